"""The engine interface and the registry of backends by name.

A backend turns a CT volume (Hounsfield units, float32, shape ``(z, y, x)``) into a uint8
label map of the same shape, using a model described by a :class:`~engines.manifest.ModelManifest`.
Backends register a factory under a name (``"onnxruntime"``, ``"tensorrt"``, ``"torch"``); heavy
modules (CUDA, TensorRT, torch) are imported only inside the factory, so the CPU install never
needs them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from engines.manifest import ModelManifest


class EngineError(Exception):
    """A model or backend cannot be loaded or run; the message says why."""


class Engine(Protocol):
    """What every backend provides."""

    name: str

    def load(self, manifest: ModelManifest) -> None:
        """Prepare the model for inference (session, engine build or cache hit)."""

    def segment(self, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """Return the label map (uint8, same shape as ``hu``) for a ``(z, y, x)`` HU volume."""

    def close(self) -> None:
        """Release sessions, device memory and streams."""


@dataclass(frozen=True)
class LabelSums:
    """Per-label voxel count, sum and sum of squares of the HU of one label map.

    Each array is indexed by label value ``0 .. len - 1`` (0: background) and covers every
    value the map holds. A backend that has the label map and the HU on its device computes
    them there (:class:`SumsEngine`), so that the node does not read the volume again;
    :func:`node.statistics.statistics_from_sums` turns them into the SR's statistics.

    Attributes
    ----------
    counts
        int64 voxel counts.
    sums, squares
        float64 sums of the HU and of the squared HU (of the HU given to the engine, before
        the model's own clipping and scaling).
    """

    counts: npt.NDArray[np.int64]
    sums: npt.NDArray[np.float64]
    squares: npt.NDArray[np.float64]


@runtime_checkable
class SumsEngine(Protocol):
    """A backend that can also sum the HU per label where its label map is (optional)."""

    def segment_with_sums(
        self, hu: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.uint8], LabelSums]:
        """The label map of :meth:`Engine.segment` and its :class:`LabelSums` over ``hu``."""


Factory = Callable[..., Engine]

# name -> "module:attribute"; resolved lazily so that importing engines never imports CUDA.
_BUILTIN: dict[str, str] = {
    "onnxruntime": "engines.ort_backend:OrtEngine",
    "tensorrt": "engines.trt_backend:TensorRTEngine",
    "torch": "engines.torch_backend:TorchEngine",
}
_REGISTRY: dict[str, Factory] = {}


def register_backend(name: str, factory: Factory) -> None:
    """Register ``factory`` under ``name`` (overrides a built-in of the same name)."""
    _REGISTRY[name] = factory


def available_backends() -> list[str]:
    """Names that :func:`create_engine` accepts."""
    return sorted(set(_BUILTIN) | set(_REGISTRY))


def create_engine(name: str, **options: Any) -> Engine:
    """Create the backend registered as ``name``.

    Raises
    ------
    EngineError
        If no backend has that name or its module cannot be imported (for example TensorRT
        on a machine without it); the message names the backend and the reason.
    """
    factory = _REGISTRY.get(name)
    if factory is None:
        target = _BUILTIN.get(name)
        if target is None:
            raise EngineError(
                f"unknown engine {name!r}; available: {', '.join(available_backends())}"
            )
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise EngineError(f"engine {name!r} is not usable here: {exc}") from exc
        factory = getattr(module, attr)
    return factory(**options)
