"""Series selection and routing: which complete series are segmented, by which models, and
where the results go.

Configuration (parsed once at start, see ``config.toml``)::

    [routing]
    mode = "first"          # "first": the first matching rule decides; "all": every match adds

    [models.lungs]          # models besides the default [model]
    manifest = "models/lungs/lungs.json"
    engine = "tensorrt"

    [[rules]]
    name = "chest-ct"
    modality = ["CT"]
    body_part = ["CHEST", "THORAX"]
    slice_thickness = [0.5, 3.0]
    min_slices = 64
    models = ["default", "lungs"]
    destinations = ["@sender", "stow:http://pacs:8042/dicom-web"]
    priority = 10

A rule's criteria are all optional; a series matches when every given criterion holds. They are
read from the first instance of the series (for Enhanced CT, from its shared functional groups)
and from the ledger's instance count:

* ``calling_ae`` - calling AE titles (exact);
* ``modality`` - Modality (0008,0060);
* ``sop_class`` - SOP Class UIDs or their keywords (``"CTImageStorage"``);
* ``image_type`` - values that Image Type (0008,0008) must all contain, e.g. ``["AXIAL"]``;
* ``skip_image_types`` - values any of which excludes the series; default ``["LOCALIZER",
  "DERIVED", "SECONDARY"]`` (scout views, reformats, screen captures, PS3.3 C.7.6.1.1.2);
* ``body_part`` - Body Part Examined (0018,0015), case-insensitive;
* ``series_description`` - a regular expression searched in Series Description (0008,103E),
  case-insensitive;
* ``slice_thickness`` and ``pixel_spacing`` - ``[min, max]`` in mm, inclusive (both pixel
  spacing values must lie in the range);
* ``min_slices`` and ``max_slices`` - the number of slices (instances; frames of an Enhanced CT).

Its action: ``models`` (default ``["default"]``, the ``[model]`` table), ``destinations``
(default: ``dispatch.destinations``; ``[]`` keeps the results in the data directory), and
``priority`` (default: the sender's ``[[series.senders]]`` priority, else 0). ``ignore = true``
makes a rule that records matching series as ignored instead.

``routing.mode = "first"`` (default): rules are tried in file order and the first match decides.
``"all"``: every matching rule contributes its models; a model named by several rules runs once,
with the union of their destinations and the highest priority; a matching ``ignore`` rule vetoes.

A series that no rule matches is recorded as ignored, with the reason (not a failure); it is
listed by ``segnode jobs``. Without any ``[[rules]]`` one implicit rule applies, as before
routing existed: Modality CT, Image Type without LOCALIZER, the default model, and
``dispatch.destinations``.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pynetdicom.sop_class
from pydicom import Dataset, dcmread
from pydicom.errors import InvalidDicomError
from pydicom.uid import UID

from segnode.node.errors import ConfigError
from segnode.node.ingest.volume import CT_CLASSES
from segnode.node.modelspec import (
    DEFAULT_MODEL_NAME as DEFAULT_MODEL_NAME,
)
from segnode.node.modelspec import SPEC_KEYS, ModelSpec, parse_model_spec
from segnode.node.peers import Peer, ae_title
from segnode.node.routing.destinations import (
    SENDER,
    Destination,
    PathFn,
    SenderRef,
    parse_destination,
    resolve,
)
from segnode.node.tables import array_of_tables, check_keys, section

if TYPE_CHECKING:
    from segnode.node.config import Config

ROUTING_MODES = ("first", "all")
DEFAULT_SKIP_IMAGE_TYPES = ("LOCALIZER", "DERIVED", "SECONDARY")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,48}$")
_RULE_KEYS = {
    "name",
    "calling_ae",
    "modality",
    "sop_class",
    "image_type",
    "skip_image_types",
    "body_part",
    "series_description",
    "slice_thickness",
    "pixel_spacing",
    "min_slices",
    "max_slices",
    "models",
    "destinations",
    "priority",
    "ignore",
}


@dataclass(frozen=True)
class SeriesFacts:
    """What rules match on: attributes of one series, read from its first instance."""

    series_instance_uid: str
    calling_ae: str = ""
    modality: str = ""
    sop_class_uid: str = ""
    image_type: tuple[str, ...] = ()
    body_part: str = ""
    series_description: str = ""
    slice_thickness: float | None = None
    pixel_spacing: tuple[float, float] | None = None
    slices: int = 0


@dataclass(frozen=True)
class Match:
    """The criteria of a rule (empty ones match everything)."""

    calling_ae: tuple[str, ...] = ()
    modality: tuple[str, ...] = ()
    sop_class: tuple[str, ...] = ()
    image_type: tuple[str, ...] = ()
    skip_image_types: tuple[str, ...] = DEFAULT_SKIP_IMAGE_TYPES
    body_part: tuple[str, ...] = ()
    series_description: re.Pattern[str] | None = None
    slice_thickness: tuple[float, float] | None = None
    pixel_spacing: tuple[float, float] | None = None
    min_slices: int = 0
    max_slices: int | None = None

    def mismatch(self, f: SeriesFacts) -> str | None:
        """Why ``f`` does not match (the first failing criterion), or None if it matches."""
        image_type = "\\".join(f.image_type) or "(absent)"
        if self.calling_ae and f.calling_ae not in self.calling_ae:
            return f"calling AE {f.calling_ae!r} not in {list(self.calling_ae)}"
        if self.modality and f.modality.upper() not in self.modality:
            return f"Modality {f.modality or '(absent)'} not in {list(self.modality)}"
        if self.sop_class and f.sop_class_uid not in self.sop_class:
            return f"SOP class {_class_name(f.sop_class_uid)} not in sop_class"
        skipped = sorted(set(self.skip_image_types) & set(f.image_type))
        if skipped:
            return f"ImageType {image_type} has {skipped[0]} (skip_image_types)"
        lacking = sorted(set(self.image_type) - set(f.image_type))
        if lacking:
            return f"ImageType {image_type} lacks {lacking[0]}"
        if self.body_part and f.body_part.upper() not in self.body_part:
            return f"BodyPartExamined {f.body_part or '(absent)'} not in {list(self.body_part)}"
        regex = self.series_description
        if regex is not None and not regex.search(f.series_description):
            return f"SeriesDescription {f.series_description!r} does not match /{regex.pattern}/"
        if self.slice_thickness is not None and not _within(
            f.slice_thickness, self.slice_thickness
        ):
            bounds = _range_text(self.slice_thickness)
            return f"SliceThickness {_mm(f.slice_thickness)} outside {bounds}"
        if self.pixel_spacing is not None and not (
            f.pixel_spacing is not None
            and all(_within(v, self.pixel_spacing) for v in f.pixel_spacing)
        ):
            bounds = _range_text(self.pixel_spacing)
            return f"PixelSpacing {_spacing(f.pixel_spacing)} outside {bounds}"
        if f.slices < self.min_slices:
            return f"{f.slices} slice(s), fewer than min_slices {self.min_slices}"
        if self.max_slices is not None and f.slices > self.max_slices:
            return f"{f.slices} slice(s), more than max_slices {self.max_slices}"
        return None


@dataclass(frozen=True)
class Rule:
    """One ``[[rules]]`` entry."""

    name: str
    match: Match = field(default_factory=Match)
    models: tuple[str, ...] = (DEFAULT_MODEL_NAME,)
    destinations: tuple[Destination, ...] | None = None
    priority: int | None = None
    ignore: bool = False


#: The rule that applies when no ``[[rules]]`` are configured (the behaviour before routing).
IMPLICIT_RULE = Rule(name="default", match=Match(modality=("CT",), skip_image_types=("LOCALIZER",)))


@dataclass(frozen=True)
class Routing:
    """``[routing]``, ``[[rules]]`` and ``[models.NAME]``."""

    mode: str = "first"
    rules: tuple[Rule, ...] = ()
    models: tuple[ModelSpec, ...] = ()

    @property
    def effective_rules(self) -> tuple[Rule, ...]:
        """The configured rules, or the implicit rule when there are none."""
        return self.rules or (IMPLICIT_RULE,)

    def model(self, name: str) -> ModelSpec | None:
        """The ``[models.NAME]`` entry called ``name``."""
        return next((m for m in self.models if m.name == name), None)

    def destinations(self) -> list[Destination]:
        """Every destination named by a rule."""
        return [d for r in self.rules for d in (r.destinations or ())]


@dataclass(frozen=True)
class PlannedJob:
    """One job that a decision creates: a model, its destinations (ledger names), a priority."""

    rule: str
    model: str
    destinations: tuple[str, ...]
    priority: int


@dataclass(frozen=True)
class Decision:
    """What happens to a complete series: jobs, or ignored with a reason."""

    jobs: tuple[PlannedJob, ...] = ()
    ignored: str | None = None


# -- parsing -------------------------------------------------------------------------------


def _strings(value: Any, key: str, upper: bool = False) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(x, str) and x.strip() for x in items):
        raise ConfigError(f"{key}: must be a string or a list of non-empty strings, got {value!r}")
    return tuple(x.strip().upper() if upper else x.strip() for x in items)


def _parse_range(value: Any, key: str) -> tuple[float, float]:
    ok = isinstance(value, list | tuple) and len(value) == 2
    nums = ok and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    if not nums or not 0 <= value[0] <= value[1]:
        raise ConfigError(f"{key}: must be [min, max] in mm with 0 <= min <= max, got {value!r}")
    return (float(value[0]), float(value[1]))


def _count(value: Any, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 1_000_000:
        raise ConfigError(f"{key}: must be an integer in [0, 1000000], got {value!r}")
    return value


def _sop_class(value: str, key: str) -> str:
    if re.fullmatch(r"[0-9]+(\.[0-9]+)+", value):
        return value
    uid = getattr(pynetdicom.sop_class, value, None)
    if not isinstance(uid, str):
        raise ConfigError(f"{key}: unknown SOP class {value!r} (a UID or a keyword)")
    return str(uid)


def _parse_match(t: Mapping[str, Any], key: str) -> Match:

    regex = None
    if "series_description" in t:
        pattern = t["series_description"]
        if not isinstance(pattern, str):
            raise ConfigError(f"{key}.series_description: must be a regular expression string")
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise ConfigError(
                f"{key}.series_description: invalid regular expression: {exc}"
            ) from exc
    max_slices = _count(t["max_slices"], f"{key}.max_slices") if "max_slices" in t else None
    match = Match(
        calling_ae=tuple(
            ae_title(a, f"{key}.calling_ae")
            for a in _strings(t.get("calling_ae", []), f"{key}.calling_ae")
        )
        if "calling_ae" in t
        else (),
        modality=_strings(t["modality"], f"{key}.modality", upper=True) if "modality" in t else (),
        sop_class=tuple(
            _sop_class(c, f"{key}.sop_class") for c in _strings(t["sop_class"], f"{key}.sop_class")
        )
        if "sop_class" in t
        else (),
        image_type=_strings(t["image_type"], f"{key}.image_type", upper=True)
        if "image_type" in t
        else (),
        skip_image_types=(
            _strings(t["skip_image_types"], f"{key}.skip_image_types", upper=True)
            if t["skip_image_types"] != []
            else ()
        )
        if "skip_image_types" in t
        else DEFAULT_SKIP_IMAGE_TYPES,
        body_part=_strings(t["body_part"], f"{key}.body_part", upper=True)
        if "body_part" in t
        else (),
        series_description=regex,
        slice_thickness=_parse_range(t["slice_thickness"], f"{key}.slice_thickness")
        if "slice_thickness" in t
        else None,
        pixel_spacing=_parse_range(t["pixel_spacing"], f"{key}.pixel_spacing")
        if "pixel_spacing" in t
        else None,
        min_slices=_count(t.get("min_slices", 0), f"{key}.min_slices"),
        max_slices=max_slices,
    )
    if max_slices is not None and max_slices < match.min_slices:
        raise ConfigError(f"{key}.max_slices: {max_slices} is below min_slices {match.min_slices}")
    return match


def _parse_models(raw: Any, path: PathFn) -> tuple[ModelSpec, ...]:
    from segnode.engines.base import available_backends

    if not isinstance(raw, dict):
        raise ConfigError("[models] must be a table of [models.NAME] tables")
    out = []
    for name, t in raw.items():
        key = f"models.{name}"
        if not _MODEL_NAME.match(name):
            raise ConfigError(f"{key}: a model name is 1-48 letters, digits, '_', '-' or '.'")
        if name == DEFAULT_MODEL_NAME:
            raise ConfigError(f'{key}: the name "default" is the [model] table; pick another')
        if not isinstance(t, dict):
            raise ConfigError(f"{key}: must be a table")
        check_keys(t, SPEC_KEYS, f"{key}:")
        out.append(parse_model_spec(name, t, key, path, engines=available_backends()))
    return tuple(out)


def parse_routing(
    raw: Mapping[str, Any],
    path: PathFn,
    peer_table: Callable[[dict[str, Any], str], Peer],
) -> Routing:
    """Build :class:`Routing` from the parsed TOML (keys ``routing``, ``rules``, ``models``).

    Raises
    ------
    ConfigError
        Naming the key: an unknown key or mode, a rule naming an undeclared model, a duplicate
        rule name, an invalid regular expression, range or destination.
    """
    r = section(raw, "routing", {"mode"})
    mode = r.get("mode", "first")
    if mode not in ROUTING_MODES:
        raise ConfigError(f'routing.mode: must be "first" or "all", got {mode!r}')
    models = _parse_models(raw.get("models", {}), path)
    known = {DEFAULT_MODEL_NAME} | {m.name for m in models}
    rules: list[Rule] = []
    for i, (key, t) in enumerate(array_of_tables(raw.get("rules", []), "rules", _RULE_KEYS)):
        name = t.get("name", f"rule{i + 1}")
        if not isinstance(name, str) or not _MODEL_NAME.match(name):
            raise ConfigError(f"{key}.name: 1-48 letters, digits, '_', '-' or '.', got {name!r}")
        if any(x.name == name for x in rules):
            raise ConfigError(f"{key}.name: {name!r} is used by an earlier rule")
        key = f"rules[{i}] ({name})"
        ignore = t.get("ignore", False)
        if not isinstance(ignore, bool):
            raise ConfigError(f"{key}.ignore: must be true or false")
        if ignore and ({"models", "destinations", "priority"} & set(t)):
            raise ConfigError(f"{key}: an ignore rule takes no models, destinations or priority")
        names = _strings(t.get("models", [DEFAULT_MODEL_NAME]), f"{key}.models")
        for m in names:
            if m not in known:
                raise ConfigError(
                    f"{key}.models: {m!r} is not declared (declared: {', '.join(sorted(known))})"
                )
        dests = None
        if "destinations" in t:
            if not isinstance(t["destinations"], list):
                raise ConfigError(f"{key}.destinations: must be a list")
            dests = tuple(
                parse_destination(x, f"{key}.destinations[{j}]", path, peer_table)
                for j, x in enumerate(t["destinations"])
            )
        priority = t.get("priority")
        if priority is not None and (
            not isinstance(priority, int) or isinstance(priority, bool) or abs(priority) > 1000
        ):
            raise ConfigError(f"{key}.priority: must be an integer in [-1000, 1000]")
        rules.append(
            Rule(
                name=name,
                match=_parse_match(t, key),
                models=tuple(dict.fromkeys(names)),
                destinations=dests,
                priority=priority,
                ignore=ignore,
            )
        )
    return Routing(mode=mode, rules=tuple(rules), models=models)


# -- facts ---------------------------------------------------------------------------------


def _float(value: Any) -> float | None:
    """``value`` as a finite number; None when absent, unreadable or not finite (a header
    value no criterion can match)."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return number if math.isfinite(number) else None


