"""``[model] load``: the node listens while its engine loads in the background; jobs wait for
it; a failed load stops the node with the reason and keeps what was received."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from pynetdicom import AE
from pynetdicom.sop_class import CTImageStorage  # type: ignore[attr-defined]

from scripts.harness import write_config
from segnode.engines.base import EngineError, register_backend
from segnode.engines.manifest import ModelManifest
from segnode.engines.ort_backend import OrtEngine
from segnode.node.config import load_config
from segnode.node.errors import ConfigError, SegnodeError
from segnode.node.ops.service import Node
from tests.conftest import free_port, wait_for
from tests.fixtures.synthetic import PhantomGeometry, synthetic_datasets


class GatedEngine:
    """ONNX Runtime whose ``load`` waits for the test's gate, then loads or fails."""

    name = "gated-test"
    gate = threading.Event()
    failure: str | None = None
    loads = 0

    def __init__(self) -> None:
        self.inner = OrtEngine(threads=1)

    def load(self, manifest: ModelManifest) -> None:
        type(self).loads += 1
        assert type(self).gate.wait(30), "the test never opened the gate"
        if type(self).failure is not None:
            raise EngineError(type(self).failure)
        self.inner.load(manifest)

    def segment(self, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        return self.inner.segment(hu)

    def close(self) -> None:
        self.inner.close()


register_backend("gated-test", GatedEngine)


@pytest.fixture(autouse=True)
def closed_gate() -> Iterator[None]:
    GatedEngine.gate.clear()
    GatedEngine.failure = None
    GatedEngine.loads = 0
    yield
    GatedEngine.gate.set()  # never leave a loader thread waiting


def node_config(tmp_path: Path, load: str | None = None) -> Any:
    model: dict[str, Any] = {"engine": "gated-test"}
    if load is not None:
        model["load"] = load
    path = write_config(
        tmp_path / "config.toml",
        tmp_path / "data",
        free_port(),
        model=model,
        series={"quiet_period_s": 60},
    )
    return load_config(path)


def send_series(port: int, slices: int = 4) -> list[int]:
    """C-STORE a small synthetic CT series on one association; the response statuses."""
    ae = AE(ae_title="MODALITY")
    ae.add_requested_context(CTImageStorage)
    assoc = ae.associate("127.0.0.1", port, ae_title="SEGNODE")
    assert assoc.is_established
    try:
        return [
            int(assoc.send_c_store(ds).Status)
            for ds in synthetic_datasets(
                PhantomGeometry(rows=64, columns=64, slices=slices), seed=3
            )
        ]
    finally:
        assoc.release()


def run(node: Node) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def main() -> None:
        try:
            node.run_forever()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread, errors


def test_node_listens_and_queues_while_the_engine_loads(tmp_path: Path) -> None:
    node = Node(node_config(tmp_path))
    node.start()
    thread, errors = run(node)
    try:
        # Listening, the engine still loading: the series is received and acknowledged.
        assert send_series(node.scp.port) == [0x0000] * 4
        wait_for(lambda: node.ledger.counts()["jobs"].get("queued"), 10, "job queued")
        assert "engine loading" in node.status_line()
        threading.Event().wait(0.5)  # the worker does not take the job meanwhile
        assert node.ledger.counts()["jobs"] == {"queued": 1}
        GatedEngine.gate.set()
        wait_for(lambda: node.ledger.counts()["jobs"].get("done"), 30, "job done")
        assert "engine loading" not in node.status_line()
    finally:
        node.request_stop()
        thread.join(30)
    assert not errors and GatedEngine.loads == 1


def test_failed_load_stops_the_node_with_the_reason_and_keeps_the_series(
    tmp_path: Path,
) -> None:
    node = Node(node_config(tmp_path))
    node.start()
    thread, errors = run(node)
    assert send_series(node.scp.port) == [0x0000] * 4
    wait_for(lambda: node.ledger.counts()["jobs"].get("queued"), 10, "job queued")
    GatedEngine.failure = "no CUDA GPU here"
    GatedEngine.gate.set()
    thread.join(30)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], SegnodeError)
    assert "no CUDA GPU here" in str(errors[0]) and "gated-test" in str(errors[0])
    # What was acknowledged is still there for the next start.
    config = node_config(tmp_path)
    GatedEngine.failure = None
    again = Node(config)
    try:
        assert again.ledger.counts()["jobs"] == {"queued": 1}
        assert again.ledger.counts()["instances"] == 4
    finally:
        again.ledger.close()


def test_load_before_listening(tmp_path: Path) -> None:
    config = node_config(tmp_path, load="before")
    GatedEngine.gate.set()
    node = Node(config)  # loads here, before start() listens
    assert GatedEngine.loads == 1 and not node.engine_loading
    node.ledger.close()


def test_load_mode_is_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.load"):
        node_config(tmp_path, load="lazy")


def test_an_engine_that_loads_at_once_reports_its_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader starts once the node listens: its status line (which names the port)
    works even when the engine is ready immediately (no exception in the loader thread)."""
    crashed: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: crashed.append(args.exc_value))
    GatedEngine.gate.set()
    node = Node(node_config(tmp_path))
    node.start()
    try:
        wait_for(lambda: node.worker.engine_ready.is_set(), 10, "engine ready")
        assert node._loader is not None
        node._loader.join(10)
        assert crashed == []
        assert not node.engine_loading and "engine loading" not in node.status_line()
    finally:
        node.request_stop()
        node.shutdown()
