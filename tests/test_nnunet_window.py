"""nnU-Net v2's sliding window (:mod:`segnode.engines.nnunet_window`) against nnU-Net's own code.

Two sources of truth:

* golden files (``tests/data/nnunet_window_golden_*.npz``, written by
  ``scripts/make_nnunet_window_golden.py`` with nnunetv2 2.8.1): nnU-Net's tile steps,
  padding and Gaussian, and the logits of a stand-in network through nnU-Net's real
  ``nnUNetPredictor.predict_logits_from_preprocessed_data`` (float16 accumulators) and through
  its loop rebuilt from its own pieces in float64; these tests run everywhere (the torch ones
  where torch imports);
* nnunetv2 itself when it is importable: the same comparisons on the spot, plus many more
  step / Gaussian / padding combinations.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scripts.make_nnunet_window_golden import (
    CASES,
    Case,
    loop_logits,
    make_image,
    predictor_logits,
    stand_in_logits,
    stand_in_weights,
)
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.nnunet_window import (
    WindowSettings,
    compute_gaussian,
    compute_steps_for_sliding_window,
    make_predict,
    maybe_mirror_and_predict,
    mirror_combinations,
    pad_to_patch,
    predict_for_manifest,
    sliding_window_logits,
    tile_step_size_from_overlap,
)
from segnode.engines.preprocess import Geometry
from segnode.engines.preprocess.pipeline import run_model
from tests.conftest import nnunet_mark

try:
    import torch
except ImportError:  # pragma: no cover - torch is optional
    torch = None

DATA = Path(__file__).parent / "data"

LOOP_ATOL = 5e-6
"""float32 accumulation against nnU-Net's loop in float64 (logits of a few units)."""

HALF_ATOL = 1e-3
"""float16 accumulation against nnU-Net's predictor: one float16 step at |logit| < 4 (the
float32 result is up to 0.1 away from it; see the module docstring)."""


needs_nnunet = nnunet_mark(
    "acvl_utils.cropping_and_padding.padding",
    "nnunetv2.inference.predict_from_raw_data",
    "nnunetv2.inference.sliding_window_prediction",
)
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _golden(case: Case) -> Any:
    return np.load(DATA / f"nnunet_window_golden_{case.name}.npz")


def _network(kernel: Any, bias: Any) -> Any:
    """One fold of the stand-in network with fixed weights."""

    def predict(batch: Any) -> Any:
        return stand_in_logits(batch, kernel, bias)

    return predict


def _numpy_folds(golden: Any, case: Case) -> list[Any]:
    return [_network(golden[f"kernel_{f}"], golden[f"bias_{f}"]) for f in range(case.folds)]


def _torch_folds(golden: Any, case: Case) -> list[Any]:
    assert torch is not None
    return [
        _network(torch.from_numpy(golden[f"kernel_{f}"]), torch.from_numpy(golden[f"bias_{f}"]))
        for f in range(case.folds)
    ]


def _ours(image: Any, folds: list[Any], case: Case, **kwargs: Any) -> Any:
    settings = WindowSettings(
        patch_size=case.patch, tile_step_size=case.step, mirror_axes=case.mirror_axes, **kwargs
    )
    return sliding_window_logits(image, folds, settings)


# -- golden: tiling, padding, Gaussian ----------------------------------------------------------


def test_golden_steps() -> None:
    tiling = np.load(DATA / "nnunet_window_golden_tiling.npz")
    cases = json.loads(str(tiling["steps"]))
    assert len(cases) >= 10
    steps = {float(step) for _, _, step, _ in cases}
    assert {0.5, 0.8} <= steps
    for image, patch, step, expected in cases:
        assert compute_steps_for_sliding_window(image, patch, step) == expected, (image, patch)


def test_golden_padding() -> None:
    tiling = np.load(DATA / "nnunet_window_golden_tiling.npz")
    for image, patch, shape, slicer in json.loads(str(tiling["pads"])):
        got_shape, got_slicer = pad_to_patch(image, patch)
        assert list(got_shape) == shape
        assert [[s.start, s.stop] for s in got_slicer] == slicer


