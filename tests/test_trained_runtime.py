"""Version-2 (trained) models run in the node: every fold loaded by the backends,
:func:`segnode.engines.trained.segment_trained` (reorient, resample to the model's spacing,
nnU-Net's window with mirroring and the fold average, back to the source grid), the worker and a
whole node, gantry tilt refused as a failed job, and composite models (several parts merged into one
label space).

The models are real ONNX files built here: a 3x3x3 mean filter followed by per-channel
``2 mu_k x - mu_k^2``, so that the arg-max is the label ``k`` whose centre ``mu_k`` is nearest
the (normalised, locally averaged) intensity: label bands of HU that the test can predict.
"""

from __future__ import annotations

import argparse
import io
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from segnode.engines.base import EngineError, TrainedEngine
from segnode.engines.manifest import ManifestError, ModelManifest, check_runnable
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.nnunet_window import predict_for_manifest
from segnode.engines.ort_backend import OrtEngine
from segnode.engines.preprocess.orientation import Geometry, GeometryError
from segnode.engines.preprocess.pipeline import run_model
from segnode.engines.trained import segment_trained

# Normalisation of every test model: (clip(HU, -1000, 1000) - 0) / 500.
INTENSITY = {"mean": 0.0, "std": 500.0, "percentile_00_5": -1000.0, "percentile_99_5": 1000.0}
# Channel centres (normalised intensity) of the two folds: background at air (-2), label 1 at
# soft tissue (0 = 0 HU), label 2 at bone (0.7 = 350 HU); bands split near -500 and 175 HU.
BANDS = ([-2.0, 0.0, 0.7], [-2.0, 0.05, 0.75])
PATCH = (16, 16, 16)
SPACING = (1.25, 0.7, 0.7)  # source (z, y, x): 0.7 x 0.7 mm pixels, 1.25 mm slices


def _code(meaning: str) -> list[str]:
    return ["T-D0050", "SRT", meaning]


def _labels(names: Sequence[str]) -> list[dict[str, Any]]:
    return [
        {
            "value": i + 1,
            "name": name,
            "category": ["91723000", "SCT", "Anatomical Structure"],
            "type": _code(name),
            "color": [40 * (i + 1), 100, 200],
        }
        for i, name in enumerate(names)
    ]


