"""TensorRT backend: engines from the cache, executed on CuPy streams.

One code path serves NVIDIA TensorRT (module ``tensorrt``) and TensorRT for RTX (module
``tensorrt_rtx``, or ``tensorrt_rtx_bindings`` from the split PyPI wheels
``tensorrt-rtx-cu13-libs`` + ``tensorrt-rtx-cu13-bindings``); ``flavour="auto"`` takes full
TensorRT when it imports and a GPU is present, else TensorRT-RTX. Builds live in
:mod:`segnode.engines.trt_build` (re-exported here: :func:`build_engine`, :func:`list_engines`), the
cache in :mod:`segnode.engines.engine_cache`. The two flavours differ in three places:

* **GPU target.** TensorRT builds for the GPU it runs on (key target ``sm90`` etc.) and needs
  one. TensorRT-RTX builds ahead of time without a GPU; by default its engine is *portable*
  (compute capability 8.0, 8.6, 8.9, 12.x) and specialised just in time on first use; a single
  target such as ``"sm86"`` can be asked for. TensorRT-RTX 1.7 has no Hopper target and refuses
  to run on compute capability 9.0 (H100/H200): :class:`TensorRTEngine` says so before trying.
* **Timing cache.** TensorRT keeps one per flavour, version and target under
  ``engines/timing/``; in TensorRT-RTX timing caches are no-ops (deprecated in 1.2), and its
  runtime (JIT kernel) cache is persisted next to the engine instead.
* **FP16.** Both use a *strongly typed* network (``NetworkDefinitionCreationFlag.STRONGLY_TYPED``)
  so precision comes from the ONNX types: for ``precision="fp16"`` the model is converted with
  ``onnxconverter_common.float16`` (``keep_io_types=True``: float32 input and logits) before
  parsing. The deprecated ``BuilderFlag.FP16`` is never used.

Execution (:class:`TensorRTEngine`): the HU volume goes to the GPU once, through two pinned host
buffers used alternately (the host copy of one chunk overlaps the DMA of the other);
preprocessing, the sliding window (:func:`segnode.engines.sliding_window.sliding_window_segment` on
CuPy arrays), Gaussian blending and argmax all run on one CuPy stream per engine; each batch of
patches is copied into one of two device input/output binding pairs (double buffering: the
logits of batch *k* stay valid while batch *k + 1* is enqueued) and run with
``execute_async_v3`` after ``set_input_shape`` / ``set_tensor_address``. Only the uint8 label
map is copied back. One execution context is used: a 128^3 patch batch saturates the GPU, so a
second context on a second stream would add memory, not throughput; the runner is written so a
second one (own stream and buffers) can be created per worker thread if that ever changes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from segnode.engines.base import (
    EngineError,
    PatchPredictor,
    check_version_1,
    loaded,
    out_of_gpu_memory,
    precision_of,
)
from segnode.engines.engine_cache import CachedEngine, EngineCache, EngineRecord, atomic_write
from segnode.engines.trt_build import (
    PORTABLE,
    BuildSettings,
    Flavour,
    GpuInfo,
    build_engine,
    gpu_info,
    list_engines,
    make_trt_logger,
    rtx_targets,
)

if TYPE_CHECKING:
    from segnode.engines.manifest import ModelManifest

__all__ = [
    "BuildSettings",
    "CachedEngine",
    "EngineRecord",
    "TensorRTEngine",
    "TrtRunner",
    "build_engine",
    "check_runnable",
    "list_engines",
]

logger = logging.getLogger(__name__)


def check_runnable(flavour: Flavour, target: str, gpu: GpuInfo) -> None:
    """Refuse early, with a clear message, an engine that this GPU cannot run.

    Raises
    ------
    EngineError
        For TensorRT-RTX on a compute capability it has no kernels for (9.0, the H100/H200,
        among them), a portable RTX engine on Turing, or an engine built for another GPU.
    """
    if flavour.is_rtx:
        supported = rtx_targets(flavour)
        if gpu.target not in supported:
            major, minor = gpu.compute_capability
            raise EngineError(
                f"TensorRT-RTX {flavour.version} does not run on compute capability "
                f"{major}.{minor} ({gpu.name}); it supports "
                f"{', '.join(s[2:-1] + '.' + s[-1] for s in supported)}. "
                "Use the 'torch' backend or full TensorRT on this GPU."
            )
        if target == PORTABLE and gpu.compute_capability < (8, 0):
            raise EngineError(
                f"portable TensorRT-RTX engines do not cover {gpu.name} ({gpu.target}); "
                f"build with target={gpu.target!r}"
            )
    if target not in (PORTABLE, gpu.target):
        raise EngineError(f"engine built for {target} cannot run on {gpu.name} ({gpu.target})")


# --------------------------------------------------------------------------- execution


def preprocess_gpu(cp: Any, volume: Any, manifest: ModelManifest) -> None:
    """Apply the manifest's ``clip(HU) * scale + offset`` to a CuPy array, in place."""
    if manifest.clip is not None:
        cp.clip(volume, manifest.clip[0], manifest.clip[1], out=volume)
    if manifest.scale != 1.0:
        volume *= manifest.scale
    if manifest.offset != 0.0:
        volume += manifest.offset


