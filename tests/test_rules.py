"""Routing rules, destinations and STOW-RS encoding, without a network.

Rules are parsed from TOML text as the node parses its config, matched against headers of
real synthetic DICOM files, and the dry run (``segnode rules test``) runs as a subprocess.
"""

from __future__ import annotations

import email
import email.policy
import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydicom import dcmread
from pydicom.dataelem import RawDataElement
from pydicom.tag import Tag

from segnode.node.config import DEFAULT_MODEL, from_dict
from segnode.node.errors import ConfigError
from segnode.node.outbox.stow import StowTarget, multipart_related, parse_response
from segnode.node.peers import Peer
from segnode.node.routing.destinations import SenderRef, from_name, resolve
from segnode.node.routing.rules import (
    IMPLICIT_RULE,
    Router,
    Routing,
    SeriesFacts,
    facts_from_dataset,
)
from tests.fixtures.sample_study import write_sample_study
from tests.fixtures.synthetic import PhantomGeometry, write_enhanced_ct

ROOT = Path(__file__).resolve().parent.parent


def cfg(text: str, base: Path | None = None) -> Any:
    """Parse TOML text with the node's config parser."""
    return from_dict(tomllib.loads(text), base_dir=base)


def facts(**kw: Any) -> SeriesFacts:
    base: dict[str, Any] = {
        "series_instance_uid": "1.2.3",
        "calling_ae": "CT1",
        "modality": "CT",
        "sop_class_uid": "1.2.840.10008.5.1.4.1.1.2",
        "image_type": ("ORIGINAL", "PRIMARY", "AXIAL"),
        "body_part": "CHEST",
        "series_description": "Thorax 1.25 mm",
        "slice_thickness": 1.25,
        "pixel_spacing": (0.7, 0.7),
        "slices": 100,
    }
    return SeriesFacts(**{**base, **kw})


def router(text: str, **kw: Any) -> Router:
    c = cfg(text)
    return Router(c.routing, c.dispatch.destinations, **kw)


RULES = f"""
[dispatch]
destinations = ["PACS@10.0.0.5:104"]

[models.lungs]
manifest = "{DEFAULT_MODEL}"

[[rules]]
name = "chest"
modality = "CT"
body_part = ["chest", "THORAX"]
series_description = "thorax|lung"
slice_thickness = [0.5, 3.0]
pixel_spacing = [0.3, 1.0]
min_slices = 64
max_slices = 2000
models = ["default", "lungs"]
destinations = ["@sender", "stow:http://127.0.0.1:8042/dicom-web/"]
priority = 5

[[rules]]
name = "other-ct"
calling_ae = ["CT2"]
sop_class = ["CTImageStorage", "1.2.840.10008.5.1.4.1.1.2.1"]
image_type = ["AXIAL"]
"""


def test_first_match_wins_with_models_destinations_priority() -> None:
    r = router(RULES, senders={"CT1": Peer("CT1STORE", "10.0.0.9", 4006)})
    d = r.decide(facts())
    assert d.ignored is None
    assert [(j.rule, j.model, j.priority) for j in d.jobs] == [
        ("chest", "default", 5),
        ("chest", "lungs", 5),
    ]
    assert d.jobs[0].destinations == (
        "CT1STORE@10.0.0.9:4006",
        "stow:http://127.0.0.1:8042/dicom-web",
    )
    # The second rule has no destinations: dispatch.destinations; no priority: the sender's.
    r2 = router(RULES, sender_priority=lambda ae: {"CT2": 7}.get(ae, 0))
    d2 = r2.decide(facts(calling_ae="CT2", body_part="HEAD"))
    assert [(j.rule, j.model, j.destinations, j.priority) for j in d2.jobs] == [
        ("other-ct", "default", ("PACS@10.0.0.5:104",), 7)
    ]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"image_type": ("ORIGINAL", "PRIMARY", "LOCALIZER")}, "has LOCALIZER (skip_image_types)"),
        ({"image_type": ("DERIVED", "SECONDARY", "MPR")}, "has DERIVED (skip_image_types)"),
        ({"modality": "MR"}, "Modality MR not in ['CT']"),
        ({"body_part": ""}, "BodyPartExamined (absent) not in ['CHEST', 'THORAX']"),
        ({"series_description": "Abdomen"}, "SeriesDescription 'Abdomen' does not match"),
        ({"slice_thickness": 5.0}, "SliceThickness 5 mm outside [0.5, 3] mm"),
        ({"slice_thickness": None}, "SliceThickness (absent) outside"),
        ({"pixel_spacing": (0.7, 1.2)}, "PixelSpacing 0.7\\1.2 mm outside [0.3, 1] mm"),
        ({"slices": 20}, "20 slice(s), fewer than min_slices 64"),
        ({"slices": 3000}, "3000 slice(s), more than max_slices 2000"),
    ],
)
def test_why_no_rule_matched(change: dict[str, Any], reason: str) -> None:
    d = router(RULES).decide(facts(**change))
    assert d.jobs == ()
    assert d.ignored is not None and d.ignored.startswith("no rule matched: rule 'chest': ")
    assert reason in d.ignored
    assert "rule 'other-ct': calling AE 'CT1' not in ['CT2']" in d.ignored