def write_band_model(
    path: Path, centres: Sequence[float], *, patch: Sequence[int] = PATCH, batch: int | str = "N"
) -> Path:
    """ONNX model: mean of a 3x3x3 neighbourhood, then ``2 mu_k x - mu_k^2`` per channel."""
    channels = len(centres)
    weight = np.zeros((channels, 1, 3, 3, 3), dtype=np.float32)
    for k, mu in enumerate(centres):
        weight[k, 0] = 2.0 * mu / 27.0
    bias = np.array([-(mu**2) for mu in centres], dtype=np.float32)
    node = helper.make_node(
        "Conv", ["input", "w", "b"], ["logits"], kernel_shape=[3, 3, 3], pads=[1] * 6
    )
    graph = helper.make_graph(
        [node],
        "bands",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 1, *patch])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, channels, *patch])],
        initializer=[
            onnx.numpy_helper.from_array(weight, "w"),
            onnx.numpy_helper.from_array(bias, "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def write_trained(
    folder: Path,
    *,
    name: str = "bands",
    bands: Sequence[Sequence[float]] = BANDS,
    label_names: Sequence[str] = ("Soft tissue", "Bone"),
    orientation: str = "SAR",
    tilt_allowed: bool = False,
    **extra: Any,
) -> Path:
    """A version-2 manifest with one fold file per entry of ``bands`` (1.5 mm target)."""
    folder.mkdir(parents=True, exist_ok=True)
    folds = []
    for i, centres in enumerate(bands):
        write_band_model(folder / f"fold_{i}.onnx", centres)
        folds.append(f"fold_{i}.onnx")
    raw: dict[str, Any] = {
        "manifest_version": 2,
        "name": name,
        "version": "1.0.0",
        "folds": folds,
        "input_name": "input",
        "output_name": "logits",
        "output_kind": "logits",
        "patch_size": list(PATCH),
        "overlap": 0.5,
        "mirror_axes": [0, 1, 2],
        "batch": {"min": 1, "opt": 2, "max": 4},
        "geometry": {
            "spacing": [1.5, 1.5, 1.5],
            "orientation": orientation,
            "gantry_tilt_allowed": tilt_allowed,
        },
        "preprocessing": {
            "crop_to_nonzero": True,
            "normalization": "ct",
            "intensity": INTENSITY,
        },
        "resampling": {"data_order": 3, "logits_order": 1},
        "labels": _labels(label_names),
        **extra,
    }
    path = folder / f"{name}.json"
    path.write_text(json.dumps(raw, indent=1))
    return path


def phantom(shape: tuple[int, int, int] = (40, 64, 64)) -> npt.NDArray[np.float32]:
    """Air with an off-centre soft-tissue box (40 HU) holding a bone ball (400 HU)."""
    hu = np.full(shape, -1000.0, dtype=np.float32)
    hu[5:32, 10:44, 18:60] = 40.0
    z, y, x = np.meshgrid(*(np.arange(n, dtype=np.float32) for n in shape), indexing="ij")
    mm = ((z - 20) * SPACING[0]) ** 2 + ((y - 26) * SPACING[1]) ** 2 + ((x - 36) * SPACING[2]) ** 2
    hu[mm <= 9.0**2] = 400.0
    return hu


def bands_of(hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    """The labels the band models aim at, straight from the HU."""
    return (hu > -500).astype(np.uint8) + (hu > 175).astype(np.uint8)


def dice(a: npt.NDArray[Any], b: npt.NDArray[Any], value: int) -> float:
    x, y = a == value, b == value
    return 2.0 * float((x & y).sum()) / max(1, int(x.sum() + y.sum()))


def geometry(kind: str, shape: tuple[int, int, int]) -> Geometry:
    """Head-first or feet-first supine axial geometry of a ``shape`` volume."""
    row = (1.0, 0.0, 0.0) if kind == "head-first" else (-1.0, 0.0, 0.0)
    col = (0.0, 1.0, 0.0)
    step = SPACING[0] if kind == "head-first" else -SPACING[0]  # along row x col
    positions = [(0.0, 0.0, k * step) for k in range(shape[0])]
    return Geometry.from_image_plane(row, col, positions, SPACING[1:])


def tilted_geometry(slices: int, degrees: float) -> Geometry:
    """An axial stack whose columns are tilted by ``degrees`` (a gantry-tilted series)."""
    t = math.radians(degrees)
    row, col = (1.0, 0.0, 0.0), (0.0, math.cos(t), math.sin(t))
    normal = np.cross(row, col)
    positions = [tuple(float(v) for v in k * SPACING[0] * normal) for k in range(slices)]
    return Geometry.from_image_plane(row, col, positions, SPACING[1:])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trained")


@pytest.fixture(scope="module")
def manifest(model_dir: Path) -> ModelManifest:
    return load_manifest(write_trained(model_dir / "bands"))


@pytest.fixture(scope="module")
def ort_engine(manifest: ModelManifest) -> OrtEngine:
    engine = OrtEngine(threads=2)
    engine.load(manifest)
    return engine


# ----------------------------------------------------------------------- manifest & loading


def test_every_fold_is_a_model_file_and_v2_is_runnable(manifest: ModelManifest) -> None:
    units = manifest.model_files()
    assert [u.onnx_path for u in units] == list(manifest.fold_paths)
    assert len(units) == 2 and units[0].onnx_path != units[1].onnx_path
    assert len({u.name for u in units}) == 2  # own engine-cache entries per fold
    assert len({u.sha256() for u in units}) == 2
    check_runnable(manifest)  # version 2 runs now
    labels_kind = replace(manifest, output_kind="labels")
    with pytest.raises(ManifestError, match="output_kind 'labels' cannot run as a version-2"):
        check_runnable(labels_kind)


def test_ort_engine_loads_every_fold(ort_engine: OrtEngine, manifest: ModelManifest) -> None:
    assert isinstance(ort_engine, TrainedEngine)
    predictors = ort_engine.fold_predictors()
    assert len(predictors) == 2
    patches = np.random.default_rng(1).normal(size=(3, 1, *PATCH)).astype(np.float32)
    outs = [p(patches) for p in predictors]
    assert all(o.shape == (3, 3, *PATCH) and o.dtype == np.float32 for o in outs)
    assert not np.allclose(outs[0], outs[1])  # two different networks
    with pytest.raises(EngineError, match="segment_trained"):
        ort_engine.segment(phantom())  # version 1's entry point refuses a trained model


def test_batches_larger_than_the_engine_batch_are_split(model_dir: Path) -> None:
    """A model with a fixed batch axis of 2: predictors take any number of patches."""
    path = write_trained(model_dir / "fixed", name="fixed")
    for i, centres in enumerate(BANDS):
        write_band_model(path.parent / f"fold_{i}.onnx", centres, batch=2)
    engine = OrtEngine(threads=1)
    engine.load(load_manifest(path))
    assert engine.window_batch() == 2
    patches = np.random.default_rng(2).normal(size=(5, 1, *PATCH)).astype(np.float32)
    [first, _] = engine.fold_predictors()
    session = ort.InferenceSession(str(path.parent / "fold_0.onnx"))
    padded = np.concatenate([patches, np.zeros((1, 1, *PATCH), np.float32)])
    want = np.concatenate([session.run(None, {"input": padded[i : i + 2]})[0] for i in (0, 2, 4)])
    np.testing.assert_allclose(first(patches), want[:5], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------- the runtime


def test_ort_segment_trained_equals_run_model_with_plain_sessions(
    ort_engine: OrtEngine, manifest: ModelManifest
) -> None:
    hu = phantom()
    geo = geometry("head-first", hu.shape)  # type: ignore[arg-type]
    got = segment_trained(ort_engine, manifest, hu, geo)
    sessions = [ort.InferenceSession(str(p)) for p in manifest.fold_paths]

    def fold(session: ort.InferenceSession) -> Any:
        return lambda batch: session.run(None, {"input": np.ascontiguousarray(batch)})[0]

    predict = predict_for_manifest(
        manifest, [fold(s) for s in sessions], batch_size=ort_engine.window_batch()
    )
    want = run_model(hu, geo, manifest, predict)
    assert got.dtype == np.uint8 and got.shape == hu.shape
    assert np.array_equal(got, want)


@pytest.mark.parametrize("kind", ["head-first", "feet-first"])
def test_labels_on_the_source_grid_follow_the_intensity_bands(
    ort_engine: OrtEngine, manifest: ModelManifest, kind: str
) -> None:
    hu = phantom()
    labels = segment_trained(ort_engine, manifest, hu, geometry(kind, hu.shape))  # type: ignore[arg-type]
    assert labels.shape == hu.shape and labels.dtype == np.uint8
    want = bands_of(hu)
    assert dice(labels, want, 1) > 0.93, dice(labels, want, 1)
    assert dice(labels, want, 2) > 0.9, dice(labels, want, 2)
    # the model ran on its 1.5 mm grid: a 1.25 x 0.7 x 0.7 mm box edge is not voxel-exact
    assert not np.array_equal(labels, want)


def test_model_grid_is_the_target_spacing(ort_engine: OrtEngine, manifest: ModelManifest) -> None:
    """The predictors see the volume resampled to 1.5 mm, in SAR order."""
    hu = phantom()
    seen: list[tuple[int, ...]] = []
    inner = ort_engine.fold_predictors()

    class Spy:
        name = "spy"

        def fold_predictors(self) -> list[Any]:
            def wrap(p: Any) -> Any:
                def run(batch: Any) -> Any:
                    seen.append(tuple(batch.shape))
                    return p(batch)

                return run

            return [wrap(p) for p in inner]

        def window_batch(self) -> int:
            return 1

        def to_device(self, x: Any) -> Any:
            return x

        def to_host(self, x: Any) -> Any:
            return np.asarray(x, dtype=np.uint8)

        def device_scope(self) -> Any:
            import contextlib

            return contextlib.nullcontext()

    captured: list[tuple[int, ...]] = []
    original = predict_for_manifest(manifest, inner)

    def record(image: Any) -> Any:
        captured.append(tuple(image.shape))
        return original(image)

    run_model(hu, geometry("head-first", hu.shape), manifest, record)  # type: ignore[arg-type]
    # source (z, y, x) = (40 x 1.25, 64 x 0.7, 64 x 0.7) mm -> SAR: (S, A, R) at 1.5 mm
    want = (round(40 * 1.25 / 1.5), round(64 * 0.7 / 1.5), round(64 * 0.7 / 1.5))
    assert captured == [want]
    labels = segment_trained(Spy(), manifest, hu, geometry("head-first", hu.shape))  # type: ignore[arg-type]
    assert labels.shape == hu.shape
    tiles = math.prod(math.ceil((n - p) / (p * 0.5)) + 1 for n, p in zip(want, PATCH, strict=True))
    assert len(seen) == tiles * 8 * 2  # tiles x (1 + 7 mirrors) x 2 folds
    assert set(seen) == {(1, 1, *PATCH)}


def test_engine_loaded_with_another_model_is_refused(
    ort_engine: OrtEngine, manifest: ModelManifest, model_dir: Path
) -> None:
    three = load_manifest(write_trained(model_dir / "three", name="three", bands=BANDS * 2))
    hu = phantom((12, 20, 20))
    with pytest.raises(EngineError, match="2 fold network"):
        segment_trained(ort_engine, three, hu, geometry("head-first", hu.shape))  # type: ignore[arg-type]


def test_tilted_geometry_is_refused_unless_allowed(
    ort_engine: OrtEngine, manifest: ModelManifest
) -> None:
    hu = phantom((12, 24, 24))
    tilted = tilted_geometry(12, 12.0)
    with pytest.raises(GeometryError, match=r"oblique series: an image axis is 12\.0 degrees"):
        segment_trained(ort_engine, manifest, hu, tilted)
    allowed = replace(
        manifest,
        contract=replace(manifest.model_contract(), gantry_tilt_allowed=True),
    )
    assert segment_trained(ort_engine, allowed, hu, tilted).shape == hu.shape


# ------------------------------------------------------------------------------------- torch


def _torch_or_skip() -> Any:
    torch = pytest.importorskip("torch", reason="PyTorch not installed")
    try:
        import onnx2torch  # noqa: F401
    except Exception as exc:  # missing, or torchvision (its requirement) missing or broken
        pytest.skip(f"onnx2torch not usable here: {type(exc).__name__}: {exc}")
    return torch


def test_torch_backend_matches_onnxruntime(
    ort_engine: OrtEngine, manifest: ModelManifest, tmp_path: Path
) -> None:
    torch = _torch_or_skip()
    from segnode.engines.torch_backend import TorchEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = TorchEngine(device=device, precision="fp32")
    engine.load(manifest)
    try:
        assert len(engine.fold_engines) == 2 and len(engine.fold_predictors()) == 2
        hu = phantom()
        for kind in ("head-first", "feet-first"):
            geo = geometry(kind, hu.shape)  # type: ignore[arg-type]
            got = segment_trained(engine, manifest, hu, geo)
            want = segment_trained(ort_engine, manifest, hu, geo)
            assert got.dtype == np.uint8 and got.shape == hu.shape
            assert np.mean(got != want) < 1e-3, np.mean(got != want)
        with pytest.raises(EngineError, match="segment_trained"):
            engine.segment(hu)
    finally:
        engine.close()


# -------------------------------------------------------------------------------- composites


def write_composite(folder: Path, parts: list[dict[str, Any]], **extra: Any) -> Path:
    raw = {
        "manifest_version": 2,
        "name": "total",
        "version": "1.0.0",
        "parts": parts,
        "labels": _labels(["Soft tissue", "Bone", "Body"]),
        **extra,
    }
    path = folder / "total.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def composite_dir(model_dir: Path) -> Path:
    folder = model_dir / "composite"
    write_trained(folder / "part_a", name="part_a")
    # one label "Body" wherever the intensity is nearer 0.5 than -2: above about -375 HU
    write_trained(folder / "part_b", name="part_b", bands=[[-2.0, 0.5]], label_names=["Body"])
    return folder


def test_composite_merges_parts_in_order(composite_dir: Path) -> None:
    a = {"manifest": "part_a/part_a.json", "labels": {"1": 1, "2": 2}}
    b = {"manifest": "part_b/part_b.json", "labels": {"1": 3}}
    hu = phantom((24, 40, 40))
    hu[:, :, :6] = -450.0  # soft tissue for part A (above -500 HU), not "Body" for part B
    geo = geometry("feet-first", hu.shape)  # type: ignore[arg-type]
    singles = {}
    for name in ("part_a", "part_b"):
        part = load_manifest(composite_dir / name / f"{name}.json")
        engine = OrtEngine(threads=1)
        engine.load(part)
        singles[name] = segment_trained(engine, part, hu, geo)
    la, lb = singles["part_a"], singles["part_b"]
    assert (la == 1).any() and (la == 2).any() and (lb == 1).any()
    assert ((la == 1) & (lb == 0)).any()  # where the order of the parts shows
    results: dict[str, npt.NDArray[np.uint8]] = {}
    for order, parts in (("a-b", [a, b]), ("b-a", [b, a])):
        composite = load_manifest(write_composite(composite_dir, parts))
        assert composite.is_composite and len(composite.model_files()) == 3
        check_runnable(composite)
        engine = OrtEngine(threads=2)
        engine.load(composite)
        assert len(engine.fold_predictors()) == 3
        got = segment_trained(engine, composite, hu, geo)
        want = np.zeros(hu.shape, np.uint8)
        if order == "a-b":
            want[la == 1], want[la == 2] = 1, 2
            want[lb == 1] = 3  # later parts overwrite
        else:
            want[lb == 1] = 3
            want[la == 1], want[la == 2] = 1, 2
        assert np.array_equal(got, want), order
        results[order] = got
    assert all((results["b-a"] == v).any() for v in (1, 2))
    assert (results["a-b"] == 1).sum() < (results["b-a"] == 1).sum()
    # a part label left out of the mapping is dropped
    only_bone = {"manifest": "part_a/part_a.json", "labels": {"2": 2}}
    composite = load_manifest(write_composite(composite_dir, [only_bone]))
    engine = OrtEngine(threads=1)
    engine.load(composite)
    got = segment_trained(engine, composite, hu, geo)
    assert np.array_equal(got, np.where(la == 2, 2, 0).astype(np.uint8))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda p: p[0].update(manifest="part_z/part_z.json"),
            r"parts\[0\]\.manifest: no such file .*part_z",
        ),
        (lambda p: p[1]["labels"].update({"2": 3}), r"parts\[1\]\.labels: '2' is not a label"),
        (lambda p: p[0]["labels"].update({"1": 9}), r"parts\[0\]\.labels\['1'\]: merged value 9"),
        (lambda p: p[0].update(labels={}), r"parts\[0\]\.labels: an object"),
        (lambda p: p[0].pop("manifest"), r"parts\[0\]\.manifest: a manifest path is required"),
        (lambda p: p.clear(), r"parts: a non-empty list"),
    ],
)
def test_composite_load_errors_name_file_and_field(
    composite_dir: Path, change: Any, message: str
) -> None:
    parts = [
        {"manifest": "part_a/part_a.json", "labels": {"1": 1, "2": 2}},
        {"manifest": "part_b/part_b.json", "labels": {"1": 3}},
    ]
    change(parts)
    path = write_composite(composite_dir, parts)
    with pytest.raises(ManifestError, match=message) as info:
        load_manifest(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("key", ["folds", "geometry"])
def test_composite_has_no_folds_or_geometry_of_its_own(composite_dir: Path, key: str) -> None:
    parts = [{"manifest": "part_a/part_a.json", "labels": {"1": 1}}]
    path = write_composite(composite_dir, parts, **{key: ["x.onnx"] if key == "folds" else {}})
    with pytest.raises(ManifestError, match=f"{key}: a composite model .parts. has none"):
        load_manifest(path)


def test_composite_parts_are_version_2_single_models(composite_dir: Path) -> None:
    from segnode.engines.models import default_manifest_path

    v1 = composite_dir / "v1.json"
    raw = json.loads(default_manifest_path().read_text())
    raw["onnx"] = str(default_manifest_path().with_suffix(".onnx"))
    v1.write_text(json.dumps(raw))
    path = write_composite(composite_dir, [{"manifest": "v1.json", "labels": {"1": 1}}])
    with pytest.raises(ManifestError, match=r"parts\[0\]\.manifest: .* is a version-1 manifest"):
        load_manifest(path)
    inner = write_composite(composite_dir, [{"manifest": "part_a/part_a.json", "labels": {"1": 1}}])
    nested = inner.with_name("nested.json")
    nested.write_text(
        json.dumps(
            {
                "manifest_version": 2,
                "name": "nested",
                "version": "1",
                "parts": [{"manifest": inner.name, "labels": {"1": 1}}],
                "labels": _labels(["Soft tissue"]),
            }
        )
    )
    with pytest.raises(ManifestError, match=r"parts\[0\]\.manifest: .* is a composite"):
        load_manifest(nested)
    # A composite that names itself (or a composite naming it back) is refused the same way,
    # not by running out of stack.
    nested.write_text(nested.read_text().replace(inner.name, nested.name))
    with pytest.raises(ManifestError, match=r"parts\[0\]\.manifest: .* is a composite"):
        load_manifest(nested)
    raw_v1 = {**json.loads(inner.read_text()), "manifest_version": 1}
    inner.write_text(json.dumps(raw_v1))
    with pytest.raises(ManifestError, match="parts: a composite model needs manifest_version 2"):
        load_manifest(inner)


# ---------------------------------------------------------------------------- TensorRT builds


def test_engine_build_builds_every_fold_with_its_own_key(
    manifest: ModelManifest, tmp_path: Path
) -> None:
    """``segnode engine build`` of a 2-fold model: two engines (TensorRT-RTX, on the CPU),
    distinct keys; building again reuses both (no fold prunes the other)."""
    from segnode.engines.trt_build import load_flavour

    try:
        load_flavour("tensorrt_rtx")
    except EngineError as exc:
        pytest.skip(f"TensorRT-RTX not installed: {exc}")
    from segnode.engines.engine_cli import add_engine_parser, run_engine_command
    from segnode.engines.trt_backend import list_engines

    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["engine", "build", "--precision", "fp32", "--model", str(manifest.onnx_path.parent)]
    )
    args.model = str(manifest.onnx_path.parent / "bands.json")
    for verb in ("built", "reused"):
        out = io.StringIO()
        assert run_engine_command(args, data_dir=tmp_path, default_model=Path("-"), out=out) == 0
        assert out.getvalue().count(f"engine {verb}: ") == 2, out.getvalue()
        assert "bands.fold0 of bands" in out.getvalue() and "bands.fold1 of bands" in out.getvalue()
    records = list_engines(tmp_path / "engines")
    assert len(records) == 2 and all(r.valid for r in records)
    assert {r.key.model_sha256 for r in records} == {u.sha256() for u in manifest.model_files()}


