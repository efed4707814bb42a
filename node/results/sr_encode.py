"""The TID 1500 measurement report of a result, prepared before the labels exist.

:func:`segnode.node.results.build.build_sr` builds the Comprehensive 3D SR with highdicom once the
label map, its statistics and the SEG exist, and pydicom writes it: most of that time goes to
what depends only on the source series (the evidence of every source instance, the
Patient and Study modules, the observer context) and to pydicom's writer. :class:`SrPlan`
does that part while inference runs:

* :meth:`SrPlan.prepare` builds the same document with highdicom, through the functions
  ``build_sr`` uses (:func:`segnode.node.results.build.measurement_report`,
  :func:`segnode.node.results.build.sr_document`), with one measurement group per manifest label
  holding placeholder values, and writes it with pydicom once. The SEG it references is described
  by a header that highdicom builds the way ``build_seg``'s Segmentation constructor does
  (Patient and Study modules copied from the first source, the SEG's equipment), so no
  SEG dataset is needed; only its plan (:class:`segnode.node.results.seg_encode.SegPlan`:
  model, UIDs, SOP Class and equipment).
* It cuts the written bytes into a template: fixed runs of bytes, the elements that change
  (Instance Creation and Content Date/Time, the Contribution DateTime of highdicom's
  equipment item; per group the tracking UID, the referenced segment number and the
  measured values) and the sequences and items around them, whose lengths are recomputed.
  The template rendered with the placeholders must reproduce pydicom's bytes exactly, or
  ``prepare`` fails.
* The first plan of a model, SEG class and equipment keeps what does not depend on the job
  (a :class:`_Template`: the top-level elements but the base modules and the evidence, the
  groups with the SEG's SOP Instance UID and the source series UID as slots too), once the
  same job spliced from it gives the same elements. Later plans of that key are spliced:
  highdicom's base class sets the SOP Common, Patient, Study, Series and Equipment modules
  from the SEG header as ``Comprehensive3DSR`` does and pydicom writes those few elements
  and the File Meta Information; the Current Requested Procedure Evidence Sequence is
  encoded here as ``collect_evidence`` fills it. A job it does not cover (evidence from
  another study, a UID pydicom would clean up) takes the full path.
* :meth:`SrPlan.encode` fills the template with the statistics of the segments present and
  the current time: a few dozen short elements, no highdicom or pydicom objects.

The result is byte for byte what ``build_sr`` and ``segnode.node.pipeline.worker.encode`` write for
the same label map and clock (``tests/test_sr_encode.py``; spliced plans in
``tests/test_sr_template.py``). Explicit VR Little Endian, defined lengths, as pydicom
writes (PS3.5 7.1.2, 7.5).
"""

from __future__ import annotations

import datetime
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any

import highdicom as hd
from pydicom.dataelem import DataElement
from pydicom.dataset import Dataset
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import dcmwrite, write_data_element
from pydicom.uid import Comprehensive3DSRStorage
from pydicom.valuerep import DA, DS, DT, TM

from segnode.engines.manifest import ModelManifest
from segnode.node.errors import NoSegmentsError, ResultError
from segnode.node.ingest.volume import Volume
from segnode.node.results.build import (
    LABEL_MAP_SEGMENTATION_STORAGE,
    SEGMENTATION_STORAGE,
    Equipment,
    ResultUIDs,
    _character_set,
    _source_headers,
    derived_uid,
    measurement_report,
    source_base,
    sr_document,
)
from segnode.node.results.seg_encode import SegPlan
from segnode.node.results.seg_header import seg_base
from segnode.node.results.statistics import SegmentStatistics

