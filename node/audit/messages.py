"""DICOM audit messages (PS3.15 A.5): the parts of a message as frozen dataclasses, one builder
per event the node reports, and the XML encoding of the DICOM Audit Message Schema (A.5.1).

A message is valid once constructed: the builders fill every field the event's table in A.5.3
makes mandatory, and :meth:`AuditMessage.to_xml` writes UTF-8 XML without a declaration and
without a line break anywhere (one message is one syslog line, RFC 5424). Every string that
comes from outside (AE titles, patient names, reasons) is cleaned of what XML 1.0 cannot carry
and of line breaks before it is written.

Must not touch: queueing and delivery (:mod:`segnode.node.audit.queue`,
:mod:`segnode.node.audit.auditor`), the syslog framing (:mod:`segnode.node.audit.syslog`).
"""

from __future__ import annotations

import base64
import ipaddress
import re
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

# Characters XML 1.0 cannot carry (section 2.2), plus the line breaks and tabs a syslog line
# must not contain: each becomes a space.
_NOT_IN_A_LINE = re.compile("[\x00-\x1f\x7f\ud800-\udfff\ufffe\uffff]")

SUCCESS, MINOR_FAILURE, SERIOUS_FAILURE, MAJOR_FAILURE = 0, 4, 8, 12
_OUTCOMES = (SUCCESS, MINOR_FAILURE, SERIOUS_FAILURE, MAJOR_FAILURE)
_ACTIONS = ("C", "R", "U", "D", "E")


def clean(value: str) -> str:
    """``value`` without the characters XML 1.0 cannot carry and without line breaks (each
    becomes a space), so that the message stays well-formed and on one line."""
    return _NOT_IN_A_LINE.sub(" ", value)


@dataclass(frozen=True)
class Code:
    """A coded value (``CodedValueType`` of A.5.1.1): code, coding scheme, code meaning.

    The meaning is written as ``originalText`` (the schema's "Code Meaning").
    """

    code: str
    scheme: str
    meaning: str

    def attributes(self) -> dict[str, str]:
        """The XML attributes of this code."""
        return {
            "csd-code": clean(self.code),
            "codeSystemName": clean(self.scheme),
            "originalText": clean(self.meaning),
        }


# PS3.16 CID 400 (Audit Event ID), as used by PS3.15 A.5.3.
APPLICATION_ACTIVITY = Code("110100", "DCM", "Application Activity")
INSTANCES_TRANSFERRED = Code("110104", "DCM", "DICOM Instances Transferred")
STUDY_DELETED = Code("110105", "DCM", "DICOM Study Deleted")
SECURITY_ALERT = Code("110113", "DCM", "Security Alert")
USER_AUTHENTICATION = Code("110114", "DCM", "User Authentication")
# PS3.16 CID 401 (Audit Event Type Code).
APPLICATION_START = Code("110120", "DCM", "Application Start")
APPLICATION_STOP = Code("110121", "DCM", "Application Stop")
LOGIN = Code("110122", "DCM", "Login")
LOGOUT = Code("110123", "DCM", "Logout")
NODE_AUTHENTICATION = Code("110126", "DCM", "Node Authentication")
SECURITY_CONFIGURATION = Code("110129", "DCM", "Security Configuration")
SOFTWARE_CONFIGURATION = Code("110131", "DCM", "Software Configuration")
USE_OF_RESTRICTED_FUNCTION = Code("110132", "DCM", "Use of Restricted Function")
# PS3.16 CID 402 (Audit Active Participant Role ID Code).
ROLE_APPLICATION = Code("110150", "DCM", "Application")
ROLE_APPLICATION_LAUNCHER = Code("110151", "DCM", "Application Launcher")
ROLE_DESTINATION = Code("110152", "DCM", "Destination Role ID")
ROLE_SOURCE = Code("110153", "DCM", "Source Role ID")
# PS3.15 A.5.1.2.4 and PS3.16 CID 404 (Audit Participant Object ID Type Code).
PATIENT_NUMBER = Code("2", "RFC-3881", "Patient Number")
STUDY_INSTANCE_UID = Code("110180", "DCM", "Study Instance UID")
NODE_ID = Code("110182", "DCM", "Node ID")

SECURITY_ALERT_KINDS: Mapping[str, Code] = {
    "software_configuration": SOFTWARE_CONFIGURATION,
    "security_configuration": SECURITY_CONFIGURATION,
    "restricted_function": USE_OF_RESTRICTED_FUNCTION,
    "node_authentication": NODE_AUTHENTICATION,
}

