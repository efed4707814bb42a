"""Power-cut harness: cut the power under ``segnode serve`` at random moments and check that
nothing acknowledged is lost.

Run::

    .venv/bin/python -m scripts.power_harness --trials 100 [--out report.json]
    .venv/bin/python -m scripts.power_harness --postgres --trials 20 [--silent-network]

(``--postgres``: two nodes on a PostgreSQL ledger, the cuts under one; see
:mod:`scripts.power_postgres`.)

The node's whole data folder (spool, results, the SQLite ledger with its WAL) lives on the
lazy file system of :mod:`scripts.lazyfs`, which passes every write through but forgets, at a
cut, what a disk may forget at a power loss: file data written since that file's last
``fsync``/``fdatasync`` (or ``O_DSYNC`` write), and every name created, renamed or removed
since its folder's last fsync (strict mode). A power cut is SIGKILL of the node, then the
cut, then a restart on what is left.

Each trial sends a small synthetic series - over one association, or one association per
instance (as Orthanc's forwarding and many scanners do), chosen at random - and cuts at a
random moment inside a randomly chosen stage (during the C-STORE stream, between the release
and the job, while building the volume, during inference, while encoding, while sending,
after sending; the windows are measured once by a run without a cut). Then it checks:

1. right after the cut: every instance acknowledged with 0x0000 has its spool file, whole
   (it parses and holds that SOP Instance UID); the ledger passes ``PRAGMA
   integrity_check``;
2. after the restart (time to READY measured), before any resend: every acknowledged
   instance is in the ledger with that file (start-up records spool files whose row the cut
   took);
3. after the sender's resend of an interrupted series and the series settling (as
   :mod:`scripts.crash_harness` checks): one job version, ``sent``, with every instance; its
   SEG references every acknowledged instance; the destination received exactly its SEG and
   SR (a same-UID resend is counted apart; allowed only after a cut while sending); no job
   refers to a missing file; nothing stuck.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydicom import dcmread

from scripts.crash_harness import SERIES, STAGES, CrashHarness, Report, Trial, finish
from scripts.harness import SendResult, send_files
from scripts.lazyfs import LazyFS, fuse_usable
from tests.fixtures.postgres import PostgresCluster, postgres_bin
from tests.fixtures.synthetic import PhantomGeometry

MODES = ("series", "instance")
#: The same with DCMTK ``storescu`` as the modality (one process per series, or per instance).
STORESCU_MODES = ("storescu-series", "storescu-instance")
#: Set in the copy of the harness that runs in a network namespace of its own.
_NETNS = "SEGNODE_POWER_HARNESS_NETNS"


@dataclass
class PowerTrial(Trial):
    """One trial's record, with how the series was sent and the file system's losses."""

    mode: str = "series"
    ready_s: float = 0.0
    lost: list[str] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    #: Two nodes: which one held the series' work when A was cut (``A``, ``B``, ``-``:
    #: none; ``A+B``: both sending), and which one encoded the results that were sent.
    held_by: str = ""
    encoded_by: str = ""
    b_paused: bool = False
    refused_s: float = 0.0


@dataclass
class PowerReport(Report):
    """The whole run, with the send modes and what the cuts dropped."""

    ledger: str = "sqlite"
    modes: dict[str, int] = field(default_factory=dict)
    acknowledged: int = 0
    lost: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    held_by: dict[str, int] = field(default_factory=dict)
    encoded_by: dict[str, int] = field(default_factory=dict)
    b_paused: int = 0
    silent_network: bool = False
    refused: int = 0
    max_refused_s: float = 0.0

    def summary(self) -> str:
        """One paragraph for humans."""
        text = (
            super().summary()
            + f"\nledger {self.ledger}; send modes: {dict(sorted(self.modes.items()))}; "
            f"{self.acknowledged} instances acknowledged before a cut, {self.lost} lost; the "
            f"cuts dropped {dict(sorted(self.dropped.items()))}"
        )
        if self.held_by or self.encoded_by:
            text += (
                f"\nthe series' work at the cut was on {dict(sorted(self.held_by.items()))} "
                f"(- : no node); the sent results were encoded by "
                f"{dict(sorted(self.encoded_by.items()))}; B paused until A took the job "
                f"in {self.b_paused} trial(s)"
            )
        if self.silent_network:
            text += (
                f"\nsilent network (the cut drops A's packets to PostgreSQL): A's restart was "
                f"refused in {self.refused} trial(s), for up to {self.max_refused_s:.1f} s"
            )
        return text


class PowerCutHarness(CrashHarness):
    """A node whose data folder is on the lazy file system, a counting destination, and the
    trial loop of :class:`~scripts.crash_harness.CrashHarness` with power cuts for kills."""

    #: The ledger's kind, for the report.
    ledger_kind = "sqlite"
    #: Whether a cut also drops the node's packets to its database (PostgreSQL only).
    silent_network = False

    def __init__(
        self,
        workdir: Path,
        *,
        torn: bool = False,
        modes: tuple[str, ...] = MODES,
        **kwargs: Any,
    ) -> None:
        self.modes = modes
        workdir.mkdir(parents=True, exist_ok=True)
        self.fs = LazyFS(workdir / "backing", workdir / "data", torn=torn)
        self.fs.start()
        try:
            super().__init__(workdir, **kwargs)
        except BaseException:
            self.fs.stop()
            raise

    def close(self) -> None:
        """Stop the node, the destination and the file system."""
        try:
            super().close()
        finally:
            self.fs.stop()

    def _storescu(self, files: list[Path], calling: str) -> list[str]:
        """Send ``files`` with DCMTK ``storescu`` over one association, in this order; the
        SOP Instance UIDs it saw acknowledged with Success (its n-th store response answers
        its n-th request, which is the n-th file)."""
        args = ["storescu", "-v", "-aet", calling, "-aec", "SEGNODE", "-to", "3", "-ta", "3"]
        args += ["-td", "3", "127.0.0.1", str(self.node.port), *map(str, files)]
        try:
            out = subprocess.run(args, capture_output=True, text=True, timeout=60)
            text = out.stdout + out.stderr
        except subprocess.TimeoutExpired as exc:
            text = str(exc.stdout or "") + str(exc.stderr or "")
        answers = re.findall(r"Received Store Response \(([^)]*)\)", text)
        return [
            str(dcmread(f, stop_before_pixels=True).SOPInstanceUID)
            for f, answer in zip(files, answers, strict=False)
            if answer == "Success"
        ]

    def _send(self, files: list[Path], mode: str) -> SendResult:
        if mode == "series":
            return send_files(files, self.node.port, timeout=3)
        uids = [str(dcmread(f, stop_before_pixels=True).SOPInstanceUID) for f in files]
        if mode.startswith("storescu"):
            acked = []
            if mode == "storescu-series":
                acked = self._storescu(files, "STORESCU")
            else:
                for f in files:
                    one = self._storescu([f], "STORESCU1")  # another AE: it splits series
                    acked += one
                    if not one:
                        break
            whole = acked == uids
            statuses = {u: (0 if u in acked else -2) for u in uids}
            return SendResult(acked, statuses, True, whole, None if whole else "cut short")
        acked: list[str] = []
        statuses: dict[str, int] = {}
        last: SendResult | None = None
        for f in files:
            # Another AE title: the node learns per AE that this one splits series.
            last = send_files([f], self.node.port, timeout=3, calling="EACHINSTANCE")
            acked += last.acknowledged
            statuses.update(last.statuses)
            if not last.complete:
                break
        for uid in uids:
            statuses.setdefault(uid, -2)
        released = last is not None and last.complete and len(acked) == len(files)
        return SendResult(acked, statuses, True, released, None if last is None else last.error)

    def trial(self, index: int, seed: int) -> PowerTrial:
        """Run one trial (the node must be running); return its record."""
        target = self.rng.choice(self.stages)
        mode = self.rng.choice(self.modes)
        lo, hi = self.windows[target]
        if mode.endswith("instance") and target == "association":
            hi = hi * 3  # one association per instance takes longer than the calibration's one
        delay = self.rng.uniform(lo, max(lo, hi))
        t = PowerTrial(index=index, seed=seed, target=target, delay=round(delay, 3), mode=mode)
        t_start = time.monotonic()
        files = self._series(seed)
        head = dcmread(files[0], stop_before_pixels=True)
        study, series_uid = str(head.StudyInstanceUID), str(head.SeriesInstanceUID)
        self._send_starts(t, series_uid)
        killer = threading.Timer(delay, self._kill_node)
        killer.start()
        res = self._send(files, mode)
        killer.join()
        self._kill_node()  # the send may end before the timer: the cut comes after it anyway
        self._node_killed()
        t.acknowledged = len(res.acknowledged)
        t.first_send_complete = res.complete
        t.landed = self._landed(series_uid, res.complete)
        t.held_by = self._held_by(series_uid)
        pending = self.fs.stats()
        self._cut()
        t.dropped = {"files": pending["pending_files"], "names": pending["pending_names"]}
        # 1. Right after the cut: every acknowledged instance's file is there and whole.
        integrity = self.ledger.integrity()
        if integrity != "ok":
            t.violations.append(f"ledger integrity_check after the cut: {integrity}")
        self._check_rows_at_cut(t, res.acknowledged, study, series_uid)
        spool = self.node.data_dir / "spool" / study / series_uid
        for uid in res.acknowledged:
            path = spool / f"{uid}.dcm"
            try:
                if str(dcmread(path, stop_before_pixels=True).SOPInstanceUID) != uid:
                    t.violations.append(f"spool file of {uid} holds another instance")
            except FileNotFoundError:
                t.lost.append(uid)
                t.violations.append(f"acknowledged instance {uid} lost: no spool file")
            except Exception as exc:
                t.lost.append(uid)
                t.violations.append(f"acknowledged instance {uid}: spool file unreadable: {exc}")
        # 2. After the restart: each acknowledged instance has its row (re-recorded if lost).
        t.ready_s = self._restart(t)
        self.restart_times.append(t.ready_s)
        row = self.ledger.series(series_uid)
        stored = self.ledger.instances(row[0]) if row else {}
        for uid in res.acknowledged:
            if uid not in stored:
                if uid not in t.lost:
                    t.lost.append(uid)
                t.violations.append(f"acknowledged instance {uid} not in the ledger at start")
        # 3. The sender resends what was cut short; the series settles, every check as for
        # a crash, and the SEG references every acknowledged instance.
        if not res.complete:
            t.resent = True
            again = self._send(files, "series")
            if not again.complete:
                t.violations.append(f"resend after restart failed: {again.error or again}")
        self.verify_settled(t, files, study, series_uid)
        self._verify_seg(t, series_uid, res.acknowledged)
        self._check_settled(t, series_uid)
        t.seconds = round(time.monotonic() - t_start, 2)
        return t

    def _send_starts(self, t: PowerTrial, series_uid: str) -> None:
        """Just before the first send of a trial (one node: nothing to do)."""

    def _kill_node(self) -> None:
        """SIGKILL the node (the first half of a power cut)."""
        self.node.kill()

    def _restart(self, t: PowerTrial) -> float:
        """Start the node after the cut; the seconds to READY."""
        return self.node.start()

    def _node_killed(self) -> None:
        """Right after the kill, before the cut (one node: nothing to do)."""

    def _cut(self) -> None:
        """The cut of the file system (the node is dead already)."""
        self.fs.cut()

    def _held_by(self, series_uid: str) -> str:
        """Which node held the series' work at the cut (one node: nothing to tell)."""
        return ""

    def _check_rows_at_cut(
        self, t: PowerTrial, acknowledged: list[str], study: str, series_uid: str
    ) -> None:
        """Ledger checks right after the cut, beyond the integrity check (SQLite: none, its
        rows may be lost with the cut and are recorded again at start)."""

    def _check_settled(self, t: PowerTrial, series_uid: str) -> None:
        """Checks after the series settled, beyond the SEG's (one node: none)."""

    def _verify_seg(self, t: PowerTrial, series_uid: str, acknowledged: list[str]) -> None:
        """The series' sent SEG references every acknowledged instance; no job of any series
        refers to a spool file that is missing."""
        row = self.ledger.series(series_uid)
        if row is None:
            t.violations.append("series not in the ledger after settling")
            return
        sent = [j for j in self.ledger.jobs(row[0]) if j["state"] == "sent"]
        if not sent:
            return  # verify_settled said why
        paths = self.ledger._q(
            "SELECT path FROM results WHERE job_id=? AND kind='SEG'", int(sent[-1]["id"])
        )
        if not paths:
            t.violations.append("the sent job has no SEG result row")
            return
        try:
            seg = dcmread(paths[0][0])
            refs = {
                str(item.ReferencedSOPInstanceUID)
                for s in seg.ReferencedSeriesSequence
                for item in s.ReferencedInstanceSequence
            }
        except Exception as exc:
            t.violations.append(f"SEG of the sent job unreadable: {exc}")
            return
        missing = set(acknowledged) - refs
        if missing:
            t.violations.append(f"SEG misses {len(missing)} acknowledged instance(s)")
        active = self.ledger._q(
            "SELECT i.path FROM instances i JOIN jobs j ON j.series_id = i.series_id "
            "WHERE j.state IN ('queued', 'running', 'encoded')"
        )
        gone = [p for (p,) in active if not Path(p).exists()]
        if gone:
            t.violations.append(f"{len(gone)} file(s) of an active job missing")

    def run(self, trials: int, base_seed: int = 5000) -> PowerReport:
        """Calibrate (no cut), then run ``trials`` trials."""
        super().run(0, base_seed)
        # Once more, warm: the first series also paid for the model's first run.
        self.calibrate(base_seed - 1)
        self.log(
            "warm stage windows (s after send start): "
            + ", ".join(f"{k} {a:.2f}-{b:.2f}" for k, (a, b) in self.windows.items())
        )
        report = PowerReport(windows=dict(self.windows), ledger=self.ledger_kind)
        t0 = time.monotonic()
        for i in range(trials):
            t = self.trial(i, base_seed + 1 + i)
            report.details.append(t)
            nodes = (
                f"{'B paused ' if t.b_paused else ''}on {t.held_by} by {t.encoded_by or '-'} "
                if t.held_by
                else ""
            )
            self.log(
                f"trial {i:3d}: {t.mode:<8} target {t.target:<11} cut at {t.delay:5.2f}s landed "
                f"{t.landed:<11} {nodes}acked {t.acknowledged:2d} resent {t.resent!s:<5} "
                f"dups {t.duplicates} ready {t.ready_s:4.2f}s dropped {t.dropped} "
                f"{t.seconds:5.1f}s "
                + ("OK" if not t.violations else "VIOLATION: " + "; ".join(t.violations))
            )
        details: list[PowerTrial] = report.details  # type: ignore[assignment]
        report.trials = trials
        report.violations = sum(len(t.violations) for t in details)
        report.landed = dict(Counter(t.landed for t in details))
        report.modes = dict(Counter(t.mode for t in details))
        report.held_by = dict(Counter(t.held_by for t in details if t.held_by))
        report.encoded_by = dict(Counter(t.encoded_by for t in details if t.held_by))
        report.b_paused = sum(t.b_paused for t in details)
        report.silent_network = self.silent_network
        report.refused = sum(t.refused_s > 0 for t in details)
        report.max_refused_s = max((t.refused_s for t in details), default=0.0)
        report.same_uid_resends = sum(t.duplicates for t in details)
        report.acknowledged = sum(t.acknowledged for t in details)
        report.lost = sum(len(t.lost) for t in details)
        dropped: Counter[str] = Counter()
        for t in details:
            dropped.update({k: v for k, v in t.dropped.items() if isinstance(v, int)})
        report.dropped = dict(dropped)
        report.restarts = len(details)
        report.mean_restart_s = sum(t.ready_s for t in details) / len(details) if details else 0.0
        report.seconds = time.monotonic() - t0
        return report


