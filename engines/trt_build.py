"""Building TensorRT engines: flavour, GPU target, ONNX parsing, FP16, profile, timing cache.

:func:`build_engine` returns the cached engine for a model and its :class:`BuildSettings`
(precision, TensorRT flavour and GPU target), building it on a miss (see
:mod:`segnode.engines.engine_cache` for the cache and its checks). With TensorRT-RTX it builds
ahead of time without a GPU, so it runs in CI; :mod:`segnode.engines.trt_backend` re-exports it
and runs the engines.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from segnode.engines.base import EngineError, checked_precision
from segnode.engines.engine_cache import (
    CachedEngine,
    EngineCache,
    EngineKey,
    EngineRecord,
    atomic_write,
)

if TYPE_CHECKING:
    from segnode.engines.manifest import ModelManifest

logger = logging.getLogger(__name__)

FLAVOURS = ("tensorrt", "tensorrt_rtx")
_MODULES = {"tensorrt": ("tensorrt",), "tensorrt_rtx": ("tensorrt_rtx", "tensorrt_rtx_bindings")}
PORTABLE = "portable"
_WORKSPACE_BYTES = 4 << 30


@dataclass(frozen=True)
class Flavour:
    """An imported TensorRT library."""

    name: str  # "tensorrt" | "tensorrt_rtx"
    module: Any
    version: str

    @property
    def is_rtx(self) -> bool:
        """True for TensorRT for RTX."""
        return self.name == "tensorrt_rtx"


def _checked_flavour(flavour: str) -> None:
    if flavour not in ("auto", *FLAVOURS):
        raise EngineError(
            f"unknown TensorRT flavour {flavour!r}; use auto, tensorrt or tensorrt_rtx"
        )


def load_flavour(flavour: str = "auto") -> Flavour:
    """Import TensorRT (``"tensorrt"``), TensorRT-RTX (``"tensorrt_rtx"``) or the first that works.

    ``"auto"`` takes full TensorRT when it imports and a CUDA GPU is present (it cannot build
    without one), else TensorRT-RTX, which builds ahead of time on any machine.

    Raises
    ------
    EngineError
        If the requested flavour (or, for ``"auto"``, neither) can be imported.
    """
    _checked_flavour(flavour)
    wanted = FLAVOURS if flavour == "auto" else (flavour,)
    problems = []
    for name in wanted:
        for module_name in _MODULES[name]:
            try:
                module = __import__(module_name)
                version = str(module.__version__)
                module.Logger  # noqa: B018 - the PyPI "tensorrt" stub imports but has no API
            except Exception as exc:  # ImportError, OSError from dlopen, the stub's RuntimeError
                problems.append(f"{module_name}: {exc}")
                continue
            if flavour == "auto" and name == "tensorrt":
                try:
                    gpu_info()
                except EngineError as exc:
                    problems.append(f"{module_name}: needs a GPU ({exc})")
                    continue
            return Flavour(name=name, module=module, version=version)
    raise EngineError(
        "TensorRT is not usable here ("
        + "; ".join(problems)
        + "). Install TensorRT-RTX (pip install tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings)"
        " or NVIDIA TensorRT."
    )


# --------------------------------------------------------------------------- GPU facts


@dataclass(frozen=True)
class GpuInfo:
    """The CUDA device an engine runs on."""

    index: int
    name: str
    compute_capability: tuple[int, int]
    total_memory: int

    @property
    def target(self) -> str:
        """Engine-cache target string, for example ``"sm90"``."""
        return f"sm{self.compute_capability[0]}{self.compute_capability[1]}"


def gpu_info(device: int = 0) -> GpuInfo:
    """Describe CUDA device ``device`` through CuPy.

    Raises
    ------
    EngineError
        If CuPy is missing, no CUDA driver or device is present, or ``device`` does not exist.
    """
    try:
        import cupy
    except ImportError as exc:
        raise EngineError(f"no GPU usable: CuPy is not installed ({exc})") from exc
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        if not 0 <= device < count:
            raise EngineError(f"no CUDA GPU {device} (found {count})")
        props = cupy.cuda.runtime.getDeviceProperties(device)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise EngineError(f"no CUDA GPU usable: {exc}") from exc
    name = props["name"]
    return GpuInfo(
        index=device,
        name=name.decode() if isinstance(name, bytes) else str(name),
        compute_capability=(int(props["major"]), int(props["minor"])),
        total_memory=int(props["totalGlobalMem"]),
    )


def rtx_targets(flavour: Flavour) -> list[str]:
    """Compute capabilities this TensorRT-RTX can target, as ``"smXY"`` (from its enum)."""
    members = flavour.module.ComputeCapability.__members__
    return sorted(m.lower() for m in members if m.startswith("SM"))


def resolve_target(flavour: Flavour, target: str | None, device: int = 0) -> str:
    """Normalise the GPU target of a build.

    ``None`` means the current GPU for TensorRT and ``"portable"`` for TensorRT-RTX;
    ``"current"`` means the current GPU for both; otherwise ``"sm86"`` / ``"8.6"`` style.
    """
    if target is None:
        target = "current" if not flavour.is_rtx else PORTABLE
    target = target.strip().lower()
    if target == "current":
        return gpu_info(device).target
    if target == PORTABLE:
        if not flavour.is_rtx:
            raise EngineError("only TensorRT-RTX builds portable engines; TensorRT builds per GPU")
        return PORTABLE
    if "." in target:
        major, _, minor = target.partition(".")
        target = f"sm{major}{minor}"
    if not (target.startswith("sm") and target[2:].isdigit()):
        raise EngineError(f"GPU target {target!r} is not 'portable', 'current' or like 'sm86'")
    if flavour.is_rtx and target not in rtx_targets(flavour):
        raise EngineError(
            f"TensorRT-RTX {flavour.version} cannot target {target}; "
            f"choose one of {', '.join(rtx_targets(flavour))} or 'portable'"
        )
    if not flavour.is_rtx and target != gpu_info(device).target:
        raise EngineError(f"TensorRT builds only for the GPU present, not {target}")
    return target


# --------------------------------------------------------------------------- build settings


@dataclass(frozen=True)
class BuildSettings:
    """What a TensorRT build is asked for: precision, library and GPU target.

    ``segnode engine build`` makes one from its ``--precision --flavour --target``,
    :class:`segnode.engines.trt_backend.TensorRTEngine` from its options (the ``[model]``
    precision); :func:`build_engine` takes it. :meth:`resolve` settles ``"auto"`` and ``None``
    against the library that imports here and the GPU present.

    Attributes
    ----------
    precision
        ``"fp32"`` or ``"fp16"``; fp16 is built only where the manifest allows it
        (:meth:`precision_for`).
    flavour
        ``"auto"``, ``"tensorrt"`` or ``"tensorrt_rtx"``; see :func:`load_flavour`.
    target
        GPU target; see :func:`resolve_target`. ``None`` is a portable ahead-of-time build with
        TensorRT-RTX, which needs no GPU, and a build for the current GPU with TensorRT.

    Raises
    ------
    EngineError
        If the precision is not fp32 or fp16, or the flavour is none of the three.
    """

    precision: str = "fp32"
    flavour: str = "auto"
    target: str | None = None

    def __post_init__(self) -> None:
        checked_precision(self.precision, "tensorrt")
        _checked_flavour(self.flavour)

    def resolve(self, device: int = 0) -> tuple[Flavour, str]:
        """The library these settings ask for, and the GPU target normalised for it and CUDA
        device ``device``.

        Raises
        ------
        EngineError
            If the library cannot be imported or the target is impossible.
        """
        lib = load_flavour(self.flavour)
        return lib, resolve_target(lib, self.target, device)

    def precision_for(self, manifest: ModelManifest) -> str:
        """``"fp16"`` only when asked for and ``manifest`` allows it, else ``"fp32"``."""
        if self.precision == "fp16" and not manifest.fp16:
            logger.warning(
                "model %s does not allow fp16 (manifest fp16=false); building fp32", manifest.name
            )
            return "fp32"
        return self.precision


# --------------------------------------------------------------------------- build


def make_trt_logger(trt: Any) -> Any:
    """A TensorRT ``ILogger`` that forwards to :mod:`logging` and keeps the errors."""

    class _Logger(trt.ILogger):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
                logger.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                logger.warning("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.INFO:
                logger.debug("TensorRT: %s", msg)

    return _Logger()


def _make_progress_monitor(trt: Any, label: str) -> Any:
    """An ``IProgressMonitor`` that logs top-level phases and their steps."""

    class _Progress(trt.IProgressMonitor):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self._started: dict[str, float] = {}
            self._steps: dict[str, int] = {}
            self._top: set[str] = set()

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self._started[phase_name] = time.perf_counter()
            self._steps[phase_name] = num_steps
            if parent_phase is None:
                self._top.add(phase_name)
            level = logging.INFO if parent_phase is None else logging.DEBUG
            logger.log(level, "%s: %s started (%d steps)", label, phase_name, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            logger.debug(
                "%s: %s step %d/%d", label, phase_name, step + 1, self._steps.get(phase_name, 0)
            )
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            took = time.perf_counter() - self._started.pop(phase_name, time.perf_counter())
            level = logging.INFO if phase_name in self._top else logging.DEBUG
            logger.log(level, "%s: %s finished in %.2f s", label, phase_name, took)

    return _Progress()


def onnx_to_fp16(model: Any) -> Any:
    """Convert an ONNX model's float32 weights and ops to float16, keeping float32 I/O.

    Uses ``onnxconverter_common.float16`` (or the copy shipped in ``onnxruntime.transformers``).
    The converter leaves the model's own ``Cast(to=FLOAT)`` nodes alone although it retypes
    their consumers to float16, which a strongly typed network rejects ("SUB must have same
    input types"); those casts are retargeted to FLOAT16 here. Ops on the converter's block
    list (Resize, CumSum, Max, ...) keep float32 behind the casts it inserts.
    """
    try:
        from onnxconverter_common import float16
    except ImportError:
        try:
            from onnxruntime.transformers import float16
        except ImportError as exc:
            raise EngineError(
                "FP16 engines need onnxconverter-common (pip install onnxconverter-common)"
            ) from exc
    from onnx import TensorProto

    own_casts = {n.name for n in model.graph.node if n.op_type == "Cast"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # per-weight "truncated to 1e-07" notes
        converted = float16.convert_float_to_float16(model, keep_io_types=True)
    for node in converted.graph.node:
        if node.op_type == "Cast" and node.name in own_casts:
            for attr in node.attribute:
                if attr.name == "to" and attr.i == TensorProto.FLOAT:
                    attr.i = TensorProto.FLOAT16
    _toposort(converted.graph)  # onnxruntime's copy appends the input casts at the end
    return converted


def _toposort(graph: Any) -> None:
    """Reorder ``graph.node`` so every node follows the producers of its inputs (stable).

    Exact duplicates (same operator, inputs, outputs and attributes, as older copies of the
    converter emit for a tensor feeding two block-listed ops) are dropped on the way.
    """
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    seen: set[tuple[Any, ...]] = set()
    pending, ordered = [], []
    for node in graph.node:
        signature = (
            node.op_type,
            node.domain,
            tuple(node.input),
            tuple(node.output),
            tuple(a.SerializeToString() for a in node.attribute),
        )
        if signature not in seen:
            seen.add(signature)
            pending.append(node)
    while pending:
        ready = [n for n in pending if all(i in available for i in n.input)]
        if not ready:  # a cycle or a dangling input: leave the rest for the parser to report
            ordered += pending
            break
        for node in ready:
            available.update(node.output)
        ordered += ready
        ready_ids = {id(n) for n in ready}
        pending = [n for n in pending if id(n) not in ready_ids]
    copies = [type(n)() for n in ordered]
    for copy, node in zip(copies, ordered, strict=True):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)


def _parse(trt: Any, network: Any, log: Any, onnx_bytes: bytes, path: Path) -> None:
    parser = trt.OnnxParser(network, log)
    if parser.parse(onnx_bytes, str(path)):
        return
    problems = []
    for i in range(parser.num_errors):
        err = parser.get_error(i)
        node, name, op = err.node(), err.node_name(), err.node_operator()
        where = f"node {node} {name!r} ({op})" if node >= 0 else "model"
        problems.append(f"{where}: {err.desc()} [{err.code()}]")
    raise EngineError(f"TensorRT cannot parse {path.name}: " + "; ".join(problems or ["unknown"]))


def _network_batch(network: Any, input_name: str) -> int:
    """-1 when the network's batch dimension is dynamic, else its static size."""
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        if tensor.name == input_name:
            return int(tensor.shape[0])
    names = [network.get_input(i).name for i in range(network.num_inputs)]
    raise EngineError(f"the model has no input {input_name!r} (inputs: {names})")


def _serialize(flavour: Flavour, manifest: ModelManifest, key: EngineKey, timing: Path) -> bytes:
    trt = flavour.module
    log = make_trt_logger(trt)
    try:
        builder = trt.Builder(log)
    except Exception as exc:  # full TensorRT without a GPU raises here
        raise EngineError(f"{flavour.name} cannot create a builder: {exc}") from exc
    if builder is None:
        raise EngineError(f"{flavour.name} cannot create a builder: {'; '.join(log.errors)}")
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))

    import onnx

    if key.precision == "fp16":
        onnx_bytes = onnx_to_fp16(onnx.load(str(manifest.onnx_path))).SerializeToString()
    else:
        onnx_bytes = manifest.onnx_path.read_bytes()
    _parse(trt, network, log, onnx_bytes, manifest.onnx_path)

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, _WORKSPACE_BYTES)
    monitor = _make_progress_monitor(trt, f"build {key.stem}")
    config.progress_monitor = monitor

    bmin, bopt, bmax = key.batch
    static = _network_batch(network, key.input_name)
    if static > 0 and static not in key.batch:
        logger.warning("model has a static batch of %d; profile %s ignored", static, key.batch)
        bmin = bopt = bmax = static
    profile = builder.create_optimization_profile()
    profile.set_shape(
        key.input_name,
        (bmin, 1, *key.patch_size),
        (bopt, 1, *key.patch_size),
        (bmax, 1, *key.patch_size),
    )
    config.add_optimization_profile(profile)

    timing_cache = None
    if flavour.is_rtx:
        if key.target != PORTABLE:
            config.num_compute_capabilities = 1
            config.set_compute_capability(trt.ComputeCapability.__members__[key.target.upper()], 0)
    else:
        blob = timing.read_bytes() if timing.exists() else b""
        timing_cache = config.create_timing_cache(blob)
        if timing_cache is None or not config.set_timing_cache(timing_cache, False):
            logger.warning("timing cache %s rejected; starting an empty one", timing.name)
            timing_cache = config.create_timing_cache(b"")
            config.set_timing_cache(timing_cache, False)

    try:
        plan = builder.build_serialized_network(network, config)
    except MemoryError as exc:
        raise EngineError(f"out of memory while building {manifest.name}: {exc}") from exc
    if plan is None:
        detail = "; ".join(log.errors) or "no detail from TensorRT"
        kind = "out of memory" if "memory" in detail.lower() else "build failed"
        raise EngineError(f"TensorRT {kind} for {manifest.name}: {detail}")
    if timing_cache is not None:
        atomic_write(timing, bytes(config.get_timing_cache().serialize()))
    del monitor
    return bytes(plan)


