"""Stand-in weights with TotalSegmentator's real architecture (issue 34, "The real shape").

TotalSegmentator 2.x's ``total`` task runs five nnU-Net v2 datasets (291-295, 1.5 mm,
``nnUNetTrainerNoMirroring``) and ``--fast`` one (297, 3 mm,
``nnUNetTrainer_4000epochs_NoMirroring``); their weights download at run time, which cannot
work offline. This script writes random weights of the same networks, laid out as
TotalSegmentator keeps them (``$TOTALSEG_HOME_DIR/nnunet/results``)::

    DIR/nnunet/results/<DatasetXXX_...>/<trainer>__nnUNetPlans__3d_fullres/
        dataset.json  plans.json  fold_0/checkpoint_final.pth

so that ``totalsegmentator(..., task="total")`` (``fast=True`` for 297) runs on them without
a download and ``segnode model import totalsegmentator DIR/nnunet/results --task
total|total_fast`` imports them: speed and memory measured on the real shape.

* Plans: what nnU-Net v2's own ``ExperimentPlanner`` (default 8 GB target) chooses for a
  synthetic fingerprint of TotalSegmentator's training data (:func:`fingerprint`: body CTs
  already resampled to the dataset's spacing, CT intensities of
  :data:`bench.totalseg_standin.INTENSITY`), committed in ``bench/totalseg_plans/`` by
  ``--plan`` (needs nnunetv2), so that the weights need no planner.
* Labels: each dataset's structure names in output order, from TotalSegmentator's
  ``map_to_binary`` (``class_map_5_parts`` for 291-295, ``class_map["total"]`` for 297),
  committed as ``bench/totalseg_plans/labels.json`` by ``--plan`` (needs TotalSegmentator).
* Weights: the network the plans name, built as ``get_network_from_plans`` builds it
  (``pydoc.locate`` of the class and of the ``_kw_requires_import`` arguments), He-initialised
  by its own ``initialize`` (nnU-Net's ``allow_init`` path) from a seed, float32; the
  segmentation heads' bias favours background, so the label map is mostly background with
  some of every structure. The checkpoint has the keys ``nnUNetTrainer.save_checkpoint``
  writes (``nnUNetPredictor.initialize_from_trained_model_folder`` reads ``network_weights``,
  ``trainer_name``, ``init_args["configuration"]``, ``inference_allowed_mirroring_axes``).
  Needs torch and dynamic_network_architectures only.

Run::

    python -m scripts.make_totalseg_standins --out /tmp/tshome --task all
    python -m scripts.make_totalseg_standins --plan      # nnunetv2 + TotalSegmentator

``--small`` divides every stage's features by 8 (same stages, strides and patch): a network
of the same layout that runs in seconds on a CPU, for tests; its ``plans.json`` says so.
"""

from __future__ import annotations

import argparse
import json
import os
import pydoc
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.totalseg_standin import INTENSITY
from segnode.engines.importers.totalsegmentator import TASKS

if TYPE_CHECKING:
    import torch

PLANS_DIR = Path(__file__).resolve().parent.parent / "bench" / "totalseg_plans"
LABELS_FILE = PLANS_DIR / "labels.json"
STANDIN_TASKS = ("total", "total_fast")
CONFIGURATION = "3d_fullres"
BACKGROUND_BIAS = 2.0
STRUCTURE_BIAS = -1.0
"""Segmentation head bias: background favoured, as :mod:`bench.totalseg_standin` does."""
SMALL_DIVISOR = 8

BODY_CT_EXTENTS_MM = (
    (450.0, 400.0, 400.0),
    (300.0, 350.0, 350.0),
    (350.0, 380.0, 380.0),
    (400.0, 400.0, 400.0),
    (420.0, 420.0, 420.0),
    (480.0, 440.0, 440.0),
    (550.0, 450.0, 450.0),
    (700.0, 480.0, 480.0),
    (900.0, 500.0, 500.0),
)
"""Extent (z, y, x) in mm of the synthetic training CTs: axial fields of view of 350-500 mm,
300-900 mm long (thorax, abdomen, trunk, whole body); median 450 x 420 x 420 mm, i.e.
300 x 280 x 280 voxels at 1.5 mm and 150 x 140 x 140 at 3 mm. Arrays are (z, y, x), as
SimpleITKIO (the reader nnU-Net's planner picks for ``.nii.gz``) returns them."""


