"""IHE IOCM rejection notes: withdrawing results a newer version of the series replaced.

When instances arrive for a series whose results were already delivered (a late instance, a
resend), the node makes a new version with new results. A PACS that supports IHE Imaging
Object Change Management (IOCM) hides objects named in a *rejection note*: a Key Object
Selection Document whose title is (113001, DCM, "Rejected for Quality Reasons") and that
references them (IHE RAD TF-3 §4.66, PS3.16 CID 7011). The node sends one, after the new
SEG and SR, to each destination with ``reject_superseded = true`` that received the old ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import highdicom as hd
from pydicom import dcmread
from pydicom.dataset import Dataset
from pydicom.sr.coding import Code

#: CID 7011 "Rejected for Quality Reasons".
REJECTED_FOR_QUALITY_REASONS = Code("113001", "DCM", "Rejected for Quality Reasons")
KOS_SOP_CLASS = "1.2.840.10008.5.1.4.1.1.88.59"


def build_rejection_note(
    superseded: Sequence[Path],
    *,
    series_instance_uid: str,
    sop_instance_uid: str,
    manufacturer: str = "segnode",
    description: str = "results superseded by a newer version of the series",
) -> Dataset:
    """A KOS rejection note referencing the result files ``superseded`` (same study).

    Raises
    ------
    ValueError
        If no file is given or they are not of one study.
    """
    if not superseded:
        raise ValueError("a rejection note needs at least one object to reject")
    evidence = [dcmread(p, stop_before_pixels=True) for p in superseded]
    studies = {str(ds.StudyInstanceUID) for ds in evidence}
    if len(studies) != 1:
        raise ValueError(f"objects of {len(studies)} studies cannot share one rejection note")
    content = hd.ko.KeyObjectSelection(
        document_title=REJECTED_FOR_QUALITY_REASONS,
        referenced_objects=evidence,
        description=description,
    )
    return hd.ko.KeyObjectSelectionDocument(
        evidence=evidence,
        content=content,
        series_instance_uid=series_instance_uid,
        series_number=9001,
        sop_instance_uid=sop_instance_uid,
        instance_number=1,
        manufacturer=manufacturer,
    )


def rejected_uids(note: Dataset) -> set[str]:
    """SOP Instance UIDs a rejection note references (its Current Requested Procedure
    Evidence)."""
    return {
        str(i.ReferencedSOPInstanceUID)
        for study in note.CurrentRequestedProcedureEvidenceSequence
        for series in study.ReferencedSeriesSequence
        for i in series.ReferencedSOPSequence
    }
