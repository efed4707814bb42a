"""The ``kserve`` engine against a real KServe v2 server started by the tests.

The server is KServe's own Python model server hosting the ONNX file with ONNX Runtime
(``tests/fixtures/kserve_server.py``), in its own process on free loopback ports: the remote
label maps must equal the local ONNX Runtime engine's, over HTTP and gRPC; a server that is
down fails the load, or the job, with a readable reason; a job retried once the server is back
succeeds. ``segnode engine export-triton`` writes a repository whose ``config.pbtxt`` parses
as Triton's ``ModelConfig``. Everything skips when ``tritonclient`` or ``kserve`` is missing
(``pip install -e '.[test]'`` installs both).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from segnode.engines.base import EngineError, create_engine
from segnode.engines.manifest import ModelManifest
from segnode.engines.manifest_parse import load_manifest
from segnode.node.errors import ConfigError
from segnode.node.modelspec import parse_model_spec
from tests.conftest import LOOPBACK, PHANTOM, ROOT, free_port, require_data, wait_for

TISSUE = ROOT / "engines" / "models" / "tissue" / "tissue.json"
SERVER = ROOT / "tests" / "fixtures" / "kserve_server.py"

pytest.importorskip(
    "tritonclient.http", reason="tritonclient not installed: pip install -e .[test]"
)
pytest.importorskip(
    "tritonclient.grpc", reason="tritonclient not installed: pip install -e .[test]"
)
if importlib.util.find_spec("kserve") is None:  # imported by the server process only
    pytest.skip(
        "kserve (the test server) not installed: pip install -e .[test]", allow_module_level=True
    )


class KServeServer:
    """``tests/fixtures/kserve_server.py`` in a subprocess; stop and start keep the ports."""

    def __init__(self, models: dict[str, Path], log: Path) -> None:
        self.models = models
        self.http_port, self.grpc_port = free_port(), free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"grpc://{LOOPBACK}:{self.grpc_port}"

    def url(self, protocol: str) -> str:
        return self.grpc_url if protocol == "grpc" else self.http_url

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"kserve server exited: {self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=1) as r:
                return bool(json.load(r).get("ready"))
        except OSError:
            return False

    def start(self) -> KServeServer:
        args = [sys.executable, str(SERVER)]
        for name, path in self.models.items():
            args += ["--model", f"{name}={path}"]
        args += ["--http_port", str(self.http_port), "--grpc_port", str(self.grpc_port)]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        wait_for(self._ready, 60, "the kserve server")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture(scope="module")
def tissue() -> ModelManifest:
    return load_manifest(TISSUE)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tissue: ModelManifest
) -> Iterator[KServeServer]:
    log = tmp_path_factory.mktemp("kserve") / "server.log"
    srv = KServeServer({"tissue": tissue.onnx_path}, log).start()
    yield srv
    srv.stop()


def _local(manifest: ModelManifest, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
    engine = create_engine("onnxruntime")
    try:
        engine.load(manifest)
        return engine.segment(hu)
    finally:
        engine.close()


def _remote(
    manifest: ModelManifest, hu: npt.NDArray[np.float32], url: str, protocol: str, **kw: Any
) -> npt.NDArray[np.uint8]:
    engine = create_engine("kserve", url=url, protocol=protocol, **kw)
    try:
        engine.load(manifest)
        return engine.segment(hu)
    finally:
        engine.close()


def _read_series(folder: Path) -> npt.NDArray[np.float32]:
    """HU ``(z, y, x)`` of a CT series, slices sorted along z."""
    import pydicom

    datasets = sorted(
        (pydicom.dcmread(p) for p in sorted(folder.iterdir()) if p.is_file()),
        key=lambda ds: float(ds.ImagePositionPatient[2]),
    )
    return np.stack(
        [ds.pixel_array * float(ds.RescaleSlope) + float(ds.RescaleIntercept) for ds in datasets]
    ).astype(np.float32)


# -- remote == local ---------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_remote_labels_equal_onnxruntime_on_the_synthetic_series(
    server: KServeServer, tissue: ModelManifest, protocol: str
) -> None:
    from tests.fixtures.synthetic import phantom_hu

    hu = phantom_hu(300, 280, 9, seed=5).astype(np.float32)
    want = _local(tissue, hu)
    assert len(np.unique(want)) >= 4  # air, fat, soft tissue, bone, lungs
    # batch 2 over 5 patches: full, full and a short last request
    got = _remote(tissue, hu, server.url(protocol), protocol, batch_size=2)
    assert got.dtype == np.uint8 and np.array_equal(got, want)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_remote_labels_equal_onnxruntime_on_the_phantom(
    server: KServeServer, tissue: ModelManifest, protocol: str
) -> None:
    hu = _read_series(require_data(PHANTOM))
    assert np.array_equal(_remote(tissue, hu, server.url(protocol), protocol), _local(tissue, hu))


# -- load checks -------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_server_that_is_down_fails_the_load_with_the_reason(
    tissue: ModelManifest, protocol: str
) -> None:
    port = free_port()  # nobody listens
    url = f"{'grpc' if protocol == 'grpc' else 'http'}://{LOOPBACK}:{port}"
    engine = create_engine("kserve", url=url, protocol=protocol, retries=1, backoff_s=0.05)
    with pytest.raises(EngineError) as caught:
        engine.load(tissue)
    message = str(caught.value)
    assert message.startswith(f"kserve server at {url} is not reachable after 2 attempts: ")
    assert "refused" in message.lower() or "unavailable" in message.lower(), message


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_model_the_server_lacks_is_named(
    server: KServeServer, tissue: ModelManifest, protocol: str
) -> None:
    engine = create_engine(
        "kserve", url=server.url(protocol), protocol=protocol, model_name="lungs"
    )
    with pytest.raises(EngineError, match=rf"model lungs not ready on {server.url(protocol)}"):
        engine.load(tissue)


def test_metadata_that_disagrees_with_the_manifest_is_named(
    server: KServeServer, tissue: ModelManifest, tmp_path: Path
) -> None:
    raw = json.loads(TISSUE.read_text())
    raw.update(patch_size=[4, 512, 512], onnx=str(tissue.onnx_path))
    (tmp_path / "tissue.json").write_text(json.dumps(raw))
    engine = create_engine("kserve", url=server.http_url)
    with pytest.raises(EngineError, match=r"input shape \[-1, 1, 2, 512, 512\] does not match"):
        engine.load(load_manifest(tmp_path / "tissue.json"))
    engine = create_engine("kserve", url=server.http_url, precision="fp16")
    with pytest.raises(EngineError, match="takes FP32 input, the engine sends FP16"):
        engine.load(tissue)  # the manifest allows fp16, the served graph takes FP32


# -- configuration -----------------------------------------------------------------------------


def _spec(**table: Any) -> Any:
    return parse_model_spec(
        "m", {"manifest": str(TISSUE), **table}, "models.m", lambda v, k: Path(v)
    )


def test_model_table_keys_of_a_remote_engine() -> None:
    spec = _spec(engine="kserve", url="grpc://triton:8001", remote_model="t", retries=0)
    assert (spec.url, spec.protocol, spec.remote_model, spec.retries) == (
        "grpc://triton:8001",
        "grpc",
        "t",
        0,
    )
    from segnode.node.pipeline.engine_pool import engine_options

    options = engine_options(spec, Path("/tmp"))
    assert options["model_name"] == "t" and options["protocol"] == "grpc"
    bad = {
        "models.m.url: engine": {"engine": "kserve"},
        "models.m.url: only meaningful": {"url": "http://x:1"},
        "models.m.url: must name a host": {"engine": "kserve", "url": "http://triton"},
        "models.m.url: scheme": {"engine": "kserve", "url": "ftp://x:1"},
        "models.m.protocol: grpc does not match": {
            "engine": "kserve",
            "url": "http://x:1",
            "protocol": "grpc",
        },
        "models.m.timeout_s": {"engine": "kserve", "url": "x:1", "timeout_s": 0},
        "models.m.retries": {"engine": "kserve", "url": "x:1", "retries": -1},
    }
    for message, table in bad.items():
        with pytest.raises(ConfigError, match=message):
            _spec(**table)


# -- Triton repository -------------------------------------------------------------------------


def test_export_triton_writes_a_config_triton_parses(tmp_path: Path, tissue: ModelManifest) -> None:
    import onnx
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    out = subprocess.run(
        [sys.executable, "-m", "segnode.node.ops.cli", "engine", "export-triton"]
        + ["--model", "tissue", str(tmp_path / "repo")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    folder = tmp_path / "repo" / "tissue"
    config = text_format.Parse(
        (folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    )
    graph = onnx.load(str(folder / "1" / "model.onnx")).graph
    assert (folder / "1" / "model.onnx").read_bytes() == tissue.onnx_path.read_bytes()
    assert config.name == "tissue" and config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == tissue.batch_max == 32
    types = {"TYPE_FP32": onnx.TensorProto.FLOAT, "TYPE_UINT8": onnx.TensorProto.UINT8}
    for ours, theirs in ((config.input, graph.input), (config.output, graph.output)):
        [tensor], [value] = ours, theirs
        assert tensor.name == value.name
        assert types[model_config_pb2.DataType.Name(tensor.data_type)] == (
            value.type.tensor_type.elem_type
        )
        dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
        assert list(tensor.dims) == dims[1:]  # the batch axis is Triton's, from max_batch_size


def test_export_triton_with_tensorrt_asks_for_the_gpu_accelerator(
    tmp_path: Path, tissue: ModelManifest
) -> None:
    """``--tensorrt FP16``: a GPU instance group and ONNX Runtime's TensorRT accelerator in
    FP16 with its engine cache, in a config Triton's own protobuf parses."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    out = subprocess.run(
        [sys.executable, "-m", "segnode.node.ops.cli", "engine", "export-triton"]
        + ["--model", "tissue", "--tensorrt", "FP16", str(tmp_path / "repo")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "repo" / "tissue" / "config.pbtxt").read_text()
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    [group] = config.instance_group
    assert group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU
    [accelerator] = config.optimization.execution_accelerators.gpu_execution_accelerator
    assert accelerator.name == "tensorrt"
    assert accelerator.parameters["precision_mode"] == "FP16"
    assert accelerator.parameters["trt_engine_cache_enable"] == "1"


