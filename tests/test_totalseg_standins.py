"""scripts/make_totalseg_standins.py: TotalSegmentator's real networks with random weights.

Without torch and dynamic_network_architectures only the committed plans and label lists are
checked; with them, the networks the plans name (built on the meta device: no memory), the
full 297 checkpoint and the folder layout (``--small`` networks); with nnunetv2, that nnU-Net's
own ``get_network_from_plans`` loads the checkpoints strictly; with TotalSegmentator, that the
committed label lists are its own.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from bench.totalseg_standin import INTENSITY
from scripts import make_totalseg_standins as mts
from segnode.engines.importers.nnunet_plans import output_layout, read_json_object
from segnode.engines.importers.totalsegmentator import (
    TASKS,
    find_dataset,
    totalsegmentator_task,
)


def _have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


needs_torch = pytest.mark.skipif(
    not _have("torch", "dynamic_network_architectures"),
    reason="needs torch and dynamic_network_architectures (pip install "
    "dynamic-network-architectures, or nnunetv2 which brings it) to build the networks",
)
needs_nnunet = pytest.mark.skipif(
    not _have("torch", "nnunetv2"), reason="needs nnunetv2 (pip install -e '.[nnunet]')"
)

PART_SIZES = {291: 24, 292: 26, 293: 18, 294: 23, 295: 26}
PARAMETERS = {291: 31_214_109, 292: 31_215_719, 293: 31_209_279, 294: 31_213_304,
              295: 31_215_719, 297: 16_603_736}  # fmt: skip
"""What the committed plans give (the figures reported for issue 34)."""


def _by_id(task_id: int) -> mts.Standin:
    return next(s for s in mts.standins() if s.task_id == task_id)


def test_standins_are_the_importers_datasets() -> None:
    found = [(s.task, s.task_id, s.folder, s.trainer_folder, s.spacing) for s in mts.standins()]
    expected = [
        (task, task_id, folder, TASKS[task].trainer_folder, TASKS[task].spacing)
        for task in ("total", "total_fast")
        for task_id, folder in TASKS[task].datasets
    ]
    assert found == expected
    assert [s.task_id for s in mts.standins("total")] == [291, 292, 293, 294, 295]
    assert _by_id(292).subjects == 1532 and _by_id(297).subjects == 1559
    assert _by_id(297).trainer == "nnUNetTrainer_4000epochs_NoMirroring"


@pytest.mark.parametrize("task_id", [291, 292, 293, 294, 295, 297])
def test_plans_are_the_planners_choice(task_id: int) -> None:
    standin = _by_id(task_id)
    plans = mts.load_plans(task_id)
    assert plans["dataset_name"] == standin.folder
    assert plans["plans_name"] == "nnUNetPlans"
    assert plans["experiment_planner_used"] == "ExperimentPlanner"
    assert plans["image_reader_writer"] == "SimpleITKIO"
    assert plans["transpose_forward"] == [0, 1, 2]
    assert plans["foreground_intensity_properties_per_channel"] == {"0": INTENSITY}
    config = mts.resolve_configuration(plans, "3d_fullres")
    assert config["spacing"] == [standin.spacing] * 3
    assert config["normalization_schemes"] == ["CTNormalization"]
    assert config["batch_size"] == 2
    arch = config["architecture"]
    assert arch["network_class_name"].endswith(".unet.PlainConvUNet")
    kwargs = arch["arch_kwargs"]
    if standin.spacing == 1.5:
        assert kwargs["n_stages"] == 6
        assert kwargs["features_per_stage"] == [32, 64, 128, 256, 320, 320]
        assert config["patch_size"] == [128, 128, 128]
    else:
        assert kwargs["n_stages"] == 5
        assert kwargs["features_per_stage"] == [32, 64, 128, 256, 320]
        assert config["patch_size"] == [128, 112, 112]
    n = kwargs["n_stages"]
    assert kwargs["strides"] == [[1, 1, 1]] + [[2, 2, 2]] * (n - 1)
    assert kwargs["kernel_sizes"] == [[3, 3, 3]] * n
    assert kwargs["n_conv_per_stage"] == [2] * n
    assert kwargs["n_conv_per_stage_decoder"] == [2] * (n - 1)
    # the patch divides by the total stride (nnU-Net's get_pool_and_conv_props)
    assert all(p % 2 ** (n - 1) == 0 for p in config["patch_size"])


def test_the_five_parts_share_one_3d_network() -> None:
    # the label count enters the planner's memory estimate (the 2d batch size differs), not
    # the 3d configurations
    first = mts.load_plans(291)["configurations"]
    for task_id in (292, 293, 294, 295):
        configurations = mts.load_plans(task_id)["configurations"]
        for name in ("3d_fullres", "3d_lowres", "3d_cascade_fullres"):
            assert configurations[name] == first[name]


def test_label_lists() -> None:
    labels = mts.load_labels()
    assert set(labels) == {291, 292, 293, 294, 295, 297}
    assert {k: len(labels[k]) for k in PART_SIZES} == PART_SIZES
    assert len(labels[297]) == 117 == len(set(labels[297]))
    # TotalSegmentator's five parts, concatenated in merge order, are class_map["total"]
    assert [n for k in (291, 292, 293, 294, 295) for n in labels[k]] == labels[297]
    assert labels[297][:3] == ["spleen", "kidney_right", "kidney_left"]


@pytest.mark.skipif(not _have("totalsegmentator"), reason="TotalSegmentator not installed")
def test_label_lists_are_totalsegmentators() -> None:
    assert mts.totalsegmentator_labels() == mts.load_labels()


@pytest.mark.parametrize("task_id", [291, 297])
def test_dataset_json(task_id: int) -> None:
    standin = _by_id(task_id)
    names = mts.load_labels()[task_id]
    dataset = mts.dataset_json(standin, names)
    assert dataset["channel_names"] == {"0": "CT"}
    assert dataset["file_ending"] == ".nii.gz"
    assert dataset["numTraining"] == standin.subjects
    assert list(dataset["labels"].items()) == [
        ("background", 0),
        *((name, i) for i, name in enumerate(names, start=1)),
    ]
    layout = output_layout(dataset, "dataset.json")  # segnode's reading of it
    assert list(layout.names) == list(enumerate(names, start=1))
    assert layout.channels == len(names) + 1


def _expected_parameters(kwargs: Mapping[str, Any], num_classes: int) -> int:
    """PlainConvUNet's parameters from the plans alone: convolutions with bias and affine
    instance norms, transposed convolutions up, a 1x1x1 head on every decoder stage."""
    features: Sequence[int] = kwargs["features_per_stage"]
    strides: Sequence[Sequence[int]] = kwargs["strides"]
    kernels: Sequence[Sequence[int]] = kwargs["kernel_sizes"]

    def conv(cin: int, cout: int, kernel: Sequence[int]) -> int:
        return cin * cout * math.prod(kernel) + cout + 2 * cout

    total, cin = 0, 1
    for stage, cout in enumerate(features):
        for i in range(kwargs["n_conv_per_stage"][stage]):
            total += conv(cin if i == 0 else cout, cout, kernels[stage])
        cin = cout
    for stage in range(len(features) - 2, -1, -1):
        below, cout = features[stage + 1], features[stage]
        total += below * cout * math.prod(strides[stage + 1]) + cout  # transposed conv
        for i in range(kwargs["n_conv_per_stage_decoder"][stage]):
            total += conv(2 * cout if i == 0 else cout, cout, kernels[stage])
        total += cout * num_classes + num_classes  # segmentation head
    return total


@needs_torch
def test_networks_match_the_plans() -> None:
    import torch

    labels = mts.load_labels()
    for standin in mts.standins():
        plans = mts.load_plans(standin.task_id)
        classes = len(labels[standin.task_id]) + 1
        with torch.device("meta"):
            network = mts.build_network(plans, classes)
        kwargs = mts.resolve_configuration(plans, "3d_fullres")["architecture"]["arch_kwargs"]
        count = mts.parameter_count(network)
        assert count == _expected_parameters(kwargs, classes) == PARAMETERS[standin.task_id]


@needs_torch
def test_checkpoint_297(tmp_path: Path) -> None:
    import torch

    standin = _by_id(297)
    written = mts.write_standin(tmp_path / "nnunet" / "results", standin, seed=5)
    folder = written.model_dir
    assert folder == (
        tmp_path / "nnunet" / "results" / "Dataset297_TotalSegmentator_total_3mm_1559subj"
        / "nnUNetTrainer_4000epochs_NoMirroring__nnUNetPlans__3d_fullres"
    )  # fmt: skip
    assert written.parameters == PARAMETERS[297]
    assert json.loads((folder / "plans.json").read_text()) == mts.load_plans(297)
    dataset = json.loads((folder / "dataset.json").read_text())
    assert len(dataset["labels"]) == 118
    ckpt = torch.load(folder / "fold_0" / "checkpoint_final.pth", map_location="cpu",
                      weights_only=False)  # fmt: skip
    # what nnUNetPredictor.initialize_from_trained_model_folder reads (nnunetv2 2.8.1)
    assert ckpt["trainer_name"] == "nnUNetTrainer_4000epochs_NoMirroring"
    assert ckpt["init_args"]["configuration"] == "3d_fullres"
    assert ckpt["inference_allowed_mirroring_axes"] is None
    assert ckpt["init_args"]["dataset_json"] == dataset
    # and the rest of nnUNetTrainer.save_checkpoint's keys
    assert {"optimizer_state", "grad_scaler_state", "logging", "_best_ema", "current_epoch"} <= set(
        ckpt
    )
    weights = ckpt["network_weights"]
    with torch.device("meta"):
        reference = mts.build_network(mts.load_plans(297), 118).state_dict()
    assert list(weights) == list(reference)
    assert all(weights[k].shape == reference[k].shape for k in reference)
    assert all(v.dtype == torch.float32 for v in weights.values())
    head = weights["decoder.seg_layers.3.bias"]
    assert head[0] == mts.BACKGROUND_BIAS and bool((head[1:] == mts.STRUCTURE_BIAS).all())
    # He: std sqrt(2 / fan_in) (InitWeights_He(1e-2)), biases zero
    w = weights["encoder.stages.4.0.convs.1.conv.weight"]
    assert abs(float(w.std()) / math.sqrt(2 / (320 * 27)) - 1) < 0.02
    assert float(weights["encoder.stages.4.0.convs.1.conv.bias"].abs().max()) == 0.0


@needs_torch
def test_constant_head_labels_every_voxel_the_first_structure() -> None:
    """``--head constant``: TotalSegmentator's cheapest non-empty output, for its bench."""
    import torch

    plans = mts.small_plans(mts.load_plans(297))
    network = mts.build_network(plans, 118)
    mts.initialise(network, 297, head="constant")
    network.eval()
    with torch.no_grad():
        logits = network(torch.randn(1, 1, 32, 32, 32) * 100)
    assert bool((logits.argmax(1) == 1).all())
    noise = mts.build_network(plans, 118)
    mts.initialise(noise, 297)
    with torch.no_grad():
        assert len(torch.unique(noise.eval()(torch.randn(1, 1, 32, 32, 32) * 100).argmax(1))) > 1
    with pytest.raises(ValueError, match="head 'x'"):
        mts.initialise(network, 297, head="x")


