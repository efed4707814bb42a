"""GPU benchmark: patch throughput and full-volume latency per backend, plus agreement checks.

Run on a machine with a CUDA GPU (PyTorch, CuPy, onnx2torch, nvidia-ml-py installed)::

    python -m bench.gpu_bench --out bench/out            # make bench-gpu

It generates the nnU-Net-style U-Net of :mod:`bench.unet` (unless ``--unet`` names one), a
synthetic 128x512x512 CT, and measures, in one process and on one GPU:

* ONNX Runtime on the CPU (patch time measured on ``--ort-patches`` patches; its full-volume
  time is *extrapolated* from that, and marked so),
* PyTorch eager FP32 (true FP32: TF32 off) -- the baseline every ratio refers to,
* PyTorch eager TF32, eager FP16 (NCDHW and channels-last), FP16 + CUDA graphs, FP16 +
  ``torch.compile`` (channels-last and NCDHW; ``--max-autotune`` adds the slow autotuned mode),
* TensorRT, when :class:`segnode.engines.trt_backend.TensorRTEngine` can run here (else the reason).

For each: patches/s at the manifest's optimal batch, full-volume latency (median of
``--repeats`` after one warm-up, host array in, uint8 label map out), achieved TFLOP/s against
the measured matrix-multiply rate of the same precision (roofline), GPU utilisation sampled
through NVML during the full-volume runs, the time spent outside the network (upload,
preprocessing, blending, download), and peak GPU memory. Agreement: FP16 vs FP32 argmax
on the U-Net (every voxel of the full volume) and, when the bundled tissue model exists,
TorchEngine (GPU) vs OrtEngine (CPU) label maps. Output: ``bench.json`` and ``bench.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import os
import platform
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.unet import FULL, write_unet

ROOT = Path(__file__).resolve().parent.parent
TISSUE = ROOT / "engines" / "models" / "tissue" / "tissue.json"


# --------------------------------------------------------------------------- inputs


def synthetic_ct(shape: tuple[int, int, int], seed: int = 0) -> npt.NDArray[np.float32]:
    """A CT-like HU volume: air, an elliptic body of soft tissue and fat, lungs, a spine, noise."""
    rng = np.random.default_rng(seed)
    z, y, x = (np.linspace(-1, 1, n, dtype=np.float32) for n in shape)
    zz, yy, xx = np.meshgrid(z, y, x, indexing="ij", sparse=True)
    vol = np.full(shape, -1000.0, dtype=np.float32)
    body = (yy / 0.75) ** 2 + (xx / 0.9) ** 2 <= 1.0
    vol = np.where(body, 40.0, vol)
    fat = body & ((yy / 0.75) ** 2 + (xx / 0.9) ** 2 > 0.8)
    vol = np.where(fat, -100.0, vol)
    for cx in (-0.4, 0.4):
        lung = ((yy + 0.05) / 0.4) ** 2 + ((xx - cx) / 0.28) ** 2 + (zz / 1.2) ** 2 <= 1.0
        vol = np.where(lung, -850.0, vol)
    spine = ((yy - 0.5) / 0.12) ** 2 + (xx / 0.12) ** 2 <= 1.0
    vol = np.where(np.broadcast_to(spine, shape), 700.0, vol)
    vol += rng.normal(0.0, 20.0, size=shape).astype(np.float32)
    return np.ascontiguousarray(vol, dtype=np.float32)


def n_patches(shape: tuple[int, ...], patch: tuple[int, ...], overlap: float) -> int:
    """Patches a sliding window with ``overlap`` visits (step = patch * (1 - overlap))."""
    total = 1
    for size, p in zip(shape, patch, strict=True):
        step = max(1, int(p * (1.0 - overlap)))
        total *= 1 if size <= p else math.ceil((size - p) / step) + 1
    return total


# --------------------------------------------------------------------------- GPU probes


class UtilSampler:
    """Samples GPU utilisation (NVML, else nvidia-smi) in a thread while a block runs."""

    def __init__(self, device: int = 0, interval: float = 0.05) -> None:
        self.device, self.interval = device, interval
        self.samples: list[float] = []
        self.source = "none"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> UtilSampler:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.device)

            def read() -> float:
                return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)

            read()
            self.source = "nvml"
        except Exception:
            import subprocess

            def read() -> float:
                out = subprocess.run(
                    [
                        "nvidia-smi",
                        "-i",
                        str(self.device),
                        "--query-gpu=utilization.gpu",
                        "--format=csv,noheader,nounits",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=5,
                    check=True,
                )
                return float(out.stdout.strip().splitlines()[0])

            try:
                read()
                self.source = "nvidia-smi"
            except Exception:
                return self

        def loop() -> None:
            while not self._stop.is_set():
                with contextlib.suppress(Exception):
                    self.samples.append(read())
                self._stop.wait(self.interval)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        """Mean and max utilisation in percent and the sample count."""
        if not self.samples:
            return {"source": self.source, "n": 0}
        return {
            "source": self.source,
            "n": len(self.samples),
            "mean_pct": round(statistics.fmean(self.samples), 1),
            "max_pct": max(self.samples),
        }


def matmul_tflops(torch: Any, dtype: Any, *, tf32: bool = False, n: int = 8192) -> float:
    """Measured dense matrix-multiply rate (TFLOP/s) for ``dtype``; the roofline ceiling."""
    b = torch.backends.cuda.matmul
    saved = b.allow_tf32
    b.allow_tf32 = tf32
    try:
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        c = torch.randn(n, n, device="cuda", dtype=dtype)
        for _ in range(3):
            a @ c
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 10
        start.record()
        for _ in range(reps):
            a @ c
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000 / reps
    finally:
        b.allow_tf32 = saved
    return float(2 * n**3 / seconds / 1e12)


def transfer_times(torch: Any, volume: npt.NDArray[np.float32]) -> dict[str, float]:
    """Host-device copies a full-volume run makes: the HU volume up, the label map down."""
    labels = torch.zeros(volume.shape, dtype=torch.uint8, device="cuda")
    result = {}
    copies: list[tuple[str, Callable[[], Any]]] = [
        ("h2d_volume_pageable", lambda: torch.from_numpy(volume).to("cuda")),
        ("d2h_labels_uint8", lambda: labels.cpu()),
    ]
    for label, fn in copies:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        result[label] = round(1000 * (time.perf_counter() - t0), 2)
    return result


def time_patches(torch: Any, predict: Callable[[Any], Any], x: Any, iters: int) -> float:
    """Seconds per call of ``predict(x)`` on the GPU (after two warm-up calls)."""
    for _ in range(2):
        predict(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        predict(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


# --------------------------------------------------------------------------- runs


def _row(name: str, **fields: Any) -> dict[str, Any]:
    return {"backend": name, **fields}


TORCH_VARIANTS: list[tuple[str, dict[str, Any], str]] = [
    # (row name, TorchEngine options, roofline ceiling)
    ("torch eager fp32", {"precision": "fp32", "channels_last": False}, "fp32"),
    ("torch eager tf32", {"precision": "fp32", "tf32": True, "channels_last": False}, "tf32"),
    ("torch fp16 (NCDHW)", {"precision": "fp16", "channels_last": False}, "fp16"),
    ("torch fp16 (channels-last)", {"precision": "fp16", "channels_last": True}, "fp16"),
    (
        "torch fp16 + CUDA graphs (NCDHW)",
        {"precision": "fp16", "cuda_graphs": True, "channels_last": False},
        "fp16",
    ),
]
COMPILED: list[tuple[str, dict[str, Any], str]] = [
    (
        "torch fp16 + compile (channels-last)",
        {"precision": "fp16", "compile": True, "channels_last": True},
        "fp16",
    ),
    (
        "torch fp16 + compile (NCDHW)",
        {"precision": "fp16", "compile": True, "channels_last": False},
        "fp16",
    ),
    (
        "torch fp16 + compile max-autotune (NCDHW)",
        {
            "precision": "fp16",
            "compile": True,
            "channels_last": False,
            "compile_mode": "max-autotune-no-cudagraphs",
        },
        "fp16",
    ),
]


def bench_torch_variants(
    torch: Any,
    manifest: Any,
    volume: npt.NDArray[np.float32],
    args: argparse.Namespace,
    peaks: dict[str, float],
    flops: int,
    labels: dict[str, npt.NDArray[np.uint8]],
    variants: list[tuple[str, dict[str, Any], str]],
) -> list[dict[str, Any]]:
    """Measure each PyTorch configuration; keep each label map in ``labels``."""
    from segnode.engines.torch_backend import TorchEngine

    batch = max(1, manifest.batch_opt)
    patches = n_patches(volume.shape, manifest.patch_size, manifest.overlap)
    rows = []
    for name, options, peak_key in variants:
        print(f"[bench] {name} ...", flush=True)
        engine = TorchEngine(batch_size=batch, **options)
        try:
            engine.load(manifest)
            x = torch.randn((batch, 1, *manifest.patch_size), device="cuda")
            per_call = time_patches(torch, engine.predict, x, args.iters)
            engine.segment(volume)  # warm-up at full-volume shapes
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            times = []
            with UtilSampler() as util:
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    out = engine.segment(volume)
                    times.append(time.perf_counter() - t0)
            labels[name] = out
            pps = batch / per_call
            rows.append(
                _row(
                    name,
                    precision=peak_key,
                    load_s=round(engine.load_seconds, 2),
                    patches_per_s=round(pps, 2),
                    ms_per_patch=round(1000 / pps, 2),
                    volume_s=round(statistics.median(times), 3),
                    outside_network_s=round(statistics.median(times) - patches / pps, 3),
                    volume_times_s=[round(t, 3) for t in times],
                    tflops=round(flops * pps / 1e12, 1),
                    roofline_pct=round(100 * flops * pps / 1e12 / peaks[peak_key], 1),
                    gpu_util=util.summary(),
                    peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                )
            )
        except Exception as exc:  # one failing variant must not lose the others' figures
            rows.append(_row(name, error=f"{type(exc).__name__}: {exc}"))
        finally:
            engine.close()
        print(f"[bench]   {rows[-1]}", flush=True)
    return rows


def bench_ort(
    manifest: Any, volume_patches: int, args: argparse.Namespace, flops: int
) -> dict[str, Any]:
    """ONNX Runtime CPU: time ``--ort-patches`` single patches; extrapolate the volume."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = os.cpu_count() or 1
    session = ort.InferenceSession(
        str(manifest.onnx_path), opts, providers=["CPUExecutionProvider"]
    )
    x = np.random.default_rng(0).standard_normal((1, 1, *manifest.patch_size), dtype=np.float32)
    times = []
    for _ in range(max(1, args.ort_patches)):
        t0 = time.perf_counter()
        session.run(None, {manifest.input_name: x})
        times.append(time.perf_counter() - t0)
    per_patch = min(times)
    return _row(
        "onnxruntime cpu",
        precision="fp32",
        threads=opts.intra_op_num_threads,
        patches_per_s=round(1 / per_patch, 3),
        ms_per_patch=round(1000 * per_patch, 1),
        volume_s=round(per_patch * volume_patches, 1),
        volume_extrapolated=True,
        tflops=round(flops / per_patch / 1e12, 3),
        patches_timed=len(times),
    )


