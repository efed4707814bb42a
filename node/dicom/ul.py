"""segnode's DICOM Upper Layer acceptor: the PS3.8 state machine, limits that hold under attack.

The node speaks the Upper Layer itself for speed: pynetdicom's acceptor runs two threads per
association that poll each other every millisecond and turns every P-DATA-TF into objects.
Here each *association* has one thread that reads each PDU straight into one buffer, cuts
the PDVs out as memoryviews and hands the C-STORE handler the encoded dataset with at most
one join. What it does not write itself it takes from pynetdicom's public modules: the
A-ASSOCIATE-RQ/AC PDU codecs and presentation-context and role negotiation
(:func:`pynetdicom.presentation.negotiate_as_acceptor`).

The protocol is the PS3.8 state machine of :mod:`segnode.node.dicom.ul_fsm`: every PDU, timer,
closed connection and local decision is an ``Evt``, and
:meth:`segnode.node.dicom.ul_association._Association.fire` performs the action Table 9-10
names for it in the current ``Sta``. Where the work happens:

* **One selector thread per listening port** owns every connection that is not (yet, or any
  more) an association: ``Sta2`` (awaiting the A-ASSOCIATE-RQ, TLS handshake included) and
  ``Sta13`` (an A-ASSOCIATE-RJ, A-ABORT or A-RELEASE-RP sent; waiting for the peer to close, so
  that it reads our last PDU instead of a TCP reset). No thread is started for them.
  ``max_pending`` of them in all and ``max_pending_per_host`` per address; a new connection
  over either cap expires the *oldest* one's ARTIM timer at once (a scanner's request arrives
  within milliseconds of its connect; an idle or trickling connection is always the oldest).
  ARTIM runs over the whole request: a trickle cannot renew it.
* **An association thread** is started only for an A-ASSOCIATE-RQ the local user accepted
  (``Sta3`` -> AE-7 -> ``Sta6``), within ``max_associations`` in all and
  ``max_associations_per_host`` per address. It enforces the announced maximum PDU length (a
  longer P-DATA-TF is an invalid PDU: A-ABORT before its body is read), bounds command sets and
  datasets by their bytes on the wire and their number of fragments, and times the data phase:
  ``network_timeout`` of silence between messages, and while a PDU or DIMSE message is in
  progress, ``network_timeout`` plus the time its bytes take at ``min_rate`` (a peer that
  trickles cannot hold the association).
* DIMSE requests must match their presentation context: the Affected SOP Class UID must be the
  context's abstract syntax (0x0122 SOP Class Not Supported otherwise; nothing is stored).
* The C-STORE handler returns a :class:`StoreOutcome`: the status, its Error Comment and the
  follow-ups (work that must come after the instance but must not delay its response); the
  association's thread sends the response, then runs the follow-ups in order. Handlers share
  nothing with the acceptor but what they return.
* :meth:`Acceptor.stop` stops accepting, aborts idle associations at once, lets messages in
  flight finish for ``grace`` seconds and aborts the rest.

The acceptor is split by concern; each module says what it owns and what it must not touch:

* this module: the :class:`Acceptor` (listening socket, selector thread, pending connections
  and their limits, admission of associations, stopping), and the public names below.
* :mod:`segnode.node.dicom.ul_types`: the service interface the acceptor, its associations and
  the service user share (:class:`AssociationInfo`, :class:`StoreRequest`,
  :class:`StoreOutcome`, :class:`Handlers`, :class:`AcceptorOptions`, the exceptions).
* :mod:`segnode.node.dicom.ul_pdu`: PDU and DIMSE command codecs, protocol constants, size
  limits.
* :mod:`segnode.node.dicom.ul_association`: one association (``_Association``): the PS3.8
  actions, its thread, PDU reading and DIMSE message assembly.
* :mod:`segnode.node.dicom.ul_fsm`: the state machine's table.

Imports run one way: ``ul`` -> ``ul_association`` -> ``ul_pdu`` -> ``ul_types`` (the
association module names the :class:`Acceptor` for typing only). Import the public names from
here.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time

from pynetdicom.presentation import PresentationContext, build_context

from segnode.node.dicom.requestor_outcome import describe_rejection
from segnode.node.dicom.ul_association import _Association
from segnode.node.dicom.ul_fsm import Event, State
from segnode.node.dicom.ul_pdu import (
    ABORT,
    APPLICATION_CONTEXT_NAME,
    ASSOCIATE_AC,
    ASSOCIATE_RJ,
    IMPLEMENTATION_CLASS_UID,
    IMPLEMENTATION_VERSION,
    P_DATA_TF,
    RELEASE_RP,
    RELEASE_RQ,
    VERIFICATION,
    decode_command,
    encode_command,
    pdata_pdus,
)
from segnode.node.dicom.ul_types import (
    AcceptorOptions,
    AssociationInfo,
    FollowUp,
    Handlers,
    PeerClosed,
    ProtocolError,
    StoreOutcome,
    StoreRequest,
    tell,
)

log = logging.getLogger(__name__)

#: Listen backlog (the kernel caps it at net.core.somaxconn).
BACKLOG = 1024
#: When the acceptor stops: how long an aborted association waits for its peer to close.
STOP_LINGER_S = 1.0
#: Bounds of the back-off after accept() fails (EMFILE and friends).
ACCEPT_BACKOFF_S = (0.05, 2.0)


class _RateLimitedWarning:
    """A warning that, under a flood, is logged at most once per ``interval`` with a count;
    called with a ``key`` (a peer's address), once per interval for each key."""

    #: Keys remembered at most; past it, those whose interval has passed are forgotten.
    MAX_KEYS = 1024

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        # key -> (when last logged, how many suppressed since)
        self._seen: dict[str, tuple[float, int]] = {}

    def __call__(self, msg: str, *args: object, key: str = "") -> None:
        now = time.monotonic()
        last, suppressed = self._seen.get(key, (-1e9, 0))
        if now - last < self.interval:
            self._seen[key] = (last, suppressed + 1)
            return
        if suppressed:
            msg += f" ({suppressed} more like it in the last {self.interval:.0f} s)"
        if len(self._seen) >= self.MAX_KEYS:
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self.interval}
        self._seen[key] = (now, 0)
        log.warning(msg, *args)


