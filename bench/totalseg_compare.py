"""segnode against TotalSegmentator on the same weights, series and machine, one table.

For one task (``--task total`` or ``total_fast``), in one invocation:

1. the stand-in weights of the real shape (``scripts.make_totalseg_standins``) in ``--home``
   (TotalSegmentator's ``TOTALSEG_HOME_DIR``), unless there;
2. ``segnode model import totalsegmentator`` of them (with ``--ts-python``, which has nnU-Net
   v2), unless imported;
3. segnode end to end (:mod:`bench.gpu_e2e`: ``segnode serve``, a DICOM sender, results to a
   Storage SCP; ``--engine torch`` on a GPU, ``openvino`` or ``onnxruntime`` on a CPU);
4. TotalSegmentator's own time (:mod:`bench.totalseg_gpu`, run by ``--ts-python``: DICOM in
   and its DICOM SEG out, and NIfTI to NIfTI) on the same synthetic series;

then prints the table with the ratios and writes ``--out/totalseg_compare.json``. The weights
are random: the label map is noise (the SEG a worst case) on both sides alike.

Run::

    python -m bench.totalseg_compare --task total --device gpu --engine torch
    python -m bench.totalseg_compare --task total_fast --device cpu --engine openvino \\
        --ts-python /path/to/venv-with-totalsegmentator/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run(cmd: list[str], python: str, timeout: float) -> None:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    print("[compare] " + " ".join(cmd), flush=True)
    subprocess.run([python, *cmd], cwd=ROOT, env=env, check=True, timeout=timeout)


def table(report: dict[str, Any]) -> str:
    ours = report["segnode_s"]
    lines = [
        f"| {report['task']}, 512 x 512 x {report['slices']}, {report['device']} | seconds | "
        "x TotalSegmentator |",
        "|---|---:|---:|",
        f"| segnode ({report['engine']}), last C-STORE response -> SEG + SR acknowledged "
        f"(median of {report['runs']}) | **{ours:.2f}** | 1 |",
    ]
    for row in report["totalsegmentator"]:
        if "seconds" in row:
            ratio = row["seconds"] / ours if ours else float("nan")
            lines.append(
                f"| TotalSegmentator, {row['mode']} | {row['seconds']:.2f} | **{ratio:.1f}x** |"
            )
        else:
            lines.append(f"| TotalSegmentator, {row['mode']} | failed: {row['error'][-200:]} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    p = argparse.ArgumentParser(
        prog="python -m bench.totalseg_compare", description=__doc__.split("\n")[0]
    )
    p.add_argument("--task", choices=("total", "total_fast"), default="total")
    p.add_argument("--device", choices=("gpu", "cpu"), default="gpu")
    p.add_argument("--engine", choices=("torch", "openvino", "onnxruntime"), default="torch")
    p.add_argument("--slices", type=int, default=300)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--home", type=Path, default=Path("/tmp/tshome"))
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/tsimport"))
    p.add_argument("--ts-python", default=sys.executable, help="Python with TotalSegmentator")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "compare")
    p.add_argument("--timeout", type=float, default=1800)
    args = p.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not (args.home / "nnunet" / "results").is_dir():
        run(["-m", "scripts.make_totalseg_standins", "--out", str(args.home), "--task", "all"],
            args.ts_python, args.timeout)  # fmt: skip
    model = args.model_dir / args.task / f"{args.task}.json"
    if not model.is_file():
        run(["-m", "segnode.node.ops.cli", "model", "import", "totalsegmentator",
             str(args.home / "nnunet" / "results"), "--task", args.task,
             "--labels", "totalsegmentator", "--out", str(model.parent)],
            args.ts_python, args.timeout)  # fmt: skip
    e2e = out / "segnode"
    cmd = ["-m", "bench.gpu_e2e", "--out", str(e2e), "--models", str(model)]
    cmd += ["--slices", str(args.slices), "--runs", str(args.runs), "--engine", args.engine]
    if args.engine == "openvino":
        cmd += ["--precision", "bf16"]
    run(cmd, sys.executable, args.timeout)
    ours = json.loads((e2e / "gpu_e2e.json").read_text())["models"][0]
    theirs = out / "totalsegmentator"
    run(["-m", "bench.totalseg_gpu", "--home", str(args.home), "--out", str(theirs),
         "--slices", str(args.slices), "--tasks", args.task, "--modes", "dicom", "nifti",
         "--device", args.device], args.ts_python, args.timeout)  # fmt: skip
    report = {
        "task": args.task,
        "device": args.device,
        "engine": args.engine,
        "slices": args.slices,
        "runs": args.runs,
        "segnode_s": ours["total_s"],
        "segnode_runs_s": ours.get("runs_s"),
        "totalsegmentator": [
            r | {"mode": "DICOM -> DICOM SEG" if r["mode"] == "dicom" else "NIfTI -> NIfTI"}
            for r in json.loads((theirs / "totalseg_gpu.json").read_text())
        ],
    }
    (out / "totalseg_compare.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
