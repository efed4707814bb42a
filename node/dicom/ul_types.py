"""The Upper Layer acceptor's service interface: what the acceptor and its service user share.

Owns the types that cross between :mod:`segnode.node.dicom.ul` (the acceptor),
:mod:`segnode.node.dicom.ul_association` (one association's thread) and the service user
(:mod:`segnode.node.ingest.scp`): the exceptions :class:`ProtocolError` and
:class:`PeerClosed`, :class:`AssociationInfo`, :class:`StoreRequest`, :class:`StoreOutcome`
with its :data:`FollowUp`, the :class:`Handlers` protocol and :class:`AcceptorOptions`.

Must not touch: sockets, threads, PDU bytes or the state machine; it holds data and
signatures only and imports nothing of the node. Import these from
:mod:`segnode.node.dicom.ul`, which re-exports them.
"""

from __future__ import annotations

import itertools
import logging
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


class ProtocolError(Exception):
    """The peer broke the Upper Layer or DIMSE protocol; the association is aborted."""

    def __init__(self, message: str, reason: int = 0x00) -> None:
        super().__init__(message)
        #: A-ABORT reason (source 2, service provider): 1 unrecognised PDU, 2 unexpected PDU,
        #: 6 invalid PDU parameter value, 0 not specified.
        self.reason = reason


class PeerClosed(Exception):
    """The transport connection closed."""


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


def tell(handlers: Handlers, name: str, info: AssociationInfo, reason: str) -> None:
    """Call the handlers' optional ``refused(info, reason)`` (an A-ASSOCIATE-RJ was sent),
    ``cut_off(info, reason)`` (the node aborted or closed a peer for what it did: a timeout,
    a malformed or oversized PDU, a pending-connection limit) or ``releasing(info, reason)``
    (the peer asked to release; the A-RELEASE-RP goes when this returns), if it has one.
    Never raises: these are notices (the audit trail), and the connection is being dealt
    with anyway."""
    notice = getattr(handlers, name, None)
    if notice is None:
        return
    try:
        notice(info, reason)
    except Exception:  # a notice must not break the connection's handling
        logging.getLogger(__name__).exception("%s notice failed", name)


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
