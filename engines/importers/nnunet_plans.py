"""nnU-Net v2 model folders: read and check them, and turn their plans into a manifest.

Everything here works on parsed JSON and paths; nothing imports torch or nnU-Net. The
mapping from nnU-Net's files to the version-2 manifest is the table in docs/integration.md
(section 8); nnunetv2 2.8.1's own readers are
``nnunetv2/utilities/plans_handling/plans_handler.py`` (configurations and their
``inherits_from``) and ``nnunetv2/utilities/label_handling/label_handling.py``
(``LabelManager``: labels, regions, the ignore label).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from segnode.engines.importers import ModelImportError

CHECKPOINTS = {"final": "checkpoint_final.pth", "best": "checkpoint_best.pth"}

REORIENTING_READERS = ("NibabelIOWithReorient", "SimpleITKIOWithReorient")
"""nnU-Net readers that reorient every image to RAS first: their arrays are ``SAR``."""

DEFAULT_ORIENTATION = "SPL"
"""What a plain nnU-Net model (``SimpleITKIO``, no reorientation) is assumed to have seen:
the array SimpleITK / ITK read from a head-first supine axial CT series, and so the array of
a NIfTI file that an ITK-based converter wrote from it (docs/import.md, "Orientation")."""

RESAMPLING_FN = "resample_data_or_seg_to_shape"
"""The only resampling function the manifest's contract reproduces (nnU-Net's default)."""


@dataclass(frozen=True)
class ModelFolder:
    """A checked nnU-Net v2 trained-model folder.

    Attributes
    ----------
    path
        The folder (``.../DatasetXXX_Name/<Trainer>__<Plans>__<configuration>``).
    plans, dataset, fingerprint
        ``plans.json``, ``dataset.json`` and ``dataset_fingerprint.json`` (``None`` if absent).
    configuration
        The configuration name (``3d_fullres``).
    checkpoints
        ``(fold, path)`` per requested fold, in order; a fold is an int or ``"all"``.
    """

    path: Path
    plans: dict[str, Any]
    dataset: dict[str, Any]
    fingerprint: dict[str, Any] | None
    configuration: str
    checkpoints: tuple[tuple[int | str, Path], ...]


@dataclass(frozen=True)
class OutputLayout:
    """The network's outputs as nnU-Net's ``LabelManager`` sees them.

    Attributes
    ----------
    names
        ``(value, name)`` of every label value 1..N, in order.
    channels
        Number of output channels (``num_segmentation_heads``).
    regions, regions_class_order
        For region-based models, the label values of each channel and the value written
        where its probability exceeds 0.5; ``None`` otherwise.
    """

    names: tuple[tuple[int, str], ...]
    channels: int
    regions: tuple[tuple[int, ...], ...] | None = None
    regions_class_order: tuple[int, ...] | None = None


def parse_fold(raw: str) -> int | str:
    """A fold as nnU-Net names them: a number, or ``all``."""
    if raw == "all":
        return raw
    try:
        fold = int(raw)
    except ValueError:
        raise ModelImportError(f"--folds: {raw!r} is not a fold number or 'all'") from None
    if fold < 0:
        raise ModelImportError(f"--folds: {fold} is negative")
    return fold


def configuration_from_folder_name(folder: Path) -> str | None:
    """The configuration in ``<Trainer>__<Plans>__<configuration>``, if the name has it."""
    parts = folder.name.split("__")
    return parts[2] if len(parts) == 3 and parts[2] else None


def _read_json(path: Path, *, required: bool = True) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelImportError(
                f"{path.parent}: not a complete nnU-Net model folder: {path.name} is missing"
            )
        return None
    return read_json_object(path)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``.

    Raises
    ------
    ModelImportError
        If the file cannot be read, is not JSON or holds no object.
    """
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelImportError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelImportError(f"{path}: expected a JSON object")
    return value


