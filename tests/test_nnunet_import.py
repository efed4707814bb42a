"""``segnode model import nnunet|totalsegmentator``: nnU-Net v2 model folders to ONNX + manifest.

The model folders are real nnU-Net v2 folders made here: a plans.json for a tiny 3-D
PlainConvUNet (3 stages, 4-8-16 features, patch 32^3, the structure of nnU-Net's own
plans), dataset.json, dataset_fingerprint.json, and checkpoints in nnUNetTrainer's
``save_checkpoint`` format holding seeded random weights of the network that nnU-Net's
``get_network_from_plans`` builds. The plans/labels/CSV parts run without torch; the export
tests need torch and nnunetv2 (``pip install -e .[nnunet]``).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from segnode.engines.importers import ModelImportError
from segnode.engines.importers.labels import (
    GENERIC_TYPE,
    label_entries,
    load_label_csv,
    palette,
    read_label_csv,
)
from segnode.engines.importers.nnunet_plans import (
    default_orientation,
    manifest_dict,
    merge_label_spaces,
    output_layout,
    read_model_folder,
    resolve_configuration,
)
from segnode.engines.manifest_parse import load_manifest
from tests.fixtures.nnunet import plans_json as nnunet_plans_json

REPO = Path(__file__).resolve().parent.parent
INTENSITY = {
    "max": 3071.0,
    "mean": 42.5,
    "median": 40.0,
    "min": -1024.0,
    "percentile_00_5": -980.0,
    "percentile_99_5": 1450.0,
    "std": 180.25,
}
CSV_HEADER = (
    "Structure,SegmentedPropertyCategoryCodeSequence.CodingSchemeDesignator,"
    "SegmentedPropertyCategoryCodeSequence.CodeValue,"
    "SegmentedPropertyCategoryCodeSequence.CodeMeaning,"
    "SegmentedPropertyTypeCodeSequence.CodingSchemeDesignator,"
    "SegmentedPropertyTypeCodeSequence.CodeValue,SegmentedPropertyTypeCodeSequence.CodeMeaning,"
    "SegmentedPropertyTypeModifierCodeSequence.CodingSchemeDesignator,"
    "SegmentedPropertyTypeModifierCodeSequence.CodeValue,"
    "SegmentedPropertyTypeModifierCodeSequence.CodeMeaning,"
    "AnatomicRegionSequence.CodingSchemeDesignator,AnatomicRegionSequence.CodeValue,"
    "AnatomicRegionSequence.CodeMeaning,AnatomicRegionModifierSequence.CodingSchemeDesignator,"
    "AnatomicRegionModifierSequence.CodeValue,AnatomicRegionModifierSequence.CodeMeaning,"
    "DicomRGBColor\n"
)
CSV_ROWS = {
    "liver": 'liver,SCT,123037004,Anatomical Structure,SCT,10200004,Liver,,,,,,,,,,"40,140,40"',
    "kidney_left": "kidney_left,SCT,123037004,Anatomical Structure,SCT,64033007,Kidney,"
    'SCT,7771000,Left,,,,,,,"46,138,184"',
    "spleen": "spleen,SCT,123037004,Anatomical Structure,SCT,78961009,Spleen,,,,,,,,,,",
    "aorta": 'aorta,SCT,123037004,Anatomical Structure,SCT,15825003,Aorta,,,,,,,,,,"216,108,54"',
}


def plans_json(
    features: tuple[int, ...] = (4, 8, 16),
    spacing: tuple[float, ...] = (2.5, 0.8, 0.8),
    transpose: tuple[int, int, int] = (0, 1, 2),
    patch: tuple[int, int, int] = (32, 32, 32),
    normalization: str = "CTNormalization",
) -> dict[str, Any]:
    """A plans.json as nnU-Net's ExperimentPlanner writes it, for a tiny PlainConvUNet."""
    n = len(features)
    architecture = {
        "network_class_name": "dynamic_network_architectures.architectures.unet.PlainConvUNet",
        "arch_kwargs": {
            "n_stages": n,
            "features_per_stage": list(features),
            "conv_op": "torch.nn.modules.conv.Conv3d",
            "kernel_sizes": [[3, 3, 3]] * n,
            "strides": [[1, 1, 1]] + [[2, 2, 2]] * (n - 1),
            "n_conv_per_stage": [2] * n,
            "n_conv_per_stage_decoder": [2] * (n - 1),
            "conv_bias": True,
            "norm_op": "torch.nn.modules.instancenorm.InstanceNorm3d",
            "norm_op_kwargs": {"eps": 1e-05, "affine": True},
            "dropout_op": None,
            "dropout_op_kwargs": None,
            "nonlin": "torch.nn.LeakyReLU",
            "nonlin_kwargs": {"inplace": True},
        },
        "_kw_requires_import": ["conv_op", "norm_op", "dropout_op", "nonlin"],
    }
    return nnunet_plans_json(
        dataset_name="Dataset901_Tiny",
        spacing=spacing,
        shape=(40, 64, 64),
        transpose=transpose,
        patch=patch,
        architecture=architecture,
        batch_dice=False,
        intensity=INTENSITY,
        normalization=normalization,
        more_configurations={"3d_fullres_bs4": {"inherits_from": "3d_fullres", "batch_size": 4}},
    )


