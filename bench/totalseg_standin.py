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
import numpy.typing as npt

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
    anatomy: tuple[int, ...] | None = None,
) -> int:
    """Write the U-Net to ``path``; return its parameter count.

    With ``anatomy`` (the structure of each output channel 1..``labels``, 1-117), the head's
    random logits are scaled down by :data:`ANATOMY_EPSILON` and an intensity classifier is
    added (:func:`anatomy_head`): the label map is :func:`anatomy_hu`'s structures, not noise.
    """
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
    out = "logits" if anatomy is None else "head.o"
    nodes.append(helper.make_node("Conv", [x, param("head.w", head), param("head.b", bias)], [out]))
    if anatomy is not None:
        if len(anatomy) != labels:
            raise ValueError(f"anatomy names {len(anatomy)} structures for {labels} labels")
        anatomy_head(nodes, param, "head.o", "logits", anatomy)
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


ANATOMY_EPSILON = 1e-3
"""Scale of the random head's logits beside the intensity classifier (whose margin is
:data:`ANATOMY_RADIUS_HU` squared, in units of 10 HU: 0.16)."""
ANATOMY_RADIUS_HU = 4.0
"""A voxel within this many HU of a structure's value is that structure."""
ANATOMY_EDGE_HU = 4.0
"""A voxel whose HU changes by more than this per voxel (central differences) is an edge:
background, so that a blend of two values at a boundary is no third structure."""
ANATOMY_NOISE_HU = 1.0


def structure_hu(index: int) -> float:
    """The HU of structure ``index`` (1-117) in :func:`anatomy_hu`: 11 HU apart, -689..587."""
    return -700.0 + 11.0 * index


def anatomy_head(
    nodes: list[Any], param: Any, head: str, out: str, anatomy: tuple[int, ...]
) -> None:
    """Logits ``out`` = ``ANATOMY_EPSILON * head`` + an intensity classifier on the
    network's input (CT-normalised with :data:`INTENSITY`): channel ``j`` (structure
    ``anatomy[j-1]``) scores ``r^2 - d^2 - g^2``, background 0, with ``d`` the distance of
    the voxel's HU from the structure's (:func:`structure_hu`) and ``g`` the HU gradient's
    size beyond :data:`ANATOMY_EDGE_HU`, all in units of 10 HU (FP16 keeps them exact
    enough). A few elementwise operations and two small convolutions per tile: the U-Net's
    cost is unchanged. For benchmarks only: an output of realistic size (a trained
    network's label map), the network's compute, random weights."""
    from onnx import helper  # noqa: PLC0415

    std, mean = INTENSITY["std"], INTENSITY["mean"]
    channels = len(anatomy) + 1
    # d: per channel, (HU - structure HU) / 10 = x * std / 10 + (mean - HU_j) / 10
    w = np.full((channels, 1, 1, 1, 1), std / 10.0)
    b = np.array([0.0] + [(mean - structure_hu(g)) / 10.0 for g in anatomy])
    w[0] = 0.0
    nodes.append(
        helper.make_node("Conv", ["input", param("anat.dw", w), param("anat.db", b)], ["anat.d"])
    )
    nodes.append(helper.make_node("Mul", ["anat.d", "anat.d"], ["anat.d2"]))
    # g^2: central differences along z, y and x, in 10 HU per voxel
    k = np.zeros((3, 1, 3, 3, 3))
    k[0, 0, 2, 1, 1], k[0, 0, 0, 1, 1] = 0.5, -0.5
    k[1, 0, 1, 2, 1], k[1, 0, 1, 0, 1] = 0.5, -0.5
    k[2, 0, 1, 1, 2], k[2, 0, 1, 1, 0] = 0.5, -0.5
    nodes.append(
        helper.make_node(
            "Conv", ["input", param("anat.gw", k * std / 10.0)], ["anat.g"], pads=[1] * 6
        )
    )
    nodes.append(helper.make_node("Mul", ["anat.g", "anat.g"], ["anat.g2c"]))
    nodes.append(
        helper.make_node(
            "Conv", ["anat.g2c", param("anat.sum", np.ones((1, 3, 1, 1, 1)))], ["anat.g2"]
        )
    )
    r2 = (ANATOMY_RADIUS_HU / 10.0) ** 2
    gate = r2 / (ANATOMY_EDGE_HU / 10.0) ** 2
    minus = np.full((1, channels, 1, 1, 1), -1.0)
    minus[0, 0] = 0.0
    radius = np.full((1, channels, 1, 1, 1), r2)
    radius[0, 0] = 0.0
    nodes.append(helper.make_node("Mul", ["anat.d2", param("anat.minus", minus)], ["anat.a"]))
    nodes.append(helper.make_node("Mul", ["anat.g2", param("anat.gate", minus * gate)], ["anat.b"]))
    nodes.append(helper.make_node("Add", ["anat.a", "anat.b"], ["anat.ab"]))
    nodes.append(helper.make_node("Add", ["anat.ab", param("anat.r2", radius)], ["anat.cls"]))
    eps = np.full((1, 1, 1, 1, 1), ANATOMY_EPSILON)
    nodes.append(helper.make_node("Mul", [head, param("anat.eps", eps)], ["anat.h"]))
    nodes.append(helper.make_node("Add", ["anat.cls", "anat.h"], [out]))


