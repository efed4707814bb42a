"""Build the default model, "tissue": CT physics written as an ONNX graph, no weights.

Run ``python -m segnode.engines.models.build_tissue [--out-dir DIR]``; it writes ``tissue.onnx`` and
``tissue.json`` (the manifest, see :mod:`segnode.engines.manifest`) into ``engines/models/tissue/``.
The output is byte-for-byte deterministic, so the committed files can be checked against a
fresh build.

The graph takes Hounsfield units (clipped to [-1024, 3071] by the manifest's preprocessing) as
``(N, 1, Z, Y, X)`` float32 and returns the label of each voxel, ``(N, 1, Z, Y, X)`` uint8
(manifest ``"output_kind": "labels"``): 0 background, 1 body (the rest of the body: skin rim,
partial-volume voxels, -500..-400 and 150..200 HU), 2 air inside the body (lung, airway,
bowel gas), 3 adipose tissue, 4 soft tissue, 5 bone. Earlier builds of this version returned
the one-hot probabilities of these classes, ``(N, 6, Z, Y, X)`` float32, for the sliding
window to arg-max; the label maps are the same, voxel for voxel (tests/test_tissue_model.py
holds the proof), for a fraction of the output.

How it works, per slice (all thresholds in :class:`TissueParameters`):

1. *Foreground* is ``HU > -500``, opened with a 5x5 square: noise specks, blankets, cables
   and thin table shells go.
2. The foreground is max-pooled 4x4 to a coarse grid. There, *outside* starts as every voxel
   from which a straight ray along +x, -x, +y or -y leaves the patch without meeting
   foreground (two ``CumSum`` per axis), then grows through free coarse voxels by 48
   4-connected geodesic steps (``MaxPool`` masked by the free space). The rays find the open
   air; the growth reaches air that a head holder or a curved table encloses along every axis
   but that is still connected to the open air (up to ~190 voxels away).
3. Everything not outside is a *filled* object. An opening with a 5x5 coarse square (20 fine
   voxels) keeps only thick filled objects, the body; thin shells such as head holders vanish.
   Up-sampled to full resolution (nearest neighbour: ``Expand`` and ``DepthToSpace``) this
   decides, per voxel: outside; near the outside, where only foreground counts as body; or
   deep inside, where air is body too.
4. Inside the body, thresholds split the classes: air ``< -400`` HU (closed with a 5x5 square
   so that small lung vessels stay in the lung), bone ``> 200`` HU and, on a 3x3 mean that
   halves the noise, fat ``[-190, -30]`` and soft tissue ``(-30, 150]``. Fat and soft tissue
   voxels next to air are partial volume and stay "body".

The morphology on thresholded masks runs on the HU themselves: the dilation of ``HU > t`` is
``max(HU) > t``, its erosion ``min(HU) > t`` with ``min(HU) = -max(-HU)``, so one opening of
the HU, ``max(min(HU))``, yields both the opened foreground and the closed air, and the three
cases of step 3 become an offset added to it before a single comparison. The label is
assembled from three bits, ``b0 + 2 b1 + 4 b2``.

Every kernel is in-plane: the graph reshapes the patch into a batch of ``N * Z`` slices
(``(N * Z, 1, Y, X)``) at its input and back at its output. Slice spacing ranges from 0.5 to
5 mm and the graph cannot see it, so mixing slices would blur thick-slice studies; it also
makes each slice's labels independent of where a patch starts along z, so z patch borders
leave no seams and the patches need no overlap along z (:data:`OVERLAP`). The patch is thin
along z (:data:`PATCH_SIZE`): on the CPU its intermediate tensors then stay in cache.
In-plane, the rays and the growth need the whole cross-section: the default 512x512 patch
holds a standard CT matrix whole. On a larger matrix the patches overlap and the Gaussian
blending favours the patch whose centre is nearest, but air cut by a patch border may there
be called outside.

Only operators that TensorRT's ONNX parser supports are used (Greater, Less, Not, And, Or,
Cast, Neg, Sub, Mul, Add, Max, MaxPool, AveragePool, CumSum with a constant axis, Reshape,
Expand, DepthToSpace), at opset 17 with static patch dimensions and a dynamic
batch dimension; uint8 appears only as the output of the final Cast, as TensorRT requires.
Values are HU, 0/1 masks, counts up to 128, the offset (+-8192) and labels 0-5, all exact in
half precision.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

from segnode.engines.models import MODELS_DIR

NAME = "tissue"
VERSION = "1.0.0"
OPSET = 17
IR_VERSION = 8
INPUT_NAME = "ct"
OUTPUT_NAME = "labels"
PATCH_SIZE: tuple[int, int, int] = (2, 512, 512)
"""Two whole slices: small enough to stay in a core's cache on the CPU."""
BATCH_MAX = 32
"""Largest batch of the TensorRT profile: 64 slices, for GPU backends given a larger batch."""
OVERLAP: tuple[float, float, float] = (0.0, 0.125, 0.125)
"""No overlap along z: each slice is labelled on its own, wherever the patch starts."""
CLIP: tuple[float, float] = (-1024.0, 3071.0)
COARSE = 4
"""In-plane down-sampling factor of the coarse grid; patch y and x must be multiples of it."""
_OFFSET = 8192.0
"""Offset that forces "body" on (+) or off (-) whatever the clipped HU; a power of two, exact
in half precision and below the float16 converter's clamp (1e4)."""