def read_model_folder(
    folder: Path,
    folds: Sequence[int | str],
    checkpoint: str = "final",
    configuration: str | None = None,
) -> ModelFolder:
    """Read and check an nnU-Net v2 trained-model folder.

    Parameters
    ----------
    folder
        ``<results>/DatasetXXX_Name/<Trainer>__<Plans>__<configuration>``.
    folds
        The folds to import.
    checkpoint
        ``"final"`` or ``"best"``.
    configuration
        The configuration; by default the one the folder name ends with, else ``3d_fullres``.

    Raises
    ------
    ModelImportError
        The folder, a JSON file or a fold's checkpoint is missing (every missing checkpoint
        is named), or the configuration is not in the plans.
    """
    if not folder.is_dir():
        raise ModelImportError(f"{folder}: no such model folder")
    if checkpoint not in CHECKPOINTS:
        raise ModelImportError(f"--checkpoint: 'final' or 'best', got {checkpoint!r}")
    if not folds:
        raise ModelImportError("--folds: at least one fold")
    if len(set(folds)) != len(folds):
        raise ModelImportError(f"--folds: a fold is listed twice: {list(folds)}")
    plans = _read_json(folder / "plans.json")
    dataset = _read_json(folder / "dataset.json")
    assert plans is not None and dataset is not None
    fingerprint = _read_json(folder / "dataset_fingerprint.json", required=False)
    name = CHECKPOINTS[checkpoint]
    checkpoints = tuple((f, folder / f"fold_{f}" / name) for f in folds)
    missing = [str(path.relative_to(folder)) for _, path in checkpoints if not path.is_file()]
    if missing:
        have = sorted(str(p.relative_to(folder)) for p in folder.glob("fold_*/checkpoint_*.pth"))
        raise ModelImportError(
            f"{folder}: not a complete nnU-Net model folder: missing {', '.join(missing)}"
            + (f" (present: {', '.join(have)})" if have else " (no checkpoints at all)")
        )
    config = configuration or configuration_from_folder_name(folder) or "3d_fullres"
    configurations = plans.get("configurations")
    if not isinstance(configurations, dict) or config not in configurations:
        known = sorted(configurations) if isinstance(configurations, dict) else []
        raise ModelImportError(
            f"{folder / 'plans.json'}: no configuration {config!r} (plans have {known})"
        )
    return ModelFolder(folder, plans, dataset, fingerprint, config, checkpoints)


def resolve_configuration(plans: dict[str, Any], name: str) -> dict[str, Any]:
    """The configuration ``name`` with its ``inherits_from`` chain applied (as
    ``PlansManager._internal_resolve_configuration_inheritance``)."""
    configurations = plans["configurations"]
    chain: list[str] = []
    while True:
        if name in chain:
            raise ModelImportError(f"plans.json: circular inherits_from: {chain + [name]}")
        if name not in configurations:
            raise ModelImportError(f"plans.json: configuration {name!r} does not exist")
        chain.append(name)
        parent = configurations[name].get("inherits_from")
        if parent is None:
            break
        name = parent
    merged: dict[str, Any] = {}
    for link in reversed(chain):
        merged.update(configurations[link])
    return merged


def output_layout(dataset: dict[str, Any], source: str = "dataset.json") -> OutputLayout:
    """The label values, names and output channels of ``dataset.json`` (``LabelManager``).

    Raises
    ------
    ModelImportError
        No background 0, label values not 1..N, or regions without ``regions_class_order``.
    """
    labels = dataset.get("labels")
    if not isinstance(labels, dict) or labels.get("background") != 0:
        raise ModelImportError(f"{source}: labels must map names to values with background 0")
    entries = [(k, v) for k, v in labels.items() if k not in ("background", "ignore")]
    has_regions = any(isinstance(v, list) and len(v) > 1 for _, v in entries)
    if not has_regions:
        by_value: dict[int, str] = {}
        for key, raw in entries:
            value = int(raw[0] if isinstance(raw, list) else raw)
            if value in by_value:
                raise ModelImportError(
                    f"{source}: labels {by_value[value]!r} and {key!r} share value {value}"
                )
            by_value[value] = key
        values = sorted(by_value)
        if values != list(range(1, len(values) + 1)) or not values:
            raise ModelImportError(f"{source}: label values must be 1..N, got {values}")
        return OutputLayout(tuple((v, by_value[v]) for v in values), channels=len(values) + 1)
    order = dataset.get("regions_class_order")
    regions: list[tuple[int, ...]] = []
    region_names: list[str] = []
    for key, raw in entries:
        region = tuple(int(v) for v in (raw if isinstance(raw, list) else [raw]))
        if set(region) == {0}:
            continue
        regions.append(region)
        region_names.append(key)
    if not isinstance(order, list) or len(order) != len(regions):
        raise ModelImportError(
            f"{source}: a region-based model needs regions_class_order, one value per region "
            f"({len(regions)}), got {order!r}"
        )
    values = sorted({v for r in regions for v in r} | {int(v) for v in order})
    if values != list(range(1, len(values) + 1)):
        raise ModelImportError(f"{source}: region label values must be 1..N, got {values}")
    # the label written for region i is regions_class_order[i]: it takes the region's name
    names = {int(v): region_names[i] for i, v in enumerate(order)}
    return OutputLayout(
        names=tuple((v, names.get(v, f"label_{v}")) for v in values),
        channels=len(regions),
        regions=tuple(regions),
        regions_class_order=tuple(int(v) for v in order),
    )


