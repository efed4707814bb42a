"""On-disk caches of built engines, keyed by everything that makes them differ.

:class:`SidecarCache` is the one implementation behind both caches of compiled models:

* :class:`EngineCache`, serialized TensorRT engines under ``<data_dir>/engines/``, which
  :func:`segnode.engines.trt_build.build_engine` fills and
  :func:`segnode.engines.trt_build.list_engines` and ``segnode engine list`` read;
* :class:`segnode.engines.torch_cache.TorchCache`, compiled PyTorch artefacts under
  ``<data_dir>/engines/torch/``.

Layout of ``<data_dir>/engines/``::

    <stem>.engine        the serialized engine (plan)
    <stem>.json          sidecar: the key, the engine's SHA-256 and size, build time
    <stem>.rtcache       TensorRT-RTX runtime (JIT kernel) cache, written after first use
    .<stem>.lock         serialises builds of one key across processes
    timing/<...>.cache   TensorRT timing caches, one per flavour, version and GPU target

``<stem>`` is ``<model>-<precision>-<flavour>-<target>-<first 16 hex of the key digest>``. Every
file is written atomically (temporary file in the same folder, ``fsync``, ``os.replace``, then
``fsync`` of the folder), the artefact before its sidecar, so a sidecar names only a complete
artefact. A lookup trusts nothing: an entry whose sidecar is missing, unreadable, written for
another key, or whose artefact has another size or SHA-256 is reported stale and rebuilt.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import (
    Any,
    ClassVar,
    Generic,
    Self,
    TypeVar,
    get_args,
    get_origin,
    get_type_hints,
)

from segnode.engines.base import EngineError

logger = logging.getLogger(__name__)

FORMAT = 1
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
T = TypeVar("T")
_BAD_KEY = (KeyError, TypeError, ValueError, IndexError, EngineError)


def _safe(text: str) -> str:
    """File-name-safe form of a model name or target (never a raw string in a path)."""
    cleaned = "".join(c if c in _SAFE else "_" for c in text).strip("._")
    return cleaned[:48] or "model"


def key_from_dict(cls: type[T], raw: dict[str, Any]) -> T:
    """Inverse of :func:`dataclasses.asdict` for a key dataclass ``cls`` whose fields are
    ``str``, ``int``, ``bool``, fixed-length tuples of ``int`` or such dataclasses: every field
    is required and converted to its type (lists back to tuples).

    Raises
    ------
    KeyError, TypeError, ValueError
        If a field is missing or does not convert.
    """
    hints = get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        hint, value = hints[f.name], raw[f.name]
        if is_dataclass(hint):
            values[f.name] = key_from_dict(hint, value)  # type: ignore[arg-type]
        elif get_origin(hint) is tuple:
            items = tuple(int(v) for v in value)
            if len(items) != len(get_args(hint)):
                raise ValueError(f"{f.name} has {len(items)} items, not {len(get_args(hint))}")
            values[f.name] = items
        else:
            values[f.name] = hint(value)
    return cls(**values)


def key_stem(key: Any, kind: str, target: str) -> str:
    """``<model>-<precision>-<kind>-<target>-<first 16 hex of the digest>``."""
    parts = (_safe(key.model_name), key.precision, kind, _safe(target), key.digest()[:16])
    return "-".join(parts)


@dataclass(frozen=True)
class ModelKey:
    """The fields every cache key starts with; a subclass adds what else the artefact
    depends on.

    Attributes
    ----------
    model_sha256
        SHA-256 of the ONNX file.
    model_name
        Manifest name (for file names and listings only; not part of the digest).
    """

    model_sha256: str
    model_name: str

    def digest(self) -> str:
        """SHA-256 over the canonical JSON of every field except ``model_name``."""
        values = asdict(self)
        values.pop("model_name")
        blob = json.dumps(values, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def stem(self) -> str:
        """File stem of this key's artefact and sidecar (:func:`key_stem`)."""
        raise NotImplementedError

    def same_configuration(self, other: Self) -> bool:
        """True when ``other`` differs from this key at most in the model file."""
        mine, theirs = asdict(self), asdict(other)
        for d in (mine, theirs):
            d.pop("model_sha256")
        return mine == theirs

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Self:
        """Inverse of :func:`dataclasses.asdict` (:func:`key_from_dict`)."""
        return key_from_dict(cls, raw)


K = TypeVar("K", bound=ModelKey)
V = TypeVar("V")


