"""Real peers for the hardening scripts and tests: a counting Storage SCP, a node process.

* :class:`CountingSCP` - a pynetdicom Storage SCP that records every C-STORE it receives
  (SOP class, SOP Instance UID, Study Instance UID, time) and answers success, optionally
  after a delay. As a destination it shows what a PACS that deduplicates (Orthanc) hides:
  how many times each object was sent.
* :class:`NodeRunner` - ``segnode serve`` as a subprocess, ready when it sent ``READY=1`` on a
  real sd_notify socket; SIGKILL, SIGTERM, restart.
* :func:`send_files` - one association from a pynetdicom SCU; returns which SOP Instance UIDs
  were acknowledged with 0x0000.

Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import ssl
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydicom import dcmread
from pydicom.dataset import Dataset
from pynetdicom import AE, evt
from pynetdicom.sop_class import (  # type: ignore[attr-defined]
    Comprehensive3DSRStorage,
    CTImageStorage,
    SegmentationStorage,
    Verification,
)

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Receipt:
    """One C-STORE received by :class:`CountingSCP`."""

    sop_class_uid: str
    sop_instance_uid: str
    study_instance_uid: str
    calling_ae: str
    at: float


class CountingSCP:
    """A Storage SCP for SEG and SR that counts what it receives.

    Parameters
    ----------
    port
        TCP port on loopback (0: any free port).
    delay
        Seconds to wait before answering each C-STORE (a slow PACS).
    ae_title
        Our AE title.
    ssl_context
        Serve DICOM TLS with this context.
    """

    def __init__(
        self,
        port: int = 0,
        *,
        delay: float = 0.0,
        ae_title: str = "COUNTER",
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.port = port or free_port()
        self.delay = delay
        self.ae_title = ae_title
        self.ssl_context = ssl_context
        self.receipts: list[Receipt] = []
        self._lock = threading.Lock()
        self._server: Any = None

    @property
    def peer(self) -> str:
        """``AE@host:port``."""
        return f"{self.ae_title}@{LOOPBACK}:{self.port}"

    def _handle_store(self, event: evt.Event) -> int:
        ds = event.dataset
        request: Any = event.request  # a C-STORE-RQ (pynetdicom types it as any DIMSE message)
        with self._lock:
            self.receipts.append(
                Receipt(
                    str(request.AffectedSOPClassUID),
                    str(request.AffectedSOPInstanceUID),
                    str(ds.get("StudyInstanceUID", "")),
                    str(event.assoc.requestor.ae_title).strip(),
                    time.time(),
                )
            )
        if self.delay:
            time.sleep(self.delay)
        return 0x0000

    def start(self) -> CountingSCP:
        """Start listening (non-blocking); returns self."""
        ae = AE(ae_title=self.ae_title)
        for cls in (SegmentationStorage, Comprehensive3DSRStorage, CTImageStorage):
            ae.add_supported_context(cls)
        ae.add_supported_context(Verification)
        self._server = ae.start_server(
            (LOOPBACK, self.port),
            block=False,
            ssl_context=self.ssl_context,
            evt_handlers=[(evt.EVT_C_STORE, self._handle_store)],
        )
        return self

    def stop(self) -> None:
        """Stop listening."""
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    def snapshot(self) -> list[Receipt]:
        """The receipts so far."""
        with self._lock:
            return list(self.receipts)

    def counts(self) -> Counter[str]:
        """How many times each SOP Instance UID was received."""
        return Counter(r.sop_instance_uid for r in self.snapshot())


def orthanc_config(base: Path, dicom_port: int, http_port: int, **extra: Any) -> dict[str, Any]:
    """An Orthanc configuration on loopback with private storage under ``base``."""
    return {
        "Name": "segnode-test",
        "StorageDirectory": str(base / "storage"),
        "IndexDirectory": str(base / "storage"),
        "DicomAet": "ORTHANC",
        "DicomPort": dicom_port,
        "HttpPort": http_port,
        "RemoteAccessAllowed": False,
        "AuthenticationEnabled": False,
        "DicomCheckCalledAet": False,
        "DicomAlwaysAllowStore": True,
        "DicomAlwaysAllowEcho": True,
        "Plugins": [],
        "DicomModalities": {},
        "HttpBindAddress": LOOPBACK,
        "DicomBindAddress": LOOPBACK,
        **extra,
    }


def storescu_args(
    port: int, *paths: Path, calling: str = "MODALITY", exe: str = "storescu"
) -> list[str]:
    """DCMTK ``storescu`` sending ``paths`` (files or folders, scanned recursively) to the node
    on loopback ``port`` over one association."""
    return [
        exe,
        "-aet",
        calling,
        "-aec",
        "SEGNODE",
        "+sd",
        "+r",
        "-R",
        LOOPBACK,
        str(port),
        *map(str, paths),
    ]


def write_config(path: Path, data_dir: Path, port: int, **sections: dict[str, Any]) -> Path:
    """A TOML config for a node on loopback (values JSON-encoded, valid TOML for scalars)."""
    top = {"data_dir": str(data_dir), "log_level": "INFO", **sections.pop("top", {})}
    lines = [f"{k} = {json.dumps(v)}" for k, v in top.items()]
    # A small staging pool and slab warm-up: every node start writes them.
    node = {
        "ae_title": "SEGNODE",
        "host": LOOPBACK,
        "port": port,
        "staging_pool_mb": 8,
        **sections.pop("node", {}),
    }
    sections["streaming"] = {"warm_mb": 64, **sections.get("streaming", {})}
    for name, values in {"node": node, **sections}.items():
        lines.append(f"[{name}]")
        for k, v in values.items():
            lines.append(f"{k} = {json.dumps(v)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def query_ledger(
    data_dir: Path,
    select: str,
    table: str,
    *,
    series_uid: str | None = None,
    where: str = "",
    args: tuple[object, ...] = (),
    tail: str = "",
) -> list[sqlite3.Row]:
    """Rows of ``SELECT select FROM table`` from the ledger of the node whose data folder is
    ``data_dir``, opened read-only (no CLI process); none while there is no ledger file yet.

    ``series_uid`` keeps the rows of that series (``table`` has a ``series_id``); ``where``
    (with ``args``) is another condition; ``tail`` (``ORDER BY``, ``LIMIT``) ends the query.
    """
    db = data_dir / "ledger.sqlite"
    if not db.exists():
        return []
    sql, conditions, params = f"SELECT {select} FROM {table}", [where] if where else [], [*args]
    if series_uid is not None:
        sql += f" JOIN series ON series.id = {table}.series_id"
        conditions.append("series.series_instance_uid = ?")
        params.append(series_uid)
    if conditions:
        sql += " WHERE " + " AND ".join(conditions)
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)) as c:
        c.row_factory = sqlite3.Row
        return c.execute(f"{sql} {tail}", params).fetchall()


@dataclass
class NodeRunner:
    """``segnode serve`` as a subprocess."""

    config_path: Path
    data_dir: Path
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    notify_lines: list[str] = field(default_factory=list)

    def start(self, timeout: float = 60.0) -> float:
        """Start and wait for ``READY=1``; return the seconds it took."""
        t0 = time.monotonic()
        sock_path = self.config_path.parent / f"notify-{self.port}.sock"
        sock_path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(sock_path))
        sock.settimeout(0.25)
        deadline = t0 + timeout
        env = {**os.environ, "NOTIFY_SOCKET": str(sock_path), "PYTHONUNBUFFERED": "1"}
        env.pop("WATCHDOG_USEC", None)
        env.update(self.env)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "segnode.node.ops.cli",
                    "serve",
                    "--config",
                    str(self.config_path),
                ],
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
                    code = self.proc.poll()
                    if code is not None:  # it will not become ready: say so now
                        self.proc = None
                        raise RuntimeError(
                            f"node exited with code {code}; log tail:\n{self.log()[-3000:]}"
                        ) from exc
                    if time.monotonic() < deadline:
                        continue
                    raise RuntimeError(f"node not ready; log tail:\n{self.log()[-3000:]}") from exc
                self.notify_lines.extend(msg.split("\n"))
                if "READY=1" in msg.split("\n"):
                    return time.monotonic() - t0
        finally:
            sock.close()
            sock_path.unlink(missing_ok=True)

    @property
    def pid(self) -> int | None:
        """The process id, while running."""
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        """Whether the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash) and reap."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.proc = None

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM and wait; return the exit code."""
        if self.proc is None:
            return None
        code: int | None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait(10)
        else:
            code = self.proc.returncode
        self.proc = None
        return code

    def log(self) -> str:
        """The node's output so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run another ``segnode`` subcommand against the same config."""
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "segnode.node.ops.cli",
                *args,
                "--config",
                str(self.config_path),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )


