"""The PostgreSQL mode of the power-cut harness: two nodes on one PostgreSQL ledger, the power
cut under one of them.

Run::

    .venv/bin/python -m scripts.power_harness --postgres --trials 20 [--silent-network]

PostgreSQL runs as a throwaway cluster with ``fsync = on`` on the real disk and is never cut.
Node A's data folder is on the lazy file system of :mod:`scripts.lazyfs`; node B's is on the
real disk. Series go to A; either node may run their jobs (one queue) and send their results,
and B takes over A's running jobs and claimed deliveries once A's lease has run out. B reads
A's spool files through the lazy file system by the paths in the ledger, as nodes read each
other's spool on the shared folder of docs/operations.md ("Several nodes on one PostgreSQL
ledger"). A power cut is SIGKILL of A, the cut (B held stopped meanwhile, with no file of
the mount open: a shared folder does not go away when one client loses power), and a
restart of A.

The checks of the SQLite mode (:class:`~scripts.power_harness.PowerCutHarness`), through
PostgreSQL, and instead of ``PRAGMA integrity_check``: right after the cut every acknowledged
instance has its row, naming its file in A's spool; after settling no job refers to an
instance or a result that is not whole on the node whose data folder holds it, each series
counts the instance rows it has, and B still runs.

``--silent-network``: a SIGKILL closes the node's connections (its kernel sends FIN), a power
cut does not, and the server keeps the dead node's sessions and their locks until TCP
keepalive probes go unanswered. The cut then first drops every packet from A's connections
to PostgreSQL (``tc`` on the loopback of a network namespace of its own), and A's restart
may be refused for a while ("a node named node-a is already running": its old session holds
the advisory lock on its name); longer than :attr:`PostgresPowerHarness.REFUSED_LIMIT_S` is
a violation.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, make_url

from scripts.crash_harness import LedgerView
from scripts.harness import NodeRunner, free_port, write_config
from scripts.power_harness import PowerCutHarness, PowerReport, PowerTrial


def _stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        if stat[stat.rindex(")") + 2] not in "Tt":
            return False
    return True


def _uses(pid: int, folder: Path) -> bool:
    """Whether ``pid`` has a file under ``folder`` open or mapped."""
    prefix = f"{folder}/"
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith(prefix):
                return True
        except OSError:
            continue
    return prefix in Path(f"/proc/{pid}/maps").read_text()


@contextlib.contextmanager
def stopped_outside(pid: int, folder: Path, tries: int = 500) -> Iterator[None]:
    """Hold process ``pid`` stopped (SIGSTOP) at a moment it has no file under ``folder``
    open or mapped; continue it (SIGCONT) at the end."""
    for _ in range(tries):
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not _stopped(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGCONT)
                raise RuntimeError(f"process {pid} does not stop")
            time.sleep(0.001)
        if not _uses(pid, folder):
            break
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.002)
    else:
        raise RuntimeError(f"process {pid} always has a file of {folder} open")
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


class SilentLink:
    """Make a dead process's TCP connections silent, as a power cut does: its kernel's FIN
    (and any later answer) never reaches the peer, whose side of each connection stays open
    until its own timeouts end it. Packets from the connections' local ports are dropped on
    the loopback device (``tc``: an HTB class whose queue holds nothing). Changes ``lo``:
    use it only in a network namespace of its own (``unshare -n``)."""

    def __init__(self) -> None:
        for cmd in (
            "qdisc add dev lo root handle 1: htb default 10",
            "class add dev lo parent 1: classid 1:10 htb rate 100gbit",
            "class add dev lo parent 1: classid 1:20 htb rate 100gbit",
            "qdisc add dev lo parent 1:20 handle 20: pfifo limit 0",
        ):
            _tc(cmd)

    @staticmethod
    def connections(pid: int, port: int) -> list[int]:
        """The local ports of ``pid``'s established TCP connections to ``port``."""
        out = subprocess.run(
            ["ss", "-tnpH", "state", "established", f"( dport = :{port} )"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [
            int(line.split()[2].rsplit(":", 1)[1])
            for line in out.splitlines()
            if f"pid={pid}," in line
        ]

    def silence(self, ports: list[int]) -> None:
        """Drop every packet sent from these local ports."""
        for port in ports:
            match = f"u32 match ip sport {port} 0xffff flowid 1:20"
            _tc(f"filter add dev lo parent 1: protocol ip prio 1 {match}")

    def clear(self) -> None:
        """Let every port speak again."""
        _tc("filter del dev lo parent 1: prio 1", check=False)

    def close(self) -> None:
        """Take the queueing rules off ``lo``."""
        _tc("qdisc del dev lo root", check=False)


def _tc(cmd: str, *, check: bool = True) -> None:
    done = subprocess.run(["tc", *cmd.split()], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"tc {cmd}: {done.stderr.strip()}")


class PostgresLedgerView(LedgerView):
    """The questions of :class:`~scripts.crash_harness.LedgerView`, asked of a PostgreSQL
    ledger (its ``?`` placeholders become psycopg's ``%s``; timestamps come back as naive
    UTC ``datetime``), and the checks that replace ``PRAGMA integrity_check`` there."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = create_engine(url, pool_size=2, pool_pre_ping=True)

    def _q(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with self.engine.connect() as conn:
            return [tuple(r) for r in conn.exec_driver_sql(sql.replace("?", "%s"), args)]

    def close(self) -> None:
        """Close the pooled connections."""
        self.engine.dispose()

    def integrity(self) -> str:
        """PostgreSQL is not cut and needs no integrity check of its pages: check instead
        that each series counts the instance rows it has."""
        rows = self._q(
            "SELECT s.series_instance_uid, s.instance_count, count(i.id) FROM series s "
            "LEFT JOIN instances i ON i.series_id = s.id "
            "GROUP BY s.id HAVING s.instance_count <> count(i.id)"
        )
        if not rows:
            return "ok"
        return "; ".join(f"series {u} counts {n} instances, has {m} rows" for u, n, m in rows)

    def missing_files(self, owners: dict[Path, str]) -> list[str]:
        """Files a job needs that are not whole where the ledger says: the instances of each
        series with a job that is not superseded, cancelled or failed (size as recorded),
        and the results of encoded and sent jobs; series purged by retention aside. Each
        problem names the node whose data folder (``owners``: folder -> name) holds it."""

        def owner(path: Path) -> str:
            return next((n for f, n in owners.items() if path.is_relative_to(f)), "no node")

        live = "('queued', 'running', 'encoded', 'sent')"
        purged = "NOT EXISTS (SELECT 1 FROM spool_purges p WHERE p.series_id = j.series_id)"
        problems = []
        for job, state, path, size in self._q(
            "SELECT DISTINCT j.id, j.state, i.path, i.size FROM jobs j "
            f"JOIN instances i ON i.series_id = j.series_id WHERE j.state IN {live} "
            f"AND {purged}"
        ):
            try:
                actual = os.stat(path).st_size
            except OSError:
                actual = None
            if actual != size:
                found = "missing" if actual is None else f"{actual} of {size} bytes"
                problems.append(
                    f"job {job} ({state}): instance file on {owner(Path(path))} {found}: {path}"
                )
        for job, state, path in self._q(
            "SELECT j.id, j.state, r.path FROM jobs j JOIN results r ON r.job_id = j.id "
            f"WHERE j.state IN ('encoded', 'sent') AND {purged}"
        ):
            if not Path(path).is_file():
                problems.append(f"job {job} ({state}): result on {owner(Path(path))} missing")
        return problems


class PostgresPowerHarness(PowerCutHarness):
    """The PostgreSQL mode: two nodes on one PostgreSQL ledger, power cuts under one.

    Node A's data folder is on the lazy file system; node B's is on the real disk (nothing
    of B is cut; a second lazy file system would only cost CPU). The database is a cluster
    with ``fsync = on`` that stays up. Series go to A; the shared queue lets either node run
    their jobs and send their results, and B takes over A's running jobs and claimed
    deliveries once A's lease (``lease_s``) has run out. B reads A's spool files through
    the lazy file system, as nodes read each other's spool on the shared folder of
    docs/operations.md ("Several nodes on one PostgreSQL ledger").

    Beyond the checks of the SQLite mode: right after each cut every acknowledged instance
    has its row, naming its file in A's spool; after settling, no job refers to an instance
    or a result that is not whole on the node that holds it, each series counts the rows it
    has, and B still runs.
    """

    ledger_kind = "postgresql"

    #: How long A's restart may be refused (its name held by its dead sessions) before that
    #: is a violation: B takes A's work over after one lease; A should be back soon after.
    REFUSED_LIMIT_S = 30.0

    def __init__(
        self,
        workdir: Path,
        *,
        url: str,
        lease_s: float = 3.0,
        silent_network: bool = False,
        **kwargs: Any,
    ) -> None:
        ledger = {"url": url, "node_name": "node-a", "lease_s": lease_s}
        self.node_b: NodeRunner | None = None
        self.silent_network = silent_network
        self.link: SilentLink | None = None
        self.pg_port = int(make_url(url).port or 5432)
        self.silenced: list[int] = []
        super().__init__(workdir, ledger=ledger, **kwargs)
        try:
            self.ledger = PostgresLedgerView(url)
            up = self.node.cli("db", "upgrade")
            if up.returncode != 0:
                raise RuntimeError(f"segnode db upgrade failed: {up.stderr[-2000:]}")
            data_b = workdir / "data-b"
            port = free_port()
            sections = {**self.sections, "ledger": {**ledger, "node_name": "node-b"}}
            config = write_config(workdir / "config-b.toml", data_b, port, **sections)
            self.node_b = NodeRunner(config, data_b, port, workdir / "node-b.log")
            if silent_network:
                self.link = SilentLink()
        except BaseException:
            self.close()
            raise
        self.names = {"node-a": "A", "node-b": "B"}
        self._killed = threading.Event()
        self._resumer: threading.Thread | None = None
        self.owners = {
            self.node.data_dir.resolve(): "A",
            self.node_b.data_dir.resolve(): "B",
        }

    def close(self) -> None:
        """Stop both nodes, the destination and the file system."""
        try:
            if self.node_b is not None:
                self.node_b.stop()
            if self.link is not None:
                self._end_dead_sessions()
                self.link.close()
            if isinstance(self.ledger, PostgresLedgerView):
                self.ledger.close()
        finally:
            super().close()

    def _kill_node(self) -> None:
        """SIGKILL A; with a silent network its connections to PostgreSQL go silent first,
        so that the server never learns that they ended."""
        pid = self.node.pid
        if self.link is not None and pid is not None:
            ports = SilentLink.connections(pid, self.pg_port)
            self.link.silence(ports)
            self.silenced += ports
        self.node.kill()

    def _end_dead_sessions(self) -> int:
        """End the server's sessions of A's silenced connections (what an operator would
        do, or PostgreSQL's TCP keepalives after hours); let their ports speak again.
        Returns how many were still there."""
        if not self.silenced or self.link is None:
            return 0
        rows = self.ledger._q(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE client_port = ANY(?)",
            self.silenced,
        )
        self.link.clear()
        self.silenced = []
        return int(rows[0][0])

    def _restart(self, t: PowerTrial) -> float:
        """Start A; while its name is still held by the sessions of its previous process
        (which the server does not know to be dead), it refuses to start: retried each
        second, a violation after :data:`REFUSED_LIMIT_S`, then those sessions are ended."""
        t0 = time.monotonic()
        while True:
            try:
                self.node.start()
                return time.monotonic() - t0
            except RuntimeError as exc:
                if "is already running on it" not in str(exc):
                    raise
            t.refused_s = round(time.monotonic() - t0, 1)
            if t.refused_s > self.REFUSED_LIMIT_S:
                left = self._end_dead_sessions()
                t.violations.append(
                    f"node A refused to start for {t.refused_s:.0f} s after the cut: 'a node "
                    f"named node-a is already running' ({left} session(s) of the dead "
                    "process still open on the server, one holding the name's advisory lock)"
                )
            time.sleep(1.0)

    def run(self, trials: int, base_seed: int = 5000) -> PowerReport:
        """Start B, then A, calibrate and run the trials."""
        assert self.node_b is not None
        self.node_b.start(timeout=120)
        return super().run(trials, base_seed)

    def _send_starts(self, t: PowerTrial, series_uid: str) -> None:
        """In half the trials (at random) B is paused (SIGSTOP) from the send until A has
        taken the series' job or is killed, so that cuts aimed at a job's stages hit a job
        running on A (B, idle, would often take it first)."""
        assert self.node_b is not None and self.node_b.pid is not None
        if self.rng.random() < 0.5:
            return
        t.b_paused = True
        pid = self.node_b.pid
        self._killed.clear()
        os.kill(pid, signal.SIGSTOP)

        def resume() -> None:
            try:
                while not self._killed.wait(0.02):
                    row = self.ledger.series(series_uid)
                    jobs = self.ledger.jobs(row[0]) if row else []
                    if jobs and jobs[-1]["started_at"] is not None:
                        return
            finally:
                os.kill(pid, signal.SIGCONT)

        self._resumer = threading.Thread(target=resume, name="resume-b", daemon=True)
        self._resumer.start()

    def _node_killed(self) -> None:
        """B runs again (if it was paused)."""
        self._killed.set()
        if self._resumer is not None:
            self._resumer.join()
            self._resumer = None

    def _cut(self) -> None:
        """The cut, atomic as B sees it: B is stopped (SIGSTOP) with no file of the mount
        open, so that it sees the lazy file system's state before the cut and after it,
        never the moment in between when the mount is down (a shared folder does not go
        away when one of its clients loses power: only that client's unsynced writes do)."""
        assert self.node_b is not None and self.node_b.pid is not None
        with stopped_outside(self.node_b.pid, self.fs.mount):
            self.fs.cut()

    def _held_by(self, series_uid: str) -> str:
        """The node running the series' job, or the nodes holding claims on its pending
        deliveries; ``-`` when none (queued, sent, or still receiving)."""
        row = self.ledger.series(series_uid)
        jobs = self.ledger.jobs(row[0]) if row else []
        if not jobs:
            return "-"
        job = jobs[-1]
        if job["state"] == "running":
            (owner,) = self.ledger._q("SELECT owner FROM jobs WHERE id=?", int(job["id"]))[0]
            return self.names.get(owner, str(owner))
        if job["state"] == "encoded":
            claims = self.ledger._q(
                "SELECT DISTINCT owner FROM deliveries WHERE job_id=? AND status='pending' "
                "AND lease_until IS NOT NULL",
                int(job["id"]),
            )
            return "+".join(sorted(self.names.get(o, str(o)) for (o,) in claims)) or "-"
        return "-"

    def _check_rows_at_cut(
        self, t: PowerTrial, acknowledged: list[str], study: str, series_uid: str
    ) -> None:
        """PostgreSQL kept every row: each acknowledged instance has one, naming its file in
        A's spool."""
        row = self.ledger.series(series_uid)
        stored = self.ledger.instances(row[0]) if row else {}
        spool = (self.node.data_dir / "spool" / study / series_uid).resolve()
        for uid in acknowledged:
            path = stored.get(uid)
            if path is None:
                t.violations.append(f"acknowledged instance {uid} has no ledger row after the cut")
            elif Path(path).resolve() != spool / f"{uid}.dcm":
                t.violations.append(f"the row of acknowledged instance {uid} names {path}")

    def _check_settled(self, t: PowerTrial, series_uid: str) -> None:
        """No job refers to a file that is not whole; B still runs; who encoded what was
        sent."""
        assert self.node_b is not None
        self._end_dead_sessions()
        t.violations += self.ledger.missing_files(self.owners)  # type: ignore[attr-defined]
        integrity = self.ledger.integrity()
        if integrity != "ok":
            t.violations.append(f"ledger after settling: {integrity}")
        if not self.node_b.alive():
            t.violations.append(f"node B died; log tail:\n{self.node_b.log()[-2000:]}")
            self.node_b.start(timeout=120)
        row = self.ledger.series(series_uid)
        sent = [j for j in self.ledger.jobs(row[0]) if j["state"] == "sent"] if row else []
        if sent:
            (owner,) = self.ledger._q("SELECT owner FROM jobs WHERE id=?", int(sent[-1]["id"]))[0]
            t.encoded_by = self.names.get(owner, str(owner))
