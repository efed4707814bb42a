"""The Upper Layer requestor: the associations the outbox opens, on the caller's thread with
no helper thread, every read and write bounded by its operation's deadline.

Owns the requestor's side of PS3.8 for one association at a time on the calling thread: the
TCP (or TLS) connection, the A-ASSOCIATE-RQ and its answer (:meth:`Requestor.open`), C-STORE
and C-ECHO requests (PS3.7 §9.3.1, §9.3.5) and the checks of their responses
(:meth:`Association.store`, :meth:`Association.echo`), what a peer sends while the
association is idle (:meth:`Association.poll_idle`), A-RELEASE and A-ABORT. Each operation
has one deadline (connection and negotiation: ``timeout``; a request: ``timeout`` from its
first byte to the last byte of its response; a release: :data:`RELEASE_S` at most) and every
``send`` and ``recv`` waits only for what is left of it, so a peer that trickles cannot
extend it. Every PDU's length is checked against a limit (:data:`AC_LIMIT`, 4 bytes for the
fixed-size PDUs, the maximum PDU length we announced for P-DATA-TF) before anything of its
body is read. Whatever a peer does wrong ends the association (an A-ABORT where the protocol
still allows one) and comes back as a typed
:class:`~segnode.node.dicom.requestor_outcome.Failure` whose text says what happened, or as
:class:`~segnode.node.dicom.requestor_outcome.AssociationFailed` from :meth:`Requestor.open`:
no exception escapes for a peer's misbehaviour, and nothing here logs above DEBUG (the caller
writes one line).

Must not touch: the ledger, result files' paths, what is sent where and when, retries, backoff
and circuit breakers, which are :mod:`segnode.node.outbox.scu`'s and
:mod:`segnode.node.outbox.policy`'s; the outcome types and their words, which are
:mod:`segnode.node.dicom.requestor_outcome`'s; the acceptor
(:mod:`segnode.node.dicom.ul`, :mod:`segnode.node.dicom.ul_association`) and its state
machine. Wire formats come from :mod:`segnode.node.dicom.ul_pdu`, the A-ASSOCIATE-RQ/AC
codecs from pynetdicom's PDU classes (pynetdicom's AE, Association and DUL threads are not
used).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import socket
import ssl
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from pynetdicom.pdu import A_ASSOCIATE_AC, A_ASSOCIATE_RQ
from pynetdicom.pdu_primitives import (
    A_ASSOCIATE,
    ImplementationClassUIDNotification,
    ImplementationVersionNameNotification,
    MaximumLengthNotification,
)
from pynetdicom.presentation import PresentationContext

from segnode.node.dicom import ul_pdu
from segnode.node.dicom.requestor_outcome import (
    AssociationFailed,
    ConnectionLost,
    Context,
    Failure,
    NoResponse,
    PeerAborted,
    ProtocolViolation,
    Response,
    describe_abort,
    describe_rejection,
    sanitise,
)
from segnode.node.dicom.tls import describe_tls_error
from segnode.node.dicom.ul_pdu import (
    ABORT,
    APPLICATION_CONTEXT_NAME,
    ASSOCIATE_AC,
    ASSOCIATE_RJ,
    ASSOCIATE_RQ,
    C_ECHO_RQ,
    C_STORE_RQ,
    IMPLEMENTATION_CLASS_UID,
    IMPLEMENTATION_VERSION,
    MAX_COMMAND_BYTES,
    NO_DATASET,
    P_DATA_TF,
    RELEASE_RP,
    RELEASE_RQ,
    _text,
    _uint16,
    _us,
    decode_command,
    encode_command,
    pdata_pdus,
)
from segnode.node.dicom.ul_types import ProtocolError

log = logging.getLogger(__name__)

#: The largest A-ASSOCIATE-AC read (a real one is well under 1 kB).
AC_LIMIT = 64 << 10
#: At most this many seconds for a connection (within the negotiation's deadline).
CONNECT_S = 10.0
#: At most this many seconds for an A-RELEASE (within ``timeout``); then A-ABORT.
RELEASE_S = 2.0
#: Bytes of P-DATA read and ignored while our A-RELEASE-RQ waits; beyond, A-ABORT.
RELEASE_DRAIN = 1 << 20
#: Our maximum PDU length when the caller gives none (what a P-DATA-TF may be, PS3.8 D.1).
DEFAULT_MAX_PDU = 1 << 20

_PDU_NAMES = {
    ASSOCIATE_RQ: "A-ASSOCIATE-RQ",
    ASSOCIATE_AC: "A-ASSOCIATE-AC",
    ASSOCIATE_RJ: "A-ASSOCIATE-RJ",
    P_DATA_TF: "P-DATA-TF",
    RELEASE_RQ: "A-RELEASE-RQ",
    RELEASE_RP: "A-RELEASE-RP",
    ABORT: "A-ABORT",
}
_FIXED = (ASSOCIATE_RJ, RELEASE_RQ, RELEASE_RP, ABORT)
_COMMANDS = {0x8001: "C-STORE-RSP", 0x8030: "C-ECHO-RSP", 0x0001: "C-STORE-RQ", 0x0030: "C-ECHO-RQ"}
C_STORE_RSP, C_ECHO_RSP = 0x8001, 0x8030


class _Deadline(Exception):
    """The operation's deadline passed."""


