"""Shared fixtures: free loopback ports, real peer processes (segnode, Orthanc), tool checks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from scripts.harness import orthanc_config

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


def require_data(path: Path) -> Path:
    """Skip when the shared scanner data is absent."""
    if not path.is_dir():
        pytest.skip(f"shared data not present: {path}")
    return path


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


@dataclass
class NodeProcess:
    """``segnode serve`` running as a subprocess, ready when it said READY=1."""

    config_path: Path
    data_dir: Path
    port: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)

    def start(self, timeout: float = 60.0) -> None:
        """Start and wait for readiness through a real sd_notify socket."""
        sock_path = self.data_dir.parent / f"notify-{self.port}.sock"
        sock_path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(sock_path))
        sock.settimeout(timeout)
        env = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "PYTHONUNBUFFERED": "1", **self.env}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "node.cli", "serve", "--config", str(self.config_path)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            while True:
                try:
                    msg = sock.recv(4096).decode()
                except TimeoutError as exc:
                    raise AssertionError(f"node not ready; log:\n{self.log()}") from exc
                if "READY=1" in msg.split("\n"):
                    return
        finally:
            sock.close()
            sock_path.unlink(missing_ok=True)

    def log(self) -> str:
        """The node's output so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL (crash)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        """SIGTERM and wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run another ``segnode`` subcommand against the same config."""
        return subprocess.run(
            [sys.executable, "-m", "node.cli", *args, "--config", str(self.config_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def jobs(self) -> dict[str, Any]:
        """``segnode jobs --json``."""
        out = self.cli("jobs", "--json", "--limit", "100")
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))


def write_config(path: Path, data_dir: Path, port: int, **sections: dict[str, Any]) -> Path:
    """Write a TOML config for a test node."""
    lines = [f'data_dir = "{data_dir}"', 'log_level = "INFO"']
    node = {"ae_title": "SEGNODE", "host": LOOPBACK, "port": port, **sections.pop("node", {})}
    sections = {"node": node, **sections}
    for name, values in sections.items():
        lines.append(f"[{name}]")
        for k, v in values.items():
            lines.append(f"{k} = {json.dumps(v)}")
    path.write_text("\n".join(lines) + "\n")
    return path


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


def start_orthanc(base: Path, dicom_port: int | None = None) -> Orthanc:
    """Start Orthanc with a private storage folder; wait until its REST API answers."""
    exe = require_tool("Orthanc")
    base.mkdir(parents=True, exist_ok=True)
    dicom_port = dicom_port or free_port()
    http_port = free_port()
    cfg = orthanc_config(base, dicom_port, http_port)
    (base / "orthanc.json").write_text(json.dumps(cfg))
    log = (base / "orthanc.log").open("ab")
    proc = subprocess.Popen([exe, str(base / "orthanc.json")], stdout=log, stderr=subprocess.STDOUT)
    o = Orthanc(dicom_port, http_port, proc)

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
def orthanc(tmp_path: Path) -> Iterator[Orthanc]:
    """A running Orthanc."""
    o = start_orthanc(tmp_path / "orthanc")
    yield o
    o.stop()