def _number_element(ds: Dataset, keyword: str) -> Any:
    """The value of numeric element ``keyword`` of ``ds``; None when absent or when pydicom
    cannot convert what the file holds (an IS of ``inf`` raises OverflowError there)."""
    try:
        return ds.get(keyword)
    except (TypeError, ValueError, OverflowError):
        return None


def _pixel_spacing(value: Any) -> tuple[float, float] | None:
    """Pixel Spacing (PS3.3 C.7.6.2.1.1) as (between rows, between columns) in mm; None
    unless it is two finite positive numbers. One value reads as a single ``DSfloat``, not
    a list, and is not a pixel spacing either."""
    if not isinstance(value, Sequence) or isinstance(value, str | bytes) or len(value) != 2:
        return None
    row, col = _float(value[0]), _float(value[1])
    if row is None or col is None or row <= 0 or col <= 0:
        return None
    return (row, col)


def facts_from_dataset(
    ds: Dataset, *, calling_ae: str = "", instances: int = 1, series_uid: str | None = None
) -> SeriesFacts:
    """Read a series' facts from one of its instances (header only).

    Parameters
    ----------
    ds
        The first instance of the series (pixel data not needed).
    calling_ae
        The AE title that sent it.
    instances
        How many instances the series has; an Enhanced CT counts its frames.
    series_uid
        The series' UID (default: the dataset's).
    """
    sop_class = str(
        ds.get("SOPClassUID", "") or getattr(ds.get("file_meta"), "MediaStorageSOPClassUID", "")
    )
    measures: Dataset | None = None
    for seq in ("SharedFunctionalGroupsSequence", "PerFrameFunctionalGroupsSequence"):
        groups = ds.get(seq)
        if groups and groups[0].get("PixelMeasuresSequence"):
            measures = groups[0].PixelMeasuresSequence[0]
            break
    src = measures if measures is not None else ds
    pixel_spacing = _pixel_spacing(_number_element(src, "PixelSpacing"))
    image_type = ds.get("ImageType") or ()
    if isinstance(image_type, str):
        image_type = image_type.split("\\")
    frames = int(_float(_number_element(ds, "NumberOfFrames")) or 1)
    return SeriesFacts(
        series_instance_uid=series_uid or str(ds.get("SeriesInstanceUID", "")),
        calling_ae=calling_ae.strip(),
        modality=str(ds.get("Modality", "") or ""),
        sop_class_uid=sop_class,
        image_type=tuple(str(v).strip().upper() for v in image_type if str(v).strip()),
        body_part=str(ds.get("BodyPartExamined", "") or "").strip(),
        series_description=str(ds.get("SeriesDescription", "") or ""),
        slice_thickness=_float(_number_element(src, "SliceThickness")),
        pixel_spacing=pixel_spacing,
        slices=instances * max(1, frames),
    )


