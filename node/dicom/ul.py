"""segnode's DICOM Upper Layer acceptor: the PS3.8 state machine, limits that hold under attack.

The node speaks the Upper Layer itself for speed: pynetdicom's acceptor runs two threads per
association that poll each other every millisecond and turns every P-DATA-TF into objects.
Here each *association* has one thread that reads each PDU straight into one buffer, cuts
the PDVs out as memoryviews and hands the C-STORE handler the encoded dataset with at most
one join. What it does not write itself it takes from pynetdicom's public modules: the
A-ASSOCIATE-RQ/AC PDU codecs and presentation-context and role negotiation
(:func:`pynetdicom.presentation.negotiate_as_acceptor`).

The protocol is the PS3.8 state machine of :mod:`segnode.node.dicom.ul_fsm`: every PDU, timer,
closed connection and local decision is an ``Evt``, and :meth:`_Association.fire` performs the
action Table 9-10 names for it in the current ``Sta``. Where the work happens:

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
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import select
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydicom.uid import UID
from pynetdicom.pdu import A_ASSOCIATE_AC, A_ASSOCIATE_RQ
from pynetdicom.pdu_primitives import (
    A_ASSOCIATE,
    ImplementationClassUIDNotification,
    ImplementationVersionNameNotification,
    MaximumLengthNotification,
    SCP_SCU_RoleSelectionNegotiation,
)
from pynetdicom.presentation import PresentationContext, build_context, negotiate_as_acceptor

from segnode.node.dicom.ul_fsm import NOT_POSSIBLE, TABLE, Action, Event, InvalidTransition, State

log = logging.getLogger(__name__)

#: The DICOM Application Context Name (PS3.7 Annex A.2.1).
APPLICATION_CONTEXT_NAME = "1.2.840.10008.3.1.1.1"
#: segnode's Implementation Class UID (a UUID-derived UID, PS3.5 §B.2) and version name.
IMPLEMENTATION_CLASS_UID = "2.25.10026610226874283191782567681120315047"
IMPLEMENTATION_VERSION = "SEGNODE_0.1"
VERIFICATION = "1.2.840.10008.1.1"

# PDU types (PS3.8 §9.3)
ASSOCIATE_RQ, ASSOCIATE_AC, ASSOCIATE_RJ = 0x01, 0x02, 0x03
P_DATA_TF, RELEASE_RQ, RELEASE_RP, ABORT = 0x04, 0x05, 0x06, 0x07

# DIMSE command fields and elements (PS3.7 §E.1)
C_STORE_RQ, C_ECHO_RQ, C_CANCEL_RQ = 0x0001, 0x0030, 0x0FFF
NO_DATASET = 0x0101
UNRECOGNISED_OPERATION = 0x0211
SOP_CLASS_NOT_SUPPORTED = 0x0122

#: TCP_QUICKACK where the platform has it (Linux).
QUICKACK: int = getattr(socket, "TCP_QUICKACK", 0)
#: The largest A-ASSOCIATE-RQ accepted (a real one is a few kB; 256 contexts fit in 64 kB).
MAX_ASSOCIATE_RQ = 256 << 10
#: The largest DIMSE command set accepted (a real one is under 1 kB).
MAX_COMMAND_BYTES = 64 << 10
#: What a PDV counts against its message's limit at least: each fragment costs a memoryview
#: and a list slot besides its wire bytes, so a message of tiny fragments must not cost more
#: memory than its limit allows (a sender fragments to the maximum PDU length, kilobytes).
MIN_FRAGMENT_COST = 1 << 10
#: Listen backlog (the kernel caps it at net.core.somaxconn).
BACKLOG = 1024
#: In Sta13, bytes read and thrown away while waiting for the peer to close; beyond, close.
DRAIN_BYTES = 1 << 20
#: When the acceptor stops: how long an aborted association waits for its peer to close.
STOP_LINGER_S = 1.0
#: Bounds of the back-off after accept() fails (EMFILE and friends).
ACCEPT_BACKOFF_S = (0.05, 2.0)

_PDU_EVENTS = {
    ASSOCIATE_RQ: Event.EVT6,
    ASSOCIATE_AC: Event.EVT3,
    ASSOCIATE_RJ: Event.EVT4,
    P_DATA_TF: Event.EVT10,
    RELEASE_RQ: Event.EVT12,
    RELEASE_RP: Event.EVT13,
    ABORT: Event.EVT16,
}


class ProtocolError(Exception):
    """The peer broke the Upper Layer or DIMSE protocol; the association is aborted."""

    def __init__(self, message: str, reason: int = 0x00) -> None:
        super().__init__(message)
        #: A-ABORT reason (source 2, service provider): 1 unrecognised PDU, 2 unexpected PDU,
        #: 6 invalid PDU parameter value, 0 not specified.
        self.reason = reason


class PeerClosed(Exception):
    """The transport connection closed."""


class _Timeout(Exception):
    """A data-phase time limit passed."""


class _Interrupted(Exception):
    """The acceptor is stopping."""


_ASSOCIATION_IDS = itertools.count(1)


@dataclass
class AssociationInfo:
    """What the handlers learn about an association."""

    calling_ae: str
    called_ae: str
    address: str
    port: int
    #: Accepted presentation contexts: context ID -> (abstract syntax, transfer syntax).
    contexts: dict[int, tuple[str, str]] = field(default_factory=dict)
    #: The peer's maximum PDU length (0 = unlimited).
    max_send_pdu: int = 0
    #: A number no other association of this process has had (``id()`` of a finished
    #: association's object can come back for a new one).
    id: int = field(default_factory=lambda: next(_ASSOCIATION_IDS))


@dataclass
class StoreRequest:
    """A received C-STORE-RQ with its encoded dataset (without File Meta Information)."""

    sop_class_uid: str
    sop_instance_uid: str
    transfer_syntax: str
    message_id: int
    priority: int
    move_originator_ae: str
    dataset: bytes | memoryview


#: Work that must follow a C-STORE but must not delay its response.
FollowUp = Callable[[], object]


@dataclass(frozen=True)
class StoreOutcome:
    """What a C-STORE handler returns: the response's status, its Error Comment (0000,0902),
    sent with a status other than success, and the follow-ups that the association's thread
    runs, in order, once the response is sent (an exception in one is logged and the next
    one still runs)."""

    status: int
    comment: str = ""
    after: tuple[FollowUp, ...] = ()


class Handlers(Protocol):
    """The service user: called from the association's thread (``requested`` from the
    acceptor's selector thread: it must not block). The Acceptor is given one at
    construction."""

    def requested(self, info: AssociationInfo) -> tuple[int, int, int] | None:
        """Return (result, source, diagnostic) to reject the association, None to go on."""

    def accepted(self, info: AssociationInfo) -> None:
        """The association was accepted."""

    def store(self, info: AssociationInfo, request: StoreRequest) -> StoreOutcome:
        """Handle one C-STORE; the status is sent back when this returns, then the
        outcome's follow-ups run."""

    def closed(self, info: AssociationInfo, released: bool) -> None:
        """The association ended: released normally, or aborted/dropped (released=False)."""


