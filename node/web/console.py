"""The web console of a running node: the HTTP server and the previewer, started and stopped
with the node (:class:`segnode.node.ops.service.Node`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from segnode.node.errors import ConfigError, SegnodeError

if TYPE_CHECKING:
    from segnode.node.ops.service import Node

log = logging.getLogger(__name__)


class WebConsole:
    """``[web]`` of one node.

    Parameters
    ----------
    node
        The node whose ledger and components the console shows.

    Raises
    ------
    ConfigError
        If the ``web`` extra (Starlette, uvicorn) is not installed, or the token file
        or the TLS files cannot be read.
    SegnodeError
        If ``web.listen`` cannot be bound.
    """

    def __init__(self, node: Node) -> None:
        try:
            from segnode.node.web.app import LOOPBACK_HOSTS, Access, Console, create_app
            from segnode.node.web.preview import Previewer
            from segnode.node.web.server import WebServer, https_context, read_token
        except ImportError as exc:
            raise ConfigError(
                f"web.enabled = true needs the web extra (pip install 'segnode[web]'): {exc}"
            ) from exc
        from segnode.node.web.status import node_ready, node_status

        cfg = node.config.web
        self.node = node
        access = Access(read_token(cfg), reads_need_token=not cfg.loopback)
        self.previewer = Previewer(node.config.data_dir, node.ledger) if cfg.preview else None

        def requeued() -> None:
            node.worker.wake.set()
            node.dispatcher.wake.set()

        own = f"[{cfg.host}]" if ":" in cfg.host else cfg.host.lower()  # as a Host header
        app = create_app(
            Console(
                ledger=node.ledger,
                data_dir=node.config.data_dir,
                access=access,
                status=lambda: node_status(node),
                ready=lambda: node_ready(node),
                requeued=requeued,
                hosts=LOOPBACK_HOSTS | {own} if cfg.loopback else None,
                audit=node.audit,
            )
        )
        tls = https_context(node.config.tls) if cfg.tls else None
        self.server = WebServer(app, cfg.host, cfg.port, tls)
        try:
            self.server.bind()  # before the node starts anything: a clean error
        except OSError as exc:
            raise SegnodeError(
                f"web.listen {cfg.host}:{cfg.port}: cannot listen: {exc.strerror or exc}"
            ) from exc

    def encoded(self, job_id: int) -> None:
        """A job's results are encoded (the node's ``Worker.on_encoded``, after the outbox
        is woken): queue its preview."""
        if self.previewer is not None:
            self.previewer.submit(job_id)

    def start(self) -> None:
        """Start the previewer and the server (bound already)."""
        if self.previewer is not None:
            self.previewer.start()
        self.server.start()

    def stop(self) -> None:
        """Stop the server (requests in flight finish), then the previewer."""
        self.server.stop()
        if self.previewer is not None:
            self.previewer.stop()