# Tags (PS3.6) of the elements encode() fills in.
_INSTANCE_CREATION_DATE = 0x00080012
_INSTANCE_CREATION_TIME = 0x00080013
_CONTENT_DATE = 0x00080023
_CONTENT_TIME = 0x00080033
_CONTRIBUTION_DATETIME = 0x0018A002
_CONTENT_SEQUENCE = 0x0040A730
_UID = 0x0040A124
_FLOATING_POINT_VALUE = 0x0040A161
_NUMERIC_VALUE = 0x0040A30A
_REFERENCED_SEGMENT_NUMBER = 0x0062000B
_REFERENCED_SOP_CLASS_UID = 0x00081150
_REFERENCED_SOP_INSTANCE_UID = 0x00081155
_REFERENCED_SERIES_SEQUENCE = 0x00081115
_REFERENCED_SOP_SEQUENCE = 0x00081199
_STUDY_INSTANCE_UID = 0x0020000D
_SERIES_INSTANCE_UID = 0x0020000E
_EVIDENCE_SEQUENCE = 0x0040A375  # Current Requested Procedure Evidence Sequence
_CLOCK = {
    _INSTANCE_CREATION_DATE: "instance_date",
    _INSTANCE_CREATION_TIME: "instance_time",
    _CONTENT_DATE: "content_date",
    _CONTENT_TIME: "content_time",
}
#: Concept name of the TID 1500 "Imaging Measurements" container (CID 7021).
_IMAGING_MEASUREMENTS = ("126010", "DCM")

_ITEM = b"\xfe\xff\x00\xe0"  # (FFFE,E000) Item
_UL = struct.Struct("<L")
_SHORT = struct.Struct("<HH2sH")  # group, element, VR, 16-bit length
_SEQUENCE = struct.Struct("<HH2s2x")  # group, element, "SQ", reserved (32-bit length follows)

# Placeholders of the template groups: values no segment can have together.
_TEMPLATE_NUMBER = 65535
_TEMPLATE_VOLUME = 1234.5
_TEMPLATE_MEAN = -2345.25
_TEMPLATE_STD = 3456.75
_MEASUREMENTS = (("volume", _TEMPLATE_VOLUME), ("mean", _TEMPLATE_MEAN), ("std", _TEMPLATE_STD))
_GROUP_SLOTS = frozenset(
    {"tracking_uid", "segment_number", "seg_sop_uid", "source_series_uid"}
    | {f"{name}_{vr}" for name, _ in _MEASUREMENTS for vr in ("ds", "fd")}
)


@dataclass(frozen=True)
class _Slot:
    """An element encode() writes: ``name`` keys the encoded element."""

    name: str


@dataclass(frozen=True)
class _Nested:
    """A sequence or item holding a slot: ``header`` is what comes before its 32-bit length."""

    header: bytes
    parts: tuple[_Part, ...]


_Part = bytes | _Slot | _Nested
_Hook = Callable[[Dataset, DataElement, str | list[str]], "_Part | None"]


def _render(parts: Sequence[_Part], values: Mapping[str, bytes]) -> bytes:
    """The bytes of ``parts`` with the slots filled from ``values``."""
    out: list[bytes] = []
    for part in parts:
        if isinstance(part, bytes):
            out.append(part)
        elif isinstance(part, _Slot):
            out.append(values[part.name])
        else:
            body = _render(part.parts, values)
            out += (part.header, _UL.pack(len(body)), body)
    return b"".join(out)


def _slots(parts: Sequence[_Part]) -> list[str]:
    names: list[str] = []
    for part in parts:
        if isinstance(part, _Slot):
            names.append(part.name)
        elif isinstance(part, _Nested):
            names += _slots(part.parts)
    return names


def _nested(header: bytes, parts: list[_Part]) -> _Part:
    """A sequence or item: plain bytes when it holds no slot."""
    merged: list[_Part] = []
    for part in parts:
        if isinstance(part, bytes) and merged and isinstance(merged[-1], bytes):
            merged[-1] += part
        else:
            merged.append(part)
    if len(merged) == 1 and isinstance(merged[0], bytes):
        return header + _UL.pack(len(merged[0])) + merged[0]
    if not merged:
        return header + _UL.pack(0)
    return _Nested(header, tuple(merged))


def _element_bytes(element: DataElement, encodings: str | list[str]) -> bytes:
    """``element`` as pydicom writes it in Explicit VR Little Endian."""
    fp = DicomBytesIO()
    fp.is_little_endian = True
    fp.is_implicit_VR = False
    write_data_element(fp, element, encodings)
    return fp.getvalue()


def _tag_bytes(tag: int) -> tuple[int, int]:
    return tag >> 16, tag & 0xFFFF


