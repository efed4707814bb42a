"""The preprocessing runtime against nnU-Net v2's own code.

Two sources of truth:

* golden files (``tests/data/nnunet_golden_*.npz``, written by
  ``scripts/make_nnunet_golden.py`` with nnunetv2 2.8.1): nnU-Net's preprocessed image and
  exported label map for small volumes; these tests run everywhere;
* nnunetv2 itself when it is importable (``pip install -e .[nnunet]``): its resampling,
  shape and separate-z decisions and normalisation on random volumes at several spacings,
  and the whole preprocess / export path on new volumes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scripts.make_nnunet_golden import (
    CASES,
    INTENSITY,
    Case,
    make_volume,
    nnunet_reference,
    predictor,
)
from segnode.engines.manifest import ModelManifest
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.preprocess import CTNormalization, Geometry
from segnode.engines.preprocess.pipeline import run_model
from segnode.engines.preprocess.resampling import compute_new_shape, resample, separate_z_axis
from tests.conftest import nnunet_mark

DATA = Path(__file__).parent / "data"


needs_nnunet = nnunet_mark(
    "nnunetv2.inference.export_prediction",
    "nnunetv2.preprocessing.preprocessors.default_preprocessor",
)

AXIAL = Geometry(
    directions=((0.0, 0.0, 1.0), (0.0, 1.0, 0.0), (1.0, 0.0, 0.0)),
    spacing=(1.0, 1.0, 1.0),
    plane_normal=(0.0, 0.0, 1.0),
)


def _manifest(tmp_path: Path, case: Case) -> ModelManifest:
    """A version-2 manifest with ``case``'s grid, nnU-Net's defaults and three classes."""
    (tmp_path / "fold_0.onnx").write_bytes(b"")
    backward = [0, 0, 0]
    for i, t in enumerate(case.transpose):
        backward[t] = i
    raw = {
        "manifest_version": 2,
        "name": "golden",
        "version": "1",
        "folds": ["fold_0.onnx"],
        "patch_size": [16, 16, 16],
        "geometry": {
            "spacing": list(case.target),
            "orientation": "source",
            "transpose_forward": list(case.transpose),
            "transpose_backward": backward,
        },
        "preprocessing": {
            "crop_to_nonzero": True,
            "normalization": "ct",
            "intensity": dict(INTENSITY),
        },
        "labels": [
            {"value": v, "name": n, "category": ["1", "SCT", "c"], "type": ["2", "SCT", "t"]}
            for v, n in ((1, "low"), (2, "high"))
        ],
    }
    if case.regions:  # as DATASET_JSON_REGIONS: organ = labels 1 and 2, core = label 2
        raw["regions"] = [[1, 2], [2]]
        raw["regions_class_order"] = [1, 2]
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(raw))
    return load_manifest(path)


def _run(
    hu: np.ndarray[Any, Any], case: Case, manifest: ModelManifest
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """segnode's network input and label map for ``hu`` on ``case``'s source grid."""
    seen: list[np.ndarray[Any, Any]] = []

    def predict(image: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        seen.append(np.array(image))
        return predictor(case)(image)

    geometry = Geometry(AXIAL.directions, case.spacing, AXIAL.plane_normal)
    labels = run_model(hu.astype(np.float32), geometry, manifest, predict)
    return seen[0], labels


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_golden_pipeline(case: Case, tmp_path: Path) -> None:
    golden = np.load(DATA / f"nnunet_golden_{case.name}.npz")
    np.testing.assert_array_equal(golden["hu"], make_volume(case))  # the script's input
    image, labels = _run(golden["hu"], case, _manifest(tmp_path, case))
    assert image.shape == golden["image"].shape
    np.testing.assert_allclose(image, golden["image"], rtol=0, atol=1e-5)
    assert labels.shape == golden["labels"].shape == case.shape
    assert labels.dtype == np.uint8
    assert np.count_nonzero(labels != golden["labels"]) == 0


def test_golden_pipeline_detects_a_wrong_spacing(tmp_path: Path) -> None:
    """The comparison above can fail: a model run at the source spacing disagrees."""
    case = CASES[2]
    golden = np.load(DATA / f"nnunet_golden_{case.name}.npz")
    wrong = Case(case.name, case.shape, case.spacing, (1.25, 0.7, 0.7))
    image, labels = _run(golden["hu"], wrong, _manifest(tmp_path, wrong))
    assert image.shape != golden["image"].shape
    assert np.count_nonzero(labels != golden["labels"]) > 0


# -- live oracle: nnunetv2's own functions ----------------------------------------------------

SPACINGS = [
    ((1.0, 1.0, 1.0), (1.5, 1.5, 1.5)),
    ((5.0, 0.8, 0.8), (1.5, 1.5, 1.5)),
    ((1.25, 0.7, 0.7), (1.5, 1.5, 1.5)),
    ((1.5, 1.5, 1.5), (5.0, 0.8, 0.8)),
    ((2.5, 0.6, 0.6), (1.0, 1.0, 1.0)),
    ((0.8, 0.8, 5.0), (1.0, 1.0, 1.0)),
    ((1.0, 1.0, 1.0), (0.5, 0.8, 0.8)),
    ((3.0, 3.0, 1.0), (1.0, 1.0, 1.0)),
]


@needs_nnunet
@pytest.mark.parametrize(("spacing", "target"), SPACINGS)
@pytest.mark.parametrize("order", [0, 1, 3])
def test_resample_matches_nnunet(
    spacing: tuple[float, float, float], target: tuple[float, float, float], order: int
) -> None:
    from nnunetv2.preprocessing.resampling import default_resampling as nn

    rng = np.random.default_rng(order)
    shape = (9, 21, 17)
    data = (rng.normal(size=(2, *shape)) * 400).astype(np.float32)
    new_shape = compute_new_shape(shape, spacing, target)
    assert new_shape == tuple(nn.compute_new_shape(shape, spacing, target))
    do_separate, axis = nn.determine_do_sep_z_and_axis(None, spacing, target)
    mine_axis = separate_z_axis(spacing, target)
    assert mine_axis == (axis if do_separate else None)
    ref = nn.resample_data_or_seg_to_shape(data, new_shape, spacing, target, False, order, 0, None)
    ours = resample(data, new_shape, order=order, separate_axis=mine_axis)
    assert ours.dtype == ref.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-3)  # HU-scale values, float32 output
    ref64 = nn.resample_data_or_seg_to_shape(
        data.astype(np.float64), new_shape, spacing, target, False, order, 0, None
    )
    ours64 = resample(data.astype(np.float64), new_shape, order=order, separate_axis=mine_axis)
    assert float(np.max(np.abs(ours64 - ref64))) < 1e-9


@needs_nnunet
def test_ct_normalization_matches_nnunet() -> None:
    from nnunetv2.preprocessing.normalization.default_normalization_schemes import (
        CTNormalization as NnunetCT,
    )

    rng = np.random.default_rng(7)
    hu = (rng.normal(size=(6, 30, 30)) * 700).astype(np.float32)
    ref = NnunetCT(use_mask_for_norm=False, intensityproperties=dict(INTENSITY)).run(hu.copy())
    ours = CTNormalization(
        mean=INTENSITY["mean"],
        std=INTENSITY["std"],
        lower=INTENSITY["percentile_00_5"],
        upper=INTENSITY["percentile_99_5"],
    )(hu)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, ref)


LIVE = [
    Case("live_iso", (11, 19, 17), (1.0, 1.0, 1.0), (1.5, 1.5, 1.5), seed=11),
    Case("live_aniso", (7, 26, 24), (5.0, 0.8, 0.8), (1.5, 1.5, 1.5), seed=12),
    Case("live_native", (16, 30, 28), (1.25, 0.7, 0.7), (1.5, 1.5, 1.5), seed=13),
    Case("live_up", (8, 12, 12), (1.5, 1.5, 1.5), (0.8, 0.8, 0.8), seed=14),
    Case(
        "live_transposed",
        (10, 20, 18),
        (0.8, 0.8, 5.0),
        (1.5, 1.5, 1.5),
        transpose=(1, 2, 0),
        zero_border=True,
        seed=15,
    ),
    Case("live_regions", (9, 22, 20), (3.0, 0.7, 0.7), (1.5, 1.5, 1.5), seed=16, regions=True),
]


@needs_nnunet
@pytest.mark.parametrize("case", LIVE, ids=[c.name for c in LIVE])
def test_pipeline_matches_nnunet_live(case: Case, tmp_path: Path) -> None:
    hu = make_volume(case)
    ref_image, ref_labels = nnunet_reference(hu, case)
    image, labels = _run(hu, case, _manifest(tmp_path, case))
    np.testing.assert_allclose(image, ref_image, rtol=0, atol=1e-5)
    assert np.count_nonzero(labels != ref_labels) == 0