def test_second_rule_criteria() -> None:
    r = router(RULES)
    base = {"calling_ae": "CT2", "body_part": "HEAD"}
    assert r.decide(facts(**base)).jobs
    assert "lacks AXIAL" in str(r.decide(facts(**base, image_type=("ORIGINAL",))).ignored)
    other = r.decide(facts(**base, sop_class_uid="1.2.840.10008.5.1.4.1.1.4"))
    assert "SOP class MR Image Storage not in sop_class" in str(other.ignored)


def test_mode_all_merges_and_ignore_vetoes() -> None:
    text = f"""
[routing]
mode = "all"
[models.second]
manifest = "{DEFAULT_MODEL}"
[[rules]]
name = "a"
destinations = ["A@h:1"]
priority = 1
[[rules]]
name = "b"
models = ["default", "second"]
destinations = ["B@h:2", "A@h:1"]
priority = 3
[[rules]]
name = "no-scouts"
ignore = true
image_type = ["LOCALIZER"]
skip_image_types = []
"""
    r = router(text)
    d = r.decide(facts())
    assert [(j.rule, j.model, j.destinations, j.priority) for j in d.jobs] == [
        ("a+b", "default", ("A@h:1", "B@h:2"), 3),
        ("b", "second", ("B@h:2", "A@h:1"), 3),
    ]
    scout = r.decide(facts(image_type=("ORIGINAL", "PRIMARY", "LOCALIZER")))
    assert scout.ignored == "ignored by rule 'no-scouts'"


def test_implicit_rule_is_todays_behaviour() -> None:
    r = Router(Routing(), (Peer("PACS", "h", 104),))
    assert r.routing.effective_rules == (IMPLICIT_RULE,)
    d = r.decide(facts(image_type=("DERIVED", "SECONDARY", "OTHER"), body_part=""))
    assert [(j.model, j.destinations) for j in d.jobs] == [("default", ("PACS@h:104",))]
    loc = r.decide(facts(image_type=("ORIGINAL", "PRIMARY", "LOCALIZER")))
    assert loc.ignored == (
        "not selected by the default rule: ImageType ORIGINAL\\PRIMARY\\LOCALIZER has "
        "LOCALIZER (skip_image_types)"
    )


