"""Remote application entities as the configuration names them: ``AE@HOST:PORT``.

:class:`Peer` (and its :class:`ClientTLS`) is what the outbox sends to, what routing rules and
destinations refer to and what ``[node] peers`` lists; :func:`parse_peer` reads the
``AE@HOST:PORT`` form and :func:`ae_title` checks an AE title (PS3.5 6.2). This module owns
those values and their validation only; :mod:`segnode.node.config.parse` builds the
configuration from them, :mod:`segnode.node.routing.destinations` and
:mod:`segnode.node.routing.rules` parse their sections with them. It imports nothing of the
node but its errors, so that those three do not import each other in a circle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from segnode.node.errors import ConfigError

_AE_OK = re.compile(r"^[\x20-\x5b\x5d-\x7e]{1,16}$")  # PS3.5 §6.2 AE: no backslash, no controls


@dataclass(frozen=True)
class ClientTLS:
    """TLS for an outgoing association (PS3.15 Annex B.1, The Basic TLS Secure Transport).

    ``ca_file`` verifies the destination's certificate (system CAs when None);
    ``cert_file``/``key_file`` are our client certificate when the destination asks for one;
    ``server_name`` is the name checked against its certificate (default: the host).
    """

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    server_name: str | None = None
    verify: bool = True


@dataclass(frozen=True)
class Peer:
    """A remote DICOM application entity."""

    ae_title: str
    host: str
    port: int
    tls: ClientTLS | None = None
    #: Send an IHE IOCM rejection note for results a newer version of the series replaced.
    reject_superseded: bool = False

    @property
    def name(self) -> str:
        """``AE@host:port``: the destination's name in the ledger."""
        return f"{self.ae_title}@{self.host}:{self.port}"


def ae_title(value: Any, key: str) -> str:
    """``value`` as an AE title (stripped), or :class:`ConfigError` naming ``key``."""
    if not isinstance(value, str) or not _AE_OK.match(value) or not value.strip():
        raise ConfigError(f"{key}: AE title must be 1-16 printable characters, got {value!r}")
    return value.strip()


def port(value: Any, key: str) -> int:
    """``value`` as a TCP port, or :class:`ConfigError` naming ``key``."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 65535:
        raise ConfigError(f"{key}: port must be an integer 1-65535, got {value!r}")
    return value


def parse_peer(text: str, key: str = "destination") -> Peer:
    """Parse ``AE@HOST:PORT``."""
    m = re.fullmatch(r"([^@]{1,16})@(\[[^\]]+\]|[^:@]+):(\d{1,5})", text)
    if not m:
        raise ConfigError(f"{key}: expected AE@HOST:PORT, got {text!r}")
    host = m.group(2).strip("[]")
    return Peer(ae_title(m.group(1), key), host, port(int(m.group(3)), key))
