"""``segnode engine build|list|export-triton``: build engines ahead of time, list the cache,
write a Triton model repository.

The node's CLI registers the sub-commands with :func:`add_engine_parser` and dispatches to
:func:`run_engine_command` with its data folder and default model::

    segnode engine build [--model NAME_OR_PATH] [--precision fp16|fp32]
                         [--flavour auto|tensorrt|tensorrt_rtx] [--target portable|current|sm86]
    segnode engine build --engine torch [--model ...] [--precision fp16|fp32]
                         [--device cuda:0]
    segnode engine list
    segnode engine export-triton [--model NAME_OR_PATH] [--name REMOTE] DIR

On a machine without a GPU ``auto`` builds with TensorRT-RTX ahead of time (a portable engine
for compute capability 8.0 and later); with full TensorRT and a GPU it builds for that GPU.
``--engine torch`` compiles the model as the node's ``torch`` engine with ``compile = true``
does at its first start (same options, same key: :mod:`segnode.engines.torch_cache`), so that the
node starts by loading the artefact; it needs the GPU the node will use. A version-2 (trained)
model gets one engine or artefact per fold file, every part's for a composite, each with its
own cache key (the fold file's SHA-256). ``export-triton`` writes ``DIR/<name>/config.pbtxt``
and ``DIR/<name>/1/model.onnx`` for Triton (one model per fold file of a version-2 model), the
repository the node's ``kserve`` engine then uses (:mod:`segnode.engines.triton_export`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from segnode.engines.base import EngineError
from segnode.engines.manifest import ModelManifest, check_runnable
from segnode.engines.manifest_parse import load_manifest

MODELS_DIR = Path(__file__).resolve().parent / "models"
#: What ``--precision`` is for a model the configuration does not name.
DEFAULT_PRECISION = "fp16"


@dataclass(frozen=True)
class Configured:
    """A model as the node's configuration runs it (``[model]`` or ``[models.NAME]``): what
    ``engine build`` builds when ``--engine`` and ``--precision`` are not given, so that the
    prebuilt engine is the one the node loads."""

    manifest: Path
    engine: str
    precision: str


def add_engine_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``engine build`` and ``engine list`` on an ``add_subparsers()`` object.

    Returns the ``engine`` parser; the chosen action is in ``args.engine_command``.
    """
    engine = subparsers.add_parser(
        "engine", help="build or list TensorRT engines and compiled torch models"
    )
    actions = engine.add_subparsers(dest="engine_command", required=True)
    build = actions.add_parser("build", help="build (or reuse) the engine of a model")
    build.add_argument(
        "--model",
        default=None,
        help="model name under engines/models, or a manifest .json / .onnx path "
        "(default: the configured model); a [models.NAME] of the configuration is built "
        "with its engine and precision",
    )
    build.add_argument(
        "--engine",
        choices=("tensorrt", "torch"),
        default=None,
        help="tensorrt: a TensorRT engine; torch: the compiled model of the torch engine "
        "(default: the model's configured engine when it is one of these, else tensorrt)",
    )
    build.add_argument(
        "--precision",
        choices=("fp16", "fp32"),
        default=None,
        help=f"default: the model's configured precision ({DEFAULT_PRECISION} for one the "
        "configuration does not name)",
    )
    build.add_argument("--flavour", choices=("auto", "tensorrt", "tensorrt_rtx"), default="auto")
    build.add_argument(
        "--target",
        default=None,
        help="GPU target: portable (TensorRT-RTX default), current, or e.g. sm86",
    )
    build.add_argument("--device", default="cuda", help="torch only: the CUDA device")
    actions.add_parser("list", help="list cached engines and check their checksums")
    triton = actions.add_parser(
        "export-triton", help="write a Triton model repository (config.pbtxt, model.onnx)"
    )
    triton.add_argument(
        "--model",
        default=None,
        help="model name under engines/models, or a manifest .json / .onnx path "
        "(default: the configured model)",
    )
    triton.add_argument(
        "--name", default=None, help="the model's name on the server (default: the manifest's)"
    )
    triton.add_argument(
        "--tensorrt",
        choices=("FP16", "FP32"),
        default=None,
        help="run on the server's GPU through ONNX Runtime's TensorRT accelerator",
    )
    triton.add_argument("directory", type=Path, help="the model repository (created if needed)")
    return engine  # type: ignore[no-any-return]


