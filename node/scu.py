"""The outbox: C-STORE every result object to every destination, with retry and backoff.

Each delivery (one object, one destination) is a ledger row. A delivery succeeds only on status
0x0000; any other status (warnings included, which are logged) or a connection failure is
retried with exponential backoff until ``dispatch.max_attempts``, then the delivery and its job
are marked failed, visible in ``segnode jobs``. The objects on disk never change, so a resend
after a crash is the same object (same SOP Instance UID).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

from pydicom import dcmread
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian
from pynetdicom import AE
from pynetdicom.sop_class import (  # type: ignore[attr-defined]
    Comprehensive3DSRStorage,
    SegmentationStorage,
    Verification,
)

from node.config import Config, Peer, parse_peer
from storage.ledger import DueDelivery, Ledger, backoff, utcnow

log = logging.getLogger(__name__)


def make_ae(calling_ae: str, timeout: float) -> AE:
    """An SCU application entity that can send SEG and SR (and echo)."""
    ae = AE(ae_title=calling_ae)
    ae.acse_timeout = timeout
    ae.dimse_timeout = timeout
    ae.network_timeout = timeout
    ae.connection_timeout = min(timeout, 10)
    for cls in (SegmentationStorage, Comprehensive3DSRStorage):
        ae.add_requested_context(cls, [ExplicitVRLittleEndian, ImplicitVRLittleEndian])
    ae.add_requested_context(Verification)
    return ae


class Dispatcher:
    """Sends due deliveries from the ledger; one thread.

    Parameters
    ----------
    config, ledger
        Node configuration and durable state.
    """

    def __init__(self, config: Config, ledger: Ledger) -> None:
        self.config = config
        self.ledger = ledger
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peers: dict[str, Peer] = {p.name: p for p in config.dispatch.destinations}

    def start(self) -> None:
        """Start the outbox thread."""
        self._thread = threading.Thread(target=self._run, name="segnode-outbox", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the send in progress."""
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                sent = self.run_once()
            except Exception:
                log.exception("outbox pass failed")
                sent = 0
            if sent:
                continue
            nxt = self.ledger.next_delivery_time()
            wait = 1.0
            if nxt is not None:
                wait = max(0.05, min(1.0, (nxt - utcnow()).total_seconds()))
            self.wake.wait(wait)
            self.wake.clear()

    def run_once(self) -> int:
        """Try every due delivery once, one association per destination; return how many sent."""
        due = self.ledger.due_deliveries()
        by_dest: dict[str, list[DueDelivery]] = defaultdict(list)
        for d in due:
            by_dest[d.destination].append(d)
        sent = 0
        for dest, items in by_dest.items():
            if self._stop.is_set():
                break
            sent += self._send_to(dest, items)
        return sent

    def _retry(self, d: DueDelivery, error: str, status: int | None = None) -> None:
        dc = self.config.dispatch
        if d.attempts + 1 >= dc.max_attempts:
            log.error(
                "delivery %d of job %d to %s failed for good: %s",
                d.id,
                d.job_id,
                d.destination,
                error,
            )
            self.ledger.delivery_failed(d.id, error)
            return
        delay = backoff(d.attempts, dc.retry_initial_s, dc.retry_max_s)
        self.ledger.delivery_retry(d.id, error, utcnow() + delay, status)
        log.warning(
            "delivery of job %d %s to %s: %s; retry in %.1f s",
            d.job_id,
            d.kind,
            d.destination,
            error,
            delay.total_seconds(),
        )

    def _send_to(self, dest: str, items: list[DueDelivery]) -> int:
        peer = self._peers.get(dest) or parse_peer(dest)
        dc = self.config.dispatch
        ae = make_ae(dc.calling_ae, dc.timeout_s)
        try:
            assoc = ae.associate(peer.host, peer.port, ae_title=peer.ae_title)
        except Exception as exc:  # socket errors surface here on some platforms
            for d in items:
                self._retry(d, f"cannot connect: {exc}")
            return 0
        if not assoc.is_established:
            why = "association rejected" if assoc.is_rejected else "cannot connect or associate"
            for d in items:
                self._retry(d, why)
            return 0
        sent = 0
        try:
            for d in items:
                if self._stop.is_set():
                    break
                try:
                    ds = dcmread(Path(d.path))
                except OSError as exc:
                    self.ledger.delivery_failed(d.id, f"result file unreadable: {exc}")
                    continue
                status = assoc.send_c_store(ds)
                code = int(getattr(status, "Status", -1)) if status else -1
                if code == 0x0000:
                    self.ledger.delivery_done(d.id, code)
                    sent += 1
                    log.info("job %d %s delivered to %s", d.job_id, d.kind, dest)
                elif code == -1:
                    self._retry(d, "no response (connection lost or timeout)")
                    if not assoc.is_established:
                        break
                else:
                    if 0xB000 <= code <= 0xBFFF:
                        log.warning("destination %s answered warning 0x%04X", dest, code)
                    self._retry(d, f"destination answered 0x{code:04X}", code)
        finally:
            if assoc.is_established:
                assoc.release()
        return sent


def echo(peer: Peer, calling_ae: str = "SEGNODE", timeout: float = 10.0) -> int:
    """C-ECHO ``peer``; return the status (or -1 when no association could be made)."""
    ae = make_ae(calling_ae, timeout)
    assoc = ae.associate(peer.host, peer.port, ae_title=peer.ae_title)
    if not assoc.is_established:
        return -1
    try:
        status = assoc.send_c_echo()
        return int(status.Status) if status else -1
    finally:
        assoc.release()


__all__ = ["Dispatcher", "echo", "make_ae", "timedelta"]
