"""``segnode model import totalsegmentator``: TotalSegmentator's weights as a composite model.

TotalSegmentator (wasserth/TotalSegmentator 2.x) runs its ``total`` task as five nnU-Net v2
datasets, 291-295 (``map_tasks_config.py``: ``TASK_CONFIGS["total"]``, trainer
``nnUNetTrainerNoMirroring``, ``3d_fullres``, fold 0, resample 1.5 mm), whose label maps
are merged in that order into one label space (``nnunet.py``, ``class_map_5_parts`` mapped
to ``class_map["total"]``, later parts overwriting). Its pipeline is
``as_closest_canonical`` (RAS: orientation ``SAR`` here), ``change_spacing`` to 1.5 mm with
order 1, nnU-Net with ``step_size=0.8`` (overlap 0.2) and no test-time mirroring, and the
label map back to the original grid with order 0. The profile writes each dataset as a
normal version-2 part (``part_<id>/model.json``) with those settings, and a composite
manifest ``<name>.json`` over them (:mod:`segnode.engines.manifest`, "composite").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from segnode.engines.base import EngineError
from segnode.engines.importers import ModelImportError
from segnode.engines.importers.labels import LabelCodes, label_entries
from segnode.engines.importers.nnunet import ImportReport, import_nnunet, write_json
from segnode.engines.importers.nnunet_plans import (
    merge_label_spaces,
    output_layout,
    read_json_object,
    resolve_configuration,
)


@dataclass(frozen=True)
class TaskProfile:
    """How TotalSegmentator runs one task."""

    datasets: tuple[tuple[int, str], ...]
    """``(task id, folder name)`` in merge order (``download_pretrained_weights``)."""
    trainer_folder: str
    spacing: float
    overlap: float
    folds: tuple[int, ...] = (0,)


TASKS = {
    "total": TaskProfile(
        datasets=(
            (291, "Dataset291_TotalSegmentator_part1_organs_1559subj"),
            (292, "Dataset292_TotalSegmentator_part2_vertebrae_1532subj"),
            (293, "Dataset293_TotalSegmentator_part3_cardiac_1559subj"),
            (294, "Dataset294_TotalSegmentator_part4_muscles_1559subj"),
            (295, "Dataset295_TotalSegmentator_part5_ribs_1559subj"),
        ),
        trainer_folder="nnUNetTrainerNoMirroring__nnUNetPlans__3d_fullres",
        spacing=1.5,
        overlap=0.2,  # TotalSegmentator's step_size 0.8 for the total tasks
    ),
    # TASK_CONFIGS["total"]["sub_modes"]: --fast and --fastest, one dataset each of all 117
    # structures, the same pipeline (step 0.8 "for every resolution variant of the total
    # CT and MR models, including fast and fastest modes", nnunet.py)
    "total_fast": TaskProfile(
        datasets=((297, "Dataset297_TotalSegmentator_total_3mm_1559subj"),),
        trainer_folder="nnUNetTrainer_4000epochs_NoMirroring__nnUNetPlans__3d_fullres",
        spacing=3.0,
        overlap=0.2,
    ),
    "total_fastest": TaskProfile(
        datasets=((298, "Dataset298_TotalSegmentator_total_6mm_1559subj"),),
        trainer_folder="nnUNetTrainer_4000epochs_NoMirroring__nnUNetPlans__3d_fullres",
        spacing=6.0,
        overlap=0.2,
    ),
}

_FLAGS = {"total": "", "total_fast": " --fast", "total_fastest": " --fastest"}


def totalsegmentator_task(folder: Path) -> tuple[str, int] | None:
    """``(task, dataset id)`` when ``folder`` (a trained-model folder, or its dataset folder)
    is one of TotalSegmentator's datasets by name (``Dataset297_TotalSegmentator_...``)."""
    for path in (folder, folder.parent):
        for task, profile in TASKS.items():
            for task_id, folder_name in profile.datasets:
                if path.name == folder_name or (
                    path.name.startswith(f"Dataset{task_id}_") and "TotalSegmentator" in path.name
                ):
                    return task, task_id
    return None


