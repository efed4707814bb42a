"""CPU runtimes for a 3D U-Net patch, side by side (issue 35, first bullet "BF16 and the runtime").

One patch of a network, batch 1, ``--threads`` threads, in one process, each runtime timed
``--runs`` times after a warm-up (medians), interleaved round by round so that a noisy machine
weighs on every runtime alike. Networks (``--networks``):

* ``fast``: TotalSegmentator's ``--fast`` shape (nnU-Net's default plans at 3 mm, 16.6 M
  parameters, 117 labels, patch 128 x 112 x 112; :mod:`bench.totalseg_standin`);
* ``unet31``: nnU-Net's default 3d_fullres network (:mod:`bench.unet`, 31 M, patch 128^3).

Runtimes: ONNX Runtime FP32 (the node's engine today); ONNX Runtime static INT8 QDQ
(per-channel weights, activations calibrated on CT-like patches: the phantom's HU,
CT-normalised); OpenVINO FP32 and BF16 (``INFERENCE_PRECISION_HINT``; an optional package);
PyTorch CPU FP32 and BF16 (weights cast; ``--torch``, the same network rebuilt from nnU-Net's
plans with ``dynamic_network_architectures``, ``fast`` only, with its own random weights).
Agreement: the fraction of voxels whose arg-max equals ONNX Runtime FP32's (PyTorch's: its
FP32's), on a CT-like patch (random weights: a trained
network's margins are larger, so this is a floor).

Run::

    python -m bench.cpu_runtimes --out bench/out --networks fast unet31
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def ct_patch(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A CT-normalised patch of the synthetic phantom (``tests.fixtures.synthetic``)."""
    from bench.totalseg_standin import INTENSITY
    from tests.fixtures.synthetic import phantom_hu

    z, y, x = shape
    hu = phantom_hu(2 * y, 2 * x, z, seed=seed)[:, ::2, ::2].astype(np.float32)
    hu = np.clip(hu, INTENSITY["percentile_00_5"], INTENSITY["percentile_99_5"])
    return ((hu - INTENSITY["mean"]) / INTENSITY["std"])[None, None].astype(np.float32)


def network(name: str, work: Path) -> tuple[Path, tuple[int, int, int]]:
    """The ONNX file and patch of ``name``."""
    work.mkdir(parents=True, exist_ok=True)
    if name == "fast":
        from bench.totalseg_standin import PATCH, build_onnx

        path = work / "fast.onnx"
        if not path.exists():
            build_onnx(path)
        return path, PATCH
    from bench.unet import FULL, write_unet

    manifest = write_unet(work, FULL, name="unet31")
    return manifest.with_suffix(".onnx"), tuple(FULL.patch_size)  # type: ignore[return-value]


def ort_session(path: Path, threads: int) -> Callable[[np.ndarray], np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda x: session.run(None, {name: x})[0]


def quantized(path: Path, patch: tuple[int, int, int], calibration: int) -> Path:
    """Static INT8 QDQ, per-channel weights, calibrated on ``calibration`` CT patches."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    out = path.with_name(path.stem + ".int8.onnx")
    if out.exists():
        return out

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.items = iter([{"input": ct_patch(patch, 100 + i)} for i in range(calibration)])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.items, None)

    quantize_static(
        str(path),
        str(out),
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )
    return out


def openvino_model(path: Path, threads: int, precision: str) -> Callable[[np.ndarray], np.ndarray]:
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(
        str(path),
        "CPU",
        {
            "INFERENCE_PRECISION_HINT": precision,
            "INFERENCE_NUM_THREADS": threads,
            "PERFORMANCE_HINT": "LATENCY",
        },
    )
    request = compiled.create_infer_request()
    return lambda x: np.asarray(request.infer({0: x})[0])


def torch_model(precision: str, threads: int) -> Callable[[np.ndarray], np.ndarray]:
    """``fast`` rebuilt from nnU-Net's plans for dataset 297 in PyTorch (its own weights)."""
    import torch

    from scripts.make_totalseg_standins import build_network, initialise, load_plans

    torch.set_num_threads(threads)
    net = build_network(load_plans(297), 118)
    initialise(net, 297)
    net.eval()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    net = net.to(dtype=dtype, memory_format=torch.channels_last_3d)

    def run(x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            t = torch.from_numpy(x).to(dtype).contiguous(memory_format=torch.channels_last_3d)
            return net(t).float().numpy()  # type: ignore[no-any-return]

    return run


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    p = argparse.ArgumentParser(
        prog="python -m bench.cpu_runtimes", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--work", type=Path, default=Path("/tmp/segnode-cpu-runtimes"))
    p.add_argument("--networks", nargs="+", default=["fast"], choices=("fast", "unet31"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--calibration", type=int, default=4, help="INT8 calibration patches")
    p.add_argument("--torch", action="store_true", help="also PyTorch CPU (fast only)")
    args = p.parse_args(argv)
    report: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": [],
    }
    for name in args.networks:
        path, patch = network(name, args.work)
        x = ct_patch(patch, 7)
        runtimes: dict[str, Callable[[np.ndarray], np.ndarray]] = {
            "onnxruntime fp32": ort_session(path, args.threads)
        }
        t = time.perf_counter()
        runtimes["onnxruntime int8 qdq"] = ort_session(
            quantized(path, patch, args.calibration), args.threads
        )
        quantize_s = time.perf_counter() - t
        try:
            runtimes["openvino fp32"] = openvino_model(path, args.threads, "f32")
            runtimes["openvino bf16"] = openvino_model(path, args.threads, "bf16")
        except ImportError as exc:
            print(f"[cpu-runtimes] no OpenVINO ({exc})")
        if args.torch and name == "fast":
            try:
                runtimes["torch fp32"] = torch_model("fp32", args.threads)
                runtimes["torch bf16"] = torch_model("bf16", args.threads)
            except ImportError as exc:
                print(f"[cpu-runtimes] no PyTorch network ({exc})")
        reference = runtimes["onnxruntime fp32"](x).argmax(1)
        times: dict[str, list[float]] = {k: [] for k in runtimes}
        agree = {}
        torch_reference = None
        for key, run in runtimes.items():  # warm-up, and the agreement
            found = run(x).argmax(1)
            if key == "torch fp32":  # its own weights: agreement with itself in FP32
                torch_reference = found
            ref = torch_reference if key.startswith("torch") else reference
            agree[key] = float((found == ref).mean())
        for _ in range(args.runs):
            for key, run in runtimes.items():
                t = time.perf_counter()
                run(x)
                times[key].append(time.perf_counter() - t)
        base = statistics.median(times["onnxruntime fp32"])
        for key in runtimes:
            median = statistics.median(times[key])
            row = {
                "network": name,
                "runtime": key,
                "patch": list(patch),
                "seconds": round(median, 3),
                "runs_s": [round(v, 3) for v in times[key]],
                "speed_up": round(base / median, 2),
                "argmax_agreement": round(agree[key], 5) if key in agree else None,
            }
            if key == "onnxruntime int8 qdq":
                row["quantize_s"] = round(quantize_s, 1)
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_runtimes.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
