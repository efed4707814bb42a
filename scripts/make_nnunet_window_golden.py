"""Golden outputs of nnU-Net v2's sliding window, for tests without nnunetv2.

Two kinds of file in ``tests/data``:

* ``nnunet_window_golden_tiling.npz``: nnU-Net's ``compute_steps_for_sliding_window`` for
  :data:`STEP_CASES`, ``pad_nd_image``'s un-padding slicer for :data:`PAD_CASES` (both as
  JSON text) and ``compute_gaussian(patch, 1/8, 10)`` (float16, as its predictor builds it)
  for :data:`GAUSSIAN_PATCHES`;
* ``nnunet_window_golden_<case>.npz`` for each :data:`CASES` entry: the input image, the
  stand-in network's weights per fold (:func:`stand_in_logits`, a fixed random 3x3x3
  convolution of ``tanh(image)``) and two sets of nnU-Net logits:

  - ``predictor``: ``nnUNetPredictor.predict_logits_from_preprocessed_data`` itself (the real
    class, on the CPU: per fold ``predict_sliding_window_return_logits`` with its float16
    accumulators, folds summed and divided), the stand-in as its network and the folds'
    weights as its ``list_of_parameters``;
  - ``loop``: the same loop in float64 built from nnU-Net's own pieces (``pad_nd_image``,
    ``_internal_get_sliding_window_slicers``, ``compute_gaussian``,
    ``_internal_maybe_mirror_and_predict``), so that float32 accumulation can be checked
    tightly, without float16's rounding.

Run (needs ``pip install -e .[nnunet]``, i.e. nnunetv2 and torch)::

    python -m scripts.make_nnunet_window_golden     # writes tests/data/nnunet_window_golden_*

``tests/test_nnunet_window.py`` compares :mod:`segnode.engines.nnunet_window` with these files, and
with :func:`predictor_logits` / :func:`loop_logits` live when nnunetv2 imports.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
from array_api_compat import array_namespace
from array_api_compat import device as array_device

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


@dataclass(frozen=True)
class Case:
    """One sliding-window case: an image, a patch, a step, mirror axes and folds."""

    name: str
    shape: tuple[int, int, int]
    patch: tuple[int, int, int]
    step: float
    mirror_axes: tuple[int, ...]
    folds: int
    channels: int = 2
    seed: int = 0


CASES = (
    Case("plain", (8, 10, 9), (4, 6, 5), 0.5, (), 1, seed=1),
    Case("mirror_2folds", (8, 10, 9), (4, 6, 5), 0.5, (0, 1, 2), 2, seed=2),
    Case("step08_padded", (3, 13, 12), (4, 6, 5), 0.8, (1, 2), 1, channels=3, seed=3),
    Case("tiny_2folds", (2, 4, 3), (4, 6, 5), 0.5, (0, 1, 2), 2, seed=4),
    Case("step08_2folds", (7, 9, 11), (5, 4, 6), 0.8, (0, 2), 2, seed=5),
)

STEP_CASES = (
    ((8, 10, 9), (4, 6, 5), 0.5),
    ((4, 6, 5), (4, 6, 5), 0.5),
    ((110, 64, 65), (64, 64, 64), 0.5),
    ((300, 251, 249), (128, 128, 128), 0.5),
    ((300, 251, 249), (128, 128, 128), 0.8),
    ((512, 512, 129), (112, 160, 128), 0.8),
    ((97, 250, 241), (80, 192, 160), 0.5),
    ((33, 40, 41), (7, 9, 10), 0.25),
    ((33, 40, 41), (7, 9, 10), 1.0),
    ((200, 200, 200), (96, 96, 96), 0.7),
)
"""``(image, patch, tile_step_size)``; images at least the patch (nnU-Net pads first)."""

PAD_CASES = (
    ((2, 4, 3), (4, 6, 5)),
    ((3, 13, 12), (4, 6, 5)),
    ((8, 10, 9), (4, 6, 5)),
    ((1, 1, 1), (128, 128, 128)),
    ((100, 127, 500), (128, 128, 128)),
)
"""``(image, patch)`` for ``pad_nd_image(..., 'constant', {'value': 0}, True)``."""

GAUSSIAN_PATCHES = ((4, 6, 5), (12, 16, 10), (1, 7, 2), (2, 2, 64), (9, 1, 33))


def stand_in_weights(case: Case, fold: int) -> tuple[npt.NDArray[np.float32], ...]:
    """The stand-in network's ``(kernel (C, 3, 3, 3), bias (C,))`` for ``fold`` of ``case``."""
    rng = np.random.default_rng(1000 * case.seed + fold)
    kernel = rng.normal(0.0, 0.5, size=(case.channels, 3, 3, 3)).astype(np.float32)
    bias = rng.normal(0.0, 0.5, size=(case.channels,)).astype(np.float32)
    return kernel, bias