# -- encoding helpers ------------------------------------------------------------------------


def _command_element(element: int, value: bytes) -> bytes:
    if len(value) % 2:
        value += b"\x00"
    return struct.pack("<HHI", 0x0000, element, len(value)) + value


def _us(value: int) -> bytes:
    return struct.pack("<H", value)


def encode_command(elements: Iterable[tuple[int, bytes]]) -> bytes:
    """Encode a DIMSE command set (implicit VR little endian, group 0000)."""
    body = b"".join(_command_element(e, v) for e, v in sorted(elements))
    return _command_element(0x0000, struct.pack("<I", len(body))) + body


def decode_command(data: bytes | memoryview) -> dict[int, bytes]:
    """Decode a command set into {element: value bytes}; raises ProtocolError if malformed."""
    out: dict[int, bytes] = {}
    view = memoryview(data)
    offset, end = 0, len(view)
    while offset < end:
        if end - offset < 8:
            raise ProtocolError("truncated command element", 0x06)
        group, element, length = struct.unpack_from("<HHI", view, offset)
        offset += 8
        if group != 0x0000 or length > end - offset:
            raise ProtocolError("malformed command set", 0x06)
        out[element] = bytes(view[offset : offset + length])
        offset += length
    return out


def _text(value: bytes | None) -> str:
    return (value or b"").rstrip(b"\x00 ").decode("ascii", "replace").strip()


def _uint16(value: bytes | None, default: int = 0) -> int:
    return struct.unpack("<H", value[:2])[0] if value and len(value) >= 2 else default


def _each_pdv(body: memoryview) -> Iterator[tuple[int, int, memoryview]]:
    """The PDVs of a checked P-DATA-TF body: (context ID, control header, value)."""
    offset, end = 0, len(body)
    while offset < end:
        (length,) = struct.unpack_from(">I", body, offset)
        yield body[offset + 4], body[offset + 5], body[offset + 6 : offset + 4 + length]
        offset += 4 + length


def _fragment_cost(value: memoryview) -> int:
    """What a PDV counts against its message's limit: its bytes on the wire (value and the
    6-byte PDV header), at least :data:`MIN_FRAGMENT_COST`."""
    return max(len(value) + 6, MIN_FRAGMENT_COST)


def _context_fault(contexts: Iterable[PresentationContext]) -> str:
    """What makes a decoded A-ASSOCIATE-RQ's presentation contexts invalid, "" if nothing: each
    item has one abstract syntax and at least one transfer syntax (PS3.8 §9.3.2.2), and an ID
    names one context (the A-ASSOCIATE-AC answers each ID once, §9.3.3.2)."""
    seen: set[int | None] = set()
    for cx in contexts:
        if not cx.abstract_syntax:
            return f"presentation context {cx.context_id} without an abstract syntax"
        if not cx.transfer_syntax:
            return f"presentation context {cx.context_id} without a transfer syntax"
        if cx.context_id in seen:
            return f"presentation context ID {cx.context_id} proposed twice"
        seen.add(cx.context_id)
    return ""


