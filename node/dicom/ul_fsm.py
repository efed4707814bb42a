"""The DICOM Upper Layer state machine (PS3.8 §9.2, Table 9-10), as data.

States ``Sta1``-``Sta13``, events ``Evt1``-``Evt19`` and actions ``AE-1``-``AE-8``,
``DT-1``-``DT-2``, ``AR-1``-``AR-10``, ``AA-1``-``AA-8`` carry the standard's names. The
:data:`TABLE` defines an outcome for *every* state x event pair (13 x 19 = 247):

* a PS3.8 action for each cell the standard fills, or
* :data:`NOT_POSSIBLE` for the cells it leaves empty. Those are pairs that cannot arise: a PDU,
  a closed connection or an invalid PDU where no transport connection exists (``Sta1``,
  ``Sta4``), an ARTIM expiry where no ARTIM timer runs, a transport event of the requestor
  side, or a local service primitive the local user may not issue in that state. The machine
  ignores the network and timer ones and refuses the local primitives
  (:class:`InvalidTransition`), leaving the state as it was.

The acceptor (:mod:`segnode.node.dicom.ul`) performs the actions; this module only says which one.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    """PS3.8 §9.2.1 states."""

    STA1 = "Sta1"
    STA2 = "Sta2"
    STA3 = "Sta3"
    STA4 = "Sta4"
    STA5 = "Sta5"
    STA6 = "Sta6"
    STA7 = "Sta7"
    STA8 = "Sta8"
    STA9 = "Sta9"
    STA10 = "Sta10"
    STA11 = "Sta11"
    STA12 = "Sta12"
    STA13 = "Sta13"

    @property
    def description(self) -> str:
        """PS3.8's description of the state."""
        return STATE_DESCRIPTIONS[self]


STATE_DESCRIPTIONS = {
    State.STA1: "Idle",
    State.STA2: "Transport connection open (awaiting A-ASSOCIATE-RQ PDU)",
    State.STA3: "Awaiting local A-ASSOCIATE response primitive",
    State.STA4: "Awaiting transport connection opening to complete",
    State.STA5: "Awaiting A-ASSOCIATE-AC or A-ASSOCIATE-RJ PDU",
    State.STA6: "Association established and ready for data transfer",
    State.STA7: "Awaiting A-RELEASE-RP PDU",
    State.STA8: "Awaiting local A-RELEASE response primitive",
    State.STA9: "Release collision requestor side; awaiting A-RELEASE response primitive",
    State.STA10: "Release collision acceptor side; awaiting A-RELEASE-RP PDU",
    State.STA11: "Release collision requestor side; awaiting A-RELEASE-RP PDU",
    State.STA12: "Release collision acceptor side; awaiting A-RELEASE response primitive",
    State.STA13: "Awaiting transport connection close indication (association no longer exists)",
}


class Event(enum.Enum):
    """PS3.8 §9.2.2 events."""

    EVT1 = "Evt1"
    EVT2 = "Evt2"
    EVT3 = "Evt3"
    EVT4 = "Evt4"
    EVT5 = "Evt5"
    EVT6 = "Evt6"
    EVT7 = "Evt7"
    EVT8 = "Evt8"
    EVT9 = "Evt9"
    EVT10 = "Evt10"
    EVT11 = "Evt11"
    EVT12 = "Evt12"
    EVT13 = "Evt13"
    EVT14 = "Evt14"
    EVT15 = "Evt15"
    EVT16 = "Evt16"
    EVT17 = "Evt17"
    EVT18 = "Evt18"
    EVT19 = "Evt19"

    @property
    def description(self) -> str:
        """PS3.8's description of the event."""
        return EVENT_DESCRIPTIONS[self]

    @property
    def local(self) -> bool:
        """A primitive issued by the local service user (the node itself)."""
        return self in LOCAL_EVENTS


EVENT_DESCRIPTIONS = {
    Event.EVT1: "A-ASSOCIATE request (local user)",
    Event.EVT2: "Transport connect confirmation (local transport service)",
    Event.EVT3: "A-ASSOCIATE-AC PDU received",
    Event.EVT4: "A-ASSOCIATE-RJ PDU received",
    Event.EVT5: "Transport connection indication (local transport service)",
    Event.EVT6: "A-ASSOCIATE-RQ PDU received",
    Event.EVT7: "A-ASSOCIATE response primitive (accept)",
    Event.EVT8: "A-ASSOCIATE response primitive (reject)",
    Event.EVT9: "P-DATA request primitive",
    Event.EVT10: "P-DATA-TF PDU received",
    Event.EVT11: "A-RELEASE request primitive",
    Event.EVT12: "A-RELEASE-RQ PDU received",
    Event.EVT13: "A-RELEASE-RP PDU received",
    Event.EVT14: "A-RELEASE response primitive",
    Event.EVT15: "A-ABORT request primitive",
    Event.EVT16: "A-ABORT PDU received",
    Event.EVT17: "Transport connection closed indication",
    Event.EVT18: "ARTIM timer expired",
    Event.EVT19: "Unrecognized or invalid PDU received",
}

