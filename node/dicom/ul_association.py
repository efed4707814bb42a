"""One association of the Upper Layer acceptor: its PS3.8 state machine, its thread, its messages.

Owns :class:`_Association`: the actions of Table 9-10 (:meth:`_Association.fire` performs the
one :mod:`segnode.node.dicom.ul_fsm` names), the selector-side steps of a connection that is
not yet (or no more) an association (TLS handshake, reading the A-ASSOCIATE-RQ in ``Sta2``,
draining in ``Sta13``), the association's own thread from AE-7 to its end (reading PDUs within
the data-phase time limits, assembling DIMSE messages within their size limits, dispatching
C-STORE and C-ECHO to the service user and sending the responses, then their follow-ups), and
the association negotiation (the A-ASSOCIATE-AC: :mod:`segnode.node.dicom.ul_negotiation`).

Must not touch: the listening socket, the selector, the pending and association counts or the
admission limits, which are the :class:`~segnode.node.dicom.ul.Acceptor`'s. It reaches the
acceptor only through the object it is given (its options, handlers, supported contexts,
stop pipes, ``linger`` and ``_ended``) and imports :mod:`segnode.node.dicom.ul` for typing
only (the acceptor imports this module).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from pynetdicom.pdu import A_ASSOCIATE_RQ

from segnode.node.dicom.ul_fsm import NOT_POSSIBLE, TABLE, Action, Event, InvalidTransition, State
from segnode.node.dicom.ul_negotiation import accept_pdu
from segnode.node.dicom.ul_pdu import (
    ABORT,
    ASSOCIATE_AC,
    ASSOCIATE_RJ,
    ASSOCIATE_RQ,
    C_CANCEL_RQ,
    C_ECHO_RQ,
    C_STORE_RQ,
    MAX_ASSOCIATE_RQ,
    MAX_COMMAND_BYTES,
    NO_DATASET,
    P_DATA_TF,
    RELEASE_RP,
    RELEASE_RP_PDU,
    RELEASE_RQ,
    RELEASE_RQ_PDU,
    SOP_CLASS_NOT_SUPPORTED,
    UNRECOGNISED_OPERATION,
    VERIFICATION,
    _context_fault,
    _each_pdv,
    _gather,
    _text,
    _uint16,
    _us,
    abort_pdu,
    decode_command,
    encode_command,
    pdata_pdus,
    pdv_headers,
    reject_pdu,
)
from segnode.node.dicom.ul_types import (
    AssociationInfo,
    FollowUp,
    PeerClosed,
    ProtocolError,
    StoreRequest,
    tell,
)

if TYPE_CHECKING:
    from segnode.node.dicom.ul import Acceptor

log = logging.getLogger(__name__)

#: TCP_QUICKACK where the platform has it (Linux).
QUICKACK: int = getattr(socket, "TCP_QUICKACK", 0)
#: In Sta13, bytes read and thrown away while waiting for the peer to close; beyond, close.
DRAIN_BYTES = 1 << 20

_PDU_EVENTS = {
    ASSOCIATE_RQ: Event.EVT6,
    ASSOCIATE_AC: Event.EVT3,
    ASSOCIATE_RJ: Event.EVT4,
    P_DATA_TF: Event.EVT10,
    RELEASE_RQ: Event.EVT12,
    RELEASE_RP: Event.EVT13,
    ABORT: Event.EVT16,
}


class _Timeout(Exception):
    """A data-phase time limit passed."""


class _Interrupted(Exception):
    """The acceptor is stopping."""


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

    def _cut(self, reason: str) -> None:
        """The node is about to abort or close this peer for what it sent (or did not)."""
        tell(self.handlers, "cut_off", self.info, reason)

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
            tell(self.handlers, "refused", self.info, "protocol version not supported")
            self._send(reject_pdu(*self.rejection))
            self._start_artim()
            return State.STA13
        return State.STA3

    def _ae7(self, _: Any) -> State:
        pdu, self.info.max_send_pdu, contexts = accept_pdu(
            self.request, self.acceptor._supported, self.options.max_pdu
        )
        self.info.contexts.update(contexts)
        self._send(pdu)
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

            why = describe_tls_error(exc)
            log.warning("TLS handshake with %s failed: %s", self.info.address, why)
            self._cut(f"TLS handshake failed: {why}")
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
            self._cut(f"unrecognised PDU type 0x{pdu_type:02X} instead of an A-ASSOCIATE-RQ")
            self.fire(Event.EVT19)
            return
        if event is not Event.EVT6:
            self.abort_reason = 0x02
            self.fire(event)  # AA-1 (or AA-2 for an A-ABORT)
            return
        if length > MAX_ASSOCIATE_RQ:
            self.abort_reason = 0x06
            log.warning("A-ASSOCIATE-RQ from %s of %d bytes refused", self.info.address, length)
            self._cut(f"an A-ASSOCIATE-RQ of {length} bytes")
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
            self._cut(f"an undecodable A-ASSOCIATE-RQ ({type(exc).__name__})")
            self.fire(Event.EVT19)
            return
        fault = _context_fault(rq.presentation_context_definition_list)
        if fault:
            log.warning("invalid A-ASSOCIATE-RQ from %s (%s); aborting", self.info.address, fault)
            self._cut(f"an invalid A-ASSOCIATE-RQ ({fault})")
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
            why = "a message in progress arrives too slowly" if self._busy else "no data"
            log.warning("association with %s timed out (%s); aborting", self.info.address, why)
            self._cut(f"timed out ({why})")
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
            self._cut(f"DIMSE protocol error: {exc}")
            self.abort_source, self.abort_reason = 0x02, exc.reason
            self.fire(Event.EVT15)
        if self.state in (State.STA8, State.STA12):
            # Before the A-RELEASE-RP: what the service user must make durable about this
            # association (the audit trail's record of the instances it received).
            tell(self.handlers, "releasing", self.info, "A-RELEASE-RQ")
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
            self._cut(f"unrecognised PDU type 0x{pdu_type:02X}")
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
                self._cut(f"a P-DATA-TF of {length} bytes over the maximum {self.options.max_pdu}")
                return Event.EVT19, None
            body = self._read(length)
            try:
                return event, self._pdvs(body)
            except ProtocolError as exc:
                self.abort_reason = exc.reason
                log.warning("invalid P-DATA-TF from %s: %s", self.info.address, exc)
                self._cut(f"an invalid P-DATA-TF: {exc}")
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
        for cx_id, control, size in pdv_headers(body):
            if cx_id not in self.info.contexts:
                raise ProtocolError(f"PDV on presentation context {cx_id} not accepted", 0x06)
            if size == 0 and not control & 0x02:
                # An empty fragment carries nothing; only a last one has a meaning (a sender
                # whose data ended on a fragment boundary may send it).
                raise ProtocolError("empty PDV that is not the last fragment", 0x06)
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
        self._command_size = _gather(
            self._command, self._command_size, value, MAX_COMMAND_BYTES, "command set", 0x06
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
        self._dataset_size = _gather(
            self._dataset, self._dataset_size, value, self.options.max_dataset_bytes, "dataset", 0
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
