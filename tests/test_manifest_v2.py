"""Manifest version 2 (the model contract): loading, defaults, version-1 compatibility and
one clear error per invalid field."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from segnode.engines.base import EngineError
from segnode.engines.manifest import ManifestError, ModelContract
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.models import default_manifest_path
from segnode.engines.preprocess import CTNormalization, LinearNormalization

VALID: dict[str, Any] = {
    "manifest_version": 2,
    "name": "abdomen",
    "version": "2.0.0",
    "folds": ["fold_0.onnx", "fold_1.onnx"],
    "input_name": "input",
    "output_name": "logits",
    "output_kind": "logits",
    "patch_size": [96, 160, 160],
    "overlap": 0.2,
    "sigma_scale": 0.125,
    "mirror_axes": [0, 1, 2],
    "batch": {"min": 1, "opt": 2, "max": 4},
    "fp16": True,
    "geometry": {
        "spacing": [1.5, 1.5, 1.5],
        "orientation": "sar",
        "transpose_forward": [2, 0, 1],
        "transpose_backward": [1, 2, 0],
        "gantry_tilt_allowed": False,
    },
    "preprocessing": {
        "crop_to_nonzero": True,
        "normalization": "ct",
        "intensity": {
            "mean": 100.5,
            "std": 210.0,
            "percentile_00_5": -985.0,
            "percentile_99_5": 1410.0,
        },
    },
    "resampling": {
        "data_order": 3,
        "logits_order": 1,
        "order_z": 0,
        "anisotropy_threshold": 3.0,
        "force_separate_z": None,
    },
    "labels": [
        {
            "value": 1,
            "name": "Liver",
            "category": ["123037004", "SCT", "Anatomical Structure"],
            "type": ["10200004", "SCT", "Liver"],
            "color": [221, 130, 101],
        },
        {
            "value": 2,
            "name": "Spleen",
            "category": ["123037004", "SCT", "Anatomical Structure"],
            "type": ["78961009", "SCT", "Spleen"],
        },
    ],
    "trained_by": "nnU-Net v2",  # unknown keys are kept in extra
}


def _write(tmp_path: Path, raw: dict[str, Any]) -> Path:
    for name in ("fold_0.onnx", "fold_1.onnx"):
        (tmp_path / name).write_bytes(b"onnx")
    path = tmp_path / "abdomen.json"
    path.write_text(json.dumps(raw))
    return path


def test_v2_loads(tmp_path: Path) -> None:
    m = load_manifest(_write(tmp_path, VALID))
    assert m.manifest_version == 2
    assert m.fold_paths == (
        (tmp_path / "fold_0.onnx").resolve(),
        (tmp_path / "fold_1.onnx").resolve(),
    )
    assert m.onnx_path == m.fold_paths[0]
    assert m.overlap == 0.2 and m.fp16 and m.batch_max == 4
    assert m.num_classes == m.output_channels == 3
    assert m.extra == {"trained_by": "nnU-Net v2"}
    c = m.model_contract()
    assert c is m.contract
    assert c.spacing == (1.5, 1.5, 1.5)
    assert c.orientation == "SAR"
    assert c.transpose_forward == (2, 0, 1) and c.transpose_backward == (1, 2, 0)
    assert c.crop_to_nonzero and not c.gantry_tilt_allowed
    assert c.normalization == CTNormalization(mean=100.5, std=210.0, lower=-985.0, upper=1410.0)
    assert (c.data_order, c.logits_order, c.order_z) == (3, 1, 0)
    assert c.anisotropy_threshold == 3.0 and c.force_separate_z is None
    assert c.sigma_scale == 0.125 and c.mirror_axes == (0, 1, 2)
    assert c.regions is None and c.regions_class_order is None
    assert m.label(1).color == (221, 130, 101)


def test_v2_defaults(tmp_path: Path) -> None:
    raw = copy.deepcopy(VALID)
    del raw["resampling"], raw["mirror_axes"], raw["sigma_scale"]
    raw["geometry"] = {"spacing": [0.8, 0.8, 5]}
    raw["preprocessing"] = {"normalization": "linear", "clip": [-1024, 3071], "scale": 0.001}
    c = load_manifest(_write(tmp_path, raw)).model_contract()
    assert c == ModelContract(
        spacing=(0.8, 0.8, 5.0),
        normalization=LinearNormalization(clip=(-1024.0, 3071.0), scale=0.001),
    )
    assert c.orientation == "source" and c.mirror_axes == () and c.data_order == 3


def test_v2_regions(tmp_path: Path) -> None:
    raw = copy.deepcopy(VALID)
    raw["regions"] = [[1, 2], [2]]
    raw["regions_class_order"] = [1, 2]
    m = load_manifest(_write(tmp_path, raw))
    assert m.contract is not None and m.contract.regions == ((1, 2), (2,))
    assert m.output_channels == 2


def test_v1_unchanged() -> None:
    """The bundled version-1 model loads as before and implies a source-grid contract."""
    m = load_manifest(default_manifest_path())
    assert m.manifest_version == 1 and m.contract is None and m.fold_paths == ()
    assert m.onnx_path.name == "tissue.onnx" and m.output_kind == "labels"
    assert m.clip == (-1024.0, 3071.0)
    c = m.model_contract()
    assert c.spacing is None and c.orientation == "source" and not c.crop_to_nonzero
    assert c.normalization == LinearNormalization(clip=(-1024.0, 3071.0), scale=1.0, offset=0.0)


def test_v1_explicit_version(tmp_path: Path) -> None:
    raw = json.loads(default_manifest_path().read_text())
    raw["manifest_version"] = 1
    raw["onnx"] = str(default_manifest_path().with_suffix(".onnx"))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(raw))
    m = load_manifest(path)
    assert m.manifest_version == 1 and "manifest_version" not in m.extra
    assert m == load_manifest(default_manifest_path())


Mutation = Callable[[dict[str, Any]], Any]

ERRORS: list[tuple[str, Mutation, str]] = [
    ("version", lambda r: r.update(manifest_version=3), "manifest_version: unsupported 3"),
    ("version bool", lambda r: r.update(manifest_version=True), "manifest_version"),
    ("onnx", lambda r: r.update(onnx="x.onnx"), "onnx: version 2 lists the model files"),
    ("folds missing", lambda r: r.pop("folds"), "folds: a non-empty list"),
    ("folds empty", lambda r: r.update(folds=[]), "folds: a non-empty list"),
    ("fold file", lambda r: r.update(folds=["fold_0.onnx", "fold_9.onnx"]), r"folds\[1\]: no such"),
    ("fold twice", lambda r: r.update(folds=["fold_0.onnx", "fold_0.onnx"]), "listed twice"),
    ("geometry", lambda r: r.pop("geometry"), "geometry: required object"),
    ("spacing", lambda r: r["geometry"].update(spacing=[1, 1]), "geometry.spacing: three"),
    (
        "spacing zero",
        lambda r: r["geometry"].update(spacing=[1, 0, 1]),
        r"geometry.spacing\[1\]: must be a positive number",
    ),
    (
        "spacing text",
        lambda r: r["geometry"].update(spacing=[1, "1", 1]),
        r"geometry.spacing\[1\]",
    ),
    ("orientation", lambda r: r["geometry"].update(orientation="RAX"), "geometry.orientation"),
    (
        "orientation axes",
        lambda r: r["geometry"].update(orientation="RLS"),
        "geometry.orientation.*each of L/R",
    ),
    (
        "transpose",
        lambda r: r["geometry"].update(transpose_forward=[0, 0, 1]),
        "geometry.transpose_forward: must be a permutation",
    ),
    (
        "transpose inverse",
        lambda r: r["geometry"].update(transpose_backward=[2, 0, 1]),
        "geometry.transpose_backward: .* does not undo",
    ),
    (
        "tilt",
        lambda r: r["geometry"].update(gantry_tilt_allowed="no"),
        "geometry.gantry_tilt_allowed",
    ),
    ("preprocessing", lambda r: r.pop("preprocessing"), "preprocessing: required object"),
    (
        "normalization",
        lambda r: r["preprocessing"].update(normalization="zscore"),
        "preprocessing.normalization: 'ct' or 'linear'",
    ),
    (
        "intensity",
        lambda r: r["preprocessing"].pop("intensity"),
        "preprocessing.intensity: required for 'ct'",
    ),
    (
        "intensity field",
        lambda r: r["preprocessing"]["intensity"].pop("percentile_99_5"),
        "preprocessing.intensity.percentile_99_5: must be a finite number",
    ),
    (
        "intensity std",
        lambda r: r["preprocessing"]["intensity"].update(std=-1),
        "preprocessing.intensity.std: must not be negative",
    ),
    (
        "percentiles",
        lambda r: r["preprocessing"]["intensity"].update(percentile_00_5=2000),
        "percentile_00_5 exceeds percentile_99_5",
    ),
    (
        "crop",
        lambda r: r["preprocessing"].update(crop_to_nonzero=1),
        "preprocessing.crop_to_nonzero",
    ),
    (
        "linear clip",
        lambda r: r.update(preprocessing={"normalization": "linear", "clip": [5, 1]}),
        "preprocessing.clip: low 5.0 exceeds high 1.0",
    ),
    (
        "linear scale",
        lambda r: r.update(preprocessing={"normalization": "linear", "scale": "x"}),
        "preprocessing.scale: must be a finite number",
    ),
    ("resampling", lambda r: r.update(resampling=[]), "resampling: must be an object"),
    (
        "data order",
        lambda r: r["resampling"].update(data_order=2),
        r"resampling.data_order: must be one of \[0, 1, 3\], got 2",
    ),
    (
        "logits order",
        lambda r: r["resampling"].update(logits_order=True),
        "resampling.logits_order",
    ),
    ("order z", lambda r: r["resampling"].update(order_z=3), "resampling.order_z"),
    (
        "threshold",
        lambda r: r["resampling"].update(anisotropy_threshold=0),
        "resampling.anisotropy_threshold: must be a positive number",
    ),
    (
        "force",
        lambda r: r["resampling"].update(force_separate_z="auto"),
        "resampling.force_separate_z",
    ),
    ("sigma", lambda r: r.update(sigma_scale=0), "sigma_scale: must be a positive number"),
    ("mirror", lambda r: r.update(mirror_axes=[0, 3]), "mirror_axes: distinct axes"),
    ("mirror twice", lambda r: r.update(mirror_axes=[1, 1]), "mirror_axes"),
    ("regions alone", lambda r: r.update(regions=[[1]]), "regions and regions_class_order"),
    (
        "region label",
        lambda r: r.update(regions=[[1, 5]], regions_class_order=[1]),
        r"regions\[0\]: a non-empty list of label values 1..2",
    ),
    (
        "region order",
        lambda r: r.update(regions=[[1], [2]], regions_class_order=[1]),
        "regions_class_order: one label value",
    ),
    (
        "region labels output",
        lambda r: r.update(regions=[[1]], regions_class_order=[1], output_kind="labels"),
        "output_kind: a region-based model",
    ),
    ("label values", lambda r: r["labels"][1].update(value=3), "label values must be 1..N"),
    ("patch", lambda r: r.update(patch_size=[1, 2]), "patch_size"),
    ("name", lambda r: r.pop("name"), "invalid manifest"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_v2_validation_errors(tmp_path: Path, case: str, mutate: Mutation, message: str) -> None:
    raw = copy.deepcopy(VALID)
    mutate(raw)
    path = _write(tmp_path, raw)
    with pytest.raises(ManifestError, match=message) as info:
        load_manifest(path)
    assert str(path) in str(info.value)  # names the file
    assert isinstance(info.value, EngineError)  # callers catching EngineError still do


def test_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text("[1, 2]")
    with pytest.raises(ManifestError, match="a manifest is a JSON object"):
        load_manifest(path)


def test_node_and_engine_build_refuse_a_v2_model_whose_network_returns_labels(
    tmp_path: Path,
) -> None:
    """Version 2 runs (segnode.engines.trained), but nnU-Net's window blends scores: a version-2
    model with ``"output_kind": "labels"`` is refused by the node at start and by ``segnode
    engine build``, each saying why (exit status 1, no traceback)."""
    import subprocess
    import sys

    from scripts.harness import write_config
    from segnode.engines.manifest import check_runnable
    from tests.conftest import ROOT, free_port

    check_runnable(load_manifest(default_manifest_path()))  # version 1 runs
    check_runnable(load_manifest(_write(tmp_path, VALID)))  # and version 2
    manifest = _write(tmp_path, {**VALID, "output_kind": "labels"})
    with pytest.raises(ManifestError, match="output_kind 'labels' cannot run as a version-2"):
        check_runnable(load_manifest(manifest))
    config = write_config(
        tmp_path / "config.toml", tmp_path / "data", free_port(), model={"manifest": str(manifest)}
    )
    for command in (["serve"], ["engine", "build"]):
        done = subprocess.run(
            [sys.executable, "-m", "segnode.node.ops.cli", *command, "--config", str(config)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert done.returncode == 1, (command, done.stderr)
        assert "output_kind 'labels' cannot run" in done.stderr and "Traceback" not in done.stderr
