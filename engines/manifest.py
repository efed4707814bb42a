"""Model manifests: the JSON file next to each ONNX model describing how to run it.

A manifest ``<model>.json`` sits next to ``<model>.onnx`` and holds::

    {
      "name": "tissue", "version": "1.0.0", "onnx": "tissue.onnx",
      "input_name": "ct", "output_name": "logits",
      "output_kind": "logits",            # logits | probabilities | labels
      "patch_size": [64, 256, 256],       # (z, y, x) voxels
      "overlap": 0.25,                    # fraction of the patch: every axis, or [z, y, x]
      "batch": {"min": 1, "opt": 1, "max": 2},
      "fp16": false,                      # may a backend run it in half precision
      "preprocessing": {"clip": [-1024, 3071], "scale": 1.0, "offset": 0.0},
      "labels": [
        {"value": 1, "name": "Body", "category": ["91723000", "SCT", "Anatomical Structure"],
         "type": ["38266002", "SCT", "Entire body"], "color": [255, 224, 189]}
      ]
    }

The network sees ``clip(HU) * scale + offset`` as a float32 tensor of shape
``(N, 1, Z, Y, X)`` and returns ``(N, C, Z, Y, X)`` with ``C = 1 + number of labels``;
channel 0 is background, channel ``i`` is label value ``i``. A model with ``"output_kind":
"labels"`` returns the label value itself, ``(N, 1, Z, Y, X)``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.base import EngineError

Code = tuple[str, str, str]  # (value, scheme designator, meaning)


@dataclass(frozen=True)
class LabelSpec:
    """One output class of a model, with its SNOMED CT codes."""

    value: int
    name: str
    category: Code
    type: Code
    color: tuple[int, int, int] = (255, 0, 0)


@dataclass(frozen=True)
class ModelManifest:
    """Everything a backend needs to run one ONNX model."""

    name: str
    version: str
    onnx_path: Path
    labels: tuple[LabelSpec, ...]
    patch_size: tuple[int, int, int]
    overlap: float | tuple[float, float, float] = 0.5
    """One fraction for every axis, or ``(z, y, x)``."""
    input_name: str = "input"
    output_name: str = "output"
    output_kind: str = "logits"
    batch_min: int = 1
    batch_opt: int = 1
    batch_max: int = 1
    fp16: bool = False
    clip: tuple[float, float] | None = None
    scale: float = 1.0
    offset: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        """Number of output channels, background included."""
        return 1 + len(self.labels)

    def sha256(self) -> str:
        """SHA-256 of the ONNX file (engine cache key)."""
        h = hashlib.sha256()
        with self.onnx_path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    def label(self, value: int) -> LabelSpec:
        """Return the label with ``value``."""
        for spec in self.labels:
            if spec.value == value:
                return spec
        raise KeyError(value)


def _code(raw: Any, where: str) -> Code:
    ok = isinstance(raw, list | tuple) and len(raw) == 3
    if not (ok and all(isinstance(x, str) for x in raw)):
        raise EngineError(f"{where}: expected [value, scheme, meaning], got {raw!r}")
    return (raw[0], raw[1], raw[2])


def _overlap(raw: Any, where: Path) -> float | tuple[float, float, float]:
    """A number, or ``[z, y, x]``, each in ``[0, 1)``."""
    if isinstance(raw, list) and len(raw) == 3:
        values = [float(v) for v in raw]
    elif isinstance(raw, int | float) and not isinstance(raw, bool):
        values = [float(raw)]
    else:
        raise EngineError(f"{where}: overlap must be a number or [z, y, x], got {raw!r}")
    if not all(0.0 <= v < 1.0 for v in values):
        raise EngineError(f"{where}: overlap must be in [0, 1)")
    return values[0] if len(values) == 1 else (values[0], values[1], values[2])


def load_manifest(path: str | Path) -> ModelManifest:
    """Read and validate a model manifest.

    Parameters
    ----------
    path
        The manifest JSON file, or the ONNX file (``.json`` beside it is read).
    """
    p = Path(path)
    if p.suffix == ".onnx":
        p = p.with_suffix(".json")
    try:
        raw = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read model manifest {p}: {exc}") from exc
    try:
        labels = tuple(
            LabelSpec(
                value=int(item["value"]),
                name=str(item["name"]),
                category=_code(item["category"], f"{p}: labels[{i}].category"),
                type=_code(item["type"], f"{p}: labels[{i}].type"),
                color=tuple(int(c) for c in item.get("color", (255, 0, 0))),  # type: ignore[arg-type]
            )
            for i, item in enumerate(raw["labels"])
        )
        values = [lab.value for lab in labels]
        if values != list(range(1, len(labels) + 1)):
            raise EngineError(f"{p}: label values must be 1..N in order, got {values}")
        patch = tuple(int(v) for v in raw["patch_size"])
        if len(patch) != 3 or min(patch) < 1:
            raise EngineError(f"{p}: patch_size must be three positive integers")
        overlap = _overlap(raw.get("overlap", 0.5), p)
        batch = raw.get("batch", {})
        pre = raw.get("preprocessing", {})
        clip = pre.get("clip")
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
            extra={k: v for k, v in raw.items() if k not in _KNOWN},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"{p}: invalid manifest: {exc!r}") from exc


_KNOWN = {
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
