"""Crash-safety harness: SIGKILL ``segnode serve`` at random points and check the invariants.

Run::

    .venv/bin/python -m scripts.crash_harness --trials 50 [--out report.json]

One node (one data directory, kept across trials, as in production) sends its results to a
:class:`~scripts.harness.CountingSCP` that answers each C-STORE after a short delay (a slow
PACS, which also widens the sending window). Each trial:

1. writes a small synthetic CT series with its own seed (so its own Study/Series UIDs);
2. picks a pipeline stage at random - association, after release, volume, inference,
   encoding, sending, after sending - and a random delay inside that stage's window (the
   windows are measured once by a calibration run without a kill), and SIGKILLs the node
   then, while a pynetdicom SCU sends the series;
3. classifies where the kill really landed from the ledger (the committed stage timestamps),
   and checks at once that every instance acknowledged with 0x0000 is in the ledger and its
   spool file is intact (and the SQLite file passes ``PRAGMA integrity_check``);
4. restarts the node; if the send was cut short, sends the whole series again, as a modality
   would (duplicates are acknowledged, not stored twice);
5. waits until the series settles and checks: exactly one job version, ``sent``, with every
   instance; exactly one SEG and one SR SOP Instance UID received by the destination, equal
   to the job's; both delivery rows ``sent``; no job anywhere left active (stuck).

A resend of the *same* SOP Instance UID after a kill while sending (the destination stored
it, the node died before committing that) is at-least-once delivery, not a violation; the
report counts those separately.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydicom import dcmread

from scripts.harness import CountingSCP, NodeRunner, free_port, send_files, write_config
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

STAGES = ("association", "released", "volume", "inference", "encoding", "sending", "after")
ACTIVE = ("queued", "running", "encoded")
SERIES = PhantomGeometry(rows=96, columns=96, slices=16)


def _epoch(value: str | datetime | None) -> float | None:
    """Seconds since the epoch of a ledger timestamp (naive UTC: text from SQLite, a
    ``datetime`` from PostgreSQL)."""
    if value is None:
        return None
    when = value if isinstance(value, datetime) else datetime.fromisoformat(value)
    return when.replace(tzinfo=UTC).timestamp()


class LedgerView:
    """Read-only questions to the node's SQLite ledger (safe while the node runs: WAL)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _q(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        con = sqlite3.connect(self.path, timeout=30)
        try:
            return con.execute(sql, args).fetchall()
        finally:
            con.close()

    def integrity(self) -> str:
        """``PRAGMA integrity_check`` result."""
        return str(self._q("PRAGMA integrity_check")[0][0])

    def series(self, uid: str) -> tuple[int, str | None, int] | None:
        """``(id, pending_since, instance_count)``."""
        rows = self._q(
            "SELECT id, pending_since, instance_count FROM series WHERE series_instance_uid=?", uid
        )
        return None if not rows else (int(rows[0][0]), rows[0][1], int(rows[0][2]))

    def instances(self, series_id: int) -> dict[str, str]:
        """SOP Instance UID -> spool path."""
        return dict(
            self._q("SELECT sop_instance_uid, path FROM instances WHERE series_id=?", series_id)
        )

    def jobs(self, series_id: int) -> list[dict[str, Any]]:
        """The series' jobs, oldest first."""
        cols = [
            "id",
            "version",
            "state",
            "started_at",
            "volume_at",
            "inference_at",
            "encoded_at",
            "finished_at",
            "seg_sop_uid",
            "sr_sop_uid",
            "instance_count",
            "reason",
        ]
        rows = self._q(
            f"SELECT {', '.join(cols)} FROM jobs WHERE series_id=? ORDER BY id", series_id
        )
        return [dict(zip(cols, r, strict=True)) for r in rows]

    def deliveries(self, job_id: int) -> list[tuple[str, str, int]]:
        """``(destination, status, attempts)`` of a job."""
        return [
            (str(a), str(b), int(c))
            for a, b, c in self._q(
                "SELECT destination, status, attempts FROM deliveries WHERE job_id=?", job_id
            )
        ]

    def active_jobs(self) -> list[tuple[int, str]]:
        """Jobs not finished, anywhere."""
        marks = ",".join("?" * len(ACTIVE))
        return [
            (int(a), str(b))
            for a, b in self._q(f"SELECT id, state FROM jobs WHERE state IN ({marks})", *ACTIVE)
        ]


