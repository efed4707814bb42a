"""The acceptor's answer to an A-ASSOCIATE-RQ: the presentation contexts and roles it
accepts, in an A-ASSOCIATE-AC.

Negotiation itself is pynetdicom's ``negotiate_as_acceptor`` (PS3.8 §9.3.3, PS3.7 D.3.3.4
for roles) against the node's supported contexts; this module reads the request's user
information (Maximum Length, SCP/SCU Role Selection) and builds the A-ASSOCIATE-AC with the
node's own Maximum Length, Implementation Class UID and Version Name.

Must not touch: sockets, the association's state or the acceptor; a pure function of the
request, the supported contexts and the node's maximum PDU size.
"""

from __future__ import annotations

from pydicom.uid import UID
from pynetdicom.pdu import A_ASSOCIATE_AC
from pynetdicom.pdu_primitives import (
    A_ASSOCIATE,
    ImplementationClassUIDNotification,
    ImplementationVersionNameNotification,
    MaximumLengthNotification,
    SCP_SCU_RoleSelectionNegotiation,
)
from pynetdicom.presentation import PresentationContext, negotiate_as_acceptor

from segnode.node.dicom.ul_pdu import (
    APPLICATION_CONTEXT_NAME,
    IMPLEMENTATION_CLASS_UID,
    IMPLEMENTATION_VERSION,
)


def accept_pdu(
    rq: A_ASSOCIATE, supported: list[PresentationContext], max_pdu: int
) -> tuple[bytes, int, dict[int, tuple[str, str]]]:
    """The A-ASSOCIATE-AC answering ``rq``.

    Returns
    -------
    pdu
        The encoded A-ASSOCIATE-AC.
    max_send_pdu
        The requestor's Maximum Length Received (0: unlimited), the largest P-DATA-TF to
        send it.
    contexts
        The accepted presentation contexts: context ID -> (abstract syntax, transfer
        syntax).
    """
    max_length = 0
    roles: dict[UID, tuple[bool | None, bool | None]] = {}
    for item in rq.user_information:
        if isinstance(item, MaximumLengthNotification):
            max_length = int(item.maximum_length_received or 0)
        elif isinstance(item, SCP_SCU_RoleSelectionNegotiation) and item.sop_class_uid:
            roles[UID(item.sop_class_uid)] = (item.scu_role, item.scp_role)
    results, role_items = negotiate_as_acceptor(
        rq.presentation_context_definition_list, supported, roles
    )
    contexts: dict[int, tuple[str, str]] = {}
    for cx in results:
        if cx.result == 0x00 and cx.context_id is not None:
            contexts[int(cx.context_id)] = (str(cx.abstract_syntax), str(cx.transfer_syntax[0]))
    ac = A_ASSOCIATE()
    ac.application_context_name = UID(APPLICATION_CONTEXT_NAME)
    ac.calling_ae_title = rq.calling_ae_title
    ac.called_ae_title = rq.called_ae_title
    ac.result = 0x00
    ac.result_source = 0x01
    ac.presentation_context_definition_results_list = results
    length = MaximumLengthNotification()
    length.maximum_length_received = max_pdu
    impl = ImplementationClassUIDNotification()
    impl.implementation_class_uid = UID(IMPLEMENTATION_CLASS_UID)
    version = ImplementationVersionNameNotification()
    version.implementation_version_name = IMPLEMENTATION_VERSION
    ac.user_information = [length, impl, version, *role_items]
    out = A_ASSOCIATE_AC()
    out.from_primitive(ac)
    return bytes(out.encode()), max_length, contexts