def read_facts(path: Path, *, calling_ae: str, instances: int, series_uid: str) -> SeriesFacts:
    """Facts from a spooled instance file (header only)."""
    ds = dcmread(path, stop_before_pixels=True)
    return facts_from_dataset(ds, calling_ae=calling_ae, instances=instances, series_uid=series_uid)


# -- deciding ------------------------------------------------------------------------------


class Router:
    """Applies the rules to complete series.

    Parameters
    ----------
    routing
        The parsed rules and models.
    default_destinations
        ``dispatch.destinations`` (with ``--send-to``): where a rule without ``destinations``
        sends.
    senders
        Calling AE title -> where to send results back (``"@sender"``), from ``[[node.peers]]``.
    sender_priority
        Calling AE title -> job priority when the rule gives none.
    """

    def __init__(
        self,
        routing: Routing,
        default_destinations: Sequence[Destination] = (),
        senders: Mapping[str, Peer] | None = None,
        sender_priority: Callable[[str], int] | None = None,
    ) -> None:
        self.routing = routing
        self.default_destinations = tuple(default_destinations)
        self.senders = dict(senders or {})
        self.sender_priority = sender_priority or (lambda _ae: 0)

    def _plan(self, rule: Rule, facts: SeriesFacts) -> list[PlannedJob]:
        dests = self.default_destinations if rule.destinations is None else rule.destinations
        names = tuple(dict.fromkeys(resolve(d, facts.calling_ae, self.senders) for d in dests))
        prio = (
            rule.priority if rule.priority is not None else self.sender_priority(facts.calling_ae)
        )
        return [PlannedJob(rule.name, m, names, prio) for m in rule.models]

    def decide(self, facts: SeriesFacts) -> Decision:
        """The jobs for a complete series, or why it is ignored."""
        misses: list[str] = []
        matched: list[Rule] = []
        for rule in self.routing.effective_rules:
            why = rule.match.mismatch(facts)
            if why is not None:
                misses.append(why if not self.routing.rules else f"rule {rule.name!r}: {why}")
                continue
            if self.routing.mode == "first":
                matched = [rule]
                break
            matched.append(rule)
        vetoes = [r for r in matched if r.ignore]
        if vetoes:
            return Decision(ignored=f"ignored by rule {vetoes[0].name!r}")
        if not matched:
            if not self.routing.rules:
                return Decision(ignored=f"not selected by the default rule: {misses[0]}")
            return Decision(ignored="no rule matched: " + "; ".join(misses))
        plans: dict[str, PlannedJob] = {}
        for rule in matched:
            for p in self._plan(rule, facts):
                old = plans.get(p.model)
                if old is None:
                    plans[p.model] = p
                else:
                    plans[p.model] = PlannedJob(
                        f"{old.rule}+{p.rule}",
                        p.model,
                        tuple(dict.fromkeys(old.destinations + p.destinations)),
                        max(old.priority, p.priority),
                    )
        return Decision(jobs=tuple(plans.values()))