@dataclass
class Trial:
    """One trial's record."""

    index: int
    seed: int
    target: str
    delay: float
    landed: str = ""
    acknowledged: int = 0
    first_send_complete: bool = False
    resent: bool = False
    duplicates: int = 0
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)


@dataclass
class Report:
    """The whole run."""

    trials: int = 0
    violations: int = 0
    landed: dict[str, int] = field(default_factory=dict)
    same_uid_resends: int = 0
    restarts: int = 0
    mean_restart_s: float = 0.0
    seconds: float = 0.0
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)
    details: list[Trial] = field(default_factory=list)

    def summary(self) -> str:
        """One paragraph for humans."""
        bad = [f"trial {t.index} ({t.landed}): {v}" for t in self.details for v in t.violations]
        return (
            f"{self.trials} trials, {self.violations} violation(s), {self.restarts} restarts "
            f"(mean {self.mean_restart_s:.2f} s to READY), {self.same_uid_resends} same-UID "
            f"resend(s), {self.seconds:.0f} s\nkills landed: {dict(sorted(self.landed.items()))}"
            + ("\n" + "\n".join(bad) if bad else "")
        )


class CrashHarness:
    """A node, a counting destination and the trial loop.

    Parameters
    ----------
    workdir
        Where the node's data, config, log and the series go.
    geometry
        Matrix and slices of each synthetic series.
    scp_delay
        Seconds the destination waits before answering each C-STORE.
    quiet_period_s
        ``series.quiet_period_s``: completes a series whose release was acknowledged just
        before a kill; long enough for the resend after a restart to start first.
    rng
        Source of randomness (seeded for a reproducible run).
    ledger
        The ``[ledger]`` section (default: none, the SQLite file in the data folder). A
        subclass on another ledger replaces :attr:`ledger` with a view of it.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        geometry: PhantomGeometry = SERIES,
        scp_delay: float = 0.25,
        quiet_period_s: float = 15.0,
        staging_pool_mb: int = 8,
        rng: random.Random | None = None,
        log: Any = print,
        stages: tuple[str, ...] = STAGES,
        ledger: dict[str, Any] | None = None,
    ) -> None:
        self.workdir = workdir
        self.geometry = geometry
        self.rng = rng or random.Random()
        self.log = log
        self.stages = stages
        self.scp = CountingSCP(delay=scp_delay).start()
        port = free_port()
        data = workdir / "data"
        #: The config sections of the node (another node on the same ledger reuses them).
        self.sections: dict[str, dict[str, Any]] = {
            "node": {"staging_pool_mb": staging_pool_mb},
            "series": {"quiet_period_s": quiet_period_s},
            "dispatch": {
                "destinations": [self.scp.peer],
                "retry_initial_s": 0.2,
                "retry_max_s": 1.0,
                "breaker_failures": 5,
                "breaker_cooldown_s": 1.0,
            },
            "top": {"job_max_attempts": 5},
            **({"ledger": ledger} if ledger else {}),
        }
        cfg = write_config(workdir / "config.toml", data, port, **self.sections)
        self.node = NodeRunner(cfg, data, port, workdir / "node.log")
        self.ledger = LedgerView(data / "ledger.sqlite")
        self.restart_times: list[float] = []
        self.windows: dict[str, tuple[float, float]] = {}

    def close(self) -> None:
        """Stop the node and the destination."""
        self.node.stop()
        self.scp.stop()

    def _series(self, seed: int) -> list[Path]:
        return write_synthetic_series(
            self.workdir / "series" / str(seed), self.geometry, seed=seed, patient_id=f"CRASH{seed}"
        )

    def _settle(self, series_uid: str, timeout: float) -> str | None:
        """Wait until the series has a finished latest job and nothing pending; None if not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            row = self.ledger.series(series_uid)
            if row is not None and row[1] is None:
                jobs = self.ledger.jobs(row[0])
                if jobs and all(j["state"] not in ACTIVE for j in jobs):
                    return str(jobs[-1]["state"])
            time.sleep(0.1)
        return None

    def calibrate(self, seed: int) -> dict[str, tuple[float, float]]:
        """One run without a kill: measure each stage's window (seconds after send start)."""
        files = self._series(seed)
        t0 = time.time()
        res = send_files(files, self.node.port)
        t_rel = time.time() - t0
        if not res.complete:
            raise RuntimeError(f"calibration send failed: {res}")
        uid = str(dcmread(files[0], stop_before_pixels=True).SeriesInstanceUID)
        if self._settle(uid, 120) != "sent":
            raise RuntimeError("calibration job did not end sent; see the node log")
        row = self.ledger.series(uid)
        assert row is not None
        job = self.ledger.jobs(row[0])[-1]
        marks = [
            _epoch(job[k])
            for k in ("started_at", "volume_at", "inference_at", "encoded_at", "finished_at")
        ]
        started, vol, inf, enc, fin = (m - t0 if m is not None else t_rel for m in marks)
        self.windows = {
            "association": (0.0, t_rel),
            "released": (t_rel, max(t_rel + 0.01, started)),
            "volume": (started, vol),
            "inference": (vol, inf),
            "encoding": (inf, enc),
            "sending": (enc, fin),
            "after": (fin, fin + 0.5),
        }
        return self.windows

    def _landed(self, series_uid: str, res_complete: bool) -> str:
        row = self.ledger.series(series_uid)
        if row is None:
            return "association"
        jobs = self.ledger.jobs(row[0])
        if not jobs:
            return "released" if res_complete else "association"
        j = jobs[-1]
        if j["state"] == "sent":
            return "after"
        if j["state"] == "encoded":
            return "sending"
        if j["state"] == "queued" and j["started_at"] is None:
            return "queued"
        if j["volume_at"] is None:
            return "volume"
        if j["inference_at"] is None:
            return "inference"
        return "encoding"

    def trial(self, index: int, seed: int) -> Trial:
        """Run one trial (the node must be running); return its record."""
        target = self.rng.choice(self.stages)
        lo, hi = self.windows[target]
        delay = self.rng.uniform(lo, max(lo, hi))
        t = Trial(index=index, seed=seed, target=target, delay=round(delay, 3))
        t_start = time.monotonic()
        files = self._series(seed)
        study = str(dcmread(files[0], stop_before_pixels=True).StudyInstanceUID)
        series_uid = str(dcmread(files[0], stop_before_pixels=True).SeriesInstanceUID)
        killer = threading.Timer(delay, self.node.kill)
        killer.start()
        res = send_files(files, self.node.port, timeout=3)
        killer.join()
        t.acknowledged = len(res.acknowledged)
        t.first_send_complete = res.complete
        t.landed = self._landed(series_uid, res.complete)
        # Right after the crash: acknowledged means durable.
        integrity = self.ledger.integrity()
        if integrity != "ok":
            t.violations.append(f"ledger integrity_check: {integrity}")
        row = self.ledger.series(series_uid)
        stored = self.ledger.instances(row[0]) if row else {}
        for uid in res.acknowledged:
            path = stored.get(uid)
            if path is None:
                t.violations.append(f"acknowledged instance {uid} not in the ledger")
                continue
            try:
                if str(dcmread(path, stop_before_pixels=True).SOPInstanceUID) != uid:
                    t.violations.append(f"spool file of {uid} holds another instance")
            except Exception as exc:
                t.violations.append(f"spool file of {uid} unreadable: {exc}")
        self.restart_times.append(self.node.start())
        if not res.complete:
            t.resent = True
            again = send_files(files, self.node.port)
            if not again.complete:
                t.violations.append(f"resend after restart failed: {again.error or again}")
        self.verify_settled(t, files, study, series_uid)
        t.seconds = round(time.monotonic() - t_start, 2)
        return t

    def verify_settled(self, t: Trial, files: list[Path], study: str, series_uid: str) -> None:
        """After the restart (and resend): the series settles with one job version, sent,
        with every instance, its SEG and SR received once each (a resend only after a kill
        while sending), and no job left active anywhere."""
        state = self._settle(series_uid, 90)
        if state is None:
            t.violations.append("series did not settle within 90 s (job stuck)")
        row = self.ledger.series(series_uid)
        jobs = self.ledger.jobs(row[0]) if row else []
        live = [j for j in jobs if j["state"] not in ("superseded", "cancelled")]
        if len(live) != 1:
            t.violations.append(
                f"{len(live)} job versions for one series: {[j['state'] for j in live]}"
            )
        if live:
            job = live[-1]
            if job["state"] != "sent":
                t.violations.append(f"job ended {job['state']}: {job['reason']}")
            if job["instance_count"] != len(files):
                t.violations.append(f"job has {job['instance_count']} of {len(files)} instances")
            dels = self.ledger.deliveries(int(job["id"]))
            if len(dels) != 2 or any(s != "sent" for _, s, _ in dels):
                t.violations.append(f"delivery rows: {dels}")
            got = Counter(
                r.sop_instance_uid for r in self.scp.snapshot() if r.study_instance_uid == study
            )
            want = {job["seg_sop_uid"], job["sr_sop_uid"]}
            if set(got) != want:
                t.violations.append(
                    f"destination received {sorted(got)}, ledger says {sorted(want)}"
                )
            t.duplicates = sum(n - 1 for n in got.values())
            if t.duplicates and t.landed != "sending":
                t.violations.append(f"{t.duplicates} resend(s) without a kill while sending")
        stuck = self.ledger.active_jobs()
        if stuck:
            t.violations.append(f"active jobs after settling: {stuck}")

    def run(self, trials: int, base_seed: int = 5000) -> Report:
        """Calibrate, then run ``trials`` trials."""
        t0 = time.monotonic()
        self.restart_times.append(self.node.start())
        self.calibrate(base_seed)
        self.log(
            "stage windows (s after send start): "
            + ", ".join(f"{k} {a:.2f}-{b:.2f}" for k, (a, b) in self.windows.items())
        )
        report = Report(windows=dict(self.windows))
        for i in range(trials):
            t = self.trial(i, base_seed + 1 + i)
            report.details.append(t)
            self.log(
                f"trial {i:3d}: target {t.target:<11} kill at {t.delay:5.2f}s landed "
                f"{t.landed:<11} acked {t.acknowledged:2d} resent {t.resent!s:<5} "
                f"dups {t.duplicates} {t.seconds:5.1f}s "
                + ("OK" if not t.violations else "VIOLATION: " + "; ".join(t.violations))
            )
        report.trials = trials
        report.violations = sum(len(t.violations) for t in report.details)
        report.landed = dict(Counter(t.landed for t in report.details))
        report.same_uid_resends = sum(t.duplicates for t in report.details)
        report.restarts = len(self.restart_times) - 1
        restarts = self.restart_times[1:]
        report.mean_restart_s = sum(restarts) / len(restarts) if restarts else 0.0
        report.seconds = time.monotonic() - t0
        return report


