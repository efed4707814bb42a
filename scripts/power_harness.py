"""Power-cut harness: cut the power under ``segnode serve`` at random moments and check that
nothing acknowledged is lost.

Run::

    .venv/bin/python -m scripts.power_harness --trials 100 [--out report.json]

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
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydicom import dcmread

from scripts.crash_harness import SERIES, STAGES, CrashHarness, Report, Trial
from scripts.harness import SendResult, send_files
from scripts.lazyfs import LazyFS, fuse_usable
from tests.fixtures.synthetic import PhantomGeometry

MODES = ("series", "instance")


@dataclass
class PowerTrial(Trial):
    """One trial's record, with how the series was sent and the file system's losses."""

    mode: str = "series"
    ready_s: float = 0.0
    lost: list[str] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)


@dataclass
class PowerReport(Report):
    """The whole run, with the send modes and what the cuts dropped."""

    modes: dict[str, int] = field(default_factory=dict)
    acknowledged: int = 0
    lost: int = 0
    dropped: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        """One paragraph for humans."""
        return (
            super().summary()
            + f"\nsend modes: {dict(sorted(self.modes.items()))}; {self.acknowledged} instances "
            f"acknowledged before a cut, {self.lost} lost; the cuts dropped "
            f"{dict(sorted(self.dropped.items()))}"
        )


class PowerCutHarness(CrashHarness):
    """A node whose data folder is on the lazy file system, a counting destination, and the
    trial loop of :class:`~scripts.crash_harness.CrashHarness` with power cuts for kills."""

    def __init__(self, workdir: Path, *, torn: bool = False, **kwargs: Any) -> None:
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

    def _send(self, files: list[Path], mode: str) -> SendResult:
        if mode == "series":
            return send_files(files, self.node.port, timeout=3)
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
        for f in files:
            statuses.setdefault(str(dcmread(f, stop_before_pixels=True).SOPInstanceUID), -2)
        released = last is not None and last.complete and len(acked) == len(files)
        return SendResult(acked, statuses, True, released, None if last is None else last.error)

    def trial(self, index: int, seed: int) -> PowerTrial:
        """Run one trial (the node must be running); return its record."""
        target = self.rng.choice(self.stages)
        mode = self.rng.choice(MODES)
        lo, hi = self.windows[target]
        if mode == "instance" and target == "association":
            hi = hi * 3  # one association per instance takes longer than the calibration's one
        delay = self.rng.uniform(lo, max(lo, hi))
        t = PowerTrial(index=index, seed=seed, target=target, delay=round(delay, 3), mode=mode)
        t_start = time.monotonic()
        files = self._series(seed)
        head = dcmread(files[0], stop_before_pixels=True)
        study, series_uid = str(head.StudyInstanceUID), str(head.SeriesInstanceUID)
        killer = threading.Timer(delay, self.node.kill)
        killer.start()
        res = self._send(files, mode)
        killer.join()
        self.node.kill()  # the send may end before the timer: the cut comes after it anyway
        t.acknowledged = len(res.acknowledged)
        t.first_send_complete = res.complete
        t.landed = self._landed(series_uid, res.complete)
        pending = self.fs.stats()
        self.fs.cut()
        t.dropped = {"files": pending["pending_files"], "names": pending["pending_names"]}
        # 1. Right after the cut: every acknowledged instance's file is there and whole.
        integrity = self.ledger.integrity()
        if integrity != "ok":
            t.violations.append(f"ledger integrity_check after the cut: {integrity}")
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
        t.ready_s = self.node.start()
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
        t.seconds = round(time.monotonic() - t_start, 2)
        return t

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
        report = PowerReport(windows=dict(self.windows))
        t0 = time.monotonic()
        for i in range(trials):
            t = self.trial(i, base_seed + 1 + i)
            report.details.append(t)
            self.log(
                f"trial {i:3d}: {t.mode:<8} target {t.target:<11} cut at {t.delay:5.2f}s landed "
                f"{t.landed:<11} acked {t.acknowledged:2d} resent {t.resent!s:<5} "
                f"dups {t.duplicates} ready {t.ready_s:4.2f}s dropped {t.dropped} "
                f"{t.seconds:5.1f}s "
                + ("OK" if not t.violations else "VIOLATION: " + "; ".join(t.violations))
            )
        details: list[PowerTrial] = report.details  # type: ignore[assignment]
        report.trials = trials
        report.violations = sum(len(t.violations) for t in details)
        report.landed = dict(Counter(t.landed for t in details))
        report.modes = dict(Counter(t.mode for t in details))
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
    args = p.parse_args(argv)
    why = fuse_usable()
    if why is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    stages = tuple(x for x in args.stages.split(",") if x)
    if not stages or set(stages) - set(STAGES):
        p.error(f"--stages: choose from {', '.join(STAGES)}")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="segnode-power-"))
    print(f"seed {seed}; work dir {work}")
    h = PowerCutHarness(
        work,
        torn=args.torn,
        geometry=PhantomGeometry(rows=args.rows, columns=args.rows, slices=args.slices),
        rng=random.Random(seed),
        stages=stages,
        quiet_period_s=6.0,
    )
    try:
        report = h.run(args.trials, base_seed=7000 + (seed % 100000) * 1000)
    finally:
        h.close()
    print(report.summary())
    if args.out:
        args.out.write_text(json.dumps(asdict(report), indent=2))
    if args.workdir is None and report.violations == 0:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if report.violations == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