def model_specs(config: Config) -> tuple[ModelSpec, ...]:
    """Every configured model: ``[model]`` as ``"default"``, then ``[models.NAME]``."""
    return (config.model, *config.routing.models)


def senders_from_peers(peers: Iterable[Any]) -> dict[str, Peer]:
    """Calling AE title -> return address, from ``[[node.peers]]`` entries with a ``port``."""
    out: dict[str, Peer] = {}
    for p in peers:
        ret = getattr(p, "return_peer", None)
        if isinstance(ret, Peer):
            out.setdefault(p.ae_title, ret)
    return out


# -- dry run -------------------------------------------------------------------------------


def _class_name(uid: str) -> str:
    if not uid:
        return "(absent)"
    name = UID(uid).name
    return name if name and name != uid else uid


def _within(value: float | None, bounds: tuple[float, float] | None) -> bool:
    return value is not None and bounds is not None and bounds[0] <= value <= bounds[1]


def _mm(value: float | None) -> str:
    return "(absent)" if value is None else f"{value:g} mm"


def _spacing(value: tuple[float, float] | None) -> str:
    return "(absent)" if value is None else f"{value[0]:g}\\{value[1]:g} mm"


def _range_text(bounds: tuple[float, float] | None) -> str:
    return "" if bounds is None else f"[{bounds[0]:g}, {bounds[1]:g}] mm"


