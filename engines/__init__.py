"""Inference engines: a backend interface, a registry by name, model manifests, sliding window."""

from segnode.engines.base import (
    Engine,
    EngineError,
    available_backends,
    create_engine,
    register_backend,
)
from segnode.engines.manifest import LabelSpec, ModelManifest
from segnode.engines.manifest_parse import load_manifest

__all__ = [
    "Engine",
    "EngineError",
    "LabelSpec",
    "ModelManifest",
    "available_backends",
    "create_engine",
    "load_manifest",
    "register_backend",
]