def _weights(folder: Path) -> dict[str, Any]:
    import torch

    ckpt = torch.load(folder / "fold_0" / "checkpoint_final.pth", map_location="cpu",
                      weights_only=False)  # fmt: skip
    weights: dict[str, Any] = ckpt["network_weights"]
    return weights


@needs_torch
def test_layout_is_what_the_importer_finds(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert mts.main(["--out", str(home), "--task", "all", "--small", "--seed", "3"]) == 0
    results = home / "nnunet" / "results"
    labels = mts.load_labels()
    for standin in mts.standins():
        folder = standin.model_dir(results)
        assert {p.relative_to(folder).as_posix() for p in folder.rglob("*")} == {
            "plans.json", "dataset.json", "fold_0", "fold_0/checkpoint_final.pth",
        }  # fmt: skip
        assert totalsegmentator_task(folder) == (standin.task, standin.task_id)
        for root in (results, home):  # the results folder, or the home holding it
            found = find_dataset(root, standin.task_id, standin.folder, standin.trainer_folder)
            assert found == folder
        plans = read_json_object(folder / "plans.json")
        config = mts.resolve_configuration(plans, "3d_fullres")
        assert config["spacing"] == [TASKS[standin.task].spacing] * 3
        assert "standin_small" in plans
        dataset = read_json_object(folder / "dataset.json")
        names = output_layout(dataset, "dataset.json").names
        assert [name for _, name in names] == labels[standin.task_id]

    # deterministic from the seed; another seed, other weights
    part = _by_id(293)
    again = mts.write_standin(tmp_path / "again", part, seed=3, small=True)
    other = mts.write_standin(tmp_path / "other", part, seed=4, small=True)
    first = _weights(part.model_dir(results))
    assert all(bool((first[k] == v).all()) for k, v in _weights(again.model_dir).items())
    key = "encoder.stages.0.0.convs.0.conv.weight"
    assert not bool((first[key] == _weights(other.model_dir)[key]).all())


@needs_torch
@needs_nnunet
def test_nnunet_loads_the_checkpoints_strictly(tmp_path: Path) -> None:
    import torch
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans
    from nnunetv2.utilities.label_handling.label_handling import determine_num_input_channels
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    results = tmp_path / "nnunet" / "results"
    for task_id in (291, 297):
        folder = mts.write_standin(results, _by_id(task_id), small=True).model_dir
        plans = read_json_object(folder / "plans.json")
        dataset = read_json_object(folder / "dataset.json")
        ckpt = torch.load(folder / "fold_0" / "checkpoint_final.pth", map_location="cpu",
                          weights_only=False)  # fmt: skip
        manager = PlansManager(plans)
        config = manager.get_configuration(ckpt["init_args"]["configuration"])
        network = get_network_from_plans(
            config.network_arch_class_name,
            config.network_arch_init_kwargs,
            config.network_arch_init_kwargs_req_import,
            determine_num_input_channels(manager, config, dataset),
            manager.get_label_manager(dataset).num_segmentation_heads,
            allow_init=True,
            deep_supervision=False,
        )
        network.load_state_dict(ckpt["network_weights"], strict=True)