@dataclass(frozen=True)
class EngineKey(ModelKey):
    """What an engine depends on; two builds with equal keys give interchangeable engines.

    Attributes
    ----------
    model_sha256, model_name
        See :class:`ModelKey`.
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

    flavour: str
    trt_version: str
    target: str
    precision: str
    input_name: str
    batch: tuple[int, int, int]
    patch_size: tuple[int, int, int]

    @property
    def stem(self) -> str:
        """File stem of this key's engine, sidecar and runtime cache."""
        return key_stem(self, self.flavour, self.target)

    def same_configuration(self, other: EngineKey) -> bool:
        """True when ``other`` differs from this key at most in the model file and the input
        name."""
        return super().same_configuration(replace(other, input_name=self.input_name))


@dataclass(frozen=True)
class CachedEngine:
    """Result of :func:`segnode.engines.trt_backend.build_engine`.

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
class CacheRecord(Generic[K]):
    """One entry of a cache, as read from its sidecar (``segnode engine list``)."""

    path: Path
    key: K
    size_bytes: int
    build_seconds: float
    created: str
    valid: bool
    problem: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


EngineRecord = CacheRecord[EngineKey]


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    The bytes go to a temporary file in the same folder, which :func:`atomic_move` puts in
    place.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        atomic_move(Path(tmp), path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_move(src: Path, path: Path) -> None:
    """Put the finished file ``src`` (on the same file system) in place of ``path``.

    ``src`` is ``fsync``-ed, made world-readable and renamed over ``path`` with
    :func:`os.replace`; the folder is ``fsync``-ed afterwards so the rename survives a power
    loss.
    """
    with src.open("rb+") as f:
        os.fsync(f.fileno())
    os.chmod(src, 0o644)
    os.replace(src, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sha256_bytes(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> tuple[str, int]:
    """Hex SHA-256 and size of the file ``path``, read in chunks."""
    h, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


class SidecarCache(Generic[K, V]):
    """A folder of built artefacts, each with a JSON sidecar: lookup with validation, atomic
    store, build lock, listing, pruning.

    A subclass names its artefacts (:attr:`label`, the sidecar fields :attr:`file_field`
    and :attr:`sha_field`), parses its key (:meth:`parse_key`), gives the artefact's suffix
    (:meth:`suffix`) and says what a valid lookup returns (:meth:`read`).

    Parameters
    ----------
    root
        The cache folder; created on first store.
    """

    label: ClassVar[str] = "artefact"
    file_field: ClassVar[str] = "artefact_file"
    sha_field: ClassVar[str] = "sha256"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def parse_key(self, raw: dict[str, Any]) -> K:
        """The key stored in a sidecar."""
        raise NotImplementedError

    def suffix(self, key: K) -> str:
        """File suffix of ``key``'s artefact."""
        raise NotImplementedError

    def read(self, path: Path) -> tuple[V, str, int]:
        """``(what a lookup returns, SHA-256, size)`` of the artefact ``path``."""
        raise NotImplementedError

    def artefact_path(self, key: K) -> Path:
        """Where the artefact of ``key`` lives (whether or not it exists)."""
        return self.root / f"{key.stem}{self.suffix(key)}"

    def sidecar_path(self, key: K) -> Path:
        """The sidecar JSON of ``key``."""
        return self.root / f"{key.stem}.json"

    def files(self, key: K) -> tuple[Path, ...]:
        """Every file of ``key``, in the order :meth:`discard` removes them (sidecar first)."""
        return (self.sidecar_path(key), self.artefact_path(key))

    def lookup(self, key: K) -> tuple[V | None, str]:
        """Return ``(artefact, "")`` for a valid entry, else ``(None, reason)``.

        The reason is empty when nothing is cached and says what is wrong otherwise (stale
        or foreign key, size or checksum mismatch, unreadable sidecar).
        """
        path, sidecar = self.artefact_path(key), self.sidecar_path(key)
        if not path.exists() and not sidecar.exists():
            return None, ""
        try:
            meta = json.loads(sidecar.read_text())
        except (OSError, ValueError) as exc:
            return None, f"sidecar {sidecar.name} unreadable ({exc})"
        problem = self._check_meta(meta, key)
        if problem:
            return None, problem
        try:
            value, digest, size = self.read(path)
        except OSError as exc:
            return None, f"{self.label} {path.name} unreadable ({exc})"
        expected = meta.get("size_bytes")
        if size != expected:
            return None, f"{self.label} {path.name} has {size} bytes, sidecar says {expected}"
        if digest != meta.get(self.sha_field):
            return None, f"{self.label} {path.name} checksum mismatch (corrupt)"
        return value, ""

    def store(self, key: K, data: bytes | Path, *, build_seconds: float, **extra: Any) -> Path:
        """Store ``data`` (bytes, or a finished file on the cache's file system, which is
        moved) and then its sidecar, each atomically; return the artefact path."""
        path = self.artefact_path(key)
        if isinstance(data, bytes):
            atomic_write(path, data)
            digest, size = sha256_bytes(data), len(data)
        else:
            atomic_move(data, path)
            digest, size = sha256_file(path)
        meta = {
            "format": FORMAT,
            "key": asdict(key),
            "digest": key.digest(),
            self.file_field: path.name,
            self.sha_field: digest,
            "size_bytes": size,
            "build_seconds": round(build_seconds, 3),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            **extra,
        }
        atomic_write(self.sidecar_path(key), (json.dumps(meta, indent=2) + "\n").encode())
        return path

    def discard(self, key: K) -> None:
        """Remove every file of ``key`` that is present (sidecar first)."""
        for p in self.files(key):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    @contextlib.contextmanager
    def lock(self, key: K) -> Iterator[None]:
        """Serialise builds of one key across processes (the second then finds a hit)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / f".{key.stem}.lock").open("w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def entries(self, *, verify: bool = True) -> list[CacheRecord[K]]:
        """Every sidecar in the folder, newest first; ``verify`` re-hashes each artefact."""
        records: list[CacheRecord[K]] = []
        if not self.root.is_dir():
            return records
        known = {"format", "key", "digest", self.file_field, self.sha_field, "size_bytes"}
        known |= {"build_seconds", "created"}
        for sidecar in self.root.glob("*.json"):
            try:
                meta = json.loads(sidecar.read_text())
                key = self.parse_key(meta["key"])
            except (OSError, *_BAD_KEY) as exc:
                name = sidecar.name
                logger.warning("ignoring unreadable %s sidecar %s: %s", self.label, name, exc)
                continue
            path = self.artefact_path(key)
            problem = self._check_meta(meta, key)
            if not problem and not path.exists():
                problem = f"{self.label} file missing"
            if not problem and verify and sha256_file(path)[0] != meta.get(self.sha_field):
                problem = "checksum mismatch (corrupt)"
            records.append(
                CacheRecord(
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

    def prune_superseded(self, key: K) -> None:
        """Remove artefacts of the same configuration built from another ONNX file."""
        for record in self.entries(verify=False):
            if record.key.same_configuration(key) and record.key.model_sha256 != key.model_sha256:
                logger.info("removing superseded %s %s", self.label, record.path.name)
                self.discard(record.key)

    def _check_meta(self, meta: Any, key: K) -> str:
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            return "sidecar of an unknown format"
        try:
            stored = self.parse_key(meta["key"])
        except _BAD_KEY:
            return "sidecar has no valid key"
        if stored.digest() != key.digest() or meta.get("digest") != key.digest():
            return "sidecar written for another key (stale or foreign)"
        return ""


class EngineCache(SidecarCache[EngineKey, bytes]):
    """The TensorRT engine folder, normally ``<data_dir>/engines``; a lookup returns the
    engine's bytes."""

    label = "engine"
    file_field = "engine_file"
    sha_field = "engine_sha256"

    def parse_key(self, raw: dict[str, Any]) -> EngineKey:
        """The key stored in a sidecar."""
        return EngineKey.from_dict(raw)

    def suffix(self, key: EngineKey) -> str:
        """``.engine``."""
        return ".engine"

    def read(self, path: Path) -> tuple[bytes, str, int]:
        """The engine's bytes, SHA-256 and size."""
        data = path.read_bytes()
        return data, sha256_bytes(data), len(data)

    def engine_path(self, key: EngineKey) -> Path:
        """Where the engine for ``key`` lives (whether or not it exists)."""
        return self.artefact_path(key)

    def runtime_cache_path(self, key: EngineKey) -> Path:
        """The TensorRT-RTX runtime (JIT) cache that goes with ``key``'s engine."""
        return self.root / f"{key.stem}.rtcache"

    def files(self, key: EngineKey) -> tuple[Path, ...]:
        """Sidecar, engine and runtime cache."""
        return (*super().files(key), self.runtime_cache_path(key))

    def timing_cache_path(self, flavour: str, trt_version: str, target: str) -> Path:
        """The timing cache shared by every build of one flavour, version and target."""
        return self.root / "timing" / f"{flavour}-{_safe(trt_version)}-{_safe(target)}.cache"
