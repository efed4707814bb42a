"""On-disk cache of serialized TensorRT engines, keyed by everything that makes them differ.

:func:`segnode.engines.trt_build.build_engine` fills it;
:func:`segnode.engines.trt_build.list_engines` and ``segnode engine list`` read it.

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
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

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
