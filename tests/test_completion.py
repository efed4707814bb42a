"""Completion policies (unit level): which signal completes whose series, and their config."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.config import from_dict
from node.errors import ConfigError
from node.series import GEOMETRY, RELEASE, CompletionTracker

Done = list[tuple[str, str]]


def tracker(policies: dict[str, str], **kw: bool) -> tuple[CompletionTracker, Done]:
    done: Done = []
    t = CompletionTracker(
        lambda s, trig: done.append((s, trig)), policy=lambda ae: policies.get(ae, "auto"), **kw
    )
    return t, done


def test_release_counts_only_for_release_policies() -> None:
    t, done = tracker({"SPLIT": "geometry", "SLOW": "quiet", "REL": "release"})
    for n, ae in enumerate(["SPLIT", "SLOW", "REL", "ANY"]):
        t.opened(n, ae)
        t.touched(n, f"s-{ae}")
        t.closed(n, released=True)
    assert done == [("s-REL", RELEASE), ("s-ANY", RELEASE)]


def test_geometry_counts_only_for_geometry_policies() -> None:
    t, done = tracker({"SPLIT": "geometry", "SLOW": "quiet", "REL": "release"})
    assert [t.geometry_complete(f"s-{ae}", ae) for ae in ("SPLIT", "SLOW", "REL", "ANY")] == [
        True,
        False,
        False,
        True,
    ]
    assert done == [("s-SPLIT", GEOMETRY), ("s-ANY", GEOMETRY)]


def test_complete_on_release_false_disables_release_everywhere() -> None:
    t, done = tracker({"REL": "release"}, complete_on_release=False)
    t.opened(1, "REL")
    t.touched(1, "s")
    assert t.closed(1, released=True) == []
    assert t.geometry_complete("s", "ANY")
    assert done == [("s", GEOMETRY)]


def test_a_failing_callback_does_not_escape() -> None:
    def boom(_s: str, _t: str) -> None:
        raise RuntimeError("ledger down")

    t = CompletionTracker(boom)
    t.opened(1, "X")
    t.touched(1, "s")
    assert t.closed(1, released=True) == ["s"]


def test_sender_config(tmp_path: Path) -> None:
    manifest = tmp_path / "m.json"
    manifest.write_text("{}")
    base = {"model": {"manifest": str(manifest)}}
    cfg = from_dict(
        {
            **base,
            "series": {
                "completion": "release",
                "senders": [
                    {"ae_title": "CT_ER", "priority": 10},
                    {"ae_title": "SPLITTER", "completion": "geometry"},
                ],
            },
            "streaming": {"workers": 3, "max_memory_mb": 512},
            "metrics": {"enabled": True, "port": 0},
        }
    )
    assert cfg.series.policy_for("CT_ER").priority == 10
    assert cfg.series.policy_for("CT_ER").completion == "auto"
    assert cfg.series.policy_for("SPLITTER").completion == "geometry"
    assert cfg.series.policy_for("OTHER").completion == "release"  # series.completion
    assert cfg.series.policy_for("OTHER").priority == 0
    assert (cfg.streaming.workers, cfg.streaming.max_memory_mb) == (3, 512)
    assert cfg.metrics.enabled and cfg.metrics.host == "127.0.0.1"
    bad = [
        ({"completion": "soon"}, "series.completion"),
        ({"senders": [{"ae_title": "A", "completion": "x"}]}, "series.senders[0].completion"),
        ({"senders": [{"ae_title": "A"}, {"ae_title": "A"}]}, "listed twice"),
        ({"senders": [{"completion": "auto"}]}, "series.senders[0].ae_title"),
        ({"senders": [{"ae_title": "A", "prio": 1}]}, "unknown key"),
        ({"senders": {"ae_title": "A"}}, "array of tables"),
    ]
    for series, msg in bad:
        with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            from_dict({**base, "series": series})
    with pytest.raises(ConfigError, match="streaming.workers"):
        from_dict({**base, "streaming": {"workers": 0}})
    with pytest.raises(ConfigError, match="metrics.port"):
        from_dict({**base, "metrics": {"port": 70000}})
