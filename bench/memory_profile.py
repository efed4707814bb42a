"""Peak memory of one trained-model job, stage by stage (issue 37).

Builds a synthetic body CT (the test phantom: 512 x 512 x 300 by default, 0.8 mm pixels,
1.5 mm slices) as DICOM datasets, assembles it as the worker does, runs the model through
:func:`segnode.engines.trained.segment_trained` on ONNX Runtime and encodes the SEG
(:class:`segnode.node.results.seg_encode.SegPlan`), as the worker's job does.

A thread samples the resident set (``/proc/self/statm``) every 10 ms; the stages are marked
by wrapping the pipeline's functions (those present in the code under test), and for each
stage the script prints the largest resident set sampled while it ran, and the peak of the
NumPy allocations that ``tracemalloc`` saw (ONNX Runtime's own allocations are not traced).
The last line is the process' ``VmHWM``. Cap the address space when you run it on a shared
machine::

    prlimit --as=$((10*1024**3)) .venv/bin/python -m bench.memory_profile \\
        --manifest bench/out/standin/profile.json --out bench/out/profile.json
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import threading
import time
import tracemalloc
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

GIB = 1024.0**3
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def vm_hwm() -> int:
    """Peak resident bytes of this process (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class Stages:
    """Resident-set peaks per stage: stages follow each other, a mark ends one."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = self._last = time.perf_counter()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        tracemalloc.start()
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            now = rss()
            with self._lock:
                self._peak = max(self._peak, now)

    def mark(self, name: str) -> None:
        """End the stage ``name`` (it began at the previous mark)."""
        now = rss()
        _, traced = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        with self._lock:
            peak, self._peak = max(self._peak, now), now
        t = time.perf_counter()
        self.rows.append(
            {
                "stage": name,
                "seconds": round(t - self._last, 2),
                "peak_rss_gib": round(peak / GIB, 3),
                "end_rss_gib": round(now / GIB, 3),
                "numpy_peak_gib": round(traced / GIB, 3),
            }
        )
        self._last = t

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        tracemalloc.stop()


def wrap(stages: Stages, target: str, before: str | None, after: str | None) -> bool:
    """Mark ``before`` when ``module:attr`` is called and ``after`` when it returns; False
    when the code under test has no such function."""
    module_name, attr = target.split(":")
    module = importlib.import_module(module_name)
    owner: Any = module
    *path, leaf = attr.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return False
    original = getattr(owner, leaf, None)
    if original is None:
        return False

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            stages.mark(before)
        result = original(*args, **kwargs)
        if after:
            stages.mark(after)
        return result

    setattr(owner, leaf, wrapped)
    return True


def wrap_predictor(stages: Stages, target: str) -> bool:
    """Mark the image predictor that ``module:attr`` returns: preprocessing ends when it is
    called, the sliding window when it returns."""
    module_name, attr = target.split(":")
    module = importlib.import_module(module_name)
    original: Callable[..., Any] | None = getattr(module, attr, None)
    if original is None:
        return False

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return _Marked(stages, original(*args, **kwargs))

    setattr(module, attr, wrapped)
    return True


class _Marked:
    """An image predictor whose calls mark the stages; keeps ``slabs`` where it has them."""

    def __init__(self, stages: Stages, predict: Any) -> None:
        self._stages, self._predict = stages, predict
        if hasattr(predict, "slabs"):
            self.slabs = self._slabs

    def __call__(self, image: Any) -> Any:
        self._stages.mark("preprocess (reorient, crop, normalise, resample in)")
        out = self._predict(image)
        self._stages.mark("sliding window (ORT, blend)")
        return out

    def _slabs(self, image: Any) -> Any:
        self._stages.mark("preprocess (reorient, crop, normalise, resample in)")
        yield from self._predict.slabs(image)
        self._stages.mark("sliding window (ORT, blend), streamed into the export")


def reset_peak() -> None:
    """Start ``VmHWM`` again from the current resident set (Linux ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", type=Path, required=True)
    ap.add_argument("--shape", type=int, nargs=3, default=(300, 512, 512), help="z y x")
    ap.add_argument("--pixel", type=float, default=0.8)
    ap.add_argument("--slice", type=float, default=1.5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-encode", action="store_true")
    ap.add_argument("--labels-out", type=Path, help="save the label map (.npy)")
    ap.add_argument("--out", type=Path, help="write the stages as JSON")
    args = ap.parse_args(argv)

    from segnode.engines.base import create_engine  # noqa: PLC0415
    from segnode.engines.manifest_parse import load_manifest  # noqa: PLC0415
    from segnode.engines.preprocess.orientation import Geometry  # noqa: PLC0415
    from segnode.engines.trained import segment_trained  # noqa: PLC0415
    from segnode.node import __version__  # noqa: PLC0415
    from segnode.node.ingest.volume import assemble_from_datasets  # noqa: PLC0415
    from segnode.node.results.build import Equipment, ResultUIDs  # noqa: PLC0415
    from segnode.node.results.seg_encode import SegPlan  # noqa: PLC0415
    from tests.fixtures.synthetic import PhantomGeometry, synthetic_datasets  # noqa: PLC0415

    stages = Stages()
    z, y, x = args.shape
    geometry = PhantomGeometry(
        rows=y, columns=x, slices=z, pixel_spacing=args.pixel, slice_spacing=args.slice
    )
    datasets = synthetic_datasets(geometry)
    volume = assemble_from_datasets(datasets)
    del datasets
    manifest = load_manifest(args.manifest)
    engine: Any = create_engine("onnxruntime", threads=args.threads)
    engine.load(manifest)
    stages.mark("volume assembled, engine loaded")
    assembly_hwm = vm_hwm()
    reset_peak()  # the job's peak from here (the node assembles while the series arrives)
    wrap_predictor(stages, "segnode.engines.trained:predict_for_manifest")
    wrap(
        stages,
        "segnode.engines.preprocess.pipeline:_labels_on_source",
        None,
        "resample back, argmax",
    )
    started = time.perf_counter()
    labels = segment_trained(engine, manifest, volume.hu, Geometry.from_volume(volume))
    stages.mark("labels on the source grid (paste, reorient)")
    inference_s = time.perf_counter() - started
    if not args.no_encode:
        plan = SegPlan.prepare(
            volume,
            manifest,
            ResultUIDs.new(),
            segmentation_type="BINARY",
            equipment=Equipment.for_seg(__version__),
            created=datetime.now(),
        )
        seg = plan.encode(labels)
        stages.mark(f"SEG encode ({len(seg.data) / 1e6:.0f} MB)")
    if args.labels_out is not None:
        np.save(args.labels_out, labels)
    stages.close()
    hwm = vm_hwm()
    found = np.bincount(labels.ravel(), minlength=2)
    result = {
        "manifest": str(args.manifest),
        "shape": list(args.shape),
        "inference_s": round(inference_s, 1),
        "labels_present": int(np.count_nonzero(found)),
        "vm_hwm_gib": round(hwm / GIB, 3),
        "assembly_vm_hwm_gib": round(assembly_hwm / GIB, 3),
        "stages": stages.rows,
    }
    for row in stages.rows:
        print(
            f"{row['stage']:<52} {row['seconds']:>7.1f} s  peak RSS {row['peak_rss_gib']:6.2f} GiB"
            f"  end {row['end_rss_gib']:6.2f}  NumPy peak {row['numpy_peak_gib']:6.2f}"
        )
    print(
        f"inference {inference_s:.1f} s, {result['labels_present']} labels present, "
        f"VmHWM {hwm / GIB:.2f} GiB from the volume on ({assembly_hwm / GIB:.2f} GiB building it)"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
