"""segnode.engines.calibrate and ``segnode model calibrate``: INT8 calibration from DICOM series,
the accuracy guard, the manifest's precision, and the precision in the SEG and SR."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from scripts.nnunet_phantom import FOV, Anatomy, Grid, OracleCase, write_dicom_case
from segnode.engines.base import EngineError, run_precision
from segnode.engines.calibrate import (
    CalibrationError,
    GuardFailed,
    calibrate,
    dice_per_label,
    read_series,
    series_folders,
)
from segnode.engines.manifest import ManifestError
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.ort_backend import OrtEngine
from segnode.engines.trt_build import BuildSettings, build_engine, load_flavour
from segnode.node.pipeline.engine_pool import EnginePool
from segnode.node.results.build import Equipment, ResultUIDs, build_seg, build_sr
from tests.fixtures.phantom_model import MANIFEST
from tests.test_results import small_volume, truth

REPO = Path(__file__).resolve().parent.parent
PHANTOM_MODEL = REPO / "tests" / "data" / "nnunet_phantom"


def model_copy(folder: Path) -> Path:
    """The trained phantom model (fold 0, no mirroring: a quick guard) in ``folder``."""
    shutil.copytree(PHANTOM_MODEL, folder)
    path = folder / "phantom.json"
    doc = json.loads(path.read_text())
    doc["folds"] = ["fold_0.onnx"]
    doc["mirror_axes"] = []
    path.write_text(json.dumps(doc, indent=2))
    return path


@pytest.fixture(scope="module")
def series(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three CT series of the phantom (varied anatomy), as DICOM folders."""
    root = tmp_path_factory.mktemp("calibration-series")
    rng = np.random.default_rng(5)
    out = []
    for i in range(3):
        case = OracleCase(f"series{i}", Grid.covering(FOV, 1.5, 3.0), Anatomy.random(rng))
        write_dicom_case(case, root / case.name, 30 + i)
        out.append(root / case.name)
    return out


def snapshot(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "segnode.node.ops.cli", "model", "calibrate", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )


# ------------------------------------------------------------------------------ INT8


def test_int8_calibration_writes_a_guarded_model(tmp_path: Path, series: list[Path]) -> None:
    path = model_copy(tmp_path / "model")
    report = calibrate(path, series, tiles_per_series=4)

    assert report.precision == "int8"
    assert report.held_out == ["series2"]
    assert report.calibration_series == ["series0", "series1"]
    assert report.tiles == 8
    kept = dict(report.kept_float)
    assert any("first convolution" in why for why in kept.values())
    assert any("last convolution" in why for why in kept.values())
    assert set(report.dice) == {"body", "lung", "bone"}
    assert report.dice_min >= 0.99

    doc = json.loads(path.read_text())
    assert doc["precision"] == "int8"
    section = doc["calibration"]
    calibration = path.parent / section["file"]
    assert section["sha256"] == hashlib.sha256(calibration.read_bytes()).hexdigest()
    ranges = json.loads(calibration.read_text())
    assert ranges["format"] == "segnode-calibration/1"
    assert list(ranges["folds"]) == ["fold_0.onnx"]
    assert section["int8_folds"] == ["fold_0.int8.onnx"]
    assert section["guard"]["dice_min"] == report.dice_min >= section["guard"]["threshold"]
    assert [k["node"] for k in section["kept_float"]] == list(kept)

    manifest = load_manifest(path)
    assert manifest.precision == "int8"
    assert manifest.int8_fold_paths == ((path.parent / "fold_0.int8.onnx").resolve(),)
    assert manifest.fold_paths == ((path.parent / "fold_0.onnx").resolve(),)

    qdq = onnx.load(str(manifest.int8_fold_paths[0]))
    ops = {n.op_type for n in qdq.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    # the layers kept in float read no dequantized weight
    weights_dq = {n.output[0] for n in qdq.graph.node if n.op_type == "DequantizeLinear"}
    for node in qdq.graph.node:
        if node.name in kept:
            assert node.input[1] not in weights_dq, node.name

    with OrtEngine(threads=1) as engine:
        engine.load(manifest)
        assert run_precision(engine, manifest) == "int8"
        # the node's pool hands the worker the manifest with what ran, for the SEG and SR
        pool = EnginePool([], tmp_path, {"default": (engine, replace(manifest, precision="x"))})
        assert pool.default_manifest.precision == "int8"
    with OrtEngine(threads=1) as engine:
        engine.load(replace(manifest, precision="fp32"))
        assert run_precision(engine, manifest) == "fp32"

    # TensorRT's form: the same ranges, symmetric INT8 activations (zero point 0), guarded
    assert section["int8_tensorrt_folds"] == ["fold_0.int8.tensorrt.onnx"]
    assert section["guard"]["tensorrt_form_dice_min"] >= 0.99
    (trt_unit,) = manifest.model_files(int8="tensorrt")
    assert trt_unit.onnx_path.name == "fold_0.int8.tensorrt.onnx"
    sym = onnx.load(str(trt_unit.onnx_path))
    zero_points = [
        numpy_helper.to_array(i) for i in sym.graph.initializer if i.name.endswith("_zero_point")
    ]
    assert zero_points and all(z.dtype == np.int8 for z in zero_points)
    assert not any(z.any() for z in zero_points)
    try:
        load_flavour("tensorrt_rtx")
    except EngineError as exc:
        pytest.skip(f"TensorRT-RTX not installed, the QDQ build not tried: {exc}")
    built = build_engine(trt_unit, BuildSettings("fp32", "tensorrt_rtx"), cache_dir=tmp_path / "e")
    assert built.path.is_file() and built.size_bytes > 0


def test_guard_failure_writes_nothing_and_exits_1(tmp_path: Path, series: list[Path]) -> None:
    path = model_copy(tmp_path / "model")
    before = snapshot(path.parent)
    # A threshold above 1 cannot be met: the guard must refuse whatever it measures.
    done = run_cli(
        str(path),
        "--series",
        *map(str, series),
        "--threshold",
        "1.01",
        "--max-rounds",
        "1",
        "--tiles-per-series",
        "2",
        "--threads",
        "1",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "fails the accuracy guard" in done.stderr
    assert "nothing was written" in done.stderr
    assert "Dice per label against FP32" in done.stdout
    assert "bone" in done.stderr
    assert snapshot(path.parent) == before
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".calibrate-")]