def _compile(ds: Dataset, encodings: str | list[str], hook: _Hook) -> list[_Part]:
    """The elements of ``ds`` in tag order (as pydicom's ``write_dataset``), the ones
    ``hook`` answers for replaced, sequences holding a replacement kept open."""
    return [part for _, part in _compile_items(ds, encodings, hook)]


def _compile_items(ds: Dataset, encodings: str | list[str], hook: _Hook) -> list[tuple[int, _Part]]:
    """:func:`_compile`, each part with its element's tag."""
    encodings = ds.get("SpecificCharacterSet", encodings)
    parts: list[tuple[int, _Part]] = []
    for tag in sorted(ds.keys()):
        if tag.element == 0 and tag.group > 6:
            continue  # retired group lengths are not written
        element = ds[tag]
        replaced = hook(ds, element, encodings)
        if replaced is not None:
            parts.append((tag, replaced))
            continue
        if element.VR == "SQ" and not element.is_undefined_length:
            items = [_nested(_ITEM, _compile(item, encodings, hook)) for item in element.value]
            parts.append((tag, _nested(_sequence_header(tag), items)))
        else:
            parts.append((tag, _element_bytes(element, encodings)))
    return parts


def _no_hook(parent: Dataset, element: DataElement, encodings: str | list[str]) -> None:
    return None


def _sequence_header(tag: int) -> bytes:
    """Tag, VR and reserved bytes of a sequence element, before its 32-bit length."""
    return _SEQUENCE.pack(*_tag_bytes(tag), b"SQ")


def _short(tag: int, vr: bytes, value: bytes) -> bytes:
    return _SHORT.pack(*_tag_bytes(tag), vr, len(value)) + value


def _ui(tag: int, uid: str) -> bytes:
    value = uid.encode("ascii")
    return _short(tag, b"UI", value + b"\x00" * (len(value) % 2))


def _ds(tag: int, number: float) -> bytes:
    """As pydicom writes the ``DS(number, auto_format=True)`` highdicom stores."""
    ds = DS(number, auto_format=True)
    text = str(getattr(ds, "original_string", ds))
    return _short(tag, b"DS", (text + " " * (len(text) % 2)).encode("ascii"))


def _fd(tag: int, number: float) -> bytes:
    return _short(tag, b"FD", struct.pack("<d", number))


def _us(tag: int, number: int) -> bytes:
    return _short(tag, b"US", struct.pack("<H", number))


def _is_imaging_measurements(item: Dataset) -> bool:
    concept = item.get("ConceptNameCodeSequence")
    return bool(
        concept
        and (str(concept[0].CodeValue), str(concept[0].CodingSchemeDesignator))
        == _IMAGING_MEASUREMENTS
    )


_PLAIN_UID = re.compile(r"[0-9.]{1,64}")


def _wrap(header: bytes, body: bytes) -> bytes:
    """A sequence or item of defined length around ``body``."""
    return header + _UL.pack(len(body)) + body


def _evidence(evidence: Sequence[Dataset], study_uid: str) -> bytes | None:
    """The Current Requested Procedure Evidence Sequence as highdicom's ``collect_evidence``
    fills it (duplicates dropped, series in order of appearance), encoded; None where it
    would not be the only evidence sequence (another study) or a UID is not plain digits
    and dots (left to pydicom's writer)."""
    seen: set[str] = set()
    series: dict[str, list[bytes]] = {}
    for ds in evidence:
        uids = [str(ds.get(k, "")) for k in ("StudyInstanceUID", "SeriesInstanceUID")]
        sop_class, sop = str(ds.get("SOPClassUID", "")), str(ds.get("SOPInstanceUID", ""))
        if uids[0] != study_uid or not all(
            _PLAIN_UID.fullmatch(uid) for uid in (*uids, sop_class, sop)
        ):
            return None
        if sop in seen:
            continue
        seen.add(sop)
        item = _ui(_REFERENCED_SOP_CLASS_UID, sop_class) + _ui(_REFERENCED_SOP_INSTANCE_UID, sop)
        series.setdefault(uids[1], []).append(_wrap(_ITEM, item))
    items = b"".join(
        _wrap(
            _ITEM,
            _wrap(_sequence_header(_REFERENCED_SOP_SEQUENCE), b"".join(references))
            + _ui(_SERIES_INSTANCE_UID, uid),
        )
        for uid, references in series.items()
    )
    study = _wrap(_sequence_header(_REFERENCED_SERIES_SEQUENCE), items)
    study += _ui(_STUDY_INSTANCE_UID, study_uid)
    return _wrap(_sequence_header(_EVIDENCE_SEQUENCE), _wrap(_ITEM, study))


