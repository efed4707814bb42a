"""Label codes for imported models: a SNOMED CT mapping CSV, generic codes and colours.

The CSV format is TotalSegmentator's ``totalsegmentator/resources/
totalsegmentator_snomed_mapping.csv``: one row per structure, the structure name in
``Structure`` (as in nnU-Net's ``dataset.json`` ``labels``), then scheme / value / meaning of
each DICOM code sequence of a segment (PS3.3 C.8.20.2, Segment Description Macro)::

    Structure,
    SegmentedPropertyCategoryCodeSequence.CodingSchemeDesignator, ....CodeValue, ....CodeMeaning,
    SegmentedPropertyTypeCodeSequence.{...}, SegmentedPropertyTypeModifierCodeSequence.{...},
    AnatomicRegionSequence.{...}, AnatomicRegionModifierSequence.{...},
    DicomRGBColor                                  # "r,g,b", optional

Category and type are required for every row; the modifier (laterality) and the anatomic
region are optional. A label the CSV does not name gets :data:`GENERIC_CATEGORY` /
:data:`GENERIC_TYPE`.
"""

from __future__ import annotations

import colorsys
import csv
import io
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from segnode.engines.importers import ModelImportError

Code = tuple[str, str, str]
"""``(value, scheme designator, meaning)``, the order of the manifest's codes."""

GENERIC_CATEGORY: Code = ("85756007", "SCT", "Tissue")
"""SNOMED CT 85756007 "Body tissue" (DICOM meaning "Tissue"; CID 7150 Segmentation Property
Categories)."""
GENERIC_TYPE: Code = ("85756007", "SCT", "Tissue")
"""The same concept as the type (CID 7151 lists it as "Tissue"): says nothing wrong about
a structure the import has no code for."""

_SEQUENCES = {
    "category": "SegmentedPropertyCategoryCodeSequence",
    "type": "SegmentedPropertyTypeCodeSequence",
    "modifier": "SegmentedPropertyTypeModifierCodeSequence",
    "anatomic_region": "AnatomicRegionSequence",
    "anatomic_region_modifier": "AnatomicRegionModifierSequence",
}
_OPTIONAL = ("modifier", "anatomic_region", "anatomic_region_modifier")


@dataclass(frozen=True)
class LabelCodes:
    """The codes of one structure, as one row of the mapping CSV gives them (the structure's
    name is the row's key in :func:`read_label_csv`'s mapping)."""

    category: Code
    type: Code
    modifier: Code | None = None
    anatomic_region: Code | None = None
    anatomic_region_modifier: Code | None = None
    color: tuple[int, int, int] | None = None


def _columns(sequence: str) -> tuple[str, str, str]:
    return (
        f"{sequence}.CodeValue",
        f"{sequence}.CodingSchemeDesignator",
        f"{sequence}.CodeMeaning",
    )


def read_label_csv(text: str, source: str = "labels CSV") -> dict[str, LabelCodes]:
    """Parse a SNOMED CT mapping CSV (TotalSegmentator's format) into codes by structure name.

    Parameters
    ----------
    text
        The CSV text.
    source
        Name of the file, for error messages.

    Raises
    ------
    ModelImportError
        A required column is missing, a row lacks its category or type, a code is partly
        given, a colour is not ``r,g,b`` in 0..255, or a structure is listed twice; the
        message names the file and the line.
    """
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    required = ["Structure"]
    for key in ("category", "type"):
        required += _columns(_SEQUENCES[key])
    missing = [c for c in required if c not in header]
    if missing:
        raise ModelImportError(f"{source}: missing column(s) {', '.join(missing)}")
    out: dict[str, LabelCodes] = {}
    for line, row in enumerate(reader, start=2):
        name = (row.get("Structure") or "").strip()
        if not name:
            continue
        where = f"{source}: line {line} ({name})"
        codes: dict[str, Code | None] = {}
        for key, sequence in _SEQUENCES.items():
            cells = tuple((row.get(c) or "").strip() for c in _columns(sequence))
            if not any(cells):
                if key not in _OPTIONAL:
                    raise ModelImportError(f"{where}: no {sequence}")
                codes[key] = None
                continue
            if not all(cells):
                raise ModelImportError(
                    f"{where}: {sequence} needs a value, a scheme and a meaning, got {cells}"
                )
            codes[key] = (cells[0], cells[1], cells[2])
        if name in out:
            raise ModelImportError(f"{where}: structure listed twice")
        category, type_ = codes["category"], codes["type"]
        assert category is not None and type_ is not None
        out[name] = LabelCodes(
            category=category,
            type=type_,
            modifier=codes["modifier"],
            anatomic_region=codes["anatomic_region"],
            anatomic_region_modifier=codes["anatomic_region_modifier"],
            color=_color(row.get("DicomRGBColor"), where),
        )
    return out


