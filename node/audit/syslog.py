"""Syslog for audit messages, as IHE ITI-20 (Record Audit Event) carries them: the RFC 5424
message format and three transports, TLS (RFC 5425), UDP (RFC 5426) and a local file.

A message is ``<PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID - BOM MSG``: facility 10
(security/authorization), severity 5 (notice) for a success and 4 (warning) otherwise, MSGID
``IHE+RFC-3881``, no structured data, and the audit XML as UTF-8 after a byte order mark
(RFC 5424 section 6.4). A transport's :meth:`~Transport.send` either delivers a batch or
raises :class:`OSError` (try again later) or :class:`Undeliverable` (a message it can never
carry); it never truncates a message.

Must not touch: the message content (:mod:`segnode.node.audit.messages`), the queue and the
retries (:mod:`segnode.node.audit.auditor`).
"""

from __future__ import annotations

import logging
import os
import re
import select
import socket
import ssl
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, Protocol

log = logging.getLogger(__name__)

FACILITY_AUTHPRIV = 10
SEVERITY_WARNING = 4
SEVERITY_NOTICE = 5
MSGID = "IHE+RFC-3881"
BOM = b"\xef\xbb\xbf"
UDP_LIMIT = 65000
TLS_PORT = 6514  # RFC 5425 section 4.1
UDP_PORT = 514  # RFC 5426 section 3.3

_HEADER = re.compile(
    rb"<(?P<pri>\d{1,3})>(?P<version>[1-9]\d{0,2}) (?P<timestamp>\S+) (?P<hostname>\S+) "
    rb"(?P<app>\S+) (?P<procid>\S+) (?P<msgid>\S+) (?P<sd>-|\[.*?\](?:\[.*?\])*)(?: (?P<msg>.*))?",
    re.DOTALL,
)


class Undeliverable(ValueError):
    """A message this transport can never carry (sending it again would not help)."""


class MessageTooLarge(Undeliverable):
    """A message is larger than a UDP datagram may carry; it is not sent (nor truncated)."""


def _header_field(value: str, limit: int) -> str:
    """``value`` as an RFC 5424 header field: printable US-ASCII without spaces, at most
    ``limit`` characters, ``-`` (NILVALUE) when empty."""
    printable = "".join(c for c in value if 33 <= ord(c) <= 126)[:limit]
    return printable or "-"


def format_message(
    payload: bytes,
    *,
    severity: int,
    hostname: str,
    app_name: str,
    procid: str,
    timestamp: datetime,
    facility: int = FACILITY_AUTHPRIV,
) -> bytes:
    """One RFC 5424 syslog message carrying ``payload`` (UTF-8 XML) for IHE ITI-20."""
    when = timestamp.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    header = (
        f"<{facility * 8 + severity}>1 {when} {_header_field(hostname, 255)} "
        f"{_header_field(app_name, 48)} {_header_field(procid, 128)} {MSGID} -"
    )
    return header.encode("ascii") + b" " + BOM + payload


@dataclass(frozen=True)
class SyslogMessage:
    """An RFC 5424 message taken apart (:func:`parse_message`)."""

    facility: int
    severity: int
    version: int
    timestamp: str
    hostname: str
    app_name: str
    procid: str
    msgid: str
    structured_data: str
    msg: bytes
    bom: bool


def parse_message(data: bytes) -> SyslogMessage:
    """Parse one RFC 5424 message (without transport framing); the BOM, if any, is removed
    from ``msg`` and reported in ``bom``.

    Raises
    ------
    ValueError
        ``data`` is not an RFC 5424 message.
    """
    match = _HEADER.fullmatch(data)
    if match is None:
        raise ValueError(f"not an RFC 5424 syslog message: {data[:80]!r}")
    pri = int(match["pri"])
    msg = match["msg"] or b""
    bom = msg.startswith(BOM)
    return SyslogMessage(
        facility=pri // 8,
        severity=pri % 8,
        version=int(match["version"]),
        timestamp=match["timestamp"].decode("ascii"),
        hostname=match["hostname"].decode("ascii"),
        app_name=match["app"].decode("ascii"),
        procid=match["procid"].decode("ascii"),
        msgid=match["msgid"].decode("ascii"),
        structured_data=match["sd"].decode("utf-8"),
        msg=msg[len(BOM) :] if bom else msg,
        bom=bom,
    )


