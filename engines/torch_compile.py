"""Compiled artefacts of the ``torch`` engine: AOTInductor packages and Inductor mega-caches.

:class:`segnode.engines.torch_backend.TorchEngine` with ``compile=True`` and a ``cache_dir`` calls
:func:`compile_cached`, which returns a predictor from the artefact cache of
:mod:`segnode.engines.torch_cache`, building the artefact on a miss:

``inductor`` (the default)
    ``torch.compile`` as without a cache, after which ``torch.compiler.save_cache_artifacts``
    serializes the FX graph, AOTAutograd and Triton caches; a restart feeds them to
    ``torch.compiler.load_cache_artifacts`` before compiling, so every lookup hits (the
    conversion, Dynamo's tracing and cuDNN's autotuning still run at every start).
``aoti`` (opt-in)
    ``torch.export`` of the onnx2torch module (cast, moved and in its memory format), compiled by
    ``torch._inductor.aoti_compile_and_package`` into a ``.pt2`` package; a restart loads the
    package with ``torch._inductor.aoti_load_package`` and runs no converter and no compiler.
    Each new package is first loaded and run in a child process (:func:`probe_aoti`); if that
    fails, or ``torch.export`` cannot trace the model, the ``inductor`` kind is used instead.

Either way the artefact is warmed up once while loading (one forward pass at the engine's
batch), so an artefact that loads but does not run is rebuilt, not used. Why ``inductor`` is
the default, with figures: docs/performance.md, "GPU: restart to ready".
"""

from __future__ import annotations

import logging
import platform
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from segnode.engines.base import EngineError
from segnode.engines.torch_cache import Loaded, RuntimeFacts, TorchCache, TorchKey, load_or_build

if TYPE_CHECKING:
    from segnode.engines.manifest import ModelManifest

logger = logging.getLogger(__name__)

# Inductor options per torch.compile mode, for the ahead-of-time path (AOTInductor has no
# CUDA graphs: "reduce-overhead" and "max-autotune" use the inductor kind instead).
_AOTI_MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "max-autotune-no-cudagraphs": {"max_autotune": True},
}


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return ""


def runtime_facts(torch: Any, dev: Any) -> RuntimeFacts:
    """Versions and device that a compiled artefact for ``dev`` depends on."""
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        name, target = str(torch.cuda.get_device_name(index)), f"sm{major}{minor}"
    else:
        name, target = "cpu", f"cpu-{platform.machine()}"
    return RuntimeFacts(
        torch_version=str(torch.__version__),
        cuda_version=str(torch.version.cuda or ""),
        triton_version=_version("triton"),
        onnx2torch_version=_version("onnx2torch"),
        device_name=name,
        target=target,
    )


def torch_key(
    manifest: ModelManifest,
    facts: RuntimeFacts,
    *,
    kind: str,
    precision: str,
    batch: int,
    channels_last: bool,
    compile_mode: str,
) -> TorchKey:
    """The cache key of ``manifest`` compiled as ``kind`` with these options."""
    return TorchKey(
        model_sha256=manifest.sha256(),
        model_name=manifest.name,
        kind=kind,
        facts=facts,
        precision=precision,
        batch=batch,
        patch_size=manifest.patch_size,
        channels_last=channels_last,
        compile_mode=compile_mode,
    )


def fold_constant_shapes(torch: Any, module: Any) -> int:
    """Make onnx2torch's shape-reading modules traceable; return how many were replaced.

    onnx2torch's ``CumSum``, ``Reshape`` and ``Expand`` read their axis or target shape from a
    tensor input at run time (``.item()``, ``torch.Size(tensor)``): data-dependent values that
    ``torch.export`` refuses and that break ``torch.compile``'s graph. Where that input is a
    constant of the graph (an ONNX initializer, as in every model seen so far), the module is
    replaced by one holding the axis or shape as integers; the constant is still passed and
    ignored. Other nodes are left alone (export may then fail, and :func:`compile_cached`
    falls back to the ``inductor`` kind). The graph is recompiled when anything changed.
    """
    changed = 0
    for node in list(module.graph.nodes):
        if node.op != "call_module" or len(node.args) != 2:
            continue
        sub = module.get_submodule(node.target)
        name = type(sub).__name__
        if name not in ("OnnxCumSum", "OnnxReshape", "OnnxExpand"):
            continue
        if getattr(node.args[1], "op", "") != "get_attr" or node.kwargs:
            continue
        value = module
        for part in str(node.args[1].target).split("."):
            value = getattr(value, part)
        if not isinstance(value, torch.Tensor) or value.dtype not in (torch.int64, torch.int32):
            continue
        ints = [int(v) for v in value.reshape(-1).tolist()]
        if name == "OnnxCumSum":
            if len(ints) != 1 or sub.exclusive:
                continue
            replacement = _static_cumsum(torch, ints[0], bool(sub.reverse))
        elif name == "OnnxReshape":
            replacement = _static_reshape(torch, ints)
        else:
            replacement = _static_expand(torch, ints)
        module.add_submodule(str(node.target), replacement)
        changed += 1
    if changed:
        module.recompile()
    return changed


