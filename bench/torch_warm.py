"""Restart-to-ready of the ``torch`` engine: cold (nothing cached) against warm (artefact cached).

Run on a CUDA machine with torch and onnx2torch::

    python -m bench.torch_warm --out bench/out            # writes torch_warm.{json,md}

For each model (the nnU-Net-style U-Net of :mod:`bench.unet` and the bundled tissue model)
and each way of loading, one **fresh process** (as a node restart is) loads a
:class:`segnode.engines.torch_backend.TorchEngine` (FP16) and segments a synthetic 128x512x512 CT
twice. Ways of loading:

* ``eager``: no compilation (the reference for the label maps' agreement);
* ``jit``: ``torch.compile`` with no persistent cache (the engine before the cache existed);
* ``aoti cold`` / ``aoti warm``: AOTInductor package built and stored, then loaded;
* ``inductor cold`` / ``inductor warm``: ``torch.compile`` whose mega-cache is saved, then
  restored (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``).

Every process gets empty ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` folders, so
only the engine's own cache (``--work``/engines) carries anything from one process to the
next, as after a reboot or under systemd's ``PrivateTmp``. Reported per process: seconds from
spawn to ``import torch`` done, to engine ready (``load`` returned), first and second
segmentation, the engine's ``load_info``; and whether the label maps of cold and warm (and of
jit) are identical, and their agreement with eager.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TISSUE = ROOT / "engines" / "models" / "tissue" / "tissue.json"

CHILD = """
import json, sys, time
t_spawn = float(sys.argv[1])
import torch
t_torch = time.time()
import numpy as np
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.torch_backend import TorchEngine
from bench.gpu_bench import synthetic_ct
manifest, mode, cache, out, shape, device = sys.argv[2:8]
options = {"precision": "fp16", "device": device}
if mode != "eager":
    options["compile"] = True
if mode.split()[0] in ("aoti", "inductor"):
    options.update(cache_dir=cache, compile_cache=mode.split()[0])
engine = TorchEngine(**options)
engine.load(load_manifest(manifest))
t_ready = time.time()
hu = synthetic_ct(tuple(int(v) for v in shape.split("x")), seed=11)
times = []
for _ in range(2):
    t0 = time.perf_counter()
    labels = engine.segment(hu)
    times.append(time.perf_counter() - t0)