def default_orientation(plans: dict[str, Any], dataset: dict[str, Any]) -> str:
    """``SAR`` when the model's reader reoriented to RAS, else :data:`DEFAULT_ORIENTATION`."""
    reader = dataset.get("overwrite_image_reader_writer") or plans.get("image_reader_writer")
    return "SAR" if reader in REORIENTING_READERS else DEFAULT_ORIENTATION


def _normalization(config: dict[str, Any], plans: dict[str, Any], where: str) -> dict[str, Any]:
    schemes = config.get("normalization_schemes")
    if not isinstance(schemes, list) or len(schemes) != 1:
        raise ModelImportError(
            f"{where}: normalization_schemes: one input channel (CT) is supported, got {schemes!r}"
        )
    scheme = schemes[0]
    if scheme == "CTNormalization":
        props = plans.get("foreground_intensity_properties_per_channel", {}).get("0")
        keys = ("mean", "std", "percentile_00_5", "percentile_99_5")
        if not isinstance(props, dict) or not all(k in props for k in keys):
            raise ModelImportError(
                f"{where}: foreground_intensity_properties_per_channel['0'] must hold {keys}"
            )
        return {
            "crop_to_nonzero": True,
            "normalization": "ct",
            "intensity": {k: float(props[k]) for k in keys},
        }
    if scheme == "NoNormalization":
        return {"crop_to_nonzero": True, "normalization": "linear", "scale": 1.0, "offset": 0.0}
    raise ModelImportError(
        f"{where}: normalization scheme {scheme!r} is not supported (CTNormalization or "
        "NoNormalization; ZScoreNormalization depends on each image's own statistics, which the "
        "manifest cannot express yet)"
    )