def profile_advice(folder: Path) -> str | None:
    """What to run instead of a plain nnU-Net import of one of TotalSegmentator's datasets
    (``None`` for any other folder)."""
    found = totalsegmentator_task(folder)
    if found is None:
        return None
    task, task_id = found
    profile = TASKS[task]
    weights = folder.parent.parent if folder.parent.name.startswith("Dataset") else folder.parent
    return (
        f"{folder} is TotalSegmentator's Dataset{task_id} (TotalSegmentator "
        f"--task total{_FLAGS[task]}); import it with its own settings (orientation SAR, "
        f"overlap {profile.overlap}, no mirroring, order 1 to {profile.spacing} mm and the "
        f"labels back at order 0, as TotalSegmentator runs it): segnode model import "
        f"totalsegmentator {weights} --task {task}. A plain nnU-Net import uses nnU-Net's "
        f"defaults instead (overlap 0.5, order-1 logits of every label back on the source "
        f"grid: slower, other labels); --as-nnunet imports it so all the same"
    )


PROFILE_RESAMPLING = {
    # change_spacing(..., order=1) before nnU-Net: scipy.ndimage.zoom (corner-aligned), one
    # 3-D pass at order 1, the image truncated to int32; nnU-Net then runs at the spacing
    # it was trained on; the label map goes back with change_spacing(order=0)
    "scheme": "totalsegmentator",
    "data_order": 1,
    "order_z": 0,
    "force_separate_z": False,
    "logits_order": 0,
}


def find_dataset(weights_dir: Path, task_id: int, folder_name: str, trainer_folder: str) -> Path:
    """The trained-model folder of dataset ``task_id`` under TotalSegmentator's weights.

    ``weights_dir`` is the folder holding ``Dataset291_...`` (TotalSegmentator's
    ``~/.totalsegmentator/nnunet/results``); that folder itself, or a parent holding
    ``nnunet/results``, is accepted too.

    Raises
    ------
    ModelImportError
        The dataset or its trainer folder is missing.
    """
    roots = [weights_dir, weights_dir / "nnunet" / "results"]
    for root in roots:
        candidates = sorted(root.glob(f"Dataset{task_id}_*")) if root.is_dir() else []
        if candidates:
            preferred = [c for c in candidates if c.name == folder_name]
            dataset = (preferred or candidates)[0]
            model = dataset / trainer_folder
            if not model.is_dir():
                raise ModelImportError(
                    f"{dataset}: no {trainer_folder} (TotalSegmentator's trained model folder)"
                )
            return model
    raise ModelImportError(
        f"{weights_dir}: no Dataset{task_id}_* folder (TotalSegmentator names it {folder_name}; "
        "download the weights with totalseg_download_weights -t total)"
    )


