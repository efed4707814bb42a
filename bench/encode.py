"""SEG encoding benchmark: ``python -m bench.encode``.

A synthetic 512 x 512 x 128 CT is segmented once by the default tissue model on ONNX Runtime
(five labels; ``--labels phantom`` uses the phantom's noise-free five-label map instead, no
inference). Then, ``--runs`` times each, it measures

* the highdicom path the worker runs today: ``node.results.build_seg`` + ``node.worker.encode``
  (build + write), and ``node.results.verify_seg`` on the written bytes;
* the fast path: :meth:`node.seg_encode.SegPlan.prepare` (runs while inference runs),
  :meth:`~node.seg_encode.SegPlan.encode` and :func:`node.seg_check.check_encoded`;

and prints the medians (wall clock and CPU time of this process; the machine may be shared,
so the CPU time is the steadier figure) and the ratio of highdicom's build + write to the
fast encode. :func:`measure_seg` is the SEG part; an SR part can be measured beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.base import create_engine
from engines.manifest import ModelManifest, load_manifest
from node import __version__
from node.results import ResultUIDs, build_seg, verify_seg
from node.seg_check import check_encoded
from node.seg_encode import SegPlan
from node.synthetic import phantom_labels, synthetic_datasets
from node.volume import Volume, assemble_from_datasets
from node.worker import encode

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


def measure_seg(
    volume: Volume,
    labels: npt.NDArray[np.uint8],
    manifest: ModelManifest,
    *,
    runs: int = 5,
    segmentation_type: str = "BINARY",
    baseline: bool = True,
) -> dict[str, Timing]:
    """Median timings of each SEG stage, highdicom's (when ``baseline``) and the fast path's.

    Keys: ``highdicom build+write``, ``highdicom verify_seg`` (BINARY only), ``prepare``,
    ``encode``, ``check``.
    """
    uids = ResultUIDs.new()
    out: dict[str, Timing] = {}
    if baseline and segmentation_type == "BINARY":

        def build_and_write() -> tuple[Any, bytes]:
            seg = build_seg(volume, labels, manifest, uids, software_version=__version__)
            return seg, encode(seg)

        out["highdicom build+write"], (seg, data) = timed(build_and_write, runs)
        out["highdicom verify_seg"], _ = timed(
            lambda: verify_seg(seg, volume, labels, encoded=data), runs
        )
    out["prepare"], plan = timed(
        lambda: SegPlan.prepare(
            volume,
            manifest,
            uids,
            software_version=__version__,
            segmentation_type=segmentation_type,
        ),
        runs,
    )
    out["encode"], encoded = timed(lambda: plan.encode(labels), runs)
    out["check"], _ = timed(lambda: check_encoded(plan, encoded, labels), runs)
    print(
        f"{segmentation_type}: {encoded.number_of_frames} frames, "
        f"{len(encoded.segment_numbers)} segments, {len(encoded.data) / 1e6:.1f} MB"
    )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--labels", choices=["tissue", "phantom"], default="tissue")
    parser.add_argument("--slices", type=int, default=128)
    args = parser.parse_args(argv)

    volume = assemble_from_datasets(synthetic_datasets(rows=512, columns=512, slices=args.slices))
    manifest = load_manifest(MANIFEST)
    if args.labels == "tissue":
        engine = create_engine("onnxruntime")
        engine.load(manifest)
        labels = engine.segment(volume.hu)
        engine.close()
    else:
        labels = phantom_labels(512, 512, args.slices)
    print(f"512 x 512 x {args.slices} synthetic CT, {args.labels} labels, medians of {args.runs}")
    for kind in ("BINARY", "LABELMAP"):
        timings = measure_seg(volume, labels, manifest, runs=args.runs, segmentation_type=kind)
        for name, t in timings.items():
            print(f"  {name:<24} {t.wall * 1e3:8.1f} ms wall {t.cpu * 1e3:8.1f} ms CPU")
        if "highdicom build+write" in timings:
            base, fast = timings["highdicom build+write"], timings["encode"]
            print(
                f"  ratio build+write / encode: {base.wall / fast.wall:.1f}x wall, "
                f"{base.cpu / fast.cpu:.1f}x CPU"
            )
            old = base.wall + timings["highdicom verify_seg"].wall
            new = fast.wall + timings["check"].wall
            print(f"  ratio (build+write+verify) / (encode+check): {old / new:.1f}x wall")


if __name__ == "__main__":
    main()
