"""Generate an nnU-Net-style 3D U-Net as ONNX, with seeded random weights, plus its manifest.

The network follows nnU-Net's ``PlainConvUNet`` (3d_fullres) layout: per encoder stage two
3x3x3 convolutions, each followed by InstanceNorm (affine) and LeakyReLU(0.01), the first
convolution of every stage but the first with stride 2; the decoder upsamples with a 2x2x2
transposed convolution, concatenates the skip connection and applies two more conv-norm-act
blocks; a 1x1x1 convolution gives the class logits at full resolution (no deep supervision).

The default (:data:`FULL`) has 6 stages of 32-64-128-256-320-320 features on 128^3 patches,
about 31 M parameters, like nnU-Net's 3d_fullres CT plans. :data:`SMALL` (2 stages, 8-16
features, 32^3) is for tests. The graph is built with :mod:`onnx.helper` and numpy only, so it
can be generated where torch is not installed. Output is never committed: write it under
``bench/generated/`` (ignored by git) or a temporary folder::

    python -m bench.unet bench/generated/unet            # full size, ~125 MB
    python -m bench.unet /tmp/unet-small --small
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17  # Conv/ConvTranspose/InstanceNormalization last changed before 22; onnx2torch reads 17


@dataclass(frozen=True)
class UNetSpec:
    """Shape of the generated network.

    Attributes
    ----------
    features
        Feature channels per stage, from full resolution down to the bottleneck.
    patch_size
        ``(z, y, x)`` input patch; each axis must be divisible by ``2 ** (len(features) - 1)``.
    num_classes
        Output channels, background included.
    convs_per_stage
        Conv-norm-act blocks per encoder and decoder stage.
    seed
        Seed of the random weights.
    batch
        ``(min, opt, max)`` batch range written into the manifest (TensorRT optimisation
        profile).
    """

    features: tuple[int, ...] = (32, 64, 128, 256, 320, 320)
    patch_size: tuple[int, int, int] = (128, 128, 128)
    num_classes: int = 4
    convs_per_stage: int = 2
    seed: int = 0
    batch: tuple[int, int, int] = (1, 2, 4)


FULL = UNetSpec()
SMALL = UNetSpec(features=(8, 16), patch_size=(32, 32, 32), num_classes=3, batch=(1, 1, 2))


class _Graph:
    """Accumulates nodes, initializers and the FLOP count while the network is laid out."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.flops = 0
        self.params = 0
        self._n = 0

    def name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def weight(self, name: str, array: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(array.astype(np.float32), name))
        self.params += int(array.size)
        return name

    def conv(
        self, x: str, cin: int, cout: int, k: int, stride: int, voxels_out: int, *, transpose: bool
    ) -> str:
        base = self.name("convt" if transpose else "conv")
        fan_in = cin * k**3
        shape = (cin, cout, k, k, k) if transpose else (cout, cin, k, k, k)
        w = self.rng.normal(0.0, np.sqrt(2.0 / fan_in), size=shape)
        b = self.rng.normal(0.0, 0.01, size=(cout,))
        inputs = [x, self.weight(f"{base}.weight", w), self.weight(f"{base}.bias", b)]
        out = f"{base}.out"
        attrs: dict[str, list[int]] = {"kernel_shape": [k] * 3, "strides": [stride] * 3}
        if transpose:
            # every input voxel spreads to k^3 outputs: cin*cout*k^3 MACs per input voxel
            self.flops += 2 * cin * cout * k**3 * (voxels_out // stride**3)
        else:
            attrs["pads"] = [k // 2] * 6
            self.flops += 2 * cin * cout * k**3 * voxels_out
        op = "ConvTranspose" if transpose else "Conv"
        self.nodes.append(helper.make_node(op, inputs, [out], name=base, **attrs))
        return out

    def norm_act(self, x: str, channels: int) -> str:
        base = self.name("norm")
        scale = self.weight(f"{base}.scale", 1.0 + self.rng.normal(0.0, 0.1, size=(channels,)))
        bias = self.weight(f"{base}.bias", self.rng.normal(0.0, 0.1, size=(channels,)))
        self.nodes.append(
            helper.make_node(
                "InstanceNormalization",
                [x, scale, bias],
                [f"{base}.out"],
                name=base,
                epsilon=1e-5,
            )
        )
        act = f"{base}.act"
        self.nodes.append(
            helper.make_node("LeakyRelu", [f"{base}.out"], [act], name=f"{base}.lrelu", alpha=0.01)
        )
        return act

    def block(self, x: str, cin: int, cout: int, stride: int, voxels_out: int) -> str:
        return self.norm_act(self.conv(x, cin, cout, 3, stride, voxels_out, transpose=False), cout)


@dataclass(frozen=True)
class UNetModel:
    """A generated network with what the benchmark needs to know about it."""

    model: onnx.ModelProto
    flops_per_patch: int
    params: int
    spec: UNetSpec


def build_unet(spec: UNetSpec = FULL) -> UNetModel:
    """Lay out the U-Net described by ``spec`` as an ONNX model.

    Returns
    -------
    UNetModel
        The model (input ``"input"`` of shape ``(N, 1, *patch)``, output ``"logits"`` of shape
        ``(N, num_classes, *patch)``, batch dimension dynamic), the multiply-add FLOPs of one
        patch (convolutions only; norms and activations are below 1 %) and the parameter count.
    """
    levels = len(spec.features)
    if any(p % 2 ** (levels - 1) for p in spec.patch_size):
        raise ValueError(f"patch {spec.patch_size} not divisible by 2^{levels - 1}")
    g = _Graph(spec.seed)
    voxels = [int(np.prod(spec.patch_size)) // 8**s for s in range(levels)]

    x, cin, skips = "input", 1, []
    for s, f in enumerate(spec.features):
        for c in range(spec.convs_per_stage):
            stride = 2 if (s > 0 and c == 0) else 1
            x = g.block(x, cin, f, stride, voxels[s])
            cin = f
        skips.append(x)
    for s in range(levels - 2, -1, -1):
        f = spec.features[s]
        up = g.conv(x, cin, f, 2, 2, voxels[s], transpose=True)
        cat = g.name("concat")
        g.nodes.append(helper.make_node("Concat", [up, skips[s]], [cat], name=cat, axis=1))
        x, cin = cat, 2 * f
        for _ in range(spec.convs_per_stage):
            x = g.block(x, cin, f, 1, voxels[s])
            cin = f
    head = g.name("head")
    w = g.rng.normal(0.0, np.sqrt(1.0 / cin), size=(spec.num_classes, cin, 1, 1, 1))
    b = np.zeros(spec.num_classes)
    g.nodes.append(
        helper.make_node(
            "Conv",
            [x, g.weight(f"{head}.weight", w), g.weight(f"{head}.bias", b)],
            ["logits"],
            name=head,
            kernel_shape=[1, 1, 1],
        )
    )
    g.flops += 2 * cin * spec.num_classes * voxels[0]

    graph = helper.make_graph(
        g.nodes,
        "nnunet_like",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, *spec.patch_size])],
        [
            helper.make_tensor_value_info(
                "logits", TensorProto.FLOAT, ["N", spec.num_classes, *spec.patch_size]
            )
        ],
        initializer=g.inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="segnode-bench"
    )
    model.ir_version = 8
    onnx.checker.check_model(model)
    return UNetModel(model=model, flops_per_patch=g.flops, params=g.params, spec=spec)


