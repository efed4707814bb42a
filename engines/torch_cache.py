"""On-disk cache of compiled PyTorch artefacts, so that a restarted node skips compilation.

The ``torch`` engine with ``compile=True`` and a cache folder keeps one artefact per model and
configuration under ``<data_dir>/engines/torch/``:

* ``aoti``: an AOTInductor package (``.pt2``: the model exported with ``torch.export`` and
  compiled ahead of time by Inductor into a shared library with its weights), loaded with
  ``torch._inductor.aoti_load_package``. A restart needs neither onnx2torch nor a compiler.
* ``inductor``: the serialized ``torch.compiler.save_cache_artifacts()`` "mega-cache" (FX graph,
  AOTAutograd and Triton kernel caches); loaded into a fresh process with
  ``torch.compiler.load_cache_artifacts`` before ``torch.compile``, which then finds every
  graph and kernel compiled. The fallback for models that ``torch.export`` cannot trace.

Layout of ``<data_dir>/engines/torch/``::

    <stem>.pt2 | <stem>.inductor   the artefact
    <stem>.json                    sidecar: the key, the artefact's SHA-256 and size, build time
    .<stem>.lock                   serialises builds of one key across processes

``<stem>`` is ``<model>-<precision>-<kind>-<target>-<first 16 hex of the key digest>``. The key
(:class:`TorchKey`) holds everything a compiled artefact depends on: the ONNX file's SHA-256,
the torch, CUDA, Triton and onnx2torch versions, the GPU's name and compute capability,
precision, batch, patch shape, memory format and compile mode. Files are written as
:func:`segnode.engines.engine_cache.atomic_write` writes them (artefact before sidecar). A lookup
trusts nothing: a sidecar written for another key (stale, or copied from another machine) or an
artefact of another size or checksum (corrupt) is reported, removed and rebuilt; an artefact
that passes the checks but does not load is removed and rebuilt too (:func:`load_or_build`).
This module imports neither torch nor onnx, so its logic is tested on any machine.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from segnode.engines.base import EngineError
from segnode.engines.engine_cache import _safe, atomic_write

logger = logging.getLogger(__name__)

FORMAT = 1
# Bump when the conversion or export recipe in engines/torch_compile.py changes what an
# artefact contains; artefacts of an older recipe are then stale.
RECIPE = 1
KINDS = ("aoti", "inductor")
SUFFIX = {"aoti": ".pt2", "inductor": ".inductor"}
SUBDIR = "torch"
T = TypeVar("T")


@dataclass(frozen=True)
class RuntimeFacts:
    """The software and device a compiled artefact is specific to.

    Attributes
    ----------
    torch_version, cuda_version, triton_version, onnx2torch_version
        ``torch.__version__`` (with its ``+cu130`` style suffix), ``torch.version.cuda``
        (``""`` on a CPU build), and the Triton and onnx2torch versions (``""`` if absent).
    device_name
        ``torch.cuda.get_device_name`` (``"NVIDIA H200"``), or ``"cpu"``.
    target
        ``"sm90"`` style compute capability, or ``"cpu-x86_64"``.
    """

    torch_version: str
    cuda_version: str
    triton_version: str
    onnx2torch_version: str
    device_name: str
    target: str


@dataclass(frozen=True)
class TorchKey:
    """What a compiled artefact depends on; equal keys give interchangeable artefacts.

    Attributes
    ----------
    model_sha256
        SHA-256 of the ONNX file.
    model_name
        Manifest name (file names and listings only; not part of the digest).
    kind
        ``"aoti"`` or ``"inductor"`` (see the module docstring).
    facts
        Versions and device (:class:`RuntimeFacts`).
    precision
        Effective precision, ``"fp16"`` or ``"fp32"`` (after the manifest's ``fp16`` check).
    batch
        The static batch size the artefact is specialised to.
    patch_size
        ``(z, y, x)`` patch dimensions.
    channels_last
        Whether weights and inputs use the ``channels_last_3d`` memory format.
    compile_mode
        Inductor mode (``"default"``, ``"max-autotune-no-cudagraphs"``, ...).
    recipe
        :data:`RECIPE` at build time.
    """

    model_sha256: str
    model_name: str
    kind: str
    facts: RuntimeFacts
    precision: str
    batch: int
    patch_size: tuple[int, int, int]
    channels_last: bool
    compile_mode: str
    recipe: int = RECIPE

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise EngineError(f"unknown compiled-artefact kind {self.kind!r}; use {KINDS}")

    def digest(self) -> str:
        """SHA-256 over the canonical JSON of every field except ``model_name``."""
        fields = asdict(self)
        fields.pop("model_name")
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @property
    def stem(self) -> str:
        """File stem of this key's artefact and sidecar."""
        parts = (
            _safe(self.model_name),
            self.precision,
            self.kind,
            _safe(self.facts.target),
            self.digest()[:16],
        )
        return "-".join(parts)

    @property
    def suffix(self) -> str:
        """File suffix of the artefact (``.pt2`` or ``.inductor``)."""
        return SUFFIX[self.kind]

    def same_configuration(self, other: TorchKey) -> bool:
        """True when ``other`` differs from this key at most in the model file."""
        mine, theirs = asdict(self), asdict(other)
        for d in (mine, theirs):
            d.pop("model_sha256")
        return mine == theirs

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TorchKey:
        """Inverse of :func:`dataclasses.asdict` (lists back to tuples)."""
        p, f = raw["patch_size"], raw["facts"]
        return cls(
            model_sha256=str(raw["model_sha256"]),
            model_name=str(raw["model_name"]),
            kind=str(raw["kind"]),
            facts=RuntimeFacts(**{k: str(f[k]) for k in RuntimeFacts.__dataclass_fields__}),
            precision=str(raw["precision"]),
            batch=int(raw["batch"]),
            patch_size=(int(p[0]), int(p[1]), int(p[2])),
            channels_last=bool(raw["channels_last"]),
            compile_mode=str(raw["compile_mode"]),
            recipe=int(raw["recipe"]),
        )


@dataclass(frozen=True)
class TorchArtefact:
    """One entry of the cache, as read from its sidecar (``segnode engine list``)."""

    path: Path
    key: TorchKey
    size_bytes: int
    build_seconds: float
    created: str
    valid: bool
    problem: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def _sha256_file(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


class TorchCache:
    """The folder of compiled artefacts: lookup with validation, atomic store, listing.

    Parameters
    ----------
    root
        The cache folder, normally ``<data_dir>/engines/torch``; created on first store.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def artefact_path(self, key: TorchKey) -> Path:
        """Where the artefact of ``key`` lives (whether or not it exists)."""
        return self.root / f"{key.stem}{key.suffix}"

    def sidecar_path(self, key: TorchKey) -> Path:
        """The sidecar JSON of ``key``."""
        return self.root / f"{key.stem}.json"

    def lookup(self, key: TorchKey) -> tuple[Path | None, str]:
        """Return ``(artefact path, "")`` for a valid entry, else ``(None, reason)``.

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
        problem = _check_meta(meta, key)
        if problem:
            return None, problem
        try:
            digest, size = _sha256_file(path)
        except OSError as exc:
            return None, f"artefact {path.name} unreadable ({exc})"
        if size != meta.get("size_bytes"):
            return None, f"artefact {path.name} has {size} bytes, sidecar says {meta['size_bytes']}"
        if digest != meta.get("sha256"):
            return None, f"artefact {path.name} checksum mismatch (corrupt)"
        return path, ""

    def scratch(self, key: TorchKey) -> tempfile.TemporaryDirectory[str]:
        """A temporary folder inside the cache for a build of ``key`` (same file system: the
        build's output is moved into place with :func:`os.replace`); removed when the
        ``with`` block ends. Call it under :meth:`lock`: folders an interrupted build of the
        same key left behind are removed first."""
        self.root.mkdir(parents=True, exist_ok=True)
        for old in self.root.glob(f".build-{key.stem}-*"):
            shutil.rmtree(old, ignore_errors=True)
        return tempfile.TemporaryDirectory(prefix=f".build-{key.stem}-", dir=self.root)

    def store(
        self, key: TorchKey, data: bytes | Path, *, build_seconds: float, **extra: Any
    ) -> Path:
        """Store ``data`` (bytes, or a file in :meth:`scratch`, which is moved) and then its
        sidecar, each atomically; return the artefact path."""
        path = self.artefact_path(key)
        if isinstance(data, bytes):
            atomic_write(path, data)
        else:
            with data.open("rb+") as f:
                os.fsync(f.fileno())
            os.chmod(data, 0o644)
            os.replace(data, path)
            dir_fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        digest, size = _sha256_file(path)
        meta = {
            "format": FORMAT,
            "key": asdict(key),
            "digest": key.digest(),
            "artefact_file": path.name,
            "sha256": digest,
            "size_bytes": size,
            "build_seconds": round(build_seconds, 3),
            "created": datetime.now(UTC).isoformat(timespec="seconds"),
            **extra,
        }
        atomic_write(self.sidecar_path(key), (json.dumps(meta, indent=2) + "\n").encode())
        return path

    def discard(self, key: TorchKey) -> None:
        """Remove the sidecar and artefact of ``key``, if present (sidecar first)."""
        for p in (self.sidecar_path(key), self.artefact_path(key)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    @contextlib.contextmanager
    def lock(self, key: TorchKey) -> Iterator[None]:
        """Serialise builds of one key across processes (the second then finds a hit)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / f".{key.stem}.lock").open("w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def entries(self, *, verify: bool = True) -> list[TorchArtefact]:
        """Every sidecar in the folder, newest first; ``verify`` re-hashes each artefact."""
        records: list[TorchArtefact] = []
        if not self.root.is_dir():
            return records
        known = {"format", "key", "digest", "artefact_file", "sha256", "size_bytes"}
        known |= {"build_seconds", "created"}
        for sidecar in self.root.glob("*.json"):
            try:
                meta = json.loads(sidecar.read_text())
                key = TorchKey.from_dict(meta["key"])
            except (OSError, ValueError, KeyError, TypeError, IndexError, EngineError) as exc:
                logger.warning("ignoring unreadable artefact sidecar %s: %s", sidecar.name, exc)
                continue
            path = self.artefact_path(key)
            problem = _check_meta(meta, key)
            if not problem and not path.exists():
                problem = "artefact file missing"
            if not problem and verify and _sha256_file(path)[0] != meta.get("sha256"):
                problem = "checksum mismatch (corrupt)"
            records.append(
                TorchArtefact(
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

    def prune_superseded(self, key: TorchKey) -> None:
        """Remove artefacts of the same configuration built from another ONNX file."""
        for record in self.entries(verify=False):
            if record.key.same_configuration(key) and record.key.model_sha256 != key.model_sha256:
                logger.info("removing superseded compiled artefact %s", record.path.name)
                self.discard(record.key)


def _check_meta(meta: Any, key: TorchKey) -> str:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return "sidecar of an unknown format"
    try:
        stored = TorchKey.from_dict(meta["key"])
    except (KeyError, TypeError, ValueError, IndexError, EngineError):
        return "sidecar has no valid key"
    if stored.digest() != key.digest() or meta.get("digest") != key.digest():
        return "sidecar written for another key (stale or foreign)"
    return ""


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_or_build` returns: the loaded object and how it was obtained.

    Attributes
    ----------
    value
        Whatever ``load`` returned.
    hit
        True when a valid cached artefact was loaded; False when it was built now.
    path
        The artefact.
    build_seconds
        Time spent building (0 on a hit).
    load_seconds
        Time spent validating and loading.
    """

    value: Any
    hit: bool
    path: Path
    build_seconds: float
    load_seconds: float


def load_or_build(
    cache: TorchCache,
    key: TorchKey,
    build: Callable[[Path], bytes | Path],
    load: Callable[[Path], T],
    **extra: Any,
) -> Loaded:
    """Load the cached artefact of ``key``, building and storing it first when needed.

    Parameters
    ----------
    cache
        The artefact folder.
    key
        What the artefact must match.
    build
        Called with a scratch folder inside the cache on a miss; returns the artefact's bytes
        or a file it wrote in that folder.
    load
        Called with the artefact's path; returns the ready object. If it raises on a cached
        artefact (a corrupt package that still has the recorded checksum, a library that
        changed underneath), the artefact is removed and rebuilt once, with a warning.
    extra
        More sidecar fields (for example the ONNX path).

    Raises
    ------
    EngineError
        If the build fails, or the artefact just built does not load.
    """
    with cache.lock(key):
        t0 = time.perf_counter()
        path, problem = cache.lookup(key)
        if path is not None:
            try:
                value = load(path)
            except Exception as exc:
                problem = f"cached artefact {path.name} does not load ({type(exc).__name__}: {exc})"
            else:
                return Loaded(value, True, path, 0.0, time.perf_counter() - t0)
        if problem:
            logger.warning("rebuilding compiled artefact %s: %s", key.stem, problem)
            cache.discard(key)
        logger.info("compiling %s artefact %s (one-off; later starts load it)", key.kind, key.stem)
        t0 = time.perf_counter()
        with cache.scratch(key) as tmp:
            data = build(Path(tmp))
            build_seconds = time.perf_counter() - t0
            path = cache.store(key, data, build_seconds=build_seconds, **extra)
        cache.prune_superseded(key)
        t1 = time.perf_counter()
        try:
            value = load(path)
        except Exception as exc:
            cache.discard(key)
            raise EngineError(f"compiled artefact {path.name} does not load: {exc}") from exc
        logger.info("compiled %s in %.1f s (%.1f MB)", path.name, build_seconds, _mb(path))
        return Loaded(value, False, path, build_seconds, time.perf_counter() - t1)


def _mb(path: Path) -> float:
    try:
        return path.stat().st_size / 1e6
    except OSError:
        return 0.0