def _sr_base(seg: Dataset, uids: ResultUIDs, **kwargs: Any) -> hd.SOPClass:
    """The SR's SOP Common, Patient, Study, Series and Equipment modules as
    ``Comprehensive3DSR`` sets them from ``seg`` (its first evidence): highdicom's base
    class with the same arguments, then the Patient and Study modules copied."""
    try:
        sr = source_base(
            seg,
            modality="SR",
            series_instance_uid=uids.sr_series_uid,
            sop_instance_uid=uids.sr_sop_uid,
            sop_class_uid=Comprehensive3DSRStorage,
            **kwargs,
        )
    except (ValueError, TypeError) as exc:
        raise ResultError(f"cannot encode the measurement report: {exc}") from exc
    sr.copy_patient_and_study_information(seg)
    return sr


def _file_head(ds: Dataset) -> bytes:
    """Preamble, prefix and File Meta Information as pydicom writes them for ``ds``."""
    buffer = BytesIO()
    dcmwrite(buffer, ds, enforce_file_format=True)
    written = buffer.getvalue()
    # (0002,0000) File Meta Information Group Length (UL) follows the 132-byte prefix.
    return written[: 144 + _UL.unpack_from(written, 140)[0]]


def _job_values(uids: ResultUIDs, source_series_uid: str) -> dict[str, bytes]:
    """The elements of every group that name this job's SEG and source series."""
    return {
        "seg_sop_uid": _element_bytes(
            DataElement(_REFERENCED_SOP_INSTANCE_UID, "UI", uids.seg_sop_uid), "iso8859"
        ),
        "source_series_uid": _element_bytes(DataElement(_UID, "UI", source_series_uid), "iso8859"),
    }


@dataclass(frozen=True)
class _Template:
    """What every plan of one key shares: the SR's top-level elements that depend only on
    the model, the SEG class and the equipment (date/time and groups as slots), and one
    group per label value."""

    items: tuple[tuple[int, _Part], ...]
    groups: Mapping[int, _Part]
    encodings: str | list[str]


#: Templates by :func:`_template_key`, most recently used last; bounded, shared by threads.
_TEMPLATES: OrderedDict[tuple[object, ...], _Template] = OrderedDict()
_TEMPLATES_LOCK = threading.Lock()
_TEMPLATES_MAX = 8


def _seg_header(
    first: Dataset,
    uids: ResultUIDs,
    sop_class_uid: str,
    equipment: Equipment,
    specific_character_set: str | list[str] | None,
) -> Dataset:
    """The attributes of the SEG that highdicom's SR reads (its evidence, Patient and Study
    modules, equipment), set as ``hd.seg.Segmentation`` sets them from the first source."""
    seg = seg_base(first, uids, sop_class_uid, equipment, charset=specific_character_set)
    seg.copy_patient_and_study_information(first)
    return seg


