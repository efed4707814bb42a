"""The engine interface and the registry of backends by name.

A backend turns a CT volume (Hounsfield units, float32, shape ``(z, y, x)``) into a uint8
label map of the same shape, using a model described by a
:class:`~segnode.engines.manifest.ModelManifest`. Backends register a factory under a name
(``"onnxruntime"``, ``"tensorrt"``, ``"torch"``, ``"kserve"``, ``"openvino"``); heavy modules
(CUDA, TensorRT, torch, ``tritonclient``, OpenVINO) are imported only inside the factory, so
the CPU install never needs them.

A version-2 (trained) manifest is not run by :meth:`Engine.segment`: its contract needs the
volume's geometry (reorientation, resampling to the model's spacing) and nnU-Net's window over
every fold. A backend that runs one also implements :class:`TrainedEngine` (loading one
network per fold file, :meth:`segnode.engines.manifest.ModelManifest.model_files`), and
:func:`segnode.engines.trained.segment_trained` drives it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from segnode.engines.manifest import ModelManifest


class EngineError(Exception):
    """A model or backend cannot be loaded or run; the message says why."""


T = TypeVar("T")

#: The precisions a backend runs a model in (fp16 only where the manifest allows it).
PRECISIONS = ("fp32", "fp16")


def checked_precision(precision: str, engine: str) -> str:
    """``precision`` when it is one of :data:`PRECISIONS`, else an :class:`EngineError`
    (``<engine>: precision must be fp32 or fp16, got ...``)."""
    if precision not in PRECISIONS:
        raise EngineError(f"{engine}: precision must be fp32 or fp16, got {precision!r}")
    return precision


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity; the CPU count off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def loaded(value: T | None, engine: str) -> T:
    """``value``, something the ``engine`` backend's ``load`` sets: an :class:`EngineError`
    (``<engine> engine used before load()``) while it is still ``None``."""
    if value is None:
        raise EngineError(f"{engine} engine used before load()")
    return value


@contextlib.contextmanager
def out_of_gpu_memory(oom: type[BaseException], doing: str) -> Iterator[None]:
    """Within the block, the GPU library's out-of-memory error ``oom`` (``torch``'s or
    CuPy's) becomes an :class:`EngineError` saying ``out of GPU memory <doing>: <error>``."""
    try:
        yield
    except oom as exc:
        raise GpuMemoryError(f"out of GPU memory {doing}: {exc}") from exc


class GpuMemoryError(EngineError):
    """The GPU ran out of memory (:func:`out_of_gpu_memory`): a trained model's job tries
    again with less (:func:`segnode.engines.trained.memory_ladder`) before it fails."""


PatchPredictor = Callable[[Any], Any]
"""One network (one fold): float32 ``(N, 1, pz, py, px)`` patches in, float32
``(N, C, pz, py, px)`` scores out, in the backend's array type and device (NumPy for ONNX
Runtime, torch tensors for the torch backend, CuPy arrays for TensorRT)."""


