"""The outbox: C-STORE every result object to every destination, with retry and backoff.

Each delivery (one object, one destination) is a ledger row. A delivery succeeds only on status
0x0000. The objects on disk never change, so a resend after a crash is the same object (same
SOP Instance UID); delivery is at least once, and a destination that stores by SOP Instance UID
(PS3.4 §B.4.1) keeps one copy.

Two kinds of failure are kept apart:

* **The object failed** - the destination answered a failure or warning status, or the
  connection was lost waiting for the answer. That uses one of the delivery's attempts; the
  next try waits an exponential backoff with jitter (``dispatch.retry_initial_s`` doubled per
  attempt, at most ``dispatch.retry_max_s``, of which half is random so that many nodes or
  objects do not retry in step). After ``dispatch.max_attempts`` the delivery and its job fail.
* **The destination cannot be reached** - connection refused or timed out, association
  rejected. That says nothing about the objects: no attempt is used. The destination backs
  off as a whole, and after ``dispatch.breaker_failures`` consecutive failures its circuit
  breaker opens: the destination is skipped for ``dispatch.breaker_cooldown_s``, then one
  association probes it. The breaker lives in memory (a restart closes it); everything that
  must survive a restart - what is due when, the last error - is in the ledger.

A delivery still pending ``dispatch.max_age_s`` after it was created fails with that reason,
visible in ``segnode jobs``; ``segnode retry --failed`` requeues such jobs.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from pydicom import dcmread
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian
from pynetdicom import AE
from pynetdicom.sop_class import (  # type: ignore[attr-defined]
    Comprehensive3DSRStorage,
    KeyObjectSelectionDocumentStorage,
    SegmentationStorage,
    Verification,
)

from node.config import Config, Peer
from node.destinations import SENDER, Target, from_name, index
from node.stow import StowFailed, StowTarget, StowUnreachable
from node.stow import store as stow_store
from node.tls import tls_args
from storage.ledger import DueDelivery, Ledger, utcnow

log = logging.getLogger(__name__)


def make_ae(calling_ae: str, timeout: float) -> AE:
    """An SCU application entity that can send SEG and SR (and echo)."""
    ae = AE(ae_title=calling_ae)
    ae.acse_timeout = timeout
    ae.dimse_timeout = timeout
    ae.network_timeout = timeout
    ae.connection_timeout = min(timeout, 10)
    for cls in (SegmentationStorage, Comprehensive3DSRStorage, KeyObjectSelectionDocumentStorage):
        ae.add_requested_context(cls, [ExplicitVRLittleEndian, ImplicitVRLittleEndian])
    ae.add_requested_context(Verification)
    return ae


def jittered_backoff(attempts: int, initial: float, maximum: float, rng: random.Random) -> float:
    """Seconds to wait after ``attempts`` failures: "equal jitter" exponential backoff.

    The exponential delay ``min(maximum, initial * 2**attempts)`` is split in half: one half
    is always waited, the other is uniformly random.
    """
    base = min(maximum, initial * (2 ** min(max(0, attempts), 62)))
    return float(base / 2 + rng.uniform(0, base / 2))


@dataclass
class _BreakerState:
    failures: int = 0
    open_until: float = 0.0


class CircuitBreakers:
    """One circuit breaker per destination (connection-level failures only).

    Parameters
    ----------
    threshold
        Consecutive connection failures that open the breaker.
    cooldown
        Seconds an open breaker skips its destination before one probe is allowed.
    initial, maximum
        Backoff between connection attempts while the breaker is still closed.
    rng
        Source of jitter.
    clock
        Monotonic clock (seconds).
    """

    def __init__(
        self,
        threshold: int,
        cooldown: float,
        initial: float,
        maximum: float,
        rng: random.Random,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.initial = initial
        self.maximum = maximum
        self._rng = rng
        self._clock = clock or time.monotonic
        self._state: dict[str, _BreakerState] = defaultdict(_BreakerState)
        self._lock = threading.Lock()

    def blocked_for(self, dest: str) -> float:
        """Seconds the breaker of ``dest`` still skips it (0: an attempt may be made)."""
        with self._lock:
            st = self._state.get(dest)
            return 0.0 if st is None else max(0.0, st.open_until - self._clock())

    def is_open(self, dest: str) -> bool:
        """Whether ``dest`` has failed ``threshold`` times in a row (open or half-open)."""
        with self._lock:
            st = self._state.get(dest)
            return st is not None and st.failures >= self.threshold

    def failure(self, dest: str) -> tuple[float, bool]:
        """Record a connection failure; return ``(seconds to wait, breaker just opened)``."""
        with self._lock:
            st = self._state[dest]
            st.failures += 1
            if st.failures >= self.threshold:
                wait = self.cooldown * self._rng.uniform(0.9, 1.1)
                opened = st.failures == self.threshold
            else:
                wait = jittered_backoff(st.failures - 1, self.initial, self.maximum, self._rng)
                opened = False
            st.open_until = self._clock() + wait
            return wait, opened

    def success(self, dest: str) -> bool:
        """Record a successful association; return True if the breaker was open."""
        with self._lock:
            st = self._state.pop(dest, None)
            return st is not None and st.failures >= self.threshold


class Dispatcher:
    """Sends due deliveries from the ledger; one thread.

    Parameters
    ----------
    config, ledger
        Node configuration and durable state.
    rng
        Source of jitter (tests pass a seeded one).
    """

    def __init__(self, config: Config, ledger: Ledger, rng: random.Random | None = None) -> None:
        self.config = config
        self.ledger = ledger
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Every destination the configuration names, by ledger name (with TLS and credentials).
        self._targets: dict[str, Target] = index(config.configured_destinations())
        self._tls: dict[str, tuple[ssl.SSLContext, str] | None] = {}
        self._rng = rng or random.Random()
        dc = config.dispatch
        self.breakers = CircuitBreakers(
            dc.breaker_failures,
            dc.breaker_cooldown_s,
            dc.retry_initial_s,
            dc.retry_max_s,
            self._rng,
        )
        self._last_expiry = -1e9

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

    def is_alive(self) -> bool:
        """Whether the outbox thread runs (for the watchdog)."""
        return self._thread is not None and self._thread.is_alive()

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

    def expire(self) -> list[int]:
        """Fail deliveries pending longer than ``dispatch.max_age_s``; return the jobs failed."""
        age = self.config.dispatch.max_age_s
        if age <= 0:
            return []
        jobs = self.ledger.expire_deliveries(
            utcnow() - timedelta(seconds=age),
            f"not delivered within dispatch.max_age_s ({age:g} s)",
        )
        for job_id in jobs:
            log.error("job %d: delivery not done within dispatch.max_age_s; job failed", job_id)
        return jobs

    def run_once(self) -> int:
        """Try every due delivery once, one association per destination; return how many sent."""
        if time.monotonic() - self._last_expiry > min(5.0, self.config.dispatch.max_age_s / 4):
            self._last_expiry = time.monotonic()
            self.expire()
        due = self.ledger.due_deliveries()
        by_dest: dict[str, list[DueDelivery]] = defaultdict(list)
        for d in due:
            by_dest[d.destination].append(d)
        sent = 0
        for dest, items in by_dest.items():
            if self._stop.is_set():
                break
            left = self.breakers.blocked_for(dest)
            if left > 0:
                # Circuit open (or backing off): skip without using attempts.
                self.ledger.defer_destination(
                    dest,
                    utcnow() + timedelta(seconds=left),
                    "destination unreachable; waiting",
                    record=False,
                )
                continue
            sent += self._send_to(dest, items)
        return sent

    def _retry(self, d: DueDelivery, error: str, status: int | None = None) -> None:
        """The object failed: use an attempt; back off or give up."""
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
        delay = jittered_backoff(d.attempts, dc.retry_initial_s, dc.retry_max_s, self._rng)
        self.ledger.delivery_retry(d.id, error, utcnow() + timedelta(seconds=delay), status)
        log.warning(
            "delivery of job %d %s to %s: %s; retry in %.1f s",
            d.job_id,
            d.kind,
            d.destination,
            error,
            delay,
        )

    def _unreachable(self, dest: str, why: str) -> None:
        """The destination failed: no attempt used; destination-wide backoff / breaker."""
        wait, opened = self.breakers.failure(dest)
        self.ledger.defer_destination(dest, utcnow() + timedelta(seconds=wait), why)
        if opened:
            log.error(
                "%s unreachable %d times in a row (%s): circuit open, next try in %.0f s",
                dest,
                self.breakers.threshold,
                why,
                wait,
            )
        else:
            log.warning("%s unreachable (%s); next try in %.1f s", dest, why, wait)

    def _tls_args(self, peer: Peer) -> tuple[ssl.SSLContext, str] | None:
        if peer.name not in self._tls:
            self._tls[peer.name] = tls_args(peer)
        return self._tls[peer.name]

    def _send_to(self, dest: str, items: list[DueDelivery]) -> int:
        target = self._targets.get(dest) or from_name(dest)
        if target is None:
            if dest.startswith(SENDER + ":"):
                why = (
                    f"no return address for calling AE {dest[len(SENDER) + 1 :]!r}: "
                    "give it a [[node.peers]] entry with host and port"
                )
            else:
                why = f"unknown destination {dest!r}"
            for d in items:
                self.ledger.delivery_failed(d.id, why)
            return 0
        if isinstance(target, StowTarget):
            return self._send_stow(target, items)
        peer = target
        dc = self.config.dispatch
        ae = make_ae(dc.calling_ae, dc.timeout_s)
        try:
            assoc = ae.associate(
                peer.host, peer.port, ae_title=peer.ae_title, tls_args=self._tls_args(peer)
            )
        except Exception as exc:  # TLS files, socket errors: a boundary, the peer is unusable
            self._unreachable(dest, f"cannot connect: {exc}")
            return 0
        if not assoc.is_established:
            why = "association rejected" if assoc.is_rejected else "cannot connect or associate"
            self._unreachable(dest, why)
            return 0
        if self.breakers.success(dest):
            log.info("%s reachable again: circuit closed", dest)
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

    def _send_stow(self, target: StowTarget, items: list[DueDelivery]) -> int:
        """DICOMweb STOW-RS, one request per object (:mod:`node.stow`); same bookkeeping."""
        dest = target.name
        sent = 0
        for d in items:
            if self._stop.is_set():
                break
            try:
                data = Path(d.path).read_bytes()
            except OSError as exc:
                self.ledger.delivery_failed(d.id, f"result file unreadable: {exc}")
                continue
            try:
                timeout = self.config.dispatch.timeout_s
                result = stow_store(target, data, d.sop_instance_uid, timeout)
            except StowUnreachable as exc:
                self._unreachable(dest, str(exc))
                break
            except StowFailed as exc:
                if exc.status is not None and self.breakers.success(dest):
                    log.info("%s reachable again: circuit closed", dest)
                self._retry(d, str(exc))
                continue
            if self.breakers.success(dest):
                log.info("%s reachable again: circuit closed", dest)
            if result.warning is not None:
                log.warning("destination %s stored with %s", dest, result.warning)
            self.ledger.delivery_done(d.id, f"HTTP {result.http_status}")
            sent += 1
            log.info("job %d %s delivered to %s", d.job_id, d.kind, dest)
        return sent


def echo(peer: Peer, calling_ae: str = "SEGNODE", timeout: float = 10.0) -> int:
    """C-ECHO ``peer`` (over TLS when it has ``tls``); return the status, -1 without association."""
    ae = make_ae(calling_ae, timeout)
    assoc = ae.associate(peer.host, peer.port, ae_title=peer.ae_title, tls_args=tls_args(peer))
    if not assoc.is_established:
        return -1
    try:
        status = assoc.send_c_echo()
        return int(status.Status) if status else -1
    finally:
        assoc.release()


__all__ = ["CircuitBreakers", "Dispatcher", "echo", "jittered_backoff", "make_ae"]
