"""PyTorch backend (onnx2torch): conversion, FP16, CUDA graphs, agreement with ONNX Runtime.

Needs torch and onnx2torch (not part of the CPU install); the GPU tests need CUDA. Each test
skips with the reason when its requirement is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.unet import SMALL, write_unet
from engines.base import EngineError, create_engine
from engines.manifest import ModelManifest, load_manifest

torch: Any = pytest.importorskip("torch", reason="PyTorch not installed (GPU machines only)")
pytest.importorskip("onnx2torch", reason="onnx2torch not installed (pip install onnx2torch)")

from engines.torch_backend import TorchEngine, convert_onnx  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU (torch.cuda.is_available() is False)")


@pytest.fixture(scope="module")
def unet(tmp_path_factory: pytest.TempPathFactory) -> ModelManifest:
    return load_manifest(write_unet(tmp_path_factory.mktemp("unet"), SMALL))


@pytest.fixture(scope="module")
def tissue(tmp_path_factory: pytest.TempPathFactory) -> ModelManifest:
    from engines.models.build_tissue import write_model

    return load_manifest(write_model(tmp_path_factory.mktemp("tissue")))


def test_converted_unet_matches_onnxruntime(unet: ModelManifest) -> None:
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((2, 1, *unet.patch_size), dtype=np.float32)
    session = ort.InferenceSession(str(unet.onnx_path), providers=["CPUExecutionProvider"])
    expected = session.run(None, {unet.input_name: x})[0]
    module = convert_onnx(unet.onnx_path).eval()
    with torch.inference_mode():
        got = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)


def test_cpu_engine_segments(unet: ModelManifest) -> None:
    engine = TorchEngine(device="cpu", precision="fp32")
    engine.load(unet)
    hu = np.random.default_rng(1).normal(0, 300, (40, 48, 36)).astype(np.float32)
    labels = engine.segment(hu)
    assert labels.dtype == np.uint8 and labels.shape == hu.shape
    assert labels.max() < unet.num_classes


@pytest.mark.skipif(CUDA, reason="a CUDA GPU is present")
def test_no_cuda_is_an_engine_error(unet: ModelManifest) -> None:
    with pytest.raises(EngineError, match="no CUDA GPU"):
        TorchEngine().load(unet)


@needs_cuda
@pytest.mark.gpu
def test_tissue_on_gpu_matches_onnxruntime_cpu(tissue: ModelManifest) -> None:
    from bench.gpu_bench import synthetic_ct

    hu = synthetic_ct((24, *tissue.patch_size[1:]), seed=2)
    reference = create_engine("onnxruntime")
    reference.load(tissue)
    expected = reference.segment(hu)
    for precision in ("fp32", "fp16"):
        engine = TorchEngine(precision=precision)
        engine.load(tissue)
        got = engine.segment(hu)
        engine.close()
        assert float(np.mean(got == expected)) >= 0.999, precision


@needs_cuda
@pytest.mark.gpu
def test_fp16_and_cuda_graphs_agree_with_fp32(unet: ModelManifest) -> None:
    hu = np.random.default_rng(3).normal(0, 300, (48, 64, 64)).astype(np.float32)
    results = {}
    for name, options in {
        "fp32": {"precision": "fp32"},
        "fp16": {"precision": "fp16"},
        "graphs": {"precision": "fp16", "cuda_graphs": True},
    }.items():
        engine = TorchEngine(**options)
        engine.load(unet)
        results[name] = engine.segment(hu)
        engine.close()
    assert float(np.mean(results["fp16"] == results["fp32"])) >= 0.99
    np.testing.assert_array_equal(results["graphs"], results["fp16"])


@needs_cuda
@pytest.mark.gpu
def test_registry_creates_the_torch_engine(unet: ModelManifest, tmp_path: Path) -> None:
    engine = create_engine("torch", precision="fp32")
    assert engine.name == "torch"
    engine.load(unet)
    assert engine.segment(np.zeros((32, 32, 32), np.float32)).shape == (32, 32, 32)
    engine.close()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.slow
def test_compiled_engine_pads_the_last_batch(unet: ModelManifest) -> None:
    hu = np.random.default_rng(4).normal(0, 300, (32, 48, 32)).astype(np.float32)  # 3 patches
    eager = TorchEngine(precision="fp32", batch_size=2)
    eager.load(unet)
    compiled = TorchEngine(precision="fp32", batch_size=2, compile=True)
    compiled.load(unet)
    assert float(np.mean(compiled.segment(hu) == eager.segment(hu))) >= 0.999
    x = torch.zeros((3, 1, *unet.patch_size), device="cuda")
    assert compiled.predict(x).shape == (3, unet.num_classes, *unet.patch_size)
