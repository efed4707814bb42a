"""The ``kserve`` engine over HTTP against hostile KServe v2 servers.

Each server here is a small KServe v2 (Open Inference) HTTP server on a free loopback port,
in a thread of the test process, that answers health, readiness and metadata like a real one
and inference as the test tells it: a wrong data type, non-finite scores, labels that would
wrap in a narrowing cast, a reply trickled one byte at a time, a 10 GB body, more rows than
were sent, a lying ``binary_data_size``. The engine must refuse each with a reason and
produce no labels, in about the configured timeout, reading no more than the reply it
expects. The replies of a well-behaved server (``tests/test_kserve.py``) and what the audit
found right (status codes, retries, shapes, closed connections, TLS) are kept.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from segnode.engines.base import EngineError, create_engine
from segnode.engines.manifest import ModelManifest
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.sliding_window import sliding_window_segment
from tests.conftest import LOOPBACK, ROOT
from tests.test_web import web_certificate

TISSUE = ROOT / "engines" / "models" / "tissue" / "tissue.json"
PATCH = (2, 16, 16)
MODEL = "m"
TRICKLE_PAUSE_S = 0.1
FLOOD_CAP = 256 << 20  # the most a flooding server sends before it gives up


def _manifest(folder: Path, kind: str) -> ModelManifest:
    """A small-patch manifest: labels (6 classes, one channel, patches side by side) or
    logits (2 classes, patches overlapping along z: blended after a softmax)."""
    raw = json.loads(TISSUE.read_text())
    raw.update(
        name=MODEL,
        onnx=str(TISSUE.parent / raw["onnx"]),
        patch_size=list(PATCH),
        overlap=0.0 if kind == "labels" else [0.5, 0.0, 0.0],
        output_kind=kind,
        output_name="labels" if kind == "labels" else "logits",
    )
    if kind != "labels":
        raw["labels"] = raw["labels"][:1]
    path = folder / f"{kind}.json"
    path.write_text(json.dumps(raw))
    return load_manifest(path)


def _volume() -> npt.NDArray[np.float32]:
    """Two patches of HU, none exactly 0: label 1 where HU > 0."""
    rng = np.random.default_rng(7)
    hu = rng.uniform(-100.0, 100.0, (4, PATCH[1], PATCH[2])).astype(np.float32)
    hu[hu == 0] = 1.0
    return hu


class Hostile:
    """A KServe v2 HTTP server on a free loopback port; ``mode`` says how it answers
    inference, ``ready`` how it answers the model's readiness."""

    def __init__(
        self, manifest: ModelManifest, datatype: str, tls: ssl.SSLContext | None = None
    ) -> None:
        self.manifest = manifest
        self.datatype = datatype
        self.mode = "ok"
        self.ready = "ok"
        self.meta = "ok"
        self.requests: list[str] = []
        self.sent = 0
        self.stop = threading.Event()
        self._tls = tls
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = int(self._listener.getsockname()[1])
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"{'https' if self._tls else 'http'}://{LOOPBACK}:{self.port}"

    def infers(self) -> int:
        return sum(r.startswith("POST") for r in self.requests)

    def close(self) -> None:
        self.stop.set()
        self._listener.close()
        for conn in list(self._conns):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    # -- the wire -------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self._tls is not None:
                conn = self._tls.wrap_socket(conn, server_side=True)
            reader = conn.makefile("rb")
            while not self.stop.is_set():
                line = reader.readline()
                if not line:
                    return
                method, path, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (field := reader.readline()) not in (b"\r\n", b""):
                    key, _, value = field.decode("latin-1").partition(":")
                    headers[key.strip().lower()] = value.strip()
                body = reader.read(int(headers.get("content-length", "0")))
                self.requests.append(f"{method} {path}")
                if not self._answer(conn, method, path, headers, body):
                    return
        except (OSError, ValueError):
            return
        finally:
            conn.close()

    def _send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        self.sent += len(data)

    def _reply(
        self, conn: socket.socket, status: str, body: bytes, extra: str = "", length: int = -1
    ) -> None:
        size = len(body) if length < 0 else length
        head = f"HTTP/1.1 {status}\r\nContent-Length: {size}\r\n{extra}\r\n".encode()
        self._send(conn, head + body)

    def _json(self, conn: socket.socket, status: str, value: Any) -> None:
        self._reply(conn, status, json.dumps(value).encode(), "Content-Type: application/json\r\n")

    def _trickle(self, conn: socket.socket, data: bytes) -> None:
        for i in range(len(data)):
            if self.stop.is_set():
                return
            self._send(conn, data[i : i + 1])
            time.sleep(TRICKLE_PAUSE_S)

    def _flood(self, conn: socket.socket, head: bytes, chunked: bool = False) -> None:
        self._send(conn, head)
        block = b"\0" * (1 << 20)
        if chunked:
            block = b"%x\r\n" % len(block) + block + b"\r\n"
        while self.sent < FLOOD_CAP and not self.stop.is_set():
            self._send(conn, block)

    # -- the protocol -----------------------------------------------------------------------

    def _answer(
        self, conn: socket.socket, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> bool:
        """Answer one request; ``False`` when the connection is done."""
        m = self.manifest
        if path in ("/v2/health/live", "/v2/health/ready"):
            self._json(conn, "200 OK", {"live": True, "ready": True})
        elif path == f"/v2/models/{MODEL}/ready":
            if self.ready == "trickle":
                self._trickle(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                return False
            self._json(conn, "200 OK", {"name": MODEL, "ready": True})
        elif path == f"/v2/models/{MODEL}":
            if self.meta == "huge":
                self._flood(conn, b"HTTP/1.1 200 OK\r\nContent-Length: 10737418240\r\n\r\n")
                return False
            if self.meta == "chunked":
                self._flood(conn, b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", True)
                return False
            shape = [-1, 1, *PATCH]
            out = [-1, m.output_channels, *PATCH]
            meta = {
                "name": MODEL,
                "versions": ["1"],
                "platform": "onnxruntime_onnx",
                "inputs": [{"name": m.input_name, "datatype": "FP32", "shape": shape}],
                "outputs": [{"name": m.output_name, "datatype": self.datatype, "shape": out}],
            }
            self._json(conn, "200 OK", meta)
        elif method == "POST" and path == f"/v2/models/{MODEL}/infer":
            return self._infer(conn, headers, body)
        else:
            self._json(conn, "404 Not Found", {"error": f"no such path {path}"})
        return True

    def _output(self, x: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        """The honest answer: label 1 where the input is positive (or logits saying so)."""
        if self.manifest.output_kind == "labels":
            return (x > 0).astype(np.dtype(_NUMPY[self.datatype]))
        return np.concatenate([-x, x], axis=1).astype(np.dtype(_NUMPY[self.datatype]))

    def _infer(self, conn: socket.socket, headers: dict[str, str], body: bytes) -> bool:
        mode, m = self.mode, self.manifest
        length = int(headers.get("inference-header-content-length", len(body)))
        request = json.loads(body[:length])
        x = np.frombuffer(body[length:], np.float32).reshape(request["inputs"][0]["shape"])
        if mode == "close":
            conn.shutdown(socket.SHUT_RDWR)
            return False
        if mode in ("400", "500", "503"):
            self._json(conn, f"{mode} Hostile", {"error": f"status {mode} from a hostile server"})
            return True
        if mode == "huge_error":
            self._flood(conn, b"HTTP/1.1 500 Hostile\r\nContent-Length: 10737418240\r\n\r\n")
            return False
        y, datatype, name = self._output(x), self.datatype, m.output_name
        transforms: dict[str, tuple[str, Any]] = {
            "nan": ("FP32", lambda y: np.full(y.shape, np.nan, np.float32)),
            "inf": ("FP32", lambda y: np.full(y.shape, np.inf, np.float32)),
            "bool": ("BOOL", lambda y: y.astype(bool)),
            "int32_big": ("INT32", lambda y: y.astype(np.int32) + 256_000),
            "int32_neg": ("INT32", lambda y: y.astype(np.int32) - 256),
            "neg_fp32": ("FP32", lambda y: y.astype(np.float32) - 256.0),
            "fp64": ("FP64", lambda y: y.astype(np.float64)),
        }
        if mode in transforms:
            datatype, change = transforms[mode]
            y = change(y)
        elif mode == "wrong_shape":
            y = np.ascontiguousarray(y[..., : PATCH[1] // 2, : PATCH[2] // 2])
        elif mode == "extra_rows":
            y = np.concatenate([y, y])
        elif mode == "missing_output":
            name = "other"
        raw = np.ascontiguousarray(y).tobytes()
        shape = list(y.shape)
        if mode == "huge_shape":
            shape[-1] *= 100_000
        size = len(raw) * (4 if mode == "bin_size_lie" else 1)
        output = {"name": name, "datatype": datatype, "shape": shape}
        header = json.dumps(
            {"model_name": MODEL, "outputs": [{**output, "parameters": {"binary_data_size": size}}]}
        ).encode()
        claimed = len(header) + (1000 if mode == "header_len_lie" else 0)
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
            f"Inference-Header-Content-Length: {claimed}\r\n"
        )
        if mode == "huge_body":
            self._flood(conn, f"{head}Content-Length: {10 << 30}\r\n\r\n".encode() + header)
            return False
        if mode == "chunked":
            first = b"%x\r\n" % len(header) + header + b"\r\n"
            self._flood(conn, f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + first, True)
            return False
        whole = f"{head}Content-Length: {len(header) + len(raw)}\r\n\r\n".encode() + header + raw
        if mode == "trickle":
            self._trickle(conn, whole)
            return False
        if mode == "cl_lie":
            self._send(conn, whole.replace(b"Content-Length: ", b"Content-Length: 5"))
            conn.shutdown(socket.SHUT_RDWR)
            return False
        self._send(conn, whole)
        return True


_NUMPY = {"UINT8": "uint8", "INT32": "int32", "INT64": "int64", "FP32": "float32"}


@pytest.fixture
def labels_model(tmp_path: Path) -> ModelManifest:
    return _manifest(tmp_path, "labels")


@pytest.fixture
def logits_model(tmp_path: Path) -> ModelManifest:
    return _manifest(tmp_path, "logits")


@pytest.fixture
def hostile() -> Iterator[Any]:
    """``hostile(manifest, datatype)``: a started server, closed after the test (and after
    30 s at most, so that a client that waits for ever still ends)."""
    servers: list[tuple[Hostile, threading.Timer]] = []

    def start(manifest: ModelManifest, datatype: str, tls: ssl.SSLContext | None = None) -> Any:
        server = Hostile(manifest, datatype, tls)
        guard = threading.Timer(30.0, server.close)
        guard.daemon = True
        guard.start()
        servers.append((server, guard))
        return server

    yield start
    for server, guard in servers:
        guard.cancel()
        server.close()


def _engine(server: Hostile, **options: Any) -> Any:
    options = {"timeout_s": 5.0, "retries": 0, "backoff_s": 0.05, "batch_size": 2, **options}
    engine = create_engine("kserve", url=server.url, **options)
    engine.load(server.manifest)
    return engine


def _segment(server: Hostile, **options: Any) -> npt.NDArray[np.uint8]:
    engine = _engine(server, **options)
    try:
        return np.asarray(engine.segment(_volume()))
    finally:
        engine.close()


def test_an_honest_server_gives_the_labels(hostile: Any, labels_model: ModelManifest) -> None:
    server = hostile(labels_model, "UINT8")
    assert np.array_equal(_segment(server), (_volume() > 0).astype(np.uint8))
    assert server.infers() == 1  # two patches, one request


def test_an_honest_logits_server_gives_the_labels(
    hostile: Any, logits_model: ModelManifest
) -> None:
    server = hostile(logits_model, "FP32")
    assert np.array_equal(_segment(server), (_volume() > 0).astype(np.uint8))


# -- 1. invalid output: data type, non-finite scores, labels out of range ---------------------


@pytest.mark.parametrize(
    ("mode", "sent"),
    [
        ("nan", "FP32"),
        ("inf", "FP32"),
        ("bool", "BOOL"),
        ("int32_big", "INT32"),
        ("neg_fp32", "FP32"),
        ("fp64", "FP64"),
    ],
)
def test_an_output_of_another_datatype_than_declared_is_refused(
    hostile: Any, labels_model: ModelManifest, mode: str, sent: str
) -> None:
    server = hostile(labels_model, "UINT8")
    server.mode = mode
    with pytest.raises(EngineError) as caught:
        _segment(server)
    message = str(caught.value)
    assert f"model {MODEL} on {server.url}" in message, message
    assert sent in message and "UINT8" in message, message
    assert server.infers() == 1  # not a transient failure: no retry


@pytest.mark.parametrize("mode", ["nan", "inf"])
def test_non_finite_scores_are_refused(
    hostile: Any, logits_model: ModelManifest, mode: str
) -> None:
    server = hostile(logits_model, "FP32")
    server.mode = mode
    with pytest.raises(EngineError, match=rf"model {MODEL} on .*non-finite"):
        _segment(server)


@pytest.mark.parametrize("mode", ["int32_big", "int32_neg"])
def test_declared_wide_labels_out_of_range_are_refused_before_they_wrap(
    hostile: Any, labels_model: ModelManifest, mode: str
) -> None:
    """An INT32 label output is allowed, but 256000 + label or label - 256 must not become
    the label in a cast to uint8."""
    server = hostile(labels_model, "INT32")
    server.mode = "ok"
    assert np.array_equal(_segment(server), (_volume() > 0).astype(np.uint8))
    server.mode = mode
    with pytest.raises(EngineError, match=r"label -?\d+.*6 classes"):
        _segment(server)


def test_an_output_type_the_model_kind_cannot_have_fails_the_load(
    hostile: Any, labels_model: ModelManifest, logits_model: ModelManifest
) -> None:
    with pytest.raises(EngineError, match=r"output 'labels' is BOOL"):
        _engine(hostile(labels_model, "BOOL"))
    with pytest.raises(EngineError, match=r"output 'logits' is UINT8"):
        _engine(hostile(logits_model, "UINT8"))


@pytest.mark.parametrize("bad", [256, -256, 256_001, float("nan")])
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")
def test_the_sliding_window_checks_labels_before_narrowing_them(bad: float) -> None:
    """Any backend: a label output is checked on its own values, not after the uint8 cast
    (a local engine's NaN label still meets NumPy's cast warning on its way to the check)."""
    dtype = np.float32 if bad != bad else np.int64

    def predict(batch: npt.NDArray[np.float32]) -> npt.NDArray[Any]:
        out = np.zeros((batch.shape[0], 1, *batch.shape[2:]), dtype)
        out[0, 0, 0, 0, 0] = bad
        return out

    with pytest.raises(ValueError, match="label"):
        sliding_window_segment(
            np.zeros((4, 8, 8), np.float32),
            predict,
            patch_size=(2, 8, 8),
            overlap=0.0,
            num_classes=6,
            output_kind="labels",
        )


# -- 2. an overall deadline ---------------------------------------------------------------------


def test_a_trickled_reply_fails_at_the_deadline_and_is_retried(
    hostile: Any, labels_model: ModelManifest
) -> None:
    server = hostile(labels_model, "UINT8")
    engine = _engine(server, timeout_s=1.0, retries=1)
    server.mode = "trickle"
    start = time.monotonic()
    try:
        with pytest.raises(EngineError) as caught:
            engine.segment(_volume())
    finally:
        engine.close()
    elapsed = time.monotonic() - start
    message = str(caught.value)
    assert "after 2 attempts" in message and "no reply within 1 s" in message, message
    assert server.infers() == 2
    assert elapsed < 4.0, elapsed


def test_a_trickled_model_readiness_fails_the_load_at_the_deadline(
    hostile: Any, labels_model: ModelManifest
) -> None:
    server = hostile(labels_model, "UINT8")
    server.ready = "trickle"
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"model m not ready on .*no reply within 1 s"):
        _engine(server, timeout_s=1.0)
    assert time.monotonic() - start < 3.0


# -- 3. the size of a reply ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("huge_body", r"reply of 10737418240 bytes; .* make \d+"),
        (
            "chunked",
            r"reply goes on past its JSON header \(\d+ bytes\) and 'labels' \(1024 bytes\)",
        ),
        ("huge_error", r"HTTP 500 Hostile"),
    ],
)
def test_a_reply_larger_than_expected_is_refused_unread(
    hostile: Any, labels_model: ModelManifest, mode: str, reason: str
) -> None:
    """The reply of two 2 x 16 x 16 UINT8 patches is its JSON header and 1024 bytes: read
    the header, then those bytes and no more; an error's reason from its first 64 KiB."""
    server = hostile(labels_model, "UINT8")
    engine = _engine(server, timeout_s=10.0)
    server.mode = mode
    start = time.monotonic()
    try:
        with pytest.raises(EngineError, match=rf"^model {MODEL} on .*: {reason}"):
            engine.segment(_volume())
    finally:
        engine.close()
    assert time.monotonic() - start < 3.0
    assert server.sent < 64 << 20, server.sent  # the client stopped reading
    assert server.infers() == 1


@pytest.mark.parametrize("mode", ["huge", "chunked"])
def test_huge_metadata_is_refused_unread(
    hostile: Any, labels_model: ModelManifest, mode: str
) -> None:
    server = hostile(labels_model, "UINT8")
    server.meta = mode
    with pytest.raises(EngineError, match=rf"^model m on {server.url}: metadata: reply .*1048576"):
        _engine(server, timeout_s=10.0)
    assert server.sent < 64 << 20, server.sent


# -- 4. exact shapes and sizes ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "reason"),
    [("extra_rows", r"shape \[4, 1, 2, 16, 16\].*\[2, 1, 2, 16, 16\]"), ("bin_size_lie", "size")],
)
def test_a_reply_with_more_than_was_asked_is_refused(
    hostile: Any, labels_model: ModelManifest, mode: str, reason: str
) -> None:
    server = hostile(labels_model, "UINT8")
    server.mode = mode
    with pytest.raises(EngineError, match=rf"model {MODEL} on .*{reason}"):
        _segment(server)


# -- kept: what the audit found right -----------------------------------------------------------


@pytest.mark.parametrize(
    "mode",
    ["wrong_shape", "missing_output", "huge_shape", "header_len_lie", "cl_lie", "400", "500"],
)
def test_a_broken_reply_fails_the_job_at_once(
    hostile: Any, labels_model: ModelManifest, mode: str
) -> None:
    server = hostile(labels_model, "UINT8")
    server.mode = mode
    with pytest.raises(EngineError, match=rf"^model {MODEL} on {server.url}: "):
        _segment(server, retries=2)
    assert server.infers() == 1


@pytest.mark.parametrize("mode", ["503", "close"])
def test_a_transient_failure_is_retried_as_configured(
    hostile: Any, labels_model: ModelManifest, mode: str
) -> None:
    server = hostile(labels_model, "UINT8")
    server.mode = mode
    with pytest.raises(EngineError, match=r"inference failed after 3 attempts"):
        _segment(server, retries=2)
    assert server.infers() == 3


def test_a_model_that_is_not_ready_is_named(hostile: Any, labels_model: ModelManifest) -> None:
    server = hostile(labels_model, "UINT8")
    engine = create_engine("kserve", url=server.url, model_name="lungs", retries=0)
    with pytest.raises(EngineError, match=rf"^model lungs not ready on {server.url}$"):
        engine.load(labels_model)


def test_a_self_signed_server_is_refused(
    hostile: Any, labels_model: ModelManifest, tmp_path: Path
) -> None:
    cert, key = web_certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = hostile(labels_model, "UINT8", context)
    with pytest.raises(EngineError, match=r"is not reachable: .*CERTIFICATE_VERIFY_FAILED"):
        _engine(server)
    assert server.requests == []
