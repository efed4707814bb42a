"""Admission guards of the Storage SCP: who may associate, and whether we have room.

* :class:`AccessPolicy` - calling AE titles allowed (``node.allowed_calling_aes``) and AE
  titles bound to hosts (``[[node.peers]]``).
* :class:`DiskGuard` - the free-space floor (``node.min_free_disk_mb``) of the spool's file
  system, checked when an association is requested and before each instance is written.
* :class:`SeriesBudget` - instances and bytes per series (``node.max_series_instances``,
  ``node.max_series_mb``). The totals come from the ledger the first time a series is seen
  by this process and are kept up to date in memory after that.

Refusals are answered as the standard says: A-ASSOCIATE-RJ "calling AE title not recognized"
(PS3.8 §9.3.4, permanent, source 1, reason 3) or "temporary congestion" (transient, source 3,
reason 1); a C-STORE beyond a limit gets 0xA700 Out of Resources (PS3.4 §B.2.3).
"""

from __future__ import annotations

import ipaddress
import logging
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from segnode.node.config import NodeConfig

log = logging.getLogger(__name__)

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _networks(host: str) -> tuple[IPNetwork, ...]:
    """Addresses that ``host`` (address, CIDR network or host name) stands for."""
    try:
        return (ipaddress.ip_network(host, strict=False),)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        log.warning("node.peers: host %r does not resolve; that entry matches nothing", host)
        return ()
    return tuple({ipaddress.ip_network(str(i[4][0])) for i in infos})


class AccessPolicy:
    """Which calling AE titles may associate, and from where.

    No ``allowed_calling_aes`` and no ``peers``: anyone. Otherwise a calling AE title is
    accepted if it is in ``allowed_calling_aes`` (any address) or a ``peers`` entry names it
    and, when that entry has a ``host``, the connection comes from that host.
    """

    def __init__(self, config: NodeConfig) -> None:
        self.open = not config.allowed_calling_aes and not config.peers
        self._any_host = set(config.allowed_calling_aes)
        self._rules: dict[str, list[tuple[IPNetwork, ...] | None]] = {}
        for rule in config.peers:
            nets = None if rule.host is None else _networks(rule.host)
            self._rules.setdefault(rule.ae_title, []).append(nets)

    def allows(self, calling_ae: str, address: str) -> bool:
        """Whether ``calling_ae`` connecting from ``address`` may associate."""
        if self.open or calling_ae in self._any_host:
            return True
        rules = self._rules.get(calling_ae)
        if not rules:
            return False
        try:
            ip = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(nets is None or any(ip in n for n in nets) for nets in rules)


class DiskGuard:
    """The free-space floor of the file system holding ``path``.

    The answer is cached for ``ttl`` seconds so that a fast stream of instances does not
    call ``statvfs`` for every one.
    """

    def __init__(self, path: Path, min_free_mb: int, ttl: float = 0.5) -> None:
        self.path = path
        self.min_free = min_free_mb * 1024 * 1024
        self.ttl = ttl
        self._checked = -1e9
        self._free = 0
        self._lock = threading.Lock()

    def free_bytes(self) -> int:
        """Free bytes for unprivileged users (cached)."""
        with self._lock:
            now = time.monotonic()
            if now - self._checked > self.ttl:
                self._free = shutil.disk_usage(self.path).free
                self._checked = now
            return self._free

    def ok(self, incoming: int = 0) -> bool:
        """Whether ``incoming`` more bytes leave at least the floor free (always True if off)."""
        if self.min_free <= 0:
            return True
        try:
            return self.free_bytes() - incoming >= self.min_free
        except OSError:
            return False


class SeriesBudget:
    """Per-series instance and byte limits.

    Parameters
    ----------
    max_instances, max_bytes
        Limits; 0 means unlimited.
    load
        ``load(series_uid) -> (instances, bytes)`` already stored (from the ledger).
    """

    def __init__(
        self, max_instances: int, max_bytes: int, load: Callable[[str], tuple[int, int]]
    ) -> None:
        self.max_instances = max_instances
        self.max_bytes = max_bytes
        self._load = load
        self._totals: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether any limit is set."""
        return self.max_instances > 0 or self.max_bytes > 0

    def _get(self, series_uid: str) -> list[int]:
        t = self._totals.get(series_uid)
        if t is None:
            if len(self._totals) >= 4096:  # the ledger has the truth; reload when needed
                self._totals.clear()
            n, b = self._load(series_uid)
            t = self._totals[series_uid] = [n, b]
        return t

    def admits(self, series_uid: str, size: int) -> str | None:
        """None if one more instance of ``size`` bytes fits, else the reason it does not."""
        if not self.enabled:
            return None
        with self._lock:
            n, b = self._get(series_uid)
        if self.max_instances and n + 1 > self.max_instances:
            return f"series already has {n} instances (node.max_series_instances)"
        if self.max_bytes and b + size > self.max_bytes:
            return f"series would exceed {self.max_bytes // 2**20} MB (node.max_series_mb)"
        return None

    def add(self, series_uid: str, size: int) -> None:
        """Count a stored instance."""
        if not self.enabled:
            return
        with self._lock:
            t = self._get(series_uid)
            t[0] += 1
            t[1] += size
