"""PyTorch backend (onnx2torch): conversion, FP16, CUDA graphs, agreement with ONNX Runtime.

Needs torch and onnx2torch (not part of the CPU install); the GPU tests need CUDA. Each test
skips with the reason when its requirement is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from bench.unet import SMALL, write_unet
from segnode.engines.base import EngineError, create_engine
from segnode.engines.manifest import ModelManifest
from segnode.engines.manifest_parse import load_manifest

torch: Any = pytest.importorskip("torch", reason="PyTorch not installed (GPU machines only)")
from segnode.engines.torch_backend import TorchEngine  # noqa: E402
from segnode.engines.torch_convert import convert_onnx, import_onnx2torch  # noqa: E402

try:
    import_onnx2torch()
except ImportError:
    pytest.skip("onnx2torch not installed (pip install onnx2torch)", allow_module_level=True)

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU (torch.cuda.is_available() is False)")


@pytest.fixture(scope="module")
def unet(tmp_path_factory: pytest.TempPathFactory) -> ModelManifest:
    return load_manifest(write_unet(tmp_path_factory.mktemp("unet"), SMALL))


@pytest.fixture(scope="module")
def tissue(tmp_path_factory: pytest.TempPathFactory) -> ModelManifest:
    from segnode.engines.models.build_tissue import write_model

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


# -- compiled artefacts cached across processes
# (segnode.engines.torch_compile, segnode.engines.torch_cache) --

RESTART = """
import hashlib, json, sys
import numpy as np
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.torch_backend import TorchEngine
manifest, cache, kind, device, precision, out = sys.argv[1:]
engine = TorchEngine(device=device, precision=precision, compile=True, cache_dir=cache,
                     compile_cache=kind)
engine.load(load_manifest(manifest))
hu = np.random.default_rng(5).normal(0, 300, (40, 48, 36)).astype(np.float32)
np.save(out, engine.segment(hu))
print(json.dumps({k: v for k, v in engine.load_info.items() if k != "artefact"}))
"""


def load_in_fresh_process(
    manifest: ModelManifest, cache: Path, kind: str, device: str, precision: str, out: Path
) -> dict[str, Any]:
    """Load (and maybe build) the compiled model in a new interpreter, as a restart does,
    with its own empty Inductor and Triton caches (only ``cache`` carries anything over)."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(out.parent / f"inductor-{out.stem}"),
        "TRITON_CACHE_DIR": str(out.parent / f"triton-{out.stem}"),
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    args = [str(manifest.onnx_path.with_suffix(".json")), str(cache), kind, device, precision]
    done = subprocess.run(
        [sys.executable, "-c", RESTART, *args, str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    info: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return info


def check_cold_then_warm(
    manifest: ModelManifest, tmp_path: Path, kind: str, device: str, precision: str
) -> None:
    cache = tmp_path / "engines"
    cold = load_in_fresh_process(manifest, cache, kind, device, precision, tmp_path / "cold.npy")
    if kind == "aoti" and cold["compiled"] == "inductor":
        pytest.skip("the AOTInductor package failed its test run here (fell back to inductor)")
    warm = load_in_fresh_process(manifest, cache, kind, device, precision, tmp_path / "warm.npy")
    assert cold["compiled"] == warm["compiled"] == kind
    assert (cold["cache_hit"], warm["cache_hit"]) == (False, True)
    if kind == "aoti":
        assert "convert_seconds" not in warm  # a restart needs no onnx2torch conversion
    # The same kernels run in both processes; only cuDNN's autotuning (per process) may pick
    # another convolution algorithm, and with it a last-bit difference where two classes' FP16
    # logits tie: on a class border, never inside a region.
    cold_labels, warm_labels = np.load(tmp_path / "cold.npy"), np.load(tmp_path / "warm.npy")
    differ = cold_labels != warm_labels
    assert float(np.mean(differ)) <= 1e-3, f"{int(differ.sum())} voxels differ"
    inside = differ & ~class_border(cold_labels) & ~class_border(warm_labels)
    assert not inside.any(), f"{int(inside.sum())} of {int(differ.sum())} differ inside a region"


def class_border(labels: npt.NDArray[np.uint8]) -> npt.NDArray[np.bool_]:
    """Voxels with a 6-neighbour of another label."""
    border = np.zeros(labels.shape, dtype=bool)
    for axis in range(labels.ndim):
        front = [slice(None)] * labels.ndim
        back = [slice(None)] * labels.ndim
        front[axis], back[axis] = slice(1, None), slice(None, -1)
        step = labels[tuple(front)] != labels[tuple(back)]
        border[tuple(front)] |= step
        border[tuple(back)] |= step
    return border


def test_class_border_marks_both_sides_of_a_step() -> None:
    labels = np.zeros((3, 4, 5), dtype=np.uint8)
    labels[:, :, 3:] = 2
    border = class_border(labels)
    assert border[:, :, 2:4].all() and not border[:, :, :2].any() and not border[:, :, 4].any()
    assert not class_border(np.ones((3, 3, 3), dtype=np.uint8)).any()


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="the GPU variant below covers it")
def test_cpu_compiled_model_is_cached_across_restarts(unet: ModelManifest, tmp_path: Path) -> None:
    import shutil

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("Inductor on the CPU needs a C++ compiler")
    check_cold_then_warm(unet, tmp_path, "aoti", "cpu", "fp32")


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="CPU variant: a package that fails its test run")
def test_package_that_crashes_its_test_run_falls_back_to_inductor(
    unet: ModelManifest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    import logging
    import shutil

    import segnode.engines.torch_compile as tc

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("Inductor on the CPU needs a C++ compiler")
    monkeypatch.setattr(tc, "_PROBE", "import os; os.abort()")
    engine = TorchEngine(
        device="cpu", precision="fp32", compile=True, cache_dir=tmp_path, compile_cache="aoti"
    )
    with caplog.at_level(logging.WARNING):
        engine.load(unet)
    assert engine.load_info["compiled"] == "inductor"
    assert "failed a test run in a child (signal 6)" in caplog.text
    assert not list((tmp_path / "torch").glob("*.pt2"))  # the crashing package was not kept
    engine.close()


def test_constant_shapes_are_folded_without_changing_the_output(tissue: ModelManifest) -> None:
    from segnode.engines.torch_compile import fold_constant_shapes

    module = convert_onnx(tissue.onnx_path).eval()
    x = torch.from_numpy(
        np.random.default_rng(6).normal(-300, 500, (1, 1, *tissue.patch_size)).astype(np.float32)
    )
    with torch.inference_mode():
        before = module(x)
        assert fold_constant_shapes(torch, module) > 0  # CumSum axes, Reshape/Expand shapes
        assert fold_constant_shapes(torch, module) == 0
        after = module(x)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert torch.export.export(module, (x,), strict=False) is not None  # traceable now


@needs_cuda
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["aoti", "inductor"])
def test_compiled_model_is_cached_across_restarts(
    unet: ModelManifest, tmp_path: Path, kind: str
) -> None:
    """Cold start compiles and stores; a restart loads the artefact (a hit, no conversion
    for AOTInductor) and gives the same label map bit for bit."""
    check_cold_then_warm(unet, tmp_path, kind, "cuda", "fp16")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.slow
