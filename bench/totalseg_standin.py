"""A stand-in for TotalSegmentator's ``--fast`` model of the ``total`` task (issue 37).

nnU-Net's default ``3d_fullres`` plans for CT at 3 mm give a ``PlainConvUNet`` with patch
112 x 128 x 112, 5 stages of 32, 64, 128, 256 and 320 features (two 3x3x3 convolutions per
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

PATCH = (112, 128, 112)
FEATURES = (32, 64, 128, 256, 320)
LABELS = 117
SPACING = (3.0, 3.0, 3.0)
INTENSITY = {
    "mean": -68.91615295410156,
    "std": 338.39581298828125,
    "percentile_00_5": -858.0,
    "percentile_99_5": 671.0,
}


def build_onnx(path: Path, *, labels: int = LABELS, seed: int = 297) -> int:
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
    for stage, cout in enumerate(FEATURES):
        x = conv(x, cin, cout, f"enc{stage}a", stride=1 if stage == 0 else 2)
        x = conv(x, cout, cout, f"enc{stage}b")
        skips.append(x)
        cin = cout
    for stage in range(len(FEATURES) - 2, -1, -1):
        cout = FEATURES[stage]
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
        "standin297",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, *PATCH])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", labels + 1, *PATCH])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return count


def manifest(name: str, *, profile: bool, labels: int = LABELS) -> dict[str, Any]:
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
        "patch_size": list(PATCH),
        "overlap": 0.2 if profile else 0.5,
        "sigma_scale": 0.125,
        "mirror_axes": [],
        "batch": {"min": 1, "opt": 2, "max": 4},
        "fp16": True,
        "geometry": {
            "spacing": list(SPACING),
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
                "name": f"structure_{k:03d}",
                "category": ["85756007", "SCT", "Tissue"],
                "type": ["85756007", "SCT", "Tissue"],
                "color": [(37 * k) % 256, (91 * k) % 256, (53 * k) % 256],
            }
            for k in range(1, labels + 1)
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """Write ``fold_0.onnx``, ``profile.json`` and ``plain.json`` to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--labels", type=int, default=LABELS)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    params = build_onnx(args.out / "fold_0.onnx", labels=args.labels)
    for name, profile in (("profile", True), ("plain", False)):
        text = json.dumps(manifest(f"standin_{name}", profile=profile, labels=args.labels))
        (args.out / f"{name}.json").write_text(text + "\n")
    print(f"{args.out}: {params / 1e6:.2f} M parameters, {args.labels} labels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