def _resampling(config: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("resampling_fn_data", "resampling_fn_probabilities"):
        fn = config.get(key, RESAMPLING_FN)
        if fn != RESAMPLING_FN:
            raise ModelImportError(
                f"{where}: {key}: {fn!r} is not supported (only nnU-Net's default {RESAMPLING_FN})"
            )
    data = config.get("resampling_fn_data_kwargs", {})
    probs = config.get("resampling_fn_probabilities_kwargs", {})
    for key, default in (("order_z", 0), ("force_separate_z", None)):
        if data.get(key, default) != probs.get(key, default):
            raise ModelImportError(
                f"{where}: {key} differs between resampling_fn_data_kwargs "
                f"({data.get(key, default)!r}) and resampling_fn_probabilities_kwargs "
                f"({probs.get(key, default)!r}); the manifest has one value"
            )
    return {
        "data_order": int(data.get("order", 3)),
        "logits_order": int(probs.get("order", 1)),
        "order_z": int(data.get("order_z", 0)),
        "anisotropy_threshold": 3.0,
        "force_separate_z": data.get("force_separate_z"),
    }


def manifest_dict(
    plans: dict[str, Any],
    dataset: dict[str, Any],
    configuration: str,
    *,
    name: str,
    version: str,
    folds: Sequence[str],
    labels: list[dict[str, Any]],
    mirror_axes: Sequence[int] | None,
    orientation: str,
    overlap: float = 0.5,
    resampling: dict[str, Any] | None = None,
    spacing: Sequence[float] | None = None,
) -> dict[str, Any]:
    """The version-2 manifest of an nnU-Net model (docs/integration.md, section 8).

    Parameters
    ----------
    plans, dataset
        ``plans.json`` and ``dataset.json``.
    configuration
        The configuration to describe (``3d_fullres``).
    name, version
        The manifest's name and version.
    folds
        The ONNX file names, one per fold.
    labels
        The ``labels`` entries (:func:`segnode.engines.importers.labels.label_entries`).
    mirror_axes
        The checkpoint's ``inference_allowed_mirroring_axes`` (``None``: no mirroring).
    orientation
        The orientation code of the arrays the model was trained on (or ``"source"``).
    overlap
        ``1 - tile_step_size`` (nnU-Net 0.5; TotalSegmentator 0.2).
    resampling
        Keys that replace the plans' resampling (the TotalSegmentator profile).
    spacing
        A target spacing replacing the configuration's (must agree; the profile's check).

    Raises
    ------
    ModelImportError
        A 2-D, cascade or multi-channel configuration, an unsupported normalisation or
        resampling function.
    """
    where = f"plans.json: configurations[{configuration!r}]"
    config = resolve_configuration(plans, configuration)
    patch = [int(v) for v in config.get("patch_size", [])]
    if len(patch) != 3:
        raise ModelImportError(f"{where}: patch_size {patch}: only 3-D configurations import")
    if config.get("previous_stage"):
        raise ModelImportError(f"{where}: a cascade stage (previous_stage) cannot be imported")
    channels = dataset.get("channel_names", dataset.get("modality", {}))
    if len(channels) != 1:
        raise ModelImportError(f"dataset.json: channel_names: one channel (CT), got {channels!r}")
    forward = [int(v) for v in plans.get("transpose_forward", [0, 1, 2])]
    backward = [int(v) for v in plans.get("transpose_backward", [0, 1, 2])]
    res = _resampling(config, where)
    res.update(resampling or {})
    layout = output_layout(dataset)
    manifest: dict[str, Any] = {
        "manifest_version": 2,
        "name": name,
        "version": version,
        "folds": list(folds),
        "input_name": "input",
        "output_name": "logits",
        "output_kind": "logits",
        "patch_size": patch,
        "overlap": overlap,
        "sigma_scale": 0.125,
        "mirror_axes": sorted(int(a) for a in (mirror_axes or ())),
        "batch": {"min": 1, "opt": 2, "max": 4},
        "fp16": True,
        "geometry": {
            "spacing": [float(v) for v in (spacing or config["spacing"])],
            "orientation": orientation,
            "transpose_forward": forward,
            "transpose_backward": backward,
            "gantry_tilt_allowed": False,
        },
        "preprocessing": _normalization(config, plans, where),
        "resampling": res,
        "labels": labels,
    }
    if layout.regions is not None and layout.regions_class_order is not None:
        manifest["regions"] = [list(r) for r in layout.regions]
        manifest["regions_class_order"] = list(layout.regions_class_order)
    return manifest


def merge_label_spaces(
    parts: Sequence[tuple[str, Sequence[tuple[int, str]]]],
) -> tuple[dict[str, dict[str, int]], list[tuple[int, str]]]:
    """One label space over several models, as TotalSegmentator merges its parts.

    Every part's labels are numbered on after the previous parts' in part order (this is
    TotalSegmentator's ``class_map["total"]``, which is ``class_map_5_parts`` concatenated);
    a name a part repeats keeps its first number. At run time the parts are applied in this
    order and a later part's non-background voxels overwrite (``nnunet.py``: ``np.copyto(...,
    where=mapped_seg != 0)``).

    Parameters
    ----------
    parts
        ``(part key, [(value, name), ...])`` in merge order.

    Returns
    -------
    tuple
        ``(maps, merged)``: per part key, its label value (string) to the merged value; and
        the merged ``(value, name)`` list, values 1..N.
    """
    merged: list[tuple[int, str]] = []
    by_name: dict[str, int] = {}
    maps: dict[str, dict[str, int]] = {}
    for key, names in parts:
        mapping: dict[str, int] = {}
        for value, name in names:
            if name not in by_name:
                by_name[name] = len(merged) + 1
                merged.append((by_name[name], name))
            mapping[str(value)] = by_name[name]
        maps[key] = mapping
    return maps, merged
