"""Tests of the inference layer: manifests, sliding window, ONNX Runtime backend, tissue model.

Everything runs for real (ONNX Runtime on the CPU, models built here with ``onnx.helper``).
The real-CT tests read ``../shared/data`` beside the project and skip when it is absent.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from segnode.engines import EngineError, create_engine, load_manifest
from segnode.engines.base import out_of_gpu_memory
from segnode.engines.models import default_manifest_path
from segnode.engines.models.build_tissue import LABELS, PATCH_SIZE, write_model
from segnode.engines.ort_backend import OrtEngine, preprocess
from segnode.engines.sliding_window import gaussian_importance, patch_grid, sliding_window_segment

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
PHANTOM = DATA / "ct-phantom-philips-28"
LIVER = DATA / "ct-liver-3slice"

BACKGROUND, BODY, LUNG, FAT, SOFT, BONE = range(6)

FloatArray = npt.NDArray[np.float32]


# -- helpers -------------------------------------------------------------------------------


def _one_hot_predict(classes: int, kind: str) -> Callable[[FloatArray], Any]:
    """A predict that returns the one-hot (logits, labels) of the rounded input values."""

    def predict(batch: FloatArray) -> Any:
        assert batch.dtype == np.float32 and batch.ndim == 5 and batch.shape[1] == 1
        labels = np.rint(batch[:, 0]).astype(np.int64)
        if kind == "labels":
            return labels[:, None].astype(np.uint8)
        out = (labels[:, None] == np.arange(classes)[None, :, None, None, None]).astype(np.float32)
        result: FloatArray = out * np.float32(8.0) - np.float32(4.0) if kind == "logits" else out
        return result

    return predict


def _write_one_hot_model(
    folder: Path,
    patch: tuple[int, int, int],
    classes: int,
    *,
    kind: str = "probabilities",
    batch_dim: int | str = "batch",
    manifest_patch: tuple[int, int, int] | None = None,
    **manifest: Any,
) -> Path:
    """Write an ONNX model returning the one-hot of its rounded input, plus its manifest."""
    shape_in = [batch_dim, 1, *patch]
    shape_out = [batch_dim, 1 if kind == "labels" else classes, *patch]
    codes = numpy_helper.from_array(
        np.arange(classes, dtype=np.float32).reshape(1, classes, 1, 1, 1), "codes"
    )
    nodes = [
        helper.make_node("Round", ["x"], ["r"]),
        helper.make_node("Equal", ["r", "codes"], ["eq"]),
        helper.make_node("Cast", ["eq"], ["y" if kind == "probabilities" else "p"], to=1),
    ]
    inits = [codes]
    out_type = TensorProto.FLOAT
    if kind == "logits":
        nodes.append(helper.make_node("Mul", ["p", "scale"], ["y"]))
        inits.append(numpy_helper.from_array(np.array(8.0, np.float32), "scale"))
    if kind == "labels":
        nodes = [
            helper.make_node("Round", ["x"], ["r"]),
            helper.make_node("Cast", ["r"], ["y"], to=TensorProto.UINT8),
        ]
        inits, out_type = [], TensorProto.UINT8
    graph = helper.make_graph(
        nodes,
        "one_hot",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape_in)],
        [helper.make_tensor_value_info("y", out_type, shape_out)],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "one_hot.onnx").write_bytes(model.SerializeToString())
    raw = {
        "name": "one_hot",
        "version": "0.1",
        "onnx": "one_hot.onnx",
        "input_name": "x",
        "output_name": "y",
        "output_kind": kind,
        "patch_size": list(manifest_patch or patch),
        "overlap": 0.5,
        "labels": [
            {
                "value": v,
                "name": f"class {v}",
                "category": ["85756007", "SCT", "Tissue"],
                "type": ["85756007", "SCT", "Tissue"],
            }
            for v in range(1, classes)
        ],
    }
    raw.update(manifest)
    path = folder / "one_hot.json"
    path.write_text(json.dumps(raw))
    return path


def _read_series(folder: Path) -> FloatArray:
    """Read a CT series as HU ``(z, y, x)``, slices sorted along the patient z axis."""
    pydicom = pytest.importorskip("pydicom")
    if not folder.is_dir():
        pytest.skip(f"real CT data not available at {folder}")
    files = [p for p in sorted(folder.iterdir()) if p.is_file() and _is_dicom(p)]
    datasets = sorted(
        (pydicom.dcmread(p) for p in files), key=lambda ds: float(ds.ImagePositionPatient[2])
    )
    slices = [
        ds.pixel_array.astype(np.float32) * float(ds.RescaleSlope) + float(ds.RescaleIntercept)
        for ds in datasets
    ]
    return np.stack(slices).astype(np.float32)


def _is_dicom(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(132)[128:] == b"DICM"


def _fractions(labels: npt.NDArray[np.uint8]) -> npt.NDArray[np.float64]:
    return np.bincount(labels.ravel(), minlength=6) / labels.size


@pytest.fixture(scope="module")
def tissue_engine() -> Iterator[OrtEngine]:
    with OrtEngine() as engine:
        engine.load(load_manifest(default_manifest_path()))
        yield engine


# -- manifests -----------------------------------------------------------------------------


def _valid_manifest() -> dict[str, Any]:
    return json.loads(default_manifest_path().read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m["labels"].reverse(), "label values must be 1..N"),
        (lambda m: m.update(patch_size=[16, 512]), "patch_size"),
        (lambda m: m.update(patch_size=[0, 512, 512]), "patch_size"),
        (lambda m: m.update(overlap=1.0), "overlap"),
        (lambda m: m.update(overlap=[0.0, 0.5]), "overlap"),
        (lambda m: m.update(overlap=[0.0, 0.5, -0.1]), "overlap"),
        (lambda m: m.update(overlap="0.5"), "overlap"),
        (lambda m: m.pop("name"), "invalid manifest"),
        (lambda m: m["labels"][0].update(type=["38266002", "SCT"]), "labels[0].type"),
        (lambda m: m["labels"][1].update(category="Tissue"), "labels[1].category"),
    ],
)
def test_manifest_validation_errors(
    tmp_path: Path, change: Callable[[dict[str, Any]], Any], message: str
) -> None:
    raw = _valid_manifest()
    change(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(EngineError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_manifest(path)


def test_manifest_unreadable(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="cannot read model manifest"):
        load_manifest(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(EngineError, match="cannot read model manifest"):
        load_manifest(tmp_path / "broken.json")


def test_default_manifest() -> None:
    manifest = load_manifest(default_manifest_path().with_suffix(".onnx"))
    assert manifest.name == "tissue"
    assert manifest.onnx_path.is_file()
    assert manifest.num_classes == 6
    assert manifest.patch_size == PATCH_SIZE
    assert manifest.output_kind == "labels"
    assert manifest.overlap == (0.0, 0.125, 0.125)
    assert manifest.clip == (-1024.0, 3071.0)
    assert [lab.name for lab in manifest.labels] == [
        "Body",
        "Lung and airway",
        "Adipose tissue",
        "Soft tissue",
        "Bone",
    ]
    assert manifest.label(2).type == ("39607008", "SCT", "Lung")
    assert manifest.label(3).type == ("55603005", "SCT", "Fat")
    assert all(lab.category[1] == "SCT" and lab.type[1] == "SCT" for lab in manifest.labels)
    assert len({lab.color for lab in manifest.labels}) == len(manifest.labels)


# -- patch grid and Gaussian ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "patch", "overlap"),
    [
        ((16, 512, 512), (16, 512, 512), 0.125),
        ((128, 512, 512), (16, 512, 512), 0.125),
        ((37, 50, 61), (8, 16, 16), 0.5),
        ((9, 10, 11), (4, 4, 4), 0.0),
        ((3, 100, 7), (16, 32, 16), 0.25),
        ((100, 5, 5), (7, 5, 5), 0.9),
    ],
)
def test_patch_grid_covers_every_voxel(
    shape: tuple[int, int, int], patch: tuple[int, int, int], overlap: float
) -> None:
    grid = patch_grid(shape, patch, overlap)
    covered = np.zeros(shape, dtype=np.int32)
    for patch_slices in grid:
        for sl, size, n in zip(patch_slices, patch, shape, strict=True):
            assert sl.stop - sl.start == size
            assert sl.start >= 0 and (sl.stop <= n or sl.start == 0)
        covered[patch_slices] += 1
    assert covered.min() >= 1
    starts = [tuple(sl.start for sl in p) for p in grid]
    assert starts == sorted(starts), "grid must be z-major"
    for axis in range(3):
        axis_starts = sorted({s[axis] for s in starts})
        if shape[axis] > patch[axis]:
            assert axis_starts[-1] == shape[axis] - patch[axis], "last patch flush with end"
            steps = np.diff(axis_starts)
            assert steps.max() <= max(1, int(patch[axis] * (1 - overlap)))


def test_patch_grid_overlap_per_axis() -> None:
    grid = patch_grid((128, 600, 512), (2, 512, 512), (0.0, 0.125, 0.125))
    assert sorted({p[0].start for p in grid}) == list(range(0, 128, 2))
    assert sorted({p[1].start for p in grid}) == [0, 88]
    assert {p[2].start for p in grid} == {0}
    assert patch_grid((9, 9, 9), (4, 4, 4), 0.5) == patch_grid((9, 9, 9), (4, 4, 4), [0.5] * 3)


def test_patch_grid_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="overlap"):
        patch_grid((10, 10, 10), (4, 4, 4), 1.0)
    with pytest.raises(ValueError, match="overlap"):
        patch_grid((10, 10, 10), (4, 4, 4), (0.0, 0.5))
    with pytest.raises(ValueError, match="patch_size"):
        patch_grid((10, 10, 10), (4, 4), 0.5)
    with pytest.raises(ValueError, match="shape"):
        patch_grid((0, 10, 10), (4, 4, 4), 0.5)


@pytest.mark.parametrize(
    ("patch", "sigma_scale"), [((5, 8, 9), 0.125), ((16, 64, 64), 0.125), ((7, 40, 3), 0.01)]
)
def test_gaussian_importance(patch: tuple[int, int, int], sigma_scale: float) -> None:
    weights = gaussian_importance(patch, sigma_scale, np)
    assert weights.shape == patch and weights.dtype == np.float32
    assert weights.min() > 0.0
    assert weights.max() == pytest.approx(1.0)
    for axis in range(3):
        np.testing.assert_array_equal(weights, np.flip(weights, axis=axis))
    centre = tuple(n // 2 for n in patch)
    assert weights[centre] == weights.max()
    assert weights[0, 0, 0] < weights[centre]


# -- sliding window ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "patch"),
    [
        ((3, 20, 25), (8, 32, 32)),  # smaller than the patch on every axis
        ((8, 32, 32), (8, 32, 32)),  # exactly one patch
        ((21, 45, 38), (8, 16, 16)),  # not divisible
        ((5, 70, 33), (8, 16, 40)),  # smaller on some axes only
        ((21, 12, 16), (8, 16, 16)),  # one in-plane window, several along z
    ],
)
@pytest.mark.parametrize("kind", ["logits", "probabilities", "labels"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_sliding_window_reproduces_label_map(
    shape: tuple[int, int, int], patch: tuple[int, int, int], kind: str, batch_size: int
) -> None:
    rng = np.random.default_rng(sum(shape))
    expected = rng.integers(0, 5, size=shape, dtype=np.uint8)
    labels = sliding_window_segment(
        expected.astype(np.float32),
        _one_hot_predict(5, kind),
        patch_size=patch,
        overlap=0.5,
        num_classes=5,
        batch_size=batch_size,
        output_kind=kind,
    )
    assert labels.dtype == np.uint8 and labels.shape == shape
    np.testing.assert_array_equal(labels, expected)


@pytest.mark.parametrize(
    ("shape", "patch"), [((21, 45, 38), (8, 16, 16)), ((21, 12, 16), (8, 16, 16))]
)
@pytest.mark.parametrize("kind", ["logits", "labels"])
def test_sliding_window_uses_only_the_array_api(
    shape: tuple[int, int, int], patch: tuple[int, int, int], kind: str
) -> None:
    """The same code runs on a strict, minimal array-API namespace (stand-in for CuPy/torch)."""
    xps = pytest.importorskip("array_api_strict")
    expected = np.random.default_rng(1).integers(0, 4, size=shape, dtype=np.uint8)

    def predict(batch: Any) -> Any:
        values = xps.round(batch[:, 0, ...])
        if kind == "labels":
            return xps.astype(values, xps.float32)[:, None, ...]  # as torch's .to(float32)
        one_hot = [xps.astype(values == float(c), xps.float32) for c in range(4)]
        return xps.stack(one_hot, axis=1) * 6.0 - 3.0

    labels = sliding_window_segment(
        xps.asarray(expected.astype(np.float32)),
        predict,
        patch_size=patch,
        overlap=0.5,
        num_classes=4,
        batch_size=2,
        output_kind=kind,
    )
    assert labels.dtype == xps.uint8
    np.testing.assert_array_equal(np.asarray(labels), expected)


def test_sliding_window_prefers_the_patch_nearest_its_centre() -> None:
    depth, patch = 20, (8, 4, 4)
    starts = [g[0].start for g in patch_grid((depth, 4, 4), patch, 0.5)]
    assert starts == [0, 4, 8, 12]
    volume = np.broadcast_to(
        np.arange(depth, dtype=np.float32)[:, None, None], (depth, 4, 4)
    ).copy()

    def predict(batch: FloatArray) -> FloatArray:
        # Each patch votes, everywhere, for its own index in the grid.
        out = np.zeros((batch.shape[0], len(starts), *patch), dtype=np.float32)
        for n in range(batch.shape[0]):
            out[n, starts.index(int(batch[n, 0, 0, 0, 0]))] = 1.0
        return out

    labels = sliding_window_segment(
        volume,
        predict,
        patch_size=patch,
        overlap=0.5,
        num_classes=len(starts),
        output_kind="probabilities",
    )
    centres = np.array(starts) + (patch[0] - 1) / 2
    for z in range(depth):
        distances = np.abs(centres - z)
        covering = [i for i, s in enumerate(starts) if s <= z < s + patch[0]]
        nearest = min(covering, key=lambda i: (distances[i], i))
        assert (labels[z] == nearest).all(), z


def test_sliding_window_rejects_bad_input() -> None:
    volume = np.zeros((4, 8, 8), dtype=np.float32)
    predict = _one_hot_predict(3, "logits")
    common: dict[str, Any] = {"patch_size": (4, 8, 8), "overlap": 0.5, "num_classes": 3}
    with pytest.raises(ValueError, match="output_kind"):
        sliding_window_segment(volume, predict, output_kind="scores", **common)
    with pytest.raises(ValueError, match="batch_size"):
        sliding_window_segment(volume, predict, batch_size=0, **common)
    with pytest.raises(ValueError, match="volume"):
        sliding_window_segment(volume[0], predict, **common)
    with pytest.raises(ValueError, match="predict returned shape"):
        sliding_window_segment(volume, predict, **{**common, "num_classes": 4})
    with pytest.raises(ValueError, match="predict returned shape"):
        sliding_window_segment(volume, predict, output_kind="labels", **common)
    with pytest.raises(ValueError, match="predict returned label 3"):
        sliding_window_segment(
            volume + 3.0, _one_hot_predict(3, "labels"), output_kind="labels", **common
        )


@pytest.mark.parametrize("overlap", [0.5, (0.5, 0.25, 0.5), (0.0, 0.5, 0.5)])
def test_sliding_window_labels_blend_like_one_hot_probabilities(
    overlap: float | tuple[float, float, float],
) -> None:
    """Where patches overlap, a labels model is blended as its one-hot probabilities: the
    label maps are identical even when overlapping patches disagree."""
    shape, patch = (19, 37, 30), (6, 16, 16)
    rng = np.random.default_rng(5)
    volume = rng.normal(0.0, 1.0, shape).astype(np.float32)

    def votes(batch: FloatArray) -> npt.NDArray[np.uint8]:
        # Each patch labels a voxel from its value and the patch's own mean: patches
        # disagree where they overlap.
        means = batch.mean(axis=(1, 2, 3, 4), keepdims=True)
        return np.asarray((batch - means > 0).astype(np.uint8) + (batch > 1.0), np.uint8)

    def one_hot(batch: FloatArray) -> FloatArray:
        labels = votes(batch)[:, 0]
        out = labels[:, None] == np.arange(3)[None, :, None, None, None]
        return np.asarray(out, dtype=np.float32)

    common: dict[str, Any] = {"patch_size": patch, "overlap": overlap, "num_classes": 3}
    expected = sliding_window_segment(volume, one_hot, output_kind="probabilities", **common)
    got = sliding_window_segment(volume, votes, output_kind="labels", batch_size=2, **common)
    np.testing.assert_array_equal(got, expected)
    assert len(np.unique(expected)) == 3


@pytest.mark.parametrize("kind", ["labels", "logits"])
@pytest.mark.parametrize("batch_size", [1, 5, 64])
def test_whole_slice_patches_run_as_views_of_the_volume(kind: str, batch_size: int) -> None:
    """Patches that are whole slices stacked without overlap go to ``predict`` as reshaped
    views of the volume (no copies), and label every voxel from its one patch."""
    shape, patch = (24, 20, 18), (2, 20, 18)
    rng = np.random.default_rng(7)
    volume = rng.normal(0.0, 1.0, shape).astype(np.float32)
    slice_means = volume.mean(axis=(1, 2), keepdims=True)
    expected = ((volume > slice_means).astype(np.uint8) + (volume > 1.0)).astype(np.uint8)
    views: list[bool] = []

    def predict(batch: FloatArray) -> npt.NDArray[Any]:
        views.append(np.shares_memory(batch, volume))
        means = batch.mean(axis=(3, 4), keepdims=True)  # per slice: z positions independent
        labels = ((batch > means).astype(np.uint8) + (batch > 1.0)).astype(np.uint8)
        if kind == "labels":
            return labels
        return np.concatenate([labels == c for c in range(3)], axis=1).astype(np.float32)

    got = sliding_window_segment(
        volume,
        predict,
        patch_size=patch,
        overlap=(0.0, 0.5, 0.5),
        num_classes=3,
        batch_size=batch_size,
        output_kind=kind,
    )
    np.testing.assert_array_equal(got, expected)
    assert views and all(views) and len(views) == -(-12 // batch_size)


# -- ONNX Runtime backend ------------------------------------------------------------------


def test_registry_creates_ort_engine() -> None:
    engine = create_engine("onnxruntime", threads=1)
    assert isinstance(engine, OrtEngine)
    assert engine.name == "onnxruntime"
    engine.close()


@pytest.mark.parametrize("kind", ["logits", "probabilities", "labels"])
@pytest.mark.parametrize("threads", [1, 3])
def test_ort_engine_runs_a_model_through_the_sliding_window(
    tmp_path: Path, kind: str, threads: int
) -> None:
    manifest = load_manifest(
        _write_one_hot_model(tmp_path, (4, 16, 16), 4, kind=kind, batch={"opt": 2})
    )
    rng = np.random.default_rng(7)
    expected = rng.integers(0, 4, size=(9, 23, 40), dtype=np.uint8)
    with OrtEngine(threads=threads) as engine:
        engine.load(manifest)
        labels = engine.segment(expected.astype(np.float32))
        assert labels.dtype == np.uint8
        np.testing.assert_array_equal(labels, expected)
        # int16 HU (a view, not a float32 copy) give the same labels
        np.testing.assert_array_equal(engine.segment(expected.astype(np.int16)), expected)


def test_ort_engine_applies_preprocessing(tmp_path: Path) -> None:
    path = _write_one_hot_model(
        tmp_path, (2, 8, 8), 4, preprocessing={"clip": [0, 30], "scale": 0.1, "offset": 0.0}
    )
    manifest = load_manifest(path)
    hu = np.array([-500.0, 4.0, 11.0, 19.0, 26.0, 900.0], dtype=np.float32).reshape(1, 1, 6)
    np.testing.assert_allclose(preprocess(hu, manifest).ravel(), [0, 0.4, 1.1, 1.9, 2.6, 3.0])
    with OrtEngine() as engine:
        engine.load(manifest)
        assert engine.segment(hu).ravel().tolist() == [0, 0, 1, 2, 3, 3]


def test_ort_engine_load_errors(tmp_path: Path) -> None:
    engine = OrtEngine()
    with pytest.raises(EngineError, match="before load"):
        engine.segment(np.zeros((2, 8, 8), np.float32))

    manifest = load_manifest(_write_one_hot_model(tmp_path / "ok", (2, 8, 8), 3))
    missing = replace(manifest, onnx_path=tmp_path / "nope.onnx")
    with pytest.raises(EngineError, match="not found"):
        engine.load(missing)

    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"this is not a protobuf")
    with pytest.raises(EngineError, match="cannot load"):
        engine.load(replace(manifest, onnx_path=garbage))

    # a file from an onnx newer than this ONNX Runtime: the versions and the ways out
    newer = onnx.load(manifest.onnx_path)
    newer.ir_version = 99
    onnx.save(newer, tmp_path / "newer.onnx")
    with pytest.raises(EngineError, match=r"IR version 99, and ONNX Runtime .* reads up to \d+"):
        engine.load(replace(manifest, onnx_path=tmp_path / "newer.onnx"))

    wrong_patch = _write_one_hot_model(tmp_path / "p", (2, 8, 8), 3, manifest_patch=(4, 8, 8))
    with pytest.raises(EngineError, match="input shape"):
        engine.load(load_manifest(wrong_patch))

    wrong_classes = replace(manifest, labels=manifest.labels[:1])
    with pytest.raises(EngineError, match="output shape"):
        engine.load(wrong_classes)

    wrong_input = _write_one_hot_model(tmp_path / "i", (2, 8, 8), 3, input_name="ct")
    with pytest.raises(EngineError, match="no input named 'ct'"):
        engine.load(load_manifest(wrong_input))

    wrong_kind = _write_one_hot_model(tmp_path / "k", (2, 8, 8), 3, output_kind="scores")
    with pytest.raises(EngineError, match="output_kind"):
        engine.load(load_manifest(wrong_kind))

    with pytest.raises(EngineError, match="not available"):
        OrtEngine(providers=["NoSuchExecutionProvider"]).load(manifest)

    engine.load(manifest)
    with pytest.raises(EngineError, match=r"\(z, y, x\)"):
        engine.segment(np.zeros((8, 8), np.float32))


def test_ort_engine_fixed_batch_model(tmp_path: Path) -> None:
    manifest = load_manifest(_write_one_hot_model(tmp_path, (2, 8, 8), 3, batch_dim=1))
    expected = np.random.default_rng(3).integers(0, 3, size=(5, 11, 9), dtype=np.uint8)
    with OrtEngine() as engine:
        engine.load(manifest)
        np.testing.assert_array_equal(engine.segment(expected.astype(np.float32)), expected)


# -- the default "tissue" model ------------------------------------------------------------


def _synthetic_phantom(depth: int = 20, size: int = 256) -> FloatArray:
    """Air, a water body ellipse with a fat layer, a lung, a bone rod, and a thin table."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32)
    radius = np.sqrt(((y - 128) / 90) ** 2 + ((x - 128) / 110) ** 2)
    image = np.full((size, size), -1000.0, dtype=np.float32)
    image[radius <= 1.0] = -100.0  # fat under the skin
    image[radius <= 0.85] = 40.0  # water / soft tissue
    image[(y - 110) ** 2 + (x - 80) ** 2 <= 25**2] = -850.0  # lung
    image[(y - 150) ** 2 + (x - 160) ** 2 <= 10**2] = 700.0  # bone rod
    image[225:228, 20:236] = 300.0  # a 3-voxel table top, 7 voxels below the body
    rng = np.random.default_rng(0)
    noise = rng.normal(0.0, 8.0, size=(depth, size, size)).astype(np.float32)
    volume: FloatArray = np.clip(image[None] + noise, -1024.0, 3071.0).astype(np.float32)
    return volume