def _static_cumsum(torch: Any, axis: int, reverse: bool) -> Any:
    class StaticCumSum(torch.nn.Module):  # type: ignore[misc]
        """ONNX ``CumSum`` over a constant axis (the second input is ignored)."""

        def forward(self, x: Any, _axis: Any) -> Any:
            if reverse:
                return torch.flip(torch.cumsum(torch.flip(x, dims=(axis,)), dim=axis), (axis,))
            return torch.cumsum(x, dim=axis)

    return StaticCumSum()


def _static_reshape(torch: Any, shape: list[int]) -> Any:
    class StaticReshape(torch.nn.Module):  # type: ignore[misc]
        """ONNX ``Reshape`` to a constant shape (0 copies the input's dimension)."""

        def forward(self, x: Any, _shape: Any) -> Any:
            dims = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
            return torch.reshape(x, dims)

    return StaticReshape()


def _static_expand(torch: Any, shape: list[int]) -> Any:
    class StaticExpand(torch.nn.Module):  # type: ignore[misc]
        """ONNX ``Expand`` (bidirectional broadcast) to a constant shape."""

        def forward(self, x: Any, _shape: Any) -> Any:
            return x.expand(torch.broadcast_shapes(tuple(x.shape), tuple(shape)))

    return StaticExpand()


@dataclass(frozen=True)
class Compiled:
    """A predictor from :func:`compile_cached` and where it came from.

    Attributes
    ----------
    fn
        Callable on a ``(batch, 1, *patch)`` tensor of the engine's dtype and memory format.
    kind
        ``"aoti"`` or ``"inductor"``.
    loaded
        The cache's answer (hit or built, timings, path).
    """

    fn: Callable[[Any], Any]
    kind: str
    loaded: Loaded


def compile_cached(
    torch: Any,
    module: Callable[[], Any],
    example: Any,
    warm_up: Callable[[Callable[[Any], Any]], None],
    *,
    cache: TorchCache,
    manifest: ModelManifest,
    key: TorchKey,
) -> Compiled:
    """Return the compiled predictor of ``manifest`` from ``cache``, building it on a miss.

    Parameters
    ----------
    torch
        The imported torch module.
    module
        Returns the onnx2torch module on the device, cast and in its memory format; called only
        when something must be compiled (a hit on an ``aoti`` package needs no module).
    example
        A zero input of the static batch, dtype and memory format (export and warm-up).
    warm_up
        Runs a predictor once (cuDNN autotuning, lazy initialisation); a failure counts as a
        load failure (the artefact is rebuilt once).
    cache, manifest
        Cache folder and the model.
    key
        The artefact's key (:func:`torch_key`), at ``example``'s batch; its ``kind`` is the one
        tried first: ``"aoti"`` falls back to ``"inductor"`` when the model cannot be exported
        or compiled ahead of time.

    Raises
    ------
    EngineError
        If neither kind can be built and loaded, or ``key`` is not at ``example``'s batch.
    """
    if key.batch != int(example.shape[0]):
        raise EngineError(f"a key for batch {key.batch} and an example of {example.shape[0]}")
    compile_mode, kind = key.compile_mode, key.kind
    extra = {"onnx_path": str(manifest.onnx_path)}
    if kind == "aoti" and compile_mode not in _AOTI_MODES:
        logger.info("compile mode %r has no ahead-of-time form; using inductor", compile_mode)
        kind = "inductor"
    if kind == "aoti":
        try:
            loaded = load_or_build(
                cache,
                key,
                lambda tmp: probe_aoti(
                    _build_aoti(torch, module(), example, tmp, compile_mode),
                    example,
                    key.channels_last,
                ),
                lambda path: _load_aoti(torch, path, example, warm_up),
                **extra,
            )
            return Compiled(loaded.value, "aoti", loaded)
        except Exception as exc:
            logger.warning(
                "ahead-of-time compilation of %s failed (%s: %s); caching torch.compile's "
                "artefacts instead",
                manifest.name,
                type(exc).__name__,
                str(exc)[:1500],
            )
    state: dict[str, Any] = {}

    def build(tmp: Path) -> bytes:
        fn = torch.compile(module(), mode=compile_mode, dynamic=False)
        warm_up(fn)
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            raise EngineError("torch.compiler.save_cache_artifacts() returned nothing")
        state["fn"] = fn
        return bytes(saved[0])

    def load(path: Path) -> Callable[[Any], Any]:
        if "fn" in state:  # built in this process: already compiled and warm
            return state.pop("fn")  # type: ignore[no-any-return]
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
        logger.debug("loaded inductor caches: %s", info)
        fn = torch.compile(module(), mode=compile_mode, dynamic=False)
        warm_up(fn)
        return fn  # type: ignore[no-any-return]

    loaded = load_or_build(cache, replace(key, kind="inductor"), build, load, **extra)
    return Compiled(loaded.value, "inductor", loaded)


