"""A 117-structure SEG is small and every reader we test reads it (issue 34).

The label map is :func:`bench.seg_size.blob_labels` (blobs with the sizes and shapes of
TotalSegmentator's structures) on a volume scaled down from the bench's 512 x 512 x 300 to
128 x 128 x 40 for speed. The node's default, a BINARY SEG in Deflated Explicit VR Little
Endian, must come back exactly as the label map from highdicom, dcmqi's ``segimage2itkimage``
and pydicom-seg (which needs numpy < 2 and pydicom < 3, so it runs in a virtual environment of
its own, installed into the tool cache on first use); tests/test_seg_dcmjs.py does the same for
the web viewers' readers. LABELMAP (Label Map Segmentation Storage) is read by highdicom, dcmqi
and Cornerstone, not by pydicom-seg nor dcmjs: that is why it is not the default.

The outbox proposes the deflated transfer syntax for the SEG and inflates it for a destination
that does not accept it: a pynetdicom SCP that takes Explicit VR Little Endian only gets the
uncompressed data set, one that takes deflate the file's bytes, and Orthanc stores the deflated
SEG as it came.
"""

from __future__ import annotations

import dataclasses
import datetime
import http.server
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.request
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import highdicom as hd
import numpy as np
import numpy.typing as npt
import pydicom
import pytest
from pydicom.uid import (
    DeflatedExplicitVRLittleEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
)

import segnode.node.results.seg_deflate as seg_deflate
from bench.seg_size import blob_labels, blob_manifest, blob_volume
from segnode.node.config import ConfigError, from_dict
from segnode.node.ingest.volume import Volume
from segnode.node.outbox.encoding import proposed_contexts
from segnode.node.outbox.scu import Dispatcher
from segnode.node.results.build import Equipment, ResultError, ResultUIDs, seg_label_map
from segnode.node.results.seg_check import check_encoded
from segnode.node.results.seg_deflate import inflate
from segnode.node.results.seg_encode import EncodedSeg, SegPlan
from segnode.storage.ledger import Ledger
from tests.conftest import LOOPBACK, start_orthanc
from tests.node.harness import cache_root
from tests.test_outbox import encoded_job, outbox_config
from tests.test_outbox_bytes import WireSCP, dataset_bytes, result_paths

SHAPE = (40, 128, 128)
CREATED = datetime.datetime(2026, 12, 6, 12, 0, 0)
UIDS = ResultUIDs("2.25.3401", "2.25.3402", "2.25.3403", "2.25.3404")
KINDS = ("BINARY", "LABELMAP")
#: pydicom-seg 0.4.1 (the last release) with the versions it runs with
PYDICOM_SEG = ("pydicom-seg==0.4.1", "pydicom==2.4.4", "numpy==1.26.4", "SimpleITK==2.5.2")


@dataclasses.dataclass(frozen=True)
class Blobs:
    volume: Volume
    labels: npt.NDArray[np.uint8]


@pytest.fixture(scope="module")
def blobs() -> Blobs:
    volume = blob_volume(SHAPE)
    return Blobs(volume, blob_labels(SHAPE))


def encode(
    blobs: Blobs,
    kind: str = "BINARY",
    syntax: str = DeflatedExplicitVRLittleEndian,
    uids: ResultUIDs = UIDS,
) -> tuple[SegPlan, EncodedSeg]:
    plan = SegPlan.prepare(
        blobs.volume,
        blob_manifest(),
        uids,
        segmentation_type=kind,
        transfer_syntax=syntax,
        equipment=Equipment.for_seg("test"),
        created=CREATED,
    )
    encoded = plan.encode(blobs.labels)
    check_encoded(plan, encoded, blobs.labels)
    return plan, encoded


def numbered(labels: npt.NDArray[np.integer], encoded: EncodedSeg) -> npt.NDArray[np.uint16]:
    """``labels`` as the SEG's segment numbers."""
    lut = np.zeros(256, dtype=np.uint16)
    for value, number in encoded.segment_numbers.items():
        lut[value] = number
    out: npt.NDArray[np.uint16] = lut[labels]
    return out


def require(what: str) -> None:
    """Skip for a missing reader; fail instead where CI requires every tool."""
    if os.environ.get("SEGNODE_REQUIRE_TOOLS"):
        pytest.fail(what)
    pytest.skip(what)


