"""The DICOM Upper Layer state machine (PS3.8 §9.2, Table 9-10), as data.

States ``Sta1``-``Sta13``, events ``Evt1``-``Evt19`` and actions ``AE-1``-``AE-8``,
``DT-1``-``DT-2``, ``AR-1``-``AR-10``, ``AA-1``-``AA-8`` carry the standard's names, each
member with its description in one row (an event also says where it comes from, an action
the state it leads to, or the :class:`Branch` that picks one of two states). The :data:`TABLE`
defines an outcome for *every* state x event pair (13 x 19 = 247):

* a PS3.8 action for each cell the standard fills, or
* :data:`NOT_POSSIBLE` for the cells it leaves empty. Those are pairs that cannot arise: a PDU,
  a closed connection or an invalid PDU where no transport connection exists (``Sta1``,
  ``Sta4``), an ARTIM expiry where no ARTIM timer runs, a transport event of the requestor
  side, or a local service primitive the local user may not issue in that state. The machine
  ignores the network and timer ones and refuses the local primitives
  (:class:`InvalidTransition`), leaving the state as it was.

The acceptor (:mod:`segnode.node.dicom.ul`; one association's actions in
:mod:`segnode.node.dicom.ul_association`) performs the actions; this module only says which one.
"""

from __future__ import annotations

import enum
from typing import Self


class _Standard(enum.Enum):
    """A name of PS3.8's (the member's value) with the standard's description of it."""

    description: str

    def __new__(cls, name: str, *_: object) -> Self:
        member = object.__new__(cls)
        member._value_ = name
        return member

    def __init__(self, name: str, description: str) -> None:
        self.description = description


class State(_Standard):
    """PS3.8 §9.2.1 states: ``Sta<n>`` and its description."""

    STA1 = "Sta1", "Idle"
    STA2 = "Sta2", "Transport connection open (awaiting A-ASSOCIATE-RQ PDU)"
    STA3 = "Sta3", "Awaiting local A-ASSOCIATE response primitive"
    STA4 = "Sta4", "Awaiting transport connection opening to complete"
    STA5 = "Sta5", "Awaiting A-ASSOCIATE-AC or A-ASSOCIATE-RJ PDU"
    STA6 = "Sta6", "Association established and ready for data transfer"
    STA7 = "Sta7", "Awaiting A-RELEASE-RP PDU"
    STA8 = "Sta8", "Awaiting local A-RELEASE response primitive"
    STA9 = "Sta9", "Release collision requestor side; awaiting A-RELEASE response primitive"
    STA10 = "Sta10", "Release collision acceptor side; awaiting A-RELEASE-RP PDU"
    STA11 = "Sta11", "Release collision requestor side; awaiting A-RELEASE-RP PDU"
    STA12 = "Sta12", "Release collision acceptor side; awaiting A-RELEASE response primitive"
    STA13 = (
        "Sta13",
        "Awaiting transport connection close indication (association no longer exists)",
    )


class Source(enum.Enum):
    """Where a PS3.8 event comes from."""

    USER = "the local service user (the node itself): a request or response primitive"
    PEER = "the peer: a PDU, or bytes that are not a valid one"
    TRANSPORT = "the local transport service"
    TIMER = "the ARTIM timer"


class Event(_Standard):
    """PS3.8 §9.2.2 events: ``Evt<n>``, its description and where it comes from."""

    source: Source

    def __init__(self, name: str, description: str, source: Source) -> None:
        super().__init__(name, description)
        self.source = source

    EVT1 = "Evt1", "A-ASSOCIATE request (local user)", Source.USER
    EVT2 = "Evt2", "Transport connect confirmation (local transport service)", Source.TRANSPORT
    EVT3 = "Evt3", "A-ASSOCIATE-AC PDU received", Source.PEER
    EVT4 = "Evt4", "A-ASSOCIATE-RJ PDU received", Source.PEER
    EVT5 = "Evt5", "Transport connection indication (local transport service)", Source.TRANSPORT
    EVT6 = "Evt6", "A-ASSOCIATE-RQ PDU received", Source.PEER
    EVT7 = "Evt7", "A-ASSOCIATE response primitive (accept)", Source.USER
    EVT8 = "Evt8", "A-ASSOCIATE response primitive (reject)", Source.USER
    EVT9 = "Evt9", "P-DATA request primitive", Source.USER
    EVT10 = "Evt10", "P-DATA-TF PDU received", Source.PEER
    EVT11 = "Evt11", "A-RELEASE request primitive", Source.USER
    EVT12 = "Evt12", "A-RELEASE-RQ PDU received", Source.PEER
    EVT13 = "Evt13", "A-RELEASE-RP PDU received", Source.PEER
    EVT14 = "Evt14", "A-RELEASE response primitive", Source.USER
    EVT15 = "Evt15", "A-ABORT request primitive", Source.USER
    EVT16 = "Evt16", "A-ABORT PDU received", Source.PEER
    EVT17 = "Evt17", "Transport connection closed indication", Source.TRANSPORT
    EVT18 = "Evt18", "ARTIM timer expired", Source.TIMER
    EVT19 = "Evt19", "Unrecognized or invalid PDU received", Source.PEER

    @property
    def local(self) -> bool:
        """A primitive issued by the local service user (the node itself)."""
        return self.source is Source.USER