@dataclass(frozen=True)
class SrPlan:
    """A TID 1500 Comprehensive 3D SR with everything but the measurements encoded.

    Build with :meth:`prepare`; :meth:`encode` is cheap and may be called for any label
    map of the same volume, model and UIDs.

    Attributes
    ----------
    manifest, uids
        Those of the SEG plan given to :meth:`prepare`.
    sop_class_uid
        Comprehensive 3D SR Storage.
    """

    manifest: ModelManifest
    uids: ResultUIDs
    sop_class_uid: str
    _head: bytes = field(repr=False)
    _body: tuple[_Part, ...] = field(repr=False)
    _groups: Mapping[int, _Part] = field(repr=False)
    _encodings: str | list[str] = field(repr=False)
    _job: Mapping[str, bytes] = field(repr=False)

    @classmethod
    def prepare(cls, volume: Volume, seg: SegPlan, *, equipment: Equipment) -> SrPlan:
        """Encode everything of the SR that does not depend on the label map.

        Parameters
        ----------
        volume
            The source volume (its headers are the evidence and give Patient and Study).
        seg
            The plan of the SEG of ``volume`` that the SR references; the SR takes from it
            the model (its labels get one measurement group each, when present), the UIDs of
            the result (the SR's, and the SEG's that the groups reference), the SEG's SOP
            Class (Segmentation Storage, or Label Map Segmentation Storage) and its
            equipment.
        equipment
            The SR's, as for :func:`segnode.node.results.build.build_sr`.

        Raises
        ------
        ResultError
            ``seg`` is not of ``volume``'s series, highdicom rejects the input, the SEG
            class is neither of the two, or the template does not reproduce pydicom's bytes.

        Notes
        -----
        The first call for a model (name, version, labels), SEG class and equipment takes
        highdicom's full path and keeps a template; later calls for the same key splice
        the job's modules and evidence into it (see the module docstring).
        """
        if seg.sop_class_uid not in (SEGMENTATION_STORAGE, LABEL_MAP_SEGMENTATION_STORAGE):
            raise ResultError(f"{seg.sop_class_uid} is not a Segmentation SOP Class")
        if seg.series_instance_uid != volume.series_instance_uid:
            raise ResultError("seg is not the SEG of this volume's series")
        manifest, uids = seg.manifest, seg.uids
        sources = _source_headers(volume)
        charset = _character_set(volume)
        header = _seg_header(sources[0], uids, seg.sop_class_uid, seg.equipment, charset)
        # The keywords sr_document gives Comprehensive3DSR that its base class keeps.
        base_kwargs: dict[str, Any] = {
            **equipment.arguments(),
            "specific_character_set": charset,
            "series_description": f"SR {manifest.name}"[:64],
        }
        key = (
            manifest.name,
            manifest.version,
            manifest.labels,
            seg.sop_class_uid,
            seg.equipment,
            *((k, v if not isinstance(v, list) else tuple(v)) for k, v in base_kwargs.items()),
        )
        evidence = [header, *sources]
        source_series_uid = volume.series_instance_uid
        with _TEMPLATES_LOCK:
            template = _TEMPLATES.get(key)
            if template is not None:
                _TEMPLATES.move_to_end(key)
        if template is not None:
            plan = cls._from_template(
                template, manifest, uids, header, evidence, source_series_uid, base_kwargs
            )
            if plan is not None:
                return plan
        specs = sorted(manifest.labels, key=lambda spec: spec.value)
        placeholders = [
            SegmentStatistics(
                segment_number=_TEMPLATE_NUMBER,
                label=spec,
                voxels=1,
                volume_ml=_TEMPLATE_VOLUME,
                mean_hu=_TEMPLATE_MEAN,
                std_hu=_TEMPLATE_STD,
            )
            for spec in specs
        ]
        report = measurement_report(
            placeholders,
            manifest,
            uids,
            seg_sop_class_uid=seg.sop_class_uid,
            source_series_uid=source_series_uid,
            equipment=equipment,
        )
        model = sr_document(
            evidence,
            report,
            manifest,
            uids,
            specific_character_set=charset,
            equipment=equipment,
        )
        plan, items = cls._from_model(
            model, manifest, uids, [spec.value for spec in specs], source_series_uid
        )
        if template is None:
            # What is not the job's (the base modules, the evidence) is the template,
            # kept once the splice gives this job's document back element for element.
            base = _sr_base(header, uids, **base_kwargs)
            job_tags = {e.tag for e in base if e.tag not in _CLOCK} | {_EVIDENCE_SEQUENCE}
            template = _Template(
                items=tuple((tag, part) for tag, part in items if tag not in job_tags),
                groups=plan._groups,
                encodings=plan._encodings,
            )
            spliced = cls._from_template(
                template, manifest, uids, header, evidence, source_series_uid, base_kwargs
            )
            if spliced == plan:
                with _TEMPLATES_LOCK:
                    _TEMPLATES[key] = template
                    while len(_TEMPLATES) > _TEMPLATES_MAX:
                        _TEMPLATES.popitem(last=False)
        return plan

    @classmethod
    def _from_template(
        cls,
        template: _Template,
        manifest: ModelManifest,
        uids: ResultUIDs,
        seg: Dataset,
        evidence: Sequence[Dataset],
        source_series_uid: str,
        base_kwargs: Mapping[str, Any],
    ) -> SrPlan | None:
        """The plan of this job from a template: the base modules set by highdicom and
        written by pydicom (a few dozen elements), the evidence encoded here; None where
        the job needs what the template does not cover (see :func:`_evidence`)."""
        base = _sr_base(seg, uids, **base_kwargs)
        evidence_sequence = _evidence(evidence, str(base.StudyInstanceUID))
        if evidence_sequence is None:
            return None
        fixed = {tag for tag, _ in template.items}
        items = [
            (tag, part)
            for tag, part in _compile_items(base, template.encodings, _no_hook)
            if tag not in _CLOCK
        ]
        if _EVIDENCE_SEQUENCE in fixed or any(tag in fixed for tag, _ in items):
            return None
        items += [*template.items, (_EVIDENCE_SEQUENCE, evidence_sequence)]
        items.sort(key=lambda item: item[0])
        return cls(
            manifest=manifest,
            uids=uids,
            sop_class_uid=str(Comprehensive3DSRStorage),
            _head=_file_head(base),
            _body=tuple(part for _, part in items),
            _groups=template.groups,
            _encodings=template.encodings,
            _job=_job_values(uids, source_series_uid),
        )

    @classmethod
    def _from_model(
        cls,
        model: Dataset,
        manifest: ModelManifest,
        uids: ResultUIDs,
        values: list[int],
        source_series_uid: str,
    ) -> tuple[SrPlan, list[tuple[int, _Part]]]:
        """Cut the written ``model`` into the template (see the module docstring); the
        plan and its top-level parts by tag."""
        placeholder_uid = derived_uid(uids.sr_sop_uid, "segment", str(_TEMPLATE_NUMBER))
        equipment = [id(item) for item in model.get("ContributingEquipmentSequence", [])]
        found: dict[str, bytes] = {}
        groups: list[_Part] = []
        group_values: list[dict[str, bytes]] = []

        def group_hook(
            parent: Dataset, element: DataElement, encodings: str | list[str]
        ) -> _Part | None:
            name = None
            if element.tag == _UID and element.value == placeholder_uid:
                name = "tracking_uid"
            elif element.tag == _REFERENCED_SEGMENT_NUMBER and element.value == _TEMPLATE_NUMBER:
                name = "segment_number"
            elif element.tag == _REFERENCED_SOP_INSTANCE_UID and element.value == uids.seg_sop_uid:
                name = "seg_sop_uid"
            elif element.tag == _UID and element.value == source_series_uid:
                name = "source_series_uid"
            elif element.tag in (_NUMERIC_VALUE, _FLOATING_POINT_VALUE):
                vr = "ds" if element.tag == _NUMERIC_VALUE else "fd"
                for measurement, value in _MEASUREMENTS:
                    if float(element.value) == value:
                        name = f"{measurement}_{vr}"
            if name is None:
                return None
            group_values[-1][name] = _element_bytes(element, encodings)
            return _Slot(name)

        def hook(parent: Dataset, element: DataElement, encodings: str | list[str]) -> _Part | None:
            name = None
            if parent is model and element.tag in _CLOCK:
                name = _CLOCK[element.tag]
            elif element.tag == _CONTRIBUTION_DATETIME and id(parent) in equipment:
                name = "contribution_datetime"
            elif element.tag == _CONTENT_SEQUENCE and _is_imaging_measurements(parent):
                for item in element.value:
                    group_values.append({})
                    groups.append(_nested(_ITEM, _compile(item, encodings, group_hook)))
                found["groups"] = b"".join(
                    _render([g], v) for g, v in zip(groups, group_values, strict=True)
                )
                return _Nested(_sequence_header(_CONTENT_SEQUENCE), (_Slot("groups"),))
            if name is None:
                return None
            if name in found:
                raise ResultError(f"the SR template has two {name} elements")
            found[name] = _element_bytes(element, encodings)
            return _Slot(name)

        encodings: str | list[str] = model.get("SpecificCharacterSet", "iso8859")
        items = _compile_items(model, encodings, hook)
        body = tuple(part for _, part in items)
        missing = {*_CLOCK.values(), "contribution_datetime", "groups"} - set(found)
        if missing or len(groups) != len(values):
            raise ResultError(f"the SR template lacks {sorted(missing) or 'groups'}")
        for group in groups:
            if sorted(_slots([group])) != sorted(_GROUP_SLOTS):
                raise ResultError(f"a template group holds {_slots([group])}")
        job = _job_values(uids, source_series_uid)
        if any(v[name] != job[name] for v in group_values for name in job):
            raise ResultError("the SR template's SEG or source series reference differs")
        buffer = BytesIO()
        dcmwrite(buffer, model, enforce_file_format=True)
        written = buffer.getvalue()
        rendered = _render(body, found)
        if not written.endswith(rendered):
            raise ResultError("the SR template does not reproduce pydicom's encoding")
        plan = cls(
            manifest=manifest,
            uids=uids,
            sop_class_uid=str(Comprehensive3DSRStorage),
            _head=written[: len(written) - len(rendered)],
            _body=body,
            _groups=dict(zip(values, groups, strict=True)),
            _encodings=encodings,
            _job=job,
        )
        return plan, items

    def encode(
        self, stats: Sequence[SegmentStatistics], *, now: datetime.datetime | None = None
    ) -> bytes:
        """The SR in the DICOM File Format (PS3.10) for the segments in ``stats``.

        Parameters
        ----------
        stats
            :func:`segnode.node.results.build.segment_statistics` (or
            :meth:`segnode.node.results.statistics.SegmentStatsAccumulator.result`) of the label
            map: segment numbers 1..n in ascending label value.
        now
            Instance Creation and Content Date/Time, and the time of highdicom's
            contribution; the current local time when None (highdicom's choice).

        Raises
        ------
        NoSegmentsError
            ``stats`` is empty.
        ResultError
            ``stats`` is not numbered 1..n in ascending label value of this manifest, or a
            value is not finite.
        """
        if not stats:
            raise NoSegmentsError("no segment found; no SR is produced")
        groups = []
        previous = 0
        for number, s in enumerate(stats, start=1):
            value = s.label.value
            template = self._groups.get(value)
            if s.segment_number != number or value <= previous or template is None:
                raise ResultError(
                    f"statistics are not numbered 1..n in ascending label value: segment "
                    f"{s.segment_number} (label {value}) at position {number}"
                )
            if s.label != self.manifest.label(value):
                raise ResultError(f"label {value} is not {self.manifest.name}'s")
            previous = value
            groups.append(_render([template], {**self._job, **self._group_values(s)}))
        now = now if now is not None else datetime.datetime.now()
        clock = {
            "instance_date": DataElement(_INSTANCE_CREATION_DATE, "DA", DA(now.date())),
            "instance_time": DataElement(_INSTANCE_CREATION_TIME, "TM", TM(now.time())),
            "content_date": DataElement(_CONTENT_DATE, "DA", DA(now.date())),
            "content_time": DataElement(_CONTENT_TIME, "TM", TM(now.time())),
            "contribution_datetime": DataElement(_CONTRIBUTION_DATETIME, "DT", DT(now)),
        }
        values = {name: _element_bytes(e, self._encodings) for name, e in clock.items()}
        values["groups"] = b"".join(groups)
        return self._head + _render(self._body, values)

    def _group_values(self, s: SegmentStatistics) -> dict[str, bytes]:
        """The elements of one group, as ``measurement_report`` sets them."""
        values = {
            "tracking_uid": _ui(
                _UID, derived_uid(self.uids.sr_sop_uid, "segment", str(s.segment_number))
            ),
            "segment_number": _us(_REFERENCED_SEGMENT_NUMBER, s.segment_number),
        }
        measured = {
            "volume": round(s.volume_ml, 6),
            "mean": round(s.mean_hu, 4),
            "std": round(s.std_hu, 4),
        }
        for name, number in measured.items():
            if number != number or number in (float("inf"), float("-inf")):
                raise ResultError(f"{name} of segment {s.segment_number} is {number}")
            values[f"{name}_ds"] = _ds(_NUMERIC_VALUE, number)
            values[f"{name}_fd"] = _fd(_FLOATING_POINT_VALUE, number)
        return values