# ------------------------------------------------------------------------- worker and node


def _reread(seg_path: Path, files: list[Path]) -> npt.NDArray[np.uint8]:
    """The SEG's labels per source instance through highdicom, in label values."""
    from tests.fixtures.seg_readback import seg_labels

    return seg_labels(seg_path, files, {"Soft tissue": 1, "Bone": 2, "Body": 3}.__getitem__)


def _direct(manifest: ModelManifest, files: list[Path]) -> npt.NDArray[np.uint8]:
    from segnode.node.ingest.volume import assemble_volume

    volume = assemble_volume(files)
    engine = OrtEngine(threads=1)
    engine.load(manifest)
    return segment_trained(engine, manifest, volume.hu, Geometry.from_volume(volume))


def test_worker_runs_a_trained_model_and_fails_a_tilted_series_with_the_reason(
    tmp_path: Path, ort_engine: OrtEngine, manifest: ModelManifest
) -> None:
    """The worker on a real ledger and spool: a tilted series becomes a failed job saying
    why; the next series is segmented on the source grid, its SEG and SR written."""
    from pydicom import dcmread

    from segnode.node.pipeline.worker import result_paths
    from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
    from tests.test_worker import ingest, worker_on

    worker, ledger, spool = worker_on(tmp_path, ort_engine, manifest)
    t = math.radians(15.0)
    tilted = write_synthetic_series(
        tmp_path / "tilted",
        PhantomGeometry(
            rows=48,
            columns=48,
            slices=12,
            orientation=(1.0, 0.0, 0.0, 0.0, math.cos(t), math.sin(t)),
        ),
        seed=5,
    )
    straight = write_synthetic_series(
        tmp_path / "in", PhantomGeometry(rows=64, columns=64, slices=20), seed=6
    )
    jobs = []
    for files in (tilted, straight):
        uid = ingest(ledger, spool, files)
        jobs.append(ledger.create_job(uid, trigger="test", model="default", engine="onnxruntime"))
    assert worker.run_once() and worker.run_once()
    failed, done = (ledger.job(j) for j in jobs)  # type: ignore[arg-type]
    assert failed is not None and failed.state == "failed"
    assert "oblique series: an image axis is 15.0 degrees" in (failed.reason or "")
    assert "gantry_tilt_allowed" in (failed.reason or "")
    assert done is not None and done.state == "done", done.reason if done else None
    seg_path, sr_path = sorted(result_paths(tmp_path, done.id))
    want = _direct(manifest, straight)
    assert set(np.unique(want).tolist()) == {0, 1, 2}
    assert np.array_equal(_reread(seg_path, straight), want)
    assert dcmread(sr_path).Modality == "SR"