PROBES = {
    (5, 5): BACKGROUND,  # air in a corner
    (226, 128): BACKGROUND,  # the table
    (222, 128): BACKGROUND,  # air between body and table
    (128, 128): SOFT,
    (110, 80): LUNG,
    (150, 160): BONE,
    (128, 229): FAT,  # fat layer, right side
    (40, 128): FAT,  # fat layer, top
}


def test_tissue_model_on_synthetic_phantom(tissue_engine: OrtEngine) -> None:
    volume = _synthetic_phantom()
    labels = tissue_engine.segment(volume)
    assert labels.shape == volume.shape and labels.dtype == np.uint8
    for (y, x), expected in PROBES.items():
        assert (labels[:, y, x] == expected).all(), ((y, x), np.unique(labels[:, y, x]))
    y, x = np.mgrid[0:256, 0:256]
    radius = np.sqrt(((y - 128) / 90) ** 2 + ((x - 128) / 110) ** 2)
    assert (labels[:, radius > 1.05] == BACKGROUND).all(), "air outside must be background"
    assert (labels[:, radius < 0.95] != BACKGROUND).all(), "the body must be filled"
    assert (labels == BODY).any(), "the skin rim is body"


def test_tissue_model_batch_of_patches(tmp_path: Path) -> None:
    volume = _synthetic_phantom(depth=40)
    with OrtEngine() as single, OrtEngine() as batched:
        manifest = load_manifest(default_manifest_path())
        single.load(manifest)
        batched.load(replace(manifest, batch_opt=3))
        np.testing.assert_array_equal(single.segment(volume), batched.segment(volume))


