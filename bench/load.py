"""Load: N concurrent associations x M instances into ``segnode serve`` over loopback.

Run::

    .venv/bin/python -m bench.load                       # 8 x 200 CT slices of 512 x 512
    .venv/bin/python -m bench.load --associations 4 --instances 25 --rows 64

Each association is a DCMTK ``storescu`` process (a real modality) sending its own synthetic
series (distinct seeds, so distinct Study/Series UIDs). Reported: failures (storescu exit
codes, and instances missing from the ledger - every acknowledged instance must be there),
ingest wall time from the first association to the last release, throughput in instances/s
and MB/s, and the node's peak resident set size (VmHWM) after ingest and after the jobs that
the series started have finished (inference included), plus the time those jobs took.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from scripts.harness import LOOPBACK, NodeRunner, free_port, peak_rss_mb, write_config
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series


@dataclass
class LoadReport:
    """Figures of one load run."""

    associations: int
    instances_per_association: int
    rows: int
    bytes_sent: int
    failures: int
    missing_in_ledger: int
    ingest_s: float
    instances_per_s: float
    mb_per_s: float
    peak_rss_ingest_mb: float
    peak_rss_after_jobs_mb: float | None
    jobs_done_s: float | None
    storescu_errors: list[str]

    def summary(self) -> str:
        """One paragraph."""
        total = self.associations * self.instances_per_association
        jobs = (
            f"; jobs done {self.jobs_done_s:.1f} s after ingest, peak RSS then "
            f"{self.peak_rss_after_jobs_mb:.0f} MiB"
            if self.jobs_done_s is not None and self.peak_rss_after_jobs_mb is not None
            else ""
        )
        return (
            f"{self.associations} associations x {self.instances_per_association} instances "
            f"({self.rows}x{self.rows}): {total} instances, {self.bytes_sent / 2**20:.0f} MiB in "
            f"{self.ingest_s:.2f} s = {self.instances_per_s:.0f} instances/s, "
            f"{self.mb_per_s:.1f} MiB/s; failures {self.failures}, missing in ledger "
            f"{self.missing_in_ledger}; node peak RSS after ingest "
            f"{self.peak_rss_ingest_mb:.0f} MiB{jobs}"
        )


def storescu(port: int, folder: Path, calling: str) -> subprocess.CompletedProcess[str]:
    """One association sending every file under ``folder``."""
    exe = shutil.which("storescu")
    if exe is None:
        raise RuntimeError("storescu not installed (apt-get install dcmtk)")
    return subprocess.run(
        [exe, "-aet", calling, "-aec", "SEGNODE", "+sd", "+r", "-R", LOOPBACK, str(port),
         str(folder)],
        capture_output=True,
        text=True,
        timeout=1800,
    )  # fmt: skip


def run_load(
    workdir: Path,
    *,
    associations: int = 8,
    instances: int = 200,
    rows: int = 512,
    wait_jobs: bool = True,
    jobs_timeout: float = 1800.0,
    log: object = print,
) -> LoadReport:
    """Generate the series, start a node, send them concurrently, measure."""
    say = log if callable(log) else print
    folders = []
    for i in range(associations):
        folder = workdir / "series" / f"a{i}"
        if not folder.exists():
            write_synthetic_series(
                folder,
                PhantomGeometry(rows=rows, columns=rows, slices=instances),
                seed=70000 + i,
                patient_id=f"LOAD{i}",
            )
        folders.append(folder)
    sent_bytes = sum(f.stat().st_size for d in folders for f in d.iterdir())
    say(
        f"{associations} series of {instances} x {rows}x{rows} ready ({sent_bytes / 2**20:.0f} MiB)"
    )
    port = free_port()
    data = workdir / "data"
    shutil.rmtree(data, ignore_errors=True)
    cfg = write_config(
        workdir / "config.toml",
        data,
        port,
        node={"max_associations": max(16, associations * 2)},
        series={"quiet_period_s": 600.0},
    )
    node = NodeRunner(cfg, data, port, workdir / "node.log")
    node.start()
    try:
        assert node.pid is not None
        t0 = time.monotonic()
        with ThreadPoolExecutor(associations) as pool:
            results = list(
                pool.map(lambda a: storescu(port, folders[a], f"LOAD{a}"), range(associations))
            )
        ingest = time.monotonic() - t0
        rss_ingest = peak_rss_mb(node.pid)
        errors = [
            f"LOAD{i}: rc {r.returncode}: {(r.stdout + r.stderr).strip()[-300:]}"
            for i, r in enumerate(results)
            if r.returncode != 0 or "E:" in r.stderr
        ]
        db = sqlite3.connect(data / "ledger.sqlite", timeout=30)
        try:
            stored = int(db.execute("SELECT count(*) FROM instances").fetchone()[0])
        finally:
            db.close()
        total = associations * instances
        rss_jobs = jobs_s = None
        if wait_jobs:
            t1 = time.monotonic()
            deadline = t1 + jobs_timeout
            while time.monotonic() < deadline:
                db = sqlite3.connect(data / "ledger.sqlite", timeout=30)
                try:
                    n = db.execute(
                        "SELECT count(*) FROM jobs WHERE state IN ('done','sent','failed')"
                    ).fetchone()[0]
                finally:
                    db.close()
                if n >= associations:
                    break
                time.sleep(0.5)
            jobs_s = time.monotonic() - t1
            rss_jobs = peak_rss_mb(node.pid)
    finally:
        node.stop()
    return LoadReport(
        associations=associations,
        instances_per_association=instances,
        rows=rows,
        bytes_sent=sent_bytes,
        failures=len(errors) + (total - stored if stored < total else 0),
        missing_in_ledger=max(0, total - stored),
        ingest_s=round(ingest, 3),
        instances_per_s=round(total / ingest, 1),
        mb_per_s=round(sent_bytes / 2**20 / ingest, 2),
        peak_rss_ingest_mb=round(rss_ingest, 1),
        peak_rss_after_jobs_mb=None if rss_jobs is None else round(rss_jobs, 1),
        jobs_done_s=None if jobs_s is None else round(jobs_s, 2),
        storescu_errors=errors,
    )


def main(argv: list[str] | None = None) -> int:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--associations", type=int, default=8)
    p.add_argument("--instances", type=int, default=200)
    p.add_argument("--rows", type=int, default=512, help="rows = columns of each slice")
    p.add_argument("--no-wait-jobs", action="store_true", help="stop after ingest")
    p.add_argument("--workdir", type=Path, help="keep series and node data here")
    p.add_argument("--out", type=Path, help="write the report as JSON")
    args = p.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="segnode-load-"))
    work.mkdir(parents=True, exist_ok=True)
    report = run_load(
        work,
        associations=args.associations,
        instances=args.instances,
        rows=args.rows,
        wait_jobs=not args.no_wait_jobs,
    )
    print(report.summary())
    if args.out:
        args.out.write_text(json.dumps(asdict(report), indent=2))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if report.failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