# -- a whole node ------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_job_fails_while_the_server_is_down_and_a_retry_succeeds(
    make_node: Any, tmp_path: Path, tissue: ModelManifest
) -> None:
    """``segnode serve`` with ``engine = "kserve"``: the server stops after the engine loaded;
    the series' job fails with the reason in ``segnode jobs`` and the node keeps serving; the
    server comes back, ``segnode retry`` requeues the job and it ends done with its SEG."""
    from scripts.harness import send_files
    from segnode.node.pipeline.worker import result_paths
    from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

    server = KServeServer({"tissue": tissue.onnx_path}, tmp_path / "server.log").start()
    try:
        model = {"engine": "kserve", "url": server.http_url, "retries": 1, "load": "before"}
        node = make_node(model=model)
        server.stop()
        files = write_synthetic_series(
            tmp_path / "in", PhantomGeometry(rows=64, columns=64, slices=6), seed=3
        )
        assert send_files(files, node.port).complete

        def ended() -> Any:
            jobs = node.jobs()["jobs"]
            return jobs[0] if jobs and jobs[0]["state"] in ("done", "failed") else None

        job = wait_for(ended, 60, "the job to fail")
        assert job["state"] == "failed", job
        reason = job["reason"]
        assert f"model tissue on {server.http_url}: inference failed after 2 attempts" in reason
        assert "refused" in reason.lower(), reason
        assert node.alive()

        server.start()
        retried = node.cli("retry", str(job["id"]))
        assert retried.returncode == 0, retried.stderr
        job = wait_for(lambda: (j := ended()) and j["state"] == "done" and j, 60, "the retry")
        assert len(result_paths(node.data_dir, int(job["id"]))) == 2  # SEG and SR
    finally:
        server.stop()