def dataset_json(labels: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "channel_names": {"0": "CT"},
        "labels": labels or {"background": 0, "liver": 1, "kidney_left": 2, "spleen": 3},
        "numTraining": 4,
        "file_ending": ".nii.gz",
        **extra,
    }


def fingerprint_json() -> dict[str, Any]:
    return {
        "foreground_intensity_properties_per_channel": {"0": dict(INTENSITY)},
        "median_relative_size_after_cropping": 1.0,
        "shapes_after_crop": [[40, 64, 64]],
        "spacings": [[2.5, 0.8, 0.8]],
    }


def write_folder(
    root: Path,
    plans: dict[str, Any],
    dataset: dict[str, Any],
    folds: tuple[int, ...] = (),
    name: str = "Dataset901_Tiny",
    trainer: str = "nnUNetTrainer",
) -> Path:
    """An nnU-Net v2 trained-model folder; checkpoints are added by :func:`save_checkpoint`."""
    folder = root / name / f"{trainer}__nnUNetPlans__3d_fullres"
    folder.mkdir(parents=True)
    (folder / "plans.json").write_text(json.dumps(plans, indent=1))
    (folder / "dataset.json").write_text(json.dumps(dataset, indent=1))
    (folder / "dataset_fingerprint.json").write_text(json.dumps(fingerprint_json()))
    for fold in folds:
        (folder / f"fold_{fold}").mkdir()
        (folder / f"fold_{fold}" / "checkpoint_final.pth").write_bytes(b"not read here")
    return folder


# ------------------------------------------------------------------ without torch: plans


def test_manifest_from_plans_carries_spacing_transpose_normalisation_and_labels(tmp_path):
    plans = plans_json(spacing=(0.8, 0.8, 2.5), transpose=(2, 0, 1))
    dataset = dataset_json()
    layout = output_layout(dataset)
    assert layout.names == ((1, "liver"), (2, "kidney_left"), (3, "spleen"))
    assert layout.channels == 4 and layout.regions is None
    labels, generic = label_entries(layout.names, None, allow_generic=False)
    assert generic == ["liver", "kidney_left", "spleen"]
    m = manifest_dict(
        plans,
        dataset,
        "3d_fullres",
        name="tiny",
        version="2.0.0",
        folds=["fold_0.onnx"],
        labels=labels,
        mirror_axes=(0, 1, 2),
        orientation="SPL",
    )
    assert m["geometry"] == {
        "spacing": [0.8, 0.8, 2.5],
        "orientation": "SPL",
        "transpose_forward": [2, 0, 1],
        "transpose_backward": [1, 2, 0],
        "gantry_tilt_allowed": False,
    }
    assert m["patch_size"] == [32, 32, 32] and m["overlap"] == 0.5
    assert m["sigma_scale"] == 0.125 and m["mirror_axes"] == [0, 1, 2]
    assert m["preprocessing"] == {
        "crop_to_nonzero": True,
        "normalization": "ct",
        "intensity": {
            k: INTENSITY[k] for k in ("mean", "std", "percentile_00_5", "percentile_99_5")
        },
    }
    assert m["resampling"] == {
        "data_order": 3,
        "logits_order": 1,
        "order_z": 0,
        "anisotropy_threshold": 3.0,
        "force_separate_z": None,
    }
    assert [e["name"] for e in m["labels"]] == ["liver", "kidney_left", "spleen"]
    assert m["labels"][0]["type"] == list(GENERIC_TYPE)

    # the node's own loader reads it (the fold file only has to exist for the loader)
    (tmp_path / "fold_0.onnx").write_bytes(b"")
    (tmp_path / "tiny.json").write_text(json.dumps(m))
    loaded = load_manifest(tmp_path / "tiny.json")
    c = loaded.model_contract()
    assert c.spacing == (0.8, 0.8, 2.5) and c.transpose_forward == (2, 0, 1)
    assert c.transpose_backward == (1, 2, 0) and c.mirror_axes == (0, 1, 2)
    assert loaded.num_classes == 4 and loaded.labels[1].name == "kidney_left"


def test_regions_and_inherited_configuration():
    plans = plans_json()
    assert resolve_configuration(plans, "3d_fullres_bs4")["batch_size"] == 4
    assert resolve_configuration(plans, "3d_fullres_bs4")["patch_size"] == [32, 32, 32]
    dataset = dataset_json(
        {"background": 0, "whole": [1, 2, 3], "core": [2, 3], "enhancing": 3},
        regions_class_order=[1, 2, 3],
    )
    layout = output_layout(dataset)
    assert layout.regions == ((1, 2, 3), (2, 3), (3,)) and layout.channels == 3
    assert layout.names == ((1, "whole"), (2, "core"), (3, "enhancing"))
    labels, _ = label_entries(layout.names, None, allow_generic=True)
    m = manifest_dict(
        plans,
        dataset,
        "3d_fullres_bs4",
        name="r",
        version="1",
        folds=["f.onnx"],
        labels=labels,
        mirror_axes=None,
        orientation="SAR",
    )
    assert m["regions"] == [[1, 2, 3], [2, 3], [3]] and m["regions_class_order"] == [1, 2, 3]
    assert m["mirror_axes"] == []
    with pytest.raises(ModelImportError, match="regions_class_order"):
        output_layout(dataset_json({"background": 0, "a": [1, 2], "b": 2}))


