"""The preprocessing runtime: orientation (exact, every acquisition), tilt, normalisation,
the array-API paths (NumPy and torch give the same results) and run_model end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydicom.dataset import Dataset

from segnode.engines.manifest import ModelManifest
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.models import default_manifest_path
from segnode.engines.preprocess import (
    CTNormalization,
    Geometry,
    GeometryError,
    LinearNormalization,
    nonzero_bbox,
    plan_reorientation,
    resample,
)
from segnode.engines.preprocess.orientation import check_orientation_code
from segnode.engines.preprocess.pipeline import run_model
from segnode.node.ingest.volume import Volume

try:
    import torch
except ImportError:  # the NumPy path is tested without it
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

# Patient-space test object: W[i, j, k] is the voxel i mm superior, j mm anterior and k mm to
# the patient's right of a corner, i.e. at LPS (-k, -j, i). Its orientation code is "SAR".
W_SHAPE = (5, 7, 6)
W = np.random.default_rng(0).integers(-1000, 2000, size=W_SHAPE).astype(np.float32)

# (name, row direction, column direction, slice axis): Image Orientation (Patient) and the
# direction in which the slices follow each other.
ACQUISITIONS = [
    ("axial head-first supine", (1, 0, 0), (0, 1, 0), (0, 0, 1)),
    ("axial head-first, slices descending", (1, 0, 0), (0, 1, 0), (0, 0, -1)),
    ("axial feet-first supine", (-1, 0, 0), (0, 1, 0), (0, 0, -1)),
    ("axial prone", (-1, 0, 0), (0, -1, 0), (0, 0, 1)),
    ("axial flipped rows", (-1, 0, 0), (0, 1, 0), (0, 0, 1)),
    ("coronal", (1, 0, 0), (0, 0, -1), (0, 1, 0)),
    ("coronal feet-first", (-1, 0, 0), (0, 0, -1), (0, -1, 0)),
    ("sagittal", (0, 1, 0), (0, 0, -1), (-1, 0, 0)),
    ("sagittal flipped", (0, -1, 0), (0, 0, -1), (1, 0, 0)),
]
SPACING = (2.5, 0.7, 0.9)  # along slices, between rows, between columns


def _acquire(
    row: tuple[int, ...], col: tuple[int, ...], slices: tuple[int, ...]
) -> tuple[np.ndarray[Any, Any], Geometry]:
    """The (slices, rows, columns) array a modality stores of W, and its geometry."""
    directions = [np.array(slices), np.array(col), np.array(row)]
    size = {0: W_SHAPE[2], 1: W_SHAPE[1], 2: W_SHAPE[0]}  # LPS axis -> W's extent along it
    shape = tuple(size[int(np.argmax(np.abs(d)))] for d in directions)
    index = np.indices(shape).reshape(3, -1)
    points = sum(index[m][:, None] * directions[m][None, :] for m in range(3))
    lows = np.array([-(W_SHAPE[2] - 1), -(W_SHAPE[1] - 1), 0])
    points = points - points.min(axis=0) + lows  # place the grid on W's extent
    values = W[points[:, 2], -points[:, 1], -points[:, 0]].reshape(shape)
    origin = points[0].astype(float) * 0.0 + points[0]
    positions = [
        tuple(float(v) for v in origin + k * SPACING[0] * directions[0]) for k in range(shape[0])
    ]
    geometry = Geometry.from_image_plane(row, col, positions, SPACING[1:])
    return values, geometry


@pytest.mark.parametrize(("name", "row", "col", "slices"), ACQUISITIONS)
@pytest.mark.parametrize("target", ["SAR", "SPL", "RAS", "LPI", "ASR"])
def test_reorientation_is_exact(
    name: str, row: tuple[int, ...], col: tuple[int, ...], slices: tuple[int, ...], target: str
) -> None:
    source, geometry = _acquire(row, col, slices)
    plan = plan_reorientation(geometry, target)
    model = plan.to_model(source, np)
    # the same object seen in the target orientation: W ("SAR") re-indexed
    expected = plan_reorientation(_sar_geometry(), target).to_model(W, np)
    np.testing.assert_array_equal(model, expected)
    np.testing.assert_array_equal(plan.to_source(model, np), source)
    # spacing follows its axis: the slice spacing lands on the model axis along the slices
    slice_axis = "LRPASI"[
        2 * int(np.argmax(np.abs(slices))) : 2 * int(np.argmax(np.abs(slices))) + 2
    ]
    t = next(i for i, c in enumerate(target) if c in slice_axis)
    assert plan.spacing_to_model(geometry.spacing)[t] == pytest.approx(SPACING[0])
    # channels first (logits) re-index the same way
    stacked = np.stack([source, -source])
    np.testing.assert_array_equal(plan.to_model(stacked, np)[1], -expected)
    np.testing.assert_array_equal(plan.to_source(plan.to_model(stacked, np), np), stacked)


def _sar_geometry() -> Geometry:
    return Geometry(
        directions=((0.0, 0.0, 1.0), (0.0, -1.0, 0.0), (-1.0, 0.0, 0.0)),
        spacing=(1.0, 1.0, 1.0),
        plane_normal=(0.0, 0.0, 1.0),
    )


def test_orientation_codes() -> None:
    _, geometry = _acquire((1, 0, 0), (0, 1, 0), (0, 0, 1))
    assert geometry.orientation_code() == "SPL"
    _, geometry = _acquire((-1, 0, 0), (0, 1, 0), (0, 0, -1))
    assert geometry.orientation_code() == "IPR"
    assert check_orientation_code("sar") == "SAR"
    for bad in ("SA", "SAX", "SSR", "LRA"):
        with pytest.raises(ValueError, match="orientation"):
            check_orientation_code(bad)


def test_source_orientation_is_identity() -> None:
    source, geometry = _acquire((0, 1, 0), (0, 0, -1), (-1, 0, 0))
    plan = plan_reorientation(geometry, "source")
    assert plan.is_identity
    assert plan.to_model(source, np) is source


def test_geometry_from_volume() -> None:
    volume = Volume(
        hu=np.zeros((3, 4, 5), dtype=np.float32),
        origin=(0.0, 0.0, 0.0),
        row_direction=(-1.0, 0.0, 0.0),
        column_direction=(0.0, 1.0, 0.0),
        normal=(0.0, 0.0, -1.0),
        spacing=(2.0, 0.5, 0.75),
        sources=(Dataset(),),
        frame_of_reference_uid="1.2",
        study_instance_uid="1.3",
        series_instance_uid="1.4",
    )
    geometry = Geometry.from_volume(volume)
    assert geometry.orientation_code() == "IPR"
    assert geometry.spacing == pytest.approx((2.0, 0.5, 0.75))
    assert geometry.shear_degrees == pytest.approx(0.0)


def test_gantry_tilt_refused_unless_allowed() -> None:
    angle = np.radians(12.0)
    positions = [(0.0, k * 2.0 * np.tan(angle), k * 2.0) for k in range(4)]  # sheared stack
    sheared = Geometry.from_image_plane((1, 0, 0), (0, 1, 0), positions, (0.8, 0.8))
    assert sheared.shear_degrees == pytest.approx(12.0)
    with pytest.raises(GeometryError, match=r"gantry-tilted series.*12\.0 degrees"):
        plan_reorientation(sheared, "SAR")
    with pytest.raises(GeometryError, match="gantry-tilted"):
        plan_reorientation(sheared, "source")
    assert plan_reorientation(sheared, "SAR", tilt_allowed=True).flips == (False, True, True)

    col = (0.0, float(np.cos(angle)), -float(np.sin(angle)))  # tilted plane, straight stack
    normal = np.cross((1.0, 0.0, 0.0), col)
    oblique = Geometry.from_image_plane(
        (1, 0, 0), col, [tuple(k * 2.0 * normal) for k in range(4)], (0.8, 0.8)
    )
    assert oblique.shear_degrees == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(GeometryError, match=r"oblique series.*12\.0 degrees"):
        plan_reorientation(oblique, "SAR")
    assert plan_reorientation(oblique, "SPL", tilt_allowed=True).is_identity
    slight = Geometry.from_image_plane(
        (1, 0, 0), (0.0, float(np.cos(0.01)), -float(np.sin(0.01))), [(0, 0, 0), (0, 0, 1)], (1, 1)
    )
    plan_reorientation(slight, "SAR")  # 0.57 degrees: within the tolerance


def test_geometry_errors() -> None:
    with pytest.raises(GeometryError, match="at least two"):
        Geometry.from_image_plane((1, 0, 0), (0, 1, 0), [(0, 0, 0)], (1, 1))
    with pytest.raises(GeometryError, match="same position"):
        Geometry.from_image_plane((1, 0, 0), (0, 1, 0), [(0, 0, 0), (0, 0, 0)], (1, 1))
    with pytest.raises(GeometryError, match="not a unit vector"):
        Geometry.from_image_plane((2, 0, 0), (0, 1, 0), [(0, 0, 0), (0, 0, 1)], (1, 1))


# -- normalisation and cropping ---------------------------------------------------------------


def test_ct_normalization() -> None:
    hu = np.array([-3000.0, -1000.0, 0.0, 100.0, 5000.0], dtype=np.float32)
    out = CTNormalization(mean=100.0, std=50.0, lower=-1000.0, upper=1000.0)(hu)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [-22.0, -22.0, -2.0, 0.0, 18.0])
    flat = CTNormalization(mean=0.0, std=0.0, lower=-1.0, upper=1.0)(hu)
    np.testing.assert_allclose(flat, np.array([-1, -1, 0, 1, 1]) / 1e-8)
    np.testing.assert_array_equal(hu, [-3000.0, -1000.0, 0.0, 100.0, 5000.0])  # not modified


def test_linear_normalization() -> None:
    hu = np.array([-2000.0, 0.0, 4000.0], dtype=np.float32)
    out = LinearNormalization(clip=(-1024.0, 3071.0), scale=0.5, offset=1.0)(hu)
    np.testing.assert_allclose(out, [-511.0, 1.0, 1536.5])
    np.testing.assert_array_equal(LinearNormalization()(hu), hu)


def test_nonzero_bbox() -> None:
    image = np.zeros((6, 7, 8), dtype=np.float32)
    assert nonzero_bbox(image) == (slice(0, 6), slice(0, 7), slice(0, 8))
    image[2, 3, 4] = -1.0
    image[4, 1, 5] = 2.0
    assert nonzero_bbox(image) == (slice(2, 5), slice(1, 4), slice(4, 6))


@needs_torch
def test_nonzero_bbox_torch() -> None:
    image = torch.zeros((6, 7, 8))
    image[2, 3, 4] = -1.0
    image[4, 1, 5] = 2.0
    assert nonzero_bbox(image) == (slice(2, 5), slice(1, 4), slice(4, 6))


# -- one code path on NumPy and torch ---------------------------------------------------------


@needs_torch
@pytest.mark.parametrize("order", [0, 1, 3])
@pytest.mark.parametrize(("new_shape", "axis"), [((7, 13, 11), None), ((20, 8, 9), 0)])
def test_resample_torch_matches_numpy(
    order: int, new_shape: tuple[int, int, int], axis: int | None
) -> None:
    data = np.random.default_rng(order).normal(size=(2, 5, 17, 15)).astype(np.float32) * 300
    ours = resample(data, new_shape, order=order, separate_axis=axis)
    on_torch = resample(torch.from_numpy(data), new_shape, order=order, separate_axis=axis)
    assert isinstance(on_torch, torch.Tensor) and on_torch.dtype == torch.float32
    np.testing.assert_allclose(on_torch.numpy(), ours, rtol=0, atol=1e-3)
    fast = resample(
        torch.from_numpy(data), new_shape, order=order, precise=False, separate_axis=axis
    )
    np.testing.assert_allclose(fast.numpy(), ours, rtol=0, atol=0.05)


def test_resample_properties() -> None:
    data = np.random.default_rng(3).normal(size=(1, 6, 9, 8)).astype(np.float32)
    assert resample(data, (6, 9, 8), order=3) is data  # nothing to do
    up = resample(data, (12, 18, 16), order=3)
    assert up.min() >= data.min() and up.max() <= data.max()  # clipped like scikit-image
    constant = np.full((1, 5, 6, 7), 3.25, dtype=np.float32)
    np.testing.assert_allclose(resample(constant, (9, 4, 11), order=3), 3.25, rtol=1e-6)
    ramp = np.broadcast_to(np.arange(8, dtype=np.float32), (1, 4, 4, 8))
    down = resample(ramp, (4, 4, 4), order=1)  # linear: centres at 0.5, 2.5, 4.5, 6.5
    np.testing.assert_allclose(down[0, 0, 0], [0.5, 2.5, 4.5, 6.5])
    with pytest.raises(ValueError, match="order"):
        resample(data, (3, 3, 3), order=2)
    with pytest.raises(ValueError, match=r"\(C, z, y, x\)"):
        resample(data[0], (3, 3, 3), order=1)


# -- run_model --------------------------------------------------------------------------------


def _v2(tmp_path: Path, **changes: Any) -> ModelManifest:
    (tmp_path / "fold_0.onnx").write_bytes(b"")
    raw: dict[str, Any] = {
        "manifest_version": 2,
        "name": "m",
        "version": "1",
        "folds": ["fold_0.onnx"],
        "patch_size": [8, 8, 8],
        "geometry": {"spacing": list(SPACING), "orientation": "SAR"},
        "preprocessing": {"normalization": "linear"},
        "labels": [
            {"value": v, "name": f"l{v}", "category": ["1", "SCT", "c"], "type": ["2", "SCT", "t"]}
            for v in (1, 2)
        ],
    }
    raw.update(changes)
    (tmp_path / "m.json").write_text(json.dumps(raw))
    return load_manifest(tmp_path / "m.json")


def _threshold_logits(image: Any) -> Any:
    """Three-class logits: class 2 above 500, class 1 above 0, else 0 (any namespace)."""
    low = image * 0.0
    on_torch = torch is not None and isinstance(image, torch.Tensor)
    return (torch.stack if on_torch else np.stack)([low, (image > 0) * 1.0, (image > 500) * 2.0])


def _expected(hu: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.where(hu > 500, 2, np.where(hu > 0, 1, 0)).astype(np.uint8)


@pytest.mark.parametrize(("name", "row", "col", "slices"), ACQUISITIONS)
def test_run_model_orientation_round_trip(
    name: str, row: tuple[int, ...], col: tuple[int, ...], slices: tuple[int, ...], tmp_path: Path
) -> None:
    """At the model's own spacing nothing is interpolated: the network sees W exactly in its
    orientation and the labels land on the source voxels they came from."""
    source, geometry = _acquire(row, col, slices)
    geometry = Geometry(geometry.directions, (1.0, 1.0, 1.0), geometry.plane_normal)
    manifest = _v2(tmp_path, geometry={"spacing": [1.0, 1.0, 1.0], "orientation": "SAR"})
    seen: list[Any] = []

    def predict(image: Any) -> Any:
        seen.append(image)
        return _threshold_logits(image)

    labels = run_model(source, geometry, manifest, predict)
    np.testing.assert_array_equal(seen[0], W)
    np.testing.assert_array_equal(labels, _expected(source))


@needs_torch
@pytest.mark.parametrize(("name", "row", "col", "slices"), ACQUISITIONS[::2])
def test_run_model_torch_matches_numpy(
    name: str, row: tuple[int, ...], col: tuple[int, ...], slices: tuple[int, ...], tmp_path: Path
) -> None:
    """The same code on torch tensors: same labels, uint8 tensor, resampling included."""
    source, geometry = _acquire(row, col, slices)
    manifest = _v2(tmp_path, geometry={"spacing": [1.0, 1.2, 0.8], "orientation": "SAR"})
    labels = run_model(source, geometry, manifest, _threshold_logits)
    on_torch = run_model(torch.from_numpy(source), geometry, manifest, _threshold_logits)
    assert isinstance(on_torch, torch.Tensor) and on_torch.dtype == torch.uint8
    np.testing.assert_array_equal(on_torch.numpy(), labels)


def test_run_model_resamples_and_returns_the_source_shape(tmp_path: Path) -> None:
    source, geometry = _acquire((-1, 0, 0), (0, 1, 0), (0, 0, -1))  # feet-first, 2.5 mm slices
    manifest = _v2(tmp_path, geometry={"spacing": [1.0, 1.0, 1.0], "orientation": "SAR"})
    shapes: list[tuple[int, ...]] = []

    def predict(image: Any) -> Any:
        shapes.append(tuple(image.shape))
        return _threshold_logits(image)

    labels = run_model(source, geometry, manifest, predict)
    assert shapes == [(12, 5, 5)]  # S: 5 x 2.5 mm, A: 7 x 0.7 mm, R: 6 x 0.9 mm at 1 mm
    assert labels.shape == source.shape and labels.dtype == np.uint8
    agree = np.mean(labels == _expected(source))
    assert agree > 0.5  # coarse grid, random data: most voxels survive the round trip


def test_run_model_v1_manifest() -> None:
    """A version-1 manifest runs on the source grid with its clip/scale/offset."""
    manifest = load_manifest(default_manifest_path())
    source, geometry = _acquire((1, 0, 0), (0, 1, 0), (0, 0, 1))
    seen: list[Any] = []

    def predict(image: Any) -> Any:
        seen.append(image)
        return (image > 0).astype(np.uint8)  # a label map: taken back with order 0

    labels = run_model(source, geometry, manifest, predict)
    np.testing.assert_array_equal(seen[0], np.clip(source, -1024, 3071))
    np.testing.assert_array_equal(labels, (source > 0).astype(np.uint8))


def test_run_model_regions(tmp_path: Path) -> None:
    manifest = _v2(
        tmp_path,
        geometry={"spacing": [1.0, 1.0, 1.0], "orientation": "source"},
        regions=[[1, 2], [2]],
        regions_class_order=[1, 2],
    )
    assert manifest.output_channels == 2
    hu = np.array([[[-5.0, 5.0, 600.0]]] * 2, dtype=np.float32)
    geometry = Geometry(((0, 0, 1), (0, 1, 0), (1, 0, 0)), (1.0, 1.0, 1.0), (0, 0, 1))

    def predict(image: Any) -> Any:
        return np.stack([image, image - 500.0])  # region logits: > 0 inside

    labels = run_model(hu, geometry, manifest, predict)
    np.testing.assert_array_equal(labels[0, 0], [0, 1, 2])


def test_run_model_checks_predict(tmp_path: Path) -> None:
    manifest = _v2(tmp_path, geometry={"spacing": [1.0, 1.0, 1.0], "orientation": "source"})
    hu = np.zeros((2, 3, 4), dtype=np.float32)
    geometry = Geometry(((0, 0, 1), (0, 1, 0), (1, 0, 0)), (1.0, 1.0, 1.0), (0, 0, 1))
    with pytest.raises(ValueError, match=r"predict returned shape \(2, 2, 3, 4\)"):
        run_model(hu, geometry, manifest, lambda image: np.stack([image, image]))
    with pytest.raises(ValueError, match="predict returned labels"):
        run_model(hu, geometry, manifest, lambda image: np.zeros((1, 1, 1), dtype=np.uint8))


def test_resample_corners_is_scipy_zoom_without_grid_mode() -> None:
    """``grid="corners"`` (the TotalSegmentator scheme) equals ``scipy.ndimage.zoom`` with
    ``grid_mode=False, mode="nearest"``, which TotalSegmentator's ``change_spacing`` calls,
    for orders 0 and 1, up and down, and differs from the centre-aligned grid."""
    ndimage = pytest.importorskip("scipy.ndimage")
    rng = np.random.default_rng(4)
    for shape, target in (((20, 31, 17), (9, 40, 17)), ((5, 6, 7), (11, 3, 8))):
        data = rng.standard_normal(shape) * 100
        zoom = [t / s for t, s in zip(target, shape, strict=True)]
        for order in (0, 1):
            want = ndimage.zoom(data, zoom, order=order, mode="nearest", grid_mode=False)
            got = resample(data[None], target, order=order, grid="corners")[0]
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
        centred = resample(data[None], target, order=1)[0]
        assert np.abs(centred - want).max() > 1.0
    with pytest.raises(ValueError, match="orders 0 and 1"):
        resample(np.zeros((1, 4, 4, 4)), (8, 8, 8), order=3, grid="corners")
    with pytest.raises(ValueError, match="grid must be one of"):
        resample(np.zeros((1, 4, 4, 4)), (8, 8, 8), order=1, grid="edges")


def test_resampling_scheme_is_validated(tmp_path: Path) -> None:
    """``resampling.scheme``: nnunet (default) or totalsegmentator, the latter with order 0 or
    1 only; anything else is refused with the key named."""
    from segnode.engines.manifest import ManifestError

    assert _v2(tmp_path).model_contract().scheme == "nnunet"
    ts = {"scheme": "totalsegmentator", "data_order": 1}
    assert _v2(tmp_path, resampling=ts).model_contract().scheme == "totalsegmentator"
    with pytest.raises(ManifestError, match="resampling.data_order"):
        _v2(tmp_path, resampling={**ts, "data_order": 3})
    with pytest.raises(ManifestError, match="resampling.scheme"):
        _v2(tmp_path, resampling={"scheme": "scipy"})


def test_run_model_totalsegmentator_scheme_is_scipy_change_spacing(tmp_path: Path) -> None:
    """The totalsegmentator scheme is TotalSegmentator's pipeline written with SciPy: the HU
    image zoomed (order 1, grid_mode=False) to the model's spacing and truncated, labelled
    there, and the labels zoomed back with order 0, on the model's orientation."""
    ndimage = pytest.importorskip("scipy.ndimage")
    rng = np.random.default_rng(9)
    hu = ndimage.gaussian_filter(rng.standard_normal((30, 41, 37)), 3) * 4000
    hu = hu.astype(np.float32)
    geometry = Geometry.from_image_plane(
        (-1.0, 0.0, 0.0), (0.0, 1.0, 0.0), [(0.0, 0.0, 2.5 * k) for k in range(30)], (0.7, 0.9)
    )
    manifest = _v2(tmp_path, resampling={"scheme": "totalsegmentator", "data_order": 1})
    got = run_model(hu, geometry, manifest, _threshold_logits)

    reorient = plan_reorientation(geometry, "SAR")
    image = reorient.to_model(hu, np)
    spacing = reorient.spacing_to_model(geometry.spacing)
    shape = tuple(round(n * s / t) for n, s, t in zip(image.shape, spacing, SPACING, strict=True))
    zoomed = ndimage.zoom(image.astype(np.float64), [n / o for n, o in zip(shape, image.shape,
                          strict=True)], order=1, mode="nearest", grid_mode=False)  # fmt: skip
    labels = _expected(np.trunc(zoomed))
    back = ndimage.zoom(labels, [o / n for o, n in zip(image.shape, shape, strict=True)],
                        order=0, mode="nearest", grid_mode=False)  # fmt: skip
    want = reorient.to_source(back, np)
    assert got.shape == hu.shape
    np.testing.assert_array_equal(got, want)
    assert 0 < int((got == 2).sum()) < got.size
