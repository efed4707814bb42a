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

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from segnode.engines.base import EngineError
from segnode.engines.engine_cache import (
    CacheRecord,
    ModelKey,
    SidecarCache,
    key_stem,
    sha256_file,
)

logger = logging.getLogger(__name__)

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
class TorchKey(ModelKey):
    """What a compiled artefact depends on; equal keys give interchangeable artefacts.

    Attributes
    ----------
    model_sha256, model_name
        See :class:`segnode.engines.engine_cache.ModelKey`.
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

    @property
    def stem(self) -> str:
        """File stem of this key's artefact and sidecar."""
        return key_stem(self, self.kind, self.facts.target)

    @property
    def suffix(self) -> str:
        """File suffix of the artefact (``.pt2`` or ``.inductor``)."""
        return SUFFIX[self.kind]


TorchArtefact = CacheRecord[TorchKey]
"""One entry of the cache, as read from its sidecar (``segnode engine list``)."""


class TorchCache(SidecarCache[TorchKey, Path]):
    """The folder of compiled artefacts, normally ``<data_dir>/engines/torch``: lookup with
    validation, atomic store, listing (:class:`segnode.engines.engine_cache.SidecarCache`);
    a lookup returns the artefact's path."""

    def parse_key(self, raw: dict[str, Any]) -> TorchKey:
        """The key stored in a sidecar."""
        return TorchKey.from_dict(raw)

    def suffix(self, key: TorchKey) -> str:
        """``.pt2`` or ``.inductor``."""
        return key.suffix

    def read(self, path: Path) -> tuple[Path, str, int]:
        """The artefact's path, SHA-256 and size."""
        return (path, *sha256_file(path))

    def scratch(self, key: TorchKey) -> tempfile.TemporaryDirectory[str]:
        """A temporary folder inside the cache for a build of ``key`` (same file system: the
        build's output is moved into place with :func:`os.replace`); removed when the
        ``with`` block ends. Call it under :meth:`lock`: folders an interrupted build of the
        same key left behind are removed first."""
        self.root.mkdir(parents=True, exist_ok=True)
        for old in self.root.glob(f".build-{key.stem}-*"):
            shutil.rmtree(old, ignore_errors=True)
        return tempfile.TemporaryDirectory(prefix=f".build-{key.stem}-", dir=self.root)


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