def anatomy_hu(
    shape: tuple[int, int, int], *, seed: int = 34
) -> tuple[npt.NDArray[np.int16], npt.NDArray[np.uint8]]:
    """A body CT of ``shape`` whose 117 structures (``bench.seg_size.blob_labels``: organs,
    vertebrae, ribs, muscles, vessels, glands) each have their own HU
    (:func:`structure_hu`), in a body of 800 HU and air; noise of
    :data:`ANATOMY_NOISE_HU`. Returns the HU and the label map."""
    from bench.seg_size import blob_labels  # noqa: PLC0415

    labels = blob_labels(shape, seed=seed)
    slices, rows, columns = shape
    y, x = np.ogrid[:rows, :columns]
    body = ((y - rows / 2) / (rows * 0.34 + 8)) ** 2 + (
        (x - columns / 2) / (columns * 0.44 + 8)
    ) ** 2 <= 1
    lut = np.array([800.0] + [structure_hu(g) for g in range(1, 118)], dtype=np.float32)
    hu = lut[labels]
    hu[:, ~body] = np.where(labels[:, ~body] > 0, hu[:, ~body], -1000.0)
    rng = np.random.default_rng(seed)
    hu += rng.normal(0.0, ANATOMY_NOISE_HU, hu.shape).astype(np.float32)
    return np.clip(np.rint(hu), -1024, 3071).astype(np.int16), labels


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


def write_total(out: Path, *, spacing: float = 1.5, anatomy: bool = False) -> list[int]:
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
                anatomy=tuple(range(first, first + labels)) if anatomy else None,
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
    ap.add_argument(
        "--anatomy",
        action="store_true",
        help="add the intensity classifier: the label map is anatomy_hu's structures",
    )
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.task == "total":
        counts = write_total(args.out, anatomy=args.anatomy)
        print(f"{args.out}: total.json, parts of {[round(c / 1e6, 2) for c in counts]} M")
        return 0
    anatomy = tuple(range(1, args.labels + 1)) if args.anatomy else None
    params = build_onnx(args.out / "fold_0.onnx", labels=args.labels, anatomy=anatomy)
    for name, profile in (("profile", True), ("plain", False)):
        text = json.dumps(manifest(f"standin_{name}", profile=profile, labels=args.labels))
        (args.out / f"{name}.json").write_text(text + "\n")
    print(f"{args.out}: {params / 1e6:.2f} M parameters, {args.labels} labels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