def test_plans_the_contract_cannot_express_are_refused():
    dataset = dataset_json()
    kwargs: dict[str, Any] = dict(
        name="x", version="1", folds=["f"], labels=[], mirror_axes=None, orientation="SPL"
    )
    with pytest.raises(ModelImportError, match="ZScoreNormalization"):
        manifest_dict(
            plans_json(normalization="ZScoreNormalization"), dataset, "3d_fullres", **kwargs
        )
    plans = plans_json()
    plans["configurations"]["3d_fullres"]["resampling_fn_data_kwargs"]["order_z"] = 1
    with pytest.raises(ModelImportError, match="order_z differs"):
        manifest_dict(plans, dataset, "3d_fullres", **kwargs)
    two = dataset_json(channel_names={"0": "CT", "1": "PET"})
    with pytest.raises(ModelImportError, match="one channel"):
        manifest_dict(plans_json(), two, "3d_fullres", **kwargs)
    with pytest.raises(ModelImportError, match=r"1\.\.N"):
        output_layout(dataset_json({"background": 0, "a": 1, "b": 3}))
    no_norm = manifest_dict(
        plans_json(normalization="NoNormalization"), dataset, "3d_fullres", **kwargs
    )
    assert no_norm["preprocessing"]["normalization"] == "linear"


def test_orientation_default_follows_the_reader():
    assert default_orientation(plans_json(), dataset_json()) == "SPL"
    reorienting = dataset_json(overwrite_image_reader_writer="NibabelIOWithReorient")
    assert default_orientation(plans_json(), reorienting) == "SAR"
    plans = plans_json()
    plans["image_reader_writer"] = "SimpleITKIOWithReorient"
    assert default_orientation(plans, dataset_json()) == "SAR"


def test_incomplete_folder_names_what_is_missing(tmp_path):
    folder = write_folder(tmp_path, plans_json(), dataset_json(), folds=(0, 1))
    with pytest.raises(ModelImportError) as err:
        read_model_folder(folder, [0, 1, 2, 3])
    assert "missing fold_2/checkpoint_final.pth, fold_3/checkpoint_final.pth" in str(err.value)
    assert "present: fold_0/checkpoint_final.pth, fold_1/checkpoint_final.pth" in str(err.value)
    with pytest.raises(ModelImportError, match="checkpoint_best.pth"):
        read_model_folder(folder, [0], checkpoint="best")
    (folder / "plans.json").unlink()
    with pytest.raises(ModelImportError, match="plans.json is missing"):
        read_model_folder(folder, [0])
    with pytest.raises(ModelImportError, match="no such model folder"):
        read_model_folder(tmp_path / "nowhere", [0])
    ok = read_model_folder(write_folder(tmp_path / "b", plans_json(), dataset_json(), (0,)), [0])
    assert ok.configuration == "3d_fullres" and ok.checkpoints[0][0] == 0


# ----------------------------------------------------------------- without torch: labels


def test_label_csv_in_totalsegmentators_format(tmp_path):
    codes = read_label_csv(CSV_HEADER + "\n".join(CSV_ROWS.values()) + "\n")
    assert codes["liver"].type == ("10200004", "SCT", "Liver")
    assert codes["liver"].category == ("123037004", "SCT", "Anatomical Structure")
    assert codes["kidney_left"].modifier == ("7771000", "SCT", "Left")
    assert codes["kidney_left"].color == (46, 138, 184) and codes["spleen"].color is None
    entries, generic = label_entries(
        [(1, "liver"), (2, "kidney_left"), (3, "spleen")], codes, allow_generic=False
    )
    assert generic == []
    assert entries[1]["modifier"] == ["7771000", "SCT", "Left"]
    assert entries[1]["color"] == [46, 138, 184] and entries[2]["color"] == list(palette(3))
    assert "modifier" not in entries[0]
    # a label the CSV does not name: an error, unless generic codes are allowed
    with pytest.raises(ModelImportError, match="does not name 1 of the model's labels: pancreas"):
        label_entries([(1, "liver"), (2, "pancreas")], codes, allow_generic=False)
    entries, generic = label_entries([(1, "liver"), (2, "pancreas")], codes, allow_generic=True)
    assert generic == ["pancreas"] and entries[1]["category"] == ["85756007", "SCT", "Tissue"]
    # broken files name the line
    with pytest.raises(ModelImportError, match="line 2"):
        read_label_csv(CSV_HEADER + "liver,SCT,123037004,,SCT,10200004,Liver,,,,,,,,,,\n")
    with pytest.raises(ModelImportError, match="missing column"):
        read_label_csv("Structure,Colour\nliver,1\n")
    path = tmp_path / "codes.csv"
    path.write_text(CSV_HEADER + CSV_ROWS["aorta"] + "\n")
    assert load_label_csv(str(path))["aorta"].color == (216, 108, 54)
    with pytest.raises(ModelImportError, match="cannot read"):
        load_label_csv(str(tmp_path / "none.csv"))


