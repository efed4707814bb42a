"""TensorRT engines: ahead-of-time builds and the engine cache (CPU), execution (GPU).

The build tests need TensorRT-RTX (``pip install tensorrt-rtx-cu13-libs
tensorrt-rtx-cu13-bindings``), which builds portable engines without a GPU; they skip, saying
so, where it is not installed. The execution tests need a CUDA GPU that the installed
TensorRT can run on; they skip with the exact reason otherwise (TensorRT-RTX refuses compute
capability 9.0, the H100/H200).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from bench.unet import SMALL, write_unet
from segnode.engines.base import EngineError
from segnode.engines.engine_cache import EngineCache, atomic_write
from segnode.engines.manifest import ModelManifest
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.trt_backend import (
    BuildSettings,
    TensorRTEngine,
    build_engine,
    check_runnable,
    list_engines,
)
from segnode.engines.trt_build import (
    Flavour,
    GpuInfo,
    _build_device,
    load_flavour,
    onnx_to_fp16,
    resolve_target,
)


def _rtx() -> Flavour:
    try:
        return load_flavour("tensorrt_rtx")
    except EngineError as exc:
        pytest.skip(f"TensorRT-RTX not installed: {exc}")


@pytest.fixture(scope="module")
def rtx() -> Flavour:
    return _rtx()


@pytest.fixture(scope="module")
def tissue(tmp_path_factory: pytest.TempPathFactory) -> ModelManifest:
    """The default model, rebuilt into a temporary folder (deterministic)."""
    from segnode.engines.models.build_tissue import write_model

    return load_manifest(write_model(tmp_path_factory.mktemp("tissue")))


@pytest.fixture()
def small_unet(tmp_path: Path) -> ModelManifest:
    return load_manifest(write_unet(tmp_path / "unet", SMALL))


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_aot_build_tissue(
    rtx: Flavour, tissue: ModelManifest, tmp_path: Path, precision: str
) -> None:
    built = build_engine(tissue, BuildSettings(precision, "tensorrt_rtx"), cache_dir=tmp_path)
    assert not built.hit
    assert built.path.exists() and built.size_bytes == built.path.stat().st_size > 0
    assert built.key.flavour == "tensorrt_rtx" and built.key.target == "portable"
    assert built.key.precision == precision
    assert built.key.batch == (tissue.batch_min, tissue.batch_opt, tissue.batch_max)
    sidecar = json.loads(built.path.with_suffix(".json").read_text())
    assert sidecar["size_bytes"] == built.size_bytes and sidecar["digest"] == built.key.digest()
    [record] = list_engines(tmp_path)
    assert record.valid and record.path == built.path


def test_aot_build_small_unet_both_precisions(
    rtx: Flavour, small_unet: ModelManifest, tmp_path: Path
) -> None:
    fp32 = build_engine(small_unet, BuildSettings("fp32"), cache_dir=tmp_path)
    fp16 = build_engine(small_unet, BuildSettings("fp16"), cache_dir=tmp_path)
    assert fp32.path != fp16.path
    assert {r.key.precision for r in list_engines(tmp_path)} == {"fp32", "fp16"}


def test_second_build_is_a_cache_hit(
    rtx: Flavour, small_unet: ModelManifest, tmp_path: Path
) -> None:
    first = build_engine(small_unet, BuildSettings("fp16"), cache_dir=tmp_path)
    second = build_engine(small_unet, BuildSettings("fp16"), cache_dir=tmp_path)
    assert not first.hit and second.hit
    assert second.path == first.path and second.key == first.key
    assert second.size_bytes == first.size_bytes


def test_changed_onnx_rebuilds_and_drops_the_old_engine(rtx: Flavour, tmp_path: Path) -> None:
    model_dir = tmp_path / "unet"
    first = build_engine(
        load_manifest(write_unet(model_dir, SMALL)), BuildSettings(), cache_dir=tmp_path / "c"
    )
    reseeded = replace(SMALL, seed=1)
    second = build_engine(
        load_manifest(write_unet(model_dir, reseeded)), BuildSettings(), cache_dir=tmp_path / "c"
    )
    assert not second.hit
    assert second.key.model_sha256 != first.key.model_sha256
    assert not first.path.exists()  # superseded engine removed
    assert [r.path for r in list_engines(tmp_path / "c")] == [second.path]


@pytest.mark.parametrize("damage", ["flip", "truncate", "sidecar", "no-sidecar"])
def test_damaged_cache_entry_is_rebuilt(
    rtx: Flavour,
    small_unet: ModelManifest,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    damage: str,
) -> None:
    built = build_engine(small_unet, BuildSettings(), cache_dir=tmp_path)
    data = bytearray(built.path.read_bytes())
    sidecar = built.path.with_suffix(".json")
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        built.path.write_bytes(bytes(data))
    elif damage == "truncate":
        built.path.write_bytes(bytes(data[:100]))
    elif damage == "sidecar":
        sidecar.write_text("{not json")
    else:
        sidecar.unlink()
    assert not list_engines(tmp_path) or not list_engines(tmp_path)[0].valid
    with caplog.at_level(logging.WARNING, logger="segnode.engines.trt_build"):
        rebuilt = build_engine(small_unet, BuildSettings(), cache_dir=tmp_path)
    assert not rebuilt.hit
    assert "rebuilding" in caplog.text
    assert [r.valid for r in list_engines(tmp_path)] == [True]
    assert build_engine(small_unet, BuildSettings(), cache_dir=tmp_path).hit


def test_parser_error_names_node_and_operator(rtx: Flavour, tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["input"], ["logits"], name="mystery_node")],
        "bad",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 1, 8, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2, 8, 8, 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnx 1.23 writes IR 14 by default; ONNX Runtime 1.30 reads up to 13
    onnx.save(model, tmp_path / "bad.onnx")
    (tmp_path / "bad.json").write_text(
        json.dumps(
            {
                "name": "bad",
                "version": "1",
                "onnx": "bad.onnx",
                "input_name": "input",
                "output_name": "logits",
                "patch_size": [8, 8, 8],
                "labels": [
                    {
                        "value": 1,
                        "name": "x",
                        "category": ["1", "SCT", "a"],
                        "type": ["2", "SCT", "b"],
                    }
                ],
            }
        )
    )
    with pytest.raises(EngineError, match=r"node 0 'mystery_node' \(NoSuchOp\)"):
        build_engine(
            load_manifest(tmp_path / "bad.json"), BuildSettings(), cache_dir=tmp_path / "c"
        )
    assert list_engines(tmp_path / "c") == []


def test_fp16_needs_the_manifest_to_allow_it(
    rtx: Flavour, small_unet: ModelManifest, tmp_path: Path
) -> None:
    import dataclasses

    strict = dataclasses.replace(small_unet, fp16=False)
    assert build_engine(strict, BuildSettings("fp16"), cache_dir=tmp_path).key.precision == "fp32"
    with pytest.raises(EngineError, match="precision"):
        BuildSettings("int8")


def test_configured_precision_reaches_the_build_settings(tmp_path: Path) -> None:
    """``[model] engine = "tensorrt"``: the constructor makes the build settings once, from
    the configured precision, and refuses one that no build can have."""
    from segnode.engines.base import create_engine
    from segnode.node.config import from_dict
    from segnode.node.pipeline.engine_pool import engine_options
    from segnode.node.routing.rules import model_specs

    config = from_dict(
        {"data_dir": str(tmp_path), "model": {"engine": "tensorrt", "precision": "fp32"}}
    )
    engine = create_engine("tensorrt", **engine_options(model_specs(config)[0], config.data_dir))
    assert isinstance(engine, TensorRTEngine)
    assert engine.settings == BuildSettings("fp32", "auto", None)
    assert engine.cache_dir == config.data_dir / "engines"
    # the engine's own default precision is fp16, a bare BuildSettings' fp32 (build_engine's)
    assert TensorRTEngine(cache_dir=tmp_path).settings == BuildSettings("fp16")
    with pytest.raises(EngineError, match="precision"):
        TensorRTEngine(cache_dir=tmp_path, precision="int8")
    # an unknown library is refused when the settings are made, not at the first build
    with pytest.raises(EngineError, match="unknown TensorRT flavour 'bogus'"):
        BuildSettings("fp16", "bogus")


def test_full_tensorrt_builds_on_the_engines_device() -> None:
    """Full TensorRT builds for the current CUDA device, so the build makes the engine's
    device current (CuPy); TensorRT-RTX builds for its target and touches no device."""
    import importlib.util

    with _build_device(Flavour("tensorrt_rtx", None, "1.7"), 3):
        pass  # no CuPy and no GPU needed
    full = Flavour("tensorrt", None, "10")
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: selecting device 3 would need that GPU")
    with _build_device(full, 0):
        pass  # the current device is device 0 already
    with pytest.raises(EngineError, match="CUDA device 3 needs CuPy"), _build_device(full, 3):
        pass


@pytest.mark.parametrize("converter", ["onnxconverter_common", "onnxruntime"])
def test_fp16_conversion_keeps_float32_io_and_runs(
    tissue: ModelManifest, converter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    import onnxruntime as ort

    if converter == "onnxruntime":  # the fallback when onnxconverter-common is missing
        monkeypatch.setitem(sys.modules, "onnxconverter_common", None)
    else:
        pytest.importorskip("onnxconverter_common", reason="onnxconverter-common not installed")
    model = onnx.load(str(tissue.onnx_path))
    half = onnx_to_fp16(model)
    onnx.checker.check_model(half)
    assert half.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    # float32 outputs stay float32; the tissue model's uint8 labels stay uint8
    out_type = model.graph.output[0].type.tensor_type.elem_type
    assert half.graph.output[0].type.tensor_type.elem_type == out_type
    x = np.random.default_rng(0).normal(0, 400, (1, 1, *tissue.patch_size))
    x[..., 100:400, 80:430] += 700.0  # a body in the middle of the noise
    # integer HU clipped as the manifest says (in half precision, the tissue model's
    # thresholds on such values are exact; only its 3x3 mean is rounded)
    x = np.clip(np.round(x), *(tissue.clip or (-1024.0, 3071.0))).astype(np.float32)
    ref, got = (
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {tissue.input_name: x}
        )[0]
        for m in (model, half)
    )
    if tissue.output_kind != "labels":
        ref, got = ref.argmax(1), got.argmax(1)
    assert np.mean(ref == got) >= 0.999
    assert len(np.unique(ref)) > 2


def test_targets(rtx: Flavour) -> None:
    assert resolve_target(rtx, None) == "portable"
    assert resolve_target(rtx, "8.6") == "sm86"
    with pytest.raises(EngineError, match="cannot target sm90"):
        resolve_target(rtx, "sm90")
    with pytest.raises(EngineError, match="not 'portable'"):
        resolve_target(rtx, "hopper")


def test_rtx_target_build(rtx: Flavour, small_unet: ModelManifest, tmp_path: Path) -> None:
    built = build_engine(small_unet, BuildSettings(target="sm86"), cache_dir=tmp_path)
    assert built.key.target == "sm86" and "-sm86-" in built.path.name


def test_rtx_refuses_hopper_before_loading(rtx: Flavour) -> None:
    h200 = GpuInfo(index=0, name="NVIDIA H200", compute_capability=(9, 0), total_memory=1 << 40)
    with pytest.raises(EngineError, match=r"does not run on compute capability 9\.0"):
        check_runnable(rtx, "portable", h200)
    ada = GpuInfo(index=0, name="RTX 4090", compute_capability=(8, 9), total_memory=1 << 34)
    check_runnable(rtx, "portable", ada)
    with pytest.raises(EngineError, match="built for sm86"):
        check_runnable(rtx, "sm86", ada)


def test_engine_cli_build_and_list(rtx: Flavour, tissue: ModelManifest, tmp_path: Path) -> None:
    from segnode.engines.engine_cli import add_engine_parser, run_engine_command

    parser = argparse.ArgumentParser()
    add_engine_parser(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    args = parser.parse_args(["engine", "build", "--precision", "fp16"])
    assert run_engine_command(args, data_dir=tmp_path, default_model=tissue.onnx_path, out=out) == 0
    text = out.getvalue()
    assert "engine built: " + str(tmp_path / "engines") in text
    assert "tensorrt_rtx" in text and "fp16" in text and " MB" in text
    out = io.StringIO()
    args = parser.parse_args(["engine", "list"])
    assert run_engine_command(args, data_dir=tmp_path, default_model=tissue.onnx_path, out=out) == 0
    assert "1 engine(s)" in out.getvalue() and "[ok]" in out.getvalue()
    args = parser.parse_args(["engine", "build", "--model", "no-such-model"])
    assert run_engine_command(args, data_dir=tmp_path, default_model=tissue.onnx_path) == 1


def test_engine_build_takes_the_configured_models_engine_and_precision(
    rtx: Flavour, tissue: ModelManifest, tmp_path: Path
) -> None:
    """``segnode engine build`` prebuilds what the node will load: without ``--precision`` the
    configured model's precision (the default [model] runs fp32), and ``--model NAME`` finds a
    ``[models.NAME]`` of the configuration with its own."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    manifest = tissue.onnx_path.with_suffix(".json")
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'data_dir = "{tmp_path / "data"}"\n'
        f'[model]\nmanifest = "{manifest}"\nengine = "tensorrt"\nprecision = "fp32"\n'
        f'[models.lungs]\nmanifest = "{manifest}"\nengine = "tensorrt"\nprecision = "fp16"\n'
    )

    def build(*extra: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "segnode.node.ops.cli", "engine", "build", "--config", str(cfg)]
            + list(extra),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert ", fp32, batch" in build()
    assert ", fp16, batch" in build("--model", "lungs")
    assert ", fp16, batch" in build("--precision", "fp16")  # given: it wins
    done = subprocess.run(
        [sys.executable, "-m", "segnode.node.ops.cli", "engine", "build", "--config", str(cfg)]
        + ["--model", "kidneys"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "the configuration names ['default', 'lungs']" in done.stderr


def test_atomic_write_leaves_no_temporary_files(tmp_path: Path) -> None:
    target = tmp_path / "a" / "x.bin"
    atomic_write(target, b"one")
    atomic_write(target, b"two")
    assert target.read_bytes() == b"two"
    assert [p.name for p in target.parent.iterdir()] == ["x.bin"]


def test_cache_lookup_of_nothing(tmp_path: Path, small_unet: ModelManifest) -> None:
    from segnode.engines.engine_cache import EngineKey

    key = EngineKey(
        small_unet.sha256(),
        "unet",
        "tensorrt_rtx",
        "1",
        "portable",
        "fp32",
        "input",
        (1, 1, 2),
        (32, 32, 32),
    )
    assert EngineCache(tmp_path).lookup(key) == (None, "")
    assert key.digest() == EngineKey.from_dict(json.loads(json.dumps(key.__dict__))).digest()


# --------------------------------------------------------------------------- GPU


def _gpu() -> GpuInfo:
    from segnode.engines.trt_build import gpu_info

    try:
        return gpu_info()
    except EngineError as exc:
        pytest.skip(f"no runnable GPU: {exc}")


def test_tensorrt_engine_without_gpu_says_so(tmp_path: Path, tissue: ModelManifest) -> None:
    from segnode.engines.trt_build import gpu_info

    try:
        gpu_info()
    except EngineError:
        pass
    else:
        pytest.skip("a GPU is present")
    with pytest.raises(EngineError, match="no (CUDA )?GPU"):
        TensorRTEngine(cache_dir=tmp_path).load(tissue)


@pytest.mark.gpu
def test_trt_runner_plumbing_with_a_stand_in_context() -> None:
    """Pinned upload, double-buffered bindings, stream order and the label download, on a GPU,
    with a stand-in for the execution context (so it runs where TensorRT cannot)."""
    _gpu()
    cp = pytest.importorskip("cupy", reason="CuPy not installed")
    from segnode.engines.manifest import LabelSpec
    from segnode.engines.trt_backend import TrtRunner

    classes = 3

    class StandIn:
        """Writes logits -(x - c)^2 for c in 0..2, so the label is round(x)."""

        def __init__(self) -> None:
            self.shapes: dict[str, tuple[int, ...]] = {}
            self.addresses: dict[str, int] = {}
            self.runs = 0

        def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
            self.shapes[name] = tuple(shape)
            return True

        def set_tensor_address(self, name: str, ptr: int) -> None:
            self.addresses[name] = ptr

        def execute_async_v3(self, stream: int) -> bool:
            shape = self.shapes["input"]
            out_shape = (shape[0], classes, *shape[2:])

            def view(name: str, shp: tuple[int, ...]) -> object:
                size = int(np.prod(shp)) * 4
                mem = cp.cuda.UnownedMemory(self.addresses[name], size, self)
                return cp.ndarray(shp, cp.float32, cp.cuda.MemoryPointer(mem, 0))

            # the runner enqueues on its own stream and makes it current around the window
            assert stream == cp.cuda.get_current_stream().ptr != 0
            x, y = view("input", shape), view("logits", out_shape)
            for c in range(classes):
                y[:, c] = -((x[:, 0] - c) ** 2)  # type: ignore[index]
            self.runs += 1
            return True

    manifest = ModelManifest(
        name="standin",
        version="1",
        onnx_path=Path("unused.onnx"),
        labels=tuple(
            LabelSpec(i, f"l{i}", ("1", "SCT", "a"), ("2", "SCT", "b")) for i in range(1, classes)
        ),
        patch_size=(8, 16, 16),
        overlap=0.5,
        input_name="input",
        output_name="logits",
        batch_max=2,
    )
    ctx = StandIn()
    runner = TrtRunner(ctx, manifest, input_name="input", output_name="logits", batch_size=2)
    rng = np.random.default_rng(0)
    truth = rng.integers(0, classes, size=(20, 40, 36)).astype(np.uint8)
    hu = truth.astype(np.float32) + rng.uniform(-0.3, 0.3, truth.shape).astype(np.float32)
    runner._CHUNK_BYTES = 4096  # many upload chunks: exercises both pinned buffers
    labels = runner.segment(hu)
    runner.close()
    assert labels.dtype == np.uint8 and labels.shape == hu.shape
    assert ctx.runs > 2
    np.testing.assert_array_equal(labels, truth)


@pytest.mark.gpu
def test_tensorrt_engine_matches_onnxruntime(tmp_path: Path, tissue: ModelManifest) -> None:
    gpu = _gpu()
    try:
        lib = load_flavour("auto")
        check_runnable(lib, resolve_target(lib, None), gpu)
    except EngineError as exc:
        pytest.skip(f"TensorRT cannot run on this GPU: {exc}")
    from bench.gpu_bench import synthetic_ct
    from segnode.engines.base import create_engine

    hu = synthetic_ct((32, *tissue.patch_size[1:]), seed=3)
    reference = create_engine("onnxruntime")
    reference.load(tissue)
    expected = reference.segment(hu)
    engine = TensorRTEngine(cache_dir=tmp_path, precision="fp16")
    engine.load(tissue)
    got = engine.segment(hu)
    engine.close()
    assert got.dtype == np.uint8 and float(np.mean(got == expected)) >= 0.999


def test_segnode_engine_build_command_line(rtx: Flavour, tmp_path: Path) -> None:
    """The real console entry point, with --data-dir after the sub-command."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    run = [sys.executable, "-m", "segnode.node.ops.cli", "engine"]
    out = subprocess.run(
        [*run, "build", "--precision", "fp32", "--data-dir", str(tmp_path)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert str(tmp_path / "engines") in out.stdout
    again = subprocess.run(
        [*run, "list", "--data-dir", str(tmp_path)], cwd=root, capture_output=True, text=True
    )
    assert again.returncode == 0 and "1 engine(s)" in again.stdout