def test_node_segments_a_series_with_a_trained_model(
    make_node: Any, manifest: ModelManifest, tmp_path: Path
) -> None:
    """``segnode serve`` with a version-2 model in ``[model]``: a series sent over DICOM
    (pynetdicom) gives a SEG whose labels, read back by highdicom, are those computed
    directly with segment_trained."""
    from scripts.harness import send_files
    from segnode.node.pipeline.worker import result_paths
    from tests.conftest import wait_for_the_job
    from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

    node = make_node(model={"manifest": str(manifest.fold_paths[0].parent / "bands.json")})
    files = write_synthetic_series(
        tmp_path / "in", PhantomGeometry(rows=64, columns=64, slices=20), seed=7
    )
    sent = send_files(files, node.port)
    assert sent.complete, sent

    job = wait_for_the_job(node, 90, "the trained model's job")
    seg_path, _ = sorted(result_paths(node.data_dir, int(job["id"])))
    assert np.array_equal(_reread(seg_path, files), _direct(manifest, files))


def test_torch_cache_keeps_one_artefact_per_fold(manifest: ModelManifest, tmp_path: Path) -> None:
    """The torch engine's compiled-artefact keys of the folds differ (fold file SHA-256 and
    name), and storing one fold's artefact does not prune the other's as superseded."""
    from segnode.engines.torch_cache import RuntimeFacts, TorchCache, load_or_build
    from segnode.engines.torch_compile import torch_key

    facts = RuntimeFacts("2.11.0+cu130", "13.0", "3.6.0", "1.5.15", "NVIDIA H200", "sm90")
    cache = TorchCache(tmp_path)
    keys = [
        torch_key(
            unit,
            facts,
            kind="inductor",
            precision="fp16",
            batch=2,
            channels_last=True,
            compile_mode="default",
        )
        for unit in manifest.model_files()
    ]
    assert len({k.digest() for k in keys}) == 2 and keys[0].model_name != keys[1].model_name
    for round_ in ("build", "hit"):
        for i, key in enumerate(keys):
            loaded = load_or_build(
                cache, key, lambda _tmp, i=i: f"fold {i}".encode(), lambda p: p.read_bytes()
            )
            assert loaded.value == f"fold {i}".encode() and loaded.hit == (round_ == "hit")
            cache.prune_superseded(key)
    assert len(cache.entries()) == 2