def test_no_calibration_data_is_a_clear_error(tmp_path: Path) -> None:
    path = model_copy(tmp_path / "model")
    before = snapshot(path.parent)
    done = run_cli(str(path))
    assert done.returncode == 1
    assert "has no calibration data" in done.stderr
    assert "--series" in done.stderr and "--spool" in done.stderr
    assert snapshot(path.parent) == before
    (tmp_path / "empty-data" / "spool").mkdir(parents=True)
    with pytest.raises(CalibrationError, match="no calibration data"):
        calibrate(path, spool=tmp_path / "empty-data")


def test_a_version_1_model_is_refused(tmp_path: Path, series: list[Path]) -> None:
    with pytest.raises(CalibrationError, match="version-1"):
        calibrate(REPO / "engines" / "models" / "tissue" / "tissue.json", series)


def test_spool_series_are_found(tmp_path: Path) -> None:
    spool = tmp_path / "data" / "spool"
    for study, serie in (("1.2.3", "1.2.3.4"), ("1.2.3", "1.2.3.5"), ("1.9", "1.9.1")):
        (spool / study / serie).mkdir(parents=True)
        (spool / study / serie / "1.dcm").write_bytes(b"x")
    (spool / "incoming").mkdir()
    (spool / "1.9" / "empty").mkdir()
    found = series_folders([], tmp_path / "data")
    assert [p.name for p in found] == ["1.2.3.4", "1.2.3.5", "1.9.1"]
    assert series_folders([], spool) == found
    study = tmp_path / "export"
    (study / "a").mkdir(parents=True)
    (study / "a" / "x.dcm").write_bytes(b"x")
    assert series_folders([study, study / "a"]) == [study / "a"]


def test_dice_per_label_scores_what_is_present() -> None:
    manifest = load_manifest(PHANTOM_MODEL / "phantom.json")
    a = np.zeros((4, 4, 4), np.uint8)
    b = np.zeros_like(a)
    a[:2] = 1
    b[:1] = 1
    b[3, 3, 3] = 2
    assert dice_per_label([a], [b], manifest) == {"body": round(2 * 16 / 48, 5), "lung": 0.0}
    assert dice_per_label([a, a], [a, b], manifest)["body"] == round(2 * 16 / 48, 5)


def test_manifest_int8_needs_its_files(tmp_path: Path) -> None:
    path = model_copy(tmp_path / "model")
    doc = json.loads(path.read_text())
    doc["precision"] = "int8"
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="int8_folds"):
        load_manifest(path)
    doc["calibration"] = {"int8_folds": ["fold_0.int8.onnx"]}
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="calibrate again"):
        load_manifest(path)
    doc["precision"] = "fp8"
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="precision"):
        load_manifest(path)


