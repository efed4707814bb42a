"""Build the default model, "tissue": CT physics written as an ONNX graph, no weights.

Run ``python -m engines.models.build_tissue [--out-dir DIR]``; it writes ``tissue.onnx`` and
``tissue.json`` (the manifest, see :mod:`engines.manifest`) into ``engines/models/tissue/``.
The output is byte-for-byte deterministic, so the committed files can be checked against a
fresh build.

The graph takes Hounsfield units (clipped to [-1024, 3071] by the manifest's preprocessing) as
``(N, 1, Z, Y, X)`` float32 and returns one-hot class probabilities ``(N, 6, Z, Y, X)``, so it
runs through the same sliding window and arg-max as a trained network. Channels: 0 background,
1 body (the rest of the body: skin rim, partial-volume voxels, -500..-400 and 150..200 HU),
2 air inside the body (lung, airway, bowel gas), 3 adipose tissue, 4 soft tissue, 5 bone.

How it works, per patch (all thresholds in :class:`TissueParameters`):

1. *Foreground* is ``HU > -500``, opened with a 5x5 in-plane square: noise specks, blankets,
   cables and thin table shells go.
2. The foreground is max-pooled 4x4 in-plane to a coarse grid. There, *outside* starts as
   every voxel from which a straight ray along +x, -x, +y or -y leaves the patch without
   meeting foreground (two ``CumSum`` per axis), then grows through free coarse voxels by
   48 4-connected geodesic steps (``MaxPool`` masked by the free space). The rays find the
   open air; the growth reaches air that a head holder or a curved table encloses along every
   axis but that is still connected to the open air (up to ~190 voxels away).
3. Everything not outside is a *filled* object. An opening with a 5x5 coarse square (20 fine
   voxels) keeps only thick filled objects, the body; thin shells such as head holders vanish.
   Up-sampled to full resolution (nearest neighbour, ``Reshape``/``Expand``) this decides, per
   voxel: outside; near the outside, where only foreground counts as body; or deep inside,
   where air is body too.
4. Inside the body, thresholds split the classes: air ``< -400`` HU (closed with a 5x5 square
   so that small lung vessels stay in the lung), bone ``> 200`` HU and, on a 3x3 in-plane mean
   that halves the noise, fat ``[-190, -30]`` and soft tissue ``(-30, 150]``. Fat and soft
   tissue voxels next to air are partial volume and stay "body".

Every kernel is in-plane (``1 x k x k``) although the tensors are 3-D: slice spacing ranges
from 0.5 to 5 mm and the graph cannot see it, so mixing slices would blur thick-slice studies;
it also makes each slice's labels independent of where a patch starts along z, so z patch
borders leave no seams. In-plane, the rays and the growth need the whole cross-section: the
default 512x512 patch holds a standard CT matrix whole. On a larger matrix the patches overlap
and the Gaussian blending favours the patch whose centre is nearest, but air cut by a patch
border may there be called outside.

Only operators that TensorRT's ONNX parser supports are used (Greater, Less, Not, And, Or,
Cast, Sub, Mul, Add, Max, MaxPool, AveragePool, CumSum with a constant axis, Reshape, Expand,
Concat), at opset 17 with static patch dimensions and a dynamic batch dimension. Values are
HU, 0/1 masks and counts up to 128, all exact in half precision.
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

from engines.models import MODELS_DIR

NAME = "tissue"
VERSION = "1.0.0"
OPSET = 17
IR_VERSION = 8
INPUT_NAME = "ct"
OUTPUT_NAME = "probabilities"
PATCH_SIZE: tuple[int, int, int] = (16, 512, 512)
OVERLAP = 0.125
CLIP: tuple[float, float] = (-1024.0, 3071.0)
COARSE = 4
"""In-plane down-sampling factor of the coarse grid; patch y and x must be multiples of it."""


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
    {
        "value": 1,
        "name": "Body",
        "category": SCT_ANATOMICAL_STRUCTURE,
        "type": ["38266002", "SCT", "Entire body"],
        "color": [241, 214, 145],
    },
    {
        "value": 2,
        "name": "Lung and airway",
        "category": SCT_ANATOMICAL_STRUCTURE,
        "type": ["39607008", "SCT", "Lung"],
        "color": [102, 180, 255],
    },
    {
        "value": 3,
        "name": "Adipose tissue",
        "category": SCT_TISSUE,
        "type": ["55603005", "SCT", "Fat"],
        "color": [230, 220, 70],
    },
    {
        "value": 4,
        "name": "Soft tissue",
        "category": SCT_TISSUE,
        "type": ["87784001", "SCT", "Soft tissue"],
        "color": [192, 104, 88],
    },
    {
        "value": 5,
        "name": "Bone",
        "category": SCT_TISSUE,
        "type": ["3138006", "SCT", "Bone"],
        "color": [250, 250, 225],
    },
]
"""Output classes with codes from DICOM PS3.16: categories from CID 7150, body and lung types
from CID 7151, fat, soft tissue and bone (tissue, 3138006) types from CID 7166."""


class _Graph:
    """Collects nodes and constants with deterministic names."""

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

    # -- comparisons give bool masks; MaxPool needs float 0/1 masks ----------------------
    def greater(self, x: str, threshold: float) -> str:
        """``x > threshold`` (bool)."""
        return self.op("Greater", x, self.constant(threshold))

    def less(self, x: str, threshold: float) -> str:
        """``x < threshold`` (bool)."""
        return self.op("Less", x, self.constant(threshold))

    def to_float(self, mask: str) -> str:
        """bool mask to float 0/1."""
        return self.op("Cast", mask, to=TensorProto.FLOAT)

    def invert(self, mask: str) -> str:
        """``1 - mask`` for a float 0/1 mask."""
        return self.op("Sub", self.constant(1.0), mask)

    def and_not(self, mask: str, excluded: str) -> str:
        """``mask and not excluded`` (bool)."""
        return self.op("And", mask, self.op("Not", excluded))

    # -- in-plane morphology on float 0/1 masks ------------------------------------------
    def max_along(self, x: str, axis: int, size: int) -> str:
        """Running maximum of odd ``size`` along spatial ``axis`` (0 z, 1 y, 2 x).

        MaxPool ignores its padding, so erosions do not eat in from the patch border.
        """
        kernel = [1, 1, 1]
        kernel[axis] = size
        pads = [0, 0, 0, 0, 0, 0]
        pads[axis] = pads[axis + 3] = size // 2
        return self.op("MaxPool", x, kernel_shape=kernel, pads=pads, strides=[1, 1, 1])

    def dilate(self, mask: str, size: int) -> str:
        """Dilation by a ``size x size`` in-plane square.

        One MaxPool: ONNX Runtime runs a 1x5x5 window faster than two separable passes.
        """
        if size <= 1:
            return mask
        half = size // 2
        return self.op(
            "MaxPool",
            mask,
            kernel_shape=[1, size, size],
            pads=[0, half, half, 0, half, half],
            strides=[1, 1, 1],
        )

    def erode(self, mask: str, size: int) -> str:
        """Erosion by a ``size x size`` in-plane square."""
        if size <= 1:
            return mask
        return self.invert(self.dilate(self.invert(mask), size))

    def opening(self, mask: str, size: int) -> str:
        """Erosion then dilation: removes structures thinner than ``size``."""
        return self.dilate(self.erode(mask, size), size)

    def closing(self, mask: str, size: int) -> str:
        """Dilation then erosion: bridges gaps narrower than ``size``."""
        return self.erode(self.dilate(mask, size), size)

    def enclosed(self, mask: str) -> str:
        """Voxels with ``mask`` somewhere before and after them along both x and y."""
        result = ""
        for axis in (3, 4):
            axis_name = self.constant(axis, dtype=np.int64)
            for reverse in (0, 1):
                seen = self.greater(self.op("CumSum", mask, axis_name, reverse=reverse), 0.5)
                result = self.op("And", result, seen) if result else seen
        return result

    def upsample(self, x: str, shape: tuple[int, int, int]) -> str:
        """Nearest-neighbour in-plane up-sampling by COARSE (Reshape, Expand, Reshape)."""
        z, y, x_size = shape
        split = self.constant([-1, 1, z, y // COARSE, 1, x_size // COARSE, 1], dtype=np.int64)
        repeat = self.constant([1, 1, 1, 1, COARSE, 1, COARSE], dtype=np.int64)
        merged = self.constant([-1, 1, z, y, x_size], dtype=np.int64)
        expanded = self.op("Expand", self.op("Reshape", x, split), repeat)
        return self.op("Reshape", expanded, merged)


def _build_graph(g: _Graph, p: TissueParameters, shape: tuple[int, int, int]) -> str:
    hu = INPUT_NAME
    fg = g.opening(g.to_float(g.greater(hu, p.body_hu)), p.denoise_kernel)

    # Coarse grid: open air found by rays, then geodesic growth through free voxels.
    coarse = g.op(
        "MaxPool",
        fg,
        kernel_shape=[1, COARSE, COARSE],
        strides=[1, COARSE, COARSE],
        pads=[0, 0, 0, 0, 0, 0],
    )
    free = g.invert(coarse)
    outside = g.to_float(g.op("Not", g.enclosed(coarse)))
    for _ in range(p.geodesic_steps):
        grown = g.op("Max", g.max_along(outside, 1, 3), g.max_along(outside, 2, 3))
        outside = g.op("Mul", grown, free)
    filled = g.invert(outside)
    keep = g.op("Mul", g.dilate(g.opening(filled, p.core_kernel), 3), filled)
    deep = g.invert(g.dilate(outside, 3))
    # 0: outside; 1: body where foreground; 2: body whatever the HU.
    code = g.upsample(g.op("Mul", keep, g.op("Add", g.constant(1.0), deep)), shape)
    body = g.op(
        "Or",
        g.greater(code, 1.5),
        g.op("And", g.greater(code, 0.5), g.greater(fg, 0.5)),
    )

    # Classes inside the body, as mutually exclusive bool masks.
    air = g.to_float(g.less(hu, p.air_hu))
    k = p.mean_kernel
    mean = g.op(
        "AveragePool",
        hu,
        kernel_shape=[1, k, k],
        pads=[0, k // 2, k // 2, 0, k // 2, k // 2],
        strides=[1, 1, 1],
        count_include_pad=0,
    )
    lung = g.op("And", body, g.greater(g.closing(air, p.lung_close_kernel), 0.5))
    bone = g.and_not(g.op("And", body, g.greater(hu, p.bone_hu)), lung)
    tissue = g.and_not(g.and_not(g.and_not(body, lung), bone), g.greater(g.dilate(air, 3), 0.5))
    above_fat = g.greater(mean, p.fat_high_hu)
    fat = g.and_not(g.and_not(tissue, above_fat), g.less(mean, p.fat_low_hu))
    soft = g.and_not(g.op("And", tissue, above_fat), g.greater(mean, p.soft_high_hu))
    labelled = g.op("Or", g.op("Or", lung, bone), g.op("Or", fat, soft))
    rest = g.and_not(body, labelled)
    channels = g.op("Concat", g.op("Not", body), rest, lung, fat, soft, bone, axis=1)
    return g.op("Cast", channels, to=TensorProto.FLOAT, output=OUTPUT_NAME)


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
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", 6, z, y, x])],
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
    """The manifest written beside the model (format in :mod:`engines.manifest`)."""
    return {
        "name": NAME,
        "version": VERSION,
        "onnx": f"{NAME}.onnx",
        "input_name": INPUT_NAME,
        "output_name": OUTPUT_NAME,
        "output_kind": "probabilities",
        "patch_size": list(patch_size),
        "overlap": OVERLAP,
        "batch": {"min": 1, "opt": 1, "max": 4},
        "fp16": True,
        "preprocessing": {"clip": list(CLIP), "scale": 1.0, "offset": 0.0},
        "labels": LABELS,
        "description": (
            "Weight-free tissue segmentation: Hounsfield thresholds plus in-plane morphology; "
            "built by engines/models/build_tissue.py."
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
