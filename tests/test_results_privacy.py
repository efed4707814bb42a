"""No patient data in the output of the results encoders (README, docs/operations.md).

The SEG and SR are encoded in a fresh interpreter, as in the node: its logging at DEBUG to
stdout (the node's format) and Python's default warning filters, which print to stderr (the
journal). pytest's own warning capture would hide what that interpreter prints, so the run
is a subprocess writing to this test's file descriptors, read with ``capfd``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# A single-component name (valid DICOM, PS3.5 6.2.1.2): highdicom warns with it in the text.
SECRET_NAME, SECRET_ID = "ZZHEADSECRET", "PIDSECRET42"

SCRIPT = f"""
import io, logging, sys
import pydicom
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout,
                    format="%(asctime)s %(levelname)s %(name)s: %(message)s")
from segnode.node.ingest.volume import assemble_from_datasets
from segnode.node.results.build import build_seg, build_sr, segment_statistics
from segnode.node.results.seg_encode import SegPlan
from segnode.node.results.sr_encode import SrPlan
from tests.fixtures.synthetic import phantom_labels, synthetic_datasets
from tests.test_results import MANIFEST, SEG_EQUIPMENT, SMALL, SR_EQUIPMENT, UIDS

datasets = []
for ds in synthetic_datasets(SMALL, patient_id={SECRET_ID!r}):
    ds.PatientName = {SECRET_NAME!r}
    buffer = io.BytesIO()
    pydicom.dcmwrite(buffer, ds, enforce_file_format=True)
    datasets.append(pydicom.dcmread(io.BytesIO(buffer.getvalue())))
volume = assemble_from_datasets(datasets)
labels = phantom_labels(*volume.shape[1:], volume.shape[0])
for kind in ("BINARY", "LABELMAP"):
    seg = SegPlan.prepare(volume, MANIFEST, UIDS, segmentation_type=kind, equipment=SEG_EQUIPMENT)
    seg.encode(labels)
    sr = SrPlan.prepare(volume, seg, equipment=SR_EQUIPMENT)
    sr.encode(segment_statistics(volume, labels, MANIFEST))
seg = build_seg(volume, labels, MANIFEST, UIDS, equipment=SEG_EQUIPMENT)
sr = build_sr(volume, labels, MANIFEST, seg, UIDS, equipment=SR_EQUIPMENT)
assert str(sr.PatientName) == {SECRET_NAME!r}
print("encoded", flush=True)
"""


def test_no_patient_data_on_stdout_or_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "default"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, timeout=300)
    out, err = capfd.readouterr()
    assert done.returncode == 0, err
    assert "encoded" in out and "DEBUG segnode.node.results.build: SEG" in out  # it ran, logging
    for word in (SECRET_NAME, SECRET_ID):
        assert word not in out, f"{word!r} on stdout (the log)"
        assert word not in err, f"{word!r} on stderr (the journal): {err[-2000:]}"
