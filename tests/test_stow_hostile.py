"""The STOW-RS client (:mod:`segnode.node.outbox.stow`) against hostile HTTP servers on loopback.

Each server is a plain socket listener on an ephemeral port of 127.0.0.1 whose connections are
handed to a handler function in a thread of the test, so it can answer what no well-behaved
server would: redirects to another origin, endless or gigabyte bodies, a response trickled a
byte at a time, JSON nested 200,000 deep, a 200 naming another instance or an HTML login page,
a TLS handshake that never comes, a reset after the whole request arrived. :func:`store` must
end within its timeout, keep its memory small, and only ever return a ``StowResult`` or raise
``StowFailed`` (an attempt used) or ``StowUnreachable`` (no attempt; the destination backs
off); the bearer token never leaves for another origin and never appears in a reason.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from segnode.node.outbox.stow import (
    StowError,
    StowFailed,
    StowResult,
    StowTarget,
    StowUnreachable,
    store,
)
from tests.conftest import LOOPBACK
from tests.test_web import web_certificate

MiB = 1 << 20
TOKEN = "SECRET-TOKEN-abc123"
UID = "1.2.826.0.1.3680043.8.498.1234567890"
#: Stands in for the PS3.10 file: store() sends the bytes as they are.
DATA = b"\0" * 128 + b"DICM" + os.urandom(4096)
#: The most a call may take beyond its timeout (thread start, a loaded 2-core machine).
MARGIN_S = 1.5
#: The most a call may grow the process's resident memory by.
RSS_LIMIT = 100 * MiB


# -- hostile servers ---------------------------------------------------------------------------


class Conn:
    """One accepted connection, as a handler sees it."""

    def __init__(self, sock: socket.socket, server: HostileServer) -> None:
        self.sock = sock
        self.server = server

    @property
    def stopping(self) -> bool:
        return self.server.stop.is_set()

    def wait(self, seconds: float) -> None:
        self.server.stop.wait(seconds)

    def request(self) -> bytes:
        """Read one request (head and Content-Length body); record and return its head."""
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed before the request's head")
            buf += data
        head, _, body = buf.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            data = self.sock.recv(MiB)
            if not data:
                break
            body += data
        self.server.heads.append(head)
        return head

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def answer(
        self, status: str, body: bytes = b"", ctype: str = "application/dicom+json", extra: str = ""
    ) -> None:
        """Read the request, then send one complete response."""
        self.request()
        self.send(
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n".encode()
            + body
        )


Handler = Callable[[Conn], None]


class HostileServer:
    """A listener on an ephemeral loopback port; each connection goes to ``handler``."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.stop = threading.Event()
        self.accepted = 0
        self.heads: list[bytes] = []
        self.listener = socket.create_server((LOOPBACK, 0))
        self.listener.settimeout(0.05)
        self.port = int(self.listener.getsockname()[1])
        self.threads: list[threading.Thread] = []
        self.accepting = threading.Thread(target=self._accept, daemon=True)
        self.accepting.start()

    def url(self, path: str = "/dicom-web") -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{LOOPBACK}:{self.port}{path}"

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        sock.settimeout(10)
        try:
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True)
            self.handler(Conn(sock, self))
        except OSError:
            pass  # the client gave up or refused the handshake: what these tests want
        finally:
            sock.close()

    def close(self) -> None:
        self.stop.set()
        self.accepting.join(5)
        self.listener.close()
        for thread in self.threads:
            thread.join(15)


@pytest.fixture
def serve() -> Iterator[Callable[..., HostileServer]]:
    """Start hostile servers; all are stopped (and their threads joined) after the test."""
    servers: list[HostileServer] = []

    def start(handler: Handler, tls: ssl.SSLContext | None = None) -> HostileServer:
        server = HostileServer(handler, tls)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def token_target(url: str, tmp_path: Path, **options: Any) -> StowTarget:
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    return StowTarget(url=url, token_file=token, **options)


