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
  objects do not retry in step). After ``dispatch.max_attempts`` the delivery and its job fail,
  and the job's other deliveries not yet sent are cancelled with that reason (none stays
  pending for a job that is over).
* **The destination cannot be reached** - connection refused or timed out, association
  rejected. That says nothing about the objects: no attempt is used. The destination backs
  off as a whole, and after ``dispatch.breaker_failures`` consecutive failures its circuit
  breaker opens: the destination is skipped for ``dispatch.breaker_cooldown_s``, then one
  association probes it. The breaker lives in memory (a restart closes it); everything that
  must survive a restart - what is due when, the last error - is in the ledger.

A delivery still pending ``dispatch.max_age_s`` after it was created fails with that reason,
visible in ``segnode jobs``; ``segnode retry --failed`` requeues such jobs: every delivery not
yet sent is pending again with its attempts at 0 and its age counted from the retry (the
earlier attempts stay in the job's events); sent ones are not sent again. ``segnode cancel``
cancels a job's unsent deliveries with it, and a retry of that job makes them pending again
in the same way.

Per destination the results go in order, SEG first, then SR (then a rejection note): the
ledger does not make a result due while an earlier one of its job to the same destination is
unacknowledged and not due itself, and within a pass a result is sent only once the earlier
ones it waits on were accepted (:class:`InOrder`), so an SR never reaches a destination that
has not accepted its SEG.

A C-STORE sends the result file's dataset bytes as the worker wrote them (PS3.10, Explicit VR
Little Endian): nothing is decoded or encoded again, unless the destination accepted only
another transfer syntax for the SOP class (:meth:`Dispatcher._store`). The association to a
destination stays open ``dispatch.keep_open_s`` after a batch for the next job's objects
(:class:`KeptAssociations`); one the peer closed meanwhile is replaced without using an attempt.
"""

from __future__ import annotations

import logging
import random
import socket
import ssl
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from pydicom import dcmread
from pydicom.errors import InvalidDicomError
from pydicom.filereader import read_file_meta_info
from pydicom.uid import UID, ExplicitVRLittleEndian, ImplicitVRLittleEndian
from pynetdicom import AE, evt
from pynetdicom import _config as pynetdicom_config
from pynetdicom.association import Association
from pynetdicom.pdu_primitives import MaximumLengthNotification
from pynetdicom.sop_class import (  # type: ignore[attr-defined]
    Comprehensive3DSRStorage,
    KeyObjectSelectionDocumentStorage,
    SegmentationStorage,
    Verification,
)

from segnode.node.config import Config
from segnode.node.dicom.tls import tls_args
from segnode.node.outbox.stow import StowFailed, StowTarget, StowUnreachable
from segnode.node.outbox.stow import store as stow_store
from segnode.node.peers import Peer
from segnode.node.results.build import LABEL_MAP_SEGMENTATION_STORAGE
from segnode.node.routing.destinations import SENDER, Target, from_name, index
from segnode.storage.ledger import DueDelivery, Ledger, utcnow

log = logging.getLogger(__name__)


def make_ae(calling_ae: str, timeout: float, keep_open: float = 0.0) -> AE:
    """An SCU application entity that can send SEG and SR (and echo).

    Each storage SOP class is proposed in two presentation contexts, Explicit VR Little Endian
    (the result files' own transfer syntax, sent as they are) and Implicit VR Little Endian
    (the fallback, re-encoded), so that a destination supporting both accepts the first rather
    than choosing Implicit from a single context (PS3.8 §9.3.2.2).

    Parameters
    ----------
    calling_ae
        Our AE title.
    timeout
        Seconds for the connection, the association and each response.
    keep_open
        Seconds an association may stay idle between batches (``dispatch.keep_open_s``):
        pynetdicom's own idle limit (``network_timeout``) is set above it.
    """
    ae = AE(ae_title=calling_ae)
    ae.acse_timeout = timeout
    ae.dimse_timeout = timeout
    ae.network_timeout = keep_open + timeout
    ae.connection_timeout = min(timeout, 10)
    for cls in (
        SegmentationStorage,
        LABEL_MAP_SEGMENTATION_STORAGE,
        Comprehensive3DSRStorage,
        KeyObjectSelectionDocumentStorage,
    ):
        ae.add_requested_context(cls, ExplicitVRLittleEndian)
        ae.add_requested_context(cls, ImplicitVRLittleEndian)
    ae.add_requested_context(Verification)
    return ae


_chunked_lock = threading.Lock()
_chunked_users = 0
_chunked_saved = False


@contextmanager
def file_bytes_sends() -> Iterator[None]:
    """While inside, ``Association.send_c_store(path)`` sends the file's dataset bytes as they are.

    pynetdicom reads its process-wide ``STORE_SEND_CHUNKED_DATASET`` when ``send_c_store``
    starts: when true, a file path is not decoded; the bytes after the File Meta Information
    go out in P-DATA fragments of the peer's maximum PDU, read from the file as they are sent,
    over an accepted context of the file's own transfer syntax only. The setting is turned on
    only while the outbox's own sends are in flight (counted, so that two outboxes in one
    process do not turn it off under each other) and restored afterwards, so that other code
    sending a path (the ``segnode send`` command, tests) keeps pynetdicom's decoding default;
    in ``segnode serve`` the outbox is the only C-STORE SCU.
    """
    global _chunked_users, _chunked_saved
    with _chunked_lock:
        if _chunked_users == 0:
            _chunked_saved = pynetdicom_config.STORE_SEND_CHUNKED_DATASET
            pynetdicom_config.STORE_SEND_CHUNKED_DATASET = True
        _chunked_users += 1
    try:
        yield
    finally:
        with _chunked_lock:
            _chunked_users -= 1
            if _chunked_users == 0:
                pynetdicom_config.STORE_SEND_CHUNKED_DATASET = _chunked_saved


@dataclass(frozen=True)
class Backoff:
    """The outbox's retry delays: "equal jitter" exponential backoff.

    The exponential delay ``min(maximum, initial * 2**attempts)`` is split in half: one half
    is always waited, the other is uniformly random (from ``rng``), so that many nodes or
    objects do not retry in step. One backoff serves a delivery's retries and a destination's
    connection attempts while its breaker is closed.
    """

    initial: float
    maximum: float
    rng: random.Random = field(default_factory=random.Random, compare=False)

    def delay(self, attempts: int) -> float:
        """Seconds to wait after ``attempts`` failures."""
        base = min(self.maximum, self.initial * (2 ** min(max(0, attempts), 62)))
        return float(base / 2 + self.rng.uniform(0, base / 2))


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
    backoff
        Waits between connection attempts while the breaker is still closed (its ``rng``
        also jitters the cooldown).
    clock
        Monotonic clock (seconds).
    """

    def __init__(
        self,
        threshold: int,
        cooldown: float,
        backoff: Backoff,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self.backoff = backoff
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
                wait = self.cooldown * self.backoff.rng.uniform(0.9, 1.1)
                opened = st.failures == self.threshold
            else:
                wait = self.backoff.delay(st.failures - 1)
                opened = False
            st.open_until = self._clock() + wait
            return wait, opened

    def success(self, dest: str) -> bool:
        """Record a successful association; return True if the breaker was open."""
        with self._lock:
            st = self._state.pop(dest, None)
            return st is not None and st.failures >= self.threshold


class InOrder:
    """Within one pass to one destination: whether a job's next result may be sent.

    A result waits on the earlier results of its job to the destination that were not
    acknowledged when it was selected (:attr:`~segnode.storage.ledger.DueDelivery.waits_on`);
    it goes only once this pass has seen all of them accepted. Once one of a job's results
    is not accepted (refused, no answer, not sent), the job's later ones wait for a later
    pass, where the ledger holds them back until the earlier one is due again.
    """

    def __init__(self) -> None:
        self._accepted: dict[int, int] = defaultdict(int)
        self._held: set[int] = set()

    def may_send(self, d: DueDelivery) -> bool:
        """Whether every earlier result ``d`` waits on was accepted in this pass."""
        if d.job_id in self._held or self._accepted[d.job_id] < d.waits_on:
            self._held.add(d.job_id)
            return False
        return True

    def outcome(self, d: DueDelivery, accepted: bool) -> None:
        """Record whether ``d`` was accepted (anything else holds its job's later results)."""
        if accepted:
            self._accepted[d.job_id] += 1
        else:
            self._held.add(d.job_id)


class KeptAssociations:
    """Established C-STORE associations kept open between batches, one per destination.

    The outbox thread owns it (no lock): before a batch it takes the destination's
    association (:meth:`take`) and puts it back after (:meth:`put`); :meth:`close_idle` runs at
    each wake-up of the outbox loop and releases those idle ``keep_open`` seconds;
    :meth:`close_all` runs when the outbox stops. With ``keep_open`` 0 every association is
    released after its batch. One the peer released or aborted while idle (or whose
    connection closed) is dropped when next looked at.

    Parameters
    ----------
    keep_open
        Seconds an association may stay idle (``dispatch.keep_open_s``).
    clock
        Monotonic clock (seconds).
    """

    def __init__(self, keep_open: float, clock: Callable[[], float] | None = None) -> None:
        self.keep_open = keep_open
        self._clock = clock or time.monotonic
        self._idle: dict[str, tuple[Association, float]] = {}

    def __len__(self) -> int:
        return len(self._idle)

    def take(self, dest: str) -> Association | None:
        """The open association to ``dest``, or None (then the caller opens one)."""
        entry = self._idle.pop(dest, None)
        if entry is None:
            return None
        assoc, since = entry
        if not assoc.is_established:
            log.debug("%s closed the idle association (%s)", dest, _ended(assoc))
            return None
        if self._clock() - since >= self.keep_open:
            _release(assoc)
            return None
        return assoc

    def put(self, dest: str, assoc: Association) -> None:
        """Keep ``assoc`` for the next batch to ``dest``, or release it (``keep_open`` 0)."""
        if self.keep_open > 0 and assoc.is_established:
            old = self._idle.pop(dest, None)
            if old is not None and old[0] is not assoc:
                _release(old[0])
            self._idle[dest] = (assoc, self._clock())
        else:
            _release(assoc)

    def close_idle(self) -> float | None:
        """Release associations idle ``keep_open`` seconds or more; drop those the peer
        closed. Returns the seconds until the next one is due, None when none is open."""
        now = self._clock()
        due: float | None = None
        for dest, (assoc, since) in list(self._idle.items()):
            left = since + self.keep_open - now
            if not assoc.is_established:
                log.debug("%s closed the idle association (%s)", dest, _ended(assoc))
                del self._idle[dest]
            elif left <= 0:
                del self._idle[dest]
                log.debug("releasing the association to %s, idle %.1f s", dest, now - since)
                _release(assoc)
            else:
                due = left if due is None else min(due, left)
        return due

    def close_all(self) -> None:
        """Release every kept association (the outbox stops)."""
        while self._idle:
            _, (assoc, _) = self._idle.popitem()
            _release(assoc)


SEND_PDU_BYTES = 1 << 20
"""Largest P-DATA PDU the outbox sends, even to a peer that takes larger ones (PS3.8 9.3.1
lets a sender stay below the peer's maximum). A peer announcing "unlimited" (0) would
otherwise get a 19 MB SEG as one PDU: pynetdicom builds it with two whole copies and the
peer can parse nothing before the last byte arrives. 1 MiB PDUs overlap both sides: a 19 MB
SEG to pynetdicom's SCP on loopback took 34 ms against 41-56 ms as one PDU (2 CPUs)."""


def _cap_send_pdu(assoc: Association) -> None:
    """Send PDUs of at most :data:`SEND_PDU_BYTES` on ``assoc`` (the peer's negotiated
    maximum, as pynetdicom reads it for sending, lowered after the negotiation)."""
    for item in assoc.acceptor.user_information:
        if isinstance(item, MaximumLengthNotification):
            peer = item.maximum_length_received or 0
            if peer == 0 or peer > SEND_PDU_BYTES:
                item.maximum_length_received = SEND_PDU_BYTES


def _no_delay(event: evt.Event) -> None:
    """Send each PDU at once (``TCP_NODELAY``) on an outbox connection.

    A C-STORE request is written as a small command PDU followed by the dataset's PDUs. With
    Nagle's algorithm on (the socket default, and pynetdicom's), a small write waits for the
    peer's acknowledgement of the previous one, which the peer's delayed-ACK timer holds back
    by up to 40 ms once the connection has left its quick-ACK start: over a kept-open
    association every object after the first paid that stall (measured on the H200: the SR's
    acknowledgement 50 ms after the SEG's; docs/performance.md).
    """
    sock = getattr(event.assoc.dul.socket, "socket", None)
    if sock is not None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:  # not TCP (tests), or already closed: leave it as it is
            log.debug("TCP_NODELAY not set: %s", exc)


def _release(assoc: Association) -> None:
    """A-RELEASE an association that is still established (PS3.8 §7.2)."""
    if assoc.is_established:
        assoc.release()


def _ended(assoc: Association) -> str:
    """How an association that is no longer established ended, for the log."""
    if assoc.is_released:
        return "A-RELEASE"
    if assoc.is_aborted:
        return "A-ABORT or connection closed"
    return "connection closed"


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
        dc = config.dispatch
        self.backoff = Backoff(dc.retry_initial_s, dc.retry_max_s, rng or random.Random())
        self.breakers = CircuitBreakers(dc.breaker_failures, dc.breaker_cooldown_s, self.backoff)
        self._last_expiry = -1e9
        self.kept = KeptAssociations(dc.keep_open_s)
        self._msg_id = 0

    def start(self) -> None:
        """Start the outbox thread."""
        self._thread = threading.Thread(target=self._run, name="segnode-outbox", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the send in progress; release the kept-open associations."""
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            # The thread released its own on the way out; this is for run_once callers.
            self.kept.close_all()

    def is_alive(self) -> bool:
        """Whether the outbox thread runs (for the watchdog)."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    sent = self.run_once()
                    idle = self.kept.close_idle()
                except Exception:
                    log.exception("outbox pass failed")
                    sent, idle = 0, None
                if sent:
                    continue
                nxt = self.ledger.next_delivery_time()
                wait = 1.0
                if nxt is not None:
                    wait = min(wait, (nxt - utcnow()).total_seconds())
                if idle is not None:
                    wait = min(wait, idle)
                self.wake.wait(max(0.05, wait))
                self.wake.clear()
        finally:
            self.kept.close_all()

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
        """Try every due delivery once, one association per destination (kept open for the
        next pass, ``dispatch.keep_open_s``); return how many were sent."""
        if time.monotonic() - self._last_expiry > min(5.0, self.config.dispatch.max_age_s / 4):
            self._last_expiry = time.monotonic()
            self.expire()
        due = self.ledger.due_deliveries(claim_s=self.claim_s)
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
        delay = self.backoff.delay(d.attempts)
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
        assoc = self.kept.take(dest)
        # An association kept from an earlier batch may have been ended by the peer just now,
        # unseen (an A-ABORT or a closed connection crossing our request; or a firewall that
        # dropped the idle connection): its first object that gets no answer is sent again on
        # a new association without using an attempt. After one answer it is known to work.
        untried = assoc is not None
        if assoc is None and (assoc := self._associate(dest, peer)) is None:
            return 0
        sent = 0
        order = InOrder()
        try:
            for d in items:
                if self._stop.is_set():
                    break
                if not order.may_send(d):
                    log.debug("job %d %s to %s waits for an earlier result", d.job_id, d.kind, dest)
                    continue
                if not assoc.is_established:
                    # The peer released or aborted after the last object (some close after
                    # each): a new association, no attempt used.
                    if (assoc := self._associate(dest, peer)) is None:
                        break
                    untried = False
                if not self._claimed(d):
                    order.outcome(d, False)
                    continue
                code = self._store(assoc, d)
                if code == -1 and untried:
                    # pynetdicom has aborted it (no answer ends an association).
                    log.info("no answer on the kept-open association to %s; a new one", dest)
                    if (assoc := self._associate(dest, peer)) is None:
                        break
                    if not self._claimed(d):
                        order.outcome(d, False)
                        continue
                    code = self._store(assoc, d)
                untried = False
                order.outcome(d, code == 0x0000)
                if code is None:
                    continue
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
            if assoc is not None:
                self.kept.put(dest, assoc)
        return sent

    @property
    def claim_s(self) -> float:
        """How long a claimed delivery is this node's on a shared ledger: the lease, or two
        send timeouts when longer (an attempt renews it)."""
        return max(self.config.ledger.lease_s, 2 * self.config.dispatch.timeout_s)

    def _claimed(self, d: DueDelivery) -> bool:
        """Stamp the start of an attempt; False when another node took the delivery over
        (this node's claim ran out) or it was settled meanwhile (its job cancelled or
        failed): it is not sent."""
        if self.ledger.delivery_sending(d.id, self.claim_s):
            return True
        log.info(
            "job %d %s to %s: cancelled, or taken over by another node; not sent",
            d.job_id,
            d.kind,
            d.destination,
        )
        return False

    def _associate(self, dest: str, peer: Peer) -> Association | None:
        """Open an association to ``peer``; None (and the destination backs off) if it fails."""
        dc = self.config.dispatch
        ae = make_ae(dc.calling_ae, dc.timeout_s, dc.keep_open_s)
        try:
            assoc = ae.associate(
                peer.host,
                peer.port,
                ae_title=peer.ae_title,
                tls_args=self._tls_args(peer),
                evt_handlers=[(evt.EVT_CONN_OPEN, _no_delay)],
            )
        except Exception as exc:  # TLS files, socket errors: a boundary, the peer is unusable
            self._unreachable(dest, f"cannot connect: {exc}")
            return None
        if not assoc.is_established:
            why = "association rejected" if assoc.is_rejected else "cannot connect or associate"
            self._unreachable(dest, why)
            return None
        if self.breakers.success(dest):
            log.info("%s reachable again: circuit closed", dest)
        _cap_send_pdu(assoc)
        return assoc

    def _store(self, assoc: Association, d: DueDelivery) -> int | None:
        """C-STORE the result file of ``d``; return the status, -1 for no response, None when
        the delivery was settled here (file unreadable, no presentation context).

        The request's SOP Class and Instance UIDs and the transfer syntax come from the file's
        File Meta Information (PS3.10 §7.1), checked against the ledger's row; the dataset is
        sent as the bytes that follow it (:func:`file_bytes_sends`) over a context of that
        transfer syntax. Only when the destination accepted another transfer syntax for the
        SOP class (Implicit VR Little Endian) is the file decoded and encoded again.
        """
        try:
            meta = read_file_meta_info(d.path)
        except (OSError, InvalidDicomError) as exc:
            self.ledger.delivery_failed(d.id, f"result file unreadable: {exc}")
            return None
        sop_class = str(meta.get("MediaStorageSOPClassUID", ""))
        sop_instance = str(meta.get("MediaStorageSOPInstanceUID", ""))
        syntax = str(meta.get("TransferSyntaxUID", ""))
        if sop_instance != d.sop_instance_uid or d.sop_class_uid not in ("", sop_class):
            why = f"result file {d.path} holds {sop_instance or 'no SOP Instance UID'}"
            self.ledger.delivery_failed(d.id, f"{why}, not the ledger's {d.sop_instance_uid}")
            return None
        contexts = [
            cx for cx in assoc.accepted_contexts if cx.abstract_syntax == sop_class and cx.as_scu
        ]
        if not contexts:
            self._retry(d, f"no presentation context accepted for {UID(sop_class).name}")
            return None
        self._msg_id = self._msg_id % 0xFFFF + 1
        try:
            if any(cx.transfer_syntax[0] == syntax for cx in contexts):
                with file_bytes_sends():
                    status = assoc.send_c_store(Path(d.path), msg_id=self._msg_id)
            else:
                log.debug(
                    "%s accepted %s for %s only: re-encoding job %d %s",
                    d.destination,
                    UID(contexts[0].transfer_syntax[0]).name,
                    UID(sop_class).name,
                    d.job_id,
                    d.kind,
                )
                status = assoc.send_c_store(dcmread(d.path), msg_id=self._msg_id)
        except OSError as exc:
            self.ledger.delivery_failed(d.id, f"result file unreadable: {exc}")
            return None
        except RuntimeError:  # the association ended just before the request
            return -1
        return int(getattr(status, "Status", -1)) if status else -1

    def _send_stow(self, target: StowTarget, items: list[DueDelivery]) -> int:
        """DICOMweb STOW-RS, one request per object (:mod:`segnode.node.outbox.stow`); same
        bookkeeping."""
        sent = 0
        order = InOrder()
        for d in items:
            if self._stop.is_set():
                break
            if not order.may_send(d):
                continue
            outcome = self._stow_one(target, d)
            if outcome is None:
                break
            order.outcome(d, outcome)
            sent += outcome
        return sent

    def _stow_one(self, target: StowTarget, d: DueDelivery) -> bool | None:
        """STOW-RS the result file of ``d``; return whether it was stored, None when the
        destination cannot be reached (the pass to it ends)."""
        dest = target.name
        try:
            data = Path(d.path).read_bytes()
        except OSError as exc:
            self.ledger.delivery_failed(d.id, f"result file unreadable: {exc}")
            return False
        if not self._claimed(d):
            return False
        try:
            timeout = self.config.dispatch.timeout_s
            result = stow_store(target, data, d.sop_instance_uid, timeout)
        except StowUnreachable as exc:
            self._unreachable(dest, str(exc))
            return None
        except StowFailed as exc:
            if exc.status is not None and self.breakers.success(dest):
                log.info("%s reachable again: circuit closed", dest)
            self._retry(d, str(exc))
            return False
        if self.breakers.success(dest):
            log.info("%s reachable again: circuit closed", dest)
        if result.warning is not None:
            log.warning("destination %s stored with %s", dest, result.warning)
        self.ledger.delivery_done(d.id, f"HTTP {result.http_status}")
        log.info("job %d %s delivered to %s", d.job_id, d.kind, dest)
        return True


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


__all__ = [
    "CircuitBreakers",
    "Dispatcher",
    "InOrder",
    "KeptAssociations",
    "echo",
    "file_bytes_sends",
    "Backoff",
    "make_ae",
]