# -- the acceptor ----------------------------------------------------------------------------


class Acceptor:
    """Listens on one address: one selector thread for connections that are not associations,
    one thread per association."""

    def __init__(self, options: AcceptorOptions, handlers: Handlers) -> None:
        self.options = options
        self.handlers = handlers
        self._supported: list[PresentationContext] = [
            build_context(abstract, syntaxes) for abstract, syntaxes in options.contexts.items()
        ]
        self._listener: socket.socket | None = None
        # Read once at bind: the address stays answerable after stop() closed the socket
        # (a status line written while the node stops).
        self._address: tuple[str, int] | None = None
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        # Written once when stopping: idle associations, then all of them, wake from poll().
        self._stop_idle_r, self._stop_idle_w = os.pipe()
        self._stop_all_r, self._stop_all_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._associations: dict[_Association, threading.Thread] = {}
        # Connections the selector thread holds (Sta2 and Sta13), oldest first.
        self._held: dict[_Association, None] = {}
        self._adopt: list[_Association] = []
        self._stopping = False
        self._abort_all = False
        self._accept_paused_until = 0.0
        self._backoff = ACCEPT_BACKOFF_S[0]
        self._evicted = _RateLimitedWarning()
        self._refused = _RateLimitedWarning()
        self._refused_host = _RateLimitedWarning()
        self._per_host = options.max_associations_per_host or max(4, options.max_associations // 2)
        self._accept_failed = _RateLimitedWarning()

    @property
    def server_address(self) -> tuple[str, int]:
        """The bound ``(host, port)`` of the listening socket."""
        assert self._address is not None, "the acceptor was not started"
        return self._address

    @property
    def active_associations(self) -> int:
        """Associations with a thread (Sta3 to Sta12)."""
        with self._lock:
            return len(self._associations)

    @property
    def pending_connections(self) -> int:
        """Connections without an association (Sta2, Sta13)."""
        with self._lock:
            return len(self._held)

    def start(self, address: tuple[str, int]) -> None:
        """Bind, listen and serve in a background thread."""
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(BACKLOG)
        listener.setblocking(False)
        host, port = listener.getsockname()[:2]
        self._address = (str(host), int(port))
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(
            target=self._loop, name=f"acceptor:{address[1]}", daemon=True
        )
        self._thread.start()

    def stop(self, grace: float = 5.0, timeout: float = 5.0) -> None:
        """Stop accepting and close every connection without an association; abort idle
        associations at once; let messages in flight finish for ``grace`` seconds, then abort
        the rest. Waits at most ``timeout`` more for their threads."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout)
        os.write(self._stop_idle_w, b"x")
        deadline = time.monotonic() + grace
        self._join_associations(deadline)
        with self._lock:
            left = list(self._associations)
        if left:
            log.warning("aborting %d association(s) still receiving after %.1f s", len(left), grace)
        self._abort_all = True
        os.write(self._stop_all_w, b"x")
        self._join_associations(time.monotonic() + timeout)
        with self._lock:
            stuck = len(self._associations)
        if stuck:
            log.error("%d association thread(s) did not end", stuck)
        if not stuck:  # a thread still running may yet poll the stop pipes
            for fd in (self._stop_idle_r, self._stop_idle_w, self._stop_all_r, self._stop_all_w):
                os.close(fd)
        self._wake_r.close()
        self._wake_w.close()

    def _join_associations(self, deadline: float) -> None:
        while True:
            with self._lock:
                threads = list(self._associations.values())
            if not threads or time.monotonic() >= deadline:
                return
            threads[0].join(max(0.0, deadline - time.monotonic()))

    # -- the selector thread -------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether the selector thread runs (the service's watchdog checks it)."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._iterate()
                except Exception:  # one connection's trouble must not stop the listener
                    log.exception("acceptor loop error; continuing")
                    time.sleep(0.01)
        finally:
            self._close_all_held()

    def _iterate(self) -> None:
        timeout = self._next_deadline()
        for key, mask in self._selector.select(timeout):
            if key.fileobj is self._listener:
                self._accept()
            elif key.fileobj is self._wake_r:
                with contextlib.suppress(OSError):
                    self._wake_r.recv(4096)
            else:
                self._on_ready(key.data, mask)
            if self._stopping:
                return
        self._take_adopted()
        self._expire()

    def _next_deadline(self) -> float | None:
        now = time.monotonic()
        deadlines = [a.artim for a in self._held if a.artim is not None]
        if self._accept_paused_until:
            deadlines.append(self._accept_paused_until)
        if not deadlines:
            return None
        return max(0.0, min(deadlines) - now)

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):  # a burst, then let the held connections have their turn
            try:
                conn, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause_accept(exc)
                return
            self._backoff = ACCEPT_BACKOFF_S[0]
            self._admit(conn, (str(peer[0]), int(peer[1])))

    def _pause_accept(self, exc: OSError) -> None:
        """accept() failed for want of resources: stop accepting for a while (doubling up to
        2 s) instead of spinning on a listener that stays readable, and free the oldest held
        connection."""
        self._accept_failed("accept() failed (%s); pausing %.2f s", exc.strerror, self._backoff)
        assert self._listener is not None
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._accept_paused_until = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, ACCEPT_BACKOFF_S[1])
        if self._held:
            self._evict(next(iter(self._held)), "out of file descriptors")

    def _admit(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        """Evt5 (transport connection indication): make room within the pending limits by
        expiring the oldest held connections, then AE-5."""
        o = self.options
        same = [a for a in self._held if a.info.address == peer[0]]
        if len(same) >= o.max_pending_per_host:
            self._evict(same[0], f"more than {o.max_pending_per_host} from {peer[0]}")
        if len(self._held) >= o.max_pending:
            self._evict(next(iter(self._held)), f"more than {o.max_pending} in all")
        assoc = _Association(self, conn, peer)
        try:
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            assoc.fire(Event.EVT5)
            if o.tls_context is not None:
                assoc.start_tls(o.tls_context, o.handshake_timeout)
        except (OSError, ValueError) as exc:
            log.warning("connection from %s failed: %s", peer[0], exc)
            assoc.close()
            return
        self._hold(assoc)

    def _hold(self, assoc: _Association) -> None:
        events = selectors.EVENT_WRITE if assoc.want_write else selectors.EVENT_READ
        try:
            self._selector.register(assoc.conn, events, assoc)
        except (KeyError, ValueError, OSError):  # closed meanwhile, or already registered
            assoc.close()
            return
        with self._lock:
            self._held[assoc] = None

    def _release_held(self, assoc: _Association) -> None:
        with self._lock:
            self._held.pop(assoc, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(assoc.conn)

    def _evict(self, assoc: _Association, why: str) -> None:
        """Expire a held connection's ARTIM now (Evt18: AA-2, close)."""
        tell(self.handlers, "cut_off", assoc.info, f"closed: pending-connection limit ({why})")
        self._evicted(
            "closing a connection from %s in %s: pending-connection limit (%s)",
            assoc.info.address,
            assoc.state.value,
            why,
        )
        self._release_held(assoc)
        assoc.fire(Event.EVT18)
        assoc.close()

    def _on_ready(self, assoc: _Association, mask: int) -> None:
        try:
            assoc.pump()
        except Exception:  # a bug must not take the selector thread down
            log.exception("connection from %s failed", assoc.info.address)
            assoc.close()
        self._after_pump(assoc)

    def _after_pump(self, assoc: _Association) -> None:
        if assoc.state is State.STA1 or assoc.closed:
            self._release_held(assoc)
            assoc.close()
        elif assoc.state is State.STA3:
            self._release_held(assoc)
            try:
                self._respond(assoc)
            except Exception:
                log.exception(
                    "answering the association request from %s failed", assoc.info.address
                )
                assoc.close()
        elif assoc.state in (State.STA2, State.STA13):
            events = selectors.EVENT_WRITE if assoc.want_write else selectors.EVENT_READ
            with contextlib.suppress(KeyError, ValueError):
                self._selector.modify(assoc.conn, events, assoc)

    def _expire(self) -> None:
        now = time.monotonic()
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            assert self._listener is not None
            self._selector.register(self._listener, selectors.EVENT_READ, None)
        for assoc in [a for a in self._held if a.artim is not None and a.artim <= now]:
            if assoc.state is State.STA2:
                self._evicted(
                    "no complete A-ASSOCIATE-RQ from %s within %.0f s; closing",
                    assoc.info.address,
                    self.options.acse_timeout,
                )
                tell(
                    self.handlers,
                    "cut_off",
                    assoc.info,
                    f"no complete A-ASSOCIATE-RQ within {self.options.acse_timeout:.0f} s",
                )
            self._release_held(assoc)
            assoc.fire(Event.EVT18)
            assoc.close()

    def _take_adopted(self) -> None:
        with self._lock:
            adopted, self._adopt = self._adopt, []
        for assoc in adopted:
            self._hold(assoc)

    def linger(self, assoc: _Association) -> None:
        """Take an association's connection in Sta13 into the selector (its thread ends)."""
        if self._stopping:
            assoc.linger_here(STOP_LINGER_S)
            return
        assoc.in_selector = True
        with self._lock:
            self._adopt.append(assoc)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _close_all_held(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._listener)
            self._listener.close()
        with self._lock:
            held = list(self._held) + self._adopt
            self._held.clear()
            self._adopt = []
        for assoc in held:
            assoc.close()
        self._selector.close()

    # -- the local user's answer to an A-ASSOCIATE indication -----------------------------

    def _respond(self, assoc: _Association) -> None:
        """Sta3: reject (Evt8) or accept (Evt7, in the association's own thread)."""
        rejection = self._rejection(assoc)
        if rejection is None:
            host = assoc.info.address
            with self._lock:
                full = len(self._associations) >= self.options.max_associations
                held = sum(1 for a in self._associations if a.info.address == host)
            if full:
                self._refused(
                    "association from %r refused: %d associations already active",
                    assoc.info.calling_ae,
                    self.options.max_associations,
                )
            elif held >= self._per_host:
                self._refused_host(
                    "association from %r at %s refused: %d associations from that address "
                    "already active",
                    assoc.info.calling_ae,
                    host,
                    held,
                    key=host,
                )
            if full or held >= self._per_host:
                rejection = (0x02, 0x03, 0x02)  # transient, provider (presentation), local limit
        if rejection is not None:
            assoc.rejection = rejection
            tell(self.handlers, "refused", assoc.info, describe_rejection(*rejection))
            try:
                assoc.fire(Event.EVT8)
            except OSError:
                assoc.close()
                return
            if assoc.state is State.STA13:
                self._hold(assoc)
            return
        assoc.in_selector = False
        thread = threading.Thread(
            target=assoc.serve, name=f"assoc:{assoc.info.address}:{assoc.info.port}", daemon=True
        )
        with self._lock:
            self._associations[assoc] = thread
        thread.start()

    def _rejection(self, assoc: _Association) -> tuple[int, int, int] | None:
        rq = assoc.request
        assert rq is not None
        info = assoc.info
        if str(rq.application_context_name) != APPLICATION_CONTEXT_NAME:
            return (0x01, 0x01, 0x02)  # application context name not supported
        if self.options.check_called_ae and info.called_ae != self.options.ae_title:
            log.warning(
                "association from %r at %s refused: called AE title %r is not %r",
                info.calling_ae,
                info.address,
                info.called_ae,
                self.options.ae_title,
            )
            return (0x01, 0x01, 0x07)  # called AE title not recognised
        return self.handlers.requested(info)

    def _ended(self, assoc: _Association) -> None:
        with self._lock:
            self._associations.pop(assoc, None)


__all__: list[str] = [
    "ABORT",
    "ASSOCIATE_AC",
    "ASSOCIATE_RJ",
    "IMPLEMENTATION_CLASS_UID",
    "IMPLEMENTATION_VERSION",
    "P_DATA_TF",
    "RELEASE_RP",
    "RELEASE_RQ",
    "VERIFICATION",
    "Acceptor",
    "AcceptorOptions",
    "AssociationInfo",
    "FollowUp",
    "Handlers",
    "PeerClosed",
    "ProtocolError",
    "StoreOutcome",
    "StoreRequest",
    "decode_command",
    "encode_command",
    "pdata_pdus",
]