def test_labels_totalsegmentator_needs_the_package():
    try:
        import totalsegmentator  # noqa: F401
    except ImportError:
        with pytest.raises(ModelImportError, match="totalsegmentator package is not installed"):
            load_label_csv("totalsegmentator")
    else:
        codes = load_label_csv("totalsegmentator")
        assert codes["kidney_left"].modifier == ("7771000", "SCT", "Left")


def test_palette_is_deterministic_and_distinct():
    colours = [palette(v) for v in range(1, 120)]
    assert colours == [palette(v) for v in range(1, 120)]
    assert len(set(colours)) == len(colours)


def test_merge_label_spaces_numbers_parts_in_order():
    maps, merged = merge_label_spaces(
        [
            ("part_291", [(1, "spleen"), (2, "kidney_right")]),
            ("part_292", [(1, "sacrum"), (2, "spleen"), (3, "vertebrae_S1")]),
        ]
    )
    assert merged == [(1, "spleen"), (2, "kidney_right"), (3, "sacrum"), (4, "vertebrae_S1")]
    assert maps == {"part_291": {"1": 1, "2": 2}, "part_292": {"1": 3, "2": 1, "3": 4}}


def test_an_export_onnx_runtime_cannot_read_fails_the_import_with_both_versions(tmp_path):
    """An ONNX file newer than the installed ONNX Runtime reads fails the fold's check with the
    versions and the way out, as the node's own engine says it (not ONNX Runtime's trace)."""
    torch = pytest.importorskip("torch", reason="PyTorch not installed (pip install -e .[nnunet])")
    onnx = pytest.importorskip("onnx")
    from segnode.engines.importers.export import check_export

    network = torch.nn.Conv3d(1, 2, 1).eval()
    path = tmp_path / "fold_0.onnx"
    x = onnx.helper.make_tensor_value_info("input", onnx.TensorProto.FLOAT, [1, 1, 4, 4, 4])
    y = onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, 1, 4, 4, 4])
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["input"], ["logits"])], "g", [x], [y]
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)])
    model.ir_version = 99
    onnx.save(model, path)
    with pytest.raises(ModelImportError) as caught:
        check_export(network, path, (4, 4, 4), 1, 0)
    message = str(caught.value)
    assert message.startswith(f"fold 0: ONNX Runtime cannot load the export {path}:")
    assert "IR version 99" in message and "upgrade onnxruntime" in message
    model.ir_version = 8
    onnx.save(model, path)
    with pytest.raises(ModelImportError, match="ONNX output shape"):  # it loads, then differs
        check_export(network, path, (4, 4, 4), 1, 0)


# ------------------------------------------------------------ with torch and nnunetv2


def _needs_nnunet() -> Any:
    torch = pytest.importorskip("torch", reason="PyTorch not installed (pip install -e .[nnunet])")
    pytest.importorskip("nnunetv2", reason="nnunetv2 not installed (pip install -e .[nnunet])")
    pytest.importorskip("onnxruntime")
    return torch


def network_for(plans: dict[str, Any], dataset: dict[str, Any], seed: int) -> Any:
    """The network nnU-Net builds for these plans, with seeded random weights."""
    torch = _needs_nnunet()
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    manager = PlansManager(plans)
    config = manager.get_configuration("3d_fullres")
    torch.manual_seed(seed)
    net = get_network_from_plans(
        config.network_arch_class_name,
        config.network_arch_init_kwargs,
        config.network_arch_init_kwargs_req_import,
        1,
        manager.get_label_manager(dataset).num_segmentation_heads,
        allow_init=True,
        deep_supervision=False,
    )
    with torch.no_grad():  # the init's zero biases would hide a bias mix-up: randomise all
        for param in net.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return net.eval()


def save_checkpoint(
    folder: Path,
    fold: int,
    net: Any,
    plans: dict[str, Any],
    dataset: dict[str, Any],
    mirror: tuple[int, ...] | None = (0, 1, 2),
    trainer: str = "nnUNetTrainer",
) -> Path:
    """A checkpoint with the keys of ``nnUNetTrainer.save_checkpoint`` (nnunetv2 2.8.1)."""
    torch = _needs_nnunet()
    path = folder / f"fold_{fold}" / "checkpoint_final.pth"
    path.parent.mkdir(exist_ok=True)
    checkpoint = {
        "network_weights": net.state_dict(),
        "optimizer_state": {},
        "grad_scaler_state": None,
        "logging": {},
        "_best_ema": 0.5,
        "current_epoch": 1000,
        "init_args": {
            "plans": plans,
            "configuration": "3d_fullres",
            "fold": fold,
            "dataset_json": dataset,
            "device": torch.device("cpu"),
        },
        "trainer_name": trainer,
        "inference_allowed_mirroring_axes": mirror,
    }
    torch.save(checkpoint, path)
    return path