S = State


class Branch(enum.Enum):
    """The two next states PS3.8 makes conditional (§9.2.3, AE-6 and AR-8): ``then`` where
    the ``condition`` holds, else ``otherwise``."""

    condition: str
    then: State
    otherwise: State

    def __init__(self, condition: str, then: State, otherwise: State) -> None:
        self.condition, self.then, self.otherwise = condition, then, otherwise

    #: AE-6: an acceptable A-ASSOCIATE-RQ is indicated to the user (Sta3); any other is
    #: rejected and the machine waits for the peer to close (Sta13).
    IF_ACCEPTABLE = "the A-ASSOCIATE-RQ is acceptable to the service provider", S.STA3, S.STA13
    #: AR-8: in a release collision the requestor goes to Sta9, the acceptor (segnode) to Sta10.
    IF_REQUESTOR = "the local user is the association-requestor", S.STA9, S.STA10


#: The two descriptions too long for one row of the table below.
_AE_6 = "Stop ARTIM; issue an A-ASSOCIATE indication, or send A-ASSOCIATE-RJ and start ARTIM"
_AA_8 = "Send A-ABORT PDU (service-provider source), issue A-P-ABORT indication, start ARTIM"


class Action(_Standard):
    """PS3.8 §9.2.3 actions: the name, the description and the state the action leads to, or
    the :class:`Branch` that decides between two."""

    leads_to: State | Branch

    def __init__(self, name: str, description: str, leads_to: State | Branch) -> None:
        super().__init__(name, description)
        self.leads_to = leads_to

    @property
    def next_states(self) -> tuple[State, ...]:
        """Every state the action may lead to."""
        if isinstance(self.leads_to, Branch):
            return self.leads_to.then, self.leads_to.otherwise
        return (self.leads_to,)

    AE_1 = "AE-1", "Issue TRANSPORT CONNECT request primitive", S.STA4
    AE_2 = "AE-2", "Send A-ASSOCIATE-RQ PDU", S.STA5
    AE_3 = "AE-3", "Issue A-ASSOCIATE confirmation (accept) primitive", S.STA6
    AE_4 = "AE-4", "Issue A-ASSOCIATE confirmation (reject), close transport", S.STA1
    AE_5 = "AE-5", "Issue transport connection response; start ARTIM timer", S.STA2
    AE_6 = "AE-6", _AE_6, Branch.IF_ACCEPTABLE
    AE_7 = "AE-7", "Send A-ASSOCIATE-AC PDU", S.STA6
    AE_8 = "AE-8", "Send A-ASSOCIATE-RJ PDU and start ARTIM timer", S.STA13
    DT_1 = "DT-1", "Send P-DATA-TF PDU", S.STA6
    DT_2 = "DT-2", "Issue P-DATA indication primitive", S.STA6
    AR_1 = "AR-1", "Send A-RELEASE-RQ PDU", S.STA7
    AR_2 = "AR-2", "Issue A-RELEASE indication primitive", S.STA8
    AR_3 = "AR-3", "Issue A-RELEASE confirmation primitive, close transport", S.STA1
    AR_4 = "AR-4", "Send A-RELEASE-RP PDU and start ARTIM timer", S.STA13
    AR_5 = "AR-5", "Stop ARTIM timer", S.STA1
    AR_6 = "AR-6", "Issue P-DATA indication", S.STA7
    AR_7 = "AR-7", "Send P-DATA-TF PDU", S.STA8
    AR_8 = "AR-8", "Issue A-RELEASE indication (release collision)", Branch.IF_REQUESTOR
    AR_9 = "AR-9", "Send A-RELEASE-RP PDU", S.STA11
    AR_10 = "AR-10", "Issue A-RELEASE confirmation primitive", S.STA12
    AA_1 = "AA-1", "Send A-ABORT PDU and start (or restart) ARTIM timer", S.STA13
    AA_2 = "AA-2", "Stop ARTIM timer if running; close transport connection", S.STA1
    AA_3 = "AA-3", "Issue A-ABORT or A-P-ABORT indication; close transport", S.STA1
    AA_4 = "AA-4", "Issue A-P-ABORT indication primitive", S.STA1
    AA_5 = "AA-5", "Stop ARTIM timer", S.STA1
    AA_6 = "AA-6", "Ignore PDU", S.STA13
    AA_7 = "AA-7", "Send A-ABORT PDU", S.STA13
    AA_8 = "AA-8", _AA_8, S.STA13