class Transport(Protocol):
    """Where formatted syslog messages go."""

    batch_size: int

    @property
    def connected(self) -> bool:
        """Whether the transport holds an open connection (files and UDP: always)."""
        ...

    def send(self, messages: Sequence[bytes]) -> None:
        """Deliver ``messages`` in order, or raise :class:`OSError`."""
        ...

    def close(self) -> None:
        """Release the connection or file; a later :meth:`send` opens it again."""
        ...


class TlsSyslog:
    """Syslog over TLS (RFC 5425): octet-counting framing ``LEN SP MSG`` on one long-lived
    connection, opened on the first send and again after any failure.

    The server's certificate is verified against ``ca_file`` (the system's CAs when ``None``)
    and must name ``host``; ``cert_file``/``key_file``, when given, are the client's
    certificate for mutual authentication (as ITI-19 asks). TLS 1.2 at least (RFC 7525).

    RFC 5425 has no acknowledgement: a message counts as delivered once the write returned.
    Before each batch the connection is checked for the server having closed it, so that a
    message is not written into a connection that is already gone.
    """

    batch_size = 100

    def __init__(
        self,
        host: str,
        port: int,
        ca_file: Path | None,
        cert_file: Path | None,
        key_file: Path | None,
        timeout: float = 10.0,
    ) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH, cafile=str(ca_file) if ca_file else None
        )
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if cert_file is not None:
            context.load_cert_chain(str(cert_file), str(key_file) if key_file else None)
        self._context = context
        self._sock: ssl.SSLSocket | None = None

    @property
    def connected(self) -> bool:
        """Whether a TLS connection is open."""
        return self._sock is not None

    def _alive(self, sock: ssl.SSLSocket) -> bool:
        """Whether the server still holds the connection: a syslog receiver never sends
        application data, so anything readable is its close (or a TLS 1.3 session ticket)."""
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable and not sock.pending():
            return True
        sock.setblocking(False)
        try:
            return sock.recv(4096) != b""
        except ssl.SSLWantReadError:
            return True  # a handshake message (session ticket), no data
        except (ssl.SSLError, OSError):
            return False
        finally:
            sock.settimeout(self.timeout)

    def _connect(self) -> ssl.SSLSocket:
        raw = socket.create_connection((self.host, self.port), timeout=self.timeout)
        try:
            sock = self._context.wrap_socket(raw, server_hostname=self.host)
        except BaseException:
            raw.close()
            raise
        sock.settimeout(self.timeout)
        log.info(
            "audit: connected to syslog+tls://%s:%d (%s)", self.host, self.port, sock.version()
        )
        return sock

    def send(self, messages: Sequence[bytes]) -> None:
        """Write ``messages`` octet-counted on the connection (opened if needed)."""
        if self._sock is not None and not self._alive(self._sock):
            log.info("audit: syslog+tls://%s:%d closed the connection", self.host, self.port)
            self.close()
        if self._sock is None:
            self._sock = self._connect()
        frames = b"".join(b"%d " % len(message) + message for message in messages)
        try:
            self._sock.sendall(frames)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the connection, with a TLS close_notify when the server is still there."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            sock.settimeout(min(1.0, self.timeout))
            sock.unwrap().close()
        except (ssl.SSLError, OSError, ValueError):
            sock.close()