def test_worker_runs_a_composite_model(tmp_path: Path, composite_dir: Path) -> None:
    """A composite's job: the SEG holds the merged labels (segments named after the
    composite's labels), equal to segment_trained's merge."""
    from segnode.node.pipeline.worker import result_paths
    from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
    from tests.test_worker import ingest, run_job, worker_on

    parts = [
        {"manifest": "part_b/part_b.json", "labels": {"1": 3}},
        {"manifest": "part_a/part_a.json", "labels": {"2": 2}},
    ]
    composite = load_manifest(write_composite(composite_dir, parts))
    engine = OrtEngine(threads=2)
    engine.load(composite)
    worker, ledger, spool = worker_on(tmp_path, engine, composite)
    files = write_synthetic_series(
        tmp_path / "in", PhantomGeometry(rows=64, columns=64, slices=20), seed=8
    )
    job, view = run_job(worker, ledger, ingest(ledger, spool, files), model="default")
    assert view.state == "done", view.reason
    seg_path, _ = sorted(result_paths(tmp_path, job))
    want = _direct(composite, files)
    assert set(np.unique(want).tolist()) == {0, 2, 3}  # bone over body; soft tissue dropped
    assert np.array_equal(_reread(seg_path, files), want)


def test_identity_fed_weights_become_initializers() -> None:
    """ONNX exporters read equal weights (all-zero biases of a freshly initialised network)
    through ``Identity`` nodes; the torch backend turns those into initializers of their own
    before onnx2torch, which wants a convolution's weight and bias as initializers. The model
    computes the same."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from segnode.engines.torch_convert import fold_initializer_nodes

    rng = np.random.default_rng(2)
    weight = numpy_helper.from_array(rng.standard_normal((2, 1, 3, 3, 3)).astype(np.float32), "w")
    bias = numpy_helper.from_array(np.zeros(2, dtype=np.float32), "b0")
    nodes = [
        helper.make_node("Identity", ["b0"], ["b1"]),
        helper.make_node("Identity", ["b1"], ["b2"]),
        helper.make_node("Conv", ["x", "w", "b2"], ["y"], pads=[1] * 6),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4, 4])],
        [weight, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnx 1.23 writes IR 14 by default; ONNX Runtime 1.30 reads up to 13
    before = model.SerializeToString()
    fixed = fold_initializer_nodes(model)
    onnx.checker.check_model(fixed)
    assert [n.op_type for n in fixed.graph.node] == ["Conv"]
    assert {"b1", "b2"} <= {t.name for t in fixed.graph.initializer}
    x = rng.standard_normal((1, 1, 4, 4, 4)).astype(np.float32)
    want = ort.InferenceSession(before).run(None, {"x": x})[0]
    got = ort.InferenceSession(fixed.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


def test_cast_weights_become_float32_initializers() -> None:
    """A model that stores its weights in float16 and casts them in the graph (the committed
    phantom folds, scripts/onnx_fp16_storage.py) is handed to onnx2torch with the casts
    folded into float32 initializers, so that an FP16 torch engine converts them with the rest
    (a cast left in the graph would pin them to float32 against half inputs). Same outputs."""
    import onnx
    import onnxruntime as ort

    from segnode.engines.torch_convert import fold_initializer_nodes

    path = Path(__file__).resolve().parent / "data" / "nnunet_phantom" / "fold_0.onnx"
    if not path.is_file():
        pytest.skip("the committed phantom model is missing")
    model = onnx.load(str(path))
    assert any(n.op_type == "Cast" for n in model.graph.node)
    before = model.SerializeToString()
    folded = fold_initializer_nodes(model)
    onnx.checker.check_model(folded)
    assert not any(n.op_type == "Cast" for n in folded.graph.node)
    used = {name for n in folded.graph.node for name in n.input}
    assert all(t.name in used for t in folded.graph.initializer)
    assert all(t.data_type == onnx.TensorProto.FLOAT for t in folded.graph.initializer)
    x = np.random.default_rng(5).standard_normal((1, 1, 48, 48, 48)).astype(np.float32)
    want = ort.InferenceSession(before).run(None, {"input": x})[0]
    got = ort.InferenceSession(folded.SerializeToString()).run(None, {"input": x})[0]
    np.testing.assert_array_equal(got, want)