def test_sender_resolution() -> None:
    senders = {"CT1": Peer("CT1", "10.1.1.1", 104)}
    assert resolve(SenderRef(), "CT1", senders) == "CT1@10.1.1.1:104"
    assert resolve(SenderRef(), "UNKNOWN", senders) == "@sender:UNKNOWN"
    assert from_name("@sender:UNKNOWN") is None
    assert from_name("stow:http://h:8042/dicom-web") == StowTarget("http://h:8042/dicom-web")
    assert from_name("PACS@h:104") == Peer("PACS", "h", 104)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[routing]\nmode = "any"', "routing.mode"),
        ("[routing]\nfoo = 1", r"\[routing\] unknown key"),
        ('[[rules]]\nmodels = ["nope"]', r"rules\[0\] \(rule1\)\.models: 'nope' is not declared"),
        ('[[rules]]\nname = "a"\n[[rules]]\nname = "a"', r"rules\[1\]\.name: 'a' is used"),
        ('[[rules]]\nseries_description = "("', r"rules\[0\] \(rule1\)\.series_description"),
        ("[[rules]]\nslice_thickness = [3, 1]", r"\.slice_thickness: must be \[min, max\]"),
        ("[[rules]]\npixel_spacing = 1", r"\.pixel_spacing"),
        ("[[rules]]\nmin_slices = 10\nmax_slices = 5", r"\.max_slices: 5 is below"),
        ("[[rules]]\ncolour = 1", r"rules\[0\]: unknown key"),
        ('[[rules]]\ncalling_ae = ["' + "A" * 17 + '"]', r"\.calling_ae: AE title"),
        ('[[rules]]\nsop_class = ["NoSuchStorage"]', r"\.sop_class: unknown SOP class"),
        ('[[rules]]\ndestinations = ["PACS@host"]', r"\.destinations\[0\]: expected AE@HOST"),
        ('[[rules]]\ndestinations = ["stow:ftp://x"]', r"\.destinations\[0\]: expected an http"),
        ('[[rules]]\ndestinations = ["@origin"]', r"\.destinations\[0\]: unknown reference"),
        ('[[rules]]\ndestinations = [{stow = "http://h/dw", verify = false}]', "https URLs only"),
        ('[[rules]]\ndestinations = [{stow = "http://h/dw", password_file = "x"}]', "not found"),
        ("[[rules]]\nignore = true\npriority = 3", "an ignore rule takes no"),
        ("[[rules]]\npriority = 5000", r"\.priority"),
        ('[models.default]\nmanifest = "x.json"', 'the name "default" is the \\[model\\] table'),
        ('[models."bad name"]\nmanifest = "x.json"', "models.bad name: a model name"),
        ('[models.m]\nmanifest = "/nonexistent.json"', r"models\.m\.manifest: file not found"),
        ('[models.m]\nengine = "x"', r"models\.m\.manifest: missing"),
        (f'[models.m]\nmanifest = "{DEFAULT_MODEL}"\nengine = "nope"', r"models\.m\.engine"),
        ('[dispatch]\ndestinations = ["stow:nothing"]', r"dispatch\.destinations\[0\]"),
    ],
)
def test_invalid_routing_names_the_key(text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        cfg(text)


def test_peers_return_address_validation() -> None:
    c = cfg(
        """
[[node.peers]]
ae_title = "CT1"
host = "10.0.0.7"
port = 4006
return_ae_title = "CT1_STORE"
[[node.peers]]
ae_title = "CT2"
host = "10.0.0.0/24"
"""
    )
    assert c.node.peers[0].return_peer == Peer("CT1_STORE", "10.0.0.7", 4006)
    assert c.node.peers[1].return_peer is None
    with pytest.raises(ConfigError, match=r"node\.peers\[0\]\.host: .*not a network"):
        cfg('[[node.peers]]\nae_title = "X"\nhost = "10.0.0.0/24"\nport = 104')
    with pytest.raises(ConfigError, match=r"node\.peers\[0\]\.port"):
        cfg('[[node.peers]]\nae_title = "X"\nport = 104')
    with pytest.raises(ConfigError, match=r"node\.peers\[0\]: TLS options given"):
        cfg('[[node.peers]]\nae_title = "X"\nhost = "h"\nport = 104\nverify = false')


def test_facts_from_ct_and_enhanced_ct(tmp_path: Path) -> None:
    files = write_sample_study(tmp_path, slices=4, size=16)
    ds = dcmread(files["localizer"][0], stop_before_pixels=True)
    f = facts_from_dataset(ds, calling_ae=" CT1 ", instances=2)
    assert f.image_type == ("ORIGINAL", "PRIMARY", "LOCALIZER")
    assert (f.calling_ae, f.modality, f.slices, f.slice_thickness) == ("CT1", "CT", 2, 1.0)
    assert f.pixel_spacing == (1.0, 1.0) and f.body_part == "CHEST"
    enh = write_enhanced_ct(
        tmp_path / "enh.dcm",
        PhantomGeometry(rows=16, columns=16, slices=6, pixel_spacing=0.8, slice_spacing=2.0),
    )
    e = facts_from_dataset(dcmread(enh, stop_before_pixels=True))
    assert e.sop_class_uid == "1.2.840.10008.5.1.4.1.1.2.1"
    assert (e.slices, e.slice_thickness, e.pixel_spacing) == (6, 2.0, (0.8, 0.8))


def _as_read(ds: Any, keyword: str, vr: str, text: bytes) -> None:
    """Give ``ds`` the element ``keyword`` holding ``text`` as a file would."""
    tag = Tag(keyword)
    ds[tag] = RawDataElement(tag, vr, len(text), text, 0, True, True)


@pytest.mark.filterwarnings("ignore:Invalid value for VR")
@pytest.mark.parametrize(
    ("spacing", "thickness", "frames"),
    [
        (b"0.7 ", b"1.25", None),  # one value: pydicom gives a DSfloat, which has no len()
        (b"nan\\0.7 ", b"nan ", b"nan "),
        (b"0.7\\inf ", b"inf ", b"inf "),
        (b"0\\0.7 ", b"1.25", None),
        (b"-0.7\\-0.7", b"1.25", None),
        (b"0.7\\0.7\\0.7 ", b"1.25", None),
        (b"0.7\\abc ", b"abc ", b"abc "),
    ],
    ids=["one-value", "nan", "inf", "zero", "negative", "three-values", "text"],
)
def test_facts_from_unusable_values_match_no_spacing_criterion(
    tmp_path: Path, spacing: bytes, thickness: bytes, frames: bytes | None
) -> None:
    """Header values no geometry comes from are facts no criterion matches, not a
    TypeError that stops the series from completing."""
    files = write_sample_study(tmp_path, slices=2, size=16)
    ds = dcmread(files["axial"][0], stop_before_pixels=True)
    _as_read(ds, "PixelSpacing", "DS", spacing)
    _as_read(ds, "SliceThickness", "DS", thickness)
    if frames is not None:
        _as_read(ds, "NumberOfFrames", "IS", frames)
    f = facts_from_dataset(ds, instances=3)
    assert f.pixel_spacing is None and f.slices == 3
    assert f.slice_thickness == (1.25 if thickness == b"1.25" else None)
    d = router('[[rules]]\nname = "fine"\npixel_spacing = [0.3, 1.0]').decide(f)
    assert d.jobs == ()
    assert d.ignored is not None and "rule 'fine': PixelSpacing (absent) outside" in d.ignored


def test_multipart_related_is_parseable() -> None:
    parts = [b"\x00" * 128 + b"DICM\r\n--not-a-boundary", b"second"]
    body = multipart_related(parts, "segnode-b1")
    msg = email.message_from_bytes(
        b'Content-Type: multipart/related; type="application/dicom"; boundary=segnode-b1\r\n\r\n'
        + body,
        policy=email.policy.HTTP,
    )
    got = [p.get_payload(decode=True) for p in msg.iter_parts()]  # type: ignore[attr-defined]
    assert got == parts
    assert all(p.get_content_type() == "application/dicom" for p in msg.iter_parts())  # type: ignore[attr-defined]


def test_stow_response_parsing() -> None:
    body = {
        "00081198": {
            "vr": "SQ",
            "Value": [
                {
                    "00081155": {"vr": "UI", "Value": ["1.2.3"]},
                    "00081197": {"vr": "US", "Value": [0xA700]},
                }
            ],
        },
        "00081199": {
            "vr": "SQ",
            "Value": [
                {
                    "00081155": {"vr": "UI", "Value": ["1.2.4"]},
                    "00081196": {"vr": "US", "Value": [0xB000]},
                }
            ],
        },
    }
    raw = json.dumps(body).encode()
    assert parse_response(raw, "1.2.3") == ("Failure Reason 0xA700", None)
    assert parse_response(raw, "1.2.4") == (None, "Warning Reason 0xB000")
    assert parse_response(b"", "1.2.3") == (None, None)
    assert parse_response(b"<html>", "1.2.3") == (None, None)


def test_rules_test_command_on_sample_study(tmp_path: Path) -> None:
    """``segnode rules test`` on a localizer + axial series + dose SR, with @sender resolved."""
    write_sample_study(tmp_path / "study", slices=8, size=16)
    config = tmp_path / "config.toml"
    config.write_text(
        f"""
data_dir = "{tmp_path / "data"}"
[[node.peers]]
ae_title = "MODALITY"
host = "127.0.0.1"
port = 4006
[[rules]]
name = "chest-ct"
modality = "CT"
body_part = ["CHEST"]
min_slices = 4
destinations = ["@sender", "stow:http://127.0.0.1:8042/dicom-web"]
"""
    )
    out = subprocess.run(
        [sys.executable, "-m", "segnode.node.ops.cli", "rules", "test", str(tmp_path / "study")]
        + ["--config", str(config), "--calling-ae", "MODALITY"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "1 rule(s), routing.mode = 'first'; calling AE 'MODALITY'" in text
    assert (
        "ignored: no rule matched: rule 'chest-ct': ImageType ORIGINAL\\PRIMARY\\LOCALIZER has "
        "LOCALIZER (skip_image_types)" in text
    )
    assert (
        "rule 'chest-ct' -> model default (tissue 1.0.0 on onnxruntime), priority 0, "
        "to MODALITY@127.0.0.1:4006, stow:http://127.0.0.1:8042/dicom-web" in text
    )
    assert "ignored: SOP class X-Ray Radiation Dose SR Storage is not CT" in text
    assert "Thorax 1.25 mm" in text and "Topogram" in text


def test_ledger_jobs_per_model_and_ignored_series(tmp_path: Path) -> None:
    """One version, one job per model with its own UIDs and destinations; ignoring clears the
    series' pending state and lists it with the reason until new instances arrive."""
    from segnode.storage.ledger import InstanceRecord, Ledger, NewJob

    ledger = Ledger(tmp_path / "ledger.sqlite")

    def add(sop: str, series: str) -> None:
        rec = InstanceRecord(sop, "1.2.840.10008.5.1.4.1.1.2", series, "1.2.9", "1.2", "CT", "CT1")
        ledger.record_instance(rec, tmp_path / sop, 1)

    add("1.2.3.1", "1.2.5")
    specs = [
        NewJob("default", "tissue 1.0.0", "onnxruntime", ("A@h:1",), 2, "chest"),
        NewJob("lungs", "lungs 2.0", "tensorrt", ("stow:http://h/dw",), 2, "chest"),
    ]
    ids = ledger.create_jobs("1.2.5", trigger="t", jobs=specs)
    assert len(ids) == 2 and ledger.create_jobs("1.2.5", trigger="t", jobs=specs) == []
    a, b = (ledger.job(i) for i in ids)
    assert a is not None and b is not None
    assert (a.version, b.version) == (1, 1)
    assert (a.model_name, b.model_name, b.rule, b.engine) == (
        "default",
        "lungs",
        "chest",
        "tensorrt",
    )
    assert (a.destinations, b.destinations) == (("A@h:1",), ("stow:http://h/dw",))
    assert len({a.seg_sop_uid, b.seg_sop_uid, a.sr_sop_uid, b.sr_sop_uid}) == 4
    claimed = ledger.claim_next_job()
    assert claimed is not None and ledger.queued_siblings(claimed.id) == 1

    add("1.2.3.2", "1.2.6")
    summary = ledger.series_summary("1.2.6")
    assert summary is not None and (summary.calling_ae, summary.instance_count) == ("CT1", 1)
    assert ledger.ignore_series("1.2.6", "no rule matched: x")
    assert not ledger.ignore_series("1.2.6", "again")
    assert ledger.series_summary("1.2.6") is None and "1.2.6" not in ledger.pending_series()
    assert ledger.ignored_series() == [("1.2.6", "CT1", "no rule matched: x")]
    add("1.2.3.3", "1.2.6")  # a new instance: pending again, no longer listed as ignored
    assert ledger.ignored_series() == [] and "1.2.6" in ledger.pending_series()
    ledger.close()
