"""Compiled-artefact cache of the torch engine: keys, validation, rebuilds (no torch needed).

:func:`segnode.engines.torch_cache.load_or_build` is driven with stand-in ``build``/``load``
functions, so every rule (hit, miss, stale or foreign key, corrupt or unloadable artefact,
superseded model, interrupted build) is checked on any machine; tests/test_torch_backend.py runs the
real compilers on a GPU.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from segnode.engines.base import EngineError
from segnode.engines.torch_cache import (
    RECIPE,
    SUBDIR,
    RuntimeFacts,
    TorchCache,
    TorchKey,
    load_or_build,
)

H200 = RuntimeFacts(
    torch_version="2.11.0+cu130",
    cuda_version="13.0",
    triton_version="3.6.0",
    onnx2torch_version="1.5.15",
    device_name="NVIDIA H200",
    target="sm90",
)


def make_key(**changes: object) -> TorchKey:
    key = TorchKey(
        model_sha256="a" * 64,
        model_name="unet",
        kind="aoti",
        facts=H200,
        precision="fp16",
        batch=2,
        patch_size=(128, 128, 128),
        channels_last=True,
        compile_mode="default",
    )
    return replace(key, **changes)  # type: ignore[arg-type]


class Recorder:
    """Stand-in compiler: ``build`` writes ``payload``; ``load`` returns the bytes read."""

    def __init__(self, payload: bytes = b"compiled-model", *, as_file: bool = False) -> None:
        self.payload, self.as_file = payload, as_file
        self.builds = self.loads = 0
        self.fail_loads = 0

    def build(self, tmp: Path) -> bytes | Path:
        self.builds += 1
        if self.as_file:
            out = tmp / "model.pt2"
            out.write_bytes(self.payload)
            return out
        return self.payload

    def load(self, path: Path) -> bytes:
        self.loads += 1
        if self.fail_loads:
            self.fail_loads -= 1
            raise RuntimeError("undefined symbol in the package")
        return path.read_bytes()


def run(cache: TorchCache, key: TorchKey, rec: Recorder) -> tuple[bytes, bool]:
    loaded = load_or_build(cache, key, rec.build, rec.load, onnx_path="/models/unet.onnx")
    return loaded.value, loaded.hit


def test_digest_covers_everything_but_the_name() -> None:
    key = make_key()
    assert make_key(model_name="other").digest() == key.digest()
    variants = [
        make_key(model_sha256="b" * 64),
        make_key(kind="inductor"),
        make_key(facts=replace(H200, torch_version="2.12.0+cu130")),
        make_key(facts=replace(H200, cuda_version="12.8")),
        make_key(facts=replace(H200, triton_version="3.7.0")),
        make_key(facts=replace(H200, onnx2torch_version="1.6.0")),
        make_key(facts=replace(H200, device_name="NVIDIA H100 80GB HBM3")),
        make_key(facts=replace(H200, target="sm89")),
        make_key(precision="fp32"),
        make_key(batch=1),
        make_key(patch_size=(64, 128, 128)),
        make_key(channels_last=False),
        make_key(compile_mode="max-autotune-no-cudagraphs"),
        make_key(recipe=RECIPE + 1),
    ]
    digests = {v.digest() for v in variants} | {key.digest()}
    assert len(digests) == len(variants) + 1
    assert key.stem.startswith("unet-fp16-aoti-sm90-") and key.suffix == ".pt2"
    assert make_key(kind="inductor").suffix == ".inductor"


def test_key_round_trips_through_json() -> None:
    from dataclasses import asdict

    key = make_key()
    again = TorchKey.from_dict(json.loads(json.dumps(asdict(key))))
    assert again == key and again.digest() == key.digest()


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(EngineError, match="unknown compiled-artefact kind"):
        make_key(kind="tensorrt")


def test_unsafe_names_do_not_reach_the_file_system(tmp_path: Path) -> None:
    key = make_key(model_name="../../etc/passwd", facts=replace(H200, target="sm90/../x"))
    cache = TorchCache(tmp_path)
    path = cache.artefact_path(key)
    assert path.parent == tmp_path and "/" not in path.name and not path.name.startswith(".")


@pytest.mark.parametrize("as_file", [False, True])
def test_miss_builds_then_hit_loads(tmp_path: Path, as_file: bool) -> None:
    cache, key, rec = TorchCache(tmp_path), make_key(), Recorder(as_file=as_file)
    assert run(cache, key, rec) == (b"compiled-model", False)
    assert run(cache, key, rec) == (b"compiled-model", True)
    assert rec.builds == 1 and rec.loads == 2
    meta = json.loads(cache.sidecar_path(key).read_text())
    assert meta["digest"] == key.digest() and meta["size_bytes"] == len(b"compiled-model")
    assert meta["onnx_path"] == "/models/unet.onnx"
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".build-")]
    assert leftovers == []


def test_foreign_gpu_or_new_torch_builds_its_own(tmp_path: Path) -> None:
    cache, rec = TorchCache(tmp_path), Recorder()
    run(cache, make_key(), rec)
    h100 = make_key(facts=replace(H200, device_name="NVIDIA H100", target="sm90"))
    newer = make_key(facts=replace(H200, torch_version="2.12.0+cu130"))
    assert run(cache, h100, rec)[1] is False
    assert run(cache, newer, rec)[1] is False
    assert rec.builds == 3 and len(cache.entries()) == 3


def test_artefact_copied_under_another_key_is_stale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sidecar and artefact renamed to this key's stem (copied from another machine, or
    left by another version) are not trusted."""
    cache, rec = TorchCache(tmp_path), Recorder()
    mine, foreign = make_key(), make_key(facts=replace(H200, device_name="NVIDIA A100"))
    run(cache, foreign, Recorder(b"foreign"))
    cache.artefact_path(foreign).rename(cache.artefact_path(mine))
    cache.sidecar_path(foreign).rename(cache.sidecar_path(mine))
    with caplog.at_level(logging.WARNING, logger="segnode.engines.torch_cache"):
        assert run(cache, mine, rec) == (b"compiled-model", False)
    assert "another key (stale or foreign)" in caplog.text


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: p.write_bytes(b"compiled-modeX"), "checksum mismatch (corrupt)"),
        (lambda p: p.write_bytes(b"compiled"), "has 8 bytes"),
        (lambda p: p.unlink(), "unreadable"),
    ],
)
def test_damaged_artefact_is_rebuilt_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: object, reason: str
) -> None:
    cache, key, rec = TorchCache(tmp_path), make_key(), Recorder()
    run(cache, key, rec)
    damage(cache.artefact_path(key))  # type: ignore[operator]
    with caplog.at_level(logging.WARNING, logger="segnode.engines.torch_cache"):
        assert run(cache, key, rec) == (b"compiled-model", False)
    assert reason in caplog.text and rec.builds == 2
    assert run(cache, key, rec)[1] is True


