"""A lean DICOM Upper Layer acceptor for the Storage and Verification services.

pynetdicom's acceptor runs two threads per association that poll each other every
millisecond, and it turns every P-DATA-TF into PDU and primitive objects and state-machine
events. For a 512 KB CT slice that is most of the time the node spends per instance, so the
receive path here is one blocking thread per association instead: it reads each PDU straight
into one buffer, cuts the PDVs out as memoryviews, and hands the C-STORE handler the encoded
dataset with at most one join. There is no timer anywhere on the path.

What it does not write itself it takes from pynetdicom: the A-ASSOCIATE-RQ/AC PDU codecs,
presentation-context and role negotiation (:func:`pynetdicom.presentation.negotiate_as_acceptor`)
and the transfer-syntax list, so negotiation behaves as it did.

The protocol (PS3.8 §7, §9; PS3.7 §9.3, §E): the first PDU must be an A-ASSOCIATE-RQ within
``acse_timeout``; it is rejected (A-ASSOCIATE-RJ) for an unsupported application context or
protocol version, or when :meth:`Handlers.requested` says so, or over ``max_associations``.
After acceptance: P-DATA-TF carries C-STORE-RQ and C-ECHO-RQ; other DIMSE requests are
answered 0x0211 (unrecognised operation); A-RELEASE-RQ is answered A-RELEASE-RP; an
unexpected or unknown PDU, a malformed PDV, or ``network_timeout`` of silence gets an A-ABORT.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from pydicom.uid import UID
from pynetdicom import PYNETDICOM_IMPLEMENTATION_UID
from pynetdicom._globals import APPLICATION_CONTEXT_NAME
from pynetdicom.pdu import A_ASSOCIATE_AC, A_ASSOCIATE_RQ
from pynetdicom.pdu_primitives import (
    A_ASSOCIATE,
    ImplementationClassUIDNotification,
    ImplementationVersionNameNotification,
    MaximumLengthNotification,
    SCP_SCU_RoleSelectionNegotiation,
)
from pynetdicom.presentation import PresentationContext, build_context, negotiate_as_acceptor

log = logging.getLogger(__name__)

IMPLEMENTATION_CLASS_UID = str(PYNETDICOM_IMPLEMENTATION_UID)
IMPLEMENTATION_VERSION = "SEGNODE_1"
VERIFICATION = "1.2.840.10008.1.1"

# PDU types (PS3.8 §9.3)
ASSOCIATE_RQ, ASSOCIATE_AC, ASSOCIATE_RJ = 0x01, 0x02, 0x03
P_DATA_TF, RELEASE_RQ, RELEASE_RP, ABORT = 0x04, 0x05, 0x06, 0x07

# DIMSE command fields and elements (PS3.7 §E.1)
C_STORE_RQ, C_ECHO_RQ, C_CANCEL_RQ = 0x0001, 0x0030, 0x0FFF
NO_DATASET = 0x0101
UNRECOGNISED_OPERATION = 0x0211

#: TCP_QUICKACK where the platform has it (Linux).
QUICKACK: int = getattr(socket, "TCP_QUICKACK", 0)
#: The largest A-ASSOCIATE-RQ accepted (a real one is a few kB; 256 contexts fit in 64 kB).
MAX_ASSOCIATE_RQ = 1 << 20
#: PDU bodies larger than this are received into chunks of this size as data arrives, so a
#: peer announcing a huge length commits no memory it has not sent.
CHUNK = 16 << 20


class ProtocolError(Exception):
    """The peer broke the Upper Layer protocol; the association is aborted."""

    def __init__(self, message: str, reason: int = 0x00) -> None:
        super().__init__(message)
        #: A-ABORT reason (source 2, service provider): 1 unrecognised PDU, 2 unexpected PDU,
        #: 6 invalid PDU parameter value, 0 not specified.
        self.reason = reason


class PeerClosed(Exception):
    """The transport connection closed."""


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
    #: Work a handler queued for after the current response is sent (run in order by the
    #: association's thread, then cleared): what must follow a stored instance but must not
    #: delay its response.
    after_reply: list[Callable[[], object]] = field(default_factory=list)


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


#: A C-STORE outcome: a status, or a status with an Error Comment (0000,0902).
StoreResult = int | tuple[int, str]


class Handlers(Protocol):
    """The service user: called from the association's thread."""

    def requested(self, info: AssociationInfo) -> tuple[int, int, int] | None:
        """Return (result, source, diagnostic) to reject the association, None to go on."""

    def accepted(self, info: AssociationInfo) -> None:
        """The association was accepted."""

    def store(self, info: AssociationInfo, request: StoreRequest) -> StoreResult:
        """Handle one C-STORE; the status is sent back when this returns."""

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