# ------------------------------------------------------------------------ size and check


def test_blobs_hold_117_structures_of_realistic_sizes(blobs: Blobs) -> None:
    counts = np.bincount(blobs.labels.ravel(), minlength=118)[1:]
    assert len(counts) == 117 and np.all(counts > 0)
    assert counts.max() > 100 * counts.min()  # organs and muscles against glands and ribs
    assert 0.05 < np.count_nonzero(blobs.labels) / blobs.labels.size < 0.5


def test_the_default_is_a_deflated_binary_seg() -> None:
    results = from_dict({}).results
    assert results.segmentation_type == "BINARY"
    assert results.seg_transfer_syntax == "deflated"
    assert results.seg_transfer_syntax_uid == DeflatedExplicitVRLittleEndian
    explicit = from_dict({"results": {"seg_transfer_syntax": "explicit"}}).results
    assert explicit.seg_transfer_syntax_uid == ExplicitVRLittleEndian
    with pytest.raises(ConfigError, match="results.seg_transfer_syntax"):
        from_dict({"results": {"seg_transfer_syntax": "jpeg"}})


@pytest.mark.parametrize("kind", KINDS)
def test_deflated_seg_is_the_explicit_one_deflated(blobs: Blobs, kind: str) -> None:
    """The deflated file's data set inflates to the uncompressed file's, byte for byte; the
    file meta differs in the Transfer Syntax UID only; the file is much smaller."""
    plain_plan, plain = encode(blobs, kind, ExplicitVRLittleEndian)
    deflated_plan, deflated = encode(blobs, kind)
    assert deflated.deflated and not plain.deflated
    assert inflate(dataset_bytes(deflated.data)) == dataset_bytes(plain.data)
    assert deflated.plain == dataset_bytes(plain.data)
    assert len(dataset_bytes(deflated.data)) % 2 == 0
    meta = pydicom.dcmread(io.BytesIO(deflated.data), stop_before_pixels=True).file_meta
    assert meta.TransferSyntaxUID == DeflatedExplicitVRLittleEndian
    assert deflated_plan.explicit_meta == plain_plan.file_meta
    assert len(deflated.data) * (20 if kind == "BINARY" else 5) < len(plain.data)
    # pydicom reads it; without the plain data set the check inflates
    ds = pydicom.dcmread(io.BytesIO(deflated.data))
    assert int(ds.NumberOfFrames) == deflated.number_of_frames
    check_encoded(deflated_plan, dataclasses.replace(deflated, plain=None), blobs.labels)