def main(argv: list[str] | None = None) -> int:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--rows", type=int, default=64, help="rows = columns of each slice")
    p.add_argument("--slices", type=int, default=SERIES.slices)
    p.add_argument("--workdir", type=Path, help="keep the node's data here (default: temp)")
    p.add_argument("--out", type=Path, help="write the report as JSON")
    p.add_argument("--torn", action="store_true", help="torn writes: a prefix of the last one")
    p.add_argument(
        "--stages",
        default=",".join(STAGES),
        help="comma-separated stages to aim cuts at (default: all)",
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES + STORESCU_MODES),
        help="comma-separated ways to send, chosen at random per trial: series and instance "
        "(pynetdicom, one association per series or per instance), storescu-series and "
        "storescu-instance (DCMTK storescu); default: all",
    )
    p.add_argument(
        "--postgres",
        action="store_true",
        help="two nodes on a PostgreSQL ledger (fsync on, never cut); the cuts hit node A",
    )
    p.add_argument("--lease-s", type=float, default=3.0, help="[ledger] lease_s with --postgres")
    p.add_argument(
        "--silent-network",
        action="store_true",
        help="with --postgres: the cut also drops A's packets to PostgreSQL, as a power cut "
        "does (no FIN reaches the server); runs in a network namespace of its own "
        "(unshare -n, needs CAP_SYS_ADMIN and CAP_NET_ADMIN)",
    )
    args = p.parse_args(argv)
    if args.silent_network and not args.postgres:
        p.error("--silent-network needs --postgres")
    if args.silent_network and os.environ.get(_NETNS) != "1":
        # Again in a network namespace of its own, whose loopback the cuts may change.
        argv = sys.argv[1:] if argv is None else argv
        cmd = ["unshare", "-n", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
        cmd += [sys.executable, "-m", "scripts.power_harness", *argv]
        return subprocess.run(cmd, env={**os.environ, _NETNS: "1"}).returncode
    why = fuse_usable()
    if why is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    bindir = postgres_bin()
    if args.postgres and bindir is None:
        print(
            "cannot run: PostgreSQL is not installed (apt-get install postgresql)", file=sys.stderr
        )
        return 2
    stages = tuple(x for x in args.stages.split(",") if x)
    if not stages or set(stages) - set(STAGES):
        p.error(f"--stages: choose from {', '.join(STAGES)}")
    modes = tuple(x for x in args.modes.split(",") if x)
    if not modes or set(modes) - set(MODES + STORESCU_MODES):
        p.error(f"--modes: choose from {', '.join(MODES + STORESCU_MODES)}")
    if set(modes) & set(STORESCU_MODES) and shutil.which("storescu") is None:
        print("cannot run: DCMTK storescu is not installed (apt-get install dcmtk)")
        return 2
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    work = (args.workdir or Path(tempfile.mkdtemp(prefix="segnode-power-"))).resolve()
    print(f"seed {seed}; work dir {work}")
    options: dict[str, Any] = {
        "torn": args.torn,
        "geometry": PhantomGeometry(rows=args.rows, columns=args.rows, slices=args.slices),
        "rng": random.Random(seed),
        "stages": stages,
        "modes": modes,
        # Longer than a restart refused while the server keeps A's dead sessions: else B
        # completes a series cut short by the quiet period before the sender can resend.
        "quiet_period_s": 45.0 if args.silent_network else 6.0,
    }
    cluster = None
    try:
        if args.postgres:
            from scripts.power_postgres import PostgresPowerHarness

            assert bindir is not None
            cluster = PostgresCluster(bindir, fsync=True)
            print(f"PostgreSQL in {cluster.root} (fsync on)")
            h: PowerCutHarness = PostgresPowerHarness(
                work,
                url=cluster.database(),
                lease_s=args.lease_s,
                silent_network=args.silent_network,
                **options,
            )
        else:
            h = PowerCutHarness(work, **options)
        try:
            report = h.run(args.trials, base_seed=7000 + (seed % 100000) * 1000)
        finally:
            h.close()
    finally:
        if cluster is not None:
            cluster.stop()
    return finish(report, args.out, None if args.workdir else work)


if __name__ == "__main__":
    sys.exit(main())