class _Closed(Exception):
    """The connection closed (end of stream, reset, TLS failure)."""


class _Aborted(Exception):
    """The peer sent an A-ABORT."""

    def __init__(self, source: int, reason: int) -> None:
        super().__init__(describe_abort(source, reason))
        self.source, self.reason = source, reason


class _Violation(Exception):
    """The peer broke the protocol; ``reason`` is our A-ABORT's (source 2) reason."""

    def __init__(self, what: str, reason: int = 0x00) -> None:
        super().__init__(what)
        self.what, self.reason = what, reason


class _PeerSpoke(Exception):
    """Something arrived while our request was still being sent."""


class _SourceFailed(Exception):
    """Reading the data set to send failed (the file, not the peer)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _pdvs(body: bytes | bytearray) -> Iterator[tuple[int, int, memoryview]]:
    """The PDVs of a P-DATA-TF body (PS3.8 §9.3.5.1): context ID, control header, value.

    Raises
    ------
    _Violation
        On a PDV whose length does not fit the PDU, or a PDU without a PDV.
    """
    view = memoryview(body)
    try:
        for _ in ul_pdu.pdv_headers(view):
            pass
    except ProtocolError as exc:
        raise _Violation(f"a malformed P-DATA-TF: {exc}", 0x06) from None
    return ul_pdu._each_pdv(view)


class Association:
    """One established association of the requestor (made by :meth:`Requestor.open`).

    Used by one thread at a time. After a
    :class:`~segnode.node.dicom.requestor_outcome.Failure`, :meth:`abort` or
    :meth:`release` it is over: :attr:`is_established` is False and :attr:`ended` says how.

    Parameters
    ----------
    sock
        The connected, non-blocking socket (TLS already wrapped).
    peer
        ``host:port`` for messages.
    timeout
        Seconds for each request and its whole response.
    max_pdu
        Our maximum PDU length (P-DATA-TF PDUs longer than this are refused unread).
    """

    def __init__(self, sock: socket.socket, peer: str, timeout: float, max_pdu: int) -> None:
        self.socket = sock
        self.peer = peer
        self.timeout = timeout
        self.max_pdu = max_pdu
        #: The accepted presentation contexts.
        self.accepted: tuple[Context, ...] = ()
        #: The peer's maximum PDU length (0: unlimited) and the largest PDU we send.
        self.peer_max_pdu = 0
        self.max_send = DEFAULT_MAX_PDU
        #: Requests sent on it so far.
        self.requests = 0
        #: How it ended ("" while established).
        self.ended = ""
        self._established = False
        self._closed = False
        self._sent_any = False
        self._inbox = bytearray()
        self._msg_id = 0
        self._received = 0

    # -- state -----------------------------------------------------------------------------

    @property
    def is_established(self) -> bool:
        """Whether requests may be sent (not released, aborted or closed)."""
        return self._established

    def contexts_for(self, abstract_syntax: str) -> list[Context]:
        """The accepted contexts of ``abstract_syntax``, in the order proposed."""
        return [cx for cx in self.accepted if cx.abstract_syntax == abstract_syntax]

    def _end(self, how: str) -> None:
        self._established = False
        if not self.ended:
            self.ended = how
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                self.socket.close()

    def abort(self, why: str = "aborted by us", source: int = 0x00, reason: int = 0x00) -> None:
        """Send an A-ABORT (PS3.8 §7.3) if the socket takes it at once (this never waits)
        and close the connection."""
        if not self._closed:
            with contextlib.suppress(OSError, ValueError):
                self.socket.send(ul_pdu.abort_pdu(source, reason))
        self._end(why)

    def release(self) -> None:
        """A-RELEASE (PS3.8 §7.2) within :data:`RELEASE_S`; A-ABORT if the peer does not
        answer in time or answers something else. Does nothing once it is over."""
        if not self._established:
            return
        deadline = time.monotonic() + min(self.timeout, RELEASE_S)
        drained = 0
        try:
            self._send(ul_pdu.RELEASE_RQ_PDU, deadline)
            while True:
                kind, body = self._read_pdu(deadline)
                if kind == RELEASE_RP:
                    self._end("released")
                    return
                if kind == RELEASE_RQ:  # release collision (AR-8, AR-9): answer, wait for ours
                    self._send(ul_pdu.RELEASE_RP_PDU, deadline)
                elif kind == ABORT:
                    self._end(f"aborted by the peer ({describe_abort(body[2], body[3])})")
                    return
                elif kind == P_DATA_TF:  # AR-6: not answered
                    drained += len(body)
                    if drained > RELEASE_DRAIN:
                        raise _Violation("P-DATA-TF flood after our A-RELEASE-RQ")
                else:
                    raise _Violation(f"an unexpected {_PDU_NAMES[kind]} after our A-RELEASE-RQ")
        except _Deadline:
            self.abort("aborted: no A-RELEASE-RP in time")
        except _Closed:
            self._end("connection closed by the peer during release")
        except _Violation as exc:
            self.abort(f"aborted: {exc.what}", 0x02, exc.reason)

    def poll_idle(self) -> bool:
        """Between requests: whether the association is still usable, without waiting.

        What the peer sent meanwhile ends it: an A-RELEASE-RQ (answered), an A-ABORT, the
        connection closed, or anything else (a protocol violation: A-ABORT).
        """
        if not self._established:
            return False
        deadline = time.monotonic() + min(self.timeout, RELEASE_S)
        try:
            if not self._arrived():
                return True
            kind, body = self._read_pdu(deadline)
        except _Closed:
            self._end("connection closed by the peer")
            return False
        except _Deadline:
            self.abort("aborted: a PDU trickled in while idle")
            return False
        except _Violation as exc:
            self.abort(f"aborted: {exc.what} while idle", 0x02, exc.reason)
            return False
        if kind == RELEASE_RQ:
            with contextlib.suppress(_Closed, _Deadline):
                self._send(ul_pdu.RELEASE_RP_PDU, deadline)
            self._end("released by the peer")
        elif kind == ABORT:
            self._end(f"aborted by the peer ({describe_abort(body[2], body[3])})")
        else:
            self.abort(f"aborted: an unsolicited {_PDU_NAMES[kind]} while idle", 0x02, 0x02)
        return False

    # -- requests --------------------------------------------------------------------------

    def _next_id(self) -> int:
        self._msg_id = self._msg_id % 0xFFFF + 1
        return self._msg_id

    def store(
        self,
        context: Context,
        sop_class: str,
        sop_instance: str,
        dataset: bytes | BinaryIO,
        priority: int = 0x0000,
    ) -> Response | Failure:
        """C-STORE ``dataset`` (encoded in ``context``'s transfer syntax; bytes, or a binary
        file positioned at the data set's first byte, read as it is sent) and wait for the
        response, within ``timeout`` of the first byte sent.

        Returns
        -------
        Response | Failure
            The destination's valid C-STORE-RSP, or why there is none (the association is
            then over).

        Raises
        ------
        OSError
            Reading ``dataset`` failed (the association is aborted).
        """
        msg_id = self._next_id()
        command = encode_command(
            [
                (0x0002, sop_class.encode()),
                (0x0100, _us(C_STORE_RQ)),
                (0x0110, _us(msg_id)),
                (0x0700, _us(priority)),
                (0x0800, _us(0x0001)),  # a data set follows (anything but 0x0101)
                (0x1000, sop_instance.encode()),
            ]
        )
        expect = (C_STORE_RSP, msg_id, sop_class, sop_instance)
        try:
            return self._request("C-STORE-RQ", context.id, command, dataset, expect)
        except _SourceFailed as exc:
            self.abort("aborted: our data set could not be read")
            raise exc.error from None

    def echo(self, context: Context) -> Response | Failure:
        """C-ECHO on ``context`` (Verification) and wait for the response."""
        msg_id = self._next_id()
        command = encode_command(
            [
                (0x0002, context.abstract_syntax.encode()),
                (0x0100, _us(C_ECHO_RQ)),
                (0x0110, _us(msg_id)),
                (0x0800, _us(NO_DATASET)),
            ]
        )
        expect = (C_ECHO_RSP, msg_id, context.abstract_syntax, "")
        return self._request("C-ECHO-RQ", context.id, command, None, expect)

    def _request(
        self,
        name: str,
        cx_id: int,
        command: bytes,
        dataset: bytes | BinaryIO | None,
        expect: tuple[int, int, str, str],
    ) -> Response | Failure:
        """Send one request and read its response; every failure ends the association."""
        if not self._established:
            return ConnectionLost(f"association already ended ({self.ended})")
        self.requests += 1
        deadline = time.monotonic() + self.timeout
        phase = "sending"
        try:
            if self._arrived():
                raise _PeerSpoke
            self._send_message(cx_id, command, dataset, deadline)
            phase, self._received = "response", 0
            return self._response(name, cx_id, expect, deadline)
        except _PeerSpoke:
            return self._spoke_early(name, deadline)
        except _Deadline:
            if phase == "sending":
                why = f"the {name} could not be sent within {self.timeout:g} s (peer not reading)"
            else:
                got = f" ({self._received} bytes of it)" if self._received else ""
                why = f"no complete response within {self.timeout:g} s{got}"
            self.abort(f"aborted: {why}")
            return NoResponse(why)
        except _Closed as exc:
            self._end(f"connection closed by the peer ({exc})")
            return ConnectionLost(f"connection lost before the response: {exc}")
        except _Aborted as exc:
            self._end(f"aborted by the peer ({exc})")
            why = f"association aborted by the destination ({exc})"
            return PeerAborted(why, exc.source, exc.reason)
        except _Violation as exc:
            return self._violated(exc.what, exc.reason)

    def _violated(self, what: str, reason: int) -> ProtocolViolation:
        """Abort (source 2, ``reason``) for a protocol violation; the failure saying so."""
        self.abort(f"aborted: {what}", 0x02, reason)
        return ProtocolViolation(f"protocol violation: {what}; association aborted", what)

    def _spoke_early(self, name: str, deadline: float) -> Failure:
        """The peer sent something before our request was complete: what it was (an A-ABORT
        is the peer's right; anything else a violation)."""
        when = f"before our {name} was complete" if self._sent_any else f"before our {name}"
        try:
            kind, body = self._read_pdu(deadline)
        except _Closed as exc:
            self._end(f"connection closed by the peer ({exc})")
            return ConnectionLost(f"connection closed by the destination {when}")
        except _Deadline:
            return self._violated(f"part of a PDU {when}", 0x02)
        except _Violation as exc:
            return self._violated(f"{exc.what} {when}", exc.reason)
        if kind == ABORT:
            why = describe_abort(body[2], body[3])
            self._end(f"aborted by the peer ({why})")
            return PeerAborted(f"association aborted by the destination ({why})", body[2], body[3])
        return self._violated(f"a {_PDU_NAMES[kind]} {when}", 0x02)

    def _send_message(
        self, cx_id: int, command: bytes, dataset: bytes | BinaryIO | None, deadline: float
    ) -> None:
        """The command PDU(s), then the data set in PDUs of at most :attr:`max_send`; stop at
        once (:class:`_PeerSpoke`) if the peer sends anything before the last byte."""
        self._sent_any = False
        for pdu in pdata_pdus(cx_id, command, self.max_send):
            self._send(pdu, deadline, watch=True)
            self._sent_any = True
        if dataset is None:
            return
        room = max(1, self.max_send - 6)
        if isinstance(dataset, bytes | bytearray | memoryview):
            view = memoryview(dataset)
            total, read = len(view), None
        else:
            start = dataset.tell()
            try:
                total = os.fstat(dataset.fileno()).st_size - start
            except OSError as exc:
                raise _SourceFailed(exc) from None
            view, read = memoryview(b""), dataset.read
        offset = 0
        while True:
            n = min(room, total - offset)
            if read is None:
                chunk: bytes | memoryview = view[offset : offset + n]
            else:
                try:
                    chunk = read(n)
                except OSError as exc:
                    raise _SourceFailed(exc) from None
                if len(chunk) != n:
                    raise _SourceFailed(
                        OSError(f"data set ended after {offset + len(chunk)} bytes")
                    )
            offset += n
            last = offset >= total
            header = struct.pack(">BBIIBB", P_DATA_TF, 0, n + 6, n + 2, cx_id, 0x02 if last else 0)
            if self._arrived():
                raise _PeerSpoke
            self._send(b"".join((header, chunk)), deadline, watch=True)
            if last:
                return

    def _response(
        self, name: str, cx_id: int, expect: tuple[int, int, str, str], deadline: float
    ) -> Response:
        """Read the response to our request and check that it is one (PS3.7 §9.3.1.2)."""
        field_, msg_id, sop_class, sop_instance = expect
        what = _COMMANDS[field_]
        parts: list[bytes] = []
        size, done = 0, False
        while not done:
            kind, body = self._read_pdu(deadline)
            if kind == ABORT:
                raise _Aborted(body[2], body[3])
            if kind == RELEASE_RQ:
                raise _Violation(f"an A-RELEASE-RQ while our {name} awaited its response", 0x02)
            if kind != P_DATA_TF:
                raise _Violation(f"an unexpected {_PDU_NAMES[kind]} in answer to our {name}", 0x02)
            for pcx, control, value in _pdvs(body):
                if done:
                    raise _Violation(f"more PDVs after the response to our {name}", 0x02)
                if pcx != cx_id:
                    raise _Violation(
                        f"a PDV on presentation context {pcx}, not our {name}'s {cx_id}", 0x06
                    )
                if not control & 0x01:
                    raise _Violation(f"a data set fragment in answer to our {name}", 0x02)
                size += len(value)
                if size > MAX_COMMAND_BYTES:
                    raise _Violation(f"a response command set over {MAX_COMMAND_BYTES} bytes", 0x06)
                parts.append(bytes(value))
                done = bool(control & 0x02)
        try:
            cmd = decode_command(b"".join(parts))
        except ProtocolError as exc:
            raise _Violation(f"an undecodable response ({exc})", exc.reason) from None
        if len(cmd.get(0x0100, b"")) < 2:
            raise _Violation(f"a response to our {name} without a Command Field")
        got = _uint16(cmd[0x0100])
        if got != field_:
            named = _COMMANDS.get(got, "a command")
            raise _Violation(f"{named} (0x{got:04X}) in answer to our {name}")
        if 0x0120 not in cmd:
            raise _Violation(f"a {what} without a Message ID Being Responded To")
        answered = _uint16(cmd.get(0x0120))
        if answered != msg_id:
            raise _Violation(f"the {what} answers message ID {answered}, ours was {msg_id}")
        if 0x0002 in cmd and _text(cmd[0x0002]) != sop_class:
            raise _Violation(
                f"the {what} names SOP Class UID {sanitise(_text(cmd[0x0002]), 64)}, "
                f"not ours ({sop_class})"
            )
        if sop_instance and 0x1000 in cmd and _text(cmd[0x1000]) != sop_instance:
            raise _Violation(
                f"the {what} names SOP Instance UID {sanitise(_text(cmd[0x1000]), 64)}, "
                f"not ours ({sop_instance})"
            )
        if _uint16(cmd.get(0x0800), NO_DATASET) != NO_DATASET:
            raise _Violation(f"a {what} that announces a data set")
        if len(cmd.get(0x0900, b"")) < 2:
            raise _Violation(f"a {what} without a Status")
        return Response(_uint16(cmd[0x0900]), sanitise(_text(cmd.get(0x0902))))

    # -- transport -------------------------------------------------------------------------

    def _wait(self, events: int, deadline: float) -> int:
        """Wait until the socket is ready for ``events``; the events that are ready."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Deadline
        poller = select.poll()
        poller.register(self.socket, events)
        ready = poller.poll(math.ceil(remaining * 1000))
        if not ready:
            raise _Deadline
        return int(ready[0][1])

    def _arrived(self) -> bool:
        """Whether the peer has sent something (or closed), without waiting: bytes already
        read, decrypted bytes waiting, or a read that returns some now."""
        if self._inbox:
            return True
        sock = self.socket
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        if not poller.poll(0):
            return False
        try:
            chunk = sock.recv(65536)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False  # a TLS record that carries no data (a session ticket)
        except OSError as exc:
            raise _Closed(str(exc)) from None
        if not chunk:
            raise _Closed("closed by the peer")
        self._inbox += chunk
        return True

    def _send(self, data: bytes, deadline: float, watch: bool = False) -> None:
        """Send all of ``data`` before ``deadline``; with ``watch``, stop (:class:`_PeerSpoke`)
        as soon as the peer sends something while we wait to send."""
        view = memoryview(data)
        while view:
            try:
                view = view[self.socket.send(view) :]
            except (BlockingIOError, ssl.SSLWantWriteError):
                ready = self._wait(select.POLLOUT | (select.POLLIN if watch else 0), deadline)
                if watch and ready & select.POLLIN and self._arrived():
                    raise _PeerSpoke from None
            except ssl.SSLWantReadError:
                self._wait(select.POLLIN, deadline)
            except OSError as exc:
                raise _Closed(str(exc)) from None

    def _recv_exact(self, n: int, deadline: float) -> bytearray:
        """Exactly ``n`` bytes (``n`` checked by the caller), before ``deadline``."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = min(n, len(self._inbox))
        if got:
            view[:got] = self._inbox[:got]
            del self._inbox[:got]
        while got < n:
            try:
                k = self.socket.recv_into(view[got:], n - got)
            except (BlockingIOError, ssl.SSLWantReadError):
                self._wait(select.POLLIN, deadline)
                continue
            except ssl.SSLWantWriteError:
                self._wait(select.POLLOUT, deadline)
                continue
            except OSError as exc:
                raise _Closed(str(exc)) from None
            if k == 0:
                raise _Closed("closed by the peer")
            got += k
            self._received += k
        return buf

    def _read_pdu(self, deadline: float) -> tuple[int, bytearray]:
        """The next PDU's type and body, its length checked before its body is read.

        Raises
        ------
        _Violation
            An unknown PDU type, a PDU over its limit, or an A-ASSOCIATE-RQ (not read).
        """
        kind, _, length = struct.unpack(">BBI", self._recv_exact(6, deadline))
        name = _PDU_NAMES.get(kind)
        if name is None:
            raise _Violation(f"an unrecognised PDU type 0x{kind:02X}", 0x01)
        if kind == ASSOCIATE_RQ or (kind == ASSOCIATE_AC and self._established):
            raise _Violation(f"an unexpected {name}", 0x02)
        limit = {ASSOCIATE_AC: AC_LIMIT, P_DATA_TF: self.max_pdu}.get(kind, 4)
        if length > limit or (kind in _FIXED and length != 4):
            raise _Violation(
                f"a {name} PDU of {length} bytes announced, over the {limit} we accept"
                if length > limit
                else f"a {name} PDU of {length} bytes (4 expected)",
                0x06,
            )
        return kind, self._recv_exact(length, deadline)


@dataclass(frozen=True)
class Requestor:
    """Opens associations with one set of proposed presentation contexts and one set of
    limits (one requestor per outbox configuration; immutable, shared by its threads).

    Parameters
    ----------
    calling_ae
        Our AE title.
    contexts
        The presentation contexts to propose: (abstract syntax, transfer syntaxes), given
        the IDs 1, 3, 5... in this order (PS3.8 §9.3.2.2).
    timeout
        Seconds for the connection and negotiation together, and for each request with its
        response.
    max_pdu
        Our maximum PDU length (0: :data:`DEFAULT_MAX_PDU`).
    max_send_pdu
        The largest PDU we send, even to a peer that takes larger ones (PS3.8 §D.1 lets a
        sender stay below the peer's maximum).
    """

    calling_ae: str
    contexts: Sequence[tuple[str, Sequence[str]]]
    timeout: float
    max_pdu: int = DEFAULT_MAX_PDU
    max_send_pdu: int = DEFAULT_MAX_PDU

    def _associate_rq(self, called_ae: str) -> bytes:
        primitive = A_ASSOCIATE()
        primitive.application_context_name = APPLICATION_CONTEXT_NAME
        primitive.calling_ae_title = self.calling_ae
        primitive.called_ae_title = called_ae
        proposed = []
        for n, (abstract, syntaxes) in enumerate(self.contexts):
            cx = PresentationContext()
            cx.context_id = 2 * n + 1
            cx.abstract_syntax = abstract
            cx.transfer_syntax = list(syntaxes)
            proposed.append(cx)
        primitive.presentation_context_definition_list = proposed
        length = MaximumLengthNotification()
        length.maximum_length_received = self.max_pdu or DEFAULT_MAX_PDU
        uid = ImplementationClassUIDNotification()
        uid.implementation_class_uid = IMPLEMENTATION_CLASS_UID
        version = ImplementationVersionNameNotification()
        version.implementation_version_name = IMPLEMENTATION_VERSION
        primitive.user_information = [length, uid, version]
        pdu = A_ASSOCIATE_RQ()
        pdu.from_primitive(primitive)
        return bytes(pdu.encode())

    def open(
        self,
        host: str,
        port: int,
        called_ae: str,
        tls: tuple[ssl.SSLContext, str] | None = None,
    ) -> Association:
        """Connect, negotiate and return the established association, all within
        ``timeout`` (the connection itself within :data:`CONNECT_S`).

        Parameters
        ----------
        host, port, called_ae
            The peer.
        tls
            ``(context, server name)`` for DICOM TLS (:func:`segnode.node.dicom.tls.tls_args`),
            None for plain TCP.

        Raises
        ------
        AssociationFailed
            With the reason in words (for a rejection, with its codes).
        """
        deadline = time.monotonic() + self.timeout
        where = f"{host}:{port}"
        try:
            raw = socket.create_connection((host, port), min(self.timeout, CONNECT_S))
        except TimeoutError:
            raise AssociationFailed(f"no association: cannot connect to {where} in time") from None
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise AssociationFailed(f"no association: cannot connect to {where} ({why})") from None
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:  # not TCP: leave it as it is
            log.debug("TCP_NODELAY not set: %s", exc)
        raw.setblocking(False)
        assoc = Association(raw, where, self.timeout, self.max_pdu or DEFAULT_MAX_PDU)
        try:
            if tls is not None:
                assoc.socket = self._handshake(assoc, raw, tls, deadline)
            self._negotiate(assoc, called_ae, deadline)
        except AssociationFailed:
            assoc.abort("not established")
            raise
        except _Deadline:
            assoc.abort("not established")
            raise AssociationFailed(
                f"no association: no answer to the A-ASSOCIATE-RQ within {self.timeout:g} s"
            ) from None
        except _Closed as exc:
            assoc.abort("not established")
            raise AssociationFailed(
                f"no association: connection closed during the negotiation ({exc})"
            ) from None
        except _Violation as exc:
            assoc.abort("not established", 0x02, exc.reason)
            raise AssociationFailed(f"no association: {exc.what} in the negotiation") from None
        return assoc

    def _handshake(
        self,
        assoc: Association,
        raw: socket.socket,
        tls: tuple[ssl.SSLContext, str],
        deadline: float,
    ) -> ssl.SSLSocket:
        context, server_name = tls
        try:
            sock = context.wrap_socket(
                raw, server_hostname=server_name, do_handshake_on_connect=False
            )
        except (OSError, ValueError) as exc:
            raise AssociationFailed(f"no association: TLS failed ({exc})") from None
        assoc.socket = sock
        while True:
            try:
                sock.do_handshake()
                return sock
            except ssl.SSLWantReadError:
                assoc._wait(select.POLLIN, deadline)
            except ssl.SSLWantWriteError:
                assoc._wait(select.POLLOUT, deadline)
            except (OSError, ValueError) as exc:
                raise AssociationFailed(
                    f"no association: TLS handshake failed ({describe_tls_error(exc)})"
                ) from None

    def _negotiate(self, assoc: Association, called_ae: str, deadline: float) -> None:
        try:
            request = self._associate_rq(called_ae)
        except (ValueError, TypeError) as exc:
            raise AssociationFailed(f"no association: cannot request it ({exc})") from None
        assoc._send(request, deadline)
        kind, body = assoc._read_pdu(deadline)
        if kind == ASSOCIATE_RJ:
            result, source, reason = body[1], body[2], body[3]
            assoc._end("rejected")
            raise AssociationFailed(
                describe_rejection(result, source, reason), (result, source, reason)
            )
        if kind == ABORT:
            why = describe_abort(body[2], body[3])
            assoc._end(f"aborted by the peer ({why})")
            raise AssociationFailed(f"no association: aborted by the destination ({why})")
        if kind != ASSOCIATE_AC:
            raise _Violation(f"a {_PDU_NAMES[kind]} instead of an A-ASSOCIATE-AC", 0x02)
        ac = A_ASSOCIATE_AC()
        try:
            ac.decode(struct.pack(">BBI", ASSOCIATE_AC, 0, len(body)) + bytes(body))
            primitive = ac.to_primitive()
        except Exception as exc:  # pynetdicom raises many types on garbage
            raise _Violation(
                f"an undecodable A-ASSOCIATE-AC ({type(exc).__name__})", 0x06
            ) from None
        proposed = {2 * n + 1: cx for n, cx in enumerate(self.contexts)}
        accepted = []
        for cx in primitive.presentation_context_definition_results_list:
            ours = proposed.get(int(cx.context_id or 0))
            syntax = str(cx.transfer_syntax[0]) if cx.transfer_syntax else ""
            if cx.result == 0x00 and ours is not None and syntax in ours[1]:
                accepted.append(Context(int(cx.context_id or 0), ours[0], syntax))
        assoc.accepted = tuple(sorted(accepted, key=lambda c: c.id))
        for item in primitive.user_information or ():
            if isinstance(item, MaximumLengthNotification):
                assoc.peer_max_pdu = int(item.maximum_length_received or 0)
        peer = assoc.peer_max_pdu
        assoc.max_send = self.max_send_pdu if peer == 0 else min(peer, self.max_send_pdu)
        assoc._established = True
        log.debug("association with %s: %d context(s) accepted", assoc.peer, len(accepted))


__all__ = ["Association", "Requestor"]
