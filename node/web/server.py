"""The console's HTTP server: uvicorn in a thread of the node process, with its own loop.

The listening socket is bound by :meth:`WebServer.bind` (in the caller's thread, before the
node starts anything), so that an address in use is an error at start that names
``web.listen``. uvicorn installs no signal
handlers outside the main thread; the node's own handlers stop it through
:meth:`WebServer.stop`.

The server is bounded so that it can never take from the DICOM listener what it needs (file
descriptors, memory, CPU): connections beyond :data:`MAX_CONNECTIONS` are closed as soon as
they are accepted; a connection that has not completed its TLS handshake, or a request
(head and body), within :data:`REQUEST_TIMEOUT_S` is dropped; an incomplete request head
over :data:`~segnode.node.web.app.MAX_HEAD_BYTES` is answered 400 (and a complete one 431,
by the application). uvicorn has neither a cap enforced at accept nor a
deadline for a request to arrive, so :class:`_BoundedServer` accepts the connections itself
and :class:`_DeadlineH11` (uvicorn's h11 protocol, chosen explicitly: h11 bounds the bytes
it buffers for an incomplete head) adds the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from segnode.node.config import TLSConfig, WebConfig
from segnode.node.errors import ConfigError
from segnode.node.web.app import MAX_HEAD_BYTES

log = logging.getLogger(__name__)

_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}

#: Open connections at most (a browser opens about six); more are closed at accept.
MAX_CONNECTIONS = 64
#: Seconds for the TLS handshake, and then for each request (head and body) to arrive whole,
#: counted from the connection (or the previous response).
REQUEST_TIMEOUT_S = 10.0
#: Seconds between two warnings about refused connections.
_REFUSAL_LOG_S = 60.0


def read_token(cfg: WebConfig) -> str | None:
    """The bearer token from ``web.token_file`` (its first line), or None without one.

    Raises
    ------
    ConfigError
        If the file cannot be read or holds fewer than 16 characters.
    """
    if cfg.token_file is None:
        return None
    try:
        lines = cfg.token_file.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"web.token_file: cannot read {cfg.token_file}: {exc}") from exc
    token = lines[0].strip() if lines else ""
    if len(token) < 16:
        raise ConfigError(f"web.token_file: {cfg.token_file} must hold a token of 16+ characters")
    if cfg.token_file.stat().st_mode & 0o077:
        log.warning("web.token_file %s is readable by group or others", cfg.token_file)
    return token


def https_context(tls: TLSConfig) -> ssl.SSLContext:
    """The console's TLS context: the node's certificate and key (``[tls]``), no client
    certificates (browsers), ``tls.min_version`` at least.

    Raises
    ------
    ConfigError
        If the certificate or key cannot be loaded.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _VERSIONS[tls.min_version]
    try:
        ctx.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls.cert_file/tls.key_file: cannot load for web.tls: {exc}") from exc
    return ctx