class Engine(Protocol):
    """What every backend provides."""

    name: str

    def load(self, manifest: ModelManifest) -> None:
        """Prepare the model for inference (session, engine build or cache hit)."""

    def segment(self, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """Return the label map (uint8, same shape as ``hu``) for a ``(z, y, x)`` HU volume.

        Version-1 models only: a backend loaded with a version-2 manifest raises
        :class:`EngineError` here (use :func:`segnode.engines.trained.segment_trained`).
        """

    def close(self) -> None:
        """Release sessions, device memory and streams."""


@dataclass(frozen=True)
class LabelSums:
    """Per-label voxel count, sum and sum of squares of the HU of one label map.

    Each array is indexed by label value ``0 .. len - 1`` (0: background) and covers every
    value the map holds. A backend that has the label map and the HU on its device computes
    them there (:class:`SumsEngine`), so that the node does not read the volume again;
    :func:`segnode.node.results.statistics.statistics_from_sums` turns them into the SR's
    statistics.

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


@runtime_checkable
class SlotEngine(Protocol):
    """A backend that can run several jobs in its models at once, each in a scope of its own
    (optional; the torch backend: a CUDA stream per job). The worker's gate lets a job in
    beside others only while :meth:`has_room` says yes."""

    def has_room(self) -> bool:
        """Whether the device has the memory for one more job beside those running now
        (False where the backend cannot run a second job at all)."""

    def job_scope(self, shared: Callable[[], bool]) -> AbstractContextManager[None]:
        """The scope one job's model runs in; ``shared()``, asked at its end, says whether
        another job ran beside it (its memory peak is then not that of a job alone)."""


@runtime_checkable
class DeviceSumsEngine(Protocol):
    """A trained-model backend that sums the HU per label on its own device (optional):
    :func:`segnode.engines.trained.segment_trained_with_sums` hands it the label map and the
    HU volume where they already are."""

    def label_sums(self, labels: Any, hu: Any) -> LabelSums:
        """:class:`LabelSums` of the uint8 ``labels`` over the float32 ``hu`` (same shape),
        both on the backend's device."""


@runtime_checkable
class TrainedEngine(Protocol):
    """A backend that runs version-2 (trained) models: one network per fold file.

    After :meth:`Engine.load` with a version-2 manifest the backend holds one network per
    entry of :meth:`~segnode.engines.manifest.ModelManifest.model_files` (every fold; for a
    composite every fold of every part, part by part).
    :func:`segnode.engines.trained.segment_trained` moves the HU volume to the backend's device,
    runs
    :func:`segnode.engines.preprocess.pipeline.run_model` there around
    :func:`segnode.engines.nnunet_window.predict_for_manifest` with these predictors, and takes the
    labels back.
    """

    def fold_predictors(self) -> list[PatchPredictor]:
        """One :data:`PatchPredictor` per loaded fold file, in the order of ``model_files()``.

        Returns
        -------
        list
            The predictors; each accepts up to :meth:`window_batch` patches per call (more
            are split) and returns float32 scores on the backend's device.
        """

    def window_batch(self) -> int:
        """Tiles per predictor call that suit the backend (its batch size, within the
        manifest's ``batch.max`` where the model's batch axis is dynamic)."""

    def to_device(self, hu: npt.NDArray[np.float32]) -> Any:
        """The float32 ``(z, y, x)`` HU volume in the predictors' array type and device."""

    def to_host(self, labels: Any) -> npt.NDArray[np.uint8]:
        """A uint8 label map from the backend's device as a NumPy array."""

    def device_scope(self) -> AbstractContextManager[None]:
        """Context for the whole preprocessing, window and export (device, stream,
        ``torch.inference_mode``)."""


def check_version_1(manifest: ModelManifest) -> None:
    """Check that ``manifest`` is a version-1 model, one that :meth:`Engine.segment` runs.

    Raises
    ------
    EngineError
        If the model is a version-2 one: it runs through ``segment_trained``.
    """
    if manifest.is_trained:
        raise EngineError(
            f"model {manifest.name!r} is a trained (version-2) model: it runs with the "
            "volume's geometry through segnode.engines.trained.segment_trained"
        )


def host_volume(manifest: ModelManifest, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """``hu`` as the NumPy volume a version-1 model's ``segment`` runs on.

    Raises
    ------
    EngineError
        If the model is a version-2 one (:func:`check_version_1`) or the volume is not a
        non-empty ``(z, y, x)`` array.
    """
    check_version_1(manifest)
    volume = np.asarray(hu)
    if volume.ndim != 3 or min(volume.shape) < 1:
        raise EngineError(f"expected a non-empty (z, y, x) volume, got shape {volume.shape}")
    return volume


class HostArrays:
    """The :class:`TrainedEngine` volume methods of a backend whose predictors take NumPy
    arrays on the host (ONNX Runtime on the CPU, a remote server): no device, no copies."""

    def to_device(self, hu: npt.NDArray[np.float32]) -> Any:
        """The volume itself (the window runs on NumPy arrays)."""
        return hu

    def to_host(self, labels: Any) -> npt.NDArray[np.uint8]:
        """The label map as a uint8 NumPy array."""
        return np.asarray(labels, dtype=np.uint8)

    def device_scope(self) -> AbstractContextManager[None]:
        """Nothing to enter: there is no device on this side."""
        return nullcontext()


def run_precision(engine: Any, manifest: ModelManifest) -> str:
    """The arithmetic ``engine`` runs ``manifest``'s model in, as the SEG and SR record it:
    the engine's ``precision_used`` after :meth:`Engine.load` (``"fp32"``, ``"fp16"``,
    ``"bf16"``, ``"int8"``), else ``"fp32"``."""
    used = getattr(engine, "precision_used", "")
    return str(used) if used else "fp32"


def precision_of(units: Sequence[ModelManifest], other: str) -> str:
    """``"int8"`` when every loaded file of ``units`` is an INT8 QDQ file
    (:meth:`~segnode.engines.manifest.ModelManifest.model_files` with ``int8``), ``other``
    when none is, ``"int8+<other>"`` for a composite with both."""
    quantized = [u.name.endswith(".int8") for u in units]
    if all(quantized):
        return "int8"
    return f"int8+{other}" if any(quantized) else other


Factory = Callable[..., Engine]

# name -> "module:attribute"; resolved lazily so that importing engines never imports CUDA.
_BUILTIN: dict[str, str] = {
    "onnxruntime": "segnode.engines.ort_backend:OrtEngine",
    "tensorrt": "segnode.engines.trt_backend:TensorRTEngine",
    "torch": "segnode.engines.torch_backend:TorchEngine",
    "kserve": "segnode.engines.kserve_backend:KServeEngine",
    "openvino": "segnode.engines.openvino_backend:OpenVinoEngine",
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
