"""DICOM TLS (PS3.15 Annex B.1, The Basic TLS Secure Transport Connection Profile).

Server side: :func:`server_context` builds an :class:`ssl.SSLContext` from ``[tls]`` (our
certificate and key, optionally a CA that client certificates must chain to, TLS 1.2 at
least). The acceptor (:mod:`segnode.node.dicom.ul`) runs the handshake in the connection's own
thread under ``tls.handshake_timeout_s``, not in the accept loop, so a client that connects and then
says nothing cannot stop the node from accepting others.

Client side: :func:`client_context` builds the context for one destination's ``tls`` options;
pass ``(context, server_name)`` as pynetdicom's ``tls_args``.
"""

from __future__ import annotations

import logging
import socket
import ssl

from segnode.node.config import TLSConfig
from segnode.node.errors import ConfigError
from segnode.node.peers import ClientTLS, Peer

log = logging.getLogger(__name__)

_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


def server_context(cfg: TLSConfig) -> ssl.SSLContext:
    """The listening side's context.

    Raises
    ------
    ConfigError
        If the certificate, key or CA file cannot be loaded (the message names the key).
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _VERSIONS[cfg.min_version]
    ctx.options |= ssl.OP_NO_COMPRESSION
    try:
        ctx.load_cert_chain(str(cfg.cert_file), str(cfg.key_file))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls.cert_file/tls.key_file: cannot load: {exc}") from exc
    if cfg.ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=str(cfg.ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"tls.ca_file: cannot load: {exc}") from exc
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_client_cert else ssl.CERT_OPTIONAL
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def client_context(tls: ClientTLS) -> ssl.SSLContext:
    """The context for sending to a destination over TLS (TLS 1.2 at least).

    Raises
    ------
    ConfigError
        If a configured file cannot be loaded.
    """
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        if tls.ca_file is not None:
            ctx.load_verify_locations(cafile=str(tls.ca_file))
        if tls.cert_file is not None:
            ctx.load_cert_chain(str(tls.cert_file), str(tls.key_file) if tls.key_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"destination TLS files cannot be loaded: {exc}") from exc
    if not tls.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def tls_args(peer: Peer) -> tuple[ssl.SSLContext, str] | None:
    """pynetdicom's ``tls_args`` for ``peer`` (None for plain TCP)."""
    if peer.tls is None:
        return None
    return client_context(peer.tls), peer.tls.server_name or peer.host


def describe_tls_error(exc: BaseException) -> str:
    """A short reason for a failed handshake, for the log."""
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timed out"
    return type(exc).__name__