def test_corrupt_artefact_is_rebuilt(
    unet: ModelManifest, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    hu = np.random.default_rng(7).normal(0, 300, (40, 48, 36)).astype(np.float32)
    options: dict[str, Any] = {"precision": "fp16", "compile": True, "cache_dir": tmp_path}
    first = TorchEngine(**options)
    first.load(unet)
    expected = first.segment(hu)
    first.close()
    artefact = Path(first.load_info["artefact"])
    data = bytearray(artefact.read_bytes())
    data[len(data) // 2] ^= 0xFF
    artefact.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="segnode.engines.torch_cache"):
        second = TorchEngine(**options)
        second.load(unet)
    assert "checksum mismatch (corrupt)" in caplog.text
    assert second.load_info["cache_hit"] is False
    assert float(np.mean(second.segment(hu) == expected)) >= 0.9999  # see check_cold_then_warm
    second.close()


def _eager_then_compiled(manifest: ModelManifest, tmp_path: Path, device: str) -> None:
    """``eager_while_compiling``: load returns with the eager module, the segmentation that
    starts after the compiled predictor is ready uses it, and both give the same labels."""
    precision = "fp16" if device == "cuda" else "fp32"
    hu = np.random.default_rng(7).normal(0, 300, (40, 64, 48)).astype(np.float32)
    reference = TorchEngine(device=device, precision=precision)
    reference.load(manifest)
    expected = reference.segment(hu)
    reference.close()

    def eager_first() -> TorchEngine:
        return TorchEngine(
            device=device,
            precision=precision,
            compile=True,
            cache_dir=tmp_path / "engines",
            eager_while_compiling=True,
        )

    engine = eager_first()
    engine.load(manifest)
    assert engine.load_info["compiled"] == ""  # ready before anything was compiled
    eager = engine.segment(hu)
    assert engine.wait_compiled(timeout=900)
    compiled = engine.segment(hu)  # the first segmentation after it: compiled
    assert engine.load_info["compiled"] == "inductor"
    assert engine.load_info["compiled_after_seconds"] > 0
    # Eager in channels-last (as compiled) against eager in the default layout: cuDNN may
    # pick other FP16 algorithms, so a last-bit difference near a class border is allowed.
    assert float(np.mean(eager == expected)) >= 0.999
    assert float(np.mean(compiled == expected)) >= 0.999
    engine.close()
    # A restart finds the artefact and loads it before it is ready (no eager phase: a
    # background compilation would slow the jobs that run meanwhile).
    again = eager_first()
    again.load(manifest)
    assert again.load_info["compiled"] == "inductor" and again.load_info["cache_hit"]
    assert again.compiled_ready.is_set()
    assert float(np.mean(again.segment(hu) == expected)) >= 0.999
    again.close()


@needs_cuda
@pytest.mark.gpu
@pytest.mark.slow
def test_eager_while_compiling_switches_between_jobs(unet: ModelManifest, tmp_path: Path) -> None:
    _eager_then_compiled(unet, tmp_path, "cuda")


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="the GPU variant covers it")
def test_eager_while_compiling_on_the_cpu(unet: ModelManifest, tmp_path: Path) -> None:
    import shutil

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("Inductor on the CPU needs a C++ compiler")
    _eager_then_compiled(unet, tmp_path, "cpu")