def resolve_model(
    spec: str | None, default_model: Path, configured: Mapping[str, Configured] | None = None
) -> ModelManifest:
    """Load the manifest named by ``spec``: a model of the configuration, a path, a bundled
    model name, or the default; one the engines cannot run as its contract says is refused
    (:func:`segnode.engines.manifest.check_runnable`)."""
    manifest = _find_model(spec, default_model, configured or {})
    check_runnable(manifest)
    return manifest


def _find_model(
    spec: str | None, default_model: Path, configured: Mapping[str, Configured]
) -> ModelManifest:
    if spec is None:
        return load_manifest(default_model)
    if spec in configured:
        return load_manifest(configured[spec].manifest)
    path = Path(spec)
    if path.suffix in (".json", ".onnx") or path.exists():
        if path.is_dir():
            path = path / f"{path.name}.json"
        return load_manifest(path)
    bundled = MODELS_DIR / spec / f"{spec}.json"
    if bundled.exists():
        return load_manifest(bundled)
    names = sorted(p.name for p in MODELS_DIR.iterdir() if (p / f"{p.name}.json").exists())
    raise EngineError(
        f"no model {spec!r}: not a file, the configuration names {sorted(configured)}, and "
        f"bundled models are {names}"
    )


def _build_defaults(args: argparse.Namespace, configured: Mapping[str, Configured]) -> None:
    """Fill ``--engine`` and ``--precision`` from the configured model (``--model NAME``, or
    ``default`` without one) where they were not given."""
    known = configured.get(args.model if args.model is not None else "default")
    if getattr(args, "engine", None) is None:
        engine = known.engine if known is not None else ""
        args.engine = engine if engine in ("tensorrt", "torch") else "tensorrt"
    if getattr(args, "precision", None) is None:
        args.precision = known.precision if known is not None else DEFAULT_PRECISION


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


def run_engine_command(
    args: argparse.Namespace,
    *,
    data_dir: Path,
    default_model: Path,
    configured: Mapping[str, Configured] | None = None,
    out: TextIO | None = None,
) -> int:
    """Run ``engine build`` or ``engine list``; return the process exit status.

    Parameters
    ----------
    args
        Parsed arguments from the parser :func:`add_engine_parser` registered.
    data_dir
        The node's data folder; engines live in ``<data_dir>/engines``.
    default_model
        Manifest (or ONNX) used when ``--model`` is not given.
    configured
        The configuration's models by name (``default`` for ``[model]``): ``--model NAME``
        finds them, and ``build`` takes their engine and precision unless given.
    out
        Where to print (standard output by default); errors go to standard error.
    """
    stream = out or sys.stdout
    cache_dir = Path(data_dir) / "engines"
    models = configured or {}
    try:
        if args.engine_command == "export-triton":
            return _export_triton(args, resolve_model(args.model, default_model, models), stream)
        if args.engine_command == "build":
            _build_defaults(args, models)
        if args.engine_command == "build" and args.engine == "torch":
            manifest = resolve_model(args.model, default_model, models)
            return _build_torch(args, manifest, cache_dir, stream)
        from segnode.engines.trt_backend import BuildSettings, build_engine, list_engines

        if args.engine_command == "build":
            manifest = resolve_model(args.model, default_model, models)
            settings = BuildSettings(args.precision, args.flavour, args.target)
            # one engine per ONNX file: the model itself, or every fold (of every part); a
            # model calibrated to INT8 builds its files in TensorRT's form where it has them
            for unit in manifest.model_files(int8="tensorrt"):
                built = build_engine(unit, settings, cache_dir=cache_dir)
                key = built.key
                batch, patch = "/".join(map(str, key.batch)), "x".join(map(str, key.patch_size))
                print(f"engine {'reused' if built.hit else 'built'}: {built.path}", file=stream)
                what = manifest.name if unit is manifest else f"{unit.name} of {manifest.name}"
                print(
                    f"  model {what} {manifest.version} (sha256 {key.model_sha256[:12]}), "
                    f"{key.flavour} {key.trt_version}, target {key.target}, {key.precision}, "
                    f"batch {batch}, patch {patch}",
                    file=stream,
                )
                print(f"  time {built.seconds:.1f} s, size {_mb(built.size_bytes)}", file=stream)
            return 0
        if args.engine_command == "list":
            records = list_engines(cache_dir)
            print(f"engine cache {cache_dir}: {len(records)} engine(s)", file=stream)
            for r in records:
                k = r.key
                state = "ok" if r.valid else f"INVALID: {r.problem}"
                print(
                    f"  {r.path.name}  {k.model_name} {k.precision} {k.flavour} {k.trt_version} "
                    f"{k.target}  {_mb(r.size_bytes)}  built in {r.build_seconds:.1f} s "
                    f"{r.created}  [{state}]",
                    file=stream,
                )
            _list_torch(cache_dir, stream)
            return 0
    except EngineError as exc:
        print(f"segnode engine: error: {exc}", file=sys.stderr)
        return 1
    print(f"segnode engine: unknown command {args.engine_command!r}", file=sys.stderr)
    return 2


