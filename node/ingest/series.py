"""Series completion: deciding that a series is ready to become a job.

Signals, in order of speed:

1. **Geometric completeness.** The slices received so far are uniformly spaced along the
   slice normal with no gap, and their number equals what the instances announce: Images in
   Acquisition (0020,1002) for single-frame CT, Number of Frames (0028,0008) for one
   multi-frame instance (PS3.3 C.7.6.2, C.7.6.6). Evaluated off the SCP thread by
   :mod:`segnode.node.ingest.streaming` through :mod:`segnode.node.ingest.geometry`; it can
   fire at the last instance, before the association is released.
2. **Association release.** When an association that delivered instances of a series is
   released normally and no other open association has delivered instances of the same
   series, the series is complete - unless the association may have carried only part of
   it: its sender is known to split series over associations (learnt per calling AE title,
   :mod:`segnode.node.ingest.senders`), or it delivered fewer than three instances. Then the series
   is held for the sender's usual gap between associations (0.5-3 s) and completes (``sender-gap``)
   when nothing more came, unless its headers say instances are missing.
3. **Quiet period** (fallback). A series with instances not yet taken by a job, no open
   association touching it, and nothing received for ``quiet_period_s`` seconds is complete.
   This also covers aborted associations and series left pending by a restart.

Which of signals 1 and 2 count is a per-sender policy (``[[series.senders]]``, PS3.8 calling
AE title): ``auto`` (both), ``release``, ``geometry`` (for modalities that split a series over
several associations) or ``quiet`` (the timer only).

**One owner, one thread.** :class:`CompletionLoop` owns the completion state (which open
associations touched which series, the series held after a release, the remembered
association ends) and is its only reader and writer: one thread, ``segnode-completion``, fed
by a FIFO queue of small frozen events - :class:`Opened`, :class:`Touched` and
:class:`Closed` from the SCP's threads, :class:`GeometryComplete` from the decode threads,
:class:`QuietScan` - plus its own timeouts: the hold timers and the periodic quiet-period
scan (so there is no lock and no timer thread). ``on_complete`` runs only on that thread,
whichever signal fired. The callers never wait: each public method posts an event and
returns. The one question the old design asked across threads, "is an open association
still delivering this series?" (the quiet-period scan, on the main loop), is now asked by
the scan itself on the completion thread: the loop is given ``quiet()`` (the ledger's quiet
pending series) and runs the scan every ``quiet_every_s``. Queries for tests and status
(:meth:`CompletionLoop.held`, :meth:`CompletionLoop.flush`) travel through the queue and are
answered by the thread through a future.

Ordering: one FIFO queue, so the events one thread posts are handled in the order it posted
them, and an event posted after another one *happened* (a ``touched`` posted by the
``store-admit`` thread before the instance's response, then the association's ``closed``
posted by its thread) is handled after it: a ``touched`` always precedes the same
association's ``closed``.

The loop holds only which open associations touched which series; everything durable
(instances, pending flags, jobs) is in the ledger, so losing this state in a crash loses
nothing: the quiet-period rule picks the series up after restart.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar, cast

from segnode.node.errors import log_failure
from segnode.node.ingest.geometry import SeriesHints
from segnode.node.ingest.senders import CONTINUE_WINDOW_S, FEW_INSTANCES, SenderBook, SenderPattern

log = logging.getLogger(__name__)

OnComplete = Callable[[str, str], None]
PolicyFn = Callable[[str], str]
#: ``hints(series_uid)``: what the headers received so far say about the series' extent.
HintsFn = Callable[[str], "SeriesHints | None"]
#: ``on_hold(series_uid, reason)``: a release did not complete the series; why.
OnHold = Callable[[str, str], None]
#: ``quiet()``: the pending series nothing was received for during the quiet period.
QuietFn = Callable[[], Iterable[str]]
#: ``on_failure(series_uid, error)``: ``on_complete`` raised for the series
#: :data:`MAX_COMPLETION_FAILURES` times in a row; True when the series is settled (the node
#: records it as ignored with the reason), False to go on retrying it.
OnFailure = Callable[[str, Exception], bool]
T = TypeVar("T")

RELEASE = "association-release"
#: A release whose series waited for the sender's usual gap (the sender splits series over
#: associations) and saw nothing more.
SENDER_GAP = "sender-gap"
GEOMETRY = "geometry"
QUIET = "quiet-period"

#: Signals (besides the quiet-period fallback) each completion mode listens to.
MODE_SIGNALS: dict[str, frozenset[str]] = {
    "auto": frozenset({RELEASE, GEOMETRY}),
    "release": frozenset({RELEASE}),
    "geometry": frozenset({GEOMETRY}),
    "quiet": frozenset(),
}
#: Series whose last association's end is remembered (to see the next one continue it).
MAX_REMEMBERED = 4096
#: While the decoder is behind a series (:attr:`SeriesHints.behind`), a decision that reads
#: its headers is retried every ``BEHIND_RECHECK_S``, for ``BEHIND_MOST_S`` at most (then it
#: is taken on what was decoded). A job would wait for those decodes anyway (the streaming
#: volume is taken only once they are done), so the wait costs at most one recheck.
BEHIND_RECHECK_S = 0.005
BEHIND_MOST_S = 30.0
#: Failed completions in a row after which a series goes to ``on_failure``: the quiet-period
#: scan retries a pending series every ``quiet_every_s``, so a series whose headers make
#: completion raise would otherwise be retried (and its traceback logged) forever.
MAX_COMPLETION_FAILURES = 3


@dataclass(frozen=True)
class _OfAssociation:
    """An event of one association, posted by its thread."""

    assoc_id: int
    #: ``time.monotonic()`` when its thread posted it (not when the loop got to the event).
    at: float = field(default_factory=time.monotonic, kw_only=True)


@dataclass(frozen=True)
class Opened(_OfAssociation):
    """The association was accepted."""

    calling_ae: str


@dataclass(frozen=True)
class Touched(_OfAssociation):
    """The association delivered an instance of a series (posted by a ``store-admit`` thread
    before the instance's response, hence before the same association's :class:`Closed`)."""

    series_uid: str


@dataclass(frozen=True)
class Closed(_OfAssociation):
    """The association ended: released normally, or aborted / dropped."""

    released: bool


@dataclass(frozen=True)
class GeometryComplete:
    """The streaming decoder found the series' stack complete (posted by a decode thread)."""

    series_uid: str
    calling_ae: str