def pdata_pdus(context_id: int, command: bytes, max_pdu: int) -> list[bytes]:
    """P-DATA-TF PDU(s) carrying a command set, split to the peer's maximum PDU length."""
    room = len(command) if max_pdu == 0 else max(1, max_pdu - 6)
    pdus = []
    for start in range(0, len(command), room):
        piece = command[start : start + room]
        control = 0x01 | (0x02 if start + room >= len(command) else 0x00)
        pdv = struct.pack(">IBB", len(piece) + 2, context_id, control) + piece
        pdus.append(struct.pack(">BBI", P_DATA_TF, 0, len(pdv)) + pdv)
    return pdus


def abort_pdu(source: int = 0x02, reason: int = 0x00) -> bytes:
    return struct.pack(">BBIBBBB", ABORT, 0, 4, 0, 0, source, reason)


def reject_pdu(result: int, source: int, diagnostic: int) -> bytes:
    return struct.pack(">BBIBBBB", ASSOCIATE_RJ, 0, 4, 0, result, source, diagnostic)


RELEASE_RQ_PDU = struct.pack(">BBII", RELEASE_RQ, 0, 4, 0)
RELEASE_RP_PDU = struct.pack(">BBII", RELEASE_RP, 0, 4, 0)


# -- options ---------------------------------------------------------------------------------


@dataclass
class AcceptorOptions:
    """Acceptor settings (from ``[node]``)."""

    ae_title: str
    #: abstract syntax -> accepted transfer syntaxes (in order of preference).
    contexts: dict[str, list[str]]
    #: The maximum P-DATA-TF PDU length we announce and enforce (0 would announce no limit).
    max_pdu: int = 1 << 20
    #: ARTIM: the whole A-ASSOCIATE-RQ (and a TLS handshake) must arrive within this; also how
    #: long Sta13 waits for the peer to close.
    acse_timeout: float = 10.0
    #: Silence allowed between messages; while a message is in progress, the allowance for it.
    network_timeout: float = 60.0
    #: Bytes per second a PDU or message in progress must average beyond ``network_timeout``.
    min_rate: float = 16 << 10
    max_associations: int = 16
    #: Associations one IP address may hold at once; 0: half of ``max_associations``, at least
    #: 4 (so one host cannot take every slot, and a modality may still send over 4 at once).
    max_associations_per_host: int = 0
    max_pending: int = 64
    max_pending_per_host: int = 16
    #: Largest encoded dataset accepted in one C-STORE (0 = no limit); larger aborts.
    max_dataset_bytes: int = 1 << 30
    #: Reject an A-ASSOCIATE-RQ whose called AE title is not ``ae_title``.
    check_called_ae: bool = False
    tls_context: ssl.SSLContext | None = None
    handshake_timeout: float = 10.0


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