np.save(out, labels)
print("RESULT " + json.dumps({
    "import_torch_s": round(t_torch - t_spawn, 2),
    "ready_s": round(t_ready - t_spawn, 2),
    "load_s": round(engine.load_seconds, 2),
    "first_segment_s": round(times[0], 3),
    "second_segment_s": round(times[1], 3),
    "ready_to_first_labels_s": round(engine.load_seconds + times[0], 2),
    "load_info": {k: v for k, v in engine.load_info.items() if k != "artefact"},
    "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
    "torch": torch.__version__,
}))
"""

MODES = ("eager", "jit", "aoti cold", "aoti warm", "inductor cold", "inductor warm")


def run_child(
    manifest: Path, mode: str, work: Path, args: argparse.Namespace
) -> tuple[dict[str, Any], Path]:
    """One fresh process; returns its figures and the label map it saved."""
    tag = f"{manifest.stem}-{mode.replace(' ', '-')}"
    scratch = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir=work))
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
        "TRITON_CACHE_DIR": str(scratch / "triton"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    }
    cache = work / "engines"  # one folder for every model, as a node has
    out = work / f"{tag}.npy"
    t0 = time.time()
    try:
        done = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", CHILD, repr(t0), str(manifest), mode]
            + [str(cache), str(out)]
            + [args.shape, args.device],
            capture_output=True,
            text=True,
            env=env,
            timeout=args.timeout,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {args.timeout} s"}, out
    wall = time.time() - t0
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        status = f"signal {-done.returncode}" if done.returncode < 0 else done.returncode
        return {"mode": mode, "error": f"exit {status}: {done.stderr[-1500:]}"}, out
    row: dict[str, Any] = {"mode": mode, **json.loads(lines[-1][7:]), "process_wall_s": wall}
    warnings = [x for x in done.stdout.splitlines() + done.stderr.splitlines() if "WARNING" in x]
    if warnings:
        row["warnings"] = warnings[:5]
    return row, out


def label_checks(outs: dict[str, Path]) -> dict[str, Any]:
    """Hashes of every label map, identity of cold/warm pairs, agreement with eager."""
    import numpy as np

    maps = {m: np.load(p) for m, p in outs.items() if p.exists()}
    result: dict[str, Any] = {
        m: hashlib.sha256(a.tobytes()).hexdigest()[:16] for m, a in maps.items()
    }
    for kind in ("aoti", "inductor"):
        cold, warm = maps.get(f"{kind} cold"), maps.get(f"{kind} warm")
        if cold is not None and warm is not None:
            result[f"{kind} cold == warm"] = bool(np.array_equal(cold, warm))
    eager = maps.get("eager")
    if eager is not None:
        for m, a in maps.items():
            if m != "eager":
                result[f"{m} vs eager agreement"] = round(float(np.mean(a == eager)), 6)
    return result


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# torch engine restart-to-ready ({report['gpu']}, torch {report['torch']}, "
        f"{report['date']})",
        "",
        f"Command: `{report['command']}`. Each row is a fresh process (empty Inductor and "
        f"Triton caches); volume {report['shape']}, FP16. `ready` counts from the process's "
        "spawn (Python start and `import torch` included) to `TorchEngine.load` returning.",
        "",
    ]
    for model, res in report["models"].items():
        lines += [
            f"## {model}",
            "",
            "| load | ready s | of which import torch s | load s | build s | 1st segment s "
            "| 2nd segment s | cache hit |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in res["rows"]:
            if "error" in r:
                lines.append(f"| {r['mode']} | error: {r['error'][-200:]!r} |||||||")
                continue
            info = r.get("load_info", {})
            lines.append(
                f"| {r['mode']} | {r['ready_s']} | {r['import_torch_s']} | {r['load_s']} | "
                f"{info.get('build_seconds', '-')} | {r['first_segment_s']} | "
                f"{r['second_segment_s']} | {info.get('cache_hit', '-')} |"
            )
        lines += ["", "Label maps: " + json.dumps(res["labels"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m bench.torch_warm")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--shape", default="128x512x512")
    parser.add_argument("--models", nargs="+", default=["unet", "tissue"])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--timeout", type=float, default=420, help="per process")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    parser.add_argument("--small", action="store_true", help="the small test U-Net")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="segnode-warm-"))
    args.out.mkdir(parents=True, exist_ok=True)
    manifests: dict[str, Path] = {}
    if "unet" in args.models:
        from bench.unet import FULL, SMALL, write_unet

        manifests["unet"] = write_unet(work / "unet", SMALL if args.small else FULL)
    if "tissue" in args.models:
        manifests["tissue"] = TISSUE
    report: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.torch_warm " + " ".join(argv or sys.argv[1:]),
        "shape": args.shape,
        "gpu": "?",
        "torch": "?",
        "models": {},
    }
    for name, manifest in manifests.items():
        rows: list[dict[str, Any]] = []
        outs: dict[str, Path] = {}
        report["models"][name] = {"rows": rows, "labels": {}}
        for mode in args.modes:
            print(f"[warm] {name} {mode} ...", flush=True)
            row, out = run_child(manifest, mode, work, args)
            rows.append(row)
            outs[mode] = out
            report["gpu"], report["torch"] = row.get("gpu", report["gpu"]), row.get("torch", "?")
            print(f"[warm]   {json.dumps(row)[:600]}", flush=True)
            report["models"][name]["labels"] = label_checks(outs)
            (args.out / "torch_warm.json").write_text(json.dumps(report, indent=2) + "\n")
            (args.out / "torch_warm.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