def _export_triton(args: argparse.Namespace, manifest: ModelManifest, stream: TextIO) -> int:
    """Write the Triton repository and say what went where."""
    from segnode.engines.triton_export import export_triton

    for model in export_triton(manifest, args.directory, args.name, args.tensorrt):
        batch = f"max_batch_size {model.max_batch_size}"
        print(f"triton model {model.name}: {model.folder} ({batch})", file=stream)
    return 0


def _build_torch(
    args: argparse.Namespace, manifest: ModelManifest, cache_dir: Path, stream: TextIO
) -> int:
    """Compile (or find) the torch engine's artefact, exactly as the node's first start would."""
    from segnode.engines.torch_backend import TorchEngine

    engine = TorchEngine(
        device=args.device,
        precision=args.precision,
        compile=True,
        cache_dir=cache_dir,
    )
    try:
        engine.load(manifest)
        info = engine.load_info
    finally:
        engine.close()
    folds = info.get("folds") or [info]
    if not all(fold.get("artefact") for fold in folds):
        print(
            f"segnode engine: error: {manifest.name} could not be compiled (see the log); "
            "the node would run it eagerly",
            file=sys.stderr,
        )
        return 1
    for fold in folds:
        verb = "reused" if fold["cache_hit"] else "built"
        print(f"compiled model {verb}: {fold['artefact']}", file=stream)
        print(
            f"  model {manifest.name} {manifest.version}, {fold['compiled']}, "
            f"build {fold.get('build_seconds', 0.0):.1f} s, load {engine.load_seconds:.1f} s",
            file=stream,
        )
    return 0


def _list_torch(cache_dir: Path, stream: TextIO) -> None:
    from segnode.engines.torch_cache import SUBDIR, TorchCache

    records = TorchCache(cache_dir / SUBDIR).entries(verify=True)
    print(f"compiled torch models {cache_dir / SUBDIR}: {len(records)}", file=stream)
    for r in records:
        k, f = r.key, r.key.facts
        state = "ok" if r.valid else f"INVALID: {r.problem}"
        print(
            f"  {r.path.name}  {k.model_name} {k.precision} {k.kind} torch {f.torch_version} "
            f"{f.device_name} {f.target} batch {k.batch}  {_mb(r.size_bytes)}  built in "
            f"{r.build_seconds:.1f} s {r.created}  [{state}]",
            file=stream,
        )
