"""A model and the backend that runs it: ``[model]`` and ``[models.NAME]`` of the configuration.

This module owns the :class:`ModelSpec` type and the validation of a model table's keys, shared
by :mod:`segnode.node.config.parse` (``[model]``, the default model) and
:mod:`segnode.node.routing.rules` (``[models.NAME]``). It imports nothing of the node but its
errors, so that those two do not import each other to share it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from segnode.engines.base import PRECISIONS, EngineError
from segnode.engines.manifest import ModelManifest
from segnode.node.errors import ConfigError

SPEC_PRECISIONS = (*PRECISIONS, "bf16")
"""``precision`` values of a model table: the GPU engines' fp32/fp16, and bf16 (the
``openvino`` engine on a CPU with BF16 instructions)."""

DEFAULT_MODEL_NAME = "default"
"""The name of ``[model]`` among the configured models."""

REMOTE_KEYS = ("url", "protocol", "remote_model", "timeout_s", "retries")
"""The keys of a model table that only ``engine = "kserve"`` (a remote server) reads."""

SPEC_KEYS = (
    "manifest",
    "engine",
    "threads",
    "precision",
    "compile",
    "eager_while_compiling",
    "mirror_axes",
    *REMOTE_KEYS,
)
"""The keys of a model table (``[model]`` adds ``load``)."""


@dataclass(frozen=True)
class ModelSpec:
    """``[models.NAME]`` (or ``[model]``, named ``"default"``): a model and its backend."""

    name: str
    manifest: Path
    engine: str = "onnxruntime"
    threads: int = 0
    precision: str = "fp32"
    compile: bool = False
    #: With ``compile``: serve jobs eagerly while the compiled model loads or builds.
    eager_while_compiling: bool = True
    #: ``engine = "kserve"``: the inference server (``http://host:port``, ``grpc://host:port``).
    url: str = ""
    #: ``engine = "kserve"``: ``"http"`` or ``"grpc"`` (default: from the URL's scheme).
    protocol: str = "http"
    #: ``engine = "kserve"``: the model's name on the server (default: the manifest's name).
    remote_model: str = ""
    #: ``engine = "kserve"``: the deadline of each request, from its start to the last byte of
    #: its reply, seconds.
    timeout_s: float = 60.0
    #: ``engine = "kserve"``: how often a request that failed for a transient reason is re-sent.
    retries: int = 3
    #: Test-time mirroring of a trained model, model axes (``()`` for none), instead of its
    #: manifest's (its trainer's); ``None``: the manifest's (:func:`load_spec_manifest`).
    mirror_axes: tuple[int, ...] | None = None


def parse_model_spec(
    name: str,
    table: Mapping[str, Any],
    key: str,
    path: Callable[[Any, str], Path],
    *,
    default_manifest: Path | None = None,
    engines: Sequence[str] | None = None,
) -> ModelSpec:
    """The :class:`ModelSpec` of one model table (its keys among :data:`SPEC_KEYS`).

    Parameters
    ----------
    name
        The model's name.
    table
        The table's values.
    key
        The table's name in error messages (``"model"``, ``"models.NAME"``).
    path
        Resolves a path value relative to the configuration file.
    default_manifest
        The manifest when the table names none; ``None``: ``manifest`` is required.
    engines
        The backends ``engine`` may name; ``None``: any string (checked when the engine loads).

    Raises
    ------
    ConfigError
        A value is missing, of the wrong type or out of range; the message names the key.
    """
    if "manifest" in table:
        manifest = path(table["manifest"], f"{key}.manifest")
    elif default_manifest is not None:
        manifest = default_manifest
    else:
        raise ConfigError(f"{key}.manifest: missing (the model's JSON manifest)")
    if not manifest.exists():
        raise ConfigError(f"{key}.manifest: file not found: {manifest}")
    engine = table.get("engine", "onnxruntime")
    if not isinstance(engine, str) or (engines is not None and engine not in engines):
        choices = f"one of {', '.join(engines)}" if engines is not None else "a backend name"
        raise ConfigError(f"{key}.engine: must be {choices}, got {engine!r}")
    threads = table.get("threads", 0)
    if not isinstance(threads, int) or isinstance(threads, bool) or not 0 <= threads <= 256:
        raise ConfigError(f"{key}.threads: must be an integer in [0, 256], got {threads!r}")
    precision = table.get("precision", "fp32")
    if precision not in SPEC_PRECISIONS:
        raise ConfigError(f"{key}.precision: must be fp32, fp16 or bf16, got {precision!r}")
    compile_ = table.get("compile", False)
    if not isinstance(compile_, bool):
        raise ConfigError(f"{key}.compile: must be true or false, got {compile_!r}")
    eager = table.get("eager_while_compiling", True)
    if not isinstance(eager, bool):
        raise ConfigError(f"{key}.eager_while_compiling: must be true or false, got {eager!r}")
    mirror = table.get("mirror_axes")
    if mirror is not None and (
        not isinstance(mirror, list)
        or any(not isinstance(a, int) or isinstance(a, bool) or a not in (0, 1, 2) for a in mirror)
        or len(set(mirror)) != len(mirror)
    ):
        raise ConfigError(
            f"{key}.mirror_axes: distinct model axes among 0, 1, 2 ([] for no mirroring), "
            f"got {mirror!r}"
        )
    remote = _remote(table, key, engine)
    return ModelSpec(
        name,
        manifest,
        engine,
        threads,
        precision,
        compile_,
        eager,
        **remote,
        mirror_axes=tuple(mirror) if mirror is not None else None,
    )


def load_spec_manifest(spec: ModelSpec) -> ModelManifest:
    """The manifest of ``spec``, with its ``mirror_axes`` override applied.

    Raises
    ------
    EngineError
        The manifest cannot be read, or ``mirror_axes`` is set for a model without test-time
        mirroring (a version-1 model or a composite: set it on each part's manifest).
    """
    from segnode.engines.manifest_parse import load_manifest

    manifest = load_manifest(spec.manifest)
    if spec.mirror_axes is None:
        return manifest
    if manifest.contract is None or manifest.is_composite:
        raise EngineError(
            f"model {spec.name!r}: mirror_axes applies to one trained (version-2) model; "
            f"{manifest.name!r} is "
            + ("a composite" if manifest.is_composite else "a version-1 model")
        )
    return replace(manifest, contract=replace(manifest.contract, mirror_axes=spec.mirror_axes))


def _remote(table: Mapping[str, Any], key: str, engine: str) -> dict[str, Any]:
    """The remote server's keys (:data:`REMOTE_KEYS`) of a model table, checked."""
    if engine != "kserve":
        for k in REMOTE_KEYS:
            if k in table:
                raise ConfigError(f'{key}.{k}: only meaningful with engine = "kserve"')
        return {}
    url = table.get("url")
    if not isinstance(url, str) or not url.strip():
        raise ConfigError(
            f'{key}.url: engine = "kserve" needs the server, e.g. "http://127.0.0.1:8000" '
            '(HTTP) or "grpc://127.0.0.1:8001" (gRPC)'
        )
    scheme, sep, rest = url.partition("://")
    if sep and scheme not in ("http", "https", "grpc", "grpcs"):
        raise ConfigError(f"{key}.url: scheme must be http, https, grpc or grpcs, got {url!r}")
    host, colon, port = (rest if sep else url).rstrip("/").rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key}.url: must name a host and a port, got {url!r}")
    default_protocol = "grpc" if scheme in ("grpc", "grpcs") else "http"
    protocol = table.get("protocol", default_protocol)
    if protocol not in ("http", "grpc"):
        raise ConfigError(f"{key}.protocol: must be http or grpc, got {protocol!r}")
    if sep and protocol != default_protocol:
        raise ConfigError(f"{key}.protocol: {protocol} does not match the url {url!r}")
    remote_model = table.get("remote_model", "")
    if not isinstance(remote_model, str):
        raise ConfigError(f"{key}.remote_model: must be a string, got {remote_model!r}")
    timeout = table.get("timeout_s", 60.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= 3600:
        raise ConfigError(f"{key}.timeout_s: must be a number in (0, 3600], got {timeout!r}")
    retries = table.get("retries", 3)
    if not isinstance(retries, int) or isinstance(retries, bool) or not 0 <= retries <= 100:
        raise ConfigError(f"{key}.retries: must be an integer in [0, 100], got {retries!r}")
    return {
        "url": url.strip(),
        "protocol": protocol,
        "remote_model": remote_model,
        "timeout_s": float(timeout),
        "retries": retries,
    }