@pytest.mark.parametrize("sidecar", ["{not json", '{"format": 99}', '{"format": 1, "key": {}}'])
def test_bad_sidecar_is_rebuilt(tmp_path: Path, sidecar: str) -> None:
    cache, key, rec = TorchCache(tmp_path), make_key(), Recorder()
    run(cache, key, rec)
    cache.sidecar_path(key).write_text(sidecar)
    assert run(cache, key, rec)[1] is False and rec.builds == 2


def test_artefact_that_does_not_load_is_rebuilt_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache, key, rec = TorchCache(tmp_path), make_key(), Recorder()
    run(cache, key, rec)
    rec.fail_loads = 1
    with caplog.at_level(logging.WARNING, logger="segnode.engines.torch_cache"):
        assert run(cache, key, rec) == (b"compiled-model", False)
    assert "does not load (RuntimeError: undefined symbol" in caplog.text
    assert rec.builds == 2


def test_fresh_artefact_that_does_not_load_is_an_error_and_removed(tmp_path: Path) -> None:
    cache, key, rec = TorchCache(tmp_path), make_key(), Recorder()
    rec.fail_loads = 1
    with pytest.raises(EngineError, match="does not load"):
        run(cache, key, rec)
    assert not cache.artefact_path(key).exists() and not cache.sidecar_path(key).exists()


def test_failed_build_stores_nothing(tmp_path: Path) -> None:
    cache, key = TorchCache(tmp_path), make_key()

    def build(tmp: Path) -> bytes:
        (tmp / "half-written.so").write_bytes(b"x")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        load_or_build(cache, key, build, Path.read_bytes)
    assert cache.entries() == [] and not any(tmp_path.glob(".build-*"))


def test_interrupted_build_leftovers_are_removed(tmp_path: Path) -> None:
    cache, key = TorchCache(tmp_path), make_key()
    stale = tmp_path / f".build-{key.stem}-abc123"
    stale.mkdir(parents=True)
    (stale / "model.pt2").write_bytes(b"half")
    run(cache, key, Recorder())
    assert not stale.exists()


