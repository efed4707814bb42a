"""IHE ATNA audit logging: DICOM audit messages (PS3.15 A.5) recorded durably and sent to
audit repositories by syslog over TLS or UDP, or written to a local file (IHE ITI-20).

The node's modules build a message with a builder of :mod:`segnode.node.audit.messages` and
hand it to the :class:`Auditor` (or the :class:`NullAuditor` when audit is off).
"""

from segnode.node.audit.auditor import Auditor, AuditSettings, NullAuditor, make_auditor
from segnode.node.audit.messages import (
    AuditMessage,
    NodeIdentity,
    application_activity,
    association_refused,
    instances_transferred,
    security_alert,
    study_deleted,
    user_authentication,
)
from segnode.node.audit.syslog import parse_destination

__all__ = [
    "AuditMessage",
    "AuditSettings",
    "Auditor",
    "NodeIdentity",
    "NullAuditor",
    "application_activity",
    "association_refused",
    "instances_transferred",
    "make_auditor",
    "parse_destination",
    "security_alert",
    "study_deleted",
    "user_authentication",
]
