"""The ``total`` task's shape on a GPU, engine alone: where the time and the memory go.

Builds the five full-size stand-in parts of :mod:`bench.totalseg_standin` (``--task
total``: nnU-Net's default 1.5 mm network, 31.2 M parameters each, random weights, the parts'
true label counts) unless ``--model`` names a composite manifest, loads them in the torch
engine, and on a synthetic 512 x 512 x ``--slices`` CT (0.7 mm pixels, 1.25 mm slices, as
``bench.gpu_e2e`` sends) reports, per engine variant:

* ``segment_trained`` wall time (median of ``--runs`` after one warm-up) and the GPU memory
  torch allocated and reserved at its peak;
* the network alone: tiles of 128^3 per second at the engine's batch, and what the
  sliding window's tile count at that spacing costs, so that the rest (resampling, export,
  merge, copies) is the difference.

Random weights: the label map is noise and its size says nothing; only speed and memory
count here (the parity with TotalSegmentator uses the phantom-trained stand-ins).

Run (CUDA machine with torch and onnx2torch)::

    python -m bench.total_gpu --out bench/out --slices 300 --variants eager compile
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def volume(slices: int, seed: int = 0) -> tuple[np.ndarray, Any]:
    """HU volume and geometry of the synthetic series ``bench.gpu_e2e`` sends."""
    from segnode.engines.preprocess.orientation import Geometry
    from tests.fixtures.synthetic import phantom_hu

    hu = phantom_hu(512, 512, slices, seed=seed).astype(np.float32)
    geometry = Geometry.from_image_plane(
        (1.0, 0.0, 0.0),
        (0.0, 1.0, 0.0),
        [(0.0, 0.0, 1.25 * k) for k in range(slices)],
        (0.7, 0.7),
    )
    return hu, geometry


def tiles(shape: tuple[int, ...], patch: tuple[int, ...], step: float) -> int:
    """nnU-Net's tile count for a ``shape`` volume."""
    n = 1
    for size, p in zip(shape, patch, strict=True):
        n *= 1 if size <= p else math.ceil((size - p) / (p * step)) + 1
    return n


class _Warnings(logging.Handler):
    """The engine's out-of-memory retries (``segnode.engines.trained`` warnings)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _segment_timed(engine: Any, manifest: Any, hu: Any, geometry: Any, args: Any) -> Any:
    import torch

    from segnode.engines.trained import segment_trained

    torch.cuda.synchronize()
    t = time.perf_counter()
    labels = segment_trained(engine, manifest, hu, geometry, precise=not args.float32)
    torch.cuda.synchronize()
    return labels, time.perf_counter() - t


def run_variant(name: str, manifest_path: Path, args: Any) -> list[dict[str, Any]]:
    """One row per ``--slices`` value (the engine loaded once), then one per
    ``--gpu-limit`` on the last of them: the GPU capped at that many GiB
    (``[engine] gpu_memory_limit``), the time, what the engine tried after running out of
    memory, and how many voxels equal the uncapped labels."""
    import torch

    from segnode.engines.manifest_parse import load_manifest
    from segnode.engines.torch_backend import TorchEngine

    manifest = load_manifest(manifest_path)
    options: dict[str, Any] = {"precision": args.precision}
    if name == "compile":
        options["compile"] = True
    if name == "graphs":
        options["cuda_graphs"] = True
    if args.batch:
        options["batch_size"] = args.batch
    engine = TorchEngine(**options)
    t0 = time.perf_counter()
    engine.load(manifest)
    if hasattr(engine, "wait_compiled"):
        engine.wait_compiled()
    load_s = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    labels: Any = None
    for slices in args.slices:
        hu, geometry = volume(slices)
        times = []
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        for i in range(args.runs + 1):
            labels, seconds = _segment_timed(engine, manifest, hu, geometry, args)
            if i:
                times.append(seconds)
            print(f"[total-gpu] {name} {slices} slices run {i}: {seconds:.3f} s", flush=True)
        rows.append(
            {
                "variant": name,
                "slices": slices,
                "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                "load_s": round(load_s, 2),
                "segment_s": round(statistics.median(times), 3),
                "runs_s": [round(t, 3) for t in times],
                "labels_present": int(np.unique(labels).size),
                "gpu_peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "gpu_peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
                "batch": engine.window_batch(),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    reference = labels
    for limit in args.gpu_limit:
        watch = _Warnings()
        logging.getLogger("segnode.engines.trained").addHandler(watch)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit * 2**30 / total))
        torch.cuda.reset_peak_memory_stats()
        row: dict[str, Any] = {"variant": name, "slices": args.slices[-1], "gpu_limit_gib": limit}
        try:
            capped, seconds = _segment_timed(engine, manifest, hu, geometry, args)
            row.update(
                segment_s=round(seconds, 3),
                voxels_equal=round(float(np.mean(capped == reference)), 5),
                gpu_peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
            )
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"  # every rung's reason
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
            logging.getLogger("segnode.engines.trained").removeHandler(watch)
        row["retries"] = watch.messages
        rows.append(row)
        print(json.dumps(row), flush=True)
    # the network alone
    part = manifest.parts[0].manifest if manifest.parts else manifest
    patch = part.patch_size
    batch = engine.window_batch()
    predict = engine.fold_predictors()[0]
    x = torch.randn((batch, 1, *patch), device="cuda")
    with torch.inference_mode():
        for _ in range(3):
            predict(x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        reps = 10
        for _ in range(reps):
            predict(x)
        torch.cuda.synchronize()
    per_tile = (time.perf_counter() - t) / (reps * batch)
    # the floor: one tile at a time (the ladder's last batch), weights and activations
    del x
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    one = torch.randn((1, 1, *patch), device="cuda")
    with torch.inference_mode():
        predict(one)
        torch.cuda.synchronize()
    floor = {
        "weights_and_cache_gib": round(base / 2**30, 3),
        "one_tile_peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
    }
    print(json.dumps({"floor": floor}), flush=True)
    for row in rows:
        if "gpu_limit_gib" in row:
            continue
        hu_shape = (row["slices"], 512, 512)
        model_shape = tuple(
            round(n * s / 1.5) for n, s in zip(hu_shape, (1.25, 0.7, 0.7), strict=True)
        )
        n_tiles = tiles(model_shape, patch, 1 - part.overlap) * max(1, len(manifest.parts))
        row.update(
            tile_ms=round(per_tile * 1000, 2), tiles=n_tiles, network_s=round(per_tile * n_tiles, 3)
        )
    engine.close()
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    p = argparse.ArgumentParser(
        prog="python -m bench.total_gpu", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--model", type=Path, default=None, help="a composite manifest")
    p.add_argument("--work", type=Path, default=Path("/tmp/total-standin"))
    p.add_argument("--slices", type=int, nargs="+", default=[300])
    p.add_argument(
        "--gpu-limit",
        type=float,
        nargs="*",
        default=[],
        help="GiB: then run the last --slices with the GPU capped there (the ladder)",
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--precision", default="fp16")
    p.add_argument("--float32", action="store_true", help="resample in float32")
    p.add_argument("--variants", nargs="+", default=["eager"], help="eager, compile, graphs")
    args = p.parse_args(argv)
    manifest = args.model
    if manifest is None:
        from bench.totalseg_standin import write_total

        manifest = args.work / "total.json"
        if not manifest.exists():
            write_total(args.work)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    for name in args.variants:
        try:
            rows.extend(run_variant(name, manifest, args))
        except Exception as exc:  # one variant failing must not lose the others
            rows.append({"variant": name, "error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "_".join(map(str, args.slices))
    (args.out / f"total_gpu_{stem}.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
