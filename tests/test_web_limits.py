"""The web server's limits, on real sockets against the real server on 127.0.0.1: a cap on
connections enforced at accept, a deadline for the TLS handshake and for each request to
arrive, a bound on a request head; job ids outside SQLite's integers; strict ``Host``."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from segnode.node.config import TLSConfig
from tests.conftest import LOOPBACK
from tests.test_web import web_certificate

TOKEN = "s3cret-token-for-the-limit-tests-0123456789"
HALF_SENT = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # no blank line: the head never ends


def start_server(
    tmp_path: Path,
    servers: list[Any],
    *,
    loopback_hosts: bool = True,
    ssl_context: ssl.SSLContext | None = None,
    **limits: Any,
) -> Any:
    """A :class:`WebServer` on a free loopback port, with an empty ledger; stopped by the
    :func:`servers` fixture."""
    from segnode.node.web.app import LOOPBACK_HOSTS, Access, Console, create_app
    from segnode.node.web.server import WebServer
    from segnode.storage.ledger import Ledger

    tmp_path.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    console = Console(
        ledger,
        tmp_path,
        Access(TOKEN),
        lambda: {},
        lambda: (True, "ready"),
        hosts=LOOPBACK_HOSTS if loopback_hosts else None,
    )
    server = WebServer(create_app(console), LOOPBACK, 0, ssl_context, **limits)
    servers.append((server, ledger))
    server.start()
    return server


@pytest.fixture
def servers() -> Iterator[list[Any]]:
    """The ``(server, ledger)`` pairs to stop after the test."""
    started: list[Any] = []
    yield started
    for server, ledger in started:
        server.stop()
        ledger.close()


def exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` on a new connection; everything answered until the server closes."""
    with socket.create_connection((LOOPBACK, port), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    """The status code of a raw HTTP answer."""
    return int(answer.split(b" ", 2)[1])


def get(port: int, path: str = "/healthz", token: str | None = None, method: str = "GET") -> int:
    """The status of one well-formed request (``Connection: close``)."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Length: 0\r\n"
    return status_of(exchange(port, (head + "Connection: close\r\n\r\n").encode()))


def seconds_until_closed(s: socket.socket, limit: float) -> float | None:
    """Seconds until the server closes ``s`` (what it sends first is read and dropped);
    None if it is still open after ``limit`` seconds."""
    start = time.monotonic()
    s.settimeout(limit)
    try:
        while s.recv(65536):
            s.settimeout(max(0.01, limit - (time.monotonic() - start)))
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return None
    return time.monotonic() - start


def half_sent(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that each send the start of a request head and nothing more."""
    socks = []
    for _ in range(n):
        s = socket.create_connection((LOOPBACK, port), timeout=5)
        s.sendall(HALF_SENT)
        socks.append(s)
    return socks


def assert_closed_at_accept(port: int, payload: bytes) -> None:
    """A connection sending ``payload`` is closed by the server within 1 s (beyond the cap)."""
    with socket.create_connection((LOOPBACK, port), timeout=5) as extra:
        extra.sendall(payload)
        closed = seconds_until_closed(extra, 2.0)
        assert closed is not None and closed < 1.0, closed


def assert_all_closed_within(socks: list[socket.socket], low: float, high: float) -> None:
    """Every one of ``socks`` is closed by the server, the last between ``low`` and ``high``
    seconds from now (their deadline)."""
    start = time.monotonic()
    for s in socks:
        assert seconds_until_closed(s, high + 2.0) is not None
    assert low < time.monotonic() - start < high


# -- the cap and the deadline ----------------------------------------------------------------


def test_connections_beyond_the_cap_are_closed_at_once(tmp_path: Path, servers: Any) -> None:
    """The audit's 19,990 half-sent requests exhausted the node's descriptors: now at most
    ``max_connections`` are open; the others are closed as soon as they are accepted."""
    server = start_server(tmp_path, servers, max_connections=4, request_timeout_s=4.0)
    held = half_sent(server.port, 4)
    try:
        time.sleep(0.2)  # all four accepted (the server counts them at accept)
        for _ in range(3):
            assert_closed_at_accept(server.port, HALF_SENT)
        # the half-sent requests are dropped at their deadline, which frees their slots
        assert_all_closed_within(held, 3.0, 6.0)
        assert get(server.port) == 200
    finally:
        for s in held:
            s.close()


def test_a_request_must_arrive_within_the_deadline(tmp_path: Path, servers: Any) -> None:
    """A half-sent head, a head trickled a byte at a time, and an idle-then-partial second
    request on a kept-alive connection are all closed after ``request_timeout_s``; a normal
    request meanwhile is answered."""
    server = start_server(tmp_path, servers, request_timeout_s=1.5)
    (stalled,) = half_sent(server.port, 1)
    trickle = socket.create_connection((LOOPBACK, server.port), timeout=5)
    kept = socket.create_connection((LOOPBACK, server.port), timeout=5)
    try:
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /healthz HTTP/1.1\r\n")  # the second request never ends
        start = time.monotonic()
        closed_at = None
        for byte in HALF_SENT * 4:  # a byte every 0.1 s: data keeps coming, the head never ends
            try:
                trickle.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic() - start
                break
            trickle.settimeout(0.1)
            try:
                if trickle.recv(1) == b"":
                    closed_at = time.monotonic() - start
                    break
            except TimeoutError:
                pass
        assert closed_at is not None and 1.2 < closed_at < 3.0, closed_at
        assert get(server.port) == 200  # a whole request is answered
        for s in (stalled, kept):
            assert seconds_until_closed(s, 3.0) is not None
    finally:
        for s in (stalled, trickle, kept):
            s.close()


def _half_client_hello() -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    out = ssl.MemoryBIO()
    client = ctx.wrap_bio(ssl.MemoryBIO(), out, server_hostname="x")
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    hello = out.read()
    return hello[: len(hello) // 2]


def test_tls_handshakes_count_and_have_a_deadline(tmp_path: Path, servers: Any) -> None:
    """Peers that stop mid-handshake hold a slot only until the deadline; beyond the cap
    they are closed at once; HTTPS still works afterwards."""
    from segnode.node.web.server import https_context

    cert, key = web_certificate(tmp_path)
    tls = https_context(TLSConfig(cert_file=cert, key_file=key, min_version="1.2"))
    server = start_server(
        tmp_path, servers, ssl_context=tls, max_connections=3, request_timeout_s=2.0
    )
    hello = _half_client_hello()
    stalled = []
    try:
        for _ in range(3):
            s = socket.create_connection((LOOPBACK, server.port), timeout=5)
            s.sendall(hello)
            stalled.append(s)
        time.sleep(0.2)
        assert_closed_at_accept(server.port, hello)
        assert_all_closed_within(stalled, 1.5, 4.0)
        client = ssl.create_default_context(cafile=str(cert))
        raw = socket.create_connection((LOOPBACK, server.port), timeout=5)
        with client.wrap_socket(raw, server_hostname=LOOPBACK) as tls_sock:
            tls_sock.sendall(
                b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
            )
            assert tls_sock.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for s in stalled:
            s.close()


# -- the request head ------------------------------------------------------------------------


def test_an_oversize_request_head_is_refused(tmp_path: Path, servers: Any) -> None:
    """The audit sent a 200 MiB header (accepted) and a 1000 MiB one (100 % CPU): now the
    connection is answered 400 and closed once the head passes the bound."""
    server = start_server(tmp_path, servers)
    with socket.create_connection((LOOPBACK, server.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        sent = 0
        try:
            while sent < 64 << 20:  # the server should stop us long before 64 MiB
                s.sendall(b"a" * (64 << 10))
                sent += 64 << 10
        except (BrokenPipeError, ConnectionResetError):
            pass
        s.settimeout(5)
        try:
            answer = s.recv(65536)
        except ConnectionResetError:
            answer = b"(reset)"
    assert sent < 8 << 20, f"{sent >> 20} MiB taken into a request head"
    assert answer.startswith(b"HTTP/1.1 400") or answer == b"(reset)", answer[:80]
    # a whole head over the bound, arriving at once, is refused too; one within it is fine
    pad = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Pad: "
    assert status_of(exchange(server.port, pad + b"a" * 100_000 + b"\r\n\r\n")) == 431
    assert status_of(exchange(server.port, pad + b"a" * 8_000 + b"\r\n\r\n")) == 200


# -- job ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "jid",
    ["0", "-1", "x", "9223372036854775807", "9223372036854775808", "99999999999999999999999"]
    + ["9" * 5000],
)
def test_job_ids_outside_sqlite_integers_are_unknown_jobs(
    tmp_path: Path, servers: Any, jid: str
) -> None:
    server = start_server(tmp_path, servers)
    assert get(server.port, f"/api/v1/jobs/{jid}") == 404
    assert get(server.port, f"/api/v1/jobs/{jid}/preview.png") == 404
    for action in ("cancel", "retry"):
        assert get(server.port, f"/api/v1/jobs/{jid}/{action}", TOKEN, "POST") == 404
        assert get(server.port, f"/api/v1/jobs/{jid}/{action}", None, "POST") == 401


# -- Host --------------------------------------------------------------------------------------


def test_host_header_is_one_and_strict(tmp_path: Path, servers: Any) -> None:
    from segnode.node.web.app import host_name

    assert [host_name(h) for h in ("[::1]evil.com", "127.0.0.1:80x", "a b", "[::1]:", "a_b")] == [
        None,
        None,
        None,
        "[::1]",
        "a_b",
    ]
    for loopback_hosts in (True, False):
        where = tmp_path / str(loopback_hosts)
        port = start_server(where, servers, loopback_hosts=loopback_hosts).port
        assert host_status(port, [b"127.0.0.1"]) == 200
        assert host_status(port, [b"127.0.0.1", b"evil.example"]) == 400
        assert host_status(port, [b"127.0.0.1", b"127.0.0.1"]) == 400
        assert host_status(port, [b"[::1]evil.example"]) == 400
        assert host_status(port, [b"localhost:8080evil"]) == 400
        assert host_status(port, [b"evil.example"]) == (400 if loopback_hosts else 200)
        assert host_status(port, [b"[::1]:1"]) == 200


def host_status(port: int, hosts: list[bytes]) -> int:
    """The status of ``GET /api/v1/jobs`` with these ``Host`` headers; a refusal by the
    application must name the header."""
    head = b"GET /api/v1/jobs HTTP/1.1\r\n" + b"".join(b"Host: " + h + b"\r\n" for h in hosts)
    answer = exchange(port, head + b"Connection: close\r\n\r\n")
    if status_of(answer) == 400 and b"{" in answer:
        assert b"Host" in answer.partition(b"\r\n\r\n")[2], answer
    return status_of(answer)