def bench_tensorrt(
    manifest: Any, volume: npt.NDArray[np.float32], args: argparse.Namespace
) -> dict[str, Any]:
    """TensorRT through TensorRTEngine, or the reason it cannot run here."""
    from segnode.engines.base import EngineError
    from segnode.engines.trt_backend import TensorRTEngine

    engine = TensorRTEngine(cache_dir=args.work / "engines", precision="fp16")
    try:
        engine.load(manifest)
        engine.segment(volume)
        t0 = time.perf_counter()
        engine.segment(volume)
        return _row("tensorrt fp16", precision="fp16", volume_s=round(time.perf_counter() - t0, 3))
    except EngineError as exc:
        return _row("tensorrt fp16", error=f"not runnable here: {exc}")
    finally:
        engine.close()


def tissue_agreement(torch: Any, shape: tuple[int, int, int]) -> dict[str, Any]:
    """TorchEngine (GPU, fp32 and fp16) vs OrtEngine (CPU) on the bundled tissue model."""
    from segnode.engines.base import create_engine
    from segnode.engines.manifest_parse import load_manifest
    from segnode.engines.torch_backend import TorchEngine

    if not TISSUE.exists():
        return {"error": f"{TISSUE} missing (python -m segnode.engines.models.build_tissue)"}
    manifest = load_manifest(TISSUE)
    hu = synthetic_ct(shape, seed=1)
    ort_engine = create_engine("onnxruntime")
    ort_engine.load(manifest)
    t0 = time.perf_counter()
    reference = ort_engine.segment(hu)
    result: dict[str, Any] = {
        "shape": list(shape),
        "ort_cpu_s": round(time.perf_counter() - t0, 2),
        "labels_present": sorted(int(v) for v in np.unique(reference)),
    }
    ort_engine.close()
    for precision in ("fp32", "fp16"):
        engine = TorchEngine(precision=precision)
        engine.load(manifest)
        engine.segment(hu)
        t0 = time.perf_counter()
        labels = engine.segment(hu)
        result[f"torch_{precision}_s"] = round(time.perf_counter() - t0, 3)
        result[f"torch_{precision}_runs_fp16"] = engine.half
        result[f"agreement_{precision}"] = float(np.mean(labels == reference))
        engine.close()
    return result