def test_golden_gaussian_exact() -> None:
    tiling = np.load(DATA / "nnunet_window_golden_tiling.npz")
    patches = json.loads(str(tiling["gaussian_patches"]))
    for i, patch in enumerate(patches):
        expected = tiling[f"gaussian_{i}"]
        got = compute_gaussian(patch, 1.0 / 8, 10)
        assert got.dtype == expected.dtype == np.float16
        np.testing.assert_array_equal(got, expected, err_msg=str(patch))
    # (12, 16, 10): its corners underflow float16 and take the smallest non-zero value
    corner = tiling["gaussian_1"]
    assert corner[0, 0, 0] == corner[corner > 0].min() and float(corner.max()) == 10.0


# -- golden: the logits of a stand-in network ---------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_logits_numpy(case: Case) -> None:
    golden = _golden(case)
    np.testing.assert_array_equal(golden["image"], make_image(case))
    for fold in range(case.folds):
        np.testing.assert_array_equal(golden[f"kernel_{fold}"], stand_in_weights(case, fold)[0])
    folds = _numpy_folds(golden, case)

    ours = _ours(golden["image"], folds, case)
    assert ours.dtype == np.float32 and ours.shape == golden["loop"].shape
    assert ours.shape == (case.channels, *case.shape)
    np.testing.assert_allclose(ours, golden["loop"], rtol=0, atol=LOOP_ATOL)

    half = _ours(golden["image"], folds, case, accumulator_dtype="float16")
    predictor = golden["predictor"].astype(np.float32)
    np.testing.assert_allclose(half, predictor, rtol=0, atol=HALF_ATOL)


@needs_torch
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_logits_torch(case: Case) -> None:
    assert torch is not None
    golden = _golden(case)
    image = torch.from_numpy(golden["image"])
    folds = _torch_folds(golden, case)
    ours = _ours(image, folds, case, batch_size=3)
    assert isinstance(ours, torch.Tensor) and ours.dtype == torch.float32
    np.testing.assert_allclose(ours.numpy(), golden["loop"], rtol=0, atol=LOOP_ATOL)
    numpy_result = _ours(golden["image"], _numpy_folds(golden, case), case)
    np.testing.assert_allclose(ours.numpy(), numpy_result, rtol=0, atol=2e-6)
    # float16 accumulators on torch: nnU-Net's predictor bit for bit
    half = _ours(image, folds, case, accumulator_dtype="float16")
    np.testing.assert_array_equal(half.numpy(), golden["predictor"].astype(np.float32))


def test_mirroring_and_folds_change_the_result() -> None:
    """The golden mirror case would not pass without mirroring or without the second fold."""
    case = next(c for c in CASES if c.name == "mirror_2folds")
    golden = _golden(case)
    folds = _numpy_folds(golden, case)
    no_mirror = sliding_window_logits(golden["image"], folds, WindowSettings(case.patch))
    one_fold = _ours(golden["image"], folds[:1], case)
    assert np.abs(no_mirror - golden["loop"]).max() > 0.05
    assert np.abs(one_fold - golden["loop"]).max() > 0.05


def test_mirror_combinations_order() -> None:
    assert mirror_combinations((0, 1, 2)) == [
        (0,),
        (1,),
        (2,),
        (0, 1),
        (0, 2),
        (1, 2),
        (0, 1, 2),
    ]
    assert mirror_combinations(()) == []
    with pytest.raises(ValueError):
        mirror_combinations((0, 3))


def test_maybe_mirror_and_predict_by_hand() -> None:
    case = CASES[0]
    kernel, bias = stand_in_weights(case, 0)
    batch = np.random.default_rng(7).normal(size=(2, 1, 4, 6, 5)).astype(np.float32)

    def net(b: Any) -> Any:
        return stand_in_logits(b, kernel, bias)

    expected = net(batch) + np.flip(net(np.flip(batch, 3)), 3)
    got = maybe_mirror_and_predict(batch, net, (1,))
    np.testing.assert_allclose(got, expected / 2, rtol=0, atol=1e-6)


# -- the predict builder and run_model ----------------------------------------------------------


