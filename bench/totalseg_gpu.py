"""TotalSegmentator's own time on this machine, for the ratios of ``bench.gpu_e2e``.

On the same synthetic 512 x 512 x ``--slices`` CT that ``bench.gpu_e2e`` sends (0.7 mm
pixels, 1.25 mm slices), written once as a DICOM folder and, with TotalSegmentator's own
``dicom2nifti``, as NIfTI, this runs ``totalsegmentator.python_api.totalsegmentator`` in a
fresh process per run (as its CLI runs: the models load each time) with the weights in
``--home`` (``TOTALSEG_HOME_DIR``: ``scripts.make_totalseg_standins`` writes the real shape),
for each ``--task`` (``total``; ``total_fast`` is ``fast=True``):

* ``dicom``: the DICOM folder in, ``output_type="dicom_seg"`` out (its highdicom SEG);
* ``nifti``: NIfTI in, one multi-label NIfTI out (``ml=True``), the way FastSegmentator's
  9.6x was measured.

Reported per row: the wall time of the call (median of ``--runs``), the process's peak RSS,
and the GPU memory torch reserved at its peak. Outputs ``--out/totalseg_gpu.json``.

Run (CUDA machine with TotalSegmentator 2.x, nnU-Net v2 and the stand-in weights)::

    python -m scripts.make_totalseg_standins --out /tmp/tshome --task all
    python -m bench.totalseg_gpu --home /tmp/tshome --out bench/out --slices 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
import torch
from totalsegmentator.python_api import totalsegmentator
args = json.loads(sys.argv[1])
t = time.perf_counter()
totalsegmentator(**args)
wall = time.perf_counter() - t
peak = torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0
print("RESULT " + json.dumps({
    "seconds": wall,
    "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    "gpu_reserved_gib": peak / 2**30,
}))
"""


def write_inputs(
    slices: int, work: Path, seed: int = 4200, phantom: str = "synthetic"
) -> tuple[Path, Path]:
    """The DICOM folder and its NIfTI (converted by TotalSegmentator's dicom2nifti): the
    series ``bench.gpu_e2e`` sends (:func:`bench.gpu_e2e.make_series`, same ``phantom``)."""
    from bench.gpu_e2e import make_series

    dicom = work / f"ct{slices}-{phantom}"
    nifti = work / f"ct{slices}-{phantom}.nii.gz"
    if not dicom.is_dir():
        dicom.mkdir(parents=True)
        datasets = make_series(slices, seed, phantom)
        for i, ds in enumerate(datasets):
            ds.save_as(dicom / f"{i:04d}.dcm", enforce_file_format=True)
    if not nifti.is_file():
        import dicom2nifti

        dicom2nifti.dicom_series_to_nifti(str(dicom), str(nifti), reorient_nifti=False)
    return dicom, nifti


def run_once(call: dict[str, Any], home: Path, timeout: float) -> dict[str, Any]:
    env = dict(os.environ, TOTALSEG_HOME_DIR=str(home), PYTHONUNBUFFERED="1")
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(call)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    process_s = time.perf_counter() - t
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:]) | {"process_s": process_s}
    raise RuntimeError(f"TotalSegmentator failed ({done.returncode}): {done.stderr[-1500:]}")


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    p = argparse.ArgumentParser(
        prog="python -m bench.totalseg_gpu", description=__doc__.split("\n")[0]
    )
    p.add_argument("--home", type=Path, required=True, help="TOTALSEG_HOME_DIR with the weights")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--work", type=Path, default=Path("/tmp/totalseg-gpu"))
    p.add_argument("--slices", type=int, nargs="+", default=[300])
    p.add_argument("--tasks", nargs="+", default=["total", "total_fast"])
    p.add_argument("--modes", nargs="+", default=["dicom", "nifti"])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--device", default="gpu")
    p.add_argument(
        "--phantom",
        choices=("synthetic", "anatomy"),
        default="synthetic",
        help="the series bench.gpu_e2e --phantom sends",
    )
    p.add_argument("--timeout", type=float, default=400)
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    config = args.home / "config.json"  # no usage statistics sent (nothing is reachable)
    if not config.is_file():
        config.write_text(
            json.dumps(
                {
                    "totalseg_id": "segnode-bench",
                    "send_usage_stats": False,
                    "prediction_counter": 0,
                    "statistics_disclaimer_shown": True,
                }
            )
        )
    rows: list[dict[str, Any]] = []
    for slices in args.slices:
        dicom, nifti = write_inputs(slices, args.work, phantom=args.phantom)
        for task in args.tasks:
            for mode in args.modes:
                out = args.work / f"out-{task}-{mode}-{slices}"
                call: dict[str, Any] = {
                    "task": "total",
                    "device": args.device,
                    "quiet": True,
                    "fast": task == "total_fast",
                }
                if mode == "dicom":
                    call |= {"input": str(dicom), "output": str(out), "output_type": "dicom_seg"}
                else:
                    call |= {"input": str(nifti), "output": str(out) + ".nii.gz", "ml": True}
                row: dict[str, Any] = {"slices": slices, "task": task, "mode": mode}
                try:
                    runs = [run_once(call, args.home, args.timeout) for _ in range(args.runs)]
                    row |= {
                        "seconds": round(statistics.median(r["seconds"] for r in runs), 2),
                        "runs_s": [round(r["seconds"], 2) for r in runs],
                        "rss_gib": round(max(r["rss_gib"] for r in runs), 2),
                        "gpu_reserved_gib": round(max(r["gpu_reserved_gib"] for r in runs), 2),
                    }
                except Exception as exc:  # one row failing must not lose the others
                    row["error"] = f"{type(exc).__name__}: {exc}"[-1500:]
                rows.append(row)
                print(json.dumps(row), flush=True)
                (args.out / "totalseg_gpu.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
