"""Models shipped with segnode and the scripts that build them.

Each model lives in its own folder (``tissue/tissue.onnx`` beside ``tissue/tissue.json``);
:func:`default_manifest_path` names the default one.
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
"""Folder holding one sub-folder per shipped model."""

DEFAULT_MODEL = "tissue"
"""Name of the model a node uses when its configuration names none."""


def default_manifest_path() -> Path:
    """Path of the default model's manifest (``tissue/tissue.json``)."""
    return MODELS_DIR / DEFAULT_MODEL / f"{DEFAULT_MODEL}.json"