def _build_aoti(torch: Any, module: Any, example: Any, tmp: Path, compile_mode: str) -> Path:
    """Export ``module`` at ``example``'s shape and compile it into ``tmp/model.pt2``."""
    with torch.no_grad():  # (an inference tensor, a plain copy for the export)
        exported = torch.export.export(module, (example.clone(),), strict=False)
    out = tmp / "model.pt2"
    torch._inductor.aoti_compile_and_package(
        exported, package_path=str(out), inductor_configs=dict(_AOTI_MODES[compile_mode])
    )
    return out


# Loads a package and runs it once, in a process of its own (see probe_aoti).
_PROBE = """
import sys, torch
path, device, dtype, shape, channels_last = sys.argv[1:6]
x = torch.zeros([int(v) for v in shape.split(",")], dtype=getattr(torch, dtype), device=device)
if channels_last == "1":
    x = x.contiguous(memory_format=torch.channels_last_3d)
index = torch.device(device).index
runner = torch._inductor.aoti_load_package(path, device_index=-1 if index is None else index)
with torch.inference_mode():
    runner(x)
if x.is_cuda:
    torch.cuda.synchronize()
"""


def probe_aoti(path: Path, example: Any, channels_last: bool, timeout: float = 600) -> Path:
    """Load the package at ``path`` and run it once in a separate Python process.

    A package that crashes its process (seen on an H200 with torch 2.11: a segmentation
    fault while loading or at the first run, cause not established) would take the node down
    with it, where no ``except`` can help. It is tried in a child first: if the child fails,
    :class:`EngineError` (with the child's exit status and the end of its output, Python's
    fault handler on) makes :func:`compile_cached` fall back to the ``inductor`` kind.

    Returns
    -------
    Path
        ``path``, when the child loaded and ran the package.
    """
    import subprocess
    import sys

    device = str(example.device)
    args = [str(path), device, str(example.dtype).removeprefix("torch."), ""]
    args[3] = ",".join(str(int(v)) for v in example.shape)
    cmd = [sys.executable, "-X", "faulthandler", "-c", _PROBE, *args, "1" if channels_last else "0"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise EngineError(f"the AOTInductor package did not run within {timeout:.0f} s") from exc
    if done.returncode != 0:
        code = done.returncode
        status = f"signal {-code}" if code < 0 else f"exit status {code}"
        tail = (done.stderr or done.stdout).strip()[-1500:]
        raise EngineError(
            f"the AOTInductor package failed a test run in a child ({status}): {tail}"
        )
    return path


def _load_aoti(
    torch: Any, path: Path, example: Any, warm_up: Callable[[Callable[[Any], Any]], None]
) -> Callable[[Any], Any]:
    """Load an AOTInductor package for ``example``'s device and run it once."""
    index = -1  # the current device, as in probe_aoti for a device given without an index
    if example.device.type == "cuda" and example.device.index != torch.cuda.current_device():
        index = example.device.index
    runner = torch._inductor.aoti_load_package(str(path), device_index=index)

    def fn(x: Any) -> Any:
        out = runner(x)
        return out[0] if isinstance(out, list | tuple) else out

    warm_up(fn)
    return fn