def test_build_is_deterministic_and_matches_committed(tmp_path: Path) -> None:
    first = write_model(tmp_path / "a")
    second = write_model(tmp_path / "b")
    committed = default_manifest_path()
    for name in ("tissue.onnx", "tissue.json"):
        data = (first.parent / name).read_bytes()
        assert data == (second.parent / name).read_bytes(), f"{name} differs between builds"
        assert data == (committed.parent / name).read_bytes(), (
            f"committed {name} is stale: run python -m segnode.engines.models.build_tissue"
        )
    assert json.loads(first.read_text())["labels"] == LABELS


def test_tissue_model_uses_tensorrt_friendly_graph() -> None:
    model = onnx.load(str(default_manifest_path().with_suffix(".onnx")))
    assert model.opset_import[0].version == 17
    assert not model.graph.initializer or all(
        init.data_type in (TensorProto.FLOAT, TensorProto.INT64) for init in model.graph.initializer
    )
    allowed = {
        "Greater", "Less", "Not", "And", "Or", "Cast", "Neg", "Sub", "Mul", "Add", "Max",
        "MaxPool", "AveragePool", "CumSum", "Reshape", "Expand", "DepthToSpace",
    }  # fmt: skip
    assert {node.op_type for node in model.graph.node} <= allowed
    (graph_input,) = model.graph.input
    dims = [d.dim_param or d.dim_value for d in graph_input.type.tensor_type.shape.dim]
    assert dims == ["batch", 1, *PATCH_SIZE]
    (graph_output,) = model.graph.output
    assert graph_output.type.tensor_type.elem_type == TensorProto.UINT8
    dims = [d.dim_param or d.dim_value for d in graph_output.type.tensor_type.shape.dim]
    assert dims == ["batch", 1, *PATCH_SIZE]