def import_totalsegmentator(
    weights_dir: Path,
    out_dir: Path,
    name: str = "total",
    *,
    task: str = "total",
    codes: Mapping[str, LabelCodes] | None = None,
    codes_source: str = "labels CSV",
    allow_generic: bool = False,
    version: str = "1.0.0",
    task_profile: TaskProfile | None = None,
) -> tuple[list[ImportReport], dict[str, Any], Path, list[str]]:
    """Import TotalSegmentator's datasets of ``task`` and write the composite manifest.

    ``task_profile`` replaces ``TASKS[task]`` (tests use fewer, smaller datasets).

    Returns
    -------
    tuple
        ``(part reports, composite manifest, its path, notes)``; the notes say how the
        composite was checked.

    Raises
    ------
    ModelImportError
        A dataset is missing or incomplete, its plans' spacing is not the profile's, or any
        part fails to import.
    """
    if task_profile is None and task not in TASKS:
        raise ModelImportError(f"--task: {task!r} is not supported (supported: {sorted(TASKS)})")
    profile = task_profile or TASKS[task]
    folders = [
        (task_id, find_dataset(weights_dir, task_id, folder_name, profile.trainer_folder))
        for task_id, folder_name in profile.datasets
    ]
    # every dataset is found and its labels read before the first (slow) export
    part_names: list[tuple[str, list[tuple[int, str]]]] = []
    for task_id, folder in folders:
        dataset = read_json_object(folder / "dataset.json")
        plans = read_json_object(folder / "plans.json")
        spacing = resolve_configuration(plans, "3d_fullres").get("spacing")
        if spacing is None or any(abs(float(s) - profile.spacing) > 1e-6 for s in spacing):
            raise ModelImportError(
                f"{folder / 'plans.json'}: spacing {spacing}, but TotalSegmentator resamples "
                f"to {profile.spacing} mm for task {task}; this is not the {task} model"
            )
        layout = output_layout(dataset, str(folder / "dataset.json"))
        part_names.append((f"part_{task_id}", list(layout.names)))
    maps, merged = merge_label_spaces(part_names)

    reports: list[ImportReport] = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for task_id, folder in folders:
        reports.append(
            import_nnunet(
                folder,
                out_dir / f"part_{task_id}",
                f"{name}_part_{task_id}",
                folds=profile.folds,
                configuration="3d_fullres",
                codes=codes,
                codes_source=codes_source,
                allow_generic=allow_generic,
                orientation="SAR",
                version=version,
                manifest_filename="model.json",
                overlap=profile.overlap,
                mirror=False,
                resampling=dict(PROFILE_RESAMPLING),
                spacing=[profile.spacing] * 3,
                profile=f"totalsegmentator:{task}",
            )
        )
    labels, _ = label_entries(merged, codes, allow_generic=True, source=codes_source)
    composite = {
        "manifest_version": 2,
        "name": name,
        "version": version,
        "parts": [
            {"manifest": f"part_{task_id}/model.json", "labels": maps[f"part_{task_id}"]}
            for task_id, _ in folders
        ],
        "labels": labels,
    }
    path = out_dir / f"{name}.json"
    write_json(path, composite)
    notes = check_composite(path)
    return reports, composite, path, notes


def check_composite_json(path: Path) -> None:
    """The composite's structure, checked on the JSON: every part manifest exists, its map
    covers exactly the part's labels, and the merged labels are 1..N, each reached.

    Raises
    ------
    ModelImportError
        Naming the part and the key.
    """
    raw = read_json_object(path)
    labels = raw.get("labels")
    if not isinstance(labels, list) or [e.get("value") for e in labels] != list(
        range(1, len(labels) + 1)
    ):
        raise ModelImportError(f"{path}: labels: values must be 1..N")
    reached: set[int] = set()
    for i, part in enumerate(raw.get("parts") or []):
        part_path = path.parent / part["manifest"]
        part_raw = read_json_object(part_path)
        values = {str(e["value"]) for e in part_raw["labels"]}
        if set(part["labels"]) != values:
            raise ModelImportError(
                f"{path}: parts[{i}].labels: keys {sorted(part['labels'])} are not the labels "
                f"of {part_path} ({sorted(values)})"
            )
        reached |= set(part["labels"].values())
    if reached != set(range(1, len(labels) + 1)):
        raise ModelImportError(f"{path}: some merged labels come from no part")


def check_composite(path: Path) -> list[str]:
    """Check the composite on its JSON, then with
    :func:`segnode.engines.manifest_parse.load_manifest` when the node's loader reads
    composite manifests (``ModelManifest.parts``).

    Returns
    -------
    list of str
        Notes for the report (which checks ran).

    Raises
    ------
    ModelImportError
        A check failed.
    """
    from segnode.engines.manifest import ModelManifest
    from segnode.engines.manifest_parse import load_manifest

    check_composite_json(path)
    if "parts" not in {f.name for f in dataclasses.fields(ModelManifest)}:
        return [f"{path.name}: checked on its JSON (this release's loader reads no composites)"]
    try:
        manifest = load_manifest(path)
    except EngineError as exc:
        raise ModelImportError(f"the composite manifest written does not load: {exc}") from exc
    return [f"{path.name}: loads: {len(manifest.labels)} labels from {len(manifest.parts)} parts"]
