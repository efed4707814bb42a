"""``mirror_axes`` of a model table: a trained model's test-time mirroring set per model."""

from __future__ import annotations

from pathlib import Path

import pytest

from segnode.engines.base import EngineError
from segnode.node.config import from_dict
from segnode.node.errors import ConfigError
from segnode.node.modelspec import load_spec_manifest
from segnode.node.routing.rules import model_specs

REPO = Path(__file__).resolve().parent.parent
PHANTOM = REPO / "tests" / "data" / "nnunet_phantom" / "phantom.json"
TISSUE = REPO / "engines" / "models" / "tissue" / "tissue.json"


def test_override_replaces_the_manifests_mirroring() -> None:
    cfg = from_dict({"model": {"manifest": str(PHANTOM), "mirror_axes": [2]}})
    manifest = load_spec_manifest(cfg.model)
    assert manifest.model_contract().mirror_axes == (2,)
    plain = from_dict({"model": {"manifest": str(PHANTOM)}})
    assert load_spec_manifest(plain.model).model_contract().mirror_axes == (0, 1, 2)
    off = from_dict(
        {
            "models": {"quick": {"manifest": str(PHANTOM), "mirror_axes": []}},
        }
    )
    specs = {s.name: s for s in model_specs(off)}
    assert load_spec_manifest(specs["quick"]).model_contract().mirror_axes == ()


@pytest.mark.parametrize("value", [[3], [0, 0], "all", [True], 1])
def test_invalid_axes_name_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match=r"model\.mirror_axes"):
        from_dict({"model": {"manifest": str(PHANTOM), "mirror_axes": value}})


def test_a_version_1_model_has_no_mirroring_to_set() -> None:
    cfg = from_dict({"model": {"manifest": str(TISSUE), "mirror_axes": []}})
    with pytest.raises(EngineError, match="version-1"):
        load_spec_manifest(cfg.model)