# -- real CT -------------------------------------------------------------------------------


def test_tissue_model_on_real_head_phantom(tissue_engine: OrtEngine) -> None:
    volume = _read_series(PHANTOM)
    assert volume.shape == (28, 512, 512)
    fractions = _fractions(tissue_engine.segment(volume))
    assert fractions[BACKGROUND] > 0.5, fractions
    assert fractions[1:].sum() > 0.05, fractions
    assert fractions[BONE] > 0.01, fractions  # the skull
    assert fractions[SOFT] > 0.005, fractions  # the inserts
    assert fractions[LUNG] > 0.05, fractions  # the phantom's skull is filled with air


def test_tissue_model_on_real_abdomen(tissue_engine: OrtEngine) -> None:
    volume = _read_series(LIVER)
    assert volume.shape == (3, 512, 512)
    labels = tissue_engine.segment(volume)
    fractions = _fractions(labels)
    assert 0.3 < fractions[BACKGROUND] < 0.7, fractions
    assert fractions[LUNG] > 0.03, fractions  # lung bases
    assert fractions[FAT] > 0.05, fractions
    assert fractions[SOFT] > 0.1, fractions  # liver, muscle
    assert fractions[BONE] > 0.005, fractions  # spine, ribs
    assert (labels[:, 480:, :] == BACKGROUND).mean() > 0.9, "the table is not body"