@dataclass(frozen=True)
class TissueParameters:
    """Thresholds (HU) and kernel sizes (voxels) of the tissue graph."""

    body_hu: float = -500.0
    air_hu: float = -400.0
    fat_low_hu: float = -190.0
    fat_high_hu: float = -30.0
    soft_high_hu: float = 150.0
    bone_hu: float = 200.0
    denoise_kernel: int = 5
    geodesic_steps: int = 48
    core_kernel: int = 5
    lung_close_kernel: int = 5
    mean_kernel: int = 3


PARAMETERS = TissueParameters()

SCT_TISSUE = ["85756007", "SCT", "Tissue"]
SCT_ANATOMICAL_STRUCTURE = ["91723000", "SCT", "Anatomical Structure"]

LABELS: list[dict[str, Any]] = [
    {"value": value, "name": name, "category": category, "type": type_, "color": color}
    for value, name, category, type_, color in (
        (1, "Body", SCT_ANATOMICAL_STRUCTURE, ["38266002", "SCT", "Entire body"], [241, 214, 145]),
        (
            2,
            "Lung and airway",
            SCT_ANATOMICAL_STRUCTURE,
            ["39607008", "SCT", "Lung"],
            [102, 180, 255],
        ),
        (3, "Adipose tissue", SCT_TISSUE, ["55603005", "SCT", "Fat"], [230, 220, 70]),
        (4, "Soft tissue", SCT_TISSUE, ["87784001", "SCT", "Soft tissue"], [192, 104, 88]),
        (5, "Bone", SCT_TISSUE, ["3138006", "SCT", "Bone"], [250, 250, 225]),
    )
]
"""Output classes with codes from DICOM PS3.16: categories from CID 7150, body and lung types
from CID 7151, fat, soft tissue and bone (tissue, 3138006) types from CID 7166."""