class TrtRunner:
    """Runs one TensorRT execution context over whole volumes on its own CuPy stream.

    Parameters
    ----------
    context
        An ``IExecutionContext`` (anything with ``set_input_shape``, ``set_tensor_address``
        and ``execute_async_v3``, so the plumbing can be tested with a stand-in).
    manifest
        The model (patch size, overlap, classes, preprocessing).
    input_name, output_name
        Engine I/O tensor names.
    input_dtype, output_dtype
        Their numpy dtypes.
    batch_size
        Patches per execution; two binding sets of this size are allocated.
    device
        CUDA device index.
    """

    _CHUNK_BYTES = 16 << 20

    def __init__(
        self,
        context: Any,
        manifest: ModelManifest,
        *,
        input_name: str,
        output_name: str,
        input_dtype: Any = np.float32,
        output_dtype: Any = np.float32,
        batch_size: int = 1,
        device: int = 0,
    ) -> None:
        import cupy as cp

        self._cp = cp
        self.context = context
        self.manifest = manifest
        self.input_name, self.output_name = input_name, output_name
        self.batch_size = batch_size
        self.device = cp.cuda.Device(device)
        self._keep: tuple[Any, ...] = ()
        self._runtime_cache: tuple[Any, Path] | None = None
        patch = manifest.patch_size
        with (
            out_of_gpu_memory(cp.cuda.memory.OutOfMemoryError, "for the TensorRT bindings"),
            self.device,
        ):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self._inputs = cp.empty((2, batch_size, 1, *patch), dtype=input_dtype)
            channels = manifest.output_channels
            self._outputs = cp.empty((2, batch_size, channels, *patch), dtype=output_dtype)
        self._slot = 0
        self._pinned: list[Any] = []

    @classmethod
    def from_plan(
        cls,
        trt: Any,
        plan: bytes,
        manifest: ModelManifest,
        *,
        device: int = 0,
        batch_size: int = 1,
        runtime_cache: Path | None = None,
    ) -> TrtRunner:
        """Deserialize ``plan`` and create the execution context (and RTX runtime cache)."""
        import cupy as cp

        log = make_trt_logger(trt)
        with cp.cuda.Device(device):
            runtime = trt.Runtime(log)
            engine = runtime.deserialize_cuda_engine(plan)
            if engine is None:
                raise EngineError(
                    "TensorRT could not deserialize the engine: "
                    + ("; ".join(log.errors) or "no detail")
                )
            names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
            ins = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
            outs = [n for n in names if n not in ins]
            in_name = manifest.input_name if manifest.input_name in ins else ins[0]
            out_name = manifest.output_name if manifest.output_name in outs else outs[0]
            rt_cache = None
            if runtime_cache is not None and hasattr(engine, "create_runtime_config"):
                config = engine.create_runtime_config()
                rt_cache = config.create_runtime_cache()
                if runtime_cache.exists() and not rt_cache.deserialize(runtime_cache.read_bytes()):
                    logger.warning("runtime cache %s rejected; recompiling", runtime_cache.name)
                config.set_runtime_cache(rt_cache)
                context = engine.create_execution_context(config)
            else:
                context = engine.create_execution_context()
            if context is None:
                raise EngineError(
                    "TensorRT could not create an execution context (out of GPU "
                    "memory?): " + ("; ".join(log.errors) or "no detail")
                )
            runner = cls(
                context,
                manifest,
                input_name=in_name,
                output_name=out_name,
                input_dtype=trt.nptype(engine.get_tensor_dtype(in_name)),
                output_dtype=trt.nptype(engine.get_tensor_dtype(out_name)),
                batch_size=batch_size,
                device=device,
            )
        runner._keep = (log, runtime, engine)  # TensorRT objects must outlive the context
        if rt_cache is not None and runtime_cache is not None:
            runner._runtime_cache = (rt_cache, runtime_cache)
        return runner

    def predict(self, patches: Any) -> Any:
        """Logits of ``(N, 1, *patch)`` CuPy patches, computed on this runner's stream."""
        cp = self._cp
        n = int(patches.shape[0])
        if n > self.batch_size:
            parts = [
                self.predict(patches[i : i + self.batch_size]) for i in range(0, n, self.batch_size)
            ]
            return cp.concatenate([p.copy() for p in parts])
        slot, self._slot = self._slot, self._slot ^ 1
        inp, out = self._inputs[slot, :n], self._outputs[slot, :n]
        inp[...] = patches
        ctx = self.context
        if not ctx.set_input_shape(self.input_name, tuple(inp.shape)):
            raise EngineError(f"batch of {n} patches is outside the engine's profile")
        ctx.set_tensor_address(self.input_name, int(inp.data.ptr))
        ctx.set_tensor_address(self.output_name, int(out.data.ptr))
        if not ctx.execute_async_v3(self.stream.ptr):
            raise EngineError("TensorRT execute_async_v3 failed")
        return out if out.dtype == cp.float32 else out.astype(cp.float32)

    def upload(self, hu: npt.NDArray[np.float32]) -> Any:
        """Copy ``hu`` to the device through two alternating pinned buffers."""
        cp = self._cp
        import cupyx

        volume = cp.empty(hu.shape, dtype=cp.float32)
        rows = max(1, self._CHUNK_BYTES // max(1, hu[0].size * 4))
        if len(self._pinned) != 2 or self._pinned[0].shape != (rows, *hu.shape[1:]):
            self._pinned = [cupyx.empty_pinned((rows, *hu.shape[1:]), np.float32) for _ in "ab"]
        done: list[Any] = [None, None]
        for i, z0 in enumerate(range(0, hu.shape[0], rows)):
            k, z1 = i % 2, min(z0 + rows, hu.shape[0])
            if done[k] is not None:
                done[k].synchronize()  # the DMA that last read this pinned buffer is over
            staging = self._pinned[k][: z1 - z0]
            np.copyto(staging, hu[z0:z1], casting="same_kind")
            volume[z0:z1].set(staging, stream=self.stream)
            done[k] = self.stream.record()
        return volume

    def segment(self, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """Label map of a ``(z, y, x)`` HU volume; only the uint8 result comes back."""
        from segnode.engines.sliding_window import segment_with_manifest

        cp = self._cp
        m = self.manifest
        if hu.ndim != 3:
            raise EngineError(f"expected a (z, y, x) volume, got shape {hu.shape}")
        with (
            out_of_gpu_memory(cp.cuda.memory.OutOfMemoryError, f"segmenting a {hu.shape} volume"),
            self.device,
            self.stream,
        ):
            volume = self.upload(hu)
            preprocess_gpu(cp, volume, m)
            labels = segment_with_manifest(volume, self.predict, m, batch_size=self.batch_size)
            result: npt.NDArray[np.uint8] = labels.astype(cp.uint8, copy=False).get(
                stream=self.stream
            )
            self.stream.synchronize()
        self._save_runtime_cache()
        return result

    def _save_runtime_cache(self) -> None:
        if self._runtime_cache is None:
            return
        cache, path = self._runtime_cache
        try:
            atomic_write(path, bytes(cache.serialize()))
        except OSError as exc:
            logger.warning("cannot save runtime cache %s: %s", path.name, exc)
        self._runtime_cache = None  # kernels compiled on first use; once is enough

    def close(self) -> None:
        """Release the context, bindings, pinned buffers and stream."""
        with self.device:
            self.stream.synchronize()
        self.context = None
        self._keep = ()
        self._inputs = self._outputs = None
        self._pinned = []


class TensorRTEngine:
    """The ``"tensorrt"`` backend of :func:`segnode.engines.base.create_engine`.

    Parameters
    ----------
    cache_dir
        Engine cache; defaults to ``<data_dir>/engines``.
    data_dir
        The node's data folder (used when ``cache_dir`` is not given).
    precision, flavour, target
        The engine's :class:`BuildSettings`, made here (``settings``). The precision defaults
        to ``"fp16"``, as ``segnode engine build``'s does (used only if the manifest allows
        it); a bare :class:`BuildSettings` is fp32.
    device
        CUDA device index.
    batch_size
        Patches per ``execute_async_v3``; defaults to the manifest's ``batch.opt``.
    """

    name = "tensorrt"

    def __init__(
        self,
        *,
        cache_dir: str | Path | None = None,
        data_dir: str | Path | None = None,
        precision: str = "fp16",
        flavour: str = "auto",
        target: str | None = None,
        device: int = 0,
        batch_size: int | None = None,
    ) -> None:
        if cache_dir is None:
            if data_dir is None:
                raise EngineError("the tensorrt engine needs cache_dir or data_dir")
            cache_dir = Path(data_dir) / "engines"
        self.cache_dir = Path(cache_dir)
        self.settings = BuildSettings(precision, flavour, target)
        self.device = device
        self.batch_size = batch_size
        self.built: CachedEngine | None = None
        #: Every fold file's engine (version 2), in ``manifest.model_files()`` order.
        self.built_folds: list[CachedEngine] = []
        self.manifest: ModelManifest | None = None
        self._runner: TrtRunner | None = None
        self._runners: list[TrtRunner] = []

    def load(self, manifest: ModelManifest) -> None:
        """Check the GPU, build or reuse the engine, and prepare an execution context.

        A version-2 manifest gets one engine (own cache entry) and one execution context per
        fold file, every part's folds for a composite (:attr:`built_folds`).
        """
        gpu = gpu_info(self.device)
        lib, target = self.settings.resolve(self.device)
        check_runnable(lib, target, gpu)
        # A model calibrated to INT8 builds its QDQ files in TensorRT's form (explicit
        # quantization) where calibration wrote them, else its float files.
        units = manifest.model_files(int8="tensorrt") if manifest.is_trained else (manifest,)
        built = [
            build_engine(unit, self.settings, cache_dir=self.cache_dir, device=self.device)
            for unit in units
        ]
        self.built = built[0]
        self.built_folds = built
        self.close()
        cache = EngineCache(self.cache_dir)
        runners: list[TrtRunner] = []
        try:
            for unit, engine in zip(units, built, strict=True):
                rt_cache = cache.runtime_cache_path(engine.key) if lib.is_rtx else None
                runners.append(
                    TrtRunner.from_plan(
                        lib.module,
                        engine.path.read_bytes(),
                        unit,
                        device=self.device,
                        batch_size=self.batch_size or max(1, unit.batch_opt),
                        runtime_cache=rt_cache,
                    )
                )
        except BaseException:
            for runner in runners:
                runner.close()
            raise
        self._runner = runners[0]
        self._runners = runners
        self.manifest = manifest
        #: What the loaded model runs in (:func:`segnode.engines.base.run_precision`).
        self.precision_used = precision_of(units, built[0].key.precision)

    def segment(self, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """Label map of ``hu`` (``(z, y, x)`` HU), computed on the GPU."""
        runner = loaded(self._runner, self.name)
        check_version_1(loaded(self.manifest, self.name))
        return runner.segment(hu)

    def fold_predictors(self) -> list[PatchPredictor]:
        """One predictor per fold file (:class:`segnode.engines.base.TrainedEngine`): CuPy patches
        in, float32 CuPy scores out. Each fold runs on its runner's stream, ordered after the
        caller's stream by events, and the caller's stream waits for its result."""
        if not self._runners:
            raise EngineError("tensorrt engine used before load()")
        return [self._fold_predictor(runner) for runner in self._runners]

    @staticmethod
    def _fold_predictor(runner: TrtRunner) -> PatchPredictor:
        cp = runner._cp

        def predict(patches: Any) -> Any:
            caller = cp.cuda.get_current_stream()
            runner.stream.wait_event(caller.record())
            with runner.stream:
                out = runner.predict(patches)
            caller.wait_event(runner.stream.record())
            return out

        return predict

    def window_batch(self) -> int:
        """Tiles per predictor call: the runners' batch (``batch.opt`` unless configured)."""
        return loaded(self._runner, self.name).batch_size

    def to_device(self, hu: npt.NDArray[np.float32]) -> Any:
        """The volume on the GPU (through the first runner's pinned buffers and stream)."""
        return loaded(self._runner, self.name).upload(hu)

    def to_host(self, labels: Any) -> npt.NDArray[np.uint8]:
        """The uint8 label map from the GPU; the runtime caches are saved after the first."""
        assert self._runner is not None
        cp = self._runner._cp
        stream = cp.cuda.get_current_stream()
        result: npt.NDArray[np.uint8] = labels.astype(cp.uint8, copy=False).get(stream=stream)
        stream.synchronize()
        for runner in self._runners:
            runner._save_runtime_cache()
        return result

    @contextlib.contextmanager
    def device_scope(self) -> Iterator[None]:
        """The engine's device and the first runner's stream; out of GPU memory becomes an
        :class:`EngineError`."""
        runner = loaded(self._runner, self.name)
        cp = runner._cp
        with (
            out_of_gpu_memory(cp.cuda.memory.OutOfMemoryError, "running a trained model"),
            runner.device,
            runner.stream,
        ):
            yield

    def close(self) -> None:
        """Free the execution contexts, device buffers and streams."""
        for runner in self._runners:
            runner.close()
        self._runners = []
        self._runner = None