@pytest.fixture
def tiny_model(tmp_path):
    """A two-fold nnU-Net model folder (transposed plans) and its two networks."""
    plans = plans_json(spacing=(0.8, 0.8, 2.5), transpose=(2, 0, 1))
    dataset = dataset_json()
    folder = write_folder(tmp_path / "results", plans, dataset)
    nets = {fold: network_for(plans, dataset, seed=fold + 11) for fold in (0, 1)}
    for fold, net in nets.items():
        save_checkpoint(folder, fold, net, plans, dataset)
    return folder, nets


def csv_file(tmp_path: Path, names: list[str]) -> Path:
    path = tmp_path / "codes.csv"
    path.write_text(CSV_HEADER + "\n".join(CSV_ROWS[n] for n in names) + "\n")
    return path


def test_import_exports_each_fold_as_the_torch_network(tmp_path, tiny_model):
    _needs_nnunet()
    import onnxruntime as ort

    from segnode.engines.importers.nnunet import import_nnunet

    torch = _needs_nnunet()
    folder, nets = tiny_model
    codes = load_label_csv(str(csv_file(tmp_path, ["liver", "kidney_left", "spleen"])))
    out = tmp_path / "models" / "tiny"
    report = import_nnunet(folder, out, "tiny", folds=[0, 1], codes=codes)

    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 1, 32, 32, 32)).astype(np.float32)  # batch 2: dynamic batch
    for fold, net in nets.items():
        session = ort.InferenceSession(str(out / f"fold_{fold}.onnx"))
        assert [i.name for i in session.get_inputs()] == ["input"]
        assert [o.name for o in session.get_outputs()] == ["logits"]
        assert session.get_inputs()[0].shape[1:] == [1, 32, 32, 32]
        got = session.run(None, {"input": x})[0]
        with torch.no_grad():
            want = net(torch.from_numpy(x)).numpy()
        assert got.shape == (2, 4, 32, 32, 32)
        assert np.max(np.abs(got - want)) < 1e-4
    # the two folds are different networks: a fold mix-up would show
    s0 = ort.InferenceSession(str(out / "fold_0.onnx")).run(None, {"input": x})[0]
    s1 = ort.InferenceSession(str(out / "fold_1.onnx")).run(None, {"input": x})[0]
    assert np.max(np.abs(s0 - s1)) > 1e-2
    assert [fold for fold, _, _ in report.checks] == ["0", "1"]
    assert all(diff < 1e-4 for _, diff, _ in report.checks)

    manifest = load_manifest(out / "tiny.json")
    c = manifest.model_contract()
    assert [p.name for p in manifest.fold_paths] == ["fold_0.onnx", "fold_1.onnx"]
    assert c.spacing == (0.8, 0.8, 2.5) and c.transpose_forward == (2, 0, 1)
    assert c.orientation == "SPL" and c.mirror_axes == (0, 1, 2) and c.crop_to_nonzero
    assert c.normalization.mean == INTENSITY["mean"]  # type: ignore[attr-defined]
    assert manifest.labels[1].type == ("64033007", "SCT", "Kidney")
    raw = json.loads((out / "tiny.json").read_text())
    assert raw["labels"][1]["modifier"] == ["7771000", "SCT", "Left"]

    provenance = json.loads((out / "import.json").read_text())
    ckpt = folder / "fold_1" / "checkpoint_final.pth"
    assert (
        provenance["folds"][1]["checkpoint_sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()
    )
    assert provenance["versions"]["torch"] == torch.__version__
    assert provenance["generic_labels"] == [] and provenance["checkpoint"] == "final"
    assert json.loads((out / "plans.json").read_text()) == json.loads(
        (folder / "plans.json").read_text()
    )


def test_checkpoint_of_another_architecture_names_fold_and_key(tmp_path):
    plans = plans_json()
    dataset = dataset_json()
    folder = write_folder(tmp_path / "results", plans, dataset)
    save_checkpoint(folder, 0, network_for(plans, dataset, 1), plans, dataset)
    other = plans_json(features=(4, 8, 32))  # the third stage is wider than the plans say
    save_checkpoint(folder, 1, network_for(other, dataset, 2), other, dataset)

    from segnode.engines.importers.nnunet import import_nnunet

    with pytest.raises(ModelImportError) as err:
        import_nnunet(folder, tmp_path / "out", "m", folds=[0, 1])
    message = str(err.value)
    assert "fold 1:" in message and "does not match its plans" in message
    assert "'encoder.stages.2.0.convs.0.conv.weight' has shape [32, 8, 3, 3, 3]" in message

    fewer = plans_json(features=(4, 8))  # a network with a stage less: a missing key
    folder2 = write_folder(tmp_path / "results2", plans, dataset)
    save_checkpoint(folder2, 0, network_for(fewer, dataset, 3), fewer, dataset)
    with pytest.raises(ModelImportError, match="fold 0: .* missing key 'encoder.stages.2"):
        import_nnunet(folder2, tmp_path / "out2", "m", folds=[0])


def test_labels_csv_missing_a_label_fails_before_export(tmp_path, tiny_model):
    from segnode.engines.importers.nnunet import import_nnunet

    folder, _ = tiny_model
    codes = load_label_csv(str(csv_file(tmp_path, ["liver", "spleen"])))
    out = tmp_path / "out"
    with pytest.raises(
        ModelImportError, match="does not name 1 of the model's labels: kidney_left"
    ):
        import_nnunet(folder, out, "m", folds=[0], codes=codes)
    assert not list(out.glob("*.onnx"))
    report = import_nnunet(folder, out, "m", folds=[0], codes=codes, allow_generic=True)
    assert report.generic == ["kidney_left"]
    assert load_manifest(out / "m.json").labels[1].type == ("85756007", "SCT", "Tissue")


def test_totalsegmentator_profile_writes_a_composite(tmp_path):
    from segnode.engines.importers.totalsegmentator import TaskProfile, import_totalsegmentator

    weights = tmp_path / "nnunet" / "results"
    trainer = "nnUNetTrainerNoMirroring"
    part_labels = {
        291: {"background": 0, "spleen": 1, "kidney_left": 2, "liver": 3},
        292: {"background": 0, "aorta": 1, "liver": 2},
    }
    nets = {}
    for task_id, labels in part_labels.items():
        plans = plans_json(spacing=(1.5, 1.5, 1.5))
        dataset = dataset_json(labels)
        folder = write_folder(
            weights, plans, dataset, name=f"Dataset{task_id}_Tiny_part", trainer=trainer
        )
        nets[task_id] = network_for(plans, dataset, task_id)
        save_checkpoint(folder, 0, nets[task_id], plans, dataset, mirror=None, trainer=trainer)
    profile = TaskProfile(
        datasets=((291, "Dataset291_Tiny_part"), (292, "Dataset292_Tiny_part")),
        trainer_folder=f"{trainer}__nnUNetPlans__3d_fullres",
        spacing=1.5,
        overlap=0.2,
    )
    codes = load_label_csv(str(csv_file(tmp_path, ["liver", "kidney_left", "spleen", "aorta"])))
    out = tmp_path / "total"
    reports, composite, path, notes = import_totalsegmentator(
        tmp_path, out, "total", codes=codes, task_profile=profile
    )
    assert path == out / "total.json" and len(reports) == 2
    assert composite["parts"] == [
        {"manifest": "part_291/model.json", "labels": {"1": 1, "2": 2, "3": 3}},
        {"manifest": "part_292/model.json", "labels": {"1": 4, "2": 3}},
    ]
    assert [e["name"] for e in composite["labels"]] == ["spleen", "kidney_left", "liver", "aorta"]
    assert composite["labels"][3]["type"] == ["15825003", "SCT", "Aorta"]
    assert notes and "total.json" in notes[0]
    for task_id in (291, 292):
        part = load_manifest(out / f"part_{task_id}" / "model.json")
        c = part.model_contract()
        assert c.orientation == "SAR" and c.mirror_axes == () and part.overlap == 0.2
        assert c.spacing == (1.5, 1.5, 1.5) and c.data_order == 1 and c.logits_order == 0
        assert c.force_separate_z is False
        assert json.loads((out / f"part_{task_id}" / "import.json").read_text())["profile"] == (
            "totalsegmentator:total"
        )
    # plans at another spacing are not TotalSegmentator's total model
    bad = json.loads(
        (weights / "Dataset292_Tiny_part" / profile.trainer_folder / "plans.json").read_text()
    )
    bad["configurations"]["3d_fullres"]["spacing"] = [3.0, 3.0, 3.0]
    (weights / "Dataset292_Tiny_part" / profile.trainer_folder / "plans.json").write_text(
        json.dumps(bad)
    )
    with pytest.raises(ModelImportError, match=r"spacing \[3.0, 3.0, 3.0\].*1.5 mm"):
        import_totalsegmentator(weights, tmp_path / "again", codes=codes, task_profile=profile)
    with pytest.raises(ModelImportError, match="no Dataset291_"):
        import_totalsegmentator(tmp_path / "empty", tmp_path / "x")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "segnode.node.ops.cli", "model", "import", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


def test_cli_imports_and_reports(tmp_path, tiny_model):
    folder, _ = tiny_model
    out = tmp_path / "cli-model"
    csv = csv_file(tmp_path, ["liver", "spleen"])
    done = run_cli(
        "nnunet", str(folder), "--name", "tiny", "--folds", "0", "1",
        "--labels", str(csv), "--allow-generic", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("model tiny 1.0.0: 3 labels, 2 folds, patch [32, 32, 32]")
    assert "orientation SPL (default for this reader" in lines[0]
    assert lines[1].startswith("  fold 0: ONNX Runtime vs torch on a random patch: max |diff|")
    assert "1 label got the generic code SCT 85756007 'Tissue': kidney_left" in done.stdout
    assert lines[-1] == f"wrote {out / 'tiny.json'}"
    assert load_manifest(out / "tiny.json").fold_paths[1].name == "fold_1.onnx"

    missing = run_cli("nnunet", str(folder), "--name", "x", "--folds", "0", "3", "--out", str(out))
    assert missing.returncode == 1
    assert "missing fold_3/checkpoint_final.pth" in missing.stderr
    csv_short = run_cli(
        "nnunet", str(folder), "--name", "x", "--labels", str(csv), "--folds", "0",
        "--out", str(tmp_path / "x"),
    )  # fmt: skip
    assert csv_short.returncode == 1 and "kidney_left" in csv_short.stderr


def test_cli_refuses_a_broken_plans_file(tmp_path):
    folder = write_folder(tmp_path, plans_json(), dataset_json(), folds=(0,))
    (folder / "plans.json").write_text("{not json")
    done = run_cli(
        "nnunet", str(folder), "--name", "x", "--folds", "0", "--out", str(tmp_path / "o")
    )
    assert done.returncode == 1 and "plans.json: cannot read" in done.stderr


def test_imported_model_runs_in_the_node_as_nnunet_runs_the_checkpoints(tmp_path):
    """The imported folder through the node's runtime (ONNX Runtime engine, segment_trained)
    against nnUNetPredictor running the two checkpoints' torch networks on the same array."""
    torch = _needs_nnunet()
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    from segnode.engines.importers.nnunet import import_nnunet
    from segnode.engines.ort_backend import OrtEngine
    from segnode.engines.preprocess.orientation import Geometry
    from segnode.engines.trained import segment_trained

    plans = plans_json(spacing=(1.2, 1.2, 2.0), transpose=(2, 0, 1))
    dataset = dataset_json()
    folder = write_folder(tmp_path / "results", plans, dataset)
    nets = [network_for(plans, dataset, seed) for seed in (1, 2)]
    for fold, net in enumerate(nets):
        save_checkpoint(folder, fold, net, plans, dataset, mirror=(1, 2))
    import_nnunet(folder, tmp_path / "m", "m", folds=[0, 1])

    zz, yy, xx = np.mgrid[0:40, 0:56, 0:60]
    body = (yy - 28) ** 2 / 400 + (xx - 30) ** 2 / 500 < 1
    noise = np.random.default_rng(0).normal(0, 20, zz.shape)
    hu = np.where(body, 60.0, -1000.0) + 300 * np.sin(zz / 5) * np.cos(xx / 7) + noise
    hu = hu.astype(np.float32)
    spacing = (1.6, 0.9, 0.9)  # head-first supine axial: the node's array is SPL
    positions = [(0.0, 0.0, k * spacing[0]) for k in range(hu.shape[0])]
    geo = Geometry.from_image_plane((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), positions, spacing[1:])

    manager = PlansManager(plans)
    predictor = nnUNetPredictor(
        perform_everything_on_device=False, device=torch.device("cpu"), allow_tqdm=False
    )
    predictor.manual_initialization(
        nets[0],
        manager,
        manager.get_configuration("3d_fullres"),
        [net.state_dict() for net in nets],
        dataset,
        "nnUNetTrainer",
        (1, 2),
    )
    want = predictor.predict_single_npy_array(hu[None], {"spacing": list(spacing)})

    def run(orientation: str) -> Any:
        path = tmp_path / "m" / "m.json"
        raw = json.loads(path.read_text())
        raw["geometry"]["orientation"] = orientation
        path.write_text(json.dumps(raw))
        manifest = load_manifest(path)
        engine = OrtEngine(threads=2)
        engine.load(manifest)
        return segment_trained(engine, manifest, hu, geo)

    got = run("SPL")
    counts = np.bincount(want.ravel().astype(np.int64), minlength=4)
    assert (counts[1:] > 5000).all(), counts  # three labels, each sizeable
    # nnU-Net accumulates in float16, the node in float32: a few voxels on near-ties differ
    assert (got == want).mean() > 0.995, (got == want).mean()
    assert (run("SAL") == want).mean() < 0.95  # the wrong orientation shows


def test_cli_imports_totalsegmentators_five_parts(tmp_path):
    from segnode.engines.importers.totalsegmentator import TASKS

    profile = TASKS["total"]
    weights = tmp_path / "nnunet" / "results"
    trainer = profile.trainer_folder.split("__")[0]
    for i, (task_id, folder_name) in enumerate(profile.datasets):
        plans = plans_json(spacing=(1.5, 1.5, 1.5), features=(2, 4, 8))
        # part i has i + 1 labels; the last part repeats the first part's first name
        labels = {"background": 0, **{f"s{task_id}_{k}": k + 1 for k in range(i + 1)}}
        if i == 4:
            labels = {"background": 0, "s291_0": 1, "rib": 2}
        dataset = dataset_json(labels)
        folder = write_folder(weights, plans, dataset, name=folder_name, trainer=trainer)
        net = network_for(plans, dataset, task_id)
        save_checkpoint(folder, 0, net, plans, dataset, mirror=None, trainer=trainer)
    out = tmp_path / "total"
    done = run_cli("totalsegmentator", str(tmp_path), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "composite total 1.0.0: 11 labels from 5 parts" in done.stdout
    assert "total.json: loads: 11 labels from 5 parts" in done.stdout
    composite = json.loads((out / "total.json").read_text())
    assert [p["manifest"] for p in composite["parts"]] == [
        f"part_{task_id}/model.json" for task_id, _ in profile.datasets
    ]
    assert composite["parts"][4]["labels"] == {"1": 1, "2": 11}  # s291_0 keeps its number
    manifest = load_manifest(out / "total.json")
    assert len(manifest.labels) == 11 and len(manifest.parts) == 5


def test_a_failed_import_leaves_the_model_folder_as_it_was(tmp_path):
    from segnode.engines.importers.nnunet import import_nnunet

    plans = plans_json()
    dataset = dataset_json()
    folder = write_folder(tmp_path / "results", plans, dataset)
    save_checkpoint(folder, 0, network_for(plans, dataset, 1), plans, dataset)
    other = plans_json(features=(4, 8, 32))
    save_checkpoint(folder, 1, network_for(other, dataset, 2), other, dataset)
    out = tmp_path / "models" / "m"
    import_nnunet(folder, out, "m", folds=[0])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    save_checkpoint(folder, 0, network_for(plans, dataset, 5), plans, dataset)  # retrained
    with pytest.raises(ModelImportError, match="fold 1"):
        import_nnunet(folder, out, "m", folds=[0, 1])  # the new fold 0 exports, fold 1 fails
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]  # no staging folder left
    with pytest.raises(ModelImportError, match="--name: '../m'"):
        import_nnunet(folder, out, "../m", folds=[0])


def test_region_based_model_exports_one_channel_per_region(tmp_path):
    _needs_nnunet()
    import onnxruntime as ort

    from segnode.engines.importers.nnunet import import_nnunet

    plans = plans_json()
    dataset = dataset_json(
        {"background": 0, "whole": [1, 2, 3], "core": [2, 3], "enhancing": 3},
        regions_class_order=[1, 2, 3],
    )
    folder = write_folder(tmp_path / "results", plans, dataset)
    save_checkpoint(folder, 0, network_for(plans, dataset, 4), plans, dataset)
    import_nnunet(folder, tmp_path / "r", "r", folds=[0])
    manifest = load_manifest(tmp_path / "r" / "r.json")
    contract = manifest.model_contract()
    assert contract.regions == ((1, 2, 3), (2, 3), (3,))
    assert contract.regions_class_order == (1, 2, 3) and manifest.output_channels == 3
    session = ort.InferenceSession(str(tmp_path / "r" / "fold_0.onnx"))
    out = session.run(None, {"input": np.zeros((1, 1, 32, 32, 32), np.float32)})[0]
    assert out.shape == (1, 3, 32, 32, 32)


FAST_FOLDER = "Dataset297_TotalSegmentator_total_3mm_1559subj"
FAST_TRAINER = "nnUNetTrainer_4000epochs_NoMirroring__nnUNetPlans__3d_fullres"


def test_plain_import_of_totalsegmentators_fast_dataset_names_the_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``model import nnunet`` of TotalSegmentator's Dataset297 refuses, naming the
    ``totalsegmentator --task total_fast`` import (issue 37); ``--as-nnunet`` goes on to the
    folder itself (here: empty, so the folder's own error)."""
    from segnode.node.ops.cli import main  # noqa: PLC0415

    weights = tmp_path / "results"
    folder = weights / FAST_FOLDER / FAST_TRAINER
    folder.mkdir(parents=True)
    assert main(["model", "import", "nnunet", str(folder), "--name", "fast", "--folds", "0"]) == 1
    err = capsys.readouterr().err
    assert "Dataset297" in err and "--fast" in err
    assert f"segnode model import totalsegmentator {weights} --task total_fast" in err
    assert "overlap 0.2" in err and "3.0 mm" in err
    other = ["model", "import", "nnunet", str(folder), "--name", "fast", "--as-nnunet"]
    assert main(other) == 1
    assert "totalsegmentator --task" not in capsys.readouterr().err
    plain = tmp_path / "Dataset555_Phantom" / "nnUNetTrainer__nnUNetPlans__3d_fullres"
    from segnode.engines.importers.totalsegmentator import profile_advice  # noqa: PLC0415

    assert profile_advice(plain) is None
    assert profile_advice(weights / "Dataset298_TotalSegmentator_total_6mm_1559subj") is not None


@pytest.mark.parametrize(("task", "dataset"), [("total_fast", 297), ("total_fastest", 298)])
def test_totalsegmentator_fast_tasks_find_their_dataset_and_check_its_spacing(
    tmp_path: Path, task: str, dataset: int
) -> None:
    from segnode.engines.importers.totalsegmentator import import_totalsegmentator  # noqa: PLC0415

    with pytest.raises(ModelImportError, match=f"no Dataset{dataset}_"):
        import_totalsegmentator(tmp_path, tmp_path / "out", task=task)
    folder = tmp_path / f"Dataset{dataset}_TotalSegmentator_x" / FAST_TRAINER
    folder.mkdir(parents=True)
    (folder / "dataset.json").write_text(
        json.dumps({"channel_names": {"0": "CT"}, "labels": {"background": 0, "spleen": 1}})
    )
    plans = {"configurations": {"3d_fullres": {"spacing": [1.5, 1.5, 1.5]}}}  # "total" 1.5 mm
    (folder / "plans.json").write_text(json.dumps(plans))
    with pytest.raises(ModelImportError, match=f"this is not the {task} model"):
        import_totalsegmentator(tmp_path, tmp_path / "out", task=task)