class _Graph:
    """Collects nodes and constants with deterministic names.

    Spatial helpers work on ``(S, 1, Y, X)`` tensors: one slice per batch entry.
    """

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0
        self._constants: dict[tuple[str, tuple[int, ...], str], str] = {}

    def constant(self, value: Any, *, dtype: type = np.float32) -> str:
        """Name of an initializer holding ``value`` (shared between uses)."""
        array: npt.NDArray[Any] = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, repr(array.tolist()))
        name = self._constants.get(key)
        if name is None:
            name = f"const_{len(self._constants)}"
            self._constants[key] = name
            self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def op(self, op_type: str, *inputs: str, output: str | None = None, **attrs: Any) -> str:
        """Append a node and return the name of its (single) output."""
        self._count += 1
        name = output or f"{op_type.lower()}_{self._count}"
        node = helper.make_node(
            op_type, list(inputs), [name], name=f"n{self._count}_{op_type}", **attrs
        )
        self.nodes.append(node)
        return name

    def greater(self, x: str, threshold: float) -> str:
        """``x > threshold`` (bool)."""
        return self.op("Greater", x, self.constant(threshold))

    def less(self, x: str, threshold: float) -> str:
        """``x < threshold`` (bool)."""
        return self.op("Less", x, self.constant(threshold))

    def and_not(self, mask: str, excluded: str) -> str:
        """``mask and not excluded`` (bool)."""
        return self.op("And", mask, self.op("Not", excluded))

    def to_float(self, mask: str) -> str:
        """bool mask to float 0/1."""
        return self.op("Cast", mask, to=TensorProto.FLOAT)

    def invert(self, mask: str) -> str:
        """``1 - mask`` for a float 0/1 mask."""
        return self.op("Sub", self.constant(1.0), mask)

    # -- in-plane morphology -------------------------------------------------------------
    def max_pool(self, x: str, rows: int, cols: int) -> str:
        """Running maximum over a centred ``rows x cols`` window (odd sizes).

        MaxPool ignores its padding, so the window shrinks at the slice border: erosions
        do not eat in from the border.
        """
        if rows <= 1 and cols <= 1:
            return x
        return self.op(
            "MaxPool",
            x,
            kernel_shape=[rows, cols],
            pads=[rows // 2, cols // 2, rows // 2, cols // 2],
            strides=[1, 1],
        )

    def dilate(self, mask: str, size: int) -> str:
        """Dilation of a float 0/1 mask by a ``size x size`` square."""
        return self.max_pool(mask, size, size)

    def erode(self, mask: str, size: int) -> str:
        """Erosion of a float 0/1 mask by a ``size x size`` square."""
        if size <= 1:
            return mask
        return self.invert(self.dilate(self.invert(mask), size))

    def enclosed(self, mask: str) -> str:
        """Voxels with ``mask`` somewhere before and after them along both y and x."""
        result = ""
        for axis in (2, 3):
            axis_name = self.constant(axis, dtype=np.int64)
            for reverse in (0, 1):
                seen = self.greater(self.op("CumSum", mask, axis_name, reverse=reverse), 0.5)
                result = self.op("And", result, seen) if result else seen
        return result

    def upsample(self, x: str) -> str:
        """Nearest-neighbour up-sampling by COARSE: Expand to COARSE**2 equal channels, then
        DepthToSpace puts them side by side.

        Weight-free (a ConvTranspose with a kernel of ones would be as fast in ONNX Runtime,
        but its weights turn half precision in the torch backend while its float32 input
        does not) and faster in ONNX Runtime than Reshape + Expand.
        """
        channels = self.constant([1, COARSE * COARSE, 1, 1], dtype=np.int64)
        return self.op("DepthToSpace", self.op("Expand", x, channels), blocksize=COARSE, mode="CRD")


def _build_graph(g: _Graph, p: TissueParameters, shape: tuple[int, int, int]) -> str:
    z, rows, cols = shape
    # One slice per batch entry: every operator below is in-plane.
    hu = g.op("Reshape", INPUT_NAME, g.constant([-1, 1, rows, cols], dtype=np.int64))
    neg_hu = g.op("Neg", hu)

    # Masks "HU > t" are opened and closed on the HU themselves: a dilation of the mask is
    # the mask of the running maximum, an erosion that of the running minimum (-max(-HU)).
    # max(min(HU)) over k x k squares thus gives the opened foreground (> body_hu) and the
    # closed air (< air_hu) alike.
    openings: dict[int, str] = {}

    def opened(k: int) -> str:
        if k not in openings:
            openings[k] = g.max_pool(g.op("Neg", g.max_pool(neg_hu, k, k)), k, k)
        return openings[k]

    fg_hu = opened(p.denoise_kernel)
    lung = g.less(opened(p.lung_close_kernel), p.air_hu)
    body = g.greater(g.op("Add", fg_hu, g.upsample(_body_offset(g, p, fg_hu))), p.body_hu)

    # Classes inside the body: bone, then fat and soft tissue on a 3x3 mean, except next to
    # air (partial volume).
    k = p.mean_kernel
    mean = g.op(
        "AveragePool",
        hu,
        kernel_shape=[k, k],
        pads=[k // 2, k // 2, k // 2, k // 2],
        strides=[1, 1],
        count_include_pad=0,
    )
    bone = g.greater(hu, p.bone_hu)
    near_air = g.greater(g.max_pool(neg_hu, 3, 3), -p.air_hu)
    above_fat = g.greater(mean, p.fat_high_hu)
    tissue = g.op("Not", g.op("Or", bone, near_air))
    fat = g.and_not(g.and_not(tissue, above_fat), g.less(mean, p.fat_low_hu))
    soft = g.and_not(g.op("And", tissue, above_fat), g.greater(mean, p.soft_high_hu))

    # The label's bits, label = b0 + 2 b1 + 4 b2: 1 body 001, 2 lung 010, 3 fat 011,
    # 4 soft tissue 100, 5 bone 101; lung comes before bone, bone before fat and soft tissue.
    body_not_lung = g.and_not(body, lung)
    b0 = g.and_not(body_not_lung, soft)
    b1 = g.op("And", body, g.op("Or", lung, fat))
    b2 = g.op("And", body_not_lung, g.op("Or", bone, soft))
    twice = g.op("Add", g.to_float(b1), g.op("Add", g.to_float(b2), g.to_float(b2)))
    label = g.op("Add", g.to_float(b0), g.op("Add", twice, twice))
    label = g.op("Reshape", label, g.constant([-1, 1, z, rows, cols], dtype=np.int64))
    return g.op("Cast", label, to=TensorProto.UINT8, output=OUTPUT_NAME)


def _body_offset(g: _Graph, p: TissueParameters, fg_hu: str) -> str:
    """Coarse offset that, added to the opened HU, makes "body" one comparison.

    -_OFFSET outside the body (never body), 0 near the outside (body where foreground),
    +_OFFSET deep inside (body whatever the HU).
    """
    coarse_max = g.op("MaxPool", fg_hu, kernel_shape=[COARSE, COARSE], strides=[COARSE, COARSE])
    coarse = g.to_float(g.greater(coarse_max, p.body_hu))
    # Open air: rays, then geodesic growth through free coarse voxels.
    free = g.invert(coarse)
    outside = g.to_float(g.op("Not", g.enclosed(coarse)))
    for _ in range(p.geodesic_steps):
        grown = g.op("Max", g.max_pool(outside, 3, 1), g.max_pool(outside, 1, 3))
        outside = g.op("Mul", grown, free)
    filled = g.invert(outside)
    core = g.dilate(g.erode(filled, p.core_kernel), p.core_kernel)
    keep = g.op("Mul", g.dilate(core, 3), filled)
    deep = g.invert(g.dilate(outside, 3))
    code = g.op("Mul", keep, g.op("Add", g.constant(1.0), deep))  # 0, 1 or 2
    return g.op("Mul", g.op("Sub", code, g.constant(1.0)), g.constant(_OFFSET))


def build_model(
    patch_size: tuple[int, int, int] = PATCH_SIZE, parameters: TissueParameters = PARAMETERS
) -> onnx.ModelProto:
    """Return the tissue graph for patches of ``patch_size`` (z, y, x).

    Raises
    ------
    ValueError
        If y or x is not a multiple of the coarse factor (4).
    """
    z, y, x = patch_size
    if y % COARSE or x % COARSE or min(patch_size) < 1:
        raise ValueError(f"patch y and x must be positive multiples of {COARSE}: {patch_size}")
    g = _Graph()
    output = _build_graph(g, parameters, patch_size)
    graph = helper.make_graph(
        g.nodes,
        NAME,
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", 1, z, y, x])],
        [helper.make_tensor_value_info(output, TensorProto.UINT8, ["batch", 1, z, y, x])],
        initializer=g.initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="segnode.engines.models.build_tissue",
        producer_version=VERSION,
        doc_string="Weight-free CT tissue segmentation from Hounsfield thresholds and morphology.",
    )
    model.ir_version = IR_VERSION
    model.model_version = 1
    onnx.checker.check_model(model, full_check=True)
    return model


def manifest_dict(patch_size: tuple[int, int, int] = PATCH_SIZE) -> dict[str, Any]:
    """The manifest written beside the model (format in :mod:`segnode.engines.manifest`)."""
    return {
        "name": NAME,
        "version": VERSION,
        "onnx": f"{NAME}.onnx",
        "input_name": INPUT_NAME,
        "output_name": OUTPUT_NAME,
        "output_kind": "labels",
        "patch_size": list(patch_size),
        "overlap": list(OVERLAP),
        "batch": {"min": 1, "opt": 1, "max": BATCH_MAX},
        "fp16": True,
        "preprocessing": {"clip": list(CLIP), "scale": 1.0, "offset": 0.0},
        "labels": LABELS,
        "description": (
            "Weight-free tissue segmentation: Hounsfield thresholds plus in-plane morphology; "
            "built by engines/models/build_tissue.py. Returns the label of each voxel (uint8, "
            "output_kind labels), no longer one-hot probabilities: the same label maps as the "
            "earlier builds of this version."
        ),
        "parameters": asdict(PARAMETERS),
    }


def write_model(out_dir: Path, patch_size: tuple[int, int, int] = PATCH_SIZE) -> Path:
    """Write ``tissue.onnx`` and ``tissue.json`` into ``out_dir``; return the manifest path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(patch_size)
    onnx_path = out_dir / f"{NAME}.onnx"
    onnx_path.write_bytes(model.SerializeToString(deterministic=True))
    manifest_path = out_dir / f"{NAME}.json"
    manifest_path.write_text(json.dumps(manifest_dict(patch_size), indent=2) + "\n")
    return manifest_path


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--out-dir", type=Path, default=MODELS_DIR / NAME, help="folder to write into"
    )
    args = parser.parse_args(argv)
    path = write_model(args.out_dir)
    print(f"wrote {path} and {path.with_suffix('.onnx')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
