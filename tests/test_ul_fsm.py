"""The Upper Layer state machine (node/dicom/ul_fsm.py) and the acceptor that performs it
(node/dicom/ul.py).

Driven from the transition table: every one of the 13 x 19 state x event pairs is fired on a
real :class:`segnode.node.dicom.ul._Association` over a socket pair, and what the peer receives,
whether the connection is closed, the next state and the ARTIM timer are checked against what PS3.8
says the cell's action does (``EFFECTS`` below, written from PS3.8 §9.2.3, not from the code). The
table itself is checked cell by cell against pynetdicom's independent encoding of Table 9-10.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from typing import Any

import pytest
from pydicom.uid import ImplicitVRLittleEndian
from pynetdicom.fsm import TRANSITION_TABLE as PYNETDICOM_TABLE
from pynetdicom.pdu import A_ASSOCIATE_RQ

from segnode.node.dicom.ul import (
    ABORT,
    ASSOCIATE_AC,
    ASSOCIATE_RJ,
    P_DATA_TF,
    RELEASE_RP,
    RELEASE_RQ,
    VERIFICATION,
    Acceptor,
    AcceptorOptions,
    AssociationInfo,
    StoreOutcome,
    StoreRequest,
    _Association,
    pdata_pdus,
)
from segnode.node.dicom.ul_fsm import (
    NOT_POSSIBLE,
    REQUESTOR_ACTIONS,
    TABLE,
    Action,
    Branch,
    Event,
    InvalidTransition,
    Source,
    State,
)
from tests.test_ul import associate_rq

A, S = Action, State
#: What each action does, seen from outside (PS3.8 §9.2.3): the PDU type the peer receives
#: (None: nothing), whether the transport is closed, whether ARTIM runs afterwards, the state.
EFFECTS: dict[Action, tuple[int | None, bool, bool, State]] = {
    A.AE_5: (None, False, True, S.STA2),
    A.AE_6: (None, False, False, S.STA3),  # an acceptable A-ASSOCIATE-RQ: indication
    A.AE_7: (ASSOCIATE_AC, False, False, S.STA6),
    A.AE_8: (ASSOCIATE_RJ, False, True, S.STA13),
    A.DT_1: (P_DATA_TF, False, False, S.STA6),
    A.DT_2: (None, False, False, S.STA6),
    A.AR_1: (RELEASE_RQ, False, False, S.STA7),
    A.AR_2: (None, False, False, S.STA8),
    A.AR_3: (None, True, False, S.STA1),
    A.AR_4: (RELEASE_RP, False, True, S.STA13),
    A.AR_5: (None, True, False, S.STA1),
    A.AR_6: (None, False, False, S.STA7),
    A.AR_7: (P_DATA_TF, False, False, S.STA8),
    A.AR_8: (None, False, False, S.STA10),  # the node is always the association-acceptor
    A.AR_9: (RELEASE_RP, False, False, S.STA11),
    A.AR_10: (None, False, False, S.STA12),
    A.AA_1: (ABORT, False, True, S.STA13),
    A.AA_2: (None, True, False, S.STA1),
    A.AA_3: (None, True, False, S.STA1),
    A.AA_4: (None, True, False, S.STA1),
    A.AA_5: (None, True, False, S.STA1),
    A.AA_6: (None, False, False, S.STA13),
    A.AA_7: (ABORT, False, False, S.STA13),
    A.AA_8: (ABORT, False, True, S.STA13),
}
ESTABLISHED = {S.STA6, S.STA7, S.STA8, S.STA9, S.STA10, S.STA11, S.STA12}


class Recorder:
    """The service user: records the indications it gets."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def requested(self, info: AssociationInfo) -> tuple[int, int, int] | None:
        self.calls.append(("requested", info.calling_ae))
        return None

    def accepted(self, info: AssociationInfo) -> None:
        self.calls.append(("accepted", info.calling_ae))

    def store(self, info: AssociationInfo, request: StoreRequest) -> StoreOutcome:
        self.calls.append(("store", request.sop_instance_uid))
        return StoreOutcome(0)

    def closed(self, info: AssociationInfo, released: bool) -> None:
        self.calls.append(("closed", released))


