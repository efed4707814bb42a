"""The console's HTTP server: uvicorn in a thread of the node process, with its own loop.

The listening socket is bound by :meth:`WebServer.bind` (in the caller's thread, before the
node starts anything), so that an address in use is an error at start that names
``web.listen``. uvicorn installs no signal
handlers outside the main thread; the node's own handlers stop it through
:meth:`WebServer.stop`.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from typing import Any

import uvicorn

from segnode.node.config import TLSConfig, WebConfig
from segnode.node.errors import ConfigError

log = logging.getLogger(__name__)

_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


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


class WebServer:
    """uvicorn serving ``app`` on ``host:port`` in a daemon thread.

    Parameters
    ----------
    app
        The ASGI application (:func:`segnode.node.web.app.create_app`).
    host, port
        Where to listen (port 0: any free port; see :attr:`port`).
    ssl_context
        Serve HTTPS with this context; plain HTTP when None.
    """

    def __init__(
        self, app: Any, host: str, port: int, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.host = host
        self._requested_port = port
        self._ssl = ssl_context
        self._config = uvicorn.Config(
            app,
            log_level="warning",
            log_config=None,  # uvicorn's loggers propagate to the handlers of the entry point
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            proxy_headers=False,
            server_header=False,
        )
        self._server = uvicorn.Server(self._config)
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
        self._config.load()
        self._config.ssl = self._ssl  # after load(): our context, not one built from file names
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
