"""Results encoding benchmark (SEG and SR as bytes): ``python -m bench.encode`` (``make bench``).

A synthetic 512 x 512 x 128 CT is segmented once by the default tissue model on ONNX Runtime
(five labels; ``--labels phantom`` uses the phantom's noise-free five-label map instead, no
inference). Then, ``--runs`` times each, it measures

* the highdicom path the worker runs today: ``segnode.node.results.build.build_seg`` +
  ``segnode.node.pipeline.worker.encode`` (build + write), and
  ``segnode.node.results.build.verify_seg`` on the written bytes;
* the fast path: :meth:`segnode.node.results.seg_encode.SegPlan.prepare` (runs while inference
  runs),
  :meth:`~segnode.node.results.seg_encode.SegPlan.encode` and
  :func:`segnode.node.results.seg_check.check_encoded`;

* the SR: :meth:`segnode.node.results.sr_encode.SrPlan.prepare` (also while inference runs), the
  statistics (:func:`segnode.node.results.build.segment_statistics`) and
  :meth:`~segnode.node.results.sr_encode.SrPlan.encode`; and highdicom's ``build_sr`` + write as the
  baseline;

and prints the medians (wall clock and CPU time of this process; the machine may be shared,
so the CPU time is the steadier figure), the ratio of highdicom's build + write to the
fast encode, and **after the labels**: the time from the label map to SEG and SR as checked
bytes (SEG encode + check + statistics + SR encode), which the worker spends between
inference and writing the files (target <= 0.2 s on 2 CPUs). ``--out DIR`` writes
``encode.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from segnode.engines.base import create_engine
from segnode.engines.manifest import ModelManifest
from segnode.engines.manifest_parse import load_manifest
from segnode.node import __version__
from segnode.node.ingest.volume import Volume, assemble_from_datasets
from segnode.node.pipeline.worker import encode
from segnode.node.results.build import (
    Equipment,
    ResultUIDs,
    build_seg,
    build_sr,
    segment_statistics,
    verify_seg,
)
from segnode.node.results.seg_check import check_encoded
from segnode.node.results.seg_encode import SegPlan
from segnode.node.results.sr_encode import SrPlan
from tests.fixtures.synthetic import PhantomGeometry, phantom_labels, synthetic_datasets

MANIFEST = "engines/models/tissue/tissue.json"


@dataclass(frozen=True)
class Timing:
    """Median wall-clock and CPU seconds of one stage."""

    wall: float
    cpu: float


def timed(run: Callable[[], Any], runs: int) -> tuple[Timing, Any]:
    """Run ``run`` ``runs`` times; the medians and the last result."""
    walls, cpus, result = [], [], None
    for _ in range(runs):
        w, c = time.perf_counter(), time.process_time()
        result = run()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return Timing(statistics.median(walls), statistics.median(cpus)), result


def measure(
    volume: Volume,
    labels: npt.NDArray[np.uint8],
    manifest: ModelManifest,
    *,
    runs: int = 5,
    segmentation_type: str = "BINARY",
    baseline: bool = True,
) -> tuple[dict[str, Timing], dict[str, Timing]]:
    """Median timings of each SEG and SR stage, highdicom's (when ``baseline``, BINARY only)
    and the fast path's; the SR references the SEG as the worker's does (the SEG plan's
    class and UIDs).

    SEG keys: ``highdicom build+write``, ``highdicom verify_seg``, ``prepare``, ``encode``,
    ``check``. SR keys: ``highdicom build_sr+write`` (of the SEG highdicom built),
    ``prepare``, ``statistics``, ``encode``.
    """
    uids = ResultUIDs.new()
    seg_out: dict[str, Timing] = {}
    sr_out: dict[str, Timing] = {}
    if baseline and segmentation_type == "BINARY":

        def build_and_write() -> tuple[Any, bytes]:
            seg = build_seg(
                volume, labels, manifest, uids, equipment=Equipment.for_seg(__version__)
            )
            return seg, encode(seg)

        seg_out["highdicom build+write"], (seg, data) = timed(build_and_write, runs)
        seg_out["highdicom verify_seg"], _ = timed(
            lambda: verify_seg(seg, volume, labels, encoded=data), runs
        )
        sr_out["highdicom build_sr+write"], _ = timed(
            lambda: encode(
                build_sr(
                    volume, labels, manifest, seg, uids, equipment=Equipment.for_sr(__version__)
                )
            ),
            runs,
        )
    seg_out["prepare"], plan = timed(
        lambda: SegPlan.prepare(
            volume,
            manifest,
            uids,
            equipment=Equipment.for_seg(__version__),
            segmentation_type=segmentation_type,
        ),
        runs,
    )
    seg_out["encode"], encoded = timed(lambda: plan.encode(labels), runs)
    seg_out["check"], _ = timed(lambda: check_encoded(plan, encoded, labels), runs)
    print(
        f"{segmentation_type}: {encoded.number_of_frames} frames, "
        f"{len(encoded.segment_numbers)} segments, {len(encoded.data) / 1e6:.1f} MB"
    )
    sr_out["prepare"], sr_plan = timed(
        lambda: SrPlan.prepare(volume, plan, equipment=Equipment.for_sr(__version__)), runs
    )
    sr_out["statistics"], stats = timed(lambda: segment_statistics(volume, labels, manifest), runs)
    sr_out["encode"], _ = timed(lambda: sr_plan.encode(stats), runs)
    return seg_out, sr_out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--labels", choices=["tissue", "phantom"], default="tissue")
    parser.add_argument("--slices", type=int, default=128)
    parser.add_argument("--out", type=Path, help="write encode.json here")
    args = parser.parse_args(argv)

    volume = assemble_from_datasets(
        synthetic_datasets(PhantomGeometry(rows=512, columns=512, slices=args.slices))
    )
    manifest = load_manifest(MANIFEST)
    if args.labels == "tissue":
        engine = create_engine("onnxruntime")
        engine.load(manifest)
        labels = engine.segment(volume.hu)
        engine.close()
    else:
        labels = phantom_labels(512, 512, args.slices)
    print(f"512 x 512 x {args.slices} synthetic CT, {args.labels} labels, medians of {args.runs}")
    report: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPUs",
        "series": f"512x512x{args.slices}",
        "labels": args.labels,
        "runs": args.runs,
    }
    for kind in ("BINARY", "LABELMAP"):
        seg, sr = measure(volume, labels, manifest, runs=args.runs, segmentation_type=kind)
        for part, timings in (("SEG", seg), ("SR", sr)):
            for name, t in timings.items():
                print(f"  {part} {name:<24} {t.wall * 1e3:8.1f} ms wall {t.cpu * 1e3:8.1f} ms CPU")
        after = sum(t.wall for t in (seg["encode"], seg["check"], sr["statistics"], sr["encode"]))
        before = seg["prepare"].wall + sr["prepare"].wall
        entry: dict[str, Any] = {
            "seg": {k: round(v.wall * 1e3, 1) for k, v in seg.items()},
            "sr": {k: round(v.wall * 1e3, 1) for k, v in sr.items()},
            "after_labels_ms": round(after * 1e3, 1),
            "prepared_ms": round(before * 1e3, 1),
        }
        print(
            f"  {kind}: labels -> SEG and SR as checked bytes: **{after * 1e3:.1f} ms** "
            f"(target <= 200 ms); prepared while inference runs: {before * 1e3:.1f} ms"
        )
        if "highdicom build+write" in seg and "highdicom build_sr+write" in sr:
            old = (
                seg["highdicom build+write"].wall
                + seg["highdicom verify_seg"].wall
                + sr["highdicom build_sr+write"].wall
            )
            entry["highdicom_ms"] = round(old * 1e3, 1)
            entry["ratio"] = round(old / after, 1)
            print(
                f"  highdicom build+write+verify SEG and build+write SR: {old * 1e3:.1f} ms, "
                f"{old / after:.1f}x the fast path"
            )
        report[kind] = entry
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "encode.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
