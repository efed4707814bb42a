"""The outbox: C-STORE every result object to every destination, with retry and backoff.

Each delivery (one object, one destination) is a ledger row. A delivery succeeds on status
0x0000 and on a warning status (0xB000-0xBFFF, 0x0001, 0x0107, 0x0116: the object was stored,
PS3.4 §B.2.3), which is logged and recorded as the delivery's status. The objects on disk
never change, so a resend after a crash is the same object (same SOP Instance UID); delivery
is at least once, and a destination that stores by SOP Instance UID (PS3.4 §B.4.1) keeps one
copy.

Two kinds of failure are kept apart:

* **The object failed** - the destination answered a failure status (the reason quotes its
  Error Comment), or gave no valid answer: none within ``dispatch.timeout_s`` of the request,
  the connection lost or the association aborted before it, or a protocol violation (a
  response to another message or object, a PDU over its limit...;
  :mod:`segnode.node.dicom.requestor` checks every response). That uses one of the
  delivery's attempts; the next try waits an exponential backoff with jitter
  (``dispatch.retry_initial_s`` doubled per attempt, at most ``dispatch.retry_max_s``, of
  which half is random so that many nodes or objects do not retry in step). After
  ``dispatch.max_attempts`` the delivery and its job fail, and the job's other deliveries not
  yet sent are cancelled with that reason (none stays pending for a job that is over).
* **The destination cannot be reached** - connection refused or timed out, association
  rejected (the reason in words with its codes, PS3.8 Table 9-21). That says nothing about
  the objects: no attempt is used. The destination backs off as a whole, and after
  ``dispatch.breaker_failures`` consecutive failures its circuit breaker opens: the
  destination is skipped for ``dispatch.breaker_cooldown_s``, then one association probes it.
  The breaker lives in memory (a restart closes it); everything that must survive a restart -
  what is due when, the last error - is in the ledger.

A delivery still pending ``dispatch.max_age_s`` after it was created fails with that reason,
visible in ``segnode jobs``; ``segnode retry --failed`` requeues such jobs: every delivery not
yet sent is pending again with its attempts at 0 and its age counted from the retry (the
earlier attempts stay in the job's events); sent ones are not sent again. ``segnode cancel``
cancels a job's unsent deliveries with it, and a retry of that job makes them pending again
in the same way.

Per destination the results go in order, SEG first, then SR (then a rejection note): the
ledger does not make a result due while an earlier one of its job to the same destination is
unacknowledged and not due itself, and within a pass a result is sent only once the earlier
ones it waits on were accepted (:class:`~segnode.node.outbox.policy.InOrder`), so an SR never
reaches a destination that has not accepted its SEG. Destinations are served side by side and
independently: each pass to a destination runs on a thread of its own, and the outbox thread
starts a destination's next pass once its last one ended, whatever the others do
(:meth:`Dispatcher._run`), so one that is slow, silent or hostile delays no other; every
operation of its pass is bounded by ``dispatch.timeout_s``, and so is :meth:`Dispatcher.stop`.

Associations are the node's own requestor's (:mod:`segnode.node.dicom.requestor`: one
thread, deadlines on every read and write, limits on every PDU). A C-STORE sends the result
file's dataset bytes as the worker wrote them (PS3.10; Explicit VR Little Endian, the SEG by
default deflated): nothing is decoded or encoded again, unless the destination accepted only
another transfer syntax for the SOP class (:meth:`Dispatcher._store`; a deflated SEG is then
inflated to Explicit VR Little Endian). STOW-RS negotiates nothing: the file goes as stored,
and a server that refuses a deflated SEG gets it inflated at once
(:meth:`Dispatcher._stow_one`). The association to a destination stays open
``dispatch.keep_open_s`` after a batch for the next job's objects
(:class:`~segnode.node.outbox.policy.KeptAssociations`); one the peer closed meanwhile, or on
which it sent anything unasked, is replaced without using an attempt.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

from pydicom.errors import InvalidDicomError
from pydicom.filereader import read_file_meta_info
from pydicom.uid import UID, ExplicitVRLittleEndian, ImplicitVRLittleEndian

from segnode.node.audit.trail import AuditTrail
from segnode.node.config import Config
from segnode.node.dicom.requestor import Association, Requestor
from segnode.node.dicom.requestor_outcome import (
    AssociationFailed,
    ConnectionLost,
    Failure,
    NoResponse,
    PeerAborted,
    Response,
    StatusKind,
)
from segnode.node.dicom.tls import tls_args
from segnode.node.dicom.ul_pdu import VERIFICATION
from segnode.node.errors import ConfigError, log_failure
from segnode.node.outbox.encoding import (
    dataset_offset,
    encode_dataset,
    explicit_file,
    proposed_contexts,
)
from segnode.node.outbox.policy import Backoff, CircuitBreakers, InOrder, KeptAssociations
from segnode.node.outbox.stow import StowFailed, StowTarget, StowUnreachable
from segnode.node.outbox.stow import store as stow_store
from segnode.node.peers import Peer
from segnode.node.routing.destinations import SENDER, Target, from_name, index
from segnode.storage.ledger import DueDelivery, Ledger, utcnow

log = logging.getLogger(__name__)

SEND_PDU_BYTES = 1 << 20
"""Largest P-DATA PDU the outbox sends, even to a peer that takes larger ones (PS3.8 9.3.1
lets a sender stay below the peer's maximum). A peer announcing "unlimited" (0) would
otherwise get a 19 MB SEG as one PDU that it can parse only once the last byte arrived.
1 MiB PDUs overlap both sides: a 19 MB SEG to pynetdicom's SCP on loopback took 34 ms against
41-56 ms as one PDU (2 CPUs)."""

MAX_PARALLEL = 16
"""Destinations served at once in a pass (each on its own thread); more wait for a thread."""


class Dispatcher:
    """Sends due deliveries from the ledger: the outbox thread starts each destination's pass
    on a thread of its own (:data:`MAX_PARALLEL` at once at most) and never waits for one.

    Parameters
    ----------
    config, ledger
        Node configuration and durable state.
    rng
        Source of jitter (tests pass a seeded one).
    audit
        The audit trail: each pass's outcomes per job (off when None).
    """

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        rng: random.Random | None = None,
        audit: AuditTrail | None = None,
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.audit = audit or AuditTrail.off()
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Every destination the configuration names, by ledger name (with TLS and credentials).
        self._targets: dict[str, Target] = index(config.configured_destinations())
        self._tls: dict[str, tuple[ssl.SSLContext, str] | None] = {}
        self._tls_lock = threading.Lock()
        dc = config.dispatch
        self.backoff = Backoff(dc.retry_initial_s, dc.retry_max_s, rng or random.Random())
        self.breakers = CircuitBreakers(dc.breaker_failures, dc.breaker_cooldown_s, self.backoff)
        self._last_expiry = -1e9
        self.kept = KeptAssociations(dc.keep_open_s)
        self.requestor = Requestor(
            dc.calling_ae,
            proposed_contexts(deflated_seg=config.results.seg_transfer_syntax == "deflated"),
            dc.timeout_s,
            max_pdu=config.node.max_pdu,
            max_send_pdu=SEND_PDU_BYTES,
        )
        self._pool: ThreadPoolExecutor | None = None
        #: Destinations with a pass in progress (on a pool thread).
        self._busy: set[str] = set()
        self._busy_lock = threading.Lock()

    def start(self) -> None:
        """Start the outbox thread."""
        self._thread = threading.Thread(target=self._run, name="segnode-outbox", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the sends in progress (each ends within ``dispatch.timeout_s``);
        release the kept-open associations."""
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        done = self._thread is None or not self._thread.is_alive()
        if done:
            # The thread released its own on the way out; this is for run_once callers.
            self.kept.close_all()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=done, cancel_futures=True)

    def is_alive(self) -> bool:
        """Whether the outbox thread runs (for the watchdog)."""
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        """The outbox thread: start a pass to every due destination that has none in
        progress (:meth:`_start`), never waiting for one; wake when a pass ends, when the
        next delivery is due, when an idle association is due for release, or after 1 s."""
        try:
            while not self._stop.is_set():
                self.wake.clear()  # a pass ending from here on wakes the wait below
                try:
                    started = len(self._start(self._pool_executor()))
                    idle = self.kept.close_idle()
                    nxt = self.ledger.next_delivery_time()
                except Exception as exc:
                    log_failure(log, "outbox pass failed", exc=exc)
                    started, idle, nxt = 0, None, None
                wait = 1.0
                if nxt is not None:
                    until = (nxt - utcnow()).total_seconds()
                    if until > 0 or started:  # due now but in progress: its end wakes us
                        wait = min(wait, until)
                if idle is not None:
                    wait = min(wait, idle)
                self.wake.wait(max(0.05, wait))
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=True)  # each pass ends within dispatch.timeout_s
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
        """Try every due delivery once and wait for it: one association per destination (kept
        open for the next pass, ``dispatch.keep_open_s``), the destinations side by side
        (one thread each, :data:`MAX_PARALLEL` at most); return how many were sent."""
        futures = self._start(None)
        return sum(f.result() for f in futures)

    def _pool_executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(MAX_PARALLEL, thread_name_prefix="segnode-outbox")
        return self._pool

    def _start(self, pool: ThreadPoolExecutor | None) -> list[Future[int]]:
        """Start a pass to every destination with due deliveries and no pass in progress
        (the others are skipped: theirs is still sending); return the passes' futures.
        Without ``pool``, one destination is served on this thread, several on a pool."""
        if time.monotonic() - self._last_expiry > min(5.0, self.config.dispatch.max_age_s / 4):
            self._last_expiry = time.monotonic()
            self.expire()
        # Destinations busy before the query are skipped even when their pass ends during
        # it: the rows read may predate that pass's outcome (a stale attempt count gave a
        # delivery one attempt more than dispatch.max_attempts). Only this thread starts
        # passes, so one not busy now cannot become busy before the check below.
        with self._busy_lock:
            busy = set(self._busy)
        due = self.ledger.due_deliveries(claim_s=self.claim_s)
        by_dest: dict[str, list[DueDelivery]] = defaultdict(list)
        for d in due:
            by_dest[d.destination].append(d)
        work: list[tuple[str, list[DueDelivery]]] = []
        for dest, items in by_dest.items():
            if self._stop.is_set():
                break
            if dest in busy:
                continue
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
            with self._busy_lock:
                self._busy.add(dest)
            work.append((dest, items))
        if pool is None:
            if len(work) == 1:  # run_once to one destination: on this thread
                done: Future[int] = Future()
                done.set_result(self._pass(*work[0]))
                return [done]
            if not work:
                return []
            pool = self._pool_executor()
        return [pool.submit(self._pass, dest, items) for dest, items in work]

    def _pass(self, dest: str, items: list[DueDelivery]) -> int:
        """One destination's pass; a bug here ends that pass only. Its end wakes the outbox
        thread (the destination may take its next pass)."""
        try:
            return self._send_to(dest, items)
        except Exception as exc:
            log_failure(log, "outbox pass to %s failed", dest, exc=exc)
            return 0
        finally:
            with self._busy_lock:
                self._busy.discard(dest)
            self.wake.set()

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
        with self._tls_lock:
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
        batch = self.audit.batch(peer.ae_title, peer.host)
        try:
            for d in items:
                if self._stop.is_set():
                    break
                if not order.may_send(d):
                    log.debug("job %d %s to %s waits for an earlier result", d.job_id, d.kind, dest)
                    continue
                if assoc.requests and not assoc.poll_idle():
                    log.info("%s ended the association (%s); a new one", dest, assoc.ended)
                if not assoc.is_established:
                    # The peer released or aborted after the last object (some close after
                    # each), or sent something unasked: a new association, no attempt used.
                    if (assoc := self._associate(dest, peer)) is None:
                        break
                    untried = False
                if not self._claimed(d):
                    order.outcome(d, False)
                    continue
                outcome = self._store(assoc, d)
                if untried and isinstance(outcome, NoResponse | ConnectionLost | PeerAborted):
                    log.info("kept-open association to %s: %s; a new one", dest, outcome)
                    if (assoc := self._associate(dest, peer)) is None:
                        break
                    if not self._claimed(d):
                        order.outcome(d, False)
                        continue
                    outcome = self._store(assoc, d)
                untried = False
                accepted = self._settle(d, outcome)
                order.outcome(d, accepted)
                if outcome is not None:
                    batch.add(d.job_id, d.path, d.sop_class_uid, _failure(outcome, accepted))
                sent += accepted
                if isinstance(outcome, Failure):
                    break  # the association is over; the rest waits for the next pass
        finally:
            if assoc is not None:
                self.kept.put(dest, assoc)
            batch.close()
        return sent

    def _settle(self, d: DueDelivery, outcome: Response | Failure | None) -> bool:
        """Record what became of one C-STORE; return whether the object was stored.

        Success and warnings (PS3.4 §B.2.3: stored) are done, a warning logged with its
        comment and kept as the delivery's status; a failure status or no valid response
        uses an attempt (:meth:`_retry`). None: already settled by :meth:`_store`.
        """
        if outcome is None:
            return False
        if isinstance(outcome, Failure):
            self._retry(d, str(outcome))
            return False
        if outcome.kind is StatusKind.FAILURE:
            self._retry(d, f"destination answered {outcome.describe()}", outcome.status)
            return False
        warning = None
        if outcome.kind is StatusKind.WARNING:
            warning = f"warning {outcome.describe()}"
            log.warning("job %d %s stored by %s with %s", d.job_id, d.kind, d.destination, warning)
        self.ledger.delivery_done(d.id, outcome.status, warning)
        log.info("job %d %s delivered to %s", d.job_id, d.kind, d.destination)
        return True

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
        try:
            assoc = self.requestor.open(peer.host, peer.port, peer.ae_title, self._tls_args(peer))
        except (AssociationFailed, ConfigError) as exc:  # ConfigError: TLS files unreadable
            self._unreachable(dest, str(exc))
            return None
        if self.breakers.success(dest):
            log.info("%s reachable again: circuit closed", dest)
        return assoc

    def _store(self, assoc: Association, d: DueDelivery) -> Response | Failure | None:
        """C-STORE the result file of ``d``; return the response, the failure (no valid
        response: the association is over), or None when the delivery was settled here
        (file unreadable, no presentation context).

        The request's SOP Class and Instance UIDs and the transfer syntax come from the file's
        File Meta Information (PS3.10 §7.1), checked against the ledger's row; the dataset is
        sent as the bytes that follow it, read from the file as the PDUs go out, over a
        context of that transfer syntax. Only when the destination accepted another transfer
        syntax for the SOP class is the data set encoded again
        (:func:`~segnode.node.outbox.encoding.encode_dataset`): a deflated SEG inflated for a
        destination that did not accept Deflated Explicit VR Little Endian, or a file decoded
        and encoded for one that accepted only Implicit VR Little Endian.
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
        contexts = assoc.contexts_for(sop_class)
        if not contexts:
            self._retry(d, f"no presentation context accepted for {UID(sop_class).name}")
            return None
        as_is = [cx for cx in contexts if cx.transfer_syntax == syntax]
        try:
            if as_is:
                with open(d.path, "rb") as f:
                    f.seek(dataset_offset(f))
                    return assoc.store(as_is[0], sop_class, sop_instance, f)
            cx = contexts[0]
            log.info(
                "%s accepted %s for %s, not %s: re-encoding job %d %s",
                d.destination,
                UID(cx.transfer_syntax).name,
                UID(sop_class).name,
                UID(syntax).name,
                d.job_id,
                d.kind,
            )
            data = encode_dataset(d.path, cx.transfer_syntax)
            return assoc.store(cx, sop_class, sop_instance, data)
        except (OSError, InvalidDicomError) as exc:
            self.ledger.delivery_failed(d.id, f"result file unreadable: {exc}")
            return None

    def _send_stow(self, target: StowTarget, items: list[DueDelivery]) -> int:
        """DICOMweb STOW-RS, one request per object (:mod:`segnode.node.outbox.stow`); same
        bookkeeping."""
        sent = 0
        order = InOrder()
        batch = self.audit.batch("", urlsplit(target.url).hostname or target.url)
        try:
            for d in items:
                if self._stop.is_set():
                    break
                if not order.may_send(d):
                    continue
                outcome = self._stow_one(target, d)
                if outcome is None:
                    break
                order.outcome(d, outcome)
                batch.add(d.job_id, d.path, d.sop_class_uid, None if outcome else "STOW-RS failed")
                sent += outcome
        finally:
            batch.close()
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
        timeout = self.config.dispatch.timeout_s
        try:
            try:
                result = stow_store(target, data, d.sop_instance_uid, timeout)
            except StowFailed as exc:
                # a server that answered but refused the object: if it is the deflated SEG,
                # the same object inflated, at once (STOW-RS negotiates no transfer syntax)
                explicit = None if exc.status is None else self._explicit_copy(d)
                if explicit is None:
                    raise
                log.info(
                    "%s refused job %d's deflated %s (%s): sending it inflated",
                    dest,
                    d.job_id,
                    d.kind,
                    exc,
                )
                result = stow_store(target, explicit, d.sop_instance_uid, timeout)
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
        self.ledger.delivery_done(d.id, f"HTTP {result.http_status}", result.warning)
        log.info("job %d %s delivered to %s", d.job_id, d.kind, dest)
        return True

    @staticmethod
    def _explicit_copy(d: DueDelivery) -> bytes | None:
        """The result file of ``d`` inflated if it is deflated, else None (also when it
        cannot be read: the refusal then stands)."""
        try:
            return explicit_file(d.path)
        except (OSError, InvalidDicomError):
            return None


def _failure(outcome: Response | Failure, accepted: bool) -> str | None:
    """Why an object was not stored, for the audit trail (None: it was)."""
    if accepted:
        return None
    if isinstance(outcome, Failure):
        return str(outcome)
    return f"destination answered {outcome.describe()}"


def echo(peer: Peer, calling_ae: str = "SEGNODE", timeout: float = 10.0) -> int:
    """C-ECHO ``peer`` (over TLS when it has ``tls``); return the status, -1 without an
    association or a valid response (the reason is logged)."""
    syntaxes = (ImplicitVRLittleEndian, ExplicitVRLittleEndian)
    requestor = Requestor(calling_ae, [(VERIFICATION, syntaxes)], timeout)
    try:
        assoc = requestor.open(peer.host, peer.port, peer.ae_title, tls_args(peer))
    except AssociationFailed as exc:
        log.warning("C-ECHO %s: %s", peer.name, exc)
        return -1
    try:
        contexts = assoc.contexts_for(VERIFICATION)
        if not contexts:
            log.warning("C-ECHO %s: Verification not accepted", peer.name)
            return -1
        outcome = assoc.echo(contexts[0])
        if isinstance(outcome, Failure):
            log.warning("C-ECHO %s: %s", peer.name, outcome)
            return -1
        return outcome.status
    finally:
        assoc.release()


__all__ = ["Dispatcher", "SEND_PDU_BYTES", "echo"]