@dataclass(frozen=True)
class Standin:
    """One of TotalSegmentator's datasets, as :data:`TASKS` names it."""

    task: str
    task_id: int
    folder: str
    trainer_folder: str
    spacing: float

    @property
    def trainer(self) -> str:
        """The trainer class (``nnUNetTrainerNoMirroring``, ...)."""
        return self.trainer_folder.split("__")[0]

    @property
    def subjects(self) -> int:
        """Training cases, from the folder name (``..._1559subj``)."""
        found = re.search(r"_(\d+)subj$", self.folder)
        if found is None:
            raise ValueError(f"{self.folder}: no subject count in the name")
        return int(found.group(1))

    def model_dir(self, results: Path) -> Path:
        """The trained-model folder under ``results`` (``.../nnunet/results``)."""
        return results / self.folder / self.trainer_folder


def standins(task: str = "all") -> list[Standin]:
    """The datasets of ``task`` (``total``, ``total_fast`` or ``all``) in merge order."""
    tasks = STANDIN_TASKS if task == "all" else (task,)
    return [
        Standin(t, task_id, folder, TASKS[t].trainer_folder, TASKS[t].spacing)
        for t in tasks
        for task_id, folder in TASKS[t].datasets
    ]


def plans_path(task_id: int) -> Path:
    """The committed plans of dataset ``task_id``."""
    return PLANS_DIR / f"plans_{task_id}.json"


def load_plans(task_id: int) -> dict[str, Any]:
    """The committed plans (nnU-Net's planner output) of dataset ``task_id``."""
    plans: dict[str, Any] = json.loads(plans_path(task_id).read_text())
    return plans


def load_labels() -> dict[int, list[str]]:
    """The committed structure names of every dataset, in output order (value 1 first)."""
    raw = json.loads(LABELS_FILE.read_text())
    return {int(k): list(v) for k, v in raw["labels"].items()}


def totalsegmentator_labels() -> dict[int, list[str]]:
    """The structure names from the installed TotalSegmentator (``map_to_binary``): what
    its ``nnunet.py`` maps each dataset's output value ``v`` to."""
    from totalsegmentator.map_to_binary import (  # noqa: PLC0415
        class_map,
        class_map_5_parts,
        map_taskid_to_partname_ct,
    )

    out: dict[int, list[str]] = {}
    for standin in standins():
        if standin.task == "total":  # merged through class_map_5_parts
            names = class_map_5_parts[map_taskid_to_partname_ct[standin.task_id]]
        else:  # one dataset: its output values are class_map["total"]'s ids
            names = class_map["total"]
        if sorted(names) != list(range(1, len(names) + 1)):
            raise ValueError(f"dataset {standin.task_id}: label values are not 1..N")
        out[standin.task_id] = [names[v] for v in range(1, len(names) + 1)]
    return out


def dataset_json(standin: Standin, names: Sequence[str]) -> dict[str, Any]:
    """nnU-Net's ``dataset.json`` of a dataset whose output values 1..N are ``names``."""
    return {
        "channel_names": {"0": "CT"},
        "labels": {"background": 0, **{name: i for i, name in enumerate(names, start=1)}},
        "numTraining": standin.subjects,
        "file_ending": ".nii.gz",
        "name": standin.folder.split("_", 1)[1],
        "description": "stand-in with random weights (scripts/make_totalseg_standins.py)",
    }


def fingerprint(spacing: float) -> dict[str, Any]:
    """A dataset fingerprint (``nnUNetv2_extract_fingerprint``'s keys the planner reads) of
    :data:`BODY_CT_EXTENTS_MM` resampled to ``spacing`` (TotalSegmentator trains on data
    already at its spacing); CT keeps every voxel after cropping to non-zero."""
    shapes = [[round(e / spacing) for e in extent] for extent in BODY_CT_EXTENTS_MM]
    return {
        "spacings": [[spacing] * 3 for _ in shapes],
        "shapes_after_crop": shapes,
        "median_relative_size_after_cropping": 1.0,
        "foreground_intensity_properties_per_channel": {"0": dict(INTENSITY)},
    }