def test_check_catches_a_bad_splice_of_deflate_blocks(
    blobs: Blobs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 64 KiB: the check rejects blocks out of order, a block whose start does not
    inflate to its place, a stream cut short or with bytes after it, a data set that is not
    the one deflated."""
    monkeypatch.setattr(seg_deflate, "MIN_BLOCK", 1 << 16)
    plan, encoded = encode(blobs)
    assert len(encoded.deflate_blocks) > 4
    meta = len(plan.file_meta)
    stream = encoded.data[meta:]
    starts = [packed for _, packed in encoded.deflate_blocks]
    one, two = (starts[1], starts[2]), (starts[2], starts[3])

    def rejected(data: bytes, match: str, **changes: Any) -> None:
        bad = dataclasses.replace(encoded, data=data, **changes)
        with pytest.raises(ResultError, match=match):
            check_encoded(plan, bad, blobs.labels)

    swapped = (
        stream[: one[0]] + stream[two[0] : two[1]] + stream[one[0] : one[1]] + stream[two[1] :]
    )
    if two[1] - two[0] != one[1] - one[0]:  # the recorded starts no longer fit
        rejected(encoded.data[:meta] + swapped, "deflate block")
    data = bytearray(encoded.data)
    data[meta + starts[3] + 1] ^= 0x55
    rejected(bytes(data), "deflate block 3")
    rejected(encoded.data[:-2], "last deflate block|odd length")
    rejected(encoded.data + b"\x00\x01", "last deflate block")
    plain = bytearray(encoded.plain or b"")
    plain[-3] ^= 0x01
    rejected(encoded.data, "last deflate block", plain=bytes(plain))
    rejected(encoded.data, "do not start", deflate_blocks=encoded.deflate_blocks[1:])


def test_check_of_the_deflated_seg_still_checks_the_frames(blobs: Blobs) -> None:
    plan, encoded = encode(blobs)
    changed = blobs.labels.copy()
    z, y, x = (int(v[0]) for v in np.nonzero(changed == 7))
    changed[z, y, x] = 8
    with pytest.raises(ResultError, match=rf"voxels differ, first at \(z, y, x\) = \({z}, "):
        check_encoded(plan, encoded, changed)


# ---------------------------------------------------------------------- readers: python


@pytest.mark.parametrize("kind", KINDS)
def test_highdicom_reads_the_deflated_seg(blobs: Blobs, kind: str, tmp_path: Path) -> None:
    _, encoded = encode(blobs, kind)
    path = tmp_path / "seg.dcm"
    path.write_bytes(encoded.data)
    found = seg_label_map(hd.seg.segread(path), blobs.volume)
    assert np.array_equal(found, numbered(blobs.labels, encoded))


def segimage2itkimage() -> str:
    tool = shutil.which("segimage2itkimage") or str(
        Path(sys.executable).parent / "segimage2itkimage"
    )
    if not Path(tool).is_file():
        require("dcmqi is not installed (pip install -e '.[test]')")
    return tool


@pytest.mark.parametrize("kind", KINDS)
def test_dcmqi_reads_the_deflated_seg(blobs: Blobs, kind: str, tmp_path: Path) -> None:
    """dcmqi writes one image per BINARY segment (one label image for LABELMAP) on the
    CT's grid; each slice of it, put back at the volume slice of its position, gives the
    label map."""
    sitk = pytest.importorskip("SimpleITK", reason="SimpleITK is not installed")
    _, encoded = encode(blobs, kind)
    seg, out = tmp_path / "seg.dcm", tmp_path / "itk"
    seg.write_bytes(encoded.data)
    out.mkdir()
    command = [segimage2itkimage(), "--inputDICOM", str(seg), "--outputDirectory", str(out)]
    proc = subprocess.run([*command, "-t", "nrrd"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    positions = np.array(blobs.volume.slice_positions)
    rebuilt = np.zeros(blobs.labels.shape, dtype=np.uint16)
    images = sorted(out.glob("*.nrrd"), key=lambda p: int(p.stem))
    assert len(images) == (1 if kind == "LABELMAP" else len(encoded.segment_numbers))
    for path in images:
        image = sitk.ReadImage(str(path))
        array = sitk.GetArrayFromImage(image)
        for k in range(array.shape[0]):
            where = np.array(image.TransformIndexToPhysicalPoint((0, 0, k)))
            z = int(np.argmin(np.linalg.norm(positions - where, axis=1)))
            assert np.linalg.norm(positions[z] - where) < 1e-3
            mask = array[k] != 0
            rebuilt[z][mask] = array[k][mask] if kind == "LABELMAP" else int(path.stem)
    assert np.array_equal(rebuilt, numbered(blobs.labels, encoded))


def pydicom_seg_python() -> Path:
    """The Python of a virtual environment with pydicom-seg (in the tool cache, made on
    first use: pydicom-seg pins numpy < 2 and imports a module pydicom 3 removed, so it
    cannot share the node's environment)."""
    venv = cache_root() / "pydicom-seg-0.4.1"
    python = venv / "bin" / "python"
    if not (venv / ".installed").exists():
        try:
            subprocess.run(
                [sys.executable, "-m", "venv", "--clear", str(venv)],
                capture_output=True,
                check=True,
                timeout=120,
            )
            proc = subprocess.run(
                [str(python), "-m", "pip", "install", "-q", *PYDICOM_SEG],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            require(f"cannot make a virtual environment for pydicom-seg: {exc}")
        if proc.returncode != 0:
            require(f"cannot install pydicom-seg (is PyPI reachable?): {proc.stderr[-500:]}")
        (venv / ".installed").write_text("ok\n")
    return python


PYDICOM_SEG_READ = """
import json, sys
import numpy as np, pydicom, pydicom_seg
try:
    result = pydicom_seg.SegmentReader().read(pydicom.dcmread(sys.argv[1]))
except ValueError as exc:
    print(json.dumps({"error": str(exc)}))
    raise SystemExit(0)
np.save(sys.argv[2], np.stack([result.segment_data(n) for n in sorted(result.available_segments)]))
print(json.dumps({"segments": sorted(int(n) for n in result.available_segments)}))
"""


@pytest.mark.parametrize("kind", KINDS)
def test_pydicom_seg_reads_the_deflated_binary_seg(blobs: Blobs, kind: str, tmp_path: Path) -> None:
    """pydicom-seg's SegmentReader: each segment's mask (its frames placed by position, in
    the order of the source slices along the normal) is the label map's; it refuses a
    LABELMAP SEG ("not a DICOM-SEG storage")."""
    python = pydicom_seg_python()
    _, encoded = encode(blobs, kind)
    seg, masks = tmp_path / "seg.dcm", tmp_path / "masks.npy"
    seg.write_bytes(encoded.data)
    proc = subprocess.run(
        [str(python), "-c", PYDICOM_SEG_READ, str(seg), str(masks)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if kind == "LABELMAP":
        assert "not a DICOM-SEG" in report["error"]
        return
    numbers = numbered(blobs.labels, encoded)
    assert report["segments"] == sorted(encoded.segment_numbers.values())
    stack = np.load(masks)
    # pydicom-seg stacks the frames from the lowest position along the normal
    order = np.argsort(np.array(blobs.volume.slice_positions)[:, 2])
    for i, number in enumerate(report["segments"]):
        assert np.array_equal(stack[i].astype(bool), (numbers == number)[order]), number


# ----------------------------------------------------------------------------- sending


def deflated_job(ledger: Ledger, tmp_path: Path, blobs: Blobs, peer: str) -> tuple[int, Path]:
    """An encoded job whose SEG file is the deflated SEG of the blobs."""
    job_id = encoded_job(ledger, tmp_path, [peer])
    view = ledger.job(job_id)
    assert view is not None
    uids = ResultUIDs(view.seg_series_uid, view.seg_sop_uid, view.sr_series_uid, view.sr_sop_uid)
    _, encoded = encode(blobs, uids=uids)
    seg = result_paths(ledger, job_id)[0]
    seg.write_bytes(encoded.data)
    return job_id, seg


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(tmp_path / "ledger.sqlite")
    yield led
    led.close()


@pytest.mark.parametrize(
    "accepted",
    [
        (DeflatedExplicitVRLittleEndian, ExplicitVRLittleEndian),
        (ExplicitVRLittleEndian,),
        (ImplicitVRLittleEndian,),
    ],
    ids=["deflate", "explicit-only", "implicit-only"],
)
def test_outbox_sends_deflated_or_falls_back(
    tmp_path: Path, ledger: Ledger, blobs: Blobs, accepted: tuple[str, ...]
) -> None:
    """A pynetdicom SCP on loopback: one that accepts deflate gets the file's data set as it
    is; one that takes Explicit VR Little Endian only gets it inflated (the uncompressed
    SEG's data set, byte for byte); one that takes Implicit only a re-encoded copy."""
    scp = WireSCP(syntaxes=accepted)
    try:
        job_id, seg = deflated_job(ledger, tmp_path, blobs, scp.peer)
        d = Dispatcher(outbox_config(tmp_path, [scp.peer], keep_open_s=0), ledger)
        assert d.run_once() == 2
        d.stop()
    finally:
        scp.stop()
    assert ledger.job_state(job_id) == "sent"
    uid, raw, syntax = scp.received[0]
    assert syntax == accepted[0] and uid == pydicom.dcmread(seg).SOPInstanceUID
    stored = dataset_bytes(seg)
    if syntax == DeflatedExplicitVRLittleEndian:
        assert raw == stored
    elif syntax == ExplicitVRLittleEndian:
        assert raw == inflate(stored)
    else:
        ds = pydicom.dcmread(io.BytesIO(raw), force=True)  # Implicit VR, no file meta
        assert ds.PixelData == pydicom.dcmread(seg).PixelData


def test_explicit_setting_does_not_propose_deflate() -> None:
    deflated = [ts for _, syntaxes in proposed_contexts() for ts in syntaxes]
    explicit = [ts for _, syntaxes in proposed_contexts(deflated_seg=False) for ts in syntaxes]
    assert deflated.count(DeflatedExplicitVRLittleEndian) == 2  # both Segmentation classes
    assert DeflatedExplicitVRLittleEndian not in explicit
    assert len(proposed_contexts()) <= 128


def test_orthanc_stores_the_deflated_seg_as_sent(
    tmp_path: Path, ledger: Ledger, blobs: Blobs
) -> None:
    """Orthanc accepts Deflated Explicit VR Little Endian for the SEG and keeps the file as
    it came; its copy reads back to the label map."""
    orthanc = start_orthanc(tmp_path / "orthanc")
    try:
        job_id, seg = deflated_job(ledger, tmp_path, blobs, orthanc.peer)
        d = Dispatcher(outbox_config(tmp_path, [orthanc.peer], keep_open_s=0), ledger)
        assert d.run_once() == 2
        d.stop()
        assert ledger.job_state(job_id) == "sent"
        uid = pydicom.dcmread(seg, stop_before_pixels=True).SOPInstanceUID
        lookup = urllib.request.Request(
            f"http://{LOOPBACK}:{orthanc.http_port}/tools/lookup", data=uid.encode()
        )
        with urllib.request.urlopen(lookup, timeout=10) as r:
            (hit,) = json.loads(r.read())
        copy = orthanc.get_bytes(f"/instances/{hit['ID']}/file")
    finally:
        orthanc.stop()
    meta = pydicom.dcmread(io.BytesIO(copy), stop_before_pixels=True).file_meta
    assert meta.TransferSyntaxUID == DeflatedExplicitVRLittleEndian
    assert zlib.decompressobj(-zlib.MAX_WBITS).decompress(dataset_bytes(copy)) == inflate(
        dataset_bytes(seg)
    )
    path = tmp_path / "copy.dcm"
    path.write_bytes(copy)
    found = seg_label_map(hd.seg.segread(path), blobs.volume)
    assert np.array_equal(found > 0, blobs.labels > 0)


class RefusingStow:
    """A STOW-RS server on loopback that refuses deflated instances (HTTP 409 with Failure
    Reason 0xC122, as a server without zlib might) and stores the others, keeping each
    request's instance."""

    def __init__(self) -> None:
        self.received: list[bytes] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                boundary = self.headers["Content-Type"].split("boundary=")[1].strip('"')
                part = body.split(b"--" + boundary.encode())[1]
                instance = part.split(b"\r\n\r\n", 1)[1][: -len(b"\r\n")]
                outer.received.append(instance)
                uid = pydicom.dcmread(io.BytesIO(instance), stop_before_pixels=True)
                item = {
                    "00081150": {"vr": "UI", "Value": [str(uid.SOPClassUID)]},
                    "00081155": {"vr": "UI", "Value": [str(uid.SOPInstanceUID)]},
                }
                deflated = uid.file_meta.TransferSyntaxUID == DeflatedExplicitVRLittleEndian
                if deflated:
                    item["00081197"] = {"vr": "US", "Value": [0xC122]}
                tag = "00081198" if deflated else "00081199"
                reply = json.dumps({tag: {"vr": "SQ", "Value": [item]}}).encode()
                self.send_response(409 if deflated else 200)
                self.send_header("Content-Type", "application/dicom+json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((LOOPBACK, 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://{LOOPBACK}:{self.server.server_address[1]}/dicom-web"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_stow_server_that_refuses_deflate_gets_the_seg_inflated(
    tmp_path: Path, ledger: Ledger, blobs: Blobs
) -> None:
    """STOW-RS negotiates no transfer syntax: the SEG goes deflated, as stored; a server that
    refuses it gets the same instance inflated at once (no attempt lost), the SR as it is."""
    stow = RefusingStow()
    try:
        peer = f"stow:{stow.url}"
        job_id, seg = deflated_job(ledger, tmp_path, blobs, peer)
        d = Dispatcher(outbox_config(tmp_path, [peer]), ledger)
        assert d.run_once() == 2
        d.stop()
    finally:
        stow.stop()
    assert ledger.job_state(job_id) == "sent"
    first, second, sr = stow.received
    assert first == seg.read_bytes()
    copy = pydicom.dcmread(io.BytesIO(second))
    assert copy.file_meta.TransferSyntaxUID == ExplicitVRLittleEndian
    assert dataset_bytes(second) == inflate(dataset_bytes(seg.read_bytes()))
    assert copy.SOPInstanceUID == pydicom.dcmread(seg, stop_before_pixels=True).SOPInstanceUID
    assert pydicom.dcmread(io.BytesIO(sr)).Modality == "SR"