# -- version-2 (trained) models ----------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_trained_model_runs_one_remote_model_per_fold(tmp_path: Path, protocol: str) -> None:
    """A version-2 manifest: ``export-triton`` writes ``bands_fold0`` and ``bands_fold1``, the
    server hosts those files, and ``segment_trained`` through the remote folds gives the
    labels of the local ONNX Runtime engine."""
    from segnode.engines.kserve_backend import KServeEngine
    from segnode.engines.ort_backend import OrtEngine
    from segnode.engines.trained import segment_trained
    from segnode.engines.triton_export import export_triton
    from tests.test_trained_runtime import geometry, phantom, write_trained

    manifest = load_manifest(write_trained(tmp_path / "bands"))
    exported = export_triton(manifest, tmp_path / "repo")
    assert [m.name for m in exported] == ["bands_fold0", "bands_fold1"]
    models = {m.name: m.folder / "1" / "model.onnx" for m in exported}
    server = KServeServer(models, tmp_path / "server.log").start()
    try:
        hu = phantom()
        where = geometry("head-first", hu.shape)
        local = OrtEngine(threads=1)
        local.load(manifest)
        want = segment_trained(local, manifest, hu, where)
        local.close()
        remote = KServeEngine(url=server.url(protocol), protocol=protocol)
        remote.load(manifest)
        assert remote.remote_models == ["bands_fold0", "bands_fold1"]
        with pytest.raises(EngineError, match="trained"):
            remote.segment(hu)
        assert np.array_equal(segment_trained(remote, manifest, hu, where), want)
        remote.close()
    finally:
        server.stop()