def engine_key(
    manifest: ModelManifest, flavour: Flavour, *, precision: str, target: str
) -> EngineKey:
    """The cache key of ``manifest`` built by ``flavour`` at ``precision`` for ``target``."""
    return EngineKey(
        model_sha256=manifest.sha256(),
        model_name=manifest.name,
        flavour=flavour.name,
        trt_version=flavour.version,
        target=target,
        precision=precision,
        input_name=manifest.input_name,
        batch=(manifest.batch_min, manifest.batch_opt, manifest.batch_max),
        patch_size=manifest.patch_size,
    )


@contextmanager
def _build_device(lib: Flavour, device: int) -> Iterator[None]:
    """Make CUDA device ``device`` current while full TensorRT builds: it builds for the current
    device, so on a host with GPUs of different models a build for GPU 1 must not run on GPU 0.
    TensorRT-RTX builds for the target it is given and needs no device."""
    if lib.is_rtx:
        yield
        return
    try:
        import cupy as cp
    except ImportError as exc:
        if device != 0:
            raise EngineError(
                f"building for CUDA device {device} needs CuPy to select it ({exc})"
            ) from exc
        yield
        return
    with cp.cuda.Device(device):
        yield


def build_engine(
    manifest: ModelManifest, settings: BuildSettings, *, cache_dir: str | Path, device: int = 0
) -> CachedEngine:
    """Return the cached engine for ``manifest``, building it first when needed.

    Parameters
    ----------
    manifest
        The model.
    settings
        Precision, TensorRT flavour and GPU target of the build.
    cache_dir
        The engine cache, normally ``<data_dir>/engines``.
    device
        The CUDA device whose GPU ``"auto"`` and a ``None`` target resolve against, and on
        which full TensorRT builds.

    Raises
    ------
    EngineError
        If TensorRT is missing, the ONNX does not parse (the message names node and operator),
        the build runs out of memory or fails, or the target is impossible.
    """
    started = time.perf_counter()
    lib, target = settings.resolve(device)
    key = engine_key(manifest, lib, precision=settings.precision_for(manifest), target=target)
    cache = EngineCache(Path(cache_dir))
    with cache.lock(key):
        data, problem = cache.lookup(key)
        if data is not None:
            return CachedEngine(
                path=cache.engine_path(key),
                hit=True,
                seconds=time.perf_counter() - started,
                size_bytes=len(data),
                key=key,
            )
        if problem:
            logger.warning("rebuilding %s: %s", key.stem, problem)
            cache.discard(key)
        logger.info(
            "building %s engine for %s (%s, %s, target %s)",
            lib.name,
            manifest.name,
            lib.version,
            key.precision,
            key.target,
        )
        t0 = time.perf_counter()
        with _build_device(lib, device):
            plan = _serialize(
                lib, manifest, key, cache.timing_cache_path(lib.name, lib.version, key.target)
            )
        build_seconds = time.perf_counter() - t0
        path = cache.store(
            key, plan, build_seconds=build_seconds, onnx_path=str(manifest.onnx_path)
        )
        cache.prune_superseded(key)
    seconds = time.perf_counter() - started
    logger.info("built %s (%.1f MB) in %.1f s", path.name, len(plan) / 1e6, build_seconds)
    return CachedEngine(path=path, hit=False, seconds=seconds, size_bytes=len(plan), key=key)


def list_engines(cache_dir: str | Path) -> list[EngineRecord]:
    """Every engine in ``cache_dir``, newest first, each verified against its checksum."""
    return EngineCache(Path(cache_dir)).entries(verify=True)
