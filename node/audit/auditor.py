"""The auditor: takes the node's audit messages, stores them durably and sends them to every
configured audit repository in order, retrying while a repository is down (IHE ATNA, ITI-20).

:meth:`Auditor.emit` encodes a message and commits it to the audit queue
(:mod:`segnode.node.audit.queue`) on the caller's thread, then wakes the senders; it does no
network I/O and never raises. One sender thread per destination reads the queue from that
destination's cursor, sends in order and moves the cursor only after a successful send (for
TLS: once the write returned, the guarantee RFC 5425 gives), waiting 1 s, 2 s, ... up to 30 s
between attempts while the destination fails. :class:`NullAuditor` has the same API and does
nothing (audit off, the default).

Must not touch: the node's configuration file (the config owner builds :class:`AuditSettings`)
and the events themselves, which the node's modules report through :meth:`Auditor.emit`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from segnode.node.audit.messages import AuditMessage
from segnode.node.audit.queue import ON_FULL, AuditQueue, QueuedMessage
from segnode.node.audit.syslog import (
    Destination,
    Transport,
    Undeliverable,
    format_message,
    parse_destination,
)

log = logging.getLogger(__name__)

QUEUE_FILE = "audit.sqlite"
RETRY_FIRST, RETRY_MAX = 1.0, 30.0


@dataclass(frozen=True)
class AuditSettings:
    """The ``[audit]`` settings.

    Parameters
    ----------
    enabled
        Whether the node audits at all (off by default).
    destinations
        Audit repositories: ``syslog+tls://HOST:PORT``, ``syslog+udp://HOST:PORT``,
        ``file:///path`` or ``file:relative/path`` (under the data directory).
    max_queued
        The audit queue's bound.
    on_full
        ``drop_oldest`` (lose the oldest messages) or ``refuse`` (refuse new ones; the node
        then refuses associations, :meth:`Auditor.admits`).
    tls_ca, tls_cert, tls_key
        The CA file that verifies the repositories' certificates (the system's CAs when
        unset), and the node's client certificate and key (optional).
    source_id, enterprise_site
        AuditSourceID (the host name when empty) and AuditEnterpriseSiteID.
    """

    enabled: bool = False
    destinations: tuple[str, ...] = ()
    max_queued: int = 100000
    on_full: str = "drop_oldest"
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    source_id: str = ""
    enterprise_site: str = ""

    def __post_init__(self) -> None:
        if self.on_full not in ON_FULL:
            raise ValueError(f"audit.on_full must be one of {ON_FULL}, not {self.on_full!r}")
        if self.max_queued < 1:
            raise ValueError(f"audit.max_queued must be at least 1, not {self.max_queued}")
        if self.enabled and not self.destinations:
            raise ValueError("audit.destinations: audit is enabled but names no destination")
        if len(set(self.destinations)) != len(self.destinations):
            raise ValueError("audit.destinations: a destination is listed twice")
        for i, url in enumerate(self.destinations):
            try:
                parse_destination(url)
            except ValueError as exc:
                raise ValueError(f"audit.destinations[{i}]: {exc}") from None
        if self.tls_key is not None and self.tls_cert is None:
            raise ValueError("audit.tls_key is set without audit.tls_cert")

    def parsed_destinations(self) -> list[Destination]:
        """The destinations, parsed."""
        return [parse_destination(url) for url in self.destinations]


@dataclass
class _DestinationState:
    connected: bool = False
    last_error: str | None = None
    last_sent: float | None = None
    sent: int = 0


class _Sender(threading.Thread):
    """Sends one destination's messages in order (see the module docstring)."""

    def __init__(self, auditor: Auditor, destination: Destination, transport: Transport) -> None:
        super().__init__(name=f"audit-{destination.kind}", daemon=True)
        self.auditor, self.destination, self.transport = auditor, destination, transport
        self.state = _DestinationState()
        self.wake = threading.Event()

    def _frame(self, message: QueuedMessage) -> bytes:
        return format_message(
            message.payload,
            severity=message.severity,
            hostname=self.auditor.hostname,
            app_name="segnode",
            procid=str(os.getpid()),
            timestamp=datetime.fromtimestamp(message.created, UTC),
        )

    def run(self) -> None:
        try:
            self._loop()
        except Exception:
            log.exception("audit: the sender for %s stopped", self.destination.url)
        finally:
            self.transport.close()
            self.state.connected = False

    def _loop(self) -> None:
        auditor, queue, url = self.auditor, self.auditor.queue, self.destination.url
        failures = 0
        while not (auditor.stopping.is_set() and time.monotonic() > auditor.deadline):
            self.wake.clear()
            batch = queue.fetch(url, self.transport.batch_size)
            if not batch:
                if auditor.stopping.is_set():
                    return
                self.wake.wait(5.0)
                continue
            try:
                try:
                    self.transport.send([self._frame(m) for m in batch])
                    sent = len(batch)
                except Undeliverable:
                    self._one_by_one(batch)  # counts what it sent
                    sent = 0
            except (OSError, ValueError) as exc:
                failures += 1
                self.state.connected = False
                self.state.last_error = f"{type(exc).__name__}: {exc}"
                if failures == 1:
                    log.warning("audit: cannot send to %s (%s); retrying", url, exc)
                if auditor.stopping.is_set():
                    return
                auditor.stopping.wait(min(RETRY_MAX, RETRY_FIRST * 2 ** (failures - 1)))
                continue
            queue.ack(url, batch[-1].seq)
            if failures:
                log.info("audit: %s takes messages again after %d failures", url, failures)
            failures = 0
            self.state.connected = self.transport.connected
            self.state.sent += sent
            self.state.last_sent = time.time()

    def _one_by_one(self, batch: list[QueuedMessage]) -> None:
        """Send ``batch`` a message at a time, skipping (with an error in the log) each one the
        transport can never carry, so that it does not hold the others back."""
        url = self.destination.url
        for message in batch:
            try:
                self.transport.send([self._frame(message)])
            except Undeliverable as exc:
                log.error("audit: message %d not sent to %s: %s", message.seq, url, exc)
            else:
                self.state.sent += 1
            self.auditor.queue.ack(url, message.seq)

    def status(self) -> dict[str, Any]:
        """This destination's part of :meth:`Auditor.status`."""
        state = self.state
        return {
            "connected": state.connected,
            "last_error": state.last_error,
            "last_sent": (
                datetime.fromtimestamp(state.last_sent, UTC).isoformat(timespec="seconds")
                if state.last_sent is not None
                else None
            ),
            "sent": state.sent,
        }