@dataclass
class SendResult:
    """What one association delivered."""

    acknowledged: list[str]
    statuses: dict[str, int]
    established: bool
    released: bool
    error: str | None = None

    @property
    def complete(self) -> bool:
        """Every instance acknowledged with 0x0000 and the association released normally."""
        return self.released and all(v == 0 for v in self.statuses.values())


def send_files(
    files: list[Path] | list[Dataset],
    port: int,
    *,
    calling: str = "MODALITY",
    called: str = "SEGNODE",
    timeout: float = 30.0,
    tls_args: tuple[ssl.SSLContext, str] | None = None,
) -> SendResult:
    """Send ``files`` (paths or datasets) over one association; never raises."""
    datasets = [f if isinstance(f, Dataset) else dcmread(f) for f in files]
    ae = AE(ae_title=calling)
    ae.acse_timeout = ae.dimse_timeout = ae.network_timeout = timeout
    for ts in sorted({str(ds.file_meta.TransferSyntaxUID) for ds in datasets}):
        ae.add_requested_context(CTImageStorage, ts)
    statuses: dict[str, int] = {}
    acked: list[str] = []
    try:
        assoc = ae.associate(LOOPBACK, port, ae_title=called, tls_args=tls_args)
    except Exception as exc:  # connection refused and friends
        return SendResult([], {}, False, False, f"{type(exc).__name__}: {exc}")
    if not assoc.is_established:
        return SendResult([], {}, False, False, "association not established")
    error = None
    try:
        for ds in datasets:
            uid = str(ds.SOPInstanceUID)
            try:
                st = assoc.send_c_store(ds)
                code = int(st.Status) if st and "Status" in st else -1
            except Exception as exc:  # the peer died mid-transfer
                code, error = -1, f"{type(exc).__name__}: {exc}"
            statuses[uid] = code
            if code == 0:
                acked.append(uid)
            if not assoc.is_established:
                break
    finally:
        released = False
        if assoc.is_established:
            assoc.release()
            released = assoc.is_released
    for ds in datasets:  # not sent at all
        statuses.setdefault(str(ds.SOPInstanceUID), -2)
    return SendResult(acked, statuses, True, released, error)


def peak_rss_mb(pid: int) -> float:
    """Peak resident set size (VmHWM) of a running process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")