def _rq() -> Any:
    pdu = A_ASSOCIATE_RQ()
    pdu.decode(associate_rq(abstract=VERIFICATION))
    return pdu.to_primitive()


def _payload(event: Event) -> Any:
    if event is Event.EVT6:
        return _rq()
    if event is Event.EVT9:
        return pdata_pdus(1, b"\x00" * 8, 0)
    if event is Event.EVT10:
        return []
    return None


@pytest.fixture()
def acceptor() -> Iterator[Acceptor]:
    options = AcceptorOptions("SEGNODE", {VERIFICATION: [ImplicitVRLittleEndian]})
    acc = Acceptor(options, Recorder())
    yield acc
    acc.stop(grace=0, timeout=0)  # never started: closes its wake-up socket and pipes
    acc._selector.close()


def _machine(acceptor: Acceptor, state: State) -> tuple[_Association, socket.socket]:
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    peer.settimeout(2)
    assoc = _Association(acceptor, ours, ("127.0.0.1", 4242))
    assoc.state = state
    assoc.request = _rq()
    assoc.info.calling_ae = "RAW"
    assoc.info.contexts = {1: (VERIFICATION, str(ImplicitVRLittleEndian))}
    assoc.established = state in ESTABLISHED or state is S.STA13
    assoc._told_closed = state is S.STA13  # told when the association ended
    if state in (S.STA2, S.STA13):
        assoc._start_artim()
    return assoc, peer


def _received(peer: socket.socket) -> int | None:
    """The type of the first PDU the peer received, None when nothing came."""
    peer.setblocking(False)
    try:
        head = peer.recv(6)
    except BlockingIOError:
        return None
    return head[0] if head else None


def test_the_table_defines_every_pair_and_matches_pynetdicoms_reading_of_ps3_8() -> None:
    assert len(TABLE) == len(State) * len(Event) == 247
    ours = {(e.value, s.value): a.value for (s, e), a in TABLE.items() if isinstance(a, Action)}
    assert ours == PYNETDICOM_TABLE
    for action in Action:
        assert EFFECTS.get(action) or action in REQUESTOR_ACTIONS
        assert action.description and action.next_states


def test_each_event_names_its_source_as_ps3_8_words_it() -> None:
    """A PDU (or invalid bytes) comes from the peer, a primitive from the local user, a
    transport indication from the transport service; only the user's events are local."""
    for event in Event:
        words = event.description
        expected = (
            Source.TIMER
            if "ARTIM" in words
            else Source.TRANSPORT
            if "Transport" in words
            else Source.PEER
            if "PDU" in words
            else Source.USER
        )
        assert event.source is expected, event
        assert event.local == ("primitive" in words or "local user" in words), event


@pytest.mark.parametrize(
    ("state", "event"), [(s, e) for s in State for e in Event], ids=lambda x: x.value
)
def test_every_state_event_pair_has_its_outcome(
    acceptor: Acceptor, state: State, event: Event
) -> None:
    assoc, peer = _machine(acceptor, state)
    users = acceptor.handlers
    assert isinstance(users, Recorder)
    cell = TABLE[(state, event)]
    try:
        if cell is NOT_POSSIBLE or cell in REQUESTOR_ACTIONS:
            if event.local or cell in REQUESTOR_ACTIONS:
                with pytest.raises(InvalidTransition):
                    assoc.fire(event, _payload(event))
            else:
                assert assoc.fire(event, _payload(event)) is None
            assert assoc.state is state  # unchanged
            assert _received(peer) is None
            assert not assoc.closed
            return
        assert isinstance(cell, Action)
        assert assoc.fire(event, _payload(event)) is cell
        pdu, closed, artim, next_state = EFFECTS[cell]
        assert assoc.state is next_state
        assert next_state in cell.next_states  # the table's next states hold in the acceptor
        assert assoc.closed is closed
        if not closed:
            assert _received(peer) == pdu
        if cell is not A.AA_6 and cell is not A.AA_7:
            assert (assoc.artim is not None) is artim
        if cell is A.AA_8:  # service-provider source
            assert peer.recv(4)[2] == 0x02
        told = [c for c in users.calls if c[0] == "closed"]
        if state in ESTABLISHED and next_state in (S.STA1, S.STA13):
            assert told == [("closed", cell is A.AR_4 or cell is A.AR_3)]
        else:
            assert told == []
        if cell is A.AE_7:
            assert ("accepted", "RAW") in users.calls
    finally:
        assoc.close()
        peer.close()