class _DeadlineH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose next request has not arrived whole
    within ``timeout`` seconds of the connection or of the previous response.

    ``release`` is called once the connection is lost (it frees the connection's slot).
    """

    def __init__(self, *args: Any, timeout: float, release: Callable[[], None], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._timeout = timeout
        self._release = release
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._release()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._disarm_if_arrived()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm()  # the next request's time starts now (before pipelined ones are read)
        super().on_response_complete()
        self._disarm_if_arrived()

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self._timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _disarm_if_arrived(self) -> None:
        """The request has arrived whole (or the connection is ending): the application,
        not the peer, decides how long the answer takes."""
        if self.conn.their_state in (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR):
            self._disarm()

    def _expired(self) -> None:
        self._deadline = None
        log.debug("web: no whole request from %s within %.0f s: closed", self.client, self._timeout)
        self.transport.abort()  # not close(): a TLS close would wait for the peer


class _BoundedServer(uvicorn.Server):
    """uvicorn's server, accepting on our socket itself: at most ``max_connections`` open
    (counted from accept, TLS handshakes included), the others closed at once.

    Parameters
    ----------
    config
        uvicorn's configuration (loaded).
    ssl_context
        TLS for every connection, or None.
    max_connections, timeout
        See :data:`MAX_CONNECTIONS`, :data:`REQUEST_TIMEOUT_S`.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        ssl_context: ssl.SSLContext | None,
        max_connections: int,
        timeout: float,
    ) -> None:
        super().__init__(config)
        self._ssl = ssl_context
        self._max = max_connections
        self._timeout = timeout
        self.open_connections = 0  # only touched on the server's loop
        self._pending: set[asyncio.Task[None]] = set()
        self._acceptor: asyncio.Task[None] | None = None
        self._refused = 0
        self._refusal_logged = 0.0

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start accepting on the one socket of ``sockets`` (uvicorn's ``Server.startup``,
        with our accept loop instead of ``loop.create_server``)."""
        assert sockets is not None and len(sockets) == 1
        await self.lifespan.startup()  # lifespan="off": nothing, but keep uvicorn's order
        self.servers = []
        self._acceptor = asyncio.get_running_loop().create_task(self._accept(sockets[0]))
        self.started = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Stop accepting and drop the handshakes in progress, then uvicorn's shutdown."""
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._acceptor  # its reader is removed before the socket is closed
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        await super().shutdown(sockets)

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ECONNABORTED...
                log.warning("web: accept failed (%s); pausing 1 s", exc)
                await asyncio.sleep(1.0)
                continue
            if self.open_connections >= self._max:
                conn.close()  # at once: a held connection would hold a descriptor
                self._note_refusal()
                continue
            self.open_connections += 1
            task = loop.create_task(self._connect(conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _connect(self, conn: socket.socket) -> None:
        """Hand ``conn`` to a :class:`_DeadlineH11` (after the TLS handshake, if any)."""
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.open_connections -= 1

        def protocol() -> asyncio.Protocol:
            return _DeadlineH11(
                config=self.config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
                _loop=loop,
                timeout=self._timeout,
                release=release,
            )

        loop = asyncio.get_running_loop()
        connected = False
        try:
            await loop.connect_accepted_socket(
                protocol,
                conn,
                ssl=self._ssl,
                ssl_handshake_timeout=self._timeout if self._ssl is not None else None,
            )
            connected = True  # from now on the protocol's connection_lost releases the slot
        except (OSError, ssl.SSLError) as exc:  # a failed or slow handshake
            log.debug("web: connection dropped before its first request: %s", exc)
        finally:
            if not connected:
                conn.close()
                release()

    def _note_refusal(self) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._refusal_logged >= _REFUSAL_LOG_S:
            log.warning(
                "web: %d connection(s) closed at accept: %d open already (the most)",
                self._refused,
                self.open_connections,
            )
            self._refused, self._refusal_logged = 0, now


class WebServer:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread, bounded (see the module).

    Parameters
    ----------
    app
        The ASGI application (:func:`segnode.node.web.app.create_app`).
    host, port
        Where to listen (port 0: any free port; see :attr:`port`).
    ssl_context
        Serve HTTPS with this context; plain HTTP when None.
    max_connections, request_timeout_s, max_head_bytes
        The limits (:data:`MAX_CONNECTIONS`, :data:`REQUEST_TIMEOUT_S`,
        :data:`MAX_HEAD_BYTES`).
    """

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        ssl_context: ssl.SSLContext | None = None,
        *,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_head_bytes: int = MAX_HEAD_BYTES,
    ) -> None:
        self.host = host
        self._requested_port = port
        self._ssl = ssl_context
        self._config = uvicorn.Config(
            app,
            loop="asyncio",
            http="h11",  # _DeadlineH11 is h11, not httptools (uvicorn's pick when installed)
            ws="none",
            h11_max_incomplete_event_size=max_head_bytes,
            timeout_keep_alive=5,
            log_level="warning",
            log_config=None,  # uvicorn's loggers propagate to the handlers of the entry point
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            proxy_headers=False,
            server_header=False,
        )
        self._server = _BoundedServer(self._config, ssl_context, max_connections, request_timeout_s)
        self._socket: socket.socket | None = None
        self._bound_port = port
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        return self._bound_port

    @property
    def url(self) -> str:
        """The console's address."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self._ssl else 'http'}://{host}:{self.port}/"

    def bind(self) -> None:
        """Bind and listen (connections wait in the backlog until :meth:`start`).

        Raises
        ------
        OSError
            If the address cannot be bound.
        """
        if self._socket is not None:
            return
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._requested_port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._socket = sock
        self._bound_port = int(sock.getsockname()[1])

    def start(self, timeout: float = 10.0) -> None:
        """Bind (unless :meth:`bind` did), then serve in a thread; return once uvicorn
        accepts connections.

        Raises
        ------
        OSError
            If the address cannot be bound.
        RuntimeError
            If uvicorn did not start within ``timeout`` seconds.
        """
        self.bind()
        sock = self._socket
        assert sock is not None
        self._config.load()  # TLS is ours (_BoundedServer), not uvicorn's: config.ssl stays None
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name="segnode-web", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and self._thread_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # uvicorn has no start event to wait on
        if not self._server.started:
            self.stop()
            raise RuntimeError("the web server did not start (see the log)")
        log.info("web console on %s", self.url)

    def _thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving: finish the requests in flight (2 s at most), close the socket."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("web server thread still running after %.0f s", timeout)
            self._thread = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