def test_new_model_file_supersedes_the_old_artefact(tmp_path: Path) -> None:
    cache, rec = TorchCache(tmp_path), Recorder()
    old, new = make_key(), make_key(model_sha256="c" * 64)
    other_config = make_key(precision="fp32")
    run(cache, old, rec)
    run(cache, other_config, rec)
    run(cache, new, rec)
    keys = {r.key for r in cache.entries()}
    assert keys == {new, other_config}


def test_entries_report_corruption(tmp_path: Path) -> None:
    cache, key = TorchCache(tmp_path), make_key()
    run(cache, key, Recorder())
    (tmp_path / "junk.json").write_text("[]")
    assert [r.valid for r in cache.entries()] == [True]
    cache.artefact_path(key).write_bytes(b"compiled-modeX")
    (record,) = cache.entries()
    assert not record.valid and "corrupt" in record.problem
    assert record.extra == {"onnx_path": "/models/unet.onnx"}


def test_engine_list_shows_compiled_torch_models(tmp_path: Path) -> None:
    from segnode.engines.engine_cli import add_engine_parser, run_engine_command

    run(TorchCache(tmp_path / "engines" / SUBDIR), make_key(), Recorder())
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    args = parser.parse_args(["engine", "list"])
    assert run_engine_command(args, data_dir=tmp_path, default_model=Path("x"), out=out) == 0
    text = out.getvalue()
    assert "compiled torch models" in text and ": 1" in text
    assert "unet fp16 aoti torch 2.11.0+cu130 NVIDIA H200 sm90 batch 2" in text and "[ok]" in text


def test_engine_build_for_torch_without_a_gpu_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from segnode.engines.engine_cli import add_engine_parser, run_engine_command
    from segnode.engines.models import default_manifest_path

    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA GPU is present (tests/test_torch_backend.py covers it)")
    except ImportError:
        pass
    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["engine", "build", "--engine", "torch", "--precision", "fp16"])
    code = run_engine_command(args, data_dir=tmp_path, default_model=default_manifest_path())
    assert code == 1
    assert "segnode engine: error:" in capsys.readouterr().err
    assert not (tmp_path / "engines" / SUBDIR).exists() or not any(
        (tmp_path / "engines" / SUBDIR).glob("*.json")
    )


def test_compile_option_reaches_the_torch_engine(tmp_path: Path) -> None:
    from segnode.engines.manifest_parse import load_manifest
    from segnode.engines.models import default_manifest_path
    from segnode.engines.ort_backend import OrtEngine
    from segnode.node.config import from_dict
    from segnode.node.errors import ConfigError
    from segnode.node.pipeline.engine_pool import EnginePool, engine_options
    from segnode.node.routing.rules import model_specs

    lungs_table = {"manifest": str(default_manifest_path()), "engine": "torch", "compile": True}
    config = from_dict(
        {
            "data_dir": str(tmp_path / "data"),
            "model": {"engine": "torch", "precision": "fp16", "compile": True},
            "models": {"lungs": lungs_table},
        }
    )
    default, lungs = model_specs(config)
    assert default.compile and lungs.compile
    options = engine_options(default, config.data_dir)
    assert options == {
        "precision": "fp16",
        "compile": True,
        "cache_dir": config.data_dir / "engines",
        "eager_while_compiling": True,
        "gpu_memory_limit": 0,
    }
    # [engine] gpu_memory_limit (MiB) reaches the torch engine in bytes
    capped = from_dict({"model": {"engine": "torch"}, "engine": {"gpu_memory_limit": 6144}})
    manifest = load_manifest(default_manifest_path())
    assert EnginePool.of_config(capped, OrtEngine(), manifest).gpu_memory_limit == 6144
    assert (
        engine_options(default, config.data_dir, gpu_memory_limit=6144)["gpu_memory_limit"]
        == 6144 << 20
    )
    assert not engine_options(
        model_specs(from_dict({"model": {"engine": "torch", "eager_while_compiling": False}}))[0],
        config.data_dir,
    )["eager_while_compiling"]
    with pytest.raises(ConfigError, match="model.compile"):
        from_dict({"model": {"engine": "torch", "compile": "yes"}})
    with pytest.raises(ConfigError, match="models.lungs.compile"):
        from_dict({"models": {"lungs": {**lungs_table, "compile": 1}}})
    with pytest.raises(ConfigError, match="model.eager_while_compiling"):
        from_dict({"model": {"engine": "torch", "eager_while_compiling": "no"}})
