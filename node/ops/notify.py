"""The systemd notification protocol (sd_notify(3)) without libsystemd.

Messages go as one datagram to the AF_UNIX socket named by ``$NOTIFY_SOCKET`` (a leading ``@``
means the abstract namespace). Without the variable every call is a no-op, so the node runs
the same in a terminal, in tests and under systemd.
"""

from __future__ import annotations

import os
import socket


class Notifier:
    """Sends ``READY=1``, ``STATUS=...``, ``WATCHDOG=1``, ``STOPPING=1``."""

    def __init__(self, address: str | None = None) -> None:
        addr = address if address is not None else os.environ.get("NOTIFY_SOCKET")
        self._addr: str | None = None
        if addr:
            self._addr = "\0" + addr[1:] if addr.startswith("@") else addr
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        """Whether a notify socket is configured."""
        return self._addr is not None

    def send(self, *lines: str) -> bool:
        """Send one datagram with ``lines`` joined by newlines; False if it could not be sent."""
        if self._addr is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.sendto("\n".join(lines).encode(), self._addr)
            return True
        except OSError:
            return False

    def watchdog_interval(self) -> float | None:
        """Half the watchdog timeout systemd asked for (``$WATCHDOG_USEC``), in seconds."""
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            return int(usec) / 2e6
        except ValueError:
            return None

    def close(self) -> None:
        """Close the socket."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