def rss() -> int:
    """Resident memory of this process, in bytes."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def call(
    target: StowTarget, timeout: float, uid: str = UID
) -> tuple[StowResult | BaseException, float, int]:
    """``store()`` once: its result or exception, its seconds, and how much RSS grew at peak."""
    base = rss()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.monotonic()
    outcome: StowResult | BaseException
    try:
        outcome = store(target, DATA, uid, timeout)
    except BaseException as exc:  # what escapes is what these tests look at
        outcome = exc
    elapsed = time.monotonic() - t0
    done.set()
    sampler.join()
    return outcome, elapsed, max(peak[0], rss()) - base


def failed(outcome: object, kind: type[StowError] = StowFailed) -> StowError:
    """``outcome`` as the StowError ``kind`` it must be (with no token in its reason)."""
    assert type(outcome) is kind, f"expected {kind.__name__}, got {outcome!r}"
    assert isinstance(outcome, StowError)
    assert TOKEN not in str(outcome)
    return outcome


def dataset(tag: str, uid: str) -> bytes:
    """A STOW-RS response body whose sequence ``tag`` names ``uid``."""
    item = {
        "00081150": {"vr": "UI", "Value": ["1.2.840.10008.5.1.4.1.1.66.4"]},
        "00081155": {"vr": "UI", "Value": [uid]},
    }
    return json.dumps({tag: {"vr": "SQ", "Value": [item]}}).encode()


# -- 1. redirects ------------------------------------------------------------------------------


REDIRECTS = ["301 Moved Permanently", "302 Found", "303 See Other", "307 Temporary Redirect",
             "308 Permanent Redirect"]  # fmt: skip


@pytest.mark.parametrize("status", REDIRECTS)
def test_redirect_is_not_followed(
    serve: Callable[..., HostileServer], tmp_path: Path, status: str
) -> None:
    """A 3xx is a failed delivery naming the Location; nothing (and no token) reaches it."""
    elsewhere = serve(lambda c: c.answer("200 OK", b"{}"))
    location = elsewhere.url("/elsewhere/studies")
    server = serve(lambda c: c.answer(status, extra=f"Location: {location}\r\n"))
    outcome, _, _ = call(token_target(server.url(), tmp_path), 5)
    error = failed(outcome)
    code = int(status[:3])
    assert error.status == code
    assert f"HTTP {code} redirect to {location}" in str(error)
    assert "not followed" in str(error)
    assert elsewhere.accepted == 0 and elsewhere.heads == []
    assert len(server.heads) == 1 and f"Bearer {TOKEN}".encode() in server.heads[0]


def test_bad_location_is_a_failure(serve: Callable[..., HostileServer], tmp_path: Path) -> None:
    """A Location that is no URL at all (urllib raised ValueError) fails the delivery."""
    server = serve(lambda c: c.answer("302 Found", extra="Location: http://[::1/x\r\n"))
    outcome, _, _ = call(token_target(server.url(), tmp_path), 5)
    error = failed(outcome)
    assert error.status == 302 and "http://[::1/x" in str(error)


# -- 2. response bodies are read up to a cap ---------------------------------------------------


def flood(head: bytes, chunked: bool = False, total: int = 400 * MiB) -> Handler:
    """Send ``head``, then ``total`` bytes of spaces as fast as the client takes them."""

    def handler(conn: Conn) -> None:
        conn.request()
        conn.send(head)
        block = b" " * MiB
        if chunked:
            block = b"%x\r\n" % len(block) + block + b"\r\n"
        sent = 0
        while sent < total and not conn.stopping:
            conn.send(block)
            sent += MiB

    return handler


HUGE = b"Content-Type: application/dicom+json\r\nContent-Length: 10737418240\r\n\r\n"


@pytest.mark.parametrize(
    ("head", "chunked", "status"),
    [
        (b"HTTP/1.1 200 OK\r\n" + HUGE, False, 200),
        (b"HTTP/1.1 200 OK\r\nContent-Type: application/dicom+json\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n", True, 200),
        (b"HTTP/1.1 200 OK\r\nContent-Type: application/dicom+json\r\nConnection: close\r\n\r\n",
         False, 200),
        (b"HTTP/1.1 500 Internal Server Error\r\n" + HUGE, False, 500),
    ],
    ids=["10GB-content-length", "endless-chunked", "close-delimited", "500-10GB"],
)  # fmt: skip
def test_response_body_is_capped(
    serve: Callable[..., HostileServer], tmp_path: Path, head: bytes, chunked: bool, status: int
) -> None:
    """An endless body is read to a small cap: the call fails at once, memory stays small."""
    server = serve(flood(head, chunked))
    outcome, elapsed, grown = call(token_target(server.url(), tmp_path), 5)
    error = failed(outcome)
    assert error.status == status
    if status == 200:
        assert "response body over" in str(error)
    assert grown < RSS_LIMIT, f"RSS grew by {grown / MiB:.0f} MiB"
    assert elapsed < 3.0


# -- 3. one deadline for the whole request -----------------------------------------------------


def trickle(head: bytes, body: bytes = b"", interval: float = 0.1, for_s: float = 8.0) -> Handler:
    """Read the request, send ``head`` at once, then ``body`` a byte per ``interval``."""

    def handler(conn: Conn) -> None:
        conn.request()
        conn.send(head)
        end = time.monotonic() + for_s
        for byte in body:
            if conn.stopping or time.monotonic() > end:
                return
            conn.send(bytes([byte]))
            conn.wait(interval)

    return handler


@pytest.mark.parametrize(
    "handler",
    [
        trickle(b"", b"HTTP/1.1 200 OK\r\nContent-Type: application/dicom+json\r\n"
                     b"Content-Length: 2\r\n\r\n{}"),
        trickle(b"HTTP/1.1 200 OK\r\nContent-Type: application/dicom+json\r\n"
                b"Content-Length: 100000\r\n\r\n", b" " * 100000),
        trickle(b"HTTP/1.1 200 OK\r\nContent-Type: application/dicom+json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n", b"1\r\n \r\n" * 10000),
        trickle(b"", b"HTTP/1.1 100 Continue\r\n\r\n" * 1000),
    ],
    ids=["head", "body", "chunks", "100-continue"],
)  # fmt: skip
def test_trickled_response_ends_at_the_deadline(
    serve: Callable[..., HostileServer], tmp_path: Path, handler: Handler
) -> None:
    """A response trickled a byte at a time (each read well within the timeout) still ends
    the call at its timeout, as a failed attempt: the request was sent."""
    server = serve(handler)
    outcome, elapsed, _ = call(token_target(server.url(), tmp_path), 1.0)
    error = failed(outcome)
    assert "no response within 1 s" in str(error)
    assert elapsed < 1.0 + MARGIN_S


# -- 4. nothing but StowResult, StowFailed and StowUnreachable ---------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [("200 OK", StowFailed), ("202 Accepted", StowFailed), ("409 Conflict", StowFailed),
     ("400 Bad Request", StowFailed), ("503 Service Unavailable", StowUnreachable)],
)  # fmt: skip
def test_deep_json_is_a_stow_error(
    serve: Callable[..., HostileServer], tmp_path: Path, status: str, kind: type[StowError]
) -> None:
    """JSON nested 200,000 deep (json.loads raised RecursionError) is a failure of its status."""
    server = serve(lambda c: c.answer(status, b"[" * 200000))
    outcome, elapsed, _ = call(token_target(server.url(), tmp_path), 5)
    error = failed(outcome, kind)
    assert error.status == int(status[:3])
    assert elapsed < 3.0


@pytest.mark.parametrize(
    "body",
    [b'{"00081199": ' * 100 + b"{}" + b"}" * 100, b"\xff\xfe\x00garbage",
     b"[" + b"9" * 5000 + b"]", b'{"00081199": {"vr": "SQ", "Value": "x"}, "00081198": 7}'],
    ids=["deep-objects", "not-utf8", "huge-int", "wrong-shapes"],
)  # fmt: skip
def test_odd_json_bodies_never_escape(
    serve: Callable[..., HostileServer], tmp_path: Path, body: bytes
) -> None:
    """Bodies that json.loads chokes on, or that have the wrong shapes, fail the delivery."""
    server = serve(lambda c: c.answer("200 OK", body))
    outcome, _, _ = call(token_target(server.url(), tmp_path), 5)
    failed(outcome)


# -- 5. a 200 must be a STOW-RS response about our instance ------------------------------------


def test_200_naming_another_instance_fails(
    serve: Callable[..., HostileServer], tmp_path: Path
) -> None:
    """The Referenced SOP Sequence names an instance that is not ours: not stored."""
    server = serve(lambda c: c.answer("200 OK", dataset("00081199", "1.2.3.4.5.6.7")))
    outcome, _, _ = call(token_target(server.url(), tmp_path), 5)
    error = failed(outcome)
    assert error.status == 200 and "1.2.3.4.5.6.7" in str(error)


def test_200_html_page_fails(serve: Callable[..., HostileServer], tmp_path: Path) -> None:
    """A 200 "Login required" page (a proxy, an SSO portal) is not a STOW-RS response."""
    page = b"<html><body>Login required</body></html>"
    server = serve(lambda c: c.answer("200 OK", page, "text/html; charset=utf-8"))
    outcome, _, _ = call(token_target(server.url(), tmp_path), 5)
    error = failed(outcome)
    assert error.status == 200 and "not a STOW-RS response: text/html" in str(error)


# -- 6. before the request is sent: unreachable; after: an attempt -----------------------------


def test_tls_handshake_timeout_is_unreachable(
    serve: Callable[..., HostileServer], tmp_path: Path
) -> None:
    """A server that takes the connection and never answers the ClientHello: no attempt."""
    server = serve(lambda c: c.wait(8))
    target = token_target(server.url().replace("http:", "https:"), tmp_path)
    outcome, elapsed, _ = call(target, 1.0)
    error = failed(outcome, StowUnreachable)
    assert "TLS" in str(error)
    assert elapsed < 1.0 + MARGIN_S


def test_trickled_tls_handshake_is_unreachable_at_the_deadline(
    serve: Callable[..., HostileServer], tmp_path: Path
) -> None:
    """A handshake trickled a byte at a time (each byte within the timeout) ends at the
    timeout, before anything was sent: no attempt."""
    server = serve(trickle(b"", b"\x16\x03\x03\x40\x00" + b"\x00" * 16384, interval=0.1))
    target = token_target(server.url().replace("http:", "https:"), tmp_path)
    outcome, elapsed, _ = call(target, 1.0)
    failed(outcome, StowUnreachable)
    assert elapsed < 1.0 + MARGIN_S


def test_reset_after_the_request_is_an_attempt(
    serve: Callable[..., HostileServer], tmp_path: Path
) -> None:
    """The server read the whole request, then reset the connection: the object may have been
    acted on, so it is a failed attempt, not "unreachable"."""

    def reset(conn: Conn) -> None:
        conn.request()
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00" * 2)

    server = serve(reset)
    outcome, _, _ = call(token_target(server.url(), tmp_path), 5)
    failed(outcome, StowFailed)
    assert len(server.heads) == 1


def test_request_never_read_is_unreachable(
    serve: Callable[..., HostileServer], tmp_path: Path
) -> None:
    """A server that never reads the request (its socket buffers full before the body is
    sent): no attempt used, and the call ends at its timeout."""
    server = serve(lambda c: c.wait(8))
    token = tmp_path / "token"
    token.write_text(TOKEN)
    big = DATA * 8192  # 32 MiB: more than loopback's socket buffers
    t0 = time.monotonic()
    with pytest.raises(StowUnreachable) as info:
        store(StowTarget(url=server.url(), token_file=token), big, UID, 1.0)
    assert time.monotonic() - t0 < 1.0 + MARGIN_S
    assert "not sent within 1 s" in str(info.value)


# -- what the audit found right, kept ----------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [("401 Unauthorized", StowFailed), ("403 Forbidden", StowFailed), ("404 Not Found", StowFailed),
     ("500 Internal Server Error", StowFailed), ("429 Too Many Requests", StowUnreachable),
     ("502 Bad Gateway", StowUnreachable), ("504 Gateway Timeout", StowUnreachable)],
)  # fmt: skip
def test_error_statuses_keep_their_classes(
    serve: Callable[..., HostileServer], tmp_path: Path, status: str, kind: type[StowError]
) -> None:
    server = serve(lambda c: c.answer(status, b'{"error": "no"}', "application/json"))
    outcome, _, _ = call(token_target(server.url(), tmp_path), 5)
    error = failed(outcome, kind)
    assert error.status == int(status[:3]) and str(error).startswith(f"HTTP {status}")


def test_failed_sop_entry_fails(serve: Callable[..., HostileServer], tmp_path: Path) -> None:
    body = json.loads(dataset("00081198", UID))
    body["00081198"]["Value"][0]["00081197"] = {"vr": "US", "Value": [0xA700]}
    server = serve(lambda c: c.answer("202 Accepted", json.dumps(body).encode()))
    outcome, _, _ = call(token_target(server.url(), tmp_path), 5)
    error = failed(outcome)
    assert str(error) == "HTTP 202, Failure Reason 0xA700"


@pytest.mark.parametrize(
    ("status", "body", "ctype", "warning"),
    [("200 OK", dataset("00081199", UID), "application/dicom+json", None),
     ("200 OK", b"[" + dataset("00081199", UID) + b"]", "application/json", None),
     ("200 OK", b"", "application/dicom+json", None),
     ("200 OK", b"", "text/plain", None),
     ("200 OK", b"{}", "application/dicom+json; charset=utf-8", None)],
    ids=["ours", "wrapped", "empty", "empty-text", "no-sequences"],
)  # fmt: skip
def test_stored(
    serve: Callable[..., HostileServer],
    tmp_path: Path,
    status: str,
    body: bytes,
    ctype: str,
    warning: str | None,
) -> None:
    server = serve(lambda c: c.answer(status, body, ctype))
    outcome, _, _ = call(token_target(server.url(), tmp_path), 5)
    assert outcome == StowResult(int(status[:3]), warning)


def test_warning_reason_is_kept(serve: Callable[..., HostileServer], tmp_path: Path) -> None:
    body = json.loads(dataset("00081199", UID))
    body["00081199"]["Value"][0]["00081196"] = {"vr": "US", "Value": [0xB000]}
    server = serve(lambda c: c.answer("202 Accepted", json.dumps(body).encode()))
    outcome, _, _ = call(token_target(server.url(), tmp_path), 5)
    assert outcome == StowResult(202, "Warning Reason 0xB000")


def test_body_shorter_than_its_content_length_fails(
    serve: Callable[..., HostileServer], tmp_path: Path
) -> None:
    """A 200 announcing 1000 bytes that closes after 2 was not a complete response."""

    def short(conn: Conn) -> None:
        conn.request()
        conn.send(b"HTTP/1.1 200 OK\r\nContent-Type: application/dicom+json\r\n"
                  b"Content-Length: 1000\r\n\r\n{}")  # fmt: skip

    server = serve(short)
    outcome, _, _ = call(token_target(server.url(), tmp_path), 5)
    assert "IncompleteRead" in str(failed(outcome))


def test_refused_and_no_response(serve: Callable[..., HostileServer], tmp_path: Path) -> None:
    """Nothing listening: unreachable. A request that gets no answer: an attempt, at the
    timeout."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]
    outcome, _, _ = call(token_target(f"http://{LOOPBACK}:{port}/dw", tmp_path), 5)
    assert "cannot connect" in str(failed(outcome, StowUnreachable))

    def hang(conn: Conn) -> None:
        conn.request()
        conn.wait(8)

    server = serve(hang)
    outcome, elapsed, _ = call(token_target(server.url(), tmp_path), 1.0)
    assert "no response within 1 s" in str(failed(outcome))
    assert elapsed < 1.0 + MARGIN_S


def self_signed(tmp_path: Path) -> ssl.SSLContext:
    """A server context with a self-signed certificate for 127.0.0.1, made with openssl."""
    cert, key = web_certificate(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context


def test_tls(serve: Callable[..., HostileServer], tmp_path: Path) -> None:
    """A self-signed server is refused before anything is sent (unreachable); with its
    certificate as ``ca_file`` the object is stored over TLS."""
    server = serve(lambda c: c.answer("200 OK", dataset("00081199", UID)), self_signed(tmp_path))
    outcome, _, _ = call(token_target(server.url(), tmp_path), 5)
    assert "CERTIFICATE_VERIFY_FAILED" in str(failed(outcome, StowUnreachable))
    assert server.heads == []
    target = token_target(server.url(), tmp_path, ca_file=tmp_path / "web.pem")
    outcome, _, _ = call(target, 5)
    assert outcome == StowResult(200, None)
    assert len(server.heads) == 1 and f"Bearer {TOKEN}".encode() in server.heads[0]