# ------------------------------------------------------------------------------ BF16


def test_bf16_guard_records_the_precision(tmp_path: Path, series: list[Path]) -> None:
    ov = pytest.importorskip("openvino")
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU has no BF16 instructions: OpenVINO runs FP32")
    path = model_copy(tmp_path / "model")
    report = calibrate(path, series, precision="bf16")
    assert report.dice_min >= 0.99
    doc = json.loads(path.read_text())
    assert doc["precision"] == "bf16"
    assert doc["calibration"]["runtime"] == "openvino"
    assert "file" not in doc["calibration"]
    assert load_manifest(path).precision == "bf16"


def _need_bf16() -> None:
    ov = pytest.importorskip("openvino")
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU has no BF16 instructions: OpenVINO runs FP32")


def test_bf16_first_convolutions_in_fp32_are_written_and_loaded(
    tmp_path: Path, series: list[Path]
) -> None:
    _need_bf16()
    from segnode.engines.openvino_backend import OpenVinoEngine

    path = model_copy(tmp_path / "model")
    report = calibrate(path, series, precision="bf16", fp32_leading=3, threads=1)
    assert [r["kept_by_measurement"] for r in report.rounds] == [3]
    doc = json.loads(path.read_text())
    assert doc["calibration"]["fp32_leading_convolutions"] == 3
    assert any("first 3 convolution" in line for line in report.lines())
    manifest = load_manifest(path)
    with OpenVinoEngine(threads=1) as engine:
        engine.load(manifest)
        assert engine.fp32_leading_used == 3
    with OpenVinoEngine(threads=1, fp32_leading=0) as engine:  # the option wins
        engine.load(manifest)
        assert engine.fp32_leading_used == 0
    with pytest.raises(CalibrationError, match="bf16 only"):
        calibrate(path, series, precision="int8", fp32_leading=3)


def test_bf16_guard_failure_tries_fp32_first_convolutions_then_writes_nothing(
    tmp_path: Path, series: list[Path]
) -> None:
    _need_bf16()
    path = model_copy(tmp_path / "model")
    before = snapshot(path.parent)
    with pytest.raises(GuardFailed) as failed:
        calibrate(path, series, precision="bf16", threshold=1.01, threads=1)
    rounds = failed.value.report.rounds
    assert [r["kept_by_measurement"] for r in rounds] == [1, 3, 6]
    assert all(0.9 < r["dice_min"] <= 1.0 for r in rounds)
    assert snapshot(path.parent) == before


# ------------------------------------------------------------------------------ SEG and SR


def test_seg_and_sr_say_which_precision_ran() -> None:
    volume = small_volume()
    labels = truth(volume)
    uids = ResultUIDs.new()
    manifest = replace(MANIFEST, precision="int8")
    seg = build_seg(volume, labels, manifest, uids, equipment=Equipment.for_seg("0.1.0"))
    for item in seg.SegmentSequence:
        algorithm = item.SegmentationAlgorithmIdentificationSequence[0]
        assert algorithm.AlgorithmParameters == "precision=int8"
    sr = build_sr(volume, labels, manifest, seg, uids, equipment=Equipment.for_sr("0.1.0"))

    def texts(items: Any) -> list[str]:
        out = []
        for item in items:
            if getattr(item, "ValueType", "") == "TEXT":
                out.append(str(item.TextValue))
            out += texts(getattr(item, "ContentSequence", []))
        return out

    found = texts(sr.ContentSequence)
    assert found.count("precision=int8") == len(np.unique(labels)) - 1, found
    plain = build_seg(volume, labels, MANIFEST, uids, equipment=Equipment.for_seg("0.1.0"))
    assert (
        plain.SegmentSequence[0].SegmentationAlgorithmIdentificationSequence[0].AlgorithmParameters
        == "precision=fp32"
    )


def test_series_are_checked_and_capped(tmp_path: Path, series: list[Path]) -> None:
    not_ct = tmp_path / "not-ct"
    not_ct.mkdir()
    (not_ct / "a.dcm").write_bytes(b"not DICOM")
    notes: list[str] = []
    found = read_series([*series, not_ct], notes, limit=10)
    assert [s.name for s in found] == ["series0", "series1", "series2"]
    assert any("skipped" in n and "not-ct" in n for n in notes)
    notes = []
    capped = read_series(series, notes, limit=2)
    assert [s.name for s in capped] == ["series0", "series2"]
    assert notes == ["3 series found: using 2, spread evenly"]
    hu, geometry = capped[0].read()
    assert hu.ndim == 3 and hu.dtype == np.float32