def resolve_configuration(plans: Mapping[str, Any], name: str) -> dict[str, Any]:
    """``plans["configurations"][name]`` with ``inherits_from`` resolved (PlansManager)."""
    config = dict(plans["configurations"][name])
    parent = config.pop("inherits_from", None)
    if parent is None:
        return config
    return {**resolve_configuration(plans, parent), **config}


def small_plans(plans: Mapping[str, Any]) -> dict[str, Any]:
    """``plans`` with every stage's features divided by :data:`SMALL_DIVISOR` (``--small``)."""
    out: dict[str, Any] = json.loads(json.dumps(plans))
    for config in out["configurations"].values():
        kwargs = config.get("architecture", {}).get("arch_kwargs")
        if kwargs is not None:
            kwargs["features_per_stage"] = [
                max(4, f // SMALL_DIVISOR) for f in kwargs["features_per_stage"]
            ]
    out["standin_small"] = f"features divided by {SMALL_DIVISOR} (--small): not the real shape"
    return out


def build_network(
    plans: Mapping[str, Any], num_classes: int, *, configuration: str = CONFIGURATION
) -> torch.nn.Module:
    """The network of ``configuration``, as nnU-Net builds it for inference.

    ``nnunetv2.utilities.get_network_from_plans`` without nnunetv2: the class and the
    ``_kw_requires_import`` arguments located with ``pydoc.locate``, ``input_channels`` 1
    (one CT channel), ``deep_supervision=False`` (the trainer's ``enable_deep_supervision``
    at inference; the state_dict keys are the same either way). Not initialised: see
    :func:`initialise`.
    """
    arch = resolve_configuration(plans, configuration)["architecture"]
    network_class = pydoc.locate(arch["network_class_name"])
    if not callable(network_class):
        raise ImportError(
            f"{arch['network_class_name']}: not found (dynamic-network-architectures)"
        )
    kwargs = dict(arch["arch_kwargs"])
    for key in arch["_kw_requires_import"]:
        if kwargs[key] is not None:
            kwargs[key] = pydoc.locate(kwargs[key])
    kwargs["deep_supervision"] = False
    network: torch.nn.Module = network_class(input_channels=1, num_classes=num_classes, **kwargs)
    return network


HEADS = ("noise", "constant")
"""``noise``: random logits, background favoured (every structure somewhere on nearly every
slice: the worst case for the output). ``constant``: the segmentation heads' weights zeroed
and the first structure's bias highest, so every voxel is that structure: the cheapest
non-empty output (one segment), for a lower bound of TotalSegmentator's own time that does
not charge it for writing noise. The convolutions run the same either way."""


def initialise(network: torch.nn.Module, seed: int, *, head: str = "noise") -> None:
    """He initialisation through the network's own ``initialize`` (``InitWeights_He(1e-2)``
    for PlainConvUNet: normal convolution weights, zero biases), from ``seed`` without
    touching the caller's random state; then the segmentation heads as ``head`` says
    (:data:`HEADS`): for ``noise`` the bias favours background (:data:`BACKGROUND_BIAS`,
    :data:`STRUCTURE_BIAS`)."""
    import torch  # noqa: PLC0415

    if head not in HEADS:
        raise ValueError(f"head {head!r}: one of {', '.join(HEADS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        network.apply(network.initialize)  # type: ignore[arg-type]
    with torch.no_grad():
        for layer in network.decoder.seg_layers:  # type: ignore[union-attr]
            layer.bias.fill_(STRUCTURE_BIAS)
            if head == "constant":
                layer.weight.zero_()
                layer.bias[1] = BACKGROUND_BIAS
            else:
                layer.bias[0] = BACKGROUND_BIAS


def parameter_count(network: torch.nn.Module) -> int:
    """Distinct parameters (the decoder's reference to the encoder counted once)."""
    return sum(p.numel() for p in network.parameters())


def checkpoint(
    network: torch.nn.Module,
    standin: Standin,
    plans: dict[str, Any],
    dataset: dict[str, Any],
    seed: int,
) -> dict[str, Any]:
    """The checkpoint ``nnUNetTrainer.save_checkpoint`` writes, for ``network``: float32
    weights on the CPU, no optimiser state, ``init_args`` as the trainer's ``__init__``
    received them, no mirroring at inference (the NoMirroring trainers set None)."""
    import torch  # noqa: PLC0415

    weights = {k: v.detach().to("cpu", torch.float32) for k, v in network.state_dict().items()}
    return {
        "network_weights": weights,
        "optimizer_state": None,
        "grad_scaler_state": None,
        "logging": {},
        "_best_ema": None,
        "current_epoch": 0,
        "init_args": {
            "plans": plans,
            "configuration": CONFIGURATION,
            "fold": 0,
            "dataset_json": dataset,
            "device": torch.device("cuda"),
        },
        "trainer_name": standin.trainer,
        "inference_allowed_mirroring_axes": None,
        "standin": {"seed": seed, "script": "scripts/make_totalseg_standins.py"},
    }


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Written:
    """What :func:`write_standin` wrote."""

    standin: Standin
    model_dir: Path
    parameters: int
    bytes: int
    seconds: float


def write_standin(
    results: Path,
    standin: Standin,
    *,
    seed: int = 0,
    small: bool = False,
    labels: Mapping[int, Sequence[str]] | None = None,
    head: str = "noise",
) -> Written:
    """Write one dataset's trained-model folder under ``results`` (``.../nnunet/results``).

    The network's seed is ``seed + task id`` (each part differs); ``head``: see
    :data:`HEADS`.
    """
    import torch  # noqa: PLC0415

    t0 = time.perf_counter()
    names = (labels or load_labels())[standin.task_id]
    plans = load_plans(standin.task_id)
    if small:
        plans = small_plans(plans)
    dataset = dataset_json(standin, names)
    network = build_network(plans, len(names) + 1)
    initialise(network, seed + standin.task_id, head=head)
    folder = standin.model_dir(results)
    _write_text(folder / "plans.json", json.dumps(plans, indent=4) + "\n")
    _write_text(folder / "dataset.json", json.dumps(dataset, indent=4) + "\n")
    target = folder / "fold_0" / "checkpoint_final.pth"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    torch.save(checkpoint(network, standin, plans, dataset, seed + standin.task_id), tmp)
    os.replace(tmp, target)
    return Written(
        standin,
        folder,
        parameter_count(network),
        target.stat().st_size,
        time.perf_counter() - t0,
    )


def plan_dataset(
    standin: Standin, names: Sequence[str], work: Path, *, gpu_memory_gb: float = 8.0
) -> str:
    """Run nnU-Net's ``ExperimentPlanner`` on :func:`fingerprint` for ``standin``; return
    the ``nnUNetPlans.json`` it wrote, as it wrote it.

    The raw folder holds ``dataset.json`` and one tiny example image (the planner reads it to
    choose the reader); ``nnUNet_raw`` and ``nnUNet_preprocessed`` point into ``work``.
    """
    import numpy as np  # noqa: PLC0415
    import SimpleITK as sitk  # noqa: N813, PLC0415

    raw = work / "raw" / standin.folder
    preprocessed = work / "preprocessed" / standin.folder
    (raw / "imagesTr").mkdir(parents=True, exist_ok=True)
    (raw / "labelsTr").mkdir(parents=True, exist_ok=True)
    preprocessed.mkdir(parents=True, exist_ok=True)
    (raw / "dataset.json").write_text(json.dumps(dataset_json(standin, names), indent=4))
    (preprocessed / "dataset_fingerprint.json").write_text(
        json.dumps(fingerprint(standin.spacing), indent=4)
    )
    # only read to choose the reader; the fingerprint holds the spacings and shapes
    image = sitk.GetImageFromArray(np.zeros((8, 8, 8), np.int16))
    sitk.WriteImage(image, str(raw / "imagesTr" / "case_000_0000.nii.gz"))
    label = sitk.GetImageFromArray(np.zeros((8, 8, 8), np.uint8))
    sitk.WriteImage(label, str(raw / "labelsTr" / "case_000.nii.gz"))

    os.environ.update(
        nnUNet_raw=str(work / "raw"),
        nnUNet_preprocessed=str(work / "preprocessed"),
        nnUNet_results=str(work / "results"),
    )
    from nnunetv2.experiment_planning.experiment_planners import (  # noqa: PLC0415
        default_experiment_planner as dep,
    )

    # nnunetv2.paths reads the variables once, at its first import
    dep.nnUNet_raw = str(work / "raw")
    dep.nnUNet_preprocessed = str(work / "preprocessed")
    planner = dep.ExperimentPlanner(standin.folder, gpu_memory_target_in_gb=gpu_memory_gb)
    planner.plan_experiment()
    return (preprocessed / "nnUNetPlans.json").read_text()


def labels_text(source: str, labels: Mapping[int, Sequence[str]]) -> str:
    """``labels.json``: ``{"source": ..., "labels": {"291": [names...], ...}}``, one
    dataset a line."""
    rows = ",\n".join(f'    "{k}": {json.dumps(list(v))}' for k, v in labels.items())
    return f'{{\n  "source": {json.dumps(source)},\n  "labels": {{\n{rows}\n  }}\n}}\n'


def plan_all() -> list[str]:
    """``--plan``: the label lists (from TotalSegmentator when installed) and every
    dataset's plans into ``bench/totalseg_plans/``; returns one summary line per dataset."""
    try:
        labels = totalsegmentator_labels()
        from importlib.metadata import version  # noqa: PLC0415

        source = f"TotalSegmentator {version('TotalSegmentator')} map_to_binary"
        lines = [f"labels: from {source}"]
        _write_text(LABELS_FILE, labels_text(source, labels))
    except ImportError:
        labels = load_labels()
        lines = [f"labels: TotalSegmentator not installed, the committed {LABELS_FILE.name}"]
    with tempfile.TemporaryDirectory(prefix="totalseg_plan_") as tmp:
        for standin in standins():
            text = plan_dataset(standin, labels[standin.task_id], Path(tmp))
            _write_text(plans_path(standin.task_id), text if text.endswith("\n") else text + "\n")
            lines.append(describe(standin, json.loads(text)))
    return lines


def describe(standin: Standin, plans: Mapping[str, Any]) -> str:
    """One line: the 3d_fullres network the plans name."""
    config = resolve_configuration(plans, CONFIGURATION)
    kwargs = config["architecture"]["arch_kwargs"]
    return (
        f"{standin.task_id} {standin.folder}: {kwargs['n_stages']} stages, features "
        f"{kwargs['features_per_stage']}, patch {config['patch_size']}, spacing "
        f"{config['spacing']}, batch {config['batch_size']}, reader {plans['image_reader_writer']}"
    )


def main(argv: list[str] | None = None) -> int:
    """Write the stand-in weights (or, with ``--plan``, the committed plans and labels)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="TOTALSEG_HOME_DIR: writes OUT/nnunet/results/...")
    ap.add_argument("--task", default="all", choices=[*STANDIN_TASKS, "all"])
    ap.add_argument("--seed", type=int, default=0, help="network seed: SEED + dataset id")
    ap.add_argument("--small", action="store_true", help="features / 8: for tests, not the shape")
    ap.add_argument("--plan", action="store_true", help="regenerate bench/totalseg_plans/")
    ap.add_argument(
        "--head",
        default="noise",
        choices=HEADS,
        help="noise: random labels; constant: every voxel the first structure (speed only)",
    )
    args = ap.parse_args(argv)
    if args.plan:
        for line in plan_all():
            print(line)
        return 0
    if args.out is None:
        ap.error("--out is required (or --plan)")
    results: Path = args.out / "nnunet" / "results"
    for standin in standins(args.task):
        written = write_standin(results, standin, seed=args.seed, small=args.small, head=args.head)
        print(
            f"{written.model_dir}: {written.parameters:,} parameters, "
            f"{written.bytes / 1e6:.1f} MB, {written.seconds:.1f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