class _Association:
    """One transport connection's PS3.8 state machine and, once accepted, its receive loop."""

    def __init__(self, acceptor: Acceptor, conn: socket.socket, peer: tuple[str, int]) -> None:
        self.acceptor = acceptor
        self.options = acceptor.options
        self.handlers = acceptor.handlers
        self.conn = conn
        self.info = AssociationInfo("", "", peer[0], peer[1])
        self.state = State.STA1
        #: ARTIM timer: when it expires (monotonic seconds), None when stopped.
        self.artim: float | None = None
        self.established = False
        self.released = False
        self.closed = False
        self._told_closed = False
        #: The decoded A-ASSOCIATE-RQ (pynetdicom primitive) once received.
        self.request: Any = None
        self.rejection: tuple[int, int, int] = (0x01, 0x01, 0x01)
        #: A-ABORT source and reason for the next abort sent.
        self.abort_source, self.abort_reason = 0x02, 0x00
        self.want_write = False
        #: True while the selector thread owns the connection: sends must not block.
        self.in_selector = True
        self._rq_version = 1
        self._handshaking = False
        self._handshake_deadline = 0.0
        self._inbox = bytearray()
        self._drained = 0
        # Data phase: a PDU or message in progress, since when, and its bytes so far.
        self._busy = False
        self._busy_since = 0.0
        self._busy_bytes = 0
        self._idle_deadline = 0.0
        self._rate = float(self.options.min_rate) or float("inf")
        self._polls: tuple[Any, Any] | None = None
        # DIMSE message assembly.
        self._command: list[memoryview] = []
        self._command_size = 0
        self._dataset: list[memoryview] = []
        self._dataset_size = 0
        self._pending: dict[int, bytes] | None = None
        self._pending_cx = 0
        self._messages: list[tuple[int, dict[int, bytes], bytes | memoryview | None]] = []
        self._dimse_error: ProtocolError | None = None
        self._actions: dict[Action, Callable[[Any], State]] = {
            Action.AE_1: self._requestor_only,
            Action.AE_2: self._requestor_only,
            Action.AE_3: self._requestor_only,
            Action.AE_4: self._requestor_only,
            Action.AE_5: self._ae5,
            Action.AE_6: self._ae6,
            Action.AE_7: self._ae7,
            Action.AE_8: self._ae8,
            Action.DT_1: self._dt1,
            Action.DT_2: self._dt2,
            Action.AR_1: self._ar1,
            Action.AR_2: self._ar2,
            Action.AR_3: self._ar3,
            Action.AR_4: self._ar4,
            Action.AR_5: self._end_artim_and_close,
            Action.AR_6: self._ar6,
            Action.AR_7: self._ar7,
            Action.AR_8: self._ar8,
            Action.AR_9: self._ar9,
            Action.AR_10: self._ar10,
            Action.AA_1: self._aa1,
            Action.AA_2: self._end_artim_and_close,
            Action.AA_3: self._aa3,
            Action.AA_4: self._aa4,
            Action.AA_5: self._end_artim_and_close,
            Action.AA_6: self._aa6,
            Action.AA_7: self._aa7,
            Action.AA_8: self._aa8,
        }

    # -- the state machine ---------------------------------------------------------------

    def fire(self, event: Event, payload: Any = None) -> Action | None:
        """Perform Table 9-10's action for ``event`` in the current state; return it (None
        for a pair PS3.8 leaves empty: ignored, or :class:`InvalidTransition` for a local
        primitive)."""
        action = TABLE[(self.state, event)]
        if action is NOT_POSSIBLE:
            if event.local:
                raise InvalidTransition(
                    f"{event.value} ({event.description}) is not possible in {self.state.value}"
                )
            return None
        assert isinstance(action, Action)
        self.state = self._actions[action](payload)
        if self.established and not self._told_closed and self.state in (State.STA1, State.STA13):
            self._told_closed = True
            self.handlers.closed(self.info, self.released)
        return action

    # -- actions (PS3.8 §9.2.3) ------------------------------------------------------------

    def _requestor_only(self, _: Any) -> State:
        raise InvalidTransition("segnode's acceptor does not request associations")

    def _start_artim(self) -> None:
        self.artim = time.monotonic() + self.options.acse_timeout

    def _ae5(self, _: Any) -> State:
        self._start_artim()
        return State.STA2

    def _ae6(self, rq: Any) -> State:
        self.artim = None
        self.request = rq
        self.info.calling_ae = str(rq.calling_ae_title or "").strip()
        self.info.called_ae = str(rq.called_ae_title or "").strip()
        if not (self._rq_version & 0x0001):
            self.rejection = (0x01, 0x02, 0x02)  # protocol version not supported
            self._send(reject_pdu(*self.rejection))
            self._start_artim()
            return State.STA13
        return State.STA3

    def _ae7(self, _: Any) -> State:
        self._send(self._accept_pdu())
        self.established = True
        self.handlers.accepted(self.info)
        return State.STA6

    def _ae8(self, _: Any) -> State:
        self._send(reject_pdu(*self.rejection))
        self._start_artim()
        return State.STA13

    def _dt1(self, pdus: list[bytes]) -> State:
        for pdu in pdus:
            self._send(pdu)
        return State.STA6

    def _dt2(self, pdvs: Iterable[tuple[int, int, memoryview]]) -> State:
        self._receive_pdvs(pdvs)
        return State.STA6

    def _ar1(self, _: Any) -> State:
        self._send(RELEASE_RQ_PDU)
        return State.STA7

    def _ar2(self, _: Any) -> State:
        return State.STA8  # the A-RELEASE indication; the node answers at once (Evt14)

    def _ar3(self, _: Any) -> State:
        self.released = True
        self.close()
        return State.STA1

    def _ar4(self, _: Any) -> State:
        self._send(RELEASE_RP_PDU)
        self.released = True
        self._start_artim()
        return State.STA13

    def _ar6(self, pdvs: Iterable[tuple[int, int, memoryview]]) -> State:
        # P-DATA while our A-RELEASE-RQ is outstanding: the node may not answer (no P-DATA
        # request is possible in Sta7), so a request that arrives now is neither stored nor
        # acknowledged; its sender sees the association end and sends it again.
        log.warning("P-DATA from %s after our release request; not processed", self.info.address)
        return State.STA7

    def _ar7(self, pdus: list[bytes]) -> State:
        for pdu in pdus:
            self._send(pdu)
        return State.STA8

    def _ar8(self, _: Any) -> State:
        return State.STA10  # release collision; the node is always the association-acceptor

    def _ar9(self, _: Any) -> State:
        self._send(RELEASE_RP_PDU)
        return State.STA11

    def _ar10(self, _: Any) -> State:
        return State.STA12

    def _aa1(self, _: Any) -> State:
        self._try_send(abort_pdu(self.abort_source, self.abort_reason))
        self._start_artim()
        return State.STA13

    def _end_artim_and_close(self, _: Any) -> State:
        """AR-5, AA-2 and AA-5: stop the ARTIM timer, close the connection, back to Sta1
        (for AR-5 and AA-5 the peer has closed it already; closing our end is all that is
        left)."""
        self.artim = None
        self.close()
        return State.STA1

    def _aa3(self, _: Any) -> State:
        log.warning("association aborted by %s", self.info.address)
        self.close()
        return State.STA1

    def _aa4(self, _: Any) -> State:
        if self.established:
            log.warning("connection from %s closed without release", self.info.address)
        self.close()
        return State.STA1

    def _aa6(self, _: Any) -> State:
        return State.STA13

    def _aa7(self, _: Any) -> State:
        self._try_send(abort_pdu(0x02, self.abort_reason))
        return State.STA13

    def _aa8(self, _: Any) -> State:
        self._try_send(abort_pdu(0x02, self.abort_reason))
        self._start_artim()
        return State.STA13

    # -- association negotiation -------------------------------------------------------

    def _accept_pdu(self) -> bytes:
        rq = self.request
        max_length = 0
        roles: dict[UID, tuple[bool | None, bool | None]] = {}
        for item in rq.user_information:
            if isinstance(item, MaximumLengthNotification):
                max_length = int(item.maximum_length_received or 0)
            elif isinstance(item, SCP_SCU_RoleSelectionNegotiation) and item.sop_class_uid:
                roles[UID(item.sop_class_uid)] = (item.scu_role, item.scp_role)
        self.info.max_send_pdu = max_length
        results, role_items = negotiate_as_acceptor(
            rq.presentation_context_definition_list, self.acceptor._supported, roles
        )
        for cx in results:
            if cx.result == 0x00 and cx.context_id is not None:
                self.info.contexts[int(cx.context_id)] = (
                    str(cx.abstract_syntax),
                    str(cx.transfer_syntax[0]),
                )
        ac = A_ASSOCIATE()
        ac.application_context_name = UID(APPLICATION_CONTEXT_NAME)
        ac.calling_ae_title = rq.calling_ae_title
        ac.called_ae_title = rq.called_ae_title
        ac.result = 0x00
        ac.result_source = 0x01
        ac.presentation_context_definition_results_list = results
        length = MaximumLengthNotification()
        length.maximum_length_received = self.options.max_pdu
        impl = ImplementationClassUIDNotification()
        impl.implementation_class_uid = UID(IMPLEMENTATION_CLASS_UID)
        version = ImplementationVersionNameNotification()
        version.implementation_version_name = IMPLEMENTATION_VERSION
        ac.user_information = [length, impl, version, *role_items]
        out = A_ASSOCIATE_AC()
        out.from_primitive(ac)
        return bytes(out.encode())

    # -- transport -----------------------------------------------------------------------

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.conn.close()

    def _send(self, data: bytes) -> None:
        """Send all of ``data`` within ``network_timeout`` (the socket is non-blocking)."""
        view = memoryview(data)
        deadline = time.monotonic() + self.options.network_timeout
        while view:
            try:
                sent = self.conn.send(view)
            except (BlockingIOError, ssl.SSLWantWriteError):
                if self.in_selector:  # a PDU of a few bytes that cannot go at once: give up
                    raise TimeoutError("peer does not read") from None
                self._wait(select.POLLOUT, deadline)
                continue
            except ssl.SSLWantReadError:
                self._wait(select.POLLIN, deadline)
                continue
            view = view[sent:]

    def _try_send(self, data: bytes) -> None:
        with contextlib.suppress(OSError, _Timeout):
            self._send(data)

    def _wait(self, events: int, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("peer does not read")
        poller = select.poll()
        poller.register(self.conn, events)
        if not poller.poll(remaining * 1000):
            raise TimeoutError("peer does not read")

    # -- the selector side: Sta2 and Sta13 ---------------------------------------------------

    def start_tls(self, context: ssl.SSLContext, timeout: float) -> None:
        self.conn = context.wrap_socket(self.conn, server_side=True, do_handshake_on_connect=False)
        self._handshaking = True
        self._handshake_deadline = time.monotonic() + timeout
        if self.artim is not None:
            self.artim = min(self.artim, self._handshake_deadline)

    def pump(self) -> None:
        """The connection is ready (selector thread): progress the TLS handshake, read what
        arrived of the A-ASSOCIATE-RQ (Sta2), or drain (Sta13)."""
        self.want_write = False
        if self._handshaking and not self._handshake():
            return
        if self.state is State.STA13:
            self._drain()
            return
        while self.state is State.STA2:
            chunk = self._recv_available()
            if not chunk:
                return
            self._inbox += chunk
            self._on_request_bytes()

    def _recv_available(self) -> bytes | None:
        """One non-blocking read: the bytes there, or None when there are none now; the end
        of the stream or an error fires Evt17 and gives b""."""
        try:
            chunk = self.conn.recv(65536)
        except (BlockingIOError, ssl.SSLWantReadError):
            return None
        except ssl.SSLWantWriteError:
            self.want_write = True
            return None
        except OSError:
            chunk = b""
        if not chunk:
            self.fire(Event.EVT17)
        return chunk

    def _handshake(self) -> bool:
        assert isinstance(self.conn, ssl.SSLSocket)
        try:
            self.conn.do_handshake()
        except ssl.SSLWantReadError:
            return False
        except ssl.SSLWantWriteError:
            self.want_write = True
            return False
        except (OSError, ValueError) as exc:
            from segnode.node.dicom.tls import describe_tls_error

            log.warning(
                "TLS handshake with %s failed: %s", self.info.address, describe_tls_error(exc)
            )
            self.fire(Event.EVT17)
            return False
        self._handshaking = False
        return True

    def _on_request_bytes(self) -> None:
        """Sta2: classify the first PDU once its header (and, for an RQ, its body) is in."""
        if len(self._inbox) < 6:
            return
        pdu_type, _, length = struct.unpack_from(">BBI", self._inbox)
        event = _PDU_EVENTS.get(pdu_type)
        if event is None:
            self.abort_reason = 0x01
            self.fire(Event.EVT19)
            return
        if event is not Event.EVT6:
            self.abort_reason = 0x02
            self.fire(event)  # AA-1 (or AA-2 for an A-ABORT)
            return
        if length > MAX_ASSOCIATE_RQ:
            self.abort_reason = 0x06
            log.warning("A-ASSOCIATE-RQ from %s of %d bytes refused", self.info.address, length)
            self.fire(Event.EVT19)
            return
        if len(self._inbox) < 6 + length:
            return
        # What follows the request in the same read is the data phase's first bytes: kept for
        # the association's thread (a peer that sends at once must not wait for a timeout).
        raw = bytes(self._inbox[: 6 + length])
        del self._inbox[: 6 + length]
        pdu = A_ASSOCIATE_RQ()
        try:
            pdu.decode(raw)
            rq = pdu.to_primitive()
        except Exception as exc:  # pynetdicom raises many types on garbage
            log.warning(
                "undecodable A-ASSOCIATE-RQ from %s (%s)", self.info.address, type(exc).__name__
            )
            self.abort_reason = 0x06
            self.fire(Event.EVT19)
            return
        fault = _context_fault(rq.presentation_context_definition_list)
        if fault:
            log.warning("invalid A-ASSOCIATE-RQ from %s (%s); aborting", self.info.address, fault)
            self.abort_reason = 0x06
            self.fire(Event.EVT19)
            return
        self._rq_version = int(pdu.protocol_version)
        self.fire(Event.EVT6, rq)

    def _drain(self) -> None:
        """Sta13: read and ignore until the peer closes (Evt17) or too much arrives."""
        while True:
            chunk = self._recv_available()
            if not chunk:
                return
            self._drained += len(chunk)
            if self._drained > DRAIN_BYTES:
                self.fire(Event.EVT18)
                return

    def linger_here(self, seconds: float) -> None:
        """Sta13 without the selector (the acceptor is stopping): half-close, drain briefly,
        close."""
        deadline = time.monotonic() + seconds
        with contextlib.suppress(OSError):
            socket.socket.shutdown(self.conn, socket.SHUT_WR)
        poller = select.poll()
        with contextlib.suppress(OSError, ValueError):
            poller.register(self.conn, select.POLLIN)
        while not self.closed and self.state is State.STA13:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                self.fire(Event.EVT18)
                break
            self._drain()
        self.close()

    # -- the association thread: Sta3 to Sta13 ---------------------------------------------

    def serve(self) -> None:
        """The association's thread: accept (Evt7), then receive until it ends."""
        try:
            try:
                self.fire(Event.EVT7)
            except (OSError, _Timeout) as exc:
                log.warning("A-ASSOCIATE-AC to %s failed: %s", self.info.address, exc)
                self.close()
                return
            log.debug("association with %s in %s", self.info.address, self.state.value)
            self._polls = self._make_polls()
            self._idle_deadline = time.monotonic() + self.options.network_timeout
            while self.state not in (State.STA1, State.STA13):
                self._step()
            if self.state is State.STA13 and not self.closed:
                self.acceptor.linger(self)
        except Exception:
            log.exception("association with %s failed", self.info.address)
            self.close()
        finally:
            if self.established and not self._told_closed:
                self._told_closed = True
                with contextlib.suppress(Exception):
                    self.handlers.closed(self.info, False)
            self.acceptor._ended(self)

    def _make_polls(self) -> tuple[Any, Any]:
        idle, busy = select.poll(), select.poll()
        for p in (idle, busy):
            p.register(self.conn, select.POLLIN)
            p.register(self.acceptor._stop_all_r, select.POLLIN)
        idle.register(self.acceptor._stop_idle_r, select.POLLIN)
        return idle, busy

    def _step(self) -> None:
        """Wait for the next event and fire it; then let the local user answer."""
        try:
            event, payload = self._next_event()
        except _Interrupted:
            log.info("node stopping: aborting the association with %s", self.info.address)
            self.abort_source, self.abort_reason = 0x00, 0x00
            event, payload = Event.EVT15, None
        except _Timeout:
            log.warning(
                "association with %s timed out (%s); aborting",
                self.info.address,
                "a message in progress arrives too slowly" if self._busy else "no data",
            )
            self.abort_source, self.abort_reason = 0x00, 0x00
            event, payload = Event.EVT15, None
        except (PeerClosed, OSError):
            event, payload = Event.EVT17, None
        try:
            self.fire(event, payload)
            self._answer()
        except (OSError, _Timeout) as exc:
            log.warning("connection to %s failed: %s", self.info.address, exc)
            if self.state is not State.STA13:
                self.fire(Event.EVT17)
            else:
                self.close()
                self.state = State.STA1

    def _answer(self) -> None:
        """The local user's part after an indication: C-STORE/C-ECHO responses, the
        A-RELEASE response, an A-ABORT after a DIMSE protocol error."""
        while self._messages and self.state is State.STA6:
            cx_id, command, dataset = self._messages.pop(0)
            self._dispatch(cx_id, command, dataset)
        if self._dimse_error is not None and self.state not in (State.STA1, State.STA13):
            exc, self._dimse_error = self._dimse_error, None
            log.warning("aborting association with %s: %s", self.info.address, exc)
            self.abort_source, self.abort_reason = 0x02, exc.reason
            self.fire(Event.EVT15)
        if self.state in (State.STA8, State.STA12):
            self.fire(Event.EVT14)
        if self.state is State.STA6 and not self._busy:
            self._idle_deadline = time.monotonic() + self.options.network_timeout

    def _next_event(self) -> tuple[Event, Any]:
        if self.acceptor._abort_all or (self.acceptor._stopping and not self._busy):
            raise _Interrupted
        header = self._read(6)
        pdu_type, _, length = struct.unpack(">BBI", header)
        event = _PDU_EVENTS.get(pdu_type)
        if event is None:
            self.abort_reason = 0x01
            log.warning("unrecognised PDU type 0x%02X from %s", pdu_type, self.info.address)
            return Event.EVT19, None
        if event is Event.EVT10:
            if length > self.options.max_pdu:
                self.abort_reason = 0x06
                log.warning(
                    "P-DATA-TF of %d bytes from %s exceeds the announced maximum %d; aborting",
                    length,
                    self.info.address,
                    self.options.max_pdu,
                )
                return Event.EVT19, None
            body = self._read(length)
            try:
                return event, self._pdvs(body)
            except ProtocolError as exc:
                self.abort_reason = exc.reason
                log.warning("invalid P-DATA-TF from %s: %s", self.info.address, exc)
                return Event.EVT19, None
        if event in (Event.EVT12, Event.EVT13, Event.EVT16):
            if length != 4:
                self.abort_reason = 0x06
                return Event.EVT19, None
            body = self._read(4)
            self._busy = False
            return event, body
        # An A-ASSOCIATE PDU on an association: unexpected (AA-8); its body is not read.
        self.abort_reason = 0x02
        return event, None

    def _pdvs(self, body: memoryview) -> Iterator[tuple[int, int, memoryview]]:
        """Check the PDV items of a P-DATA-TF (PS3.8 §9.3.5.1) and return them (context ID,
        control header, value) one at a time: a PDU packed with PDVs builds no list of them,
        and its message's limits stop it at the first fragment too many. An invalid PDU
        raises."""
        offset, end = 0, len(body)
        if end < 6:
            raise ProtocolError("P-DATA-TF without a PDV", 0x06)
        while offset < end:
            if end - offset < 6:
                raise ProtocolError("truncated PDV", 0x06)
            (length,) = struct.unpack_from(">I", body, offset)
            if length < 2 or length > end - offset - 4:
                raise ProtocolError("invalid PDV length", 0x06)
            cx_id, control = body[offset + 4], body[offset + 5]
            if cx_id not in self.info.contexts:
                raise ProtocolError(f"PDV on presentation context {cx_id} not accepted", 0x06)
            if length == 2 and not control & 0x02:
                # An empty fragment carries nothing; only a last one has a meaning (a sender
                # whose data ended on a fragment boundary may send it).
                raise ProtocolError("empty PDV that is not the last fragment", 0x06)
            offset += 4 + length
        return _each_pdv(body)

    def _read(self, n: int) -> memoryview:
        """Read exactly ``n`` bytes, within the data phase's time limits."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = min(n, len(self._inbox))
        if got:  # read with the A-ASSOCIATE-RQ, before this thread started
            view[:got] = self._inbox[:got]
            del self._inbox[:got]
            if not self._busy:
                self._busy, self._busy_since, self._busy_bytes = True, time.monotonic(), 0
            self._busy_bytes += got
        conn = self.conn
        while got < n:
            try:
                if QUICKACK:
                    # Acknowledge at once: a sender whose last small segment waits for our
                    # ACK (Nagle) would otherwise stall ~40 ms per instance on the delayed ACK.
                    conn.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)
                k = conn.recv_into(view[got:], n - got)
            except (BlockingIOError, ssl.SSLWantReadError):
                self._wait_readable()
                continue
            if k == 0:
                raise PeerClosed
            if not self._busy:
                self._busy, self._busy_since, self._busy_bytes = True, time.monotonic(), 0
            self._busy_bytes += k
            got += k
        return view

    def _wait_readable(self) -> None:
        assert self._polls is not None
        if self._busy:
            deadline = (
                self._busy_since + self.options.network_timeout + self._busy_bytes / self._rate
            )
        else:
            deadline = self._idle_deadline
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Timeout
        ready = self._polls[1 if self._busy else 0].poll(remaining * 1000)
        if not ready:
            raise _Timeout
        if any(fd != self.conn.fileno() for fd, _ in ready):
            raise _Interrupted

    # -- DIMSE message assembly ------------------------------------------------------------

    def _receive_pdvs(self, pdvs: Iterable[tuple[int, int, memoryview]]) -> None:
        try:
            for cx_id, control, value in pdvs:
                if control & 0x01:
                    self._on_command(cx_id, value, bool(control & 0x02))
                else:
                    self._on_dataset(cx_id, value, bool(control & 0x02))
        except ProtocolError as exc:
            self._dimse_error = exc

    def _on_command(self, cx_id: int, value: memoryview, last: bool) -> None:
        if self._pending is not None:
            raise ProtocolError("command received while a dataset was expected", 0x02)
        if value:
            self._command.append(value)
        self._command_size += _fragment_cost(value)
        if self._command_size > MAX_COMMAND_BYTES:
            raise ProtocolError(
                f"command set over {MAX_COMMAND_BYTES} bytes (PDV headers included, "
                f"at least {MIN_FRAGMENT_COST} a fragment)",
                0x06,
            )
        if not last:
            return
        parts, self._command, self._command_size = self._command, [], 0
        raw = parts[0] if len(parts) == 1 else memoryview(b"".join(parts))
        command = decode_command(raw)
        if _uint16(command.get(0x0800), NO_DATASET) != NO_DATASET:
            self._pending, self._pending_cx = command, cx_id
            return
        self._messages.append((cx_id, command, None))
        self._busy = False

    def _on_dataset(self, cx_id: int, value: memoryview, last: bool) -> None:
        if self._pending is None or cx_id != self._pending_cx:
            raise ProtocolError("dataset fragment without its command", 0x02)
        if value:
            self._dataset.append(value)
        self._dataset_size += _fragment_cost(value)
        limit = self.options.max_dataset_bytes
        if limit and self._dataset_size > limit:
            raise ProtocolError(
                f"dataset over {limit} bytes (PDV headers included, "
                f"at least {MIN_FRAGMENT_COST} a fragment)",
                0x00,
            )
        if not last:
            return
        parts, self._dataset, self._dataset_size = self._dataset, [], 0
        data: bytes | memoryview = parts[0] if len(parts) == 1 else b"".join(parts)
        command, self._pending = self._pending, None
        self._messages.append((cx_id, command, data))
        self._busy = False

    def _dispatch(
        self, cx_id: int, command: dict[int, bytes], dataset: bytes | memoryview | None
    ) -> None:
        field_ = _uint16(command.get(0x0100))
        message_id = _uint16(command.get(0x0110))
        abstract, syntax = self.info.contexts[cx_id]
        sop_class = _text(command.get(0x0002))
        if field_ == C_CANCEL_RQ:
            return
        reply: list[tuple[int, bytes]] = [
            (0x0002, (sop_class or abstract).encode()),
            (0x0100, _us(field_ | 0x8000)),
            (0x0120, _us(message_id)),
            (0x0800, _us(NO_DATASET)),
        ]
        status, comment = UNRECOGNISED_OPERATION, "only C-STORE and C-ECHO are supported"
        after: tuple[FollowUp, ...] = ()
        if field_ in (C_STORE_RQ, C_ECHO_RQ) and sop_class != abstract:
            # PS3.7 §9.3.1.1 / §9.1.5: the request's SOP class is the context's abstract syntax.
            log.warning(
                "%s from %r for SOP class %s on a context negotiated for %s: refused",
                "C-STORE" if field_ == C_STORE_RQ else "C-ECHO",
                self.info.calling_ae,
                sop_class or "(none)",
                abstract,
            )
            status = SOP_CLASS_NOT_SUPPORTED
            comment = "SOP Class differs from the presentation context's abstract syntax"
            if field_ == C_STORE_RQ:
                reply.append((0x1000, _text(command.get(0x1000)).encode()))
        elif field_ == C_STORE_RQ and dataset is not None:
            sop_uid = _text(command.get(0x1000))
            request = StoreRequest(
                sop_class_uid=sop_class,
                sop_instance_uid=sop_uid,
                transfer_syntax=syntax,
                message_id=message_id,
                priority=_uint16(command.get(0x0700)),
                move_originator_ae=_text(command.get(0x1030)),
                dataset=dataset,
            )
            outcome = self.handlers.store(self.info, request)
            status, comment, after = outcome.status, outcome.comment, outcome.after
            reply.append((0x1000, sop_uid.encode()))
        elif field_ == C_STORE_RQ:
            status, comment = 0xC210, "C-STORE-RQ without a dataset"
        elif field_ == C_ECHO_RQ and abstract == VERIFICATION:
            status, comment = 0x0000, ""
        reply.append((0x0900, _us(status)))
        if comment and status != 0x0000:
            reply.append((0x0902, comment[:64].encode("ascii", "replace")))
        try:
            self.fire(Event.EVT9, pdata_pdus(cx_id, encode_command(reply), self.info.max_send_pdu))
        finally:
            self._after_reply(after)

    @staticmethod
    def _after_reply(after: tuple[FollowUp, ...]) -> None:
        for follow_up in after:
            try:
                follow_up()
            except Exception:
                log.exception("error after a C-STORE response")


__all__: list[str] = [
    "Acceptor",
    "AcceptorOptions",
    "AssociationInfo",
    "FollowUp",
    "Handlers",
    "StoreOutcome",
    "StoreRequest",
]