def make_image(case: Case) -> npt.NDArray[np.float32]:
    """A normalised-CT-like float32 image."""
    rng = np.random.default_rng(case.seed)
    return rng.normal(0.0, 1.0, size=case.shape).astype(np.float32)


def stand_in_logits(batch: Any, kernel: Any, bias: Any) -> Any:
    """A deterministic stand-in network on any array-API namespace.

    ``(N, 1, z, y, x)`` in, ``(N, C, z, y, x)`` out: the cross-correlation of ``tanh(batch)``
    (zero padded, "same" size) with ``kernel`` (C, 3, 3, 3), plus ``bias``. The kernel is not
    symmetric, so mirroring changes its output; the zero padding makes each tile's border
    differ from its neighbour's.
    """
    xp = array_namespace(batch)
    dev = array_device(batch)
    n, _, depth, rows, cols = (int(s) for s in batch.shape)
    padded = xp.zeros((n, depth + 2, rows + 2, cols + 2), dtype=xp.float32, device=dev)
    padded[:, 1:-1, 1:-1, 1:-1] = xp.tanh(xp.astype(batch[:, 0, ...], xp.float32))
    k = xp.asarray(kernel, dtype=xp.float32, device=dev)
    b = xp.asarray(bias, dtype=xp.float32, device=dev)
    channels = []
    for c in range(int(k.shape[0])):
        acc = xp.zeros((n, depth, rows, cols), dtype=xp.float32, device=dev) + b[c]
        for dz in range(3):
            for dy in range(3):
                for dx in range(3):
                    shifted = padded[:, dz : dz + depth, dy : dy + rows, dx : dx + cols]
                    acc = acc + k[c, dz, dy, dx] * shifted
        channels.append(acc)
    return xp.stack(channels, axis=1)


