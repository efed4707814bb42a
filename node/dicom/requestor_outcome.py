"""What the requestor's associations and requests come to, in types and in words: a DIMSE
response and its status, the failure that ended an association, a refused association, and
the A-ASSOCIATE-RJ and A-ABORT codes described.

:class:`Response` is a valid response (its Status, PS3.7 Annex C, and what it means for the
object, :class:`StatusKind`, PS3.4 §B.2.3); :class:`Failure` and its subclasses say why no
valid response came; :class:`AssociationFailed` says why there is no association, with the
rejection's codes (PS3.8 Table 9-21). Their texts go to the log and the ledger as they are:
:func:`sanitise` makes a peer's text fit for both.

Must not touch: sockets, PDUs and an association's state, which are
:mod:`segnode.node.dicom.requestor`'s; what becomes of an outcome (retries, backoff, circuit
breakers, the ledger), which is the outbox's (:mod:`segnode.node.outbox.scu`,
:mod:`segnode.node.outbox.policy`). Nothing here does I/O or logs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# PS3.8 Table 9-21: A-ASSOCIATE-RJ result, source and reason/diag.
_RJ_RESULTS = {1: "permanently", 2: "transiently"}
_RJ_SOURCES = {
    1: "the service user",
    2: "the service provider (ACSE)",
    3: "the service provider (presentation)",
}
_RJ_REASONS = {
    (1, 1): "no reason given",
    (1, 2): "application context name not supported",
    (1, 3): "calling AE title not recognised",
    (1, 7): "called AE title not recognised",
    (2, 1): "no reason given",
    (2, 2): "protocol version not supported",
    (3, 1): "temporary congestion",
    (3, 2): "local limit exceeded",
}
# PS3.8 Table 9-26: A-ABORT source and reason/diag.
_ABORT_SOURCES = {0: "service user", 1: "reserved source", 2: "service provider"}
_ABORT_REASONS = {
    0: "reason not specified",
    1: "unrecognised PDU",
    2: "unexpected PDU",
    4: "unrecognised PDU parameter",
    5: "unexpected PDU parameter",
    6: "invalid PDU parameter value",
}
# PS3.7 Annex C and PS3.4 §B.2.3: the C-STORE statuses, by code or range.
_WARNINGS = frozenset({0x0001, 0x0107, 0x0116})
_STATUS_NAMES = {
    0x0000: "Success",
    0x0001: "Requested optional Attributes are not supported",
    0x0107: "Attribute list error",
    0x0110: "Processing failure",
    0x0111: "Duplicate SOP Instance",
    0x0116: "Attribute Value out of range",
    0x0117: "Invalid SOP Instance",
    0x0122: "SOP Class not supported",
    0x0124: "Not authorized",
    0x0210: "Duplicate invocation",
    0x0211: "Unrecognized operation",
    0x0212: "Mistyped argument",
    0xB000: "Coercion of Data Elements",
    0xB006: "Elements Discarded",
    0xB007: "Data Set does not match SOP Class",
    0xFE00: "Cancel",
}
_STATUS_RANGES = (
    (0xA700, 0xA7FF, "Out of Resources"),
    (0xA900, 0xA9FF, "Data Set does not match SOP Class"),
    (0xB000, 0xBFFF, "Warning"),
    (0xC000, 0xCFFF, "Cannot understand"),
)


def describe_rejection(result: int, source: int, reason: int) -> str:
    """An A-ASSOCIATE-RJ in words with its codes (PS3.8 Table 9-21), e.g. "association
    rejected permanently by the service user: called AE title not recognised (1/1/7)"."""
    how = _RJ_RESULTS.get(result, f"(result {result})")
    who = _RJ_SOURCES.get(source, f"an unknown source {source}")
    why = _RJ_REASONS.get((source, reason), "reason code not defined")
    return f"association rejected {how} by {who}: {why} ({result}/{source}/{reason})"


def describe_abort(source: int, reason: int) -> str:
    """An A-ABORT's source and reason in words with their codes (PS3.8 Table 9-26)."""
    who = _ABORT_SOURCES.get(source, f"source {source}")
    if source != 2:  # the reason is significant only when the service provider aborts
        return f"{who}, {source}/{reason}"
    return f"{who}: {_ABORT_REASONS.get(reason, 'reason code not defined')}, {source}/{reason}"


def status_name(status: int) -> str:
    """The meaning of a DIMSE status (PS3.7 Annex C, PS3.4 §B.2.3), "" when unknown."""
    if status in _STATUS_NAMES:
        return _STATUS_NAMES[status]
    for low, high, name in _STATUS_RANGES:
        if low <= status <= high:
            return name
    return ""


def sanitise(text: str, limit: int = 200) -> str:
    """A peer's text for a log line or the ledger: printable ASCII, one line, ``limit``
    characters at most."""
    clean = "".join(c if " " <= c <= "~" else " " for c in text)
    clean = " ".join(clean.split())
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


class StatusKind(StrEnum):
    """What a C-STORE status means for the object (PS3.4 §B.2.3)."""

    SUCCESS = "success"
    #: Stored, with a remark: 0xB000, 0xB006, 0xB007 (and the rest of 0xBxxx), 0x0001,
    #: 0x0107, 0x0116.
    WARNING = "warning"
    FAILURE = "failure"


@dataclass(frozen=True)
class Context:
    """A presentation context the peer accepted: its ID and the syntaxes negotiated."""

    id: int
    abstract_syntax: str
    transfer_syntax: str


@dataclass(frozen=True)
class Response:
    """A valid response to our request: its Status (0000,0900) and Error Comment
    (0000,0902), sanitised."""

    status: int
    comment: str = ""

    @property
    def kind(self) -> StatusKind:
        """Success, warning (stored) or failure."""
        if self.status == 0x0000:
            return StatusKind.SUCCESS
        if self.status in _WARNINGS or 0xB000 <= self.status <= 0xBFFF:
            return StatusKind.WARNING
        return StatusKind.FAILURE

    def describe(self) -> str:
        """``0xA700 (Out of Resources): the comment``."""
        name = status_name(self.status)
        text = f"0x{self.status:04X}" + (f" ({name})" if name else "")
        return f"{text}: {self.comment}" if self.comment else text


@dataclass(frozen=True)
class Failure:
    """No valid response came: the association is over (aborted or closed).

    The subclasses say why; ``str()`` is the reason for the log and the ledger.
    """

    detail: str

    def __str__(self) -> str:
        return self.detail


@dataclass(frozen=True)
class NoResponse(Failure):
    """The request or its response did not complete within the deadline; we aborted."""


@dataclass(frozen=True)
class ConnectionLost(Failure):
    """The connection closed or failed before the response."""


@dataclass(frozen=True)
class PeerAborted(Failure):
    """The peer sent an A-ABORT."""

    source: int = 0
    reason: int = 0


@dataclass(frozen=True)
class ProtocolViolation(Failure):
    """The peer broke PS3.7 or PS3.8 (``what``); we aborted."""

    what: str = ""


class AssociationFailed(Exception):
    """No association: the connection, the TLS handshake or the negotiation failed, or the
    peer rejected it (:attr:`rejection`: result, source and reason codes)."""

    def __init__(self, reason: str, rejection: tuple[int, int, int] | None = None) -> None:
        super().__init__(reason)
        self.rejection = rejection


__all__ = [
    "AssociationFailed",
    "ConnectionLost",
    "Context",
    "Failure",
    "NoResponse",
    "PeerAborted",
    "ProtocolViolation",
    "Response",
    "StatusKind",
    "describe_abort",
    "describe_rejection",
    "sanitise",
    "status_name",
]
