"""Reading a model manifest file: its JSON checked key by key into a ``ModelManifest``.

:func:`load_manifest` reads a version-1 or version-2 manifest, or a composite and each of
its parts; every refusal is a :class:`~segnode.engines.manifest.ManifestError` that names
the file and the key. The format is described in :mod:`segnode.engines.manifest` and in
docs/integration.md ("Model contract v2").

This module builds the types of :mod:`segnode.engines.manifest` and defines none of its
own: what a field means, what a manifest computes from its fields and which manifests the
node can run (:func:`~segnode.engines.manifest.check_runnable`) stay there. It reads the
manifest files only, never a model file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from segnode.engines.manifest import (
    RESAMPLING_SCHEMES,
    Code,
    CompositePart,
    LabelSpec,
    ManifestError,
    ModelContract,
    ModelManifest,
)
from segnode.engines.preprocess.intensity import CTNormalization, LinearNormalization, Normalization
from segnode.engines.preprocess.orientation import SOURCE, check_orientation_code
from segnode.engines.preprocess.resampling import ANISO_THRESHOLD, ORDERS

MANIFEST_VERSIONS = (1, 2)


def _code(raw: Any, where: str) -> Code:
    ok = isinstance(raw, list | tuple) and len(raw) == 3
    if not (ok and all(isinstance(x, str) for x in raw)):
        raise ManifestError(f"{where}: expected [value, scheme, meaning], got {raw!r}")
    return (raw[0], raw[1], raw[2])


def _overlap(raw: Any, where: Path) -> float | tuple[float, float, float]:
    """A number, or ``[z, y, x]``, each in ``[0, 1)``."""
    if isinstance(raw, list) and len(raw) == 3:
        values = [float(v) for v in raw]
    elif isinstance(raw, int | float) and not isinstance(raw, bool):
        values = [float(raw)]
    else:
        raise ManifestError(f"{where}: overlap must be a number or [z, y, x], got {raw!r}")
    if not all(0.0 <= v < 1.0 for v in values):
        raise ManifestError(f"{where}: overlap must be in [0, 1)")
    return values[0] if len(values) == 1 else (values[0], values[1], values[2])


def load_manifest(path: str | Path) -> ModelManifest:
    """Read and validate a model manifest (version 1 or 2).

    Parameters
    ----------
    path
        The manifest JSON file, or the ONNX file (``.json`` beside it is read).

    Raises
    ------
    ManifestError
        The file cannot be read or a field is missing or invalid; the message names the file
        and the field.
    """
    p = Path(path)
    if p.suffix == ".onnx":
        p = p.with_suffix(".json")
    return _from_raw(_read(p), p)


def _read(p: Path) -> dict[str, Any]:
    """The manifest file's JSON object."""
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ManifestError(f"cannot read model manifest {p}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ManifestError(f"{p}: a manifest is a JSON object, got {type(raw).__name__}")
    return raw


def _from_raw(raw: dict[str, Any], p: Path) -> ModelManifest:
    """:func:`load_manifest` once the file is read."""
    version = raw.get("manifest_version", 1)
    if version not in MANIFEST_VERSIONS or isinstance(version, bool):
        raise ManifestError(f"{p}: manifest_version: unsupported {version!r} (supported: 1, 2)")
    if "parts" in raw:
        if version != 2:
            raise ManifestError(f"{p}: parts: a composite model needs manifest_version 2")
        return _composite(raw, p)
    try:
        labels = _labels(raw, p)
        patch = tuple(int(v) for v in raw["patch_size"])
        if len(patch) != 3 or min(patch) < 1:
            raise ManifestError(f"{p}: patch_size must be three positive integers")
        overlap = _overlap(raw.get("overlap", 0.5), p)
        batch = raw.get("batch", {})
        pre = raw.get("preprocessing", {})
        clip = pre.get("clip")
        contract: ModelContract | None = None
        folds: tuple[Path, ...] = ()
        precision: str = "fp32"
        int8_folds: tuple[Path, ...] = ()
        tensorrt_folds: tuple[Path, ...] = ()
        calibration: dict[str, Any] = {}
        if version == 2:
            folds = _folds(raw, p)
            precision, int8_folds, tensorrt_folds, calibration = _precision(raw, p, len(folds))
            contract = _contract(raw, p, len(labels))
            onnx_path = folds[0]
            if isinstance(contract.normalization, LinearNormalization):
                clip = contract.normalization.clip
        else:
            onnx_path = (p.parent / raw.get("onnx", p.with_suffix(".onnx").name)).resolve()
        return ModelManifest(
            name=str(raw["name"]),
            version=str(raw["version"]),
            onnx_path=onnx_path,
            labels=labels,
            patch_size=(patch[0], patch[1], patch[2]),
            overlap=overlap,
            input_name=str(raw.get("input_name", "input")),
            output_name=str(raw.get("output_name", "output")),
            output_kind=str(raw.get("output_kind", "logits")),
            batch_min=int(batch.get("min", 1)),
            batch_opt=int(batch.get("opt", 1)),
            batch_max=int(batch.get("max", 1)),
            fp16=bool(raw.get("fp16", False)),
            clip=(float(clip[0]), float(clip[1])) if clip else None,
            scale=float(pre.get("scale", 1.0)),
            offset=float(pre.get("offset", 0.0)),
            extra={k: v for k, v in raw.items() if k not in _KNOWN[version]},
            manifest_version=int(version),
            fold_paths=folds,
            contract=contract,
            precision=precision,
            int8_fold_paths=int8_folds,
            int8_tensorrt_fold_paths=tensorrt_folds,
            calibration=calibration,
        )
    except ManifestError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{p}: invalid manifest: {exc!r}") from exc


_OPTIONAL_CODES = ("modifier", "anatomic_region", "anatomic_region_modifier")
"""Optional codes of a label entry (:class:`~segnode.engines.manifest.LabelSpec`)."""


def _labels(raw: dict[str, Any], p: Path) -> tuple[LabelSpec, ...]:
    """The ``labels`` list, values 1..N in order (KeyError/TypeError/ValueError on a
    malformed entry: the caller names the file)."""
    labels = tuple(
        LabelSpec(
            value=int(item["value"]),
            name=str(item["name"]),
            category=_code(item["category"], f"{p}: labels[{i}].category"),
            type=_code(item["type"], f"{p}: labels[{i}].type"),
            color=tuple(int(c) for c in item.get("color", (255, 0, 0))),  # type: ignore[arg-type]
            **{
                key: _code(item[key], f"{p}: labels[{i}].{key}")
                for key in _OPTIONAL_CODES
                if item.get(key) is not None
            },
        )
        for i, item in enumerate(raw["labels"])
    )
    values = [lab.value for lab in labels]
    if values != list(range(1, len(labels) + 1)):
        raise ManifestError(f"{p}: label values must be 1..N in order, got {values}")
    return labels


# ------------------------------------------------------------------------------ version 2


def _folds(raw: dict[str, Any], p: Path) -> tuple[Path, ...]:
    names = raw.get("folds")
    if "onnx" in raw:
        raise ManifestError(f"{p}: onnx: version 2 lists the model files under 'folds'")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ManifestError(f"{p}: folds: a non-empty list of ONNX file names, got {names!r}")
    paths = tuple((p.parent / n).resolve() for n in names)
    if len(set(paths)) != len(paths):
        raise ManifestError(f"{p}: folds: a file is listed twice: {names}")
    for i, path in enumerate(paths):
        if not path.is_file():
            raise ManifestError(f"{p}: folds[{i}]: no such file {path}")
    return paths


PRECISIONS = ("fp32", "int8", "bf16")
"""Values of a version-2 manifest's ``"precision"``."""


def _precision(
    raw: dict[str, Any], p: Path, folds: int
) -> tuple[str, tuple[Path, ...], tuple[Path, ...], dict[str, Any]]:
    """``"precision"`` (default fp32), the INT8 fold files of an ``"int8"`` model (its
    ``"calibration"`` section's ``"int8_folds"``, one per fold, present), those in TensorRT's
    form (``"int8_tensorrt_folds"``, optional) and the section."""
    precision = raw.get("precision", "fp32")
    if precision not in PRECISIONS:
        raise ManifestError(f"{p}: precision: one of {', '.join(PRECISIONS)}, got {precision!r}")
    calibration = raw.get("calibration", {})
    if not isinstance(calibration, dict):
        raise ManifestError(f"{p}: calibration: an object, got {calibration!r}")
    if precision != "int8":
        return precision, (), (), calibration
    int8 = _int8_files(calibration, "int8_folds", p, folds)
    tensorrt: tuple[Path, ...] = ()
    if calibration.get("int8_tensorrt_folds"):
        tensorrt = _int8_files(calibration, "int8_tensorrt_folds", p, folds)
    return precision, int8, tensorrt, calibration


def _int8_files(calibration: dict[str, Any], key: str, p: Path, folds: int) -> tuple[Path, ...]:
    """The files of ``calibration[key]``: one per fold, each present."""
    names = calibration.get(key)
    if (
        not isinstance(names, list)
        or len(names) != folds
        or not all(isinstance(n, str) for n in names)
    ):
        raise ManifestError(
            f"{p}: calibration.{key}: one INT8 ONNX file name per fold ({folds}) for "
            f"precision int8, got {names!r} (run segnode model calibrate again)"
        )
    paths = tuple((p.parent / n).resolve() for n in names)
    for i, path in enumerate(paths):
        if not path.is_file():
            raise ManifestError(
                f"{p}: calibration.{key}[{i}]: no such file {path} "
                "(run segnode model calibrate again, or set precision to fp32)"
            )
    return paths


def _section(raw: dict[str, Any], key: str, p: Path) -> dict[str, Any]:
    value = raw.get(key)
    if not isinstance(value, dict):
        raise ManifestError(f"{p}: {key}: required object for manifest_version 2, got {value!r}")
    return value


def _number(value: Any, where: str, *, positive: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(float(value)) or (positive and not float(value) > 0.0):
        kind = "a positive number" if positive else "a finite number"
        raise ManifestError(f"{where}: must be {kind}, got {value!r}")
    return float(value)


def _permutation(value: Any, where: str) -> tuple[int, int, int]:
    if not isinstance(value, list) or sorted(value) != [0, 1, 2]:
        raise ManifestError(f"{where}: must be a permutation of [0, 1, 2], got {value!r}")
    return (int(value[0]), int(value[1]), int(value[2]))


def _order(value: Any, where: str, allowed: tuple[int, ...]) -> int:
    if isinstance(value, bool) or value not in allowed:
        raise ManifestError(f"{where}: must be one of {list(allowed)}, got {value!r}")
    return int(value)


def _contract(raw: dict[str, Any], p: Path, num_labels: int) -> ModelContract:
    geo = _section(raw, "geometry", p)
    spacing_raw = geo.get("spacing")
    if not isinstance(spacing_raw, list) or len(spacing_raw) != 3:
        raise ManifestError(f"{p}: geometry.spacing: three numbers in mm, got {spacing_raw!r}")
    spacing = tuple(
        _number(v, f"{p}: geometry.spacing[{i}]", positive=True) for i, v in enumerate(spacing_raw)
    )
    orientation = geo.get("orientation", SOURCE)
    if orientation != SOURCE:
        try:
            orientation = check_orientation_code(str(orientation))
        except ValueError as exc:
            raise ManifestError(f"{p}: geometry.orientation: {exc} (or 'source')") from exc
    forward = _permutation(
        geo.get("transpose_forward", [0, 1, 2]), f"{p}: geometry.transpose_forward"
    )
    backward = _permutation(
        geo.get("transpose_backward", [0, 1, 2]), f"{p}: geometry.transpose_backward"
    )
    if tuple(forward[b] for b in backward) != (0, 1, 2):
        raise ManifestError(
            f"{p}: geometry.transpose_backward: {list(backward)} does not undo "
            f"transpose_forward {list(forward)}"
        )
    tilt = geo.get("gantry_tilt_allowed", False)
    if not isinstance(tilt, bool):
        raise ManifestError(f"{p}: geometry.gantry_tilt_allowed: must be true or false")

    pre = _section(raw, "preprocessing", p)
    crop = pre.get("crop_to_nonzero", False)
    if not isinstance(crop, bool):
        raise ManifestError(f"{p}: preprocessing.crop_to_nonzero: must be true or false")
    normalization = _normalization(pre, p)

    res = raw.get("resampling", {})
    if not isinstance(res, dict):
        raise ManifestError(f"{p}: resampling: must be an object, got {res!r}")
    force = res.get("force_separate_z")
    if force is not None and not isinstance(force, bool):
        raise ManifestError(f"{p}: resampling.force_separate_z: true, false or null")
    scheme = res.get("scheme", "nnunet")
    if scheme not in RESAMPLING_SCHEMES:
        raise ManifestError(
            f"{p}: resampling.scheme: one of {', '.join(RESAMPLING_SCHEMES)}, got {scheme!r}"
        )
    if scheme == "totalsegmentator" and res.get("data_order", 3) not in (0, 1):
        raise ManifestError(
            f"{p}: resampling.data_order: the totalsegmentator scheme resamples with order 0 "
            f"or 1, got {res.get('data_order', 3)!r}"
        )

    sigma = _number(raw.get("sigma_scale", 0.125), f"{p}: sigma_scale", positive=True)
    mirror = raw.get("mirror_axes", [])
    if (
        not isinstance(mirror, list)
        or not all(isinstance(a, int) and not isinstance(a, bool) and 0 <= a <= 2 for a in mirror)
        or len(set(mirror)) != len(mirror)
    ):
        raise ManifestError(f"{p}: mirror_axes: distinct axes among 0, 1, 2, got {mirror!r}")

    regions, class_order = _regions(raw, p, num_labels)
    if regions is not None and raw.get("output_kind", "logits") == "labels":
        raise ManifestError(
            f"{p}: output_kind: a region-based model returns logits or probabilities"
        )
    return ModelContract(
        spacing=(spacing[0], spacing[1], spacing[2]),
        orientation=orientation,
        transpose_forward=forward,
        transpose_backward=backward,
        gantry_tilt_allowed=tilt,
        crop_to_nonzero=crop,
        normalization=normalization,
        data_order=_order(res.get("data_order", 3), f"{p}: resampling.data_order", ORDERS),
        logits_order=_order(res.get("logits_order", 1), f"{p}: resampling.logits_order", ORDERS),
        order_z=_order(res.get("order_z", 0), f"{p}: resampling.order_z", (0, 1)),
        anisotropy_threshold=_number(
            res.get("anisotropy_threshold", ANISO_THRESHOLD),
            f"{p}: resampling.anisotropy_threshold",
            positive=True,
        ),
        force_separate_z=force,
        scheme=str(scheme),
        sigma_scale=sigma,
        mirror_axes=tuple(int(a) for a in mirror),
        regions=regions,
        regions_class_order=class_order,
    )


def _normalization(pre: dict[str, Any], p: Path) -> Normalization:
    scheme = pre.get("normalization")
    if scheme == "ct":
        props = pre.get("intensity")
        if not isinstance(props, dict):
            raise ManifestError(
                f"{p}: preprocessing.intensity: required for 'ct' normalization (mean, std, "
                "percentile_00_5, percentile_99_5 of the training foreground)"
            )
        values = {
            key: _number(props.get(key), f"{p}: preprocessing.intensity.{key}")
            for key in ("mean", "std", "percentile_00_5", "percentile_99_5")
        }
        if values["std"] < 0.0:
            raise ManifestError(f"{p}: preprocessing.intensity.std: must not be negative")
        if values["percentile_00_5"] > values["percentile_99_5"]:
            raise ManifestError(
                f"{p}: preprocessing.intensity: percentile_00_5 exceeds percentile_99_5"
            )
        return CTNormalization(
            mean=values["mean"],
            std=values["std"],
            lower=values["percentile_00_5"],
            upper=values["percentile_99_5"],
        )
    if scheme == "linear":
        clip = pre.get("clip")
        if clip is not None:
            if not isinstance(clip, list) or len(clip) != 2:
                raise ManifestError(f"{p}: preprocessing.clip: [low, high] in HU, got {clip!r}")
            low = _number(clip[0], f"{p}: preprocessing.clip[0]")
            high = _number(clip[1], f"{p}: preprocessing.clip[1]")
            if low > high:
                raise ManifestError(f"{p}: preprocessing.clip: low {low} exceeds high {high}")
        return LinearNormalization(
            clip=(low, high) if clip is not None else None,
            scale=_number(pre.get("scale", 1.0), f"{p}: preprocessing.scale"),
            offset=_number(pre.get("offset", 0.0), f"{p}: preprocessing.offset"),
        )
    raise ManifestError(f"{p}: preprocessing.normalization: 'ct' or 'linear', got {scheme!r}")


def _regions(
    raw: dict[str, Any], p: Path, num_labels: int
) -> tuple[tuple[tuple[int, ...], ...] | None, tuple[int, ...] | None]:
    regions = raw.get("regions")
    order = raw.get("regions_class_order")
    if regions is None and order is None:
        return None, None
    if regions is None or order is None:
        raise ManifestError(f"{p}: regions and regions_class_order go together")
    valid = set(range(1, num_labels + 1))
    if not isinstance(regions, list) or not regions:
        raise ManifestError(f"{p}: regions: a non-empty list of label lists, got {regions!r}")
    for i, region in enumerate(regions):
        if not isinstance(region, list) or not region or not set(region) <= valid:
            raise ManifestError(
                f"{p}: regions[{i}]: a non-empty list of label values 1..{num_labels}, "
                f"got {region!r}"
            )
    if not isinstance(order, list) or len(order) != len(regions) or not set(order) <= valid:
        raise ManifestError(
            f"{p}: regions_class_order: one label value (1..{num_labels}) per region, got {order!r}"
        )
    return tuple(tuple(int(v) for v in r) for r in regions), tuple(int(v) for v in order)


# ------------------------------------------------------------------------------ composite

_COMPOSITE_KEYS = {"manifest_version", "name", "version", "parts", "labels"}
_NOT_IN_COMPOSITE = (
    "folds",
    "onnx",
    "geometry",
    "preprocessing",
    "resampling",
    "patch_size",
    "regions",
    "regions_class_order",
)


def _composite(raw: dict[str, Any], p: Path) -> ModelManifest:
    """A composite manifest: each part a version-2 model, labels merged in order."""
    for key in _NOT_IN_COMPOSITE:
        if key in raw:
            raise ManifestError(
                f"{p}: {key}: a composite model (parts) has none of its own; each part's "
                "manifest has its own"
            )
    try:
        labels = _labels(raw, p)
        name, version = str(raw["name"]), str(raw["version"])
    except ManifestError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ManifestError(f"{p}: invalid manifest: {exc!r}") from exc
    entries = raw["parts"]
    if not isinstance(entries, list) or not entries:
        raise ManifestError(
            f"{p}: parts: a non-empty list of {{manifest, labels}}, got {entries!r}"
        )
    merged_values = {lab.value for lab in labels}
    parts: list[CompositePart] = []
    for i, entry in enumerate(entries):
        where = f"{p}: parts[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("manifest"), str):
            raise ManifestError(f"{where}.manifest: a manifest path is required, got {entry!r}")
        unknown = sorted(set(entry) - {"manifest", "labels"})
        if unknown:
            raise ManifestError(f"{where}: unknown keys {unknown} (manifest, labels)")
        path = (p.parent / entry["manifest"]).resolve()
        if not path.is_file():
            raise ManifestError(f"{where}.manifest: no such file {path}")
        part_raw = _read(path)
        if "parts" in part_raw:  # refused before it is read: it could name this file again
            raise ManifestError(
                f"{where}.manifest: {path} is a composite; parts are version-2 trained models"
            )
        part = _from_raw(part_raw, path)
        if part.manifest_version != 2:
            raise ManifestError(
                f"{where}.manifest: {path} is a version-{part.manifest_version} manifest; "
                "parts are version-2 trained models"
            )
        mapping = entry.get("labels")
        if not isinstance(mapping, dict) or not mapping:
            raise ManifestError(
                f"{where}.labels: an object from the part's label values (strings) to merged "
                f"label values, got {mapping!r}"
            )
        pairs: list[tuple[int, int]] = []
        part_values = {lab.value for lab in part.labels}
        for key, value in mapping.items():
            try:
                source = int(key)
            except ValueError:
                source = -1
            if source not in part_values:
                raise ManifestError(
                    f"{where}.labels: {key!r} is not a label value of {path} "
                    f"(1..{len(part.labels)})"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value not in merged_values:
                raise ManifestError(
                    f"{where}.labels[{key!r}]: merged value {value!r} is not among the labels "
                    f"of {p} (1..{len(labels)})"
                )
            pairs.append((source, value))
        parts.append(CompositePart(manifest=part, label_map=tuple(sorted(pairs))))
    first = parts[0].manifest
    return ModelManifest(
        name=name,
        version=version,
        labels=labels,
        **{key: getattr(first, key) for key in _FROM_FIRST_PART},
        fp16=all(part.manifest.fp16 for part in parts),
        extra={k: v for k, v in raw.items() if k not in _COMPOSITE_KEYS},
        manifest_version=2,
        parts=tuple(parts),
    )


#: The fields a composite's own manifest takes from its first part (each part still runs
#: with its own, from :attr:`~segnode.engines.manifest.ModelManifest.parts`).
_FROM_FIRST_PART = (
    "onnx_path",
    "patch_size",
    "overlap",
    "input_name",
    "output_name",
    "output_kind",
    "batch_min",
    "batch_opt",
    "batch_max",
)

_KNOWN_V1 = {
    "name",
    "version",
    "onnx",
    "input_name",
    "output_name",
    "output_kind",
    "patch_size",
    "overlap",
    "batch",
    "fp16",
    "preprocessing",
    "labels",
}
_KNOWN = {
    1: _KNOWN_V1 | {"manifest_version"},
    2: (_KNOWN_V1 - {"onnx"})
    | {
        "manifest_version",
        "folds",
        "sigma_scale",
        "mirror_axes",
        "geometry",
        "resampling",
        "regions",
        "regions_class_order",
        "precision",
        "calibration",
    },
}