def _color(raw: str | None, where: str) -> tuple[int, int, int] | None:
    if raw is None or not raw.strip():
        return None
    try:
        parts = [int(p) for p in raw.split(",")]
    except ValueError:
        parts = []
    if len(parts) != 3 or not all(0 <= p <= 255 for p in parts):
        raise ModelImportError(f"{where}: DicomRGBColor must be 'r,g,b' in 0..255, got {raw!r}")
    return (parts[0], parts[1], parts[2])


def load_label_csv(spec: str) -> dict[str, LabelCodes]:
    """Read ``--labels``: a CSV file, or ``"totalsegmentator"`` for the CSV that ships in the
    installed ``totalsegmentator`` package.

    Raises
    ------
    ModelImportError
        The file cannot be read, is invalid, or the package is not installed.
    """
    if spec == "totalsegmentator":
        from importlib import resources

        try:
            ref = resources.files("totalsegmentator") / "resources"
            csv_file = ref / "totalsegmentator_snomed_mapping.csv"
            text = csv_file.read_text(encoding="utf-8")
        except (ModuleNotFoundError, OSError) as exc:
            raise ModelImportError(
                "--labels totalsegmentator: the totalsegmentator package is not installed "
                f"({exc}); pip install totalsegmentator, or pass the CSV file itself"
            ) from exc
        return read_label_csv(text, "totalsegmentator_snomed_mapping.csv")
    path = Path(spec)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise ModelImportError(f"--labels: cannot read {path}: {exc}") from exc
    return read_label_csv(text, str(path))


def palette(value: int) -> tuple[int, int, int]:
    """A deterministic, well-spread colour for label ``value`` (golden-ratio hues)."""
    hue = (value * 0.618033988749895) % 1.0
    saturation = 0.65 if value % 2 else 0.8
    r, g, b = colorsys.hsv_to_rgb(hue, saturation, 0.9)
    return (round(r * 255), round(g * 255), round(b * 255))


def _lookup(codes: Mapping[str, LabelCodes], name: str) -> LabelCodes | None:
    if name in codes:
        return codes[name]
    key = name.casefold().replace(" ", "_")
    for other, found in codes.items():
        if other.casefold().replace(" ", "_") == key:
            return found
    return None


def label_entries(
    names: Iterable[tuple[int, str]],
    codes: Mapping[str, LabelCodes] | None,
    *,
    allow_generic: bool,
    source: str = "labels CSV",
) -> tuple[list[dict[str, Any]], list[str]]:
    """The manifest's ``labels`` list for ``(value, name)`` pairs.

    A label the CSV names gets its codes and colour (the palette's if the CSV has none); the
    modifier and anatomic region go into the entry as ``"modifier"``, ``"anatomic_region"``
    and ``"anatomic_region_modifier"`` (``[value, scheme, meaning]``; the manifest loader
    keeps only the keys it knows and ignores these, so they are on record for the SEG writer
    that reads them). A label without a row gets the generic codes.

    Parameters
    ----------
    names
        ``(value, name)`` in value order.
    codes
        The parsed CSV, or ``None`` when no ``--labels`` was given (every label generic).
    allow_generic
        With a CSV: accept labels it does not name (generic codes) instead of failing.
    source
        Name of the CSV, for the error message.

    Returns
    -------
    tuple
        ``(entries, generic)``: the label entries and the names that got generic codes.

    Raises
    ------
    ModelImportError
        The CSV does not cover every label and ``allow_generic`` is false.
    """
    entries: list[dict[str, Any]] = []
    generic: list[str] = []
    missing: list[str] = []
    for value, name in names:
        found = _lookup(codes, name) if codes is not None else None
        entry: dict[str, Any] = {"value": value, "name": name}
        if found is None:
            (missing if codes is not None else generic).append(name)
            entry["category"] = list(GENERIC_CATEGORY)
            entry["type"] = list(GENERIC_TYPE)
            entry["color"] = list(palette(value))
        else:
            entry["category"] = list(found.category)
            entry["type"] = list(found.type)
            entry["color"] = list(found.color or palette(value))
            for key in _OPTIONAL:
                code = getattr(found, key)
                if code is not None:
                    entry[key] = list(code)
        entries.append(entry)
    if missing and not allow_generic:
        raise ModelImportError(
            f"{source} does not name {len(missing)} of the model's labels: "
            f"{', '.join(missing)} (add rows for them, or pass --allow-generic to give them "
            "the generic code SCT 85756007 'Tissue')"
        )
    return entries, generic + missing