RELEASE_RP_PDU = struct.pack(">BBII", RELEASE_RP, 0, 4, 0)


# -- the acceptor ----------------------------------------------------------------------------


@dataclass
class AcceptorOptions:
    """Acceptor settings (from ``[node]``)."""

    ae_title: str
    #: abstract syntax -> accepted transfer syntaxes (in order of preference).
    contexts: dict[str, list[str]]
    max_pdu: int = 0
    acse_timeout: float = 10.0
    network_timeout: float = 60.0
    max_associations: int = 10
    #: Largest encoded dataset accepted in one C-STORE (0 = no limit); larger aborts.
    max_dataset_bytes: int = 0
    tls_context: ssl.SSLContext | None = None
    handshake_timeout: float = 10.0


class Acceptor:
    """Listens on one address; one thread per association; no polling."""

    def __init__(self, options: AcceptorOptions, handlers: Handlers) -> None:
        self.options = options
        self.handlers = handlers
        self._supported: list[PresentationContext] = [
            build_context(abstract, syntaxes) for abstract, syntaxes in options.contexts.items()
        ]
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._active: set[threading.Thread] = set()
        self._stopping = False

    @property
    def server_address(self) -> tuple[str, int]:
        assert self._listener is not None
        host, port = self._listener.getsockname()[:2]
        return str(host), int(port)

    @property
    def active_associations(self) -> int:
        with self._lock:
            return len(self._active)

    def start(self, address: tuple[str, int]) -> None:
        """Bind, listen and accept in a background thread."""
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(64)
        self._listener = listener
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"acceptor:{address[1]}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting, then wait (up to ``timeout``) for associations in flight."""
        self._stopping = True
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            threads = list(self._active)
        for thread in threads:
            thread.join(timeout)
        if self._listener is not None:
            self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping:
            ready, _, _ = select.select([self._listener, self._wake_r], [], [])
            if self._wake_r in ready or self._stopping:
                return
            try:
                conn, peer = self._listener.accept()
            except OSError:
                continue
            thread = threading.Thread(
                target=self._serve, args=(conn, peer), name=f"assoc:{peer[0]}:{peer[1]}"
            )
            thread.daemon = True
            with self._lock:
                self._active.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.options.tls_context is not None:
                conn = self._handshake(conn, peer)
            _Association(self, conn, peer).run()
        except _HandshakeFailed:
            pass
        except Exception:
            log.exception("association with %s:%s failed", peer[0], peer[1])
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            with self._lock:
                self._active.discard(threading.current_thread())

    def _handshake(self, conn: socket.socket, peer: tuple[str, int]) -> socket.socket:
        from node.tls import describe_tls_error

        assert self.options.tls_context is not None
        try:
            conn.settimeout(self.options.handshake_timeout)
            wrapped = self.options.tls_context.wrap_socket(conn, server_side=True)
            wrapped.settimeout(None)
            return wrapped
        except (OSError, ValueError) as exc:
            log.warning("TLS handshake with %s failed: %s", peer[0], describe_tls_error(exc))
            conn.close()
            raise _HandshakeFailed from exc


class _HandshakeFailed(Exception):
    pass