class Auditor:
    """Records and sends the node's audit messages (see the module docstring).

    Parameters
    ----------
    settings
        The audit settings; ``enabled`` must be true (:func:`make_auditor` chooses).
    data_dir
        The node's data directory: the queue is ``audit.sqlite`` there, and relative file
        destinations are under it.
    hostname
        HOSTNAME of the syslog header (the machine's host name by default).
    timeout
        Seconds a TLS connect or write may take.

    The queue is opened here, so that messages emitted before :meth:`start` (the application
    start) are recorded; they are sent once the senders run.
    """

    def __init__(
        self,
        settings: AuditSettings,
        data_dir: Path,
        *,
        hostname: str | None = None,
        timeout: float = 10.0,
    ) -> None:
        if not settings.enabled:
            raise ValueError("Auditor needs audit.enabled; use NullAuditor (make_auditor)")
        self.settings, self.data_dir, self.timeout = settings, data_dir, timeout
        self.hostname = hostname or socket.gethostname()
        self.stopping = threading.Event()
        self.deadline = float("inf")
        self._destinations = settings.parsed_destinations()
        self.queue = AuditQueue(
            data_dir / QUEUE_FILE,
            [d.url for d in self._destinations],
            max_messages=settings.max_queued,
            on_full=settings.on_full,
        )
        self._senders: list[_Sender] = []
        self._closed = False

    def start(self) -> None:
        """Start one sender thread per destination.

        Raises
        ------
        OSError, ssl.SSLError
            A TLS certificate or key file cannot be read.
        """
        for destination in self._destinations:
            transport = destination.transport(
                base=self.data_dir,
                ca_file=self.settings.tls_ca,
                cert_file=self.settings.tls_cert,
                key_file=self.settings.tls_key,
                timeout=self.timeout,
            )
            self._senders.append(_Sender(self, destination, transport))
        for sender in self._senders:
            sender.start()
        log.info("audit: sending to %s", ", ".join(d.url for d in self._destinations))

    def stop(self, timeout: float = 5.0) -> None:
        """Send what can be sent within ``timeout`` seconds, then stop the senders and close
        the queue; what is left stays queued for the next start. Never waits much longer than
        ``timeout``."""
        self.deadline = time.monotonic() + timeout
        self.stopping.set()
        for sender in self._senders:
            sender.wake.set()
        for sender in self._senders:
            sender.join(max(0.0, self.deadline - time.monotonic()) + 0.1)
        stuck = [s.destination.url for s in self._senders if s.is_alive()]
        if stuck:
            # A sender blocked in a connect or write: leave the queue open for it (daemon).
            log.warning("audit: senders still busy at stop: %s", ", ".join(stuck))
            return
        if not self._closed:
            left = self.queue.count()
            self._closed = True
            self.queue.close()
            if left:
                log.warning("audit: %d messages stay queued for the next start", left)

    def emit(self, message: AuditMessage) -> None:
        """Record ``message`` durably and wake the senders; never raises (failures are logged,
        without the message's content)."""
        what = message.event.event_id.meaning
        try:
            payload = message.to_xml()
            if self._closed:
                log.error("audit: %s emitted after the auditor stopped: not recorded", what)
                return
            if not self.queue.enqueue(payload, message.severity):
                log.debug("audit: %s refused, the audit queue is full", what)
                return
        except Exception:
            log.exception("audit: %s could not be recorded", what)
            return
        for sender in self._senders:
            sender.wake.set()

    def admits(self) -> bool:
        """False only when the queue is full and refuses new messages (``on_full="refuse"``):
        the node must then refuse new associations."""
        if self.settings.on_full != "refuse" or self._closed:
            return True
        try:
            return not self.queue.full()
        except Exception:
            log.exception("audit: the audit queue cannot be read")
            return False

    def status(self) -> dict[str, Any]:
        """Queued, sent, dropped and refused counts, and per destination whether it is
        connected, its last error and when it was last sent a message."""
        destinations = {s.destination.url: s.status() for s in self._senders}
        queued: int | None = None
        if not self._closed:
            try:
                queued = self.queue.count()
                for url, entry in destinations.items():
                    entry["pending"] = self.queue.pending(url)
            except Exception:
                log.exception("audit: the audit queue cannot be read")
        return {
            "enabled": True,
            "queued": queued,
            "sent": sum(s.state.sent for s in self._senders),
            "dropped": self.queue.dropped,
            "refused": self.queue.refused,
            "destinations": destinations,
        }


class NullAuditor:
    """The auditor when audit is off: the same API, doing nothing."""

    def start(self) -> None:
        """Nothing to start."""

    def stop(self, timeout: float = 5.0) -> None:
        """Nothing to stop."""

    def emit(self, message: AuditMessage) -> None:
        """Discard ``message``."""

    def admits(self) -> bool:
        """Always true."""
        return True

    def status(self) -> dict[str, Any]:
        """Audit is off."""
        return {
            "enabled": False,
            "queued": 0,
            "sent": 0,
            "dropped": 0,
            "refused": 0,
            "destinations": {},
        }


def make_auditor(settings: AuditSettings, data_dir: Path) -> Auditor | NullAuditor:
    """An :class:`Auditor` when audit is enabled, else a :class:`NullAuditor`."""
    return Auditor(settings, data_dir) if settings.enabled else NullAuditor()
