"""The SR of a result: statistics and encoding, before and after
:mod:`segnode.node.results.sr_encode`.

Run::

    .venv/bin/python -m bench.sr_encode_bench                 # 128 x 512 x 512, 5 labels
    .venv/bin/python -m bench.sr_encode_bench --slices 32 --runs 9 --json

On the synthetic phantom series (``tests.fixtures.synthetic``) with its label map (five labels), the
median wall and process CPU time of ``--runs`` runs of:

* baseline: the statistics as they were (``np.bincount`` with float64 weights), highdicom's
  Comprehensive 3D SR (what ``build_sr`` builds) and pydicom's writer
  (``segnode.node.pipeline.worker.encode``);
* ``build_sr`` + write as it is now (the new statistics inside);
* the new statistics (:func:`segnode.node.results.build.segment_statistics`), and the same fed slab
  by slab to a :class:`segnode.node.results.statistics.SegmentStatsAccumulator`;
* :meth:`segnode.node.results.sr_encode.SrPlan.prepare` (off the critical path: before the labels
  exist);
* :meth:`segnode.node.results.sr_encode.SrPlan.encode`;

and the ratio of the baseline to statistics + encode, the part that waits for the labels.
The statistics are checked against the bincount ones and the encoded bytes against
``build_sr``'s with the same clock before anything is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from pydicom.dataset import Dataset

from segnode.node.ingest.volume import Volume, assemble_from_datasets
from segnode.node.pipeline.worker import encode
from segnode.node.results.build import (
    Equipment,
    ResultUIDs,
    SegmentStatistics,
    build_seg,
    build_sr,
    segment_statistics,
    sr_of_statistics,
)
from segnode.node.results.seg_encode import SegPlan
from segnode.node.results.sr_encode import SrPlan
from segnode.node.results.statistics import SegmentStatsAccumulator
from tests.fixtures.highdicom_clock import highdicom_clock
from tests.fixtures.phantom_model import MANIFEST as RESULTS_MANIFEST
from tests.fixtures.phantom_model import PHANTOM_LABELS
from tests.fixtures.statistics import bincount_statistics
from tests.fixtures.synthetic import PhantomGeometry, phantom_labels, synthetic_datasets

#: The phantom's five labels (tests.fixtures.synthetic), as a model would describe them.
MANIFEST = dataclasses.replace(RESULTS_MANIFEST, labels=PHANTOM_LABELS)
SEG_EQUIPMENT = Equipment.for_seg("bench")
SR_EQUIPMENT = Equipment.for_sr("bench")


def _medians_ms(fn: Callable[[], object], runs: int) -> tuple[float, float]:
    """Median wall and process CPU time of ``runs`` calls (CPU time: less disturbed by other
    processes on a shared machine)."""
    wall, cpu = [], []
    for _ in range(runs):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return round(statistics.median(wall) * 1000, 2), round(statistics.median(cpu) * 1000, 2)


def run(slices: int, size: int, runs: int) -> dict[str, Any]:
    """Time each step; return the medians (ms) and the ratio."""
    volume = assemble_from_datasets(
        synthetic_datasets(PhantomGeometry(rows=size, columns=size, slices=slices))
    )
    labels = phantom_labels(size, size, slices)
    uids = ResultUIDs.new()
    seg = build_seg(volume, labels, MANIFEST, uids, equipment=SEG_EQUIPMENT)
    # The SR's SEG, prepared outside the timings: "new prepare" is the SR's alone.
    seg_plan = SegPlan.prepare(volume, MANIFEST, uids, equipment=SEG_EQUIPMENT)

    def baseline() -> bytes:
        stats = bincount_statistics(volume, labels, MANIFEST)
        return encode(sr_of_statistics(stats, volume, MANIFEST, seg, uids, SR_EQUIPMENT))

    def build_sr_now() -> bytes:
        return encode(build_sr(volume, labels, MANIFEST, seg, uids, equipment=SR_EQUIPMENT))

    def slabs() -> list[SegmentStatistics]:
        accumulator = SegmentStatsAccumulator(MANIFEST)
        for z in range(0, slices, 16):
            accumulator.add(labels[z : z + 16], volume.hu[z : z + 16])
        return accumulator.result(volume.voxel_volume_ml)

    def prepare() -> SrPlan:
        return SrPlan.prepare(volume, seg_plan, equipment=SR_EQUIPMENT)

    stats = segment_statistics(volume, labels, MANIFEST)
    if stats != bincount_statistics(volume, labels, MANIFEST) or slabs() != stats:
        raise SystemExit("the statistics differ from the bincount ones")
    plan = prepare()
    when = datetime.datetime.now()
    if plan.encode(stats, now=when) != _pinned_build_sr(volume, labels, seg, uids, when):
        raise SystemExit("the encoded SR differs from build_sr's")
    baseline_name = "baseline: bincount statistics + highdicom SR + write"
    results = {
        baseline_name: _medians_ms(baseline, runs),
        "build_sr + write (new statistics inside)": _medians_ms(build_sr_now, runs),
        "new statistics": _medians_ms(lambda: segment_statistics(volume, labels, MANIFEST), runs),
        "new statistics, 16-slice slabs": _medians_ms(slabs, runs),
        "new prepare (before the labels)": _medians_ms(prepare, runs),
        "new encode": _medians_ms(lambda: plan.encode(stats), runs),
    }
    critical = [
        a + b for a, b in zip(results["new statistics"], results["new encode"], strict=True)
    ]
    return {
        "shape": [slices, size, size],
        "labels": len(stats),
        "runs": runs,
        "median_ms [wall, cpu]": results,
        "statistics + encode ms [wall, cpu]": [round(v, 2) for v in critical],
        "ratio baseline / (statistics + encode) [wall, cpu]": [
            round(results[baseline_name][i] / critical[i], 1) for i in range(2)
        ],
        "sr_bytes": len(plan.encode(stats)),
    }


def _pinned_build_sr(
    volume: Volume,
    labels: npt.NDArray[np.integer],
    seg: Dataset,
    uids: ResultUIDs,
    when: datetime.datetime,
) -> bytes:
    """build_sr's bytes with highdicom's clock stopped at ``when``."""
    with highdicom_clock(when):
        return encode(build_sr(volume, labels, MANIFEST, seg, uids, equipment=SR_EQUIPMENT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slices", type=int, default=128)
    parser.add_argument("--size", type=int, default=512, help="rows = columns")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    report = run(args.slices, args.size, args.runs)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.slices} x {args.size} x {args.size}, {report['labels']} labels, ", end="")
    print(f"median of {args.runs} runs (ms):")
    print(f"  {'':<55} {'wall':>9} {'cpu':>9}")
    for name, (wall, cpu) in report["median_ms [wall, cpu]"].items():
        print(f"  {name:<55} {wall:9.2f} {cpu:9.2f}")
    wall, cpu = report["statistics + encode ms [wall, cpu]"]
    print(f"  {'statistics + encode':<55} {wall:9.2f} {cpu:9.2f}")
    wall, cpu = report["ratio baseline / (statistics + encode) [wall, cpu]"]
    print(f"  {'ratio baseline / (statistics + encode)':<55} {wall:8.1f}x {cpu:8.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