def _manifest_v2(tmp_path: Path, case: Case, folds: int) -> Any:
    """A version-2 manifest with ``case``'s patch, overlap and mirror axes, two classes."""
    names = [f"fold_{i}.onnx" for i in range(folds)]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    raw = {
        "manifest_version": 2,
        "name": "window",
        "version": "1",
        "folds": names,
        "patch_size": list(case.patch),
        "overlap": round(1.0 - case.step, 12),
        "mirror_axes": list(case.mirror_axes),
        "geometry": {"spacing": [1.0, 1.0, 1.0], "orientation": "source"},
        "preprocessing": {"crop_to_nonzero": False, "normalization": "linear"},
        "labels": [
            {"value": 1, "name": "one", "category": ["1", "SCT", "c"], "type": ["2", "SCT", "t"]}
        ],
    }
    path = tmp_path / "window.json"
    path.write_text(json.dumps(raw))
    return load_manifest(path)


def test_predict_for_manifest_in_run_model(tmp_path: Path) -> None:
    case = next(c for c in CASES if c.name == "step08_2folds")
    golden = _golden(case)
    manifest = _manifest_v2(tmp_path, case, 2)
    assert tile_step_size_from_overlap(manifest.overlap) == 0.8
    assert manifest.patch_size == case.patch and manifest.output_channels == case.channels
    predict = predict_for_manifest(manifest, _numpy_folds(golden, case))
    # on an image that is already on the model grid it is the golden case itself
    np.testing.assert_allclose(predict(golden["image"]), golden["loop"], rtol=0, atol=LOOP_ATOL)

    geometry = Geometry(
        directions=((0.0, 0.0, 1.0), (0.0, 1.0, 0.0), (1.0, 0.0, 0.0)),
        spacing=(1.0, 1.0, 1.0),
        plane_normal=(0.0, 0.0, 1.0),
    )
    labels = run_model(golden["image"], geometry, manifest, predict)
    assert labels.shape == case.shape and labels.dtype == np.uint8
    # same grid: order-1 resampling to the same shape is the identity, so the arg-max of
    # nnU-Net's logits comes back (logits within 5e-6: compare where the classes are apart)
    expected = np.argmax(golden["loop"], axis=0)
    apart = np.abs(golden["loop"][0] - golden["loop"][1]) > 1e-4
    np.testing.assert_array_equal(labels[apart], expected[apart])


def test_predict_for_manifest_checks_folds(tmp_path: Path) -> None:
    case = CASES[0]
    golden = _golden(case)
    with pytest.raises(ValueError, match="folds"):
        predict_for_manifest(_manifest_v2(tmp_path, case, 2), _numpy_folds(golden, case))


def test_make_predict_rejects_bad_predictions() -> None:
    image = np.zeros((5, 7, 6), dtype=np.float32)

    def wrong_shape(batch: Any) -> Any:
        return np.zeros((batch.shape[0], 2, 3, 3, 3), dtype=np.float32)

    def not_finite(batch: Any) -> Any:
        return np.full((batch.shape[0], 2, *batch.shape[2:]), np.inf, dtype=np.float32)

    with pytest.raises(ValueError, match="expected"):
        make_predict([wrong_shape], WindowSettings((4, 6, 5)))(image)
    with pytest.raises(ValueError, match="finite"):
        make_predict([not_finite], WindowSettings((4, 6, 5)))(image)
    with pytest.raises(ValueError, match="at least the tile"):
        compute_steps_for_sliding_window((3, 10, 10), (4, 6, 5), 0.5)
    with pytest.raises(ValueError, match="tile_step_size"):
        compute_steps_for_sliding_window((8, 10, 10), (4, 6, 5), 0.0)


def test_window_settings_check() -> None:
    settings = WindowSettings((4, 6, 5), (0.5, 0.8, 1), mirror_axes=(2, 0))
    assert isinstance(settings.tile_step_size, tuple)
    assert all(isinstance(s, float) for s in settings.tile_step_size)
    assert settings == WindowSettings((4, 6, 5), (0.5, 0.8, 1.0), (2, 0))
    assert hash(settings) == hash(WindowSettings((4, 6, 5), (0.5, 0.8, 1.0), (2, 0)))
    for bad in (
        {"patch_size": (4, 6)},
        {"patch_size": (4, 0, 5)},
        {"patch_size": (4, 6, 5), "tile_step_size": (0.5, 0.5)},
        {"patch_size": (4, 6, 5), "mirror_axes": (0, 0)},
        {"patch_size": (4, 6, 5), "batch_size": 0},
        {"patch_size": (4, 6, 5), "accumulator_dtype": "float64"},
    ):
        with pytest.raises(ValueError):
            WindowSettings(**bad)


