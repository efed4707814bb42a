"""Where results go: C-STORE peers, DICOMweb STOW-RS services, and back to the sender.

A destination is written in the configuration as a string or a table:

==================================================  =============================================
``"PACS@10.0.0.5:104"``                             C-STORE (PS3.4 Annex B) to that AE
``{peer = "PACS@host:104", tls = true, ...}``        C-STORE over DICOM TLS (PS3.15 Annex B.1)
``"stow:http://pacs:8042/dicom-web"``                STOW-RS (PS3.18 §10.5) to that service root
``{stow = "https://...", ca_file = ..., ...}``       STOW-RS with TLS options or authentication
``"@sender"``                                        C-STORE back to the calling AE title that
                                                     sent the series, at the address and port of
                                                     its ``[[node.peers]]`` entry
==================================================  =============================================

The ledger keeps destinations by name (``AE@host:port``, ``stow:<url>``); ``"@sender"`` is
resolved to the sender's name when the job is created, so each job records where its results
go. A sender without a ``[[node.peers]]`` entry that has a ``port`` cannot be resolved: the
job's delivery is recorded under ``@sender:<AE>`` and fails with that reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from segnode.node.errors import ConfigError
from segnode.node.outbox.stow import STOW_PREFIX, StowTarget
from segnode.node.peers import Peer, parse_peer
from segnode.node.tables import check_keys

#: The destination that means "back to the AE that sent the series".
SENDER = "@sender"

PathFn = Callable[[Any, str], Path]


@dataclass(frozen=True)
class SenderRef:
    """``"@sender"``: the calling AE title of the series, resolved through ``[[node.peers]]``."""

    @property
    def name(self) -> str:
        """The destination's name as written in the configuration."""
        return SENDER


Destination = Peer | StowTarget | SenderRef
#: A destination the outbox can send to (``"@sender"`` already resolved).
Target = Peer | StowTarget


def unresolved_sender(calling_ae: str) -> str:
    """Ledger name of a ``"@sender"`` delivery whose sender has no return address."""
    return f"{SENDER}:{calling_ae or '?'}"


def parse_stow_url(url: Any, key: str) -> str:
    """Validate a DICOMweb service root URL (``http`` or ``https``, with a host)."""
    if not isinstance(url, str):
        raise ConfigError(f"{key}: must be a URL string, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{key}: expected an http:// or https:// DICOMweb URL, got {url!r}")
    if parts.query or parts.fragment:
        raise ConfigError(f"{key}: the service root URL takes no query or fragment")
    return url.rstrip("/")


def _stow_table(x: Mapping[str, Any], key: str, path: PathFn) -> StowTarget:
    known = {"stow", "ca_file", "verify", "username", "password_file", "token_file"}
    check_keys(x, known, f"{key}:")
    url = parse_stow_url(x["stow"], f"{key}.stow")

    def opt(name: str) -> Path | None:
        if name not in x:
            return None
        p = path(x[name], f"{key}.{name}")
        if not p.exists():
            raise ConfigError(f"{key}.{name}: file not found: {p}")
        return p

    verify = x.get("verify", True)
    if not isinstance(verify, bool):
        raise ConfigError(f"{key}.verify: must be true or false, got {verify!r}")
    username = x.get("username")
    if username is not None and (not isinstance(username, str) or ":" in username):
        raise ConfigError(f"{key}.username: must be a string without ':', got {username!r}")
    target = StowTarget(
        url=url,
        ca_file=opt("ca_file"),
        verify=verify,
        username=username,
        password_file=opt("password_file"),
        token_file=opt("token_file"),
    )
    if target.password_file is not None and target.username is None:
        raise ConfigError(f"{key}.password_file: needs username")
    if target.token_file is not None and target.username is not None:
        raise ConfigError(f"{key}: give either username/password_file or token_file, not both")
    if not url.startswith("https") and (target.ca_file is not None or not verify):
        raise ConfigError(f"{key}: ca_file/verify apply to https URLs only")
    return target


def parse_destination(
    value: Any,
    key: str,
    path: PathFn,
    peer_table: Callable[[dict[str, Any], str], Peer],
) -> Destination:
    """Parse one destination (string or table form, see the module docstring).

    Parameters
    ----------
    value
        The TOML value.
    key
        Its key, for messages (``rules[0].destinations[1]``).
    path
        Resolves a configured path relative to the config file.
    peer_table
        Parses the C-STORE table form (``{peer = ..., tls = ...}``).
    """
    if isinstance(value, str):
        if value == SENDER:
            return SenderRef()
        if value.startswith(STOW_PREFIX):
            return StowTarget(url=parse_stow_url(value[len(STOW_PREFIX) :], key))
        if value.startswith("@"):
            raise ConfigError(f'{key}: unknown reference {value!r} (only "@sender")')
        return parse_peer(value, key)
    if isinstance(value, dict):
        if "stow" in value:
            return _stow_table(value, key, path)
        return peer_table(value, key)
    raise ConfigError(
        f'{key}: expected "AE@HOST:PORT", "stow:URL", "@sender" or a table, got {value!r}'
    )


def resolve(dest: Destination, calling_ae: str, senders: Mapping[str, Peer]) -> str:
    """The ledger name of ``dest`` for a series sent by ``calling_ae``."""
    if isinstance(dest, SenderRef):
        peer = senders.get(calling_ae.strip())
        return peer.name if peer is not None else unresolved_sender(calling_ae.strip())
    return dest.name


def index(destinations: Iterable[Destination]) -> dict[str, Target]:
    """Name -> target for every concrete destination (``"@sender"`` left out)."""
    out: dict[str, Target] = {}
    for d in destinations:
        if not isinstance(d, SenderRef):
            out.setdefault(d.name, d)
    return out


def from_name(name: str) -> Target | None:
    """A target rebuilt from its ledger name alone (no TLS options or credentials).

    Used for deliveries whose destination is no longer in the configuration; None when the
    name is not a destination (e.g. an unresolved ``@sender:AE``).
    """
    if name.startswith(STOW_PREFIX):
        try:
            return StowTarget(url=parse_stow_url(name[len(STOW_PREFIX) :], "destination"))
        except ConfigError:
            return None
    if name.startswith("@"):
        return None
    try:
        return parse_peer(name)
    except ConfigError:
        return None


__all__ = [
    "SENDER",
    "Destination",
    "SenderRef",
    "Target",
    "from_name",
    "index",
    "parse_destination",
    "parse_stow_url",
    "resolve",
    "unresolved_sender",
]