@dataclass
class _SeriesFiles:
    first: Dataset
    count: int = 0
    files: list[Path] = field(default_factory=list)


def _group(files: Iterable[Path]) -> tuple[dict[str, _SeriesFiles], list[str]]:
    series: dict[str, _SeriesFiles] = {}
    problems: list[str] = []
    for f in files:
        try:
            ds = dcmread(f, stop_before_pixels=True)
        except (InvalidDicomError, OSError, ValueError) as exc:
            problems.append(f"{f}: not readable as DICOM ({exc})")
            continue
        uid = str(ds.get("SeriesInstanceUID", "") or "")
        if not uid:
            problems.append(f"{f}: no SeriesInstanceUID (the node answers 0xC212)")
            continue
        entry = series.setdefault(uid, _SeriesFiles(first=ds))
        entry.count += 1
        entry.files.append(f)
        if int(ds.get("InstanceNumber", 0) or 0) < int(entry.first.get("InstanceNumber", 0) or 0):
            entry.first = ds
    return series, problems


def dry_run(
    files: Iterable[Path],
    router: Router,
    *,
    calling_ae: str = "",
    describe_model: Callable[[str], str] = str,
    other_sop_classes: str = "ignore",
) -> list[str]:
    """What the node would do with the series in ``files``, as printable lines.

    The same decisions as a running node: SOP classes other than CT are accepted and ignored
    (or refused), the node's own SEG/SR are ignored by the loop guard, and every CT series is
    put to the rules as if ``calling_ae`` had sent it in one association.
    """
    series, problems = _group(files)
    routing = router.routing
    lines = [
        (
            f"{len(routing.rules)} rule(s), routing.mode = {routing.mode!r}"
            if routing.rules
            else "no [[rules]]: the implicit default rule (CT, not LOCALIZER, default model, "
            "dispatch.destinations)"
        )
        + (f"; calling AE {calling_ae!r}" if calling_ae else "; no calling AE (--calling-ae)")
    ]
    by_study: dict[str, list[tuple[str, _SeriesFiles]]] = defaultdict(list)
    for uid, entry in series.items():
        by_study[str(entry.first.get("StudyInstanceUID", ""))].append((uid, entry))
    for study, members in by_study.items():
        lines.append(f"study {study or '(no StudyInstanceUID)'}")
        members.sort(key=lambda m: int(m[1].first.get("SeriesNumber", 0) or 0))
        for uid, entry in members:
            ds = entry.first
            facts = facts_from_dataset(
                ds, calling_ae=calling_ae, instances=entry.count, series_uid=uid
            )
            desc = f' "{facts.series_description}"' if facts.series_description else ""
            lines.append(
                f"  series {uid}{desc}: {facts.modality or '?'}, "
                f"{_class_name(facts.sop_class_uid)}, {entry.count} instance(s)"
            )
            lines.extend(
                f"    {t}" for t in _outcome(ds, facts, router, describe_model, other_sop_classes)
            )
    lines.extend(problems)
    return lines