def test_failed_background_compilation_stays_eager(
    unet: ModelManifest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    import logging

    import segnode.engines.torch_compile as tc

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(tc, "compile_cached", broken)
    device = "cuda" if CUDA else "cpu"
    engine = TorchEngine(
        device=device,
        precision="fp32",
        compile=True,
        cache_dir=tmp_path / "engines",
        eager_while_compiling=True,
    )
    engine.load(unet)
    assert engine.wait_compiled(timeout=60)
    hu = np.random.default_rng(8).normal(0, 300, (24, 40, 40)).astype(np.float32)
    with caplog.at_level(logging.WARNING):
        labels = engine.segment(hu)
    assert labels.shape == hu.shape
    assert "no compiled artefact" in caplog.text and "no C compiler" in caplog.text
    assert engine.load_info["compiled"] == "" and not engine.compile
    engine.close()


def test_onnx2torch_is_imported_without_torchvision() -> None:
    """The engine's import of onnx2torch loads no torchvision (5 s of a GPU engine's load);
    its two torchvision-backed converters import it when called."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from segnode.engines.torch_convert import import_onnx2torch\n"
        "m = import_onnx2torch()\n"
        "from onnx2torch.node_converters import roialign\n"
        "print('torchvision' in sys.modules, roialign.roi_align.__name__)\n"
        "try:\n"
        "    import torchvision\n"
        "    print('real', hasattr(torchvision, '__file__'))\n"
        "except ImportError:\n"
        "    print('real absent')\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.split("\n")
    assert lines[0] == "False roi_align"  # onnx2torch imported, torchvision not
    # A later import gets the real package (or fails as without the stand-ins).
    assert lines[1] in ("real True", "real absent")


@pytest.mark.slow
def test_first_segmentation_does_not_compile_again(unet: ModelManifest, tmp_path: Path) -> None:
    """The compiled model is warmed up with an input made as the jobs' are (an inference
    tensor): before, a guard failed on the first job, which compiled the model again
    (12-16 s on the H200 after every restart)."""
    import shutil

    from torch._dynamo.utils import counters

    if not CUDA and shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("Inductor on the CPU needs a C++ compiler")
    device = "cuda" if CUDA else "cpu"
    hu = np.random.default_rng(9).normal(0, 300, (24, 40, 40)).astype(np.float32)
    for start in ("cold", "warm"):  # compiled and stored, then loaded from the cache
        engine = TorchEngine(device=device, precision="fp32", compile=True, cache_dir=tmp_path)
        engine.load(unet)
        assert engine.load_info["cache_hit"] == (start == "warm")
        graphs = counters["stats"]["unique_graphs"]
        engine.segment(hu)
        assert counters["stats"]["unique_graphs"] == graphs, f"{start}: compiled again"
        engine.close()


def test_off_a_gpu_a_job_has_no_second_slot(unet: ModelManifest) -> None:
    engine = TorchEngine(device="cpu", precision="fp32")
    assert not engine.has_room()  # not loaded
    engine.load(unet)
    hu = np.random.default_rng(5).normal(0, 300, (40, 48, 36)).astype(np.float32)
    with engine.job_scope(lambda: False):
        labels = engine.segment(hu)
    np.testing.assert_array_equal(labels, engine.segment(hu))
    assert not engine.has_room() and engine.solo_peak is None  # the CPU: one job at a time


@needs_cuda
@pytest.mark.gpu
def test_two_jobs_on_their_own_streams_match_one_at_a_time(unet: ModelManifest) -> None:
    """Two lanes' jobs in the model at once, each on its thread's CUDA stream, give the label
    maps and sums the same jobs give one at a time; a job alone sets the peak that
    ``has_room`` asks for, and a job beside another does not."""
    import threading

    engine = TorchEngine(precision="fp16")
    engine.load(unet)
    rng = np.random.default_rng(6)
    volumes = [rng.normal(0, 300, (96, 128, 128)).astype(np.float32) for _ in range(2)]
    assert not engine.has_room()  # no job has run alone yet
    alone = []
    for hu in volumes:
        with engine.job_scope(lambda: False):
            alone.append(engine.segment_with_sums(hu))
    peak = engine.solo_peak
    assert peak is not None and peak > 0
    assert engine.has_room()  # a GPU of tens of GiB holds a second job of this small model
    together: list[Any] = [None, None]
    start = threading.Barrier(2)
    streams: list[Any] = [None, None]

    def lane(k: int) -> None:
        start.wait()
        with engine.job_scope(lambda: True):
            streams[k] = torch.cuda.current_stream()
            together[k] = engine.segment_with_sums(volumes[k])

    threads = [threading.Thread(target=lane, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert streams[0] != streams[1] and torch.cuda.default_stream() not in streams
    for (labels, sums), (got, got_sums) in zip(alone, together, strict=True):
        # cuDNN may pick other FP16 kernels with two jobs at once: noise-level ties may flip;
        # a race between the jobs' buffers would not leave 99.9 % of the labels in place
        agree = float(np.mean(got == labels))
        assert agree >= 0.999, agree
        counts = got_sums.counts.astype(np.float64)
        np.testing.assert_allclose(counts, sums.counts, rtol=2e-3, atol=labels.size * 1e-3)
    assert engine.solo_peak == peak  # jobs beside another do not change it
    engine.gpu_memory_limit = torch.cuda.memory_allocated() + peak  # no room for 1.25 peaks
    assert not engine.has_room()
    engine.close()


def test_the_cudnn_switches_stay_set_while_another_job_is_inside() -> None:
    """Two jobs' calls overlap: the first one out must not restore the switches under the
    second (its kernels would change halfway); the last one out restores them."""
    b = torch.backends
    before = b.cudnn.benchmark
    b.cudnn.benchmark = False
    try:
        first, second = TorchEngine(device="cpu"), TorchEngine(device="cpu")
        first._torch = second._torch = torch
        outer = first._flags()
        outer.__enter__()
        with second._flags():
            assert b.cudnn.benchmark is True
        assert b.cudnn.benchmark is True  # the first call is still inside
        outer.__exit__(None, None, None)
        assert b.cudnn.benchmark is False  # restored by the last one out
    finally:
        b.cudnn.benchmark = before


@needs_cuda
@pytest.mark.gpu
def test_a_model_process_gives_the_labels_and_sums_of_the_engine_in_the_node(
    unet: ModelManifest,
) -> None:
    """``[engine] model_process`` on a GPU: the torch engine in its own process gives the
    labels and HU sums of the same engine in this one; a job alone there sets the peak that
    its ``has_room`` answers from."""
    from segnode.engines.model_process import ProcessEngine

    inside = TorchEngine(precision="fp16")
    inside.load(unet)
    hu = np.random.default_rng(8).normal(0, 300, (96, 128, 128)).astype(np.float32)
    labels, sums = inside.segment_with_sums(hu)
    engine = ProcessEngine("torch", {"precision": "fp16"})
    engine.load(unet)
    try:
        assert engine.precision_used == "fp16"
        assert not engine.has_room()  # no job has run alone there yet
        got, got_sums = engine.segment_job(hu)
        assert got_sums is not None and got.shape == hu.shape
        agree = float(np.mean(got == labels))
        assert agree >= 0.999, agree
        np.testing.assert_allclose(
            got_sums.counts.astype(np.float64), sums.counts, rtol=2e-3, atol=labels.size * 1e-3
        )
        assert engine.has_room()  # the child measured a job alone
    finally:
        engine.close()


def test_a_file_that_is_not_onnx_fails_with_the_reason(tmp_path: Path) -> None:
    """A model whose network file is corrupt fails its load with an EngineError naming the
    file (its jobs fail with that reason), not protobuf's DecodeError as an internal error."""
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"this is not an ONNX model\n" * 64)
    with pytest.raises(EngineError, match=r"cannot load .*broken\.onnx: not a readable ONNX"):
        convert_onnx(bad)
