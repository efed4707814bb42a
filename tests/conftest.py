"""Shared fixtures: free loopback ports, real peer processes (segnode, Orthanc), tool checks."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from scripts.harness import NodeRunner, orthanc_config, write_config

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"
PHANTOM = SHARED_DATA / "ct-phantom-philips-28"
LIVER = SHARED_DATA / "ct-liver-3slice"
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def require_tool(name: str) -> str:
    """Path of an external tool; skip when absent unless SEGNODE_REQUIRE_TOOLS is set (CI)."""
    path = shutil.which(name)
    if path is None:
        msg = f"{name} not installed (apt-get install dcmtk orthanc dicom3tools)"
        if os.environ.get("SEGNODE_REQUIRE_TOOLS"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Any]:
    """A throwaway PostgreSQL cluster on loopback for the whole session
    (tests/fixtures/postgres.py); skipped without Debian's ``postgresql`` and psycopg, unless
    SEGNODE_REQUIRE_TOOLS is set."""
    from tests.fixtures.postgres import PostgresCluster, postgres_bin

    bindir = postgres_bin()
    missing = None
    if bindir is None:
        missing = "PostgreSQL not installed (apt-get install postgresql)"
    elif importlib.util.find_spec("psycopg") is None:
        missing = "psycopg not installed (pip install -e '.[postgres]')"
    if missing is not None:
        if os.environ.get("SEGNODE_REQUIRE_TOOLS"):
            pytest.fail(missing)
        pytest.skip(missing)
    assert bindir is not None
    cluster = PostgresCluster(bindir)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def rsyslog(tmp_path: Path) -> Iterator[Any]:
    """Debian's ``rsyslogd`` receiving syslog over TLS on a loopback port, with a test PKI in
    ``tmp_path / "pki"`` (tests/fixtures/rsyslog.py); skipped without rsyslog and its TLS
    driver, unless SEGNODE_REQUIRE_TOOLS is set."""
    from tests.fixtures.rsyslog import Rsyslog, make_pki, require_rsyslog_tls

    require_rsyslog_tls()
    make_pki(tmp_path / "pki")
    server = Rsyslog(tmp_path, tmp_path / "pki")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def shared_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The files shared with child processes (``/dev/shm``) in a folder of the test's own,
    to count leftovers (``SEGNODE_SHARED_DIR``)."""
    folder = tmp_path / "shm"
    folder.mkdir()
    monkeypatch.setenv("SEGNODE_SHARED_DIR", str(folder))
    return folder


@pytest.fixture
def pg_url(postgres_cluster: Any) -> str:
    """The URL of a new, empty PostgreSQL database on the session's cluster."""
    return str(postgres_cluster.database())


def require_data(path: Path) -> Path:
    """Skip when the shared scanner data is absent."""
    if not path.is_dir():
        pytest.skip(f"shared data not present: {path}")
    return path


def nnunet_mark(*modules: str) -> pytest.MarkDecorator:
    """A ``skipif`` mark for the tests against nnU-Net's own code: they skip when ``nnunetv2``
    is not installed or one of ``modules`` does not import (the golden-file tests cover it)."""
    missing: str | None = None
    if importlib.util.find_spec("nnunetv2") is None:
        missing = "nnunetv2 is not installed"
    else:
        try:
            for module in modules:
                importlib.import_module(module)
        except Exception as exc:  # any import failure of the optional oracle means "skip"
            missing = f"nnunetv2 is installed but does not import: {exc!r}"
    return pytest.mark.skipif(
        missing is not None,
        reason=f"{missing} (pip install -e .[nnunet]); the golden-file tests cover it",
    )


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns a truthy value (for peers we do not control)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class NodeProcess(NodeRunner):
    """``segnode serve`` running as a subprocess, ready when it said READY=1 through a real
    sd_notify socket (:class:`scripts.harness.NodeRunner`, shared with the bench and the
    crash harness), plus the tests' view of its ledger."""

    def jobs(self) -> dict[str, Any]:
        """``segnode jobs --json``."""
        out = self.cli("jobs", "--json", "--limit", "100")
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))


