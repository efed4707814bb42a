"""Building TensorRT engines, and their on-disk cache keyed by everything that makes them differ.

:func:`build_engine` returns the engine for a model, precision, TensorRT flavour and GPU
target, building it on a cache miss; it needs no GPU with TensorRT-RTX (ahead-of-time build),
so it runs in CI. :mod:`engines.trt_backend` re-exports it and runs the engines.

Layout of ``<data_dir>/engines/``::

    <stem>.engine        the serialized engine (plan)
    <stem>.json          sidecar: the key, the engine's SHA-256 and size, build time
    <stem>.rtcache       TensorRT-RTX runtime (JIT kernel) cache, written after first use
    timing/<...>.cache   TensorRT timing caches, one per flavour, version and GPU target

``<stem>`` is ``<model>-<precision>-<flavour>-<target>-<first 16 hex of the key digest>``. Every
file is written atomically (temporary file in the same folder, ``fsync``, ``os.replace``, then
``fsync`` of the folder), the engine before its sidecar, so a sidecar names only a complete
engine. A lookup trusts nothing: an entry whose sidecar is missing, unreadable, written for
another key, or whose engine file has another size or SHA-256 is reported stale and rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.base import EngineError

if TYPE_CHECKING:
    from engines.manifest import ModelManifest

logger = logging.getLogger(__name__)

FORMAT = 1
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _safe(text: str) -> str:
    """File-name-safe form of a model name or target (never a raw string in a path)."""
    cleaned = "".join(c if c in _SAFE else "_" for c in text).strip("._")
    return cleaned[:48] or "model"


@dataclass(frozen=True)
class EngineKey:
    """What an engine depends on; two builds with equal keys give interchangeable engines.

    Attributes
    ----------
    model_sha256
        SHA-256 of the ONNX file.
    model_name
        Manifest name (for file names and listings only; not part of the digest).
    flavour
        ``"tensorrt"`` or ``"tensorrt_rtx"``.
    trt_version
        Version of the TensorRT library that built the engine.
    target
        ``"sm90"`` style compute capability, or ``"portable"`` for a TensorRT-RTX
        ahead-of-time engine that runs on every GPU the library supports.
    precision
        ``"fp32"`` or ``"fp16"`` (strongly typed network from an FP16 ONNX).
    input_name
        Name of the network input the profile applies to.
    batch
        ``(min, opt, max)`` of the optimisation profile over the batch dimension.
    patch_size
        Static ``(z, y, x)`` patch dimensions.
    """

    model_sha256: str
    model_name: str
    flavour: str
    trt_version: str
    target: str
    precision: str
    input_name: str
    batch: tuple[int, int, int]
    patch_size: tuple[int, int, int]

    def digest(self) -> str:
        """SHA-256 over the canonical JSON of every field except ``model_name``."""
        fields = asdict(self)
        fields.pop("model_name")
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def stem(self) -> str:
        """File stem of this key's engine, sidecar and runtime cache."""
        return "-".join(
            (
                _safe(self.model_name),
                self.precision,
                self.flavour,
                _safe(self.target),
                self.digest()[:16],
            )
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EngineKey:
        """Inverse of :func:`dataclasses.asdict` (lists back to tuples)."""
        b, p = raw["batch"], raw["patch_size"]
        return cls(
            model_sha256=str(raw["model_sha256"]),
            model_name=str(raw["model_name"]),
            flavour=str(raw["flavour"]),
            trt_version=str(raw["trt_version"]),
            target=str(raw["target"]),
            precision=str(raw["precision"]),
            input_name=str(raw["input_name"]),
            batch=(int(b[0]), int(b[1]), int(b[2])),
            patch_size=(int(p[0]), int(p[1]), int(p[2])),
        )


@dataclass(frozen=True)
class CachedEngine:
    """Result of :func:`engines.trt_backend.build_engine`.

    Attributes
    ----------
    path
        The serialized engine.
    hit
        True when a valid cached engine was reused, False when it was built now.
    seconds
        Wall time of the lookup plus, on a miss, the build.
    size_bytes
        Size of the engine file.
    key
        The key the engine was built for (``key.digest()`` identifies it).
    """

    path: Path
    hit: bool
    seconds: float
    size_bytes: int
    key: EngineKey


@dataclass(frozen=True)
class EngineRecord:
    """One entry of the cache, as read from its sidecar."""

    path: Path
    key: EngineKey
    size_bytes: int
    build_seconds: float
    created: str
    valid: bool
    problem: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The bytes go to a temporary file in the same folder, which is flushed, ``fsync``-ed and
    renamed over ``path`` with :func:`os.replace`; the folder is ``fsync``-ed afterwards so
    the rename survives a power loss.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sha256_bytes(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


class EngineCache:
    """The engine folder: lookup with validation, atomic store, listing.

    Parameters
    ----------
    root
        The cache folder, normally ``<data_dir>/engines``; created on first store.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def engine_path(self, key: EngineKey) -> Path:
        """Where the engine for ``key`` lives (whether or not it exists)."""
        return self.root / f"{key.stem}.engine"

    def sidecar_path(self, key: EngineKey) -> Path:
        """The sidecar JSON of ``key``."""
        return self.root / f"{key.stem}.json"

    def runtime_cache_path(self, key: EngineKey) -> Path:
        """The TensorRT-RTX runtime (JIT) cache that goes with ``key``'s engine."""
        return self.root / f"{key.stem}.rtcache"

    def timing_cache_path(self, flavour: str, trt_version: str, target: str) -> Path:
        """The timing cache shared by every build of one flavour, version and target."""
        return self.root / "timing" / f"{flavour}-{_safe(trt_version)}-{_safe(target)}.cache"

    def lookup(self, key: EngineKey) -> tuple[bytes | None, str]:
        """Return ``(engine bytes, "")`` for a valid entry, else ``(None, reason)``.

        The reason is empty when nothing is cached and says what is wrong otherwise
        (stale key, size or checksum mismatch, unreadable sidecar).
        """
        engine, sidecar = self.engine_path(key), self.sidecar_path(key)
        if not engine.exists() and not sidecar.exists():
            return None, ""
        try:
            meta = json.loads(sidecar.read_text())
        except (OSError, ValueError) as exc:
            return None, f"sidecar {sidecar.name} unreadable ({exc})"
        problem = _check_meta(meta, key)
        if problem:
            return None, problem
        try:
            data = engine.read_bytes()
        except OSError as exc:
            return None, f"engine {engine.name} unreadable ({exc})"
        if len(data) != meta.get("size_bytes"):
            expected = meta.get("size_bytes")
            return None, f"engine {engine.name} has {len(data)} bytes, sidecar says {expected}"
        if sha256_bytes(data) != meta.get("engine_sha256"):
            return None, f"engine {engine.name} checksum mismatch (corrupt)"
        return data, ""

    def store(self, key: EngineKey, data: bytes, *, build_seconds: float, **extra: Any) -> Path:
        """Write the engine and then its sidecar atomically; return the engine path."""
        path = self.engine_path(key)
        atomic_write(path, data)
        meta = {
            "format": FORMAT,
            "key": asdict(key),
            "digest": key.digest(),
            "engine_file": path.name,
            "engine_sha256": sha256_bytes(data),
            "size_bytes": len(data),
            "build_seconds": round(build_seconds, 3),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            **extra,
        }
        atomic_write(self.sidecar_path(key), (json.dumps(meta, indent=2) + "\n").encode())
        return path

    def discard(self, key: EngineKey) -> None:
        """Remove ``key``'s engine, sidecar and runtime cache, if present."""
        for p in (self.sidecar_path(key), self.engine_path(key), self.runtime_cache_path(key)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def entries(self, *, verify: bool = True) -> list[EngineRecord]:
        """Every sidecar in the folder, newest first; ``verify`` re-hashes each engine."""
        records: list[EngineRecord] = []
        if not self.root.is_dir():
            return records
        for sidecar in self.root.glob("*.json"):
            try:
                meta = json.loads(sidecar.read_text())
                key = EngineKey.from_dict(meta["key"])
            except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
                logger.warning("ignoring unreadable engine sidecar %s: %s", sidecar.name, exc)
                continue
            path = sidecar.with_suffix(".engine")
            problem = _check_meta(meta, key)
            if not problem and not path.exists():
                problem = "engine file missing"
            if not problem and verify:
                data = path.read_bytes()
                if sha256_bytes(data) != meta.get("engine_sha256"):
                    problem = "checksum mismatch (corrupt)"
            known = {
                "format",
                "key",
                "digest",
                "engine_file",
                "engine_sha256",
                "size_bytes",
                "build_seconds",
                "created",
            }
            records.append(
                EngineRecord(
                    path=path,
                    key=key,
                    size_bytes=int(meta.get("size_bytes", 0)),
                    build_seconds=float(meta.get("build_seconds", 0.0)),
                    created=str(meta.get("created", "")),
                    valid=not problem,
                    problem=problem,
                    extra={k: v for k, v in meta.items() if k not in known},
                )
            )
        records.sort(key=lambda r: r.created, reverse=True)
        return records


def _check_meta(meta: Any, key: EngineKey) -> str:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return "sidecar of an unknown format"
    try:
        stored = EngineKey.from_dict(meta["key"])
    except (KeyError, TypeError, ValueError, IndexError):
        return "sidecar has no valid key"
    if stored.digest() != key.digest() or meta.get("digest") != key.digest():
        return "sidecar written for another key (stale)"
    return ""


# --------------------------------------------------------------------------- TensorRT libraries

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


def load_flavour(flavour: str = "auto") -> Flavour:
    """Import TensorRT (``"tensorrt"``), TensorRT-RTX (``"tensorrt_rtx"``) or the first that works.

    ``"auto"`` takes full TensorRT when it imports and a CUDA GPU is present (it cannot build
    without one), else TensorRT-RTX, which builds ahead of time on any machine.

    Raises
    ------
    EngineError
        If the requested flavour (or, for ``"auto"``, neither) can be imported.
    """
    if flavour not in ("auto", *FLAVOURS):
        raise EngineError(
            f"unknown TensorRT flavour {flavour!r}; use auto, tensorrt or tensorrt_rtx"
        )
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
    """Reorder ``graph.node`` so every node follows the producers of its inputs (stable)."""
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
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


@contextlib.contextmanager
def _build_lock(cache: EngineCache, key: EngineKey) -> Iterator[None]:
    """Serialise builds of one key across processes (the second then finds a cache hit)."""
    cache.root.mkdir(parents=True, exist_ok=True)
    with (cache.root / f".{key.stem}.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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


def effective_precision(manifest: ModelManifest, precision: str) -> str:
    """``"fp16"`` only when asked for and the manifest allows it, else ``"fp32"``."""
    if precision not in ("fp16", "fp32"):
        raise EngineError(f"precision must be fp16 or fp32, not {precision!r}")
    if precision == "fp16" and not manifest.fp16:
        logger.warning(
            "model %s does not allow fp16 (manifest fp16=false); building fp32", manifest.name
        )
        return "fp32"
    return precision


def build_engine(
    manifest: ModelManifest,
    *,
    cache_dir: str | Path,
    precision: str = "fp32",
    flavour: str = "auto",
    target: str | None = None,
) -> CachedEngine:
    """Return the cached engine for ``manifest``, building it first when needed.

    Parameters
    ----------
    manifest
        The model.
    cache_dir
        The engine cache, normally ``<data_dir>/engines``.
    precision
        ``"fp32"`` or ``"fp16"`` (honoured only if ``manifest.fp16``).
    flavour
        ``"auto"``, ``"tensorrt"`` or ``"tensorrt_rtx"``.
    target
        GPU target; see :func:`resolve_target`. With TensorRT-RTX the default is a portable
        ahead-of-time build, which needs no GPU.

    Raises
    ------
    EngineError
        If TensorRT is missing, the ONNX does not parse (the message names node and operator),
        the build runs out of memory or fails, or the target is impossible.
    """
    started = time.perf_counter()
    lib = load_flavour(flavour)
    key = engine_key(
        manifest,
        lib,
        precision=effective_precision(manifest, precision),
        target=resolve_target(lib, target),
    )
    cache = EngineCache(Path(cache_dir))
    with _build_lock(cache, key):
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
        plan = _serialize(
            lib, manifest, key, cache.timing_cache_path(lib.name, lib.version, key.target)
        )
        build_seconds = time.perf_counter() - t0
        path = cache.store(
            key, plan, build_seconds=build_seconds, onnx_path=str(manifest.onnx_path)
        )
        _prune_superseded(cache, key)
    seconds = time.perf_counter() - started
    logger.info("built %s (%.1f MB) in %.1f s", path.name, len(plan) / 1e6, build_seconds)
    return CachedEngine(path=path, hit=False, seconds=seconds, size_bytes=len(plan), key=key)


def _prune_superseded(cache: EngineCache, key: EngineKey) -> None:
    """Remove engines of the same model and configuration built from an older ONNX file."""
    for record in cache.entries(verify=False):
        k = record.key
        same_config = (
            k.model_name,
            k.flavour,
            k.trt_version,
            k.target,
            k.precision,
            k.batch,
            k.patch_size,
        ) == (
            key.model_name,
            key.flavour,
            key.trt_version,
            key.target,
            key.precision,
            key.batch,
            key.patch_size,
        )
        if same_config and k.model_sha256 != key.model_sha256:
            logger.info("removing superseded engine %s", record.path.name)
            cache.discard(k)


def list_engines(cache_dir: str | Path) -> list[EngineRecord]:
    """Every engine in ``cache_dir``, newest first, each verified against its checksum."""
    return EngineCache(Path(cache_dir)).entries(verify=True)