def _outcome(
    ds: Dataset,
    facts: SeriesFacts,
    router: Router,
    describe_model: Callable[[str], str],
    other_sop_classes: str,
) -> list[str]:
    if facts.sop_class_uid not in CT_CLASSES:
        own = str(ds.get("Manufacturer", "")) == "segnode"
        if own:
            return ["ignored: object produced by this node (loop guard)"]
        if other_sop_classes == "reject":
            return ['refused at association negotiation (node.other_sop_classes = "reject")']
        return [
            f"ignored: SOP class {_class_name(facts.sop_class_uid)} is not CT; accepted and ignored"
        ]
    out = [
        "ImageType {}, BodyPartExamined {}, SliceThickness {}, PixelSpacing {}, {} slice(s)".format(
            "\\".join(facts.image_type) or "(absent)",
            facts.body_part or "(absent)",
            _mm(facts.slice_thickness),
            _spacing(facts.pixel_spacing),
            facts.slices,
        )
    ]
    decision = router.decide(facts)
    if decision.ignored is not None:
        return [*out, f"ignored: {decision.ignored}"]
    for job in decision.jobs:
        named = [
            f"{d} (unresolved: no [[node.peers]] entry with host and port)"
            if d.startswith(SENDER + ":")
            else d
            for d in job.destinations
        ]
        dests = ", ".join(named) or "(none: results kept in data_dir/results)"
        out.append(
            f"rule {job.rule!r} -> model {job.model} ({describe_model(job.model)}), "
            f"priority {job.priority}, to {dests}"
        )
    return out


__all__ = [
    "DEFAULT_MODEL_NAME",
    "DEFAULT_SKIP_IMAGE_TYPES",
    "IMPLICIT_RULE",
    "ROUTING_MODES",
    "Decision",
    "Match",
    "ModelSpec",
    "PlannedJob",
    "Router",
    "Routing",
    "Rule",
    "SenderRef",
    "SeriesFacts",
    "dry_run",
    "facts_from_dataset",
    "model_specs",
    "parse_routing",
    "read_facts",
    "senders_from_peers",
]