def test_tile_step_size_from_overlap() -> None:
    assert tile_step_size_from_overlap(0.5) == 0.5
    assert tile_step_size_from_overlap(0.2) == 0.8
    assert tile_step_size_from_overlap((0.5, 0.2, 0.0)) == (0.5, 0.8, 1.0)


# -- live: nnunetv2 itself -----------------------------------------------------------------------


@needs_nnunet
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_live_logits(case: Case) -> None:
    image = make_image(case)
    folds = [_network(*stand_in_weights(case, f)) for f in range(case.folds)]
    loop = loop_logits(case, image)
    np.testing.assert_allclose(_ours(image, folds, case), loop, rtol=0, atol=LOOP_ATOL)
    predictor = predictor_logits(case, image).astype(np.float32)
    half = _ours(image, folds, case, accumulator_dtype="float16")
    np.testing.assert_allclose(half, predictor, rtol=0, atol=HALF_ATOL)
    np.testing.assert_array_equal(predictor, _golden(case)["predictor"].astype(np.float32))


@needs_nnunet
@pytest.mark.parametrize("case", CASES[1:3], ids=[c.name for c in CASES[1:3]])
def test_live_without_gaussian(case: Case) -> None:
    """``use_gaussian=False``: every tile weighs 1, as nnU-Net's predictor."""
    image = make_image(case)
    folds = [_network(*stand_in_weights(case, f)) for f in range(case.folds)]
    expected = predictor_logits(case, image, use_gaussian=False).astype(np.float32)
    half = _ours(image, folds, case, use_gaussian=False, accumulator_dtype="float16")
    np.testing.assert_allclose(half, expected, rtol=0, atol=HALF_ATOL)
    ours = _ours(image, folds, case, use_gaussian=False)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-2)
    assert np.abs(ours - _ours(image, folds, case)).max() > 1e-2  # the Gaussian matters


@needs_nnunet
def test_live_steps_and_padding() -> None:
    from acvl_utils.cropping_and_padding.padding import pad_nd_image
    from nnunetv2.inference.sliding_window_prediction import (
        compute_steps_for_sliding_window as nnunet_steps,
    )

    rng = random.Random(0)
    for _ in range(3000):
        patch = [rng.randint(1, 200) for _ in range(3)]
        image = [p + rng.choice([0, 1, rng.randint(0, 50), rng.randint(0, 400)]) for p in patch]
        step = rng.choice([0.5, 0.8, 1.0, 0.25, 0.33, 0.7, rng.uniform(0.01, 1.0)])
        assert compute_steps_for_sliding_window(image, patch, step) == nnunet_steps(
            image, patch, step
        ), (image, patch, step)
    for _ in range(300):
        patch = [rng.randint(1, 40) for _ in range(3)]
        image = [max(1, p + rng.randint(-39, 5)) for p in patch]
        padded, slicer = pad_nd_image(np.zeros(image, np.float32), patch, "constant", {}, True)
        shape, ours = pad_to_patch(image, patch)
        assert shape == padded.shape and ours == slicer


@needs_nnunet
@needs_torch
def test_live_gaussian_exact() -> None:
    assert torch is not None
    from nnunetv2.inference.sliding_window_prediction import compute_gaussian as nnunet_gaussian

    patches = [(128, 128, 128), (112, 160, 128), (80, 192, 160), (64, 64, 64), (1, 2, 3)]
    patches += [(a, b, c) for a in (3, 8, 17, 32) for b in (1, 6, 48) for c in (5, 96)]
    for patch in patches:
        for name, dtype in (("float16", torch.float16), ("float32", torch.float32)):
            nnunet_gaussian.cache_clear()
            expected = nnunet_gaussian(patch, 1.0 / 8, 10, dtype=dtype, device=torch.device("cpu"))
            got = compute_gaussian(patch, 1.0 / 8, 10, dtype=name)
            assert got.dtype == expected.numpy().dtype
            np.testing.assert_array_equal(got, expected.numpy(), err_msg=f"{patch} {name}")