# --------------------------------------------------------------------------- report


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table with ratios to eager FP32."""
    env, unet, vol = report["env"], report["unet"], report["volume"]
    rows = report["rows"]
    base = next((r for r in rows if r["backend"] == "torch eager fp32" and "volume_s" in r), None)
    patch, shape = "x".join(map(str, unet["patch"])), "x".join(map(str, vol["shape"]))
    ceilings = ", ".join(f"{k} {v:.0f} TFLOP/s" for k, v in report["peaks_tflops"].items())
    lines = [
        f"# GPU benchmark: {env['gpu']} ({env['date']})",
        "",
        f"U-Net: {unet['params'] / 1e6:.1f} M parameters, "
        f"{unet['flops_per_patch'] / 1e9:.0f} GFLOP per {patch} patch, batch {unet['batch']}; "
        f"volume {shape}, overlap {vol['overlap']}, {vol['patches']} patches. "
        f"torch {env['torch']}, CUDA {env['cuda']}, driver {env['driver']}.",
        "",
        f"Roofline: {vol['flops'] / 1e12:.1f} TFLOP per volume, at least "
        f"{1000 * vol['flops'] / 1e12 / max(report['peaks_tflops'].values()):.0f} ms at the "
        "best measured matmul rate. "
        f"Measured matmul ceilings (8192^3): {ceilings}. "
        f"Transfers (ms): {report.get('transfers_ms', {})}.",
        "",
        "| backend | patches/s | ms/patch | volume s | x eager fp32 (volume) "
        "| x eager fp32 (patch) | TFLOP/s | % of matmul peak | GPU util mean/max % "
        "| outside network s | load s | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if "error" in r:
            lines.append(
                f"| {r['backend']} | - | - | - | - | - | - | - | - | - | {r['error'][:160]} |"
            )
            continue
        seconds = f"{r['volume_s']}" + (" (extrapolated)" if r.get("volume_extrapolated") else "")
        xv = f"{base['volume_s'] / r['volume_s']:.2f}" if base and r.get("volume_s") else "-"
        pps = r.get("patches_per_s")
        xp = f"{pps / base['patches_per_s']:.2f}" if base and pps else "-"
        util = r.get("gpu_util", {})
        u = f"{util.get('mean_pct', '-')}/{util.get('max_pct', '-')}" if util else "-"
        cells = [
            r["backend"],
            pps or "-",
            r.get("ms_per_patch", "-"),
            seconds,
            xv,
            xp,
            r.get("tflops", "-"),
            r.get("roofline_pct", "-"),
            u,
            r.get("outside_network_s", "-"),
            r.get("load_s", "-"),
            r.get("peak_mem_gib", "-"),
        ]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "Agreement:", ""]
    for k, v in report["agreement"].items():
        lines.append(f"- {k}: {v}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_bench")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--unet", type=Path, default=None, help="existing U-Net manifest")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder")
    parser.add_argument("--shape", type=int, nargs=3, default=(128, 512, 512))
    parser.add_argument("--iters", type=int, default=10, help="timed patch batches")
    parser.add_argument("--repeats", type=int, default=3, help="timed full volumes")
    parser.add_argument("--ort-patches", type=int, default=2)
    parser.add_argument("--no-ort", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument(
        "--max-autotune", action="store_true", help="also torch.compile max-autotune (minutes)"
    )
    parser.add_argument("--no-tissue", action="store_true")
    parser.add_argument("--tissue-shape", type=int, nargs=3, default=(64, 512, 512))
    args = parser.parse_args(argv)
    args.work = args.work or Path(tempfile.mkdtemp(prefix="segnode-bench-"))
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from segnode.engines.manifest_parse import load_manifest

    if not torch.cuda.is_available():
        print("no CUDA GPU: this benchmark needs one")
        return 2
    manifest_path = args.unet or write_unet(args.work / "unet", FULL)
    manifest = load_manifest(manifest_path)
    flops = int(manifest.extra["flops_per_patch"])
    shape = tuple(args.shape)
    volume = synthetic_ct(shape)
    patches = n_patches(shape, manifest.patch_size, manifest.overlap)
    try:
        import subprocess

        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        driver = "?"
    report: dict[str, Any] = {
        "env": {
            "gpu": torch.cuda.get_device_name(0),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "driver": driver,
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
        },
        "unet": {
            "params": manifest.extra["params"],
            "flops_per_patch": flops,
            "patch": list(manifest.patch_size),
            "batch": manifest.batch_opt,
        },
        "volume": {
            "shape": list(shape),
            "overlap": manifest.overlap,
            "patches": patches,
            "flops": patches * flops,
        },
    }
    report["transfers_ms"] = transfer_times(torch, volume)
    print("[bench] matmul ceilings ...", flush=True)
    report["peaks_tflops"] = {
        "fp16": round(matmul_tflops(torch, torch.float16), 1),
        "fp32": round(matmul_tflops(torch, torch.float32), 1),
        "tf32": round(matmul_tflops(torch, torch.float32, tf32=True), 1),
    }
    labels: dict[str, npt.NDArray[np.uint8]] = {}
    rows: list[dict[str, Any]] = []
    report["rows"], report["agreement"] = rows, {}
    peaks = report["peaks_tflops"]

    def save() -> None:  # after every stage, so a run cut short still leaves its figures
        agreement = report["agreement"]
        ref = labels.get("torch eager fp32")
        if ref is not None:
            for name, lab in labels.items():
                if name != "torch eager fp32":
                    key = f"U-Net argmax, {name} vs eager fp32"
                    agreement[key] = round(float(np.mean(lab == ref)), 6)
            agreement["U-Net label histogram (eager fp32)"] = np.bincount(ref.ravel()).tolist()
        (args.out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "bench.md").write_text(markdown(report))

    if not args.no_ort:
        print("[bench] onnxruntime cpu ...", flush=True)
        rows.append(bench_ort(manifest, patches, args, flops))
        save()
    rows += bench_torch_variants(
        torch, manifest, volume, args, peaks, flops, labels, TORCH_VARIANTS
    )
    save()
    rows.append(bench_tensorrt(manifest, volume, args))
    save()
    if not args.no_tissue:
        print("[bench] tissue agreement ...", flush=True)
        key = "tissue TorchEngine vs OrtEngine (CPU)"
        try:
            report["agreement"][key] = tissue_agreement(torch, tuple(args.tissue_shape))
        except Exception as exc:
            report["agreement"][key] = {"error": f"{type(exc).__name__}: {exc}"}
        save()
    if not args.no_compile:
        for variant in COMPILED:
            if args.max_autotune or "max-autotune" not in variant[0]:
                rows += bench_torch_variants(
                    torch, manifest, volume, args, peaks, flops, labels, [variant]
                )
                save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
