"""PyTorch backend: the ONNX model converted with onnx2torch and run on a CUDA device.

This is the GPU path on GPUs that TensorRT-RTX refuses (compute capability 9.0: H100, H200)
and where full TensorRT is not installed. The ONNX graph becomes a ``torch.fx`` module
(``onnx2torch.convert``, :mod:`segnode.engines.torch_convert`); for ``precision="fp16"``
(honoured only when the manifest allows it) the module and its inputs are cast with
``.half()`` (no autocast: every convolution runs on FP16 tensor cores without per-op
casts). ``compile=True`` wraps the module in
``torch.compile``, which fuses InstanceNorm and LeakyReLU into the convolutions' neighbours;
``cuda_graphs=True`` captures one CUDA graph per batch size and replays it. Both are
specialised to one batch size: the last, smaller batch of a volume is padded.

Measured on an H200 (nnU-Net-like 31 M-parameter U-Net, 128^3 patches, 128x512x512 CT with
50 % overlap, ``python -m bench.gpu_bench``): eager FP32 1.72 s per volume, eager FP16
0.78 s, FP16 + ``compile`` 0.24 s (7.1x). Eager FP16 is held back by InstanceNorm, which
``compile`` fuses; the ``channels_last_3d`` memory format pays only when compiled (0.24 s
against 0.34 s NCDHW) and costs eagerly (1.09 s against 0.78 s), so ``channels_last`` follows
``compile`` by default. Recommended node options on such a GPU: ``precision="fp16",
compile=True``.

Compilation takes seconds to minutes. With a ``cache_dir`` (the node passes
``<data_dir>/engines``) the compiled model is kept as an artefact keyed by model, versions,
GPU and options (:mod:`segnode.engines.torch_compile`, :mod:`segnode.engines.torch_cache`): the
first start (or ``segnode engine build --engine torch``) compiles it, later starts load it. Without
one, every process compiles again (``torch.compile`` at the first forward pass).

The sliding window (:func:`segnode.engines.sliding_window.sliding_window_segment`) runs on torch
tensors on the device; only the uint8 label map is copied back. With
:meth:`TorchEngine.segment_with_sums` the per-label voxel counts and HU sums of the SR's
statistics are computed there too (a few values copied back), so that the node does not
read the label map and the volume again on the CPU.

torch, onnx2torch and torchvision (an onnx2torch requirement) are imported inside
:meth:`TorchEngine.load`, so importing this module needs none of them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from segnode.engines.base import (
    EngineError,
    LabelSums,
    PatchPredictor,
    check_version_1,
    checked_precision,
    loaded,
    out_of_gpu_memory,
)
from segnode.engines.torch_convert import convert_onnx

if TYPE_CHECKING:
    from segnode.engines.manifest import ModelManifest
    from segnode.engines.torch_cache import TorchKey

logger = logging.getLogger(__name__)

GPU_BATCH_VOXELS = 1 << 24
"""Input voxels per forward pass that :func:`default_batch` aims for on a GPU (16.8 M: 64
slices of 512 x 512, or 8 patches of 128^3)."""


_FLAGS_LOCK = threading.Lock()
_FLAGS: dict[str, Any] = {"inside": 0, "saved": None}  # calls inside, the switches before

ROOM_MARGIN = 1.25
"""A second job enters the GPU beside another only where this many times the peak of a job
alone is free (:meth:`TorchEngine.has_room`): the allocator rounds blocks up and a stream's
cached blocks serve only that stream."""


def default_batch(manifest: ModelManifest, on_gpu: bool) -> int:
    """Patches per forward pass when none is configured (see :class:`TorchEngine`)."""
    opt = max(1, manifest.batch_opt)
    if not on_gpu:
        return opt
    voxels = max(1, math.prod(manifest.patch_size))
    return max(opt, min(max(opt, manifest.batch_max), GPU_BATCH_VOXELS // voxels))


ALLOC_CONF = "expandable_segments:True"
"""PyTorch's CUDA allocator setting the engine starts with unless ``PYTORCH_CUDA_ALLOC_CONF``
is set: segments that grow instead of a new block per size, so that the sliding window's
slabs of changing length do not leave the memory reserved far above the memory in use
(TotalSegmentator's ``total`` on 824 slices: see docs/performance.md)."""


def _import_torch() -> Any:
    # read when CUDA's allocator starts, so before the first tensor on the GPU
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    try:
        import torch
    except ImportError as exc:
        raise EngineError(f"the torch engine needs PyTorch ({exc})") from exc
    return torch


MASKED_SUMS_MAX = 16
"""Label values up to which :meth:`TorchEngine.label_sums` sums with one masked reduction per
value; above it, with ``torch.bincount`` (docs/performance.md)."""


class TorchEngine:
    """The ``"torch"`` backend of :func:`segnode.engines.base.create_engine`.

    Parameters
    ----------
    device
        Torch device, ``"cuda"`` (default), ``"cuda:1"``, or ``"cpu"`` (slow; for tests).
    precision
        ``"fp16"`` (used only if the manifest allows it) or ``"fp32"``.
    compile
        Wrap the module in ``torch.compile`` (first call compiles; :meth:`load` warms it up).
    cuda_graphs
        Capture and replay one CUDA graph per batch size (CUDA devices only).
    batch_size
        Patches per forward pass. Default: the manifest's ``batch.opt`` on the CPU; on a
        GPU the largest batch up to ``batch.max`` whose input holds at most
        :data:`GPU_BATCH_VOXELS` voxels, and never less than ``batch.opt``
        (:func:`default_batch`): thin patches such as the tissue model's 2-slice ones then
        go 32 at a time instead of one kernel sequence per patch.
    channels_last
        Use the ``channels_last_3d`` memory format; default: when compiling on CUDA.
    tf32
        Let FP32 convolutions and matmuls use TF32 tensor cores. Off by default so that
        ``precision="fp32"`` is true FP32 (the reference for the FP16 agreement check).
    compile_mode
        ``mode`` passed to ``torch.compile``.
    cache_dir
        With ``compile=True``: the engine cache folder (``<data_dir>/engines``); compiled
        artefacts go to its ``torch/`` sub-folder and are reused by later processes.
    compile_cache
        Kind of artefact cached: ``"inductor"`` (``torch.compile`` with its caches saved and
        restored) or ``"aoti"`` (AOTInductor package, test-run in a child process when
        built; falls back to ``"inductor"`` when the model cannot be exported or the package
        fails its test run). See :mod:`segnode.engines.torch_compile`.
    eager_while_compiling
        With ``compile=True`` and a ``cache_dir`` that does not hold the compiled model yet:
        :meth:`load` returns as soon as the model runs eagerly (seconds) and the compiled
        predictor is built on a background thread (``segnode-torch-compile``); each
        segmentation that starts after it is ready uses it (a job never switches
        predictors half-way). A cached compiled model is loaded before :meth:`load`
        returns either way. Off: :meth:`load` always returns with the compiled predictor
        (``segnode engine build``, benchmarks).

    Attributes
    ----------
    load_seconds
        Wall time of :meth:`load`.
    load_info
        How :meth:`load` got its predictor: ``compiled`` (``"aoti"``, ``"inductor"``,
        ``"jit"`` or ``""`` for eager), ``cache_hit``, ``artefact`` (path),
        ``build_seconds``, ``convert_seconds``; with ``eager_while_compiling``,
        ``compiled_after_seconds`` once the compiled predictor is in use.
    compiled_ready
        Set when the background compilation has ended (in use from the next segmentation,
        or failed: the engine then stays eager); set at once without one.
    """

    name = "torch"

    def __init__(
        self,
        *,
        device: str = "cuda",
        precision: str = "fp16",
        compile: bool = False,
        cuda_graphs: bool = False,
        batch_size: int | None = None,
        channels_last: bool | None = None,
        tf32: bool = False,
        compile_mode: str = "default",
        cache_dir: str | Path | None = None,
        compile_cache: str = "inductor",
        eager_while_compiling: bool = False,
        gpu_memory_limit: int = 0,
    ) -> None:
        checked_precision(precision, "torch")
        if compile and cuda_graphs:
            raise EngineError("choose compile or cuda_graphs, not both")
        if compile_cache not in ("aoti", "inductor"):
            raise EngineError(f"compile_cache must be aoti or inductor, not {compile_cache!r}")
        self.device = device
        self.precision = precision
        self.compile = compile
        self.cuda_graphs = cuda_graphs
        self.batch_size = batch_size
        self.channels_last = channels_last
        self.tf32 = tf32
        self.compile_mode = compile_mode
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.compile_cache = compile_cache
        #: What the loaded model runs in (:func:`segnode.engines.base.run_precision`).
        self.precision_used = ""
        self.eager_while_compiling = eager_while_compiling
        #: GPU memory the process may take, in bytes (0: all of it); see :meth:`_cap_memory`.
        self.gpu_memory_limit = gpu_memory_limit
        self.compiled_ready = threading.Event()
        self.compiled_ready.set()
        self._compiling: Future[Any] | None = None
        self._load_started = 0.0
        self.load_seconds = 0.0
        self.load_info: dict[str, Any] = {}
        self.manifest: ModelManifest | None = None
        self._torch: Any = None
        self._module: Any = None
        self._fn: Any = None
        self._dtype: Any = None
        self._dev: Any = None
        self._graphs: dict[int, tuple[Any, Any, Any]] = {}
        self._batch = 1
        #: Version 2: one loaded engine per fold file (``manifest.model_files()``).
        self.fold_engines: list[TorchEngine] = []
        #: Per thread (a worker lane): the CUDA stream its jobs run on (:meth:`job_scope`).
        self._local = threading.local()
        #: The most GPU memory a job took above what was allocated before it, among the
        #: jobs that ran alone (bytes; None before the first): what :meth:`has_room` needs.
        self.solo_peak: int | None = None
        self._lock = threading.Lock()  # solo_peak, and adopting the compiled model

    @property
    def half(self) -> bool:
        """True when the model runs in FP16."""
        return self._dtype is not None and self._dtype == self._torch.float16

    @contextlib.contextmanager
    def _flags(self) -> Iterator[None]:
        """Process-wide cuDNN/TF32 switches, set for this engine's calls and restored after
        the last call inside ends: two jobs in the models at once (each on its own thread)
        must not have one's restore change the other's kernels halfway."""
        b = self._torch.backends
        with _FLAGS_LOCK:
            if not _FLAGS["inside"]:
                _FLAGS["saved"] = (b.cudnn.benchmark, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32)
            _FLAGS["inside"] += 1
            b.cudnn.benchmark = True
            b.cudnn.allow_tf32 = b.cuda.matmul.allow_tf32 = self.tf32
        try:
            yield
        finally:
            with _FLAGS_LOCK:
                _FLAGS["inside"] -= 1
                if not _FLAGS["inside"]:
                    b.cudnn.benchmark, b.cudnn.allow_tf32, b.cuda.matmul.allow_tf32 = _FLAGS[
                        "saved"
                    ]

    def load(self, manifest: ModelManifest) -> None:
        """Convert the model, move it to the device and warm it up (compile, graphs).

        With ``compile=True`` and a ``cache_dir``, a cached compiled artefact is loaded
        instead (no conversion, no compilation), or built and stored first. A version-2
        manifest loads one module per fold file (every part's folds for a composite), each
        with its own cache entry (:attr:`fold_engines`).
        """
        for fold in self.fold_engines:  # a previous trained model's
            fold.close()
        self.fold_engines = []
        if not manifest.is_trained:
            self._load_single(manifest)
            return
        started = time.perf_counter()
        self.close()
        folds: list[TorchEngine] = []
        try:
            for unit in manifest.model_files():
                fold = TorchEngine(
                    device=self.device,
                    precision=self.precision,
                    compile=self.compile,
                    cuda_graphs=self.cuda_graphs,
                    batch_size=self.batch_size,
                    channels_last=self.channels_last,
                    tf32=self.tf32,
                    compile_mode=self.compile_mode,
                    cache_dir=self.cache_dir,
                    compile_cache=self.compile_cache,
                    eager_while_compiling=self.eager_while_compiling,
                )
                fold._load_single(unit)
                folds.append(fold)
                self.precision_used = fold.precision_used
        except BaseException:
            for fold in folds:
                fold.close()
            raise
        first = folds[0]
        self.manifest = manifest
        self.fold_engines = folds
        self._torch, self._dev, self._dtype, self._batch = (
            first._torch,
            first._dev,
            first._dtype,
            first._batch,
        )
        self.load_seconds = time.perf_counter() - started
        infos = [fold.load_info for fold in folds]
        self.load_info = {
            "compiled": infos[0].get("compiled", ""),
            "cache_hit": all(info.get("cache_hit", False) for info in infos),
            "folds": infos,
        }
        if all(info.get("artefact") for info in infos):
            self.load_info["artefact"] = ", ".join(str(info["artefact"]) for info in infos)
        logger.info(
            "torch engine ready for trained model %s: %d fold module(s) in %.1f s",
            manifest.name,
            len(folds),
            self.load_seconds,
        )

    def _load_single(self, manifest: ModelManifest) -> None:
        """:meth:`load` of one ONNX file (a version-1 model, or one fold)."""
        started = time.perf_counter()
        torch = self._torch = _import_torch()
        dev = torch.device(self.device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise EngineError("the torch engine found no CUDA GPU (torch.cuda.is_available())")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise EngineError(f"no CUDA device {dev.index}")
        elif self.cuda_graphs:
            raise EngineError("cuda_graphs needs a CUDA device")
        self._dev = dev
        self._cap_memory()
        self.manifest = manifest
        self._module = self._fn = None
        half = self.precision == "fp16" and manifest.fp16 and dev.type == "cuda"
        if self.precision == "fp16" and not half:
            logger.warning(
                "model %s runs in fp32 (manifest fp16=%s, device %s)",
                manifest.name,
                manifest.fp16,
                dev,
            )
        self._dtype = torch.float16 if half else torch.float32
        self.precision_used = "fp16" if half else "fp32"
        if self.channels_last is None:
            self.channels_last = dev.type == "cuda" and self.compile
        self._graphs = {}
        self._compiling = None
        self.compiled_ready.set()
        self.load_info = {"compiled": "", "cache_hit": False}
        batch = self._batch = self.batch_size or default_batch(manifest, dev.type == "cuda")
        zeros = torch.zeros((batch, 1, *manifest.patch_size), device=dev)
        self._load_started = started
        with out_of_gpu_memory(torch.cuda.OutOfMemoryError, f"loading {manifest.name}"):
            eager_first = self.eager_while_compiling and not self._compiled_is_cached(batch)
            if self.compile and self.cache_dir is not None and eager_first:
                self._fn = self._module_on_device()
                try:
                    self._predict(zeros)
                except torch.cuda.OutOfMemoryError:
                    raise
                except Exception as exc:
                    raise EngineError(f"{manifest.name} does not run under torch: {exc}") from exc
                self._start_compiling(self._example(zeros))
            elif self.compile and self.cache_dir is not None:
                self._fn = self._compile_cached(self._example(zeros))
            if self._fn is None:
                module = self._module_on_device()
                self._fn = module
                if self.compile:
                    self._fn = torch.compile(module, mode=self.compile_mode, dynamic=False)
                    self.load_info["compiled"] = "jit"
                self._warm_up(zeros)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.load_seconds = time.perf_counter() - started
        info = self.load_info
        logger.info(
            "torch engine ready for %s on %s (%s, batch %d%s%s) in %.1f s",
            manifest.name,
            dev,
            "fp16" if half else "fp32",
            batch,
            f", compiled ({info['compiled']}{', cached' if info['cache_hit'] else ''})"
            if info["compiled"]
            else ", eager while compiling"
            if self._compiling is not None
            else "",
            ", CUDA graphs" if self.cuda_graphs else "",
            self.load_seconds,
        )

    def _module_on_device(self) -> Any:
        """The onnx2torch module on the device, cast and in its memory format (converted once)."""
        if self._module is None:
            assert self.manifest is not None
            torch, t0 = self._torch, time.perf_counter()
            module = convert_onnx(self.manifest.onnx_path).eval()
            if self.compile:
                from segnode.engines.torch_compile import fold_constant_shapes

                if folded := fold_constant_shapes(torch, module):
                    logger.info("%d constant axes/shapes folded for compilation", folded)
            module = module.to(device=self._dev, dtype=self._dtype)
            if self.channels_last:
                module = module.to(memory_format=torch.channels_last_3d)
            self._module = module
            self.load_info["convert_seconds"] = round(time.perf_counter() - t0, 3)
        return self._module

    def _warm_up(self, zeros: Any) -> None:
        """First forward pass (cuDNN autotuning, JIT compilation, graph capture); a failing
        ``torch.compile`` (no Triton or C compiler) leaves the model running eagerly."""
        assert self.manifest is not None
        try:
            self._predict(zeros)
        except self._torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:
            if not self.compile:
                raise EngineError(f"{self.manifest.name} does not run under torch: {exc}") from exc
            logger.warning(
                "torch.compile failed (%s: %s); running eagerly", type(exc).__name__, exc
            )
            self.compile, self._fn = False, self._module_on_device()
            self.load_info["compiled"] = ""
            self._predict(zeros)

    def _run_once(self, fn: Callable[[Any], Any], example: Any) -> None:
        with self._torch.inference_mode(), self._flags():
            fn(example)
        if self._dev.type == "cuda":
            self._torch.cuda.synchronize(self._dev)

    def _compiled_is_cached(self, batch: int) -> bool:
        """Whether the artefact cache holds a valid compiled model for this engine (a start
        with it loads it at once: compiling on a background thread would slow the jobs that
        run meanwhile, through the GIL, more than loading it first delays them)."""
        if not self.compile or self.cache_dir is None:
            return False
        from segnode.engines.torch_cache import SUBDIR, TorchCache

        cache = TorchCache(self.cache_dir / SUBDIR)
        key = self._cache_key(batch)
        kinds = ("aoti", "inductor") if key.kind == "aoti" else ("inductor",)
        return any(cache.lookup(replace(key, kind=kind))[0] is not None for kind in kinds)

    def _cache_key(self, batch: int) -> TorchKey:
        """The compiled-artefact cache key of this engine's model at ``batch``, of the kind
        asked for (``compile_cache``)."""
        from segnode.engines.torch_compile import runtime_facts, torch_key

        assert self.manifest is not None
        return torch_key(
            self.manifest,
            runtime_facts(self._torch, self._dev),
            kind=self.compile_cache,
            precision="fp16" if self.half else "fp32",
            batch=batch,
            channels_last=bool(self.channels_last),
            compile_mode=self.compile_mode,
        )

    def _compiled(self, example: Any) -> Any:
        """The :class:`segnode.engines.torch_compile.Compiled` predictor from the artefact
        cache (built on a miss); raises when nothing can be compiled. Changes nothing of the
        engine, so that it can run on the background thread."""
        from segnode.engines.torch_cache import SUBDIR, TorchCache
        from segnode.engines.torch_compile import compile_cached

        assert self.manifest is not None and self.cache_dir is not None
        return compile_cached(
            self._torch,
            self._module_on_device,
            example,
            lambda fn: self._run_once(fn, example),
            cache=TorchCache(self.cache_dir / SUBDIR),
            manifest=self.manifest,
            key=self._cache_key(int(example.shape[0])),
        )

    def _compile_cached(self, example: Any) -> Callable[[Any], Any] | None:
        """The predictor from the compiled-artefact cache (built on a miss), or None (with a
        warning) when nothing can be compiled: the caller then runs the model eagerly."""
        try:
            compiled = self._compiled(example)
        except self._torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:
            self._compile_failed(exc)
            return None
        self._record_compiled(compiled)
        return compiled.fn  # type: ignore[no-any-return]

    def _compile_failed(self, exc: BaseException) -> None:
        assert self.manifest is not None
        logger.warning(
            "no compiled artefact for %s (%s: %s); running eagerly",
            self.manifest.name,
            type(exc).__name__,
            exc,
        )
        self.compile = False

    def _record_compiled(self, compiled: Any) -> None:
        loaded = compiled.loaded
        self.load_info.update(
            compiled=compiled.kind,
            cache_hit=loaded.hit,
            artefact=str(loaded.path),
            build_seconds=round(loaded.build_seconds, 3),
            artefact_load_seconds=round(loaded.load_seconds, 3),
        )

    def _start_compiling(self, example: Any) -> None:
        """Load or build the compiled predictor on a background thread (see
        ``eager_while_compiling``); :meth:`_adopt_compiled` puts it in use."""
        assert self.manifest is not None
        name = self.manifest.name
        self.compiled_ready.clear()
        future: Future[Any] = Future()
        started = self._load_started

        def run() -> None:
            try:
                if self._dev.type == "cuda" and self._dev.index is not None:
                    self._torch.cuda.set_device(self._dev.index)  # a new thread's is 0
                future.set_result(self._compiled(example))
                logger.info(
                    "compiled model for %s ready %.1f s after the load began; in use from "
                    "the next job",
                    name,
                    time.perf_counter() - started,
                )
            except BaseException as exc:
                logger.warning(
                    "compiling %s failed (%s: %s); jobs keep running eagerly",
                    name,
                    type(exc).__name__,
                    exc,
                )
                future.set_exception(exc)
            finally:
                self.compiled_ready.set()

        self._compiling = future
        threading.Thread(target=run, name="segnode-torch-compile", daemon=True).start()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until every background compilation (each fold's) has ended; False on
        timeout. The compiled predictors are used from the next segmentation."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for engine in self.fold_engines or [self]:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not engine.compiled_ready.wait(left):
                return False
        return True

    def _adopt_compiled(self) -> None:
        """Between segmentations: put a compiled predictor that became ready in use."""
        with self._lock:  # two jobs starting at once adopt it once
            future = self._compiling
            if future is None or not future.done():
                return
            self._compiling = None
        try:
            compiled = future.result()
        except Exception as exc:
            self._compile_failed(exc)
            self.load_info["compiled"] = ""
            return
        self._record_compiled(compiled)
        self._fn = compiled.fn
        seconds = round(time.perf_counter() - self._load_started, 3)
        self.load_info["compiled_after_seconds"] = seconds
        assert self.manifest is not None
        logger.info(
            "compiled model for %s in use (%s%s), %.1f s after the load began",
            self.manifest.name,
            compiled.kind,
            ", cached" if compiled.loaded.hit else "",
            seconds,
        )

    def _example(self, zeros: Any) -> Any:
        """The compiler's example input, made as the jobs' inputs are: under
        ``torch.inference_mode``. A tensor made outside it carries another dispatch key set,
        which fails one of Dynamo's guards, so that the first job compiled the model again
        (12-16 s on the H200 after a restart with the compiled model cached)."""
        with self._torch.inference_mode():
            return self._prepare(zeros.clone())

    def _prepare(self, patches: Any) -> Any:
        """Patches on the device, in the engine's dtype and dense in its memory format: a
        compiled module is specialised to its example's strides, and a view of the sliding
        window's buffer would fail that guard and compile the model again."""
        torch = self._torch
        x = patches.to(device=self._dev, dtype=self._dtype)
        fmt = torch.channels_last_3d if self.channels_last else torch.contiguous_format
        return x.contiguous(memory_format=fmt)

    def _graph(self, n: int) -> tuple[Any, Any, Any]:
        torch = self._torch
        if n not in self._graphs:
            assert self.manifest is not None
            static_in = self._prepare(
                torch.zeros((n, 1, *self.manifest.patch_size), device=self._dev)
            )
            side = torch.cuda.Stream(device=self._dev)
            side.wait_stream(torch.cuda.current_stream(self._dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # cuDNN picks its algorithms outside the capture
                    self._fn(static_in)
            torch.cuda.current_stream(self._dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = self._fn(static_in)
            self._graphs[n] = (graph, static_in, static_out)
        return self._graphs[n]

    def _predict(self, patches: Any) -> Any:
        """Float32 logits ``(N, C, *patch)`` of ``(N, 1, *patch)`` patches, on the device.

        Compiled modules and CUDA graphs are specialised to one batch size: a smaller last
        batch is padded with zeros (and the padding's logits dropped) instead of triggering a
        recompilation or a second capture; a larger one is split.
        """
        torch = self._torch
        n, batch = int(patches.shape[0]), self._batch
        static = self.compile or self.cuda_graphs
        if static and n > batch:
            parts = [self._predict(patches[i : i + batch]) for i in range(0, n, batch)]
            return torch.cat(parts)
        if static and n < batch:
            pad = patches.new_zeros((batch - n, *patches.shape[1:]))
            return self._predict(torch.cat([patches, pad]))[:n]
        with torch.inference_mode(), self._flags():
            if self.cuda_graphs:
                graph, static_in, static_out = self._graph(n)
                static_in.copy_(patches)
                graph.replay()
                return static_out.to(torch.float32, copy=True)
            return self._fn(self._prepare(patches)).to(torch.float32)

    def predict(self, patches: Any) -> Any:
        """Public form of the predictor the sliding window calls (for benchmarks)."""
        self._adopt_compiled()
        return self._predict(patches)

    def fold_predictors(self) -> list[PatchPredictor]:
        """One predictor per fold file (:class:`segnode.engines.base.TrainedEngine`): float32
        ``(N, 1, *patch)`` tensors on the device in, float32 scores on the device out (cast to
        FP16 inside where the engine runs in half precision; a compiled or graphed module's
        batch is split or padded to its static size)."""
        loaded(self.manifest, self.name)
        if not self.fold_engines:
            self._adopt_compiled()
            return [self._predict]
        for fold in self.fold_engines:
            fold._adopt_compiled()
        return [fold._predict for fold in self.fold_engines]

    def window_batch(self) -> int:
        """Tiles per predictor call: the engine's batch (see :func:`default_batch`)."""
        return self._batch

    def to_device(self, hu: npt.NDArray[np.float32]) -> Any:
        """The volume as a float32 tensor on the engine's device (one copy)."""
        torch = loaded(self._torch, self.name)
        host = torch.from_numpy(np.ascontiguousarray(hu, dtype=np.float32))
        return host.to(self._dev)

    def to_host(self, labels: Any) -> npt.NDArray[np.uint8]:
        """The uint8 label map, copied back through page-locked memory on a GPU."""
        return self._to_host(labels.to(self._torch.uint8))

    @contextlib.contextmanager
    def device_scope(self) -> Iterator[None]:
        """``torch.inference_mode`` on the engine's device; out of GPU memory becomes an
        :class:`EngineError`."""
        torch = loaded(self._torch, self.name)
        with (
            out_of_gpu_memory(torch.cuda.OutOfMemoryError, "running a trained model"),
            torch.inference_mode(),
        ):
            if self._dev.type == "cuda":
                with torch.cuda.device(self._dev):
                    yield
            else:
                yield

    def segment(self, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """Label map of a ``(z, y, x)`` HU volume, computed on the engine's device."""
        labels, _ = self._segment(hu, sums=False)
        return labels

    def segment_with_sums(
        self, hu: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.uint8], LabelSums]:
        """The label map and, summed on the device, each label's voxel count, HU sum and
        sum of squared HU (:class:`segnode.engines.base.SumsEngine`).

        The sums are float64 on the device (``torch.bincount`` with float64 weights); for
        integer HU, as CT stores them, they are exact and equal those of
        :func:`segnode.node.results.statistics.segment_statistics` whatever the order of the
        additions.
        """
        labels, sums = self._segment(hu, sums=True)
        assert sums is not None
        return labels, sums

    def _segment(
        self, hu: npt.NDArray[np.float32], *, sums: bool
    ) -> tuple[npt.NDArray[np.uint8], LabelSums | None]:
        from segnode.engines.sliding_window import segment_with_manifest

        m = loaded(self.manifest, self.name)
        check_version_1(m)
        if hu.ndim != 3:
            raise EngineError(f"expected a (z, y, x) volume, got shape {hu.shape}")
        self._adopt_compiled()
        torch = self._torch
        with (
            out_of_gpu_memory(torch.cuda.OutOfMemoryError, f"segmenting a {hu.shape} volume"),
            torch.inference_mode(),
        ):
            raw = torch.from_numpy(np.ascontiguousarray(hu, dtype=np.float32)).to(self._dev)
            # The model's clipping and scaling go to a copy when the HU are summed after,
            # and on the CPU, where ``raw`` is the caller's array.
            volume = raw.clone() if sums or raw.device.type == "cpu" else raw
            if m.clip is not None:
                volume.clamp_(m.clip[0], m.clip[1])
            if m.scale != 1.0:
                volume.mul_(m.scale)
            if m.offset != 0.0:
                volume.add_(m.offset)
            labels = segment_with_manifest(volume, self._predict, m, batch_size=self._batch)
            del volume
            labels = labels.to(torch.uint8)
            totals = self._label_sums(labels, raw) if sums else None
            del raw
            result: npt.NDArray[np.uint8] = self._to_host(labels)
            label_sums = None
            if totals is not None:
                table = totals.cpu().numpy()
                label_sums = LabelSums(
                    counts=table[0].astype(np.int64),
                    sums=np.ascontiguousarray(table[1]),
                    squares=np.ascontiguousarray(table[2]),
                )
        return result, label_sums

    def label_sums(self, labels: Any, hu: Any) -> LabelSums:
        """:class:`~segnode.engines.base.LabelSums` of a uint8 label map and its HU, both
        tensors on the engine's device, summed there
        (:class:`~segnode.engines.base.DeviceSumsEngine`: a trained model's statistics
        without reading the volume again on the host)."""
        table = self._label_sums(labels, hu).cpu().numpy()
        return LabelSums(
            counts=table[0].astype(np.int64),
            sums=np.ascontiguousarray(table[1]),
            squares=np.ascontiguousarray(table[2]),
        )

    def _label_sums(self, labels: Any, hu: Any) -> Any:
        """float64 ``(3, n)`` on the device: per label value 0..n-1 (n: the model's classes,
        or more if the label map holds larger values) the voxel count, the sum of ``hu`` and
        the sum of its squares (counts are exact in float64 up to 2**53).

        Up to :data:`MASKED_SUMS_MAX` values, one masked reduction per label value rather
        than ``torch.bincount`` with weights: bincount adds every voxel into one of a handful
        of bins with atomic float64 adds, which serialise on a GPU (10.2 ms against 3.9 ms
        for 128 x 512 x 512 on the H200). With many labels (TotalSegmentator's 117) the
        masked passes add up and three bincounts win.
        """
        torch = self._torch
        assert self.manifest is not None
        wide = hu.reshape(-1).to(torch.float64)
        flat = labels.reshape(-1)
        n = max(self.manifest.num_classes, int(flat.max()) + 1)
        if n > MASKED_SUMS_MAX:
            index = flat.to(torch.int64)
            return torch.stack(
                [
                    torch.bincount(index, minlength=n).to(torch.float64),
                    torch.bincount(index, weights=wide, minlength=n),
                    torch.bincount(index, weights=wide * wide, minlength=n),
                ]
            )
        zero = wide.new_zeros(())
        rows = []
        for value in range(n):
            hit = flat == value
            picked = torch.where(hit, wide, zero)
            rows.append(
                torch.stack([hit.sum(dtype=torch.float64), picked.sum(), picked.mul_(picked).sum()])
            )
        return torch.stack(rows, dim=1)

    def _to_host(self, labels: Any) -> npt.NDArray[np.uint8]:
        """The uint8 label map as a NumPy array, copied from the GPU through page-locked
        memory (torch's caching host allocator hands the same block back next time; the
        array keeps it until it is dropped). A copy from the device into pageable memory
        runs at about a tenth of the speed (20.7 ms against ~2 ms for 33.6 MB, H200)."""
        torch = self._torch
        if labels.device.type != "cuda":
            array: npt.NDArray[np.uint8] = labels.numpy()
            return array
        host = torch.empty(labels.shape, dtype=labels.dtype, pin_memory=True)
        host.copy_(labels, non_blocking=True)
        torch.cuda.current_stream(labels.device).synchronize()
        array = host.numpy()
        return array

    def has_room(self) -> bool:
        """Whether the GPU has the memory for one more job beside those running now
        (:class:`segnode.engines.base.SlotEngine`): its free memory, with what PyTorch's
        allocator holds unused (it hands that back before it fails an allocation), and under
        ``gpu_memory_limit``, at least :data:`ROOM_MARGIN` times the largest peak a job of
        this model took running alone. False before such a job, off a CUDA GPU, and with CUDA
        graphs (one set of static buffers)."""
        torch, dev = self._torch, self._dev
        need = self.solo_peak
        if need is None or dev is None or dev.type != "cuda" or self.cuda_graphs:
            return False
        free, _ = torch.cuda.mem_get_info(dev)
        allocated = torch.cuda.memory_allocated(dev)
        room = free + torch.cuda.memory_reserved(dev) - allocated
        if self.gpu_memory_limit:
            room = min(room, self.gpu_memory_limit - allocated)
        return bool(room >= ROOM_MARGIN * need)

    @contextlib.contextmanager
    def job_scope(self, shared: Callable[[], bool]) -> Iterator[None]:
        """One job's model on this lane's own CUDA stream
        (:class:`segnode.engines.base.SlotEngine`), so that two jobs' kernels interleave on
        the GPU. A job that started alone has the allocator's peak reset; if no other job ran
        beside it by its end, its peak above the memory allocated before it becomes
        :attr:`solo_peak` (the largest of them). Off a CUDA GPU: nothing."""
        torch, dev = self._torch, self._dev
        if torch is None or dev is None or dev.type != "cuda":
            yield
            return
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(device=dev)
        base = torch.cuda.memory_allocated(dev)
        if not shared():
            torch.cuda.reset_peak_memory_stats(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            yield  # the job's results reach the host through a synchronised copy
        if not shared():
            peak = torch.cuda.max_memory_allocated(dev) - base
            with self._lock:
                self.solo_peak = max(self.solo_peak or 0, peak)

    def _cap_memory(self) -> None:
        """Cap PyTorch's allocator at ``gpu_memory_limit`` bytes of the GPU
        (``torch.cuda.set_per_process_memory_fraction``; ``[engine] gpu_memory_limit``): an
        allocation past it raises out of memory as a full GPU would, and a job then goes
        down :func:`segnode.engines.trained.memory_ladder`."""
        torch, dev = self._torch, self._dev
        if not self.gpu_memory_limit or dev is None or dev.type != "cuda":
            return
        total = torch.cuda.get_device_properties(dev).total_memory
        fraction = min(1.0, self.gpu_memory_limit / total)
        torch.cuda.set_per_process_memory_fraction(fraction, dev)
        logger.info(
            "torch engine: GPU memory capped at %.1f GiB of %.1f GiB",
            fraction * total / 2**30,
            total / 2**30,
        )

    def release_memory(self) -> None:
        """Hand the allocator's cached, unused GPU blocks back to the driver (after running
        out of memory, before :func:`segnode.engines.trained.segment_trained` tries again)."""
        if self._torch is not None and self._dev is not None and self._dev.type == "cuda":
            self._torch.cuda.synchronize(self._dev)
            self._torch.cuda.empty_cache()

    def close(self) -> None:
        """Drop the module (every fold's), graphs and cached device memory."""
        for fold in self.fold_engines:
            fold.close()
        self.fold_engines = []
        self._graphs = {}
        self._fn = self._module = None
        self._compiling = None  # a background compilation still running is dropped
        if self._torch is not None and self._dev is not None and self._dev.type == "cuda":
            self._torch.cuda.empty_cache()
