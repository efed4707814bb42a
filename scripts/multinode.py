"""Several ``segnode serve`` processes on one PostgreSQL ledger and one shared folder.

Two checks, each from a fresh database and fresh data folders:

* ``throughput``: N nodes (``--nodes 1 2 3``) and DCMTK ``storescu`` senders, one per
  node, that send ``--series`` small synthetic CT series in all (one association per series,
  spread evenly over the nodes); the SEG and SR of every series go to Orthanc. Reports the
  jobs per minute from the first send to the last result acknowledged, and checks that
  every series was segmented once and Orthanc holds exactly its one SEG and one SR (the
  UIDs the ledger allocated).
* ``kill``: three nodes and three senders as above, the results going to a Storage SCP that
  counts every C-STORE (a slow PACS, 200 ms per object). While the first node runs a job
  (even trials) or holds claimed deliveries (odd trials), it is killed with SIGKILL; the
  others take over its work once its lease (``--lease-s``) has run out. Checks, per trial:
  every series ends ``sent`` with one job; the distinct SOP Instance UIDs received are
  exactly the ledger's SEG and SR UIDs; the killed node's running jobs and claimed
  deliveries were finished by another node; nothing is left active. A
  resend of the same SOP Instance UID (the PACS stored it, the node died before recording
  it) is at-least-once delivery and counted apart, as in ``scripts.crash_harness``.

PostgreSQL runs as a throwaway cluster on loopback (Debian's ``postgresql``)::

    .venv/bin/python -m scripts.multinode throughput --nodes 1 2 3 --series 30
    .venv/bin/python -m scripts.multinode kill --trials 10 --series 30
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Any

from pydicom import dcmread
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from scripts.harness import CountingSCP, NodeRunner, free_port, storescu_args, write_config
from tests.fixtures.postgres import PostgresCluster, postgres_bin
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

LOOPBACK = "127.0.0.1"


@dataclass
class Series:
    """One synthetic series on disk."""

    folder: Path
    study_uid: str
    series_uid: str


def write_series(root: Path, count: int, seed: int) -> list[Series]:
    """``count`` small CT series (64x64, 12 slices), each in its own folder."""
    out = []
    for k in range(count):
        files = write_synthetic_series(
            root / f"s{k:03d}",
            PhantomGeometry(rows=64, columns=64, slices=12),
            patient_id=f"MN{k}",
            seed=seed + k,
        )
        ds = dcmread(files[0], stop_before_pixels=True)
        out.append(Series(files[0].parent, str(ds.StudyInstanceUID), str(ds.SeriesInstanceUID)))
    return out


@dataclass
class Nodes:
    """N node processes on one ledger; their data folders under one shared folder."""

    url: str
    shared: Path
    runners: list[NodeRunner] = field(default_factory=list)

    def start(
        self, count: int, destination: str, lease_s: float, model: dict[str, Any] | None = None
    ) -> None:
        """Start ``count`` nodes named ``node-1``..., all sending to ``destination``, with
        ``[model]`` settings ``model`` (the default model on ONNX Runtime when None)."""
        for i in range(1, count + 1):
            data = self.shared / f"node-{i}"
            data.mkdir(parents=True)
            port = free_port()
            config = write_config(
                self.shared / f"node-{i}.toml",
                data,
                port,
                ledger={"url": self.url, "node_name": f"node-{i}", "lease_s": lease_s},
                dispatch={
                    "destinations": [destination],
                    "retry_initial_s": 0.2,
                    "retry_max_s": 1.0,
                },
                **({"model": model} if model else {}),
            )
            runner = NodeRunner(config, data, port, self.shared / f"node-{i}.log")
            self.runners.append(runner)
        if not self.runners:
            return
        up = self.runners[0].cli("db", "upgrade")
        if up.returncode != 0:
            raise RuntimeError(f"segnode db upgrade failed: {up.stderr}")
        for runner in self.runners:
            runner.start(timeout=120)

    def stop(self) -> None:
        """SIGTERM every node still running."""
        for runner in self.runners:
            if runner.alive():
                runner.stop()


def storescu(port: int, calling: str, folder: Path) -> int:
    """DCMTK ``storescu``: one association with every file of ``folder``."""
    cmd = storescu_args(port, folder, calling=calling)
    return subprocess.run(cmd, capture_output=True, timeout=300).returncode


def send_spread(nodes: list[NodeRunner], series: list[Series]) -> list[int]:
    """One sender per node, at once; sender ``i`` sends series ``i, i + N, ...`` to node ``i``
    and, when that node does not take a series whole (it died), the whole series again to
    the next node, as a PACS router with several destinations does. Returns the exit code
    of each series' last attempt."""
    codes: list[int] = []
    lock = threading.Lock()

    def sender(i: int) -> None:
        for s in series[i :: len(nodes)]:
            for k in range(len(nodes)):
                code = storescu(nodes[(i + k) % len(nodes)].port, f"SENDER{i + 1}", s.folder)
                if code == 0:
                    break
            with lock:
                codes.append(code)

    threads = [threading.Thread(target=sender, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


def ledger_rows(url: str, sql: str, **params: Any) -> list[Any]:
    """Rows of a read-only query on the ledger."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return list(conn.execute(text(sql), params).all())
    finally:
        engine.dispose()


JOBS = (
    "SELECT j.id, s.series_instance_uid, j.state, j.owner, j.seg_sop_uid, j.sr_sop_uid, "
    "j.finished_at, j.version FROM jobs j JOIN series s ON s.id = j.series_id ORDER BY j.id"
)


def wait_settled(url: str, series: list[Series], timeout: float) -> list[Any]:
    """Wait until every series has a job and no job is active; return the jobs."""
    want = {s.series_uid for s in series}
    deadline = time.monotonic() + timeout
    while True:
        jobs = ledger_rows(url, JOBS)
        done = {j.series_instance_uid for j in jobs if j.state in ("sent", "done", "failed")}
        active = [j for j in jobs if j.state in ("queued", "running", "encoded")]
        if want <= done and not active:
            return jobs
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(want - done)} series not finished, {len(active)} job(s) active"
            )
        time.sleep(0.2)


def check_jobs(jobs: list[Any], series: list[Series]) -> list[str]:
    """Every series: exactly one job, version 1, ``sent``."""
    problems = []
    by_series = Counter(j.series_instance_uid for j in jobs)
    for s in series:
        if by_series[s.series_uid] != 1:
            problems.append(f"series {s.series_uid}: {by_series[s.series_uid]} jobs")
    problems += [f"job {j.id}: {j.state}" for j in jobs if j.state != "sent"]
    return problems


def throughput(args: argparse.Namespace, pg: PostgresCluster, root: Path) -> list[dict[str, Any]]:
    """Jobs per minute with each node count; Orthanc holds exactly one SEG and SR each."""

    runs: list[dict[str, Any]] = []
    model = None
    server = None
    if args.engine == "kserve":  # one KServe v2 server (ONNX Runtime) for every node
        from segnode.engines.manifest_parse import load_manifest
        from segnode.engines.models import default_manifest_path
        from tests.test_kserve import KServeServer

        manifest = load_manifest(default_manifest_path())
        server = KServeServer({manifest.name: manifest.onnx_path}, root / "kserve.log").start()
        model = {"engine": "kserve", "url": server.url("grpc"), "protocol": "grpc"}
    try:
        return _throughput(args, pg, root, runs, model)
    finally:
        if server is not None:
            server.stop()


def _throughput(
    args: argparse.Namespace,
    pg: PostgresCluster,
    root: Path,
    runs: list[dict[str, Any]],
    model: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    from tests.conftest import start_orthanc
    from tests.test_interop import orthanc_results

    for n in args.nodes:
        for run in range(args.runs):
            work = root / f"tp-{n}-{run}"
            series = write_series(work / "series", args.series, seed=1000 * n + 100 * run)
            orthanc = start_orthanc(work / "orthanc")
            url = (
                pg.database() if args.ledger == "postgresql" else f"sqlite:///{work}/ledger.sqlite"
            )
            nodes = Nodes(url, work / "shared")
            try:
                nodes.start(n, orthanc.peer, args.lease_s, model)
                t0 = time.monotonic()
                codes = send_spread(nodes.runners, series)
                jobs = wait_settled(nodes.url, series, timeout=600)
                elapsed = time.monotonic() - t0
                problems = check_jobs(jobs, series)
                if any(codes):
                    problems.append(f"storescu exit codes {Counter(codes)}")
                by_series = {j.series_instance_uid: j for j in jobs}
                for s in series:
                    held = orthanc_results(orthanc, s.study_uid)
                    uids = {
                        k: sorted(str(dcmread(io.BytesIO(b)).SOPInstanceUID) for b in v)
                        for k, v in held.items()
                    }
                    job = by_series.get(s.series_uid)
                    if job is None or uids != {"SEG": [job.seg_sop_uid], "SR": [job.sr_sop_uid]}:
                        problems.append(f"series {s.series_uid}: Orthanc holds {uids}")
                owners = Counter(j.owner for j in jobs)
            finally:
                nodes.stop()
                orthanc.stop()
            result = {
                "ledger": args.ledger,
                "engine": args.engine,
                "nodes": n,
                "run": run,
                "series": len(series),
                "seconds": round(elapsed, 2),
                "jobs_per_min": round(len(series) / elapsed * 60, 1),
                "jobs_by_node": dict(owners),
                "problems": problems,
            }
            print(json.dumps(result), flush=True)
            runs.append(result)
    return runs


def kill_trial(
    args: argparse.Namespace, pg: PostgresCluster, root: Path, trial: int
) -> dict[str, Any]:
    """One SIGKILL of node-1 in the middle of its work; the invariants afterwards."""
    rng = random.Random(args.seed + trial)
    work = root / f"kill-{trial}"
    series = write_series(work / "series", args.series, seed=50_000 + 1000 * trial)
    pacs = CountingSCP(delay=0.2).start()
    nodes = Nodes(pg.database(), work / "shared")
    problems: list[str] = []
    try:
        nodes.start(3, pacs.peer, args.lease_s)
        codes: list[int] = []
        senders = threading.Thread(
            target=lambda: codes.extend(send_spread(nodes.runners, series)), name="senders"
        )
        senders.start()
        # In the middle of node-1's work: odd trials while it sends (claimed deliveries),
        # even ones while it runs a job.
        running = "SELECT count(*) FROM jobs WHERE owner = 'node-1' AND state = 'running'"
        sending = (
            "SELECT count(*) FROM deliveries WHERE owner = 'node-1' AND status = 'pending' "
            "AND lease_until > now() AT TIME ZONE 'UTC'"
        )
        busy = sending if trial % 2 else running
        deadline = time.monotonic() + 120
        while not ledger_rows(nodes.url, busy)[0][0]:
            if time.monotonic() > deadline:
                raise TimeoutError("node-1 never took a job")
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.1))
        held = ledger_rows(
            nodes.url, "SELECT id FROM jobs WHERE owner = 'node-1' AND state = 'running'"
        )
        claimed = ledger_rows(
            nodes.url,
            "SELECT id FROM deliveries WHERE owner = 'node-1' AND status = 'pending' "
            "AND lease_until IS NOT NULL",
        )
        nodes.runners[0].kill()
        killed_at = time.time()
        senders.join()
        if any(codes):
            problems.append(f"series not taken by any node: storescu exit codes {Counter(codes)}")
        jobs = wait_settled(nodes.url, series, timeout=300)
        problems += check_jobs(jobs, series)
        # The killed node's running jobs were finished by another node.
        by_id = {j.id: j for j in jobs}
        took = []
        for (jid,) in held:
            j = by_id[jid]
            if j.owner == "node-1" or j.state != "sent":
                problems.append(f"job {jid} of the killed node: {j.state} on {j.owner}")
            elif j.finished_at is not None:
                took.append(j.finished_at.replace(tzinfo=UTC).timestamp() - killed_at)
        for (did,) in claimed:
            [(owner, status, sent_at)] = ledger_rows(
                nodes.url, "SELECT owner, status, sent_at FROM deliveries WHERE id = :i", i=did
            )
            if owner == "node-1" or status != "sent":
                problems.append(f"delivery {did} of the killed node: {status} by {owner}")
            elif sent_at is not None:
                took.append(sent_at.replace(tzinfo=UTC).timestamp() - killed_at)
        time.sleep(1.0)  # anything late would arrive now
        counts = pacs.counts()
        expected = {u for j in jobs for u in (j.seg_sop_uid, j.sr_sop_uid)}
        received = set(counts)
        if received != expected:
            problems.append(
                f"received {len(received)} distinct UIDs, expected {len(expected)}: "
                f"{len(received - expected)} unexpected, {len(expected - received)} missing"
            )
        resent = sum(c - 1 for c in counts.values() if c > 1)
    finally:
        nodes.stop()
        pacs.stop()
    result = {
        "trial": trial,
        "series": len(series),
        "killed_running_jobs": len(held),
        "killed_claimed_deliveries": len(claimed),
        "taken_over_finished_after_kill_s": [round(t, 2) for t in took],
        "resent_same_uid": resent,
        "problems": problems,
    }
    print(json.dumps(result), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the chosen check; exit 1 when any invariant failed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("mode", choices=("throughput", "kill"))
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--series", type=int, default=30)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--lease-s", type=float, default=3.0)
    ap.add_argument(
        "--ledger",
        choices=("postgresql", "sqlite"),
        default="postgresql",
        help="throughput: the shared PostgreSQL ledger, or one node's SQLite file (--nodes 1)",
    )
    ap.add_argument(
        "--engine",
        choices=("onnxruntime", "kserve"),
        default="onnxruntime",
        help="throughput: local ONNX Runtime, or one KServe v2 server (gRPC) for every node",
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.ledger == "sqlite" and args.nodes != [1]:
        ap.error("--ledger sqlite is one node's file: --nodes 1")
    bindir = postgres_bin()
    if bindir is None:
        raise SystemExit("PostgreSQL is not installed (apt-get install postgresql)")
    pg = PostgresCluster(bindir)
    report: dict[str, Any] = {"mode": args.mode, "args": {k: str(v) for k, v in vars(args).items()}}
    try:
        with tempfile.TemporaryDirectory(prefix="segnode-multinode-") as tmp:
            if args.mode == "throughput":
                report["runs"] = throughput(args, pg, Path(tmp))
            else:
                report["trials"] = [kill_trial(args, pg, Path(tmp), t) for t in range(args.trials)]
    finally:
        pg.stop()
    rows = report.get("runs") or report.get("trials") or []
    failed = [r for r in rows if r["problems"]]
    if args.mode == "throughput":
        for n in args.nodes:
            rates = [r["jobs_per_min"] for r in rows if r["nodes"] == n]
            median = statistics.median(rates)
            print(f"{n} node(s): median {median:.1f} jobs/min over {len(rates)} run(s)")
    else:
        takes = [t for r in rows for t in r["taken_over_finished_after_kill_s"]]
        running = sum(r["killed_running_jobs"] for r in rows)
        claimed = sum(r["killed_claimed_deliveries"] for r in rows)
        resent = sum(r["resent_same_uid"] for r in rows)
        print(
            f"{len(rows)} trial(s), {len(failed)} with violations; {running} running job(s) "
            f"and {claimed} claimed deliveries on the killed node; taken over and finished "
            f"{min(takes, default=0):.1f}-{max(takes, default=0):.1f} s after the kill "
            f"(lease {args.lease_s:g} s); same-UID resends {resent}"
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
