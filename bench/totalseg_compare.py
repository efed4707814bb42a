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
are random: with ``--head noise`` (the default) the label map is noise (the SEG a worst case)
on both sides alike. ``--head constant`` labels every voxel one structure
(``scripts.make_totalseg_standins --head constant``): TotalSegmentator's cheapest non-empty
output, so its time is a lower bound of its time on a real body CT (the networks and the
resampling cost the same whatever the weights; only post-processing and writing depend on the
labels). With ``--segnode-model`` segnode runs that manifest instead of the import, such as
the anatomy stand-ins of ``bench.totalseg_standin --anatomy``, whose 117 structures on
``--phantom anatomy`` make a realistic SEG: the table is then segnode's realistic output
against TotalSegmentator's lower bound, the conservative ratio.

Run::

    python -m bench.totalseg_compare --task total --device gpu --engine torch
    python -m bench.totalseg_compare --task total --head constant --home /tmp/tsconst \
        --segnode-model /tmp/tsa/total.json --phantom anatomy
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
    if ours is None:
        return f"segnode failed: {report.get('segnode_error')}"
    runs = ", ".join(f"{x:.2f}" for x in report.get("segnode_runs_s") or [])
    lines = [
        f"| {report['task']}, 512 x 512 x {report['slices']}, {report['device']} | seconds | "
        "x TotalSegmentator |",
        "|---|---:|---:|",
        f"| segnode ({report['engine']}, {report.get('segnode_weights', 'imported')}), last "
        f"C-STORE response -> SEG + SR acknowledged (median of {report['runs']}: {runs}) | "
        f"**{ours:.2f}** | 1 |",
    ]
    for row in report["totalsegmentator"]:
        if "seconds" in row:
            ratio = row["seconds"] / ours if ours else float("nan")
            lines.append(
                f"| TotalSegmentator ({report.get('head', 'noise')} head), {row['mode']} "
                f"(peak RSS {row['rss_gib']:.1f} GiB, GPU reserved "
                f"{row['gpu_reserved_gib']:.1f} GiB) | {row['seconds']:.2f} | **{ratio:.1f}x** |"
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
    p.add_argument(
        "--head",
        choices=("noise", "constant"),
        default="noise",
        help="the stand-ins' segmentation head (scripts.make_totalseg_standins --head)",
    )
    p.add_argument(
        "--segnode-model",
        type=Path,
        default=None,
        help="a segnode manifest to run instead of importing --home (e.g. the anatomy stand-ins)",
    )
    p.add_argument("--phantom", choices=("synthetic", "anatomy"), default="synthetic")
    p.add_argument("--ts-runs", type=int, default=1, help="TotalSegmentator calls per mode")
    p.add_argument(
        "--ts-modes",
        nargs="+",
        choices=("dicom", "nifti"),
        default=["dicom", "nifti"],
        help="TotalSegmentator's inputs and outputs: DICOM -> DICOM SEG, NIfTI -> NIfTI",
    )
    p.add_argument(
        "--e2e-args",
        default="",
        help="more bench.gpu_e2e arguments, e.g. '--engine-cache /tmp/engines --no-compile'",
    )
    p.add_argument(
        "--order",
        choices=("segnode-first", "totalseg-first"),
        default="segnode-first",
    )
    args = p.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if not (args.home / "nnunet" / "results").is_dir():
        run(["-m", "scripts.make_totalseg_standins", "--out", str(args.home), "--task", "all",
             "--head", args.head], args.ts_python, args.timeout)  # fmt: skip
    model = args.segnode_model or args.model_dir / args.task / f"{args.task}.json"
    if not model.is_file():
        run(["-m", "segnode.node.ops.cli", "model", "import", "totalsegmentator",
             str(args.home / "nnunet" / "results"), "--task", args.task,
             "--labels", "totalsegmentator", "--out", str(model.parent)],
            args.ts_python, args.timeout)  # fmt: skip
    e2e = out / "segnode"
    theirs = out / "totalsegmentator"

    def ours_run() -> None:
        cmd = ["-m", "bench.gpu_e2e", "--out", str(e2e), "--models", str(model)]
        cmd += ["--slices", str(args.slices), "--runs", str(args.runs), "--engine", args.engine]
        cmd += ["--phantom", args.phantom, *args.e2e_args.split()]
        if args.engine == "openvino":
            cmd += ["--precision", "bf16"]
        run(cmd, sys.executable, args.timeout)

    def theirs_run() -> None:
        run(["-m", "bench.totalseg_gpu", "--home", str(args.home), "--out", str(theirs),
             "--slices", str(args.slices), "--tasks", args.task, "--modes", *args.ts_modes,
             "--device", args.device, "--phantom", args.phantom, "--runs", str(args.ts_runs)],
            args.ts_python, args.timeout)  # fmt: skip

    for step in (ours_run, theirs_run) if args.order == "segnode-first" else (theirs_run, ours_run):
        step()
    ours = json.loads((e2e / "gpu_e2e.json").read_text())["models"][0]
    report = {
        "task": args.task,
        "device": args.device,
        "engine": args.engine,
        "slices": args.slices,
        "runs": args.runs,
        "head": args.head,
        "phantom": args.phantom,
        "segnode_weights": (
            f"manifest {args.segnode_model}"
            if args.segnode_model
            else f"the same checkpoints imported ({args.head} head)"
        ),
        "segnode_s": ours.get("total_s"),
        "segnode_error": ours.get("error"),
        "segnode_runs_s": ours.get("runs_s"),
        "segnode_job_peak_rss_gib": ours.get("job_peak_rss_gib"),
        "segnode_gpu_peak_gib": ours.get("gpu_peak_gib"),
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