def test_out_of_gpu_memory_becomes_an_engine_error() -> None:
    """The GPU engines' out-of-memory errors (torch's, CuPy's) become EngineError naming what
    ran out; other errors pass unchanged."""

    class OutOfMemoryError(RuntimeError):
        pass

    expected = r"^out of GPU memory loading unet: 2 GiB more$"
    with (
        pytest.raises(EngineError, match=expected) as info,
        out_of_gpu_memory(OutOfMemoryError, "loading unet"),
    ):
        raise OutOfMemoryError("2 GiB more")
    assert isinstance(info.value.__cause__, OutOfMemoryError)
    with (
        pytest.raises(ValueError, match="not memory"),
        out_of_gpu_memory(OutOfMemoryError, "loading unet"),
    ):
        raise ValueError("not memory")
    with out_of_gpu_memory(OutOfMemoryError, "loading unet"):
        pass


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("tensorrt", {"cache_dir": "unused"}),
        ("kserve", {"url": "http://127.0.0.1:1"}),
        ("torch", {}),
    ],
)
def test_every_backend_refuses_an_unknown_precision_naming_itself(
    name: str, options: dict[str, str]
) -> None:
    """One check (``engines.base.checked_precision``) for every backend that takes a
    precision, refused when the engine is made, before anything loads."""
    with pytest.raises(EngineError, match=rf"^{name}: precision must be fp32 or fp16, got 'int8'"):
        create_engine(name, precision="int8", **options)