def write_unet(out_dir: str | Path, spec: UNetSpec = FULL, *, name: str = "unet") -> Path:
    """Write ``<name>.onnx`` and its manifest ``<name>.json`` into ``out_dir``.

    The manifest follows :mod:`segnode.engines.manifest`; its extra keys ``flops_per_patch`` and
    ``params`` are read by the benchmark. Returns the manifest path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    built = build_unet(spec)
    onnx.save(built.model, out / f"{name}.onnx")
    labels = [
        {
            "value": i,
            "name": f"Structure {i}",
            "category": ["91723000", "SCT", "Anatomical Structure"],
            "type": ["85756007", "SCT", "Tissue"],
            "color": [(60 * i) % 256, (120 + 40 * i) % 256, (200 + 90 * i) % 256],
        }
        for i in range(1, spec.num_classes)
    ]
    manifest = {
        "name": name,
        "version": f"0.0.0+seed{spec.seed}",
        "onnx": f"{name}.onnx",
        "input_name": "input",
        "output_name": "logits",
        "output_kind": "logits",
        "patch_size": list(spec.patch_size),
        "overlap": 0.5,
        "batch": dict(zip(("min", "opt", "max"), spec.batch, strict=True)),
        "fp16": True,
        "preprocessing": {"clip": [-1024.0, 3071.0], "scale": 1.0 / 1000.0, "offset": 0.0},
        "labels": labels,
        "flops_per_patch": built.flops_per_patch,
        "params": built.params,
    }
    path = out / f"{name}.json"
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m bench.unet OUT_DIR [--small] [--classes N] [--seed S]``."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.unet", description=__doc__.split("\n")[0]
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--small", action="store_true", help="2 stages, 8-16 features, 32^3")
    parser.add_argument(
        "--classes", type=int, default=None, help="output channels incl. background"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--name", default="unet")
    args = parser.parse_args(argv)
    base = SMALL if args.small else FULL
    spec = replace(base, num_classes=args.classes or base.num_classes, seed=args.seed)
    path = write_unet(args.out_dir, spec, name=args.name)
    meta = json.loads(path.read_text())
    print(
        f"{path}: {meta['params'] / 1e6:.1f} M parameters, "
        f"{meta['flops_per_patch'] / 1e9:.1f} GFLOP per patch"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
