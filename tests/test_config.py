"""Configuration parsing: defaults, validation messages naming the key, overrides."""

from __future__ import annotations

import re
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest

from segnode.node.config import ROOT_CONFIG, Config, from_dict, load_config
from segnode.node.config.schema import SETTING, Accepts
from segnode.node.errors import ConfigError
from segnode.node.peers import parse_peer


def test_repository_config_matches_defaults() -> None:
    cfg = load_config(ROOT_CONFIG)
    default = from_dict({})
    assert cfg.node == default.node
    assert cfg.series == default.series
    assert cfg.dispatch == default.dispatch
    assert cfg.model.engine == "onnxruntime"
    assert cfg.data_dir == ROOT_CONFIG.parent / "data"


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"node": {"ae_title": "A" * 17}}, "node.ae_title"),
        ({"node": {"ae_title": "BAD\\AE"}}, "node.ae_title"),
        ({"node": {"port": 70000}}, "node.port"),
        ({"node": {"port": "104"}}, "node.port"),
        ({"node": {"other_sop_classes": "drop"}}, "node.other_sop_classes"),
        ({"node": {"colour": 1}}, "[node] unknown key"),
        ({"series": {"quiet_period_s": -1}}, "series.quiet_period_s"),
        ({"series": {"min_slices": 1}}, "series.min_slices"),
        ({"dispatch": {"destinations": ["PACS@host"]}}, "dispatch.destinations[0]"),
        ({"model": {"manifest": "/nonexistent/model.json"}}, "model.manifest"),
        ({"nonsense": 1}, "unknown top-level"),
    ],
)
def test_invalid_values_name_the_key(raw: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        from_dict(raw)


def _settings() -> list[tuple[str, str, str, Accepts, object]]:
    """``(table, key, type, accepts, default)`` of every :func:`setting` of every table."""
    out = []
    for table in fields(Config):
        cls = type(getattr(Config(), table.name))
        if not is_dataclass(cls):
            continue
        for f in fields(cls):
            if SETTING in f.metadata:
                out.append((table.name, f.name, str(f.type), f.metadata[SETTING], f.default))
    return out


SETTINGS = _settings()


def test_settings_cover_the_scalar_keys_of_every_table() -> None:
    tables = {t for t, *_ in SETTINGS}
    assert {"node", "series", "dispatch", "tls", "retention", "streaming"} <= tables
    assert {"metrics", "results", "web", "ledger", "model"} <= tables
    assert len(SETTINGS) >= 45


#: Settings checked against another: its range is tried with the other at its widest.
COMPANIONS: dict[str, dict[str, object]] = {
    "dispatch.retry_initial_s": {"retry_max_s": 86400},
    "dispatch.retry_max_s": {"retry_initial_s": 0.01},
}


@pytest.mark.parametrize(
    ("table", "key", "kind", "accepts", "default"),
    SETTINGS,
    ids=[f"{t}.{k}" for t, k, *_ in SETTINGS],
)
def test_each_setting_takes_its_range_and_refuses_what_is_outside(
    table: str, key: str, kind: str, accepts: Accepts, default: object
) -> None:
    """The default lies within what the setting accepts; a bound is taken, a value past it, a
    value of another type and a string outside the choices are refused naming the key."""
    name = f"{table}.{key}"
    others = COMPANIONS.get(name, {})

    def read(value: object) -> object:
        return getattr(getattr(from_dict({table: {**others, key: value}}), table), key)

    def refused(value: object) -> None:
        with pytest.raises(ConfigError, match=rf"^{re.escape(name)}: "):
            from_dict({table: {**others, key: value}})

    assert getattr(getattr(Config(), table), key) == default
    refused("nonsense" if kind != "str" else 5)
    if kind == "bool":
        assert isinstance(default, bool)
        refused(1)
        return
    if kind == "str":
        assert isinstance(default, str)
        if accepts.choices:
            assert default in accepts.choices
            refused(default + "x")
            assert read(accepts.choices[-1]) == accepts.choices[-1]
        return
    assert kind in ("int", "float") and isinstance(default, int | float)
    refused(True)
    if kind == "int":
        refused(float(default) + 0.5)
    step = 1 if kind == "int" else 0.001
    if accepts.low is not None:
        assert default >= accepts.low
        assert read(accepts.low) == accepts.low
        refused(accepts.low - step)
    if accepts.high is not None:
        assert default <= accepts.high
        assert read(accepts.high) == accepts.high
        refused(accepts.high + step)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "c.toml"
    p.write_text("[node\nport = 1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(p)


def test_overrides() -> None:
    cfg = from_dict({}).with_overrides(
        port=4242, ae_title="EDGE", send_to=["PACS@127.0.0.1:4243", "B@[::1]:5"]
    )
    assert cfg.node.port == 4242
    assert cfg.node.ae_title == "EDGE"
    assert [p.name for p in cfg.dispatch.destinations] == ["PACS@127.0.0.1:4243", "B@::1:5"]
    with pytest.raises(ConfigError, match="--port"):
        from_dict({}).with_overrides(port=0)


def test_parse_peer() -> None:
    p = parse_peer("ORTHANC@127.0.0.1:4242")
    assert (p.ae_title, p.host, p.port) == ("ORTHANC", "127.0.0.1", 4242)
    with pytest.raises(ConfigError):
        parse_peer("ORTHANC@127.0.0.1")


def test_results_segmentation_type() -> None:
    assert from_dict({}).results.segmentation_type == "BINARY"
    labelmap = {"results": {"segmentation_type": "LABELMAP"}}
    assert from_dict(labelmap).results.segmentation_type == "LABELMAP"
    with pytest.raises(ConfigError, match="results.segmentation_type"):
        from_dict({"results": {"segmentation_type": "FRACTIONAL"}})
    with pytest.raises(ConfigError, match="results"):
        from_dict({"results": {"segmentation": "BINARY"}})


def test_one_model_type_for_model_and_models(tmp_path: Path) -> None:
    """``[model]`` and ``[models.NAME]`` are the same type (ModelSpec; [model] adds ``load``),
    validated by one function: the same bad value gives the same message under either."""
    from segnode.node.modelspec import ModelSpec
    from segnode.node.routing.rules import model_specs

    config = from_dict({})
    assert isinstance(config.model, ModelSpec) and config.model.name == "default"
    assert model_specs(config)[0] is config.model
    manifest = str(config.model.manifest)
    for field, bad in (("threads", 999), ("precision", "fp8"), ("compile", "yes")):
        with pytest.raises(ConfigError) as default:
            from_dict({"model": {field: bad}})
        with pytest.raises(ConfigError) as named:
            from_dict({"models": {"ct": {"manifest": manifest, field: bad}}})
        assert str(default.value).replace("model.", "X.", 1) == str(named.value).replace(
            "models.ct.", "X.", 1
        )