# NetworkAccessPointTypeCode (A.5.1.1): 1 machine name, 2 IP address.
MACHINE_NAME, IP_ADDRESS = 1, 2
# ParticipantObjectTypeCode and ParticipantObjectTypeCodeRole (A.5.1.2.2).
PERSON, SYSTEM_OBJECT = 1, 2
ROLE_PATIENT, ROLE_REPORT = 1, 3
# AuditSourceTypeCode (A.5.1.2.1): application server process.
APPLICATION_SERVER = "4"


def access_point(value: str) -> tuple[str, int]:
    """``value`` as a network access point: its ID and type code (2 for an IP address, 1 for
    anything else, taken as a machine name)."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return value, MACHINE_NAME
    return value, IP_ADDRESS


@dataclass(frozen=True)
class EventIdentification:
    """What happened, when and with which outcome (``EventIdentification``).

    Parameters
    ----------
    event_id
        The event's family (CID 400).
    action
        ``EventActionCode``: C, R, U, D or E.
    outcome
        ``EventOutcomeIndicator``: 0 success, 4 minor, 8 serious, 12 major failure.
    when
        The time of the event; written in UTC with milliseconds (A.5.2.5).
    types
        ``EventTypeCode`` values (CID 401).
    description
        ``EventOutcomeDescription``, free text.
    """

    event_id: Code
    action: str
    outcome: int
    when: datetime
    types: tuple[Code, ...] = ()
    description: str | None = None

    def __post_init__(self) -> None:
        if self.action not in _ACTIONS:
            raise ValueError(f"EventActionCode must be one of {_ACTIONS}, not {self.action!r}")
        if self.outcome not in _OUTCOMES:
            raise ValueError(f"EventOutcomeIndicator must be one of {_OUTCOMES}")
        if self.when.tzinfo is None:
            raise ValueError("EventDateTime needs a time zone (PS3.15 A.5.2.5)")


@dataclass(frozen=True)
class ActiveParticipant:
    """A user, process or node that took part (``ActiveParticipant``, A.5.2.1-A.5.2.4)."""

    user_id: str
    requestor: bool
    roles: tuple[Code, ...] = ()
    alternative_user_id: str | None = None
    user_name: str | None = None
    access_point: str | None = None
    access_point_type: int | None = None


@dataclass(frozen=True)
class AuditSource:
    """The system that detected the event and wrote the message (``AuditSourceIdentification``)."""

    source_id: str
    enterprise_site: str | None = None
    type_code: str = APPLICATION_SERVER

    def __post_init__(self) -> None:
        if not self.source_id.strip():
            raise ValueError("AuditSourceID must not be empty")


@dataclass(frozen=True)
class SOPClassCount:
    """One SOP Class of a study and how many of its instances the event concerned."""

    uid: str
    instances: int


@dataclass(frozen=True)
class ParticipantObject:
    """A data object the event concerned (``ParticipantObjectIdentification``).

    The schema of A.5.1.1 requires a ``ParticipantObjectName`` (or a query), so ``name`` is
    mandatory here. ``details`` are (type, value) pairs, the value base64-encoded when written;
    ``sop_classes`` become the ``SOPClass`` children of ``ParticipantObjectDescription``.
    """

    object_id: str
    id_type: Code
    name: str
    type_code: int | None = None
    role: int | None = None
    details: tuple[tuple[str, str], ...] = ()
    sop_classes: tuple[SOPClassCount, ...] = ()


@dataclass(frozen=True)
class AuditMessage:
    """One audit message (``AuditMessage``, PS3.15 A.5.1.1)."""

    event: EventIdentification
    participants: tuple[ActiveParticipant, ...]
    source: AuditSource
    objects: tuple[ParticipantObject, ...] = ()

    def __post_init__(self) -> None:
        if not self.participants:
            raise ValueError("an audit message needs at least one ActiveParticipant")
        if sum(p.requestor for p in self.participants) > 1:
            raise ValueError("at most one ActiveParticipant may be the requestor (A.5.2)")

    @property
    def severity(self) -> int:
        """The syslog severity for this message: 5 (notice) on success, 4 (warning) otherwise
        (IHE ITI-20)."""
        return 5 if self.event.outcome == SUCCESS else 4

    def to_xml(self) -> bytes:
        """The message as UTF-8 XML of the DICOM Audit Message Schema, on one line."""
        root = ET.Element("AuditMessage")
        _event(root, self.event)
        for participant in self.participants:
            _participant(root, participant)
        _source(root, self.source)
        for obj in self.objects:
            _object(root, obj)
        return ET.tostring(root, encoding="unicode", short_empty_elements=True).encode("utf-8")


def _event(root: ET.Element, event: EventIdentification) -> None:
    when = event.when.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    element = ET.SubElement(
        root,
        "EventIdentification",
        {
            "EventActionCode": event.action,
            "EventDateTime": when,
            "EventOutcomeIndicator": str(event.outcome),
        },
    )
    ET.SubElement(element, "EventID", event.event_id.attributes())
    for code in event.types:
        ET.SubElement(element, "EventTypeCode", code.attributes())
    if event.description is not None:
        ET.SubElement(element, "EventOutcomeDescription").text = clean(event.description)


def _participant(root: ET.Element, participant: ActiveParticipant) -> None:
    attributes = {"UserID": clean(participant.user_id)}
    if participant.alternative_user_id is not None:
        attributes["AlternativeUserID"] = clean(participant.alternative_user_id)
    if participant.user_name is not None:
        attributes["UserName"] = clean(participant.user_name)
    attributes["UserIsRequestor"] = "true" if participant.requestor else "false"
    if participant.access_point is not None:
        attributes["NetworkAccessPointID"] = clean(participant.access_point)
        if participant.access_point_type is not None:
            attributes["NetworkAccessPointTypeCode"] = str(participant.access_point_type)
    element = ET.SubElement(root, "ActiveParticipant", attributes)
    for role in participant.roles:
        ET.SubElement(element, "RoleIDCode", role.attributes())


def _source(root: ET.Element, source: AuditSource) -> None:
    attributes = {}
    if source.enterprise_site:
        attributes["AuditEnterpriseSiteID"] = clean(source.enterprise_site)
    attributes["AuditSourceID"] = clean(source.source_id)
    element = ET.SubElement(root, "AuditSourceIdentification", attributes)
    ET.SubElement(element, "AuditSourceTypeCode", {"csd-code": source.type_code})


def _object(root: ET.Element, obj: ParticipantObject) -> None:
    attributes = {"ParticipantObjectID": clean(obj.object_id)}
    if obj.type_code is not None:
        attributes["ParticipantObjectTypeCode"] = str(obj.type_code)
    if obj.role is not None:
        attributes["ParticipantObjectTypeCodeRole"] = str(obj.role)
    element = ET.SubElement(root, "ParticipantObjectIdentification", attributes)
    ET.SubElement(element, "ParticipantObjectIDTypeCode", obj.id_type.attributes())
    ET.SubElement(element, "ParticipantObjectName").text = clean(obj.name)
    for kind, value in obj.details:
        encoded = base64.b64encode(value.encode("utf-8")).decode("ascii")
        ET.SubElement(element, "ParticipantObjectDetail", {"type": clean(kind), "value": encoded})
    if obj.sop_classes:
        description = ET.SubElement(element, "ParticipantObjectDescription")
        for sop_class in obj.sop_classes:
            ET.SubElement(
                description,
                "SOPClass",
                {"UID": clean(sop_class.uid), "NumberOfInstances": str(sop_class.instances)},
            )


@dataclass(frozen=True)
class NodeIdentity:
    """This node as the audit messages name it.

    As an active participant (A.5.2.1-A.5.2.3) its UserID is ``process_id`` (an identifier
    of the node's own logs), its AlternativeUserID ``AETITLES=<ae_title>``, its UserName
    ``process_name``, and its network access point ``address`` when that is an IP address,
    else ``host_name`` (one choice for every message, A.5.2.4). As the audit source its
    AuditSourceID is ``source_id`` (``host_name`` when empty), with ``enterprise_site`` and
    type code 4, application server process (A.5.1.2.1).
    """

    ae_title: str
    host_name: str
    address: str
    process_id: str
    source_id: str
    enterprise_site: str | None
    process_name: str = "segnode"

    def __post_init__(self) -> None:
        if not self.ae_title.strip():
            raise ValueError("the node's AE title must not be empty")
        if not (self.source_id.strip() or self.host_name.strip()):
            raise ValueError("the audit source needs a source_id or a host_name")

    @property
    def access_point(self) -> tuple[str, int]:
        """The node's network access point: ID and type code."""
        found = access_point(self.address)
        return found if found[1] == IP_ADDRESS else access_point(self.host_name)

    def participant(self, *, requestor: bool, roles: tuple[Code, ...] = ()) -> ActiveParticipant:
        """The node as an ``ActiveParticipant``."""
        point, kind = self.access_point
        return ActiveParticipant(
            user_id=self.process_id,
            requestor=requestor,
            roles=roles,
            alternative_user_id=f"AETITLES={self.ae_title}",
            user_name=self.process_name,
            access_point=point,
            access_point_type=kind,
        )

    def audit_source(self) -> AuditSource:
        """The node as ``AuditSourceIdentification``."""
        return AuditSource(
            source_id=self.source_id.strip() or self.host_name,
            enterprise_site=self.enterprise_site or None,
        )


def _now() -> datetime:
    return datetime.now(UTC)


def _peer(
    ae_title: str, address: str, *, requestor: bool, roles: tuple[Code, ...]
) -> ActiveParticipant:
    point, kind = access_point(address)
    return ActiveParticipant(
        user_id=ae_title,
        requestor=requestor,
        roles=roles,
        alternative_user_id=f"AETITLES={ae_title}",
        access_point=point,
        access_point_type=kind,
    )


def _patient(patient_id: str, patient_name: str | None) -> ParticipantObject:
    # The schema requires a ParticipantObjectName; without the patient's name the patient ID
    # (already the object's ID) stands in, so that nothing more is disclosed.
    return ParticipantObject(
        object_id=patient_id,
        id_type=PATIENT_NUMBER,
        name=patient_name if patient_name else patient_id,
        type_code=PERSON,
        role=ROLE_PATIENT,
    )


def _study(study_uid: str, sop_classes: Mapping[str, int]) -> ParticipantObject:
    return ParticipantObject(
        object_id=study_uid,
        id_type=STUDY_INSTANCE_UID,
        name=study_uid,
        type_code=SYSTEM_OBJECT,
        role=ROLE_REPORT,
        sop_classes=tuple(SOPClassCount(uid, int(n)) for uid, n in sorted(sop_classes.items())),
    )


def application_activity(
    node: NodeIdentity, *, started: bool, user: str | None = None
) -> AuditMessage:
    """Application Activity (PS3.15 A.5.3.1): the node started or stopped.

    ``user``, when known, is the person or process that started or stopped it (role
    Application Launcher) and the requestor.
    """
    participants = [node.participant(requestor=False, roles=(ROLE_APPLICATION,))]
    if user is not None:
        participants.append(
            ActiveParticipant(user_id=user, requestor=True, roles=(ROLE_APPLICATION_LAUNCHER,))
        )
    return AuditMessage(
        event=EventIdentification(
            event_id=APPLICATION_ACTIVITY,
            action="E",
            outcome=SUCCESS,
            when=_now(),
            types=(APPLICATION_START if started else APPLICATION_STOP,),
        ),
        participants=tuple(participants),
        source=node.audit_source(),
    )


def association_refused(
    node: NodeIdentity, *, calling_ae: str, address: str, reason: str
) -> AuditMessage:
    """Security Alert (A.5.3.11) of type Node Authentication, minor failure: an association
    was refused. The peer is a performing participant with its address; it is also the alert's
    subject (Node ID) with ``reason`` as its "Alert Description"."""
    return AuditMessage(
        event=EventIdentification(
            event_id=SECURITY_ALERT,
            action="E",
            outcome=MINOR_FAILURE,
            when=_now(),
            types=(NODE_AUTHENTICATION,),
            description=reason,
        ),
        participants=(
            node.participant(requestor=False),
            _peer(calling_ae, address, requestor=False, roles=()),
        ),
        source=node.audit_source(),
        objects=(
            ParticipantObject(
                object_id=address,
                id_type=NODE_ID,
                name=calling_ae,
                type_code=SYSTEM_OBJECT,
                details=(("Alert Description", reason),),
            ),
        ),
    )


def instances_transferred(
    node: NodeIdentity,
    *,
    direction: Literal["in", "out"],
    peer_ae: str,
    peer_address: str,
    patient_id: str,
    patient_name: str | None,
    study_uid: str,
    sop_classes: Mapping[str, int],
    outcome: int = SUCCESS,
    description: str | None = None,
) -> AuditMessage:
    """DICOM Instances Transferred (A.5.3.7), one study of one patient.

    ``direction="in"``: the node received (EventActionCode C); the peer is the source and the
    requestor, the node the destination. ``"out"``: the node sent (R, since the audit source is
    not the receiver); the node is the source and the requestor, the peer the destination.
    """
    if direction == "in":
        action = "C"
        peer = _peer(peer_ae, peer_address, requestor=True, roles=(ROLE_SOURCE,))
        own = node.participant(requestor=False, roles=(ROLE_DESTINATION,))
        participants = (peer, own)
    elif direction == "out":
        action = "R"
        own = node.participant(requestor=True, roles=(ROLE_SOURCE,))
        peer = _peer(peer_ae, peer_address, requestor=False, roles=(ROLE_DESTINATION,))
        participants = (own, peer)
    else:
        raise ValueError(f"direction must be 'in' or 'out', not {direction!r}")
    return AuditMessage(
        event=EventIdentification(
            event_id=INSTANCES_TRANSFERRED,
            action=action,
            outcome=outcome,
            when=_now(),
            description=description,
        ),
        participants=participants,
        source=node.audit_source(),
        objects=(_study(study_uid, sop_classes), _patient(patient_id, patient_name)),
    )


def study_deleted(
    node: NodeIdentity,
    *,
    patient_id: str,
    patient_name: str | None,
    study_uid: str,
    sop_classes: Mapping[str, int],
    reason: str,
) -> AuditMessage:
    """DICOM Study Deleted (A.5.3.8): the node deleted a study; ``reason`` is the outcome
    description."""
    return AuditMessage(
        event=EventIdentification(
            event_id=STUDY_DELETED, action="D", outcome=SUCCESS, when=_now(), description=reason
        ),
        participants=(node.participant(requestor=True),),
        source=node.audit_source(),
        objects=(_study(study_uid, sop_classes), _patient(patient_id, patient_name)),
    )


def user_authentication(
    node: NodeIdentity, *, user: str, address: str, success: bool, description: str
) -> AuditMessage:
    """User Authentication (A.5.3.12), type Login: ``user`` (the requestor, at ``address``)
    tried to log in; the node performed the authentication."""
    point, kind = access_point(address)
    return AuditMessage(
        event=EventIdentification(
            event_id=USER_AUTHENTICATION,
            action="E",
            outcome=SUCCESS if success else MINOR_FAILURE,
            when=_now(),
            types=(LOGIN,),
            description=description,
        ),
        participants=(
            ActiveParticipant(
                user_id=user, requestor=True, access_point=point, access_point_type=kind
            ),
            node.participant(requestor=False),
        ),
        source=node.audit_source(),
    )


def security_alert(
    node: NodeIdentity,
    *,
    kind: str,
    user: str | None,
    address: str | None,
    description: str,
    outcome: int = SUCCESS,
) -> AuditMessage:
    """Security Alert (A.5.3.11) of ``kind``: ``software_configuration`` (110131),
    ``security_configuration`` (110129), ``restricted_function`` (110132) or
    ``node_authentication`` (110126).

    The node reports; ``user`` (at ``address``), when given, is a performing participant. The
    alert's subject is a Node ID: the peer at ``address`` for ``node_authentication``, else
    this node; ``description`` is its "Alert Description" and the outcome description.
    """
    try:
        type_code = SECURITY_ALERT_KINDS[kind]
    except KeyError:
        raise ValueError(
            f"security alert kind must be one of {sorted(SECURITY_ALERT_KINDS)}, not {kind!r}"
        ) from None
    participants = [node.participant(requestor=False)]
    if user is not None:
        point, point_type = access_point(address) if address else (None, None)
        participants.append(
            ActiveParticipant(
                user_id=user, requestor=False, access_point=point, access_point_type=point_type
            )
        )
    if kind == "node_authentication" and address:
        subject, subject_name = address, address
    else:
        subject, subject_name = node.access_point[0], node.host_name or node.access_point[0]
    return AuditMessage(
        event=EventIdentification(
            event_id=SECURITY_ALERT,
            action="E",
            outcome=outcome,
            when=_now(),
            types=(type_code,),
            description=description,
        ),
        participants=tuple(participants),
        source=node.audit_source(),
        objects=(
            ParticipantObject(
                object_id=subject,
                id_type=NODE_ID,
                name=subject_name,
                type_code=SYSTEM_OBJECT,
                details=(("Alert Description", description),),
            ),
        ),
    )


__all__ = [
    "MAJOR_FAILURE",
    "MINOR_FAILURE",
    "SERIOUS_FAILURE",
    "SUCCESS",
    "ActiveParticipant",
    "AuditMessage",
    "AuditSource",
    "Code",
    "EventIdentification",
    "NodeIdentity",
    "ParticipantObject",
    "SOPClassCount",
    "application_activity",
    "association_refused",
    "clean",
    "instances_transferred",
    "security_alert",
    "study_deleted",
    "user_authentication",
]