LOCAL_EVENTS = frozenset(
    {Event.EVT1, Event.EVT7, Event.EVT8, Event.EVT9, Event.EVT11, Event.EVT14, Event.EVT15}
)


class Action(enum.Enum):
    """PS3.8 §9.2.3 actions."""

    AE_1 = "AE-1"
    AE_2 = "AE-2"
    AE_3 = "AE-3"
    AE_4 = "AE-4"
    AE_5 = "AE-5"
    AE_6 = "AE-6"
    AE_7 = "AE-7"
    AE_8 = "AE-8"
    DT_1 = "DT-1"
    DT_2 = "DT-2"
    AR_1 = "AR-1"
    AR_2 = "AR-2"
    AR_3 = "AR-3"
    AR_4 = "AR-4"
    AR_5 = "AR-5"
    AR_6 = "AR-6"
    AR_7 = "AR-7"
    AR_8 = "AR-8"
    AR_9 = "AR-9"
    AR_10 = "AR-10"
    AA_1 = "AA-1"
    AA_2 = "AA-2"
    AA_3 = "AA-3"
    AA_4 = "AA-4"
    AA_5 = "AA-5"
    AA_6 = "AA-6"
    AA_7 = "AA-7"
    AA_8 = "AA-8"

    @property
    def description(self) -> str:
        """PS3.8's description of the action."""
        return ACTION_DESCRIPTIONS[self][0]

    def next_states(self) -> tuple[State, ...]:
        """The state(s) the action leads to (AE-6 and AR-8 decide between two)."""
        return ACTION_DESCRIPTIONS[self][1]


S = State
ACTION_DESCRIPTIONS: dict[Action, tuple[str, tuple[State, ...]]] = {
    Action.AE_1: ("Issue TRANSPORT CONNECT request primitive", (S.STA4,)),
    Action.AE_2: ("Send A-ASSOCIATE-RQ PDU", (S.STA5,)),
    Action.AE_3: ("Issue A-ASSOCIATE confirmation (accept) primitive", (S.STA6,)),
    Action.AE_4: ("Issue A-ASSOCIATE confirmation (reject), close transport", (S.STA1,)),
    Action.AE_5: ("Issue transport connection response; start ARTIM timer", (S.STA2,)),
    Action.AE_6: (
        "Stop ARTIM; if the A-ASSOCIATE-RQ is acceptable issue an A-ASSOCIATE indication, "
        "otherwise send A-ASSOCIATE-RJ and start ARTIM",
        (S.STA3, S.STA13),
    ),
    Action.AE_7: ("Send A-ASSOCIATE-AC PDU", (S.STA6,)),
    Action.AE_8: ("Send A-ASSOCIATE-RJ PDU and start ARTIM timer", (S.STA13,)),
    Action.DT_1: ("Send P-DATA-TF PDU", (S.STA6,)),
    Action.DT_2: ("Issue P-DATA indication primitive", (S.STA6,)),
    Action.AR_1: ("Send A-RELEASE-RQ PDU", (S.STA7,)),
    Action.AR_2: ("Issue A-RELEASE indication primitive", (S.STA8,)),
    Action.AR_3: ("Issue A-RELEASE confirmation primitive, close transport", (S.STA1,)),
    Action.AR_4: ("Send A-RELEASE-RP PDU and start ARTIM timer", (S.STA13,)),
    Action.AR_5: ("Stop ARTIM timer", (S.STA1,)),
    Action.AR_6: ("Issue P-DATA indication", (S.STA7,)),
    Action.AR_7: ("Send P-DATA-TF PDU", (S.STA8,)),
    Action.AR_8: (
        "Issue A-RELEASE indication (release collision): requestor to Sta9, acceptor to Sta10",
        (S.STA9, S.STA10),
    ),
    Action.AR_9: ("Send A-RELEASE-RP PDU", (S.STA11,)),
    Action.AR_10: ("Issue A-RELEASE confirmation primitive", (S.STA12,)),
    Action.AA_1: ("Send A-ABORT PDU and start (or restart) ARTIM timer", (S.STA13,)),
    Action.AA_2: ("Stop ARTIM timer if running; close transport connection", (S.STA1,)),
    Action.AA_3: ("Issue A-ABORT or A-P-ABORT indication; close transport", (S.STA1,)),
    Action.AA_4: ("Issue A-P-ABORT indication primitive", (S.STA1,)),
    Action.AA_5: ("Stop ARTIM timer", (S.STA1,)),
    Action.AA_6: ("Ignore PDU", (S.STA13,)),
    Action.AA_7: ("Send A-ABORT PDU", (S.STA13,)),
    Action.AA_8: (
        "Send A-ABORT PDU (service-provider source), issue A-P-ABORT indication, start ARTIM",
        (S.STA13,),
    ),
}


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
    "Event",
    "InvalidTransition",
    "NOT_POSSIBLE",
    "REQUESTOR_ACTIONS",
    "State",
    "TABLE",
]