class UdpSyslog:
    """Syslog over UDP (RFC 5426): one datagram per message, nothing truncated; a message over
    65,000 bytes raises :class:`MessageTooLarge`. Delivery is not confirmed by anything."""

    batch_size = 1

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._sock: socket.socket | None = None
        self._address: tuple[str, int] | None = None

    @property
    def connected(self) -> bool:
        """Always true: UDP has no connection."""
        return True

    def send(self, messages: Sequence[bytes]) -> None:
        """Send each message as one datagram."""
        for message in messages:
            if len(message) > UDP_LIMIT:
                raise MessageTooLarge(
                    f"an audit message of {len(message)} bytes is over the {UDP_LIMIT}-byte "
                    "limit of a UDP datagram (RFC 5426); use syslog+tls"
                )
        if self._sock is None:
            family, kind, proto, _, address = socket.getaddrinfo(
                self.host, self.port, type=socket.SOCK_DGRAM
            )[0]
            self._sock = socket.socket(family, kind, proto)
            self._address = (str(address[0]), int(address[1]))
        assert self._address is not None
        for message in messages:
            self._sock.sendto(message, self._address)

    def close(self) -> None:
        """Close the socket."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class FileSyslog:
    """A local file of RFC 5424 messages, one a line: appended, flushed and fsynced per batch."""

    batch_size = 100

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def connected(self) -> bool:
        """Always true: the file is opened for each batch."""
        return True

    def send(self, messages: Sequence[bytes]) -> None:
        """Append ``messages``, one a line, and fsync."""
        for message in messages:
            if b"\n" in message or b"\r" in message:
                raise Undeliverable("a message with a line break cannot be one line of a file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as f:
            f.write(b"".join(message + b"\n" for message in messages))
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        """Nothing to release."""


@dataclass(frozen=True)
class Destination:
    """An audit destination as configured: ``syslog+tls://HOST:PORT``, ``syslog+udp://HOST:PORT``
    or ``file:PATH`` (see :func:`parse_destination`)."""

    url: str
    kind: Literal["tls", "udp", "file"]
    host: str = ""
    port: int = 0
    path: Path | None = None

    def transport(
        self,
        *,
        base: Path,
        ca_file: Path | None = None,
        cert_file: Path | None = None,
        key_file: Path | None = None,
        timeout: float = 10.0,
    ) -> Transport:
        """The transport to this destination; a relative file path is taken under ``base``."""
        if self.kind == "tls":
            return TlsSyslog(self.host, self.port, ca_file, cert_file, key_file, timeout)
        if self.kind == "udp":
            return UdpSyslog(self.host, self.port)
        assert self.path is not None
        return FileSyslog(self.path if self.path.is_absolute() else base / self.path)


def parse_destination(url: str) -> Destination:
    """Parse an audit destination URL.

    ``syslog+tls://HOST[:PORT]`` (port 6514 by default, RFC 5425), ``syslog+udp://HOST[:PORT]``
    (514, RFC 5426), ``file:///absolute/path`` or ``file:relative/path`` (under the node's
    data directory). IPv6 hosts are written in brackets.

    Raises
    ------
    ValueError
        The URL is none of these; the message says what is wrong.
    """
    parts = urllib.parse.urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{url!r}: a file destination names no host (file:///abs/path)")
        if parts.query or parts.fragment:
            raise ValueError(f"{url!r}: a file destination has no query or fragment")
        path = urllib.parse.unquote(parts.path)
        if not path or path.endswith("/"):
            raise ValueError(f"{url!r}: a file destination needs a file name")
        return Destination(url=url, kind="file", path=Path(path))
    if scheme not in ("syslog+tls", "syslog+udp"):
        raise ValueError(
            f"{url!r}: an audit destination is syslog+tls://HOST:PORT, syslog+udp://HOST:PORT "
            "or file:///path"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a syslog destination is only HOST:PORT")
    if parts.username is not None:
        raise ValueError(f"{url!r}: a syslog destination has no user name")
    if not parts.hostname:
        raise ValueError(f"{url!r}: the host is missing")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url!r}: the port must be a number from 1 to 65535") from None
    if port == 0:
        raise ValueError(f"{url!r}: the port must be a number from 1 to 65535")
    kind: Literal["tls", "udp"] = "tls" if scheme == "syslog+tls" else "udp"
    default = TLS_PORT if kind == "tls" else UDP_PORT
    return Destination(url=url, kind=kind, host=parts.hostname, port=port or default)