def main(argv: list[str] | None = None) -> int:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--rows", type=int, default=SERIES.rows, help="rows = columns of each slice")
    p.add_argument("--slices", type=int, default=SERIES.slices)
    p.add_argument("--workdir", type=Path, help="keep the node's data here (default: temp)")
    p.add_argument("--out", type=Path, help="write the report as JSON")
    p.add_argument(
        "--stages",
        default=",".join(STAGES),
        help="comma-separated stages to aim kills at (default: all)",
    )
    p.add_argument(
        "--staging-pool-mb",
        type=int,
        default=192,
        help="node.staging_pool_mb (default: the node's default, 192)",
    )
    args = p.parse_args(argv)
    stages = tuple(x for x in args.stages.split(",") if x)
    if not stages or set(stages) - set(STAGES):
        p.error(f"--stages: choose from {', '.join(STAGES)}")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="segnode-crash-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"seed {seed}; work dir {work}")
    h = CrashHarness(
        work,
        geometry=PhantomGeometry(rows=args.rows, columns=args.rows, slices=args.slices),
        rng=random.Random(seed),
        stages=stages,
        staging_pool_mb=args.staging_pool_mb,
    )
    try:
        report = h.run(args.trials, base_seed=5000 + (seed % 100000) * 100)
    finally:
        h.close()
    return finish(report, args.out, None if args.workdir else work)


def finish(report: Report, out: Path | None, temporary: Path | None) -> int:
    """Print the report, write it as JSON to ``out``, remove a ``temporary`` work folder when
    nothing went wrong; the exit status (1: violations)."""
    print(report.summary())
    if out:
        out.write_text(json.dumps(asdict(report), indent=2))
    if temporary is not None and report.violations == 0:
        shutil.rmtree(temporary, ignore_errors=True)
    return 0 if report.violations == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