def _torch_network(case: Case) -> Any:
    """The stand-in as a ``torch.nn.Module`` whose weights are a state dict (folds)."""
    import torch

    class StandIn(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            kernel, bias = stand_in_weights(case, 0)
            self.kernel = torch.nn.Parameter(torch.from_numpy(kernel))
            self.bias = torch.nn.Parameter(torch.from_numpy(bias))

        def forward(self, x: Any) -> Any:
            return stand_in_logits(x, self.kernel.detach(), self.bias.detach())

    return StandIn()


def _state_dicts(case: Case) -> list[dict[str, Any]]:
    import torch

    out = []
    for fold in range(case.folds):
        kernel, bias = stand_in_weights(case, fold)
        out.append({"kernel": torch.from_numpy(kernel), "bias": torch.from_numpy(bias)})
    return out


def _predictor(case: Case, use_gaussian: bool = True) -> Any:
    """An ``nnUNetPredictor`` on the CPU set up by hand (no model folder): the stand-in as its
    network, the case's patch, step, mirror axes and folds."""
    import torch
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor

    predictor = nnUNetPredictor(
        tile_step_size=case.step,
        use_gaussian=use_gaussian,
        use_mirroring=bool(case.mirror_axes),
        perform_everything_on_device=False,
        device=torch.device("cpu"),
        verbose=False,
        allow_tqdm=False,
    )
    predictor.network = _torch_network(case)
    predictor.configuration_manager = SimpleNamespace(patch_size=list(case.patch))
    predictor.label_manager = SimpleNamespace(num_segmentation_heads=case.channels)
    predictor.allowed_mirroring_axes = case.mirror_axes or None
    predictor.list_of_parameters = _state_dicts(case)
    return predictor


def predictor_logits(
    case: Case, image: npt.NDArray[np.float32], use_gaussian: bool = True
) -> npt.NDArray[np.float16]:
    """nnU-Net's own ``predict_logits_from_preprocessed_data`` (float16 accumulators)."""
    import torch

    predictor = _predictor(case, use_gaussian)
    with torch.no_grad():
        logits = predictor.predict_logits_from_preprocessed_data(torch.from_numpy(image[None]))
    out: npt.NDArray[np.float16] = logits.numpy()
    return out


def loop_logits(case: Case, image: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """nnU-Net's sliding-window loop from its own pieces, accumulated in float64.

    The body of ``_internal_predict_sliding_window_return_logits`` (slicers, float16 Gaussian,
    ``_internal_maybe_mirror_and_predict``, ``predicted_logits[sl] += prediction * gaussian``,
    ``n_predictions[sl[1:]] += gaussian``, division) with float64 accumulators, per fold, then
    the folds averaged as ``predict_logits_from_preprocessed_data`` does.
    """
    import torch
    from acvl_utils.cropping_and_padding.padding import pad_nd_image
    from nnunetv2.inference.sliding_window_prediction import compute_gaussian

    predictor = _predictor(case)
    data, revert = pad_nd_image(
        torch.from_numpy(image[None]), list(case.patch), "constant", {"value": 0}, True, None
    )
    slicers = predictor._internal_get_sliding_window_slicers(data.shape[1:])
    gaussian = compute_gaussian(
        tuple(case.patch), sigma_scale=1.0 / 8, value_scaling_factor=10, device="cpu"
    ).double()
    total = torch.zeros((case.channels, *data.shape[1:]), dtype=torch.float64)
    for params in predictor.list_of_parameters:
        predictor.network.load_state_dict(params)
        logits = torch.zeros((case.channels, *data.shape[1:]), dtype=torch.float64)
        weights = torch.zeros(data.shape[1:], dtype=torch.float64)
        with torch.no_grad():
            for sl in slicers:
                tile = torch.clone(data[sl][None])
                prediction = predictor._internal_maybe_mirror_and_predict(tile)[0].double()
                logits[sl] += prediction * gaussian
                weights[sl[1:]] += gaussian
        total += logits / weights
    total /= len(predictor.list_of_parameters)
    out: npt.NDArray[np.float64] = total[(slice(None), *revert[1:])].numpy()
    return out


def tiling_reference() -> dict[str, Any]:
    """nnU-Net's steps, un-padding slicers and Gaussians for the tiling golden file."""
    import torch
    from acvl_utils.cropping_and_padding.padding import pad_nd_image
    from nnunetv2.inference.sliding_window_prediction import (
        compute_gaussian,
        compute_steps_for_sliding_window,
    )

    steps = [
        [
            list(image),
            list(patch),
            step,
            [
                [int(s) for s in axis]
                for axis in compute_steps_for_sliding_window(image, patch, step)
            ],
        ]
        for image, patch, step in STEP_CASES
    ]
    pads = []
    for image, patch in PAD_CASES:
        padded, slicer = pad_nd_image(np.zeros(image, np.float32), patch, "constant", {}, True)
        pads.append(
            [
                list(image),
                list(patch),
                [int(n) for n in padded.shape],
                [[int(s.start), int(s.stop)] for s in slicer],
            ]
        )
    out: dict[str, Any] = {
        "steps": np.asarray(json.dumps(steps)),
        "pads": np.asarray(json.dumps(pads)),
        "gaussian_patches": np.asarray(json.dumps([list(p) for p in GAUSSIAN_PATCHES])),
    }
    for i, patch in enumerate(GAUSSIAN_PATCHES):
        g = compute_gaussian(patch, 1.0 / 8, 10, dtype=torch.float16, device=torch.device("cpu"))
        out[f"gaussian_{i}"] = g.numpy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DATA)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "nnunet_window_golden_tiling.npz"
    np.savez_compressed(path, **tiling_reference())
    print(path)
    for case in CASES:
        image = make_image(case)
        weights: dict[str, Any] = {}
        for fold in range(case.folds):
            kernel, bias = stand_in_weights(case, fold)
            weights[f"kernel_{fold}"] = kernel
            weights[f"bias_{fold}"] = bias
        path = args.out / f"nnunet_window_golden_{case.name}.npz"
        np.savez_compressed(
            path,
            image=image,
            predictor=predictor_logits(case, image),
            loop=loop_logits(case, image).astype(np.float32),
            **weights,
        )
        print(path)


if __name__ == "__main__":
    main()