@dataclass(frozen=True)
class QuietScan:
    """Run the quiet-period scan now (it also runs every ``quiet_every_s`` on its own)."""


@dataclass(frozen=True)
class _Ask:
    """Run ``fn`` on the completion thread and hand its result to ``future``."""

    fn: Callable[[], object]
    future: Future[object]


@dataclass(frozen=True)
class _Stop:
    """The last event: the thread ends after handling everything posted before it."""


#: What the completion thread is fed.
Event = Opened | Touched | Closed | GeometryComplete | QuietScan | _Ask | _Stop


@dataclass
class _Association:
    calling_ae: str
    opened_at: float
    #: Series delivered -> instances of it delivered.
    series: dict[str, int] = field(default_factory=dict)
    #: Series this association continues (an earlier association of the same AE delivered
    #: them shortly before) -> the gap between the two, in seconds.
    continues: dict[str, float] = field(default_factory=dict)


class CompletionLoop:
    """The one owner of series-completion state, on its own thread (``segnode-completion``).

    Fed by events (:class:`Opened`, :class:`Touched`, :class:`Closed`,
    :class:`GeometryComplete`, :class:`QuietScan`) on one FIFO queue; its own timeouts run
    the hold timers and the periodic quiet-period scan. Which open associations touched
    which series, the series held after a release and the remembered association ends are
    read and written only on that thread: no lock. ``on_complete`` is called only there, so
    completions never run concurrently and never on the thread that fired them.

    The public methods other threads call (:meth:`opened`, :meth:`touched`, :meth:`closed`,
    :meth:`geometry_complete`, :meth:`scan_quiet`) only post an event. A poster's events
    are handled in the order it posted them: an association's ``touched`` (posted before its
    response) always precedes its ``closed``. Questions that need the state (:meth:`held`,
    :meth:`flush`) are asked through the queue and answered by the thread.

    A normal release completes the series the association delivered (when no other open
    association is still delivering them) unless the association may have carried only
    part of it: the sender is known to split series over associations
    (:class:`~segnode.node.ingest.senders.SenderBook`), or the association delivered fewer than
    :data:`~segnode.node.ingest.senders.FEW_INSTANCES` instances of it. Such a series is *held* for
    four times the sender's usual gap (at least 0.5 s, at most
    the quiet period); when that passes with nothing more, it completes
    (``sender-gap``), unless its headers say instances are missing (Images in Acquisition
    not reached, a hole in the Instance Numbers): then the quiet period decides.

    The thread starts with :meth:`start` or the first event posted; :meth:`stop` handles
    what was posted before it and joins the thread. Events posted after :meth:`stop` are
    dropped: their series are pending in the ledger and the quiet period completes them
    after the next start.

    Parameters
    ----------
    on_complete
        Called as ``on_complete(series_uid, trigger)`` on the completion thread.
    complete_on_release
        Whether a normal release completes series at all (config
        ``series.complete_on_release``; false removes the release signal for every sender).
    policy
        Completion mode of a calling AE title (``auto``, ``release``, ``geometry``,
        ``quiet``); ``auto`` for every sender when None. Called on any thread.
    senders
        The learnt sender patterns (in memory only when None).
    hints
        The series' extent from its headers (none when None).
    on_hold
        Told once per series when a release holds it, with the reason.
    quiet
        The pending series quiet for the quiet period (from the ledger); the scan completes
        those no open association touched (``quiet-period``). No scan when None.
    quiet_every_s
        Seconds between two quiet-period scans.
    on_failure
        Given a series whose ``on_complete`` raised :data:`MAX_COMPLETION_FAILURES` times in
        a row, with the last error, to settle it; without it such a series is retried at
        every signal.
    quiet_period_s
        ``series.quiet_period_s``: the longest a hold waits (the quiet period completes the
        series then in any case).
    """

    def __init__(
        self,
        on_complete: OnComplete,
        *,
        complete_on_release: bool = True,
        policy: PolicyFn | None = None,
        senders: SenderBook | None = None,
        hints: HintsFn | None = None,
        on_hold: OnHold | None = None,
        quiet: QuietFn | None = None,
        quiet_every_s: float = 1.0,
        on_failure: OnFailure | None = None,
        quiet_period_s: float = CONTINUE_WINDOW_S,
    ) -> None:
        self._on_complete = on_complete
        self._on_failure = on_failure
        self._release = complete_on_release
        self._policy = policy or (lambda _ae: "auto")
        self.senders = senders or SenderBook()
        self._hints = hints
        self._on_hold = on_hold
        self._quiet = quiet
        self._quiet_every = quiet_every_s
        self._most_wait = quiet_period_s
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stopping = False
        # -- owned by the completion thread ----------------------------------------------
        self._assocs: dict[int, _Association] = {}
        self._last_end: dict[str, tuple[str, float]] = {}
        # Held series -> when their wait ends.
        self._holds: dict[str, float] = {}
        # Held series whose last association carried one instance in all (one instance per
        # association, from a sender not known yet perhaps): see _wait_ended.
        self._tiny: set[str] = set()
        # Series whose decision waits for the decoder to read the headers received (a
        # short hold): the decision to take again and when to stop waiting.
        self._behind: dict[str, tuple[Callable[[float], None], float]] = {}
        # Series whose hold was reported (an ordered set, bounded like _last_end).
        self._told: dict[str, None] = {}
        # Series whose completion raised -> how many times in a row (bounded like _last_end).
        self._failures: dict[str, int] = {}
        self._next_quiet = 0.0

    # -- the thread ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the completion thread (idempotent; posting an event starts it too)."""
        with self._start_lock:
            if self._thread is None and not self._stopping:
                self._next_quiet = time.monotonic() + self._quiet_every
                self._thread = threading.Thread(
                    target=self._run, name="segnode-completion", daemon=True
                )
                self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the completion thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Handle every event posted so far, then end the thread (held series are left to
        the quiet period after a restart)."""
        with self._start_lock:
            if self._stopping:
                return
            self._stopping = True
            thread = self._thread
        if thread is not None:
            self._queue.put(_Stop())
            thread.join(timeout)

    def _post(self, event: Event) -> None:
        if self._thread is None:
            self.start()
        if self._stopping:
            log.debug("completion stopped; %s dropped", type(event).__name__)
            return
        self._queue.put(event)

    def _run(self) -> None:
        while True:
            due = self._next_due()
            try:
                if due is None:
                    event = self._queue.get()
                else:
                    event = self._queue.get(timeout=max(0.0, due - time.monotonic()))
            except queue.Empty:
                self._timeouts()
                continue
            if isinstance(event, _Stop):
                return
            try:
                self._handle(event)
            except Exception as exc:  # one event's failure must not end completion
                log_failure(log, "completion event %s failed", type(event).__name__, exc=exc)
            self._timeouts()

    def _next_due(self) -> float | None:
        nxt = min(self._holds.values(), default=None)
        if self._quiet is not None:
            nxt = self._next_quiet if nxt is None else min(nxt, self._next_quiet)
        return nxt

    def _timeouts(self) -> None:
        """Run what is due: ended hold waits, the periodic quiet-period scan."""
        now = time.monotonic()
        try:
            due = [uid for uid, at in self._holds.items() if at <= now]
            for uid in due:
                del self._holds[uid]
            for uid in due:
                behind = self._behind.pop(uid, None)
                if self._busy(uid):
                    continue
                if behind is not None:
                    decide, give_up_at = behind
                    decide(give_up_at)
                else:
                    self._wait_ended(uid, time.monotonic() + BEHIND_MOST_S)
        except Exception:
            log.exception("ending a completion wait failed")
        if self._quiet is not None and now >= self._next_quiet:
            self._next_quiet = now + self._quiet_every
            self._scan_quiet()

    def _handle(self, event: Event) -> None:
        if isinstance(event, Touched):
            self._touched(event)
        elif isinstance(event, Opened):
            self._assocs[event.assoc_id] = _Association(event.calling_ae, event.at)
        elif isinstance(event, Closed):
            self._closed(event)
        elif isinstance(event, GeometryComplete):
            self._complete(event.series_uid, GEOMETRY)
        elif isinstance(event, QuietScan):
            self._scan_quiet()
        elif isinstance(event, _Ask):
            try:
                event.future.set_result(event.fn())
            except Exception as exc:  # the asker gets it
                event.future.set_exception(exc)

    def _ask(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """``fn()`` run on the completion thread (directly when called there, or once the
        thread has ended)."""
        thread = self._thread
        if thread is threading.current_thread():
            return fn()
        if self._stopping:  # nothing is handled any more: wait for the drain, then ask
            if thread is not None:
                thread.join(timeout)
            return fn()
        future: Future[object] = Future()
        self._post(_Ask(fn, future))
        return cast("T", future.result(timeout))

    # -- what other threads call: each posts an event ------------------------------------

    def signals(self, calling_ae: str) -> frozenset[str]:
        """The completion signals that count for ``calling_ae`` (configuration only: any
        thread)."""
        out = MODE_SIGNALS.get(self._policy(calling_ae), MODE_SIGNALS["auto"])
        return out if self._release else out - {RELEASE}

    def opened(self, assoc_id: int, calling_ae: str = "") -> None:
        """An association was accepted."""
        self._post(Opened(assoc_id, calling_ae.strip()))

    def touched(self, assoc_id: int, series_uid: str) -> None:
        """An association delivered an instance of ``series_uid``."""
        self._post(Touched(assoc_id, series_uid))

    def closed(self, assoc_id: int, *, released: bool) -> None:
        """An association ended; the series it completes are completed on the completion
        thread.

        Parameters
        ----------
        released
            True for a normal A-RELEASE, False for an abort or a dropped connection; only a
            release completes series (an aborted transfer waits for the quiet period), and
            only for senders whose policy counts the release.
        """
        self._post(Closed(assoc_id, released))

    def geometry_complete(self, series_uid: str, calling_ae: str) -> bool:
        """The series is geometrically complete: complete it (on the completion thread) if
        the sender's policy counts geometry; return whether it does."""
        if GEOMETRY not in self.signals(calling_ae):
            return False
        self._post(GeometryComplete(series_uid, calling_ae))
        return True

    def scan_quiet(self) -> None:
        """Run the quiet-period scan now rather than at its next period."""
        self._post(QuietScan())

    def held(self) -> dict[str, float]:
        """Series held after a release -> seconds until their wait ends."""

        def now_held() -> dict[str, float]:
            now = time.monotonic()
            return {s: max(0.0, due - now) for s, due in self._holds.items()}

        return self._ask(now_held)

    def flush(self, timeout: float = 10.0) -> None:
        """Return once every event posted before this call has been handled."""
        self._ask(lambda: None, timeout)

    # -- the handlers (completion thread only) ---------------------------------------------

    def _touched(self, event: Touched) -> None:
        a = self._assocs.get(event.assoc_id)
        if a is None:
            a = self._assocs[event.assoc_id] = _Association("", time.monotonic())
        uid = event.series_uid
        n = a.series.get(uid, 0)
        if n == 0:
            prev = self._last_end.get(uid)
            if prev is not None and prev[0] == a.calling_ae:
                gap = a.opened_at - prev[1]
                if gap <= CONTINUE_WINDOW_S:
                    a.continues[uid] = max(0.0, gap)
        a.series[uid] = n + 1
        self._holds.pop(uid, None)  # more came: a wait for it is moot
        self._behind.pop(uid, None)
        self._tiny.discard(uid)

    def _busy(self, series_uid: str) -> bool:
        """Whether an open association has delivered instances of ``series_uid``."""
        return any(series_uid in a.series for a in self._assocs.values())

    def _closed(self, event: Closed) -> None:
        done, reading = self._close(event)
        if event.released:
            waits = f", {reading} waiting for their headers to be read" if reading else ""
            log.info("association released; %d series complete%s", len(done), waits)

    def _close(self, event: Closed) -> tuple[list[str], int]:
        """End an association; return the series its release completed and how many of its
        series wait for the decoder."""
        a = self._assocs.pop(event.assoc_id, None)
        if a is None or not a.series:
            return [], 0
        for uid in a.series:
            self._last_end.pop(uid, None)
            self._last_end[uid] = (a.calling_ae, event.at)
        while len(self._last_end) > MAX_REMEMBERED:
            del self._last_end[next(iter(self._last_end))]
        still_busy = {uid for uid in a.series if self._busy(uid)}
        gap = max(a.continues.values()) if a.continues else None
        pattern = self.senders.learn(a.calling_ae, sum(a.series.values()), bool(a.continues), gap)
        if not event.released or RELEASE not in self.signals(a.calling_ae):
            self.senders.persist(a.calling_ae)
            return [], 0
        give_up_at = time.monotonic() + BEHIND_MOST_S
        ended = sorted(set(a.series) - still_busy)
        done = [uid for uid in ended if self._released(uid, a, pattern, give_up_at)]
        self.senders.persist(a.calling_ae)
        return done, sum(uid in self._behind for uid in ended)

    def _series_hints(self, uid: str) -> SeriesHints | None:
        return self._hints(uid) if self._hints is not None else None

    def _wait_for_decoder(
        self, uid: str, hints: SeriesHints | None, decide: Callable[[float], None], until: float
    ) -> bool:
        """When the decoder has not read every header received for ``uid`` yet (and
        ``until`` has not passed), hold the series briefly and take ``decide`` again then:
        the headers read so far could say the series is whole when those still queued say
        it is not. Return whether it waits."""
        if hints is None or not hints.behind:
            return False
        if time.monotonic() >= until:
            log.info(
                "series %s: decided on the headers read so far (%d still not decoded after %.0f s)",
                uid,
                hints.behind,
                BEHIND_MOST_S,
            )
            return False
        self._holds[uid] = time.monotonic() + BEHIND_RECHECK_S
        self._behind[uid] = (decide, until)
        return True

    def _released(
        self, uid: str, a: _Association, pattern: SenderPattern, give_up_at: float
    ) -> bool:
        """Decide ``uid`` after ``a``'s release: complete it now (True), or hold it (or wait
        for the decoder and decide again then)."""
        hints = self._series_hints(uid)

        def again(until: float) -> None:
            self._released(uid, a, pattern, until)

        if self._wait_for_decoder(uid, hints, again, give_up_at):
            return False
        reason = self._hold_reason(uid, a, pattern, hints)
        if reason is None:
            self._complete(uid, RELEASE)
            return True
        self._hold(uid, pattern.wait_s(self._most_wait), reason)
        if sum(a.series.values()) == 1:
            self._tiny.add(uid)
        else:
            self._tiny.discard(uid)
        return False

    def _hold_reason(
        self, uid: str, a: _Association, pattern: SenderPattern, hints: SeriesHints | None
    ) -> str | None:
        """Why this release must not complete ``uid`` at once (None: it completes)."""
        if hints is not None and hints.complete:
            return None
        wait = pattern.wait_s(self._most_wait)
        missing = hints.incomplete_reason() if hints is not None else None
        if missing is not None:
            # The headers say more is coming (another association may send it): the hold's
            # end completes the series only once they stop saying so (_wait_ended).
            return f"{missing}; waiting {wait:.1f} s for the rest from any sender"
        if pattern.splits_series:
            return (
                f"waiting {wait:.1f} s for more instances from {a.calling_ae or '(no AE)'}, "
                f"which {pattern.describe()}"
            )
        n = a.series[uid]
        if n < FEW_INSTANCES:
            return (
                f"waiting {wait:.1f} s for more instances from {a.calling_ae or '(no AE)'}: "
                f"its association carried only {n} instance(s) of the series"
            )
        return None

    def _hold(self, uid: str, wait: float, reason: str) -> None:
        self._holds[uid] = time.monotonic() + wait
        tell = uid not in self._told
        self._told[uid] = None
        while len(self._told) > MAX_REMEMBERED:
            del self._told[next(iter(self._told))]
        log.info("series %s held: %s", uid, reason)
        if tell and self._on_hold is not None:
            try:
                self._on_hold(uid, reason)
            except Exception as exc:
                log_failure(log, "recording a held series failed", exc=exc)

    def _wait_ended(self, uid: str, give_up_at: float) -> None:
        """A held series' wait passed with no new instance: complete it, unless its headers
        say instances are missing (then the quiet period decides)."""
        hints = self._series_hints(uid)
        if self._wait_for_decoder(
            uid, hints, lambda until: self._wait_ended(uid, until), give_up_at
        ):
            return
        reason = hints.incomplete_reason() if hints is not None else None
        tiny = uid in self._tiny
        self._tiny.discard(uid)
        if reason is None and tiny and hints is not None and hints.received < FEW_INSTANCES:
            # One instance per association, and fewer than a volume's worth so far: more is
            # coming (a new sender slower than the default wait), or the quiet period ends it.
            # (A two-image scout sent on one association completes here as before.)
            reason = f"only {hints.received} instance(s) so far"
        if reason is not None:
            log.info("series %s still held after the sender's gap: %s", uid, reason)
            if self._on_hold is not None:
                try:
                    self._on_hold(uid, f"{reason}; waiting for the rest or the quiet period")
                except Exception as exc:
                    log_failure(log, "recording a held series failed", exc=exc)
            return
        self._complete(uid, SENDER_GAP)

    def _scan_quiet(self) -> None:
        """Complete the pending series quiet for the period that no open association
        touched."""
        if self._quiet is None:
            return
        try:
            for uid in self._quiet():
                if not self._busy(uid):
                    # A hold is left as it is (as when the scan ran on the main loop): its
                    # end finds the series taken and creates nothing.
                    self._deliver(uid, QUIET)
        except Exception as exc:
            log_failure(log, "quiet-period scan failed", exc=exc)

    def _complete(self, series_uid: str, trigger: str) -> None:
        self._holds.pop(series_uid, None)
        self._behind.pop(series_uid, None)
        self._tiny.discard(series_uid)
        self._told.pop(series_uid, None)
        self._deliver(series_uid, trigger)

    def _deliver(self, series_uid: str, trigger: str) -> None:
        try:
            self._on_complete(series_uid, trigger)
        except Exception as exc:  # a job-creation failure must not end the completion thread
            failures = self._failures.pop(series_uid, 0) + 1
            log_failure(
                log,
                "completing series %s failed (%d time(s) in a row)",
                series_uid,
                failures,
                exc=exc,
            )
            if failures >= MAX_COMPLETION_FAILURES and self._settle(series_uid, exc):
                return
            self._failures[series_uid] = failures
            while len(self._failures) > MAX_REMEMBERED:
                del self._failures[next(iter(self._failures))]
        else:
            self._failures.pop(series_uid, None)

    def _settle(self, series_uid: str, error: Exception) -> bool:
        """Hand a series whose completion keeps failing to ``on_failure``; whether it is
        settled."""
        if self._on_failure is None:
            return False
        try:
            return self._on_failure(series_uid, error)
        except Exception as exc:
            log_failure(
                log, "recording the failed completion of series %s failed", series_uid, exc=exc
            )
            return False
