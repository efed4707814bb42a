"""A stand-in for TotalSegmentator's ``--fast`` model of the ``total`` task (issue 37).

nnU-Net's default ``3d_fullres`` plans for CT at 3 mm give a ``PlainConvUNet`` with patch
128 x 112 x 112 (z, y, x), 5 stages of 32, 64, 128, 256 and 320 features (two 3x3x3 convolutions per
stage, instance norm, leaky ReLU, strides 1, 2, 2, 2, 2; transposed convolutions up) and
about 16.6 M parameters; TotalSegmentator's Dataset297 has 117 labels and background. The
graph is written with ``onnx.helper`` (no torch needed), with random He-initialised weights
and the segmentation head's bias favouring background, so that the label map holds mostly
background and some of every structure, like an untrained network's.

Two manifests share the ONNX file:

* ``profile.json``: TotalSegmentator's own settings for ``--fast`` (orientation SAR, overlap
  0.2, no mirroring, order 1 in and order 0 back on corner-aligned grids, 3 mm), what
  ``segnode model import totalsegmentator --task total_fast`` writes;
* ``plain.json``: what ``segnode model import nnunet`` of the same folder wrote before it
  recognised TotalSegmentator's datasets (orientation SPL, overlap 0.5, nnU-Net's order-3
  image / order-1 logits resampling).

Run::

    .venv/bin/python -m bench.totalseg_standin --out bench/out/standin
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

PATCH = (128, 112, 112)  # nnU-Net's planner, (z, y, x): bench/totalseg_plans/plans_297.json
FEATURES = (32, 64, 128, 256, 320)
LABELS = 117
SPACING = (3.0, 3.0, 3.0)
#: ``total`` (1.5 mm): nnU-Net's default plans, and the labels of datasets 291-295
#: (``class_map_5_parts``: organs 24, vertebrae 26, cardiac 18, muscles 23, ribs 26).
TOTAL_PATCH = (128, 128, 128)
TOTAL_FEATURES = (32, 64, 128, 256, 320, 320)
TOTAL_PARTS = ((291, 24), (292, 26), (293, 18), (294, 23), (295, 26))
INTENSITY = {
    "mean": -68.91615295410156,
    "std": 338.39581298828125,
    "percentile_00_5": -858.0,
    "percentile_99_5": 671.0,
}


def build_onnx(
    path: Path,
    *,
    labels: int = LABELS,
    seed: int = 297,
    features: tuple[int, ...] = FEATURES,
    patch: tuple[int, int, int] = PATCH,
) -> int:
    """Write the U-Net to ``path``; return its parameter count."""
    import onnx  # noqa: PLC0415
    from onnx import TensorProto, helper, numpy_helper  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    nodes: list[Any] = []
    inits: list[Any] = []
    count = 0

    def param(name: str, array: np.ndarray) -> str:
        nonlocal count
        count += array.size
        inits.append(numpy_helper.from_array(array.astype(np.float32), name))
        return name

    def conv(x: str, cin: int, cout: int, name: str, stride: int = 1) -> str:
        w = rng.normal(0.0, np.sqrt(2.0 / (cin * 27)), (cout, cin, 3, 3, 3))
        nodes.append(
            helper.make_node(
                "Conv",
                [x, param(f"{name}.w", w), param(f"{name}.b", np.zeros(cout))],
                [f"{name}.c"],
                kernel_shape=[3, 3, 3],
                pads=[1] * 6,
                strides=[stride] * 3,
            )
        )
        nodes.append(
            helper.make_node(
                "InstanceNormalization",
                [
                    f"{name}.c",
                    param(f"{name}.g", np.ones(cout)),
                    param(f"{name}.n", np.zeros(cout)),
                ],
                [f"{name}.i"],
                epsilon=1e-5,
            )
        )
        nodes.append(helper.make_node("LeakyRelu", [f"{name}.i"], [f"{name}.o"], alpha=0.01))
        return f"{name}.o"

    x, cin, skips = "input", 1, []
    for stage, cout in enumerate(features):
        x = conv(x, cin, cout, f"enc{stage}a", stride=1 if stage == 0 else 2)
        x = conv(x, cout, cout, f"enc{stage}b")
        skips.append(x)
        cin = cout
    for stage in range(len(features) - 2, -1, -1):
        cout = features[stage]
        w = rng.normal(0.0, np.sqrt(2.0 / (cin * 8)), (cin, cout, 2, 2, 2))
        nodes.append(
            helper.make_node(
                "ConvTranspose",
                [x, param(f"up{stage}.w", w)],
                [f"up{stage}.o"],
                kernel_shape=[2, 2, 2],
                strides=[2, 2, 2],
            )
        )
        nodes.append(
            helper.make_node("Concat", [f"up{stage}.o", skips[stage]], [f"cat{stage}"], axis=1)
        )
        x = conv(f"cat{stage}", 2 * cout, cout, f"dec{stage}a")
        x = conv(x, cout, cout, f"dec{stage}b")
        cin = cout
    head = rng.normal(0.0, np.sqrt(2.0 / cin), (labels + 1, cin, 1, 1, 1))
    bias = np.full(labels + 1, -1.0)
    bias[0] = 2.0  # background favoured
    nodes.append(
        helper.make_node("Conv", [x, param("head.w", head), param("head.b", bias)], ["logits"])
    )
    graph = helper.make_graph(
        nodes,
        f"standin{seed}",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, *patch])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", labels + 1, *patch])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return count


def manifest(
    name: str,
    *,
    profile: bool,
    labels: int = LABELS,
    patch: tuple[int, int, int] = PATCH,
    spacing: tuple[float, float, float] = SPACING,
    first: int = 1,
) -> dict[str, Any]:
    """A version-2 manifest of the stand-in: TotalSegmentator's settings or nnU-Net's."""
    resampling: dict[str, Any] = {
        "data_order": 1 if profile else 3,
        "logits_order": 0 if profile else 1,
        "order_z": 0,
        "anisotropy_threshold": 3.0,
        "force_separate_z": False if profile else None,
    }
    if profile:
        resampling["scheme"] = "totalsegmentator"
    return {
        "manifest_version": 2,
        "name": name,
        "version": "1.0.0",
        "folds": ["fold_0.onnx"],
        "input_name": "input",
        "output_name": "logits",
        "output_kind": "logits",
        "patch_size": list(patch),
        "overlap": 0.2 if profile else 0.5,
        "sigma_scale": 0.125,
        "mirror_axes": [],
        "batch": {"min": 1, "opt": 2, "max": 4},
        "fp16": True,
        "geometry": {
            "spacing": list(spacing),
            "orientation": "SAR" if profile else "SPL",
            "transpose_forward": [0, 1, 2],
            "transpose_backward": [0, 1, 2],
            "gantry_tilt_allowed": False,
        },
        "preprocessing": {"crop_to_nonzero": True, "normalization": "ct", "intensity": INTENSITY},
        "resampling": resampling,
        "labels": [
            {
                "value": k,
                "name": f"structure_{first + k - 1:03d}",
                "category": ["85756007", "SCT", "Tissue"],
                "type": ["85756007", "SCT", "Tissue"],
                "color": [(37 * k) % 256, (91 * k) % 256, (53 * k) % 256],
            }
            for k in range(1, labels + 1)
        ],
    }


def write_total(out: Path, *, spacing: float = 1.5) -> list[int]:
    """The ``total`` task's shape: five parts (datasets 291-295) of nnU-Net's default 1.5 mm
    network (6 stages, 32-320 features, patch 128^3), with the parts' true label counts, and
    the composite manifest ``total.json`` over them; return the parameter counts."""
    counts: list[int] = []
    parts: list[dict[str, Any]] = []
    merged: list[dict[str, Any]] = []
    first = 1
    for task_id, labels in TOTAL_PARTS:
        folder = out / f"part_{task_id}"
        folder.mkdir(parents=True, exist_ok=True)
        counts.append(
            build_onnx(
                folder / "fold_0.onnx",
                labels=labels,
                seed=task_id,
                features=TOTAL_FEATURES,
                patch=TOTAL_PATCH,
            )
        )
        part = manifest(
            f"total_part_{task_id}",
            profile=True,
            labels=labels,
            patch=TOTAL_PATCH,
            spacing=(spacing,) * 3,
            first=first,
        )
        (folder / "model.json").write_text(json.dumps(part, indent=1) + "\n")
        parts.append(
            {
                "manifest": f"part_{task_id}/model.json",
                "labels": {str(k): first + k - 1 for k in range(1, labels + 1)},
            }
        )
        merged += [dict(e, value=first + e["value"] - 1) for e in part["labels"]]
        first += labels
    composite = {
        "manifest_version": 2,
        "name": "total_standin",
        "version": "1.0.0",
        "labels": merged,
        "parts": parts,
    }
    (out / "total.json").write_text(json.dumps(composite, indent=1) + "\n")
    return counts


def main(argv: list[str] | None = None) -> int:
    """Write ``fold_0.onnx``, ``profile.json`` and ``plain.json`` to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--labels", type=int, default=LABELS)
    ap.add_argument(
        "--task",
        choices=("total_fast", "total"),
        default="total_fast",
        help="total: the five 1.5 mm parts and total.json",
    )
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.task == "total":
        counts = write_total(args.out)
        print(f"{args.out}: total.json, parts of {[round(c / 1e6, 2) for c in counts]} M")
        return 0
    params = build_onnx(args.out / "fold_0.onnx", labels=args.labels)
    for name, profile in (("profile", True), ("plain", False)):
        text = json.dumps(manifest(f"standin_{name}", profile=profile, labels=args.labels))
        (args.out / f"{name}.json").write_text(text + "\n")
    print(f"{args.out}: {params / 1e6:.2f} M parameters, {args.labels} labels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
