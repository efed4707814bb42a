"""What test-time mirroring buys: Dice and time of a trained model per mirrored axis (issue 35).

nnU-Net predicts each tile once more per mirrored combination of axes (8 passes for all three),
and a model's manifest keeps its trainer's axes. This runs one model on a phantom CT whose true
labels are known, with each set of axes a ``mirror_axes`` override (``[model] mirror_axes``)
could give, and reports the time and the Dice per label against the truth and against the
manifest's own mirroring::

    python -m bench.mirror_cost --manifest tests/data/nnunet_phantom/phantom.json \\
        --engine openvino --slices 140 --out bench/out

Writes ``mirror_cost.json`` and ``mirror_cost.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ((0, 1, 2), (), (0,), (1,), (2,), (1, 2), (0, 1), (0, 2))


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    ap = argparse.ArgumentParser(prog="python -m bench.mirror_cost")
    ap.add_argument(
        "--manifest", type=Path, default=ROOT / "tests/data/nnunet_phantom/phantom.json"
    )
    ap.add_argument("--engine", choices=("openvino", "onnxruntime"), default="openvino")
    ap.add_argument(
        "--ct",
        choices=("oracle", "body"),
        default="oracle",
        help="oracle: the phantom the model was trained on (the oracle series, 0.7 x 0.7 x "
        "1.25 mm); body: a 512 x 512 CT of a larger body (--slices), outside its training",
    )
    ap.add_argument("--slices", type=int, default=140)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = ap.parse_args(argv)
    from bench.nnunet_gpu import plane_geometry
    from scripts.nnunet_phantom import Anatomy, Grid, oracle_cases, sample
    from segnode.engines.base import create_engine
    from segnode.engines.calibrate import dice_per_label
    from segnode.engines.manifest_parse import load_manifest
    from segnode.engines.trained import segment_trained

    if args.ct == "oracle":
        case = oracle_cases()[0]
        grid, anatomy = case.grid, case.anatomy
    else:
        grid = Grid(slices=args.slices, rows=512, columns=512, pixel=0.7, slice=1.25)
        half_z = args.slices * 1.25 / 2
        anatomy = Anatomy(body_axes=(150.0, 110.0), body_z=(-0.8 * half_z, 0.8 * half_z), seed=3)
    hu16, truth = sample(grid, anatomy)
    hu = hu16.astype(np.float32)
    geometry = plane_geometry(grid, grid.slices)
    manifest = load_manifest(args.manifest)
    options: dict[str, Any] = {"threads": len(os.sched_getaffinity(0))}
    if args.engine == "openvino":
        options["precision"] = "bf16"
    engine = create_engine(args.engine, **options)
    engine.load(manifest)
    own = manifest.model_contract().mirror_axes
    rows: list[dict[str, Any]] = []
    reference = None
    for axes in sorted(set(VARIANTS) | {own}, key=lambda a: (a != own, len(a), a)):
        m = replace(manifest, contract=replace(manifest.model_contract(), mirror_axes=axes))
        t0 = time.perf_counter()
        labels = segment_trained(engine, m, hu, geometry)
        seconds = time.perf_counter() - t0
        if reference is None:
            reference = labels
        row = {
            "mirror_axes": list(axes),
            "passes": 2 ** len(axes),
            "seconds": round(seconds, 2),
            "dice_vs_truth": dice_per_label([labels], [truth], manifest),
            "dice_vs_manifest_mirroring": dice_per_label([labels], [reference], manifest),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    engine.close()
    result = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "model": f"{manifest.name} {manifest.version}",
        "engine": args.engine,
        "ct": "x".join(map(str, hu.shape[::-1])) + f" ({args.ct})",
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mirror_cost.json").write_text(json.dumps(result, indent=2))
    names = [s.name for s in manifest.labels]
    lines = [
        f"# Mirroring cost: {result['model']}, {args.engine}, CT {result['ct']}",
        "",
        f"{result['date']} (`python -m bench.mirror_cost`). Dice per label against the "
        "phantom's truth, and the lowest against the manifest's own mirroring.",
        "",
        "| mirror_axes | passes | time (s) | "
        + " | ".join(f"Dice {n}" for n in names)
        + " | lowest vs manifest's |",
        "|---|---:|---:|" + "---:|" * len(names) + "---:|",
    ]
    for r in rows:
        truth_d = r["dice_vs_truth"]
        lines.append(
            f"| {r['mirror_axes']} | {r['passes']} | {r['seconds']:.1f} | "
            + " | ".join(f"{truth_d.get(n, float('nan')):.4f}" for n in names)
            + f" | {min(r['dice_vs_manifest_mirroring'].values(), default=1.0):.4f} |"
        )
    (args.out / "mirror_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