class _NotPossible:
    """The outcome of a pair PS3.8 leaves empty (see the module docstring)."""

    def __repr__(self) -> str:
        return "NOT_POSSIBLE"


NOT_POSSIBLE = _NotPossible()

#: The actions only an association *requestor* performs; segnode's acceptor refuses them.
REQUESTOR_ACTIONS = frozenset({Action.AE_1, Action.AE_2, Action.AE_3, Action.AE_4})


def _build() -> dict[tuple[State, Event], Action | _NotPossible]:
    A, E = Action, Event
    table: dict[tuple[State, Event], Action | _NotPossible] = {
        (s, e): NOT_POSSIBLE for s in State for e in Event
    }
    established = [S.STA3, S.STA5, S.STA6, S.STA7, S.STA8, S.STA9, S.STA10, S.STA11, S.STA12]
    # Unexpected PDUs: an abort before the association exists (AA-1 in Sta2), a provider abort
    # after (AA-8), ignored once it is gone (AA-6 in Sta13); Table 9-10 rows Evt3/4/6/10/12/13/19.
    for e in (E.EVT3, E.EVT4, E.EVT6, E.EVT10, E.EVT12, E.EVT13, E.EVT19):
        table[(S.STA2, e)] = A.AA_1
        for s in established:
            table[(s, e)] = A.AA_8
        table[(S.STA13, e)] = A.AA_6
    table[(S.STA13, E.EVT6)] = A.AA_7
    table[(S.STA13, E.EVT19)] = A.AA_7
    # Association establishment.
    table[(S.STA1, E.EVT1)] = A.AE_1
    table[(S.STA4, E.EVT2)] = A.AE_2
    table[(S.STA5, E.EVT3)] = A.AE_3
    table[(S.STA5, E.EVT4)] = A.AE_4
    table[(S.STA1, E.EVT5)] = A.AE_5
    table[(S.STA2, E.EVT6)] = A.AE_6
    table[(S.STA3, E.EVT7)] = A.AE_7
    table[(S.STA3, E.EVT8)] = A.AE_8
    # Data transfer.
    table[(S.STA6, E.EVT9)] = A.DT_1
    table[(S.STA8, E.EVT9)] = A.AR_7
    table[(S.STA6, E.EVT10)] = A.DT_2
    table[(S.STA7, E.EVT10)] = A.AR_6
    # Release, including the collisions.
    table[(S.STA6, E.EVT11)] = A.AR_1
    table[(S.STA6, E.EVT12)] = A.AR_2
    table[(S.STA7, E.EVT12)] = A.AR_8
    table[(S.STA7, E.EVT13)] = A.AR_3
    table[(S.STA10, E.EVT13)] = A.AR_10
    table[(S.STA11, E.EVT13)] = A.AR_3
    table[(S.STA8, E.EVT14)] = A.AR_4
    table[(S.STA9, E.EVT14)] = A.AR_9
    table[(S.STA12, E.EVT14)] = A.AR_4
    # Abort.
    table[(S.STA4, E.EVT15)] = A.AA_2
    for s in established:
        table[(s, E.EVT15)] = A.AA_1
        table[(s, E.EVT16)] = A.AA_3
        table[(s, E.EVT17)] = A.AA_4
    table[(S.STA2, E.EVT16)] = A.AA_2
    table[(S.STA13, E.EVT16)] = A.AA_2
    table[(S.STA2, E.EVT17)] = A.AA_5
    table[(S.STA4, E.EVT17)] = A.AA_4
    table[(S.STA13, E.EVT17)] = A.AR_5
    table[(S.STA2, E.EVT18)] = A.AA_2
    table[(S.STA13, E.EVT18)] = A.AA_2
    return table


#: State x event -> action (or NOT_POSSIBLE), all 247 pairs.
TABLE = _build()


class InvalidTransition(Exception):
    """The local user issued a primitive that is not possible in the current state."""


__all__ = [
    "Action",
    "Branch",
    "Event",
    "InvalidTransition",
    "NOT_POSSIBLE",
    "REQUESTOR_ACTIONS",
    "Source",
    "State",
    "TABLE",
]