class _Association:
    """One association's state and its blocking receive loop."""

    def __init__(self, acceptor: Acceptor, conn: socket.socket, peer: tuple[str, int]) -> None:
        self.acceptor = acceptor
        self.options = acceptor.options
        self.handlers = acceptor.handlers
        self.conn = conn
        self.info = AssociationInfo("", "", str(peer[0]), int(peer[1]))
        self.established = False
        # Fragments of the message being received on each presentation context.
        self._command: list[memoryview] = []
        self._dataset: list[memoryview] = []
        self._dataset_size = 0
        self._pending: dict[int, bytes] | None = None
        self._pending_cx = 0

    # -- transport -----------------------------------------------------------------------

    def _recv_exact(self, n: int) -> memoryview:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            if QUICKACK:
                # Acknowledge at once: a sender whose last small segment waits for our ACK
                # (Nagle) would otherwise stall ~40 ms per instance on the delayed ACK.
                self.conn.setsockopt(socket.IPPROTO_TCP, QUICKACK, 1)
            k = self.conn.recv_into(view[got:], n - got)
            if k == 0:
                raise PeerClosed
            got += k
        return view

    def _recv_pdu(self) -> tuple[int, memoryview]:
        header = self._recv_exact(6)
        pdu_type, _, length = struct.unpack(">BBI", header)
        if pdu_type not in (
            ASSOCIATE_RQ,
            ASSOCIATE_AC,
            ASSOCIATE_RJ,
            P_DATA_TF,
            RELEASE_RQ,
            RELEASE_RP,
            ABORT,
        ):
            raise ProtocolError(f"unrecognised PDU type 0x{pdu_type:02X}", 0x01)
        if pdu_type == ASSOCIATE_RQ and length > MAX_ASSOCIATE_RQ:
            raise ProtocolError("A-ASSOCIATE-RQ too long", 0x06)
        if length <= CHUNK:
            return pdu_type, self._recv_exact(length)
        parts, left = [], length
        while left:
            parts.append(self._recv_exact(min(left, CHUNK)))
            left -= len(parts[-1])
        return pdu_type, memoryview(b"".join(parts))

    def _send(self, data: bytes) -> None:
        self.conn.sendall(data)

    # -- lifecycle -----------------------------------------------------------------------

    def run(self) -> None:
        released = False
        try:
            self.conn.settimeout(self.options.acse_timeout)
            try:
                pdu_type, body = self._recv_pdu()
            except TimeoutError:
                log.warning(
                    "no A-ASSOCIATE-RQ from %s within %.0f s; closing",
                    self.info.address,
                    self.options.acse_timeout,
                )
                return
            if pdu_type != ASSOCIATE_RQ:
                raise ProtocolError(f"expected A-ASSOCIATE-RQ, got PDU type {pdu_type}", 0x02)
            if not self._associate(body):
                return
            self.conn.settimeout(self.options.network_timeout or None)
            released = self._data_phase()
        except PeerClosed:
            if self.established:
                log.warning("connection from %s closed without release", self.info.address)
        except TimeoutError:
            log.warning(
                "network timeout: no data from %s for %.0f s; aborting",
                self.info.address,
                self.options.network_timeout,
            )
            self._try_send(abort_pdu(0x02, 0x00))
        except ProtocolError as exc:
            log.warning("aborting association with %s: %s", self.info.address, exc)
            self._try_send(abort_pdu(0x02, exc.reason))
        except (OSError, ssl.SSLError) as exc:
            log.warning("connection from %s failed: %s", self.info.address, exc)
        finally:
            if self.established:
                self.handlers.closed(self.info, released)

    def _try_send(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            self._send(data)

    def _associate(self, body: memoryview) -> bool:
        """Negotiate; return True when the association is established."""
        pdu = A_ASSOCIATE_RQ()
        try:
            pdu.decode(struct.pack(">BBI", ASSOCIATE_RQ, 0, len(body)) + bytes(body))
            rq = pdu.to_primitive()
        except Exception as exc:
            raise ProtocolError(f"undecodable A-ASSOCIATE-RQ ({type(exc).__name__})", 0x06) from exc
        self.info.calling_ae = str(rq.calling_ae_title or "").strip()
        self.info.called_ae = str(rq.called_ae_title or "").strip()
        max_length = 0
        roles: dict[UID, tuple[bool | None, bool | None]] = {}
        for item in rq.user_information:
            if isinstance(item, MaximumLengthNotification):
                max_length = int(item.maximum_length_received or 0)
            elif isinstance(item, SCP_SCU_RoleSelectionNegotiation) and item.sop_class_uid:
                roles[UID(item.sop_class_uid)] = (item.scu_role, item.scp_role)
        self.info.max_send_pdu = max_length

        rejection: tuple[int, int, int] | None = None
        if str(rq.application_context_name) != APPLICATION_CONTEXT_NAME:
            rejection = (0x01, 0x01, 0x02)  # application context name not supported
        elif not (pdu.protocol_version & 0x0001):
            rejection = (0x01, 0x02, 0x02)  # protocol version not supported
        else:
            rejection = self.handlers.requested(self.info)
        if rejection is None and self.acceptor.active_associations > self.options.max_associations:
            log.warning(
                "association from %r refused: %d associations already active",
                self.info.calling_ae,
                self.options.max_associations,
            )
            rejection = (0x02, 0x03, 0x02)  # local limit exceeded
        if rejection is not None:
            self._try_send(reject_pdu(*rejection))
            return False

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
        self._send(out.encode())
        self.established = True
        self.handlers.accepted(self.info)
        return True

    def _data_phase(self) -> bool:
        """Receive until release (True) or abort (False)."""
        while True:
            pdu_type, body = self._recv_pdu()
            if pdu_type == P_DATA_TF:
                self._pdata(body)
            elif pdu_type == RELEASE_RQ:
                self._send(RELEASE_RP_PDU)
                return True
            elif pdu_type == ABORT:
                log.warning("association aborted by %s", self.info.address)
                return False
            else:
                raise ProtocolError(f"unexpected PDU type 0x{pdu_type:02X}", 0x02)

    def _pdata(self, body: memoryview) -> None:
        offset, end = 0, len(body)
        while offset < end:
            if end - offset < 6:
                raise ProtocolError("truncated PDV", 0x06)
            (length,) = struct.unpack_from(">I", body, offset)
            if length < 2 or length > end - offset - 4:
                raise ProtocolError("invalid PDV length", 0x06)
            cx_id, control = body[offset + 4], body[offset + 5]
            value = body[offset + 6 : offset + 4 + length]
            offset += 4 + length
            if cx_id not in self.info.contexts:
                raise ProtocolError(f"PDV on presentation context {cx_id} not accepted", 0x06)
            if control & 0x01:
                self._on_command(cx_id, value, bool(control & 0x02))
            else:
                self._on_dataset(cx_id, value, bool(control & 0x02))

    def _on_command(self, cx_id: int, value: memoryview, last: bool) -> None:
        if self._pending is not None:
            raise ProtocolError("command received while a dataset was expected", 0x02)
        self._command.append(value)
        if not last:
            return
        raw = value if len(self._command) == 1 else memoryview(b"".join(self._command))
        self._command = []
        command = decode_command(raw)
        if _uint16(command.get(0x0800), NO_DATASET) != NO_DATASET:
            self._pending, self._pending_cx = command, cx_id
            return
        self._dispatch(cx_id, command, None)

    def _on_dataset(self, cx_id: int, value: memoryview, last: bool) -> None:
        if self._pending is None or cx_id != self._pending_cx:
            raise ProtocolError("dataset fragment without its command", 0x02)
        self._dataset.append(value)
        self._dataset_size += len(value)
        limit = self.options.max_dataset_bytes
        if limit and self._dataset_size > limit:
            raise ProtocolError(f"dataset larger than {limit} bytes", 0x00)
        if not last:
            return
        parts, self._dataset, self._dataset_size = self._dataset, [], 0
        data: bytes | memoryview = parts[0] if len(parts) == 1 else b"".join(parts)
        command, self._pending = self._pending, None
        self._dispatch(cx_id, command, data)

    def _dispatch(
        self, cx_id: int, command: dict[int, bytes], dataset: bytes | memoryview | None
    ) -> None:
        field_ = _uint16(command.get(0x0100))
        message_id = _uint16(command.get(0x0110))
        abstract, syntax = self.info.contexts[cx_id]
        sop_class = _text(command.get(0x0002)) or abstract
        if field_ == C_CANCEL_RQ:
            return
        reply: list[tuple[int, bytes]] = [
            (0x0002, sop_class.encode()),
            (0x0100, _us(field_ | 0x8000)),
            (0x0120, _us(message_id)),
            (0x0800, _us(NO_DATASET)),
        ]
        if field_ == C_STORE_RQ and dataset is not None:
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
            result = self.handlers.store(self.info, request)
            status, comment = result if isinstance(result, tuple) else (result, "")
            reply.append((0x1000, sop_uid.encode()))
        elif field_ == C_ECHO_RQ and abstract == VERIFICATION:
            status, comment = 0x0000, ""
        else:
            status, comment = UNRECOGNISED_OPERATION, "only C-STORE and C-ECHO are supported"
        reply.append((0x0900, _us(status)))
        if comment and status != 0x0000:
            reply.append((0x0902, comment[:64].encode("ascii", "replace")))
        try:
            for pdu in pdata_pdus(cx_id, encode_command(reply), self.info.max_send_pdu):
                self._send(pdu)
        finally:
            self._after_reply()

    def _after_reply(self) -> None:
        actions, self.info.after_reply = self.info.after_reply, []
        for action in actions:
            try:
                action()
            except Exception:
                log.exception("error after a C-STORE response")


__all__: list[str] = [
    "Acceptor",
    "AcceptorOptions",
    "AssociationInfo",
    "Handlers",
    "StoreRequest",
    "StoreResult",
]
