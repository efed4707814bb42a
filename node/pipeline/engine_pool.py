"""One inference engine per configured model, loaded when a job first needs it.

The default model (``[model]``) is usually loaded at start so that the first job does not wait;
the models of ``[models.NAME]`` are loaded by the worker on their first job and kept for the
life of the process. Manifests are read at start for every model, so a broken manifest stops
the node before it accepts anything.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from segnode.engines.base import Engine, EngineError, create_engine, run_precision
from segnode.engines.manifest import ModelManifest, check_runnable
from segnode.engines.model_process import ProcessEngine
from segnode.node.config import Config
from segnode.node.modelspec import load_spec_manifest
from segnode.node.routing.rules import DEFAULT_MODEL_NAME, ModelSpec, model_specs

log = logging.getLogger(__name__)


def engine_options(spec: ModelSpec, data_dir: Path, *, gpu_memory_limit: int = 0) -> dict[str, Any]:
    """Backend constructor options of one model (``gpu_memory_limit``: ``[engine]
    gpu_memory_limit``, MiB, for the torch engine)."""
    if spec.engine == "onnxruntime":
        return {"threads": spec.threads or None}
    if spec.engine == "openvino":
        return {"threads": spec.threads or None, "precision": spec.precision}
    if spec.engine == "tensorrt":
        return {"cache_dir": data_dir / "engines", "precision": spec.precision}
    if spec.engine == "torch":
        # compiled artefacts are cached in <data_dir>/engines/torch (segnode.engines.torch_cache)
        cache_dir = data_dir / "engines"
        return {
            "precision": spec.precision,
            "compile": spec.compile,
            "cache_dir": cache_dir,
            "eager_while_compiling": spec.eager_while_compiling,
            "gpu_memory_limit": gpu_memory_limit * 1024 * 1024,
        }
    if spec.engine == "kserve":
        return {
            "url": spec.url,
            "protocol": spec.protocol,
            "model_name": spec.remote_model or None,
            "timeout_s": spec.timeout_s,
            "retries": spec.retries,
            "precision": spec.precision,
        }
    return {}


def make_engine(
    spec: ModelSpec, data_dir: Path, *, gpu_memory_limit: int = 0, model_process: bool = False
) -> Engine:
    """The (unloaded) engine of one model: its backend in the node's process, or with
    ``model_process`` (``[engine] model_process``) in a process of its own."""
    options = engine_options(spec, data_dir, gpu_memory_limit=gpu_memory_limit)
    if model_process:
        return ProcessEngine(spec.engine, options)
    return create_engine(spec.engine, **options)


class EnginePool:
    """Loaded engines by model name.

    Parameters
    ----------
    specs
        Every configured model (the default one under ``"default"``).
    data_dir
        The node's data directory (engine caches).
    preloaded
        Engines already loaded, by model name (the node's default engine, or a test's).

    Raises
    ------
    EngineError
        If a manifest cannot be read.
    """

    def __init__(
        self,
        specs: Iterable[ModelSpec],
        data_dir: Path,
        preloaded: Mapping[str, tuple[Engine, ModelManifest]] | None = None,
        *,
        gpu_memory_limit: int = 0,
        model_process: bool = False,
    ) -> None:
        self.specs = {s.name: s for s in specs}
        self.data_dir = data_dir
        self.gpu_memory_limit = gpu_memory_limit
        self.model_process = model_process
        self._engines: dict[str, Engine] = {}
        self.manifests: dict[str, ModelManifest] = {}
        for name, (engine, manifest) in (preloaded or {}).items():
            self._engines[name] = engine
            self.manifests[name] = _as_run(engine, manifest)
        for name, spec in self.specs.items():
            if name not in self.manifests:
                self.manifests[name] = load_spec_manifest(spec)
            check_runnable(self.manifests[name])
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}  # per model: its load
        self._closed = False

    @classmethod
    def of_config(cls, config: Config, engine: Engine, manifest: ModelManifest) -> EnginePool:
        """Every model of ``config``, with ``engine`` (``manifest``) as the default one."""
        return cls(
            model_specs(config),
            config.data_dir,
            {DEFAULT_MODEL_NAME: (engine, manifest)},
            gpu_memory_limit=config.engine.gpu_memory_limit,
            model_process=config.engine.model_process,
        )

    @property
    def default_manifest(self) -> ModelManifest:
        """The manifest of the default model (``[model]``)."""
        return self.manifests[DEFAULT_MODEL_NAME]

    def label(self, name: str) -> str:
        """``"<manifest name> <version>"`` of a model (the job's model column)."""
        m = self.manifests.get(name)
        return f"{m.name} {m.version}" if m is not None else name

    def engine_name(self, name: str) -> str:
        """The backend a model runs on."""
        spec = self.specs.get(name)
        return spec.engine if spec is not None else "unknown"

    def get(self, name: str) -> tuple[Engine, ModelManifest]:
        """The loaded engine and manifest of model ``name`` (loading it on first use).

        Raises
        ------
        EngineError
            If the model is not configured or its backend cannot load it.
        """
        with self._lock:
            engine = self._engines.get(name)
            if engine is not None:
                return engine, self.manifests[name]
            spec = self.specs.get(name)
            if spec is None:
                known = ", ".join(sorted(self.specs)) or "none"
                raise EngineError(f"model {name!r} is not configured (configured: {known})")
            loading = self._loading.setdefault(name, threading.Lock())
        # One load per model at a time; the other models' jobs go on meanwhile (a compiled
        # torch model takes tens of seconds to load).
        with loading:
            with self._lock:
                engine = self._engines.get(name)
                if engine is not None:
                    return engine, self.manifests[name]
                manifest = self.manifests[name]
            log.info("loading model %s (%s) on %s", name, self.label(name), spec.engine)
            engine = make_engine(
                spec,
                self.data_dir,
                gpu_memory_limit=self.gpu_memory_limit,
                model_process=self.model_process,
            )
            engine.load(manifest)
            with self._lock:
                closed = self._closed
                if not closed:
                    self._engines[name] = engine
                    manifest = self.manifests[name] = _as_run(engine, manifest)
            if closed:
                engine.close()
                raise EngineError(f"model {name!r}: the node is stopping")
            return engine, manifest

    def loaded(self) -> list[str]:
        """Names of the models whose engines are loaded."""
        with self._lock:
            return sorted(self._engines)

    def model_processes(self) -> dict[str, dict[str, int | None]]:
        """Per loaded model whose engine runs in a process of its own
        (``[engine] model_process``): that process' id (None while it is not running) and
        how often it was started again after it ended."""
        with self._lock:
            engines = dict(self._engines)
        return {
            name: {"pid": engine.pid, "restarts": engine.restarts}
            for name, engine in sorted(engines.items())
            if isinstance(engine, ProcessEngine)
        }

    def close(self) -> None:
        """Close every loaded engine."""
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
            self._closed = True
        for engine in engines:
            try:
                engine.close()
            except Exception:
                log.exception("closing an engine failed")


def _as_run(engine: Engine, manifest: ModelManifest) -> ModelManifest:
    """``manifest`` with the precision its loaded engine runs it in, for the SEG's and SR's
    algorithm identification (:func:`segnode.engines.base.run_precision`)."""
    return replace(manifest, precision=run_precision(engine, manifest))


__all__ = ["DEFAULT_MODEL_NAME", "EnginePool", "engine_options", "make_engine"]