def _pdus(peer: socket.socket) -> list[int]:
    out = []
    peer.setblocking(False)
    buf = b""
    try:
        while True:
            chunk = peer.recv(65536)
            if not chunk:
                break
            buf += chunk
    except BlockingIOError:
        pass
    while len(buf) >= 6:
        kind, _, length = struct.unpack(">BBI", buf[:6])
        out.append(kind)
        buf = buf[6 + length :]
    return out


def test_release_collision_on_the_acceptor_side(acceptor: Acceptor) -> None:
    """Sta6 -A-RELEASE request-> Sta7 -peer's A-RELEASE-RQ-> Sta10 -A-RELEASE-RP-> Sta12
    -our response-> Sta13 -peer closes-> Sta1 (PS3.8 §7.2.2, Figure 7-1, acceptor side)."""
    assoc, peer = _machine(acceptor, S.STA6)
    steps = [
        (Event.EVT11, A.AR_1, S.STA7),
        (Event.EVT12, A.AR_8, S.STA10),
        (Event.EVT13, A.AR_10, S.STA12),
        (Event.EVT14, A.AR_4, S.STA13),
        (Event.EVT17, A.AR_5, S.STA1),
    ]
    for event, action, state in steps:
        assert assoc.fire(event) is action
        assert assoc.state is state
    assert _pdus(peer) == [RELEASE_RQ, RELEASE_RP]
    assert isinstance(acceptor.handlers, Recorder)
    assert acceptor.handlers.calls == [("closed", True)]
    peer.close()


def test_the_two_conditional_actions_take_the_branch_ps3_8_names(acceptor: Acceptor) -> None:
    """AE-6 leads to Sta3 for an acceptable A-ASSOCIATE-RQ and to Sta13 (A-ASSOCIATE-RJ sent,
    ARTIM started) for one that is not; AR-8 takes the acceptor's side of the collision."""
    assert A.AE_6.leads_to is Branch.IF_ACCEPTABLE and A.AR_8.leads_to is Branch.IF_REQUESTOR
    assert A.AE_6.next_states == (S.STA3, S.STA13)
    assert all(a.next_states == (a.leads_to,) for a in Action if a not in (A.AE_6, A.AR_8))
    for acceptable, expected in (
        (True, Branch.IF_ACCEPTABLE.then),
        (False, Branch.IF_ACCEPTABLE.otherwise),
    ):
        assoc, peer = _machine(acceptor, S.STA2)
        assoc._rq_version = 1 if acceptable else 2  # PS3.8 §9.3.2: bit 0, version 1
        assert assoc.fire(Event.EVT6, _rq()) is A.AE_6
        assert assoc.state is expected
        assert _received(peer) == (None if acceptable else ASSOCIATE_RJ)
        assert (assoc.artim is not None) is (not acceptable)
        assoc.close()
        peer.close()
    assoc, peer = _machine(acceptor, S.STA7)
    assert assoc.fire(Event.EVT12) is A.AR_8
    assert assoc.state is Branch.IF_REQUESTOR.otherwise  # segnode is never the requestor
    assoc.close()
    peer.close()


def test_p_data_after_our_release_request_is_not_processed(acceptor: Acceptor) -> None:
    """Sta7 + P-DATA-TF: AR-6; the node may not answer in Sta7, so nothing is stored."""
    assoc, peer = _machine(acceptor, S.STA7)
    assert assoc.fire(Event.EVT10, [(1, 0x03, memoryview(b"\x00" * 8))]) is A.AR_6
    assert assoc.state is S.STA7
    assert isinstance(acceptor.handlers, Recorder)
    assert acceptor.handlers.calls == []
    assoc.close()
    peer.close()
