"""systemd integration: the unit file, its hardening score, and the sd_notify protocol.

``systemd-analyze`` works here without a running systemd (``verify`` and ``security
--offline=true`` only read files); the tests skip where it is not installed. The notify test
runs ``segnode serve`` against a real AF_UNIX datagram socket, as systemd would.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from scripts.harness import free_port, write_config
from tests.conftest import ROOT

UNIT = ROOT / "systemd" / "segnode.service"


def systemd_analyze() -> str:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze not installed (apt-get install systemd)")
    return exe


def test_unit_verifies(tmp_path: Path) -> None:
    exe = systemd_analyze()
    # verify checks that ExecStart's program exists: point it at this checkout's interpreter.
    text = UNIT.read_text()
    assert "ExecStart=/opt/segnode/.venv/bin/segnode serve" in text
    unit = tmp_path / "segnode.service"
    unit.write_text(
        text.replace(
            "ExecStart=/opt/segnode/.venv/bin/segnode",
            f"ExecStart={sys.executable} -m segnode.node.ops.cli",
        )
    )
    out = subprocess.run([exe, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "segnode.service" not in out.stdout + out.stderr, out.stdout + out.stderr


def test_unit_security_exposure_at_most_2(tmp_path: Path) -> None:
    exe = systemd_analyze()
    out = subprocess.run(
        [exe, "security", "--offline=true", "--no-pager", str(UNIT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    m = re.search(r"Overall exposure level for segnode\.service: (\d+\.\d+)", out.stdout)
    if m is None:
        pytest.skip(f"systemd-analyze security --offline unsupported here: {out.stderr[-300:]}")
    print(f"systemd-analyze security: {m.group(1)}")
    assert float(m.group(1)) <= 2.0


def test_unit_settings() -> None:
    text = UNIT.read_text()
    for line in (
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=",
        "KillSignal=SIGTERM",
        "StateDirectory=segnode",
        "StateDirectoryMode=0700",
        "UMask=0077",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "PrivateTmp=yes",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
        "SystemCallFilter=@system-service",
        "--config /etc/segnode/config.toml",
    ):
        assert line in text, line
    sysusers = (ROOT / "systemd" / "segnode.sysusers").read_text()
    assert re.search(r"^u segnode ", sysusers, re.M)
    from segnode.node.config import load_config

    cfg = load_config(ROOT / "systemd" / "config.toml")
    assert str(cfg.data_dir) == "/var/lib/segnode"


def test_sd_notify_ready_status_watchdog_stopping(tmp_path: Path) -> None:
    """READY=1 after listening, STATUS=, WATCHDOG=1 at WATCHDOG_USEC/2, STOPPING=1 on SIGTERM."""
    sock_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.2)
    port = free_port()
    cfg = write_config(tmp_path / "config.toml", tmp_path / "data", port)
    messages: list[tuple[float, str]] = []
    done = threading.Event()

    def listen() -> None:
        while not done.is_set():
            try:
                data = sock.recv(4096).decode()
            except TimeoutError:
                continue
            messages.extend((time.monotonic(), line) for line in data.split("\n"))

    reader = threading.Thread(target=listen, daemon=True)
    reader.start()
    env = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "400000"}
    env.pop("WATCHDOG_PID", None)
    log = (tmp_path / "node.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "segnode.node.ops.cli", "serve", "--config", str(cfg)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not any(m == "READY=1" for _, m in messages):
            assert proc.poll() is None and time.monotonic() < deadline, "no READY=1"
            time.sleep(0.02)
        # Listening when READY=1 arrives.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        time.sleep(1.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        done.set()
        reader.join(2)
        sock.close()
        log.close()
    lines = [m for _, m in messages]
    ready = lines.index("READY=1")
    assert any(m.startswith("STATUS=listening on 127.0.0.1:") for m in lines)
    pings = [t for t, m in messages if m == "WATCHDOG=1"]
    assert len(pings) >= 5, lines  # every 0.1 s (a quarter of WATCHDOG_USEC) for 1.5 s
    gaps = [b - a for a, b in zip(pings, pings[1:], strict=False)]
    assert max(gaps) < 0.4  # always within WATCHDOG_USEC
    assert lines[-1] == "STOPPING=1" and lines.index("STOPPING=1") > ready
    assert "READY=1" not in lines[ready + 1 :]
