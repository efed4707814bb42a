"""What ``segnode serve`` and the admin commands refuse before they can do harm.

One node per data directory (a lock the kernel drops with the process), SIGHUP logged and
ignored, a data directory that cannot be made, a read-only command on a ledger that does not
exist, a busy metrics port, and settings that cannot work. Real processes of ``segnode serve``
on 127.0.0.1, as systemd would run them.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.harness import free_port, write_config
from segnode.node.config import load_config
from segnode.node.errors import ConfigError
from segnode.node.ops.service import DataDirInUse, DataDirLock
from tests.conftest import ROOT

CLI = [sys.executable, "-m", "segnode.node.ops.cli"]


def _serve(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [*CLI, "serve", "--config", str(cfg)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )


def _wait_listening(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the node did not listen within 60 s"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def test_data_dir_lock_is_exclusive_and_names_the_owner(tmp_path: Path) -> None:
    first = DataDirLock(tmp_path / "data")
    with pytest.raises(DataDirInUse, match=r"in use by another segnode process \(pid \d+\)"):
        DataDirLock(tmp_path / "data")
    first.release()
    first.release()  # idempotent
    DataDirLock(tmp_path / "data").release()  # free again


def test_a_second_node_on_the_same_data_dir_refuses_to_start_and_sighup_is_ignored(
    tmp_path: Path,
) -> None:
    """Two nodes on one data_dir would share staging files and clear each other's work at
    start-up: the second stops with the reason, and the first keeps serving. SIGHUP (a closed
    terminal, ``systemctl reload``) used to kill the node without a word."""
    port, other = free_port(), free_port()
    cfg = write_config(tmp_path / "a.toml", tmp_path / "data", port)
    log = tmp_path / "a.log"
    proc = _serve(cfg, log)
    try:
        _wait_listening(proc, port, log)
        second = _run(
            "serve", "--config", str(write_config(tmp_path / "b.toml", tmp_path / "data", other))
        )
        assert second.returncode == 1
        assert f"data_dir {tmp_path / 'data'} is in use by another segnode process" in (
            second.stderr
        )
        assert f"(pid {proc.pid})" in second.stderr
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None, "SIGHUP ended the node"
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # still listening
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert "SIGHUP ignored: segnode does not reload its configuration" in text
    assert "segnode stopped" in text
    # The lock went with the process: a node starts on the same folder again.
    again = DataDirLock(tmp_path / "data")
    again.release()


def test_a_data_dir_that_cannot_be_made_is_a_configuration_error(tmp_path: Path) -> None:
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    for data_dir, says in (
        (blocker, f"data_dir: {blocker} exists and is not a folder"),
        (blocker / "sub", f"data_dir: cannot create {blocker / 'sub'}"),
    ):
        cfg = write_config(tmp_path / "c.toml", data_dir, free_port())
        done = _run("serve", "--config", str(cfg))
        assert done.returncode == 2, done.stderr
        assert f"segnode: configuration error: {says}" in done.stderr
        assert "Traceback" not in done.stderr


def test_admin_commands_do_not_invent_an_empty_ledger(tmp_path: Path) -> None:
    """``segnode jobs`` in the wrong folder, or with a mistyped --data-dir, says so instead of
    creating a ledger there and reporting no jobs."""
    missing = tmp_path / "no-such-node"
    for command in (["jobs"], ["status"], ["cancel", "1"], ["retry", "1"]):
        done = _run(*command, "--data-dir", str(missing))
        assert done.returncode == 1, (command, done.stderr)
        assert f"no ledger at {missing / 'ledger.sqlite'}" in done.stderr
        assert "--config" in done.stderr
    assert not missing.exists()


def test_a_busy_metrics_port_is_named_as_such(tmp_path: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    metrics_port = busy.getsockname()[1]
    port = free_port()
    cfg = write_config(
        tmp_path / "m.toml",
        tmp_path / "data",
        port,
        metrics={"enabled": True, "host": "127.0.0.1", "port": metrics_port},
    )
    try:
        done = _run("serve", "--config", str(cfg))
    finally:
        busy.close()
    assert done.returncode == 1, done.stderr
    assert f"metrics.port 127.0.0.1:{metrics_port}: cannot listen" in done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" not in done.stderr
    DataDirLock(tmp_path / "data").release()  # the failed start released its lock


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[model]\nengine = "tensorflow"\n', "model.engine: must be one of"),
        (
            "[dispatch]\nretry_initial_s = 600\nretry_max_s = 10\n",
            "dispatch.retry_initial_s (600) is more than dispatch.retry_max_s (10)",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_when_loaded(
    tmp_path: Path, text: str, says: str
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_config(path)


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_ledger_deleted_or_replaced_under_the_node_stops_it(tmp_path: Path, how: str) -> None:
    """The node went on acknowledging into a deleted ledger (its open connections write to
    the unlinked file) while `segnode status` said there was none, and every series was
    processed again after the next restart. It now stops within a tick, with the reason and
    a non-zero exit, so that systemd restarts it on a ledger that exists."""
    port = free_port()
    data = tmp_path / "data"
    cfg = write_config(tmp_path / "n.toml", data, port)
    log = tmp_path / "n.log"
    proc = _serve(cfg, log)
    try:
        _wait_listening(proc, port, log)
        deadline = time.monotonic() + 60
        while "jobs start" not in log.read_text():  # started: the threads use the ledger
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.05)
        ledger = data / "ledger.sqlite"
        ledger.unlink()
        if how == "replaced":
            ledger.write_bytes(b"")
        code = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = log.read_text()
    assert code == 1, out
    assert f"the ledger {ledger} was {how}" in out and "stopping" in out, out
    assert "Traceback" not in out, out