def wait_for_the_job(node: Any, timeout: float, what: str) -> dict[str, Any]:
    """The node's one job once it has ended; the test fails unless it is ``done``."""

    def finished() -> Any:
        jobs = node.jobs()["jobs"]
        return jobs if jobs and jobs[0]["state"] in ("done", "failed") else None

    [job] = wait_for(finished, timeout, what)
    assert job["state"] == "done", job
    return dict(job)


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Any]:
    """Factory: ``make_node(**sections) -> NodeProcess`` (started); all stopped at teardown."""
    nodes: list[NodeProcess] = []

    def factory(start: bool = True, **sections: dict[str, Any]) -> NodeProcess:
        port = free_port()
        base = tmp_path / f"node{len(nodes)}"
        base.mkdir()
        data = base / "data"
        cfg = write_config(base / "config.toml", data, port, **sections)
        node = NodeProcess(cfg, data, port, base / "node.log")
        nodes.append(node)
        if start:
            node.start()
        return node

    yield factory
    for n in nodes:
        n.stop()
        print(f"--- node log {n.log_path} ---\n{n.log()[-20000:]}")  # shown on failure


@dataclass
class Orthanc:
    """An Orthanc PACS on loopback, started by the test."""

    dicom_port: int
    http_port: int
    proc: subprocess.Popen[bytes]
    aet: str = "ORTHANC"

    @property
    def peer(self) -> str:
        """``AE@host:port``."""
        return f"{self.aet}@{LOOPBACK}:{self.dicom_port}"

    def get(self, path: str) -> Any:
        """GET a REST resource as JSON."""
        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.http_port}{path}", timeout=10) as r:
            return json.loads(r.read())

    def get_bytes(self, path: str) -> bytes:
        """GET raw bytes."""
        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.http_port}{path}", timeout=30) as r:
            return bytes(r.read())

    def instances_by_modality(self) -> dict[str, list[str]]:
        """Instance ids grouped by the series' Modality."""
        out: dict[str, list[str]] = {}
        for sid in self.get("/series"):
            s = self.get(f"/series/{sid}")
            out.setdefault(s["MainDicomTags"].get("Modality", ""), []).extend(s["Instances"])
        return out

    def stop(self) -> None:
        """Terminate."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


OrthancT = TypeVar("OrthancT", bound=Orthanc)


def start_orthanc(base: Path, dicom_port: int | None = None, **extra: Any) -> Orthanc:
    """Start Orthanc with a private storage folder; wait until its REST API answers.
    ``extra``: more configuration options (Lua scripts, modalities, ...)."""
    return launch_orthanc(base, Orthanc, dicom_port, **extra)


def launch_orthanc(
    base: Path,
    peer: Callable[[int, int, subprocess.Popen[bytes]], OrthancT],
    dicom_port: int | None = None,
    **extra: Any,
) -> OrthancT:
    """:func:`start_orthanc` with the handle ``peer(dicom_port, http_port, process)`` (an
    :class:`Orthanc` or a subclass), which also answers the readiness check."""
    exe = require_tool("Orthanc")
    base.mkdir(parents=True, exist_ok=True)
    dicom_port = dicom_port or free_port()
    http_port = free_port()
    cfg = orthanc_config(base, dicom_port, http_port, **extra)
    (base / "orthanc.json").write_text(json.dumps(cfg))
    log = (base / "orthanc.log").open("ab")
    proc = subprocess.Popen([exe, str(base / "orthanc.json")], stdout=log, stderr=subprocess.STDOUT)
    o = peer(dicom_port, http_port, proc)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError((base / "orthanc.log").read_text(errors="replace")[-3000:])
        try:
            o.get("/system")
            return True
        except OSError:
            return False

    wait_for(ready, 60, "Orthanc REST API")
    return o


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Any]:
    """A :class:`~segnode.storage.ledger.Ledger` on a SQLite file in ``tmp_path``, closed
    after the test (a test module's own ``ledger`` fixture takes precedence)."""
    from segnode.storage.ledger import Ledger

    led = Ledger(tmp_path / "ledger.sqlite")
    yield led
    led.close()


@pytest.fixture
def orthanc(tmp_path: Path) -> Iterator[Orthanc]:
    """A running Orthanc."""
    o = start_orthanc(tmp_path / "orthanc")
    yield o
    o.stop()


@pytest.fixture
def asm() -> Iterator[Any]:
    """A started :class:`~segnode.node.ingest.streaming.StreamingAssembler` (2 decode
    workers, 256 MiB), stopped after the test."""
    from segnode.node.ingest.streaming import StreamingAssembler

    a = StreamingAssembler(workers=2, max_bytes=256 * 2**20)
    a.start()
    yield a
    a.stop()
