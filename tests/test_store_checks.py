"""C-STOREs the node must refuse although they parse: deflate bombs and datasets that do not
match their request or their SOP class.

* A Deflated Explicit VR Little Endian dataset is inflated only up to the instance limit
  (``node.max_instance_mb``): past it the answer is 0xA700 and nothing is stored.
* A dataset without SOP Instance UID or SOP Class UID, or whose SOP Class UID is not the
  request's Affected SOP Class UID, is refused with 0xA900 (PS3.4 §B.2.3); so is a CT Image
  Storage dataset without Pixel Data (Type 1 in the CT IOD). Other SOP classes are ignored
  without judging their contents (test_scp covers an RT Dose without pixels).

The SCP runs in-process (:class:`tests.test_scp.Harness`) and the datasets are sent as they
are encoded here (pynetdicom's chunked send), like a careless or hostile modality.
"""

from __future__ import annotations

import logging
import struct
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydicom import dcmread
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.filebase import DicomBytesIO
from pydicom.filewriter import write_dataset
from pydicom.uid import DeflatedExplicitVRLittleEndian, ExplicitVRLittleEndian, generate_uid
from pynetdicom import _config as pynetdicom_config
from pynetdicom.sop_class import CTImageStorage, MRImageStorage  # type: ignore[attr-defined]

from segnode.node.dicom.header import HeaderError, InflateLimitError, parse_header
from segnode.node.ingest.scp import file_meta
from tests import test_scp
from tests.test_scp import Harness, send

#: The small synthetic series of the C-STORE tests (a module-scoped fixture).
series = test_scp.series
MiB = 2**20
CT = str(CTImageStorage)


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path / "node", max_instance_mb=1)
    yield harness
    harness.close()


def fresh(path: Path) -> Dataset:
    """A slice of ``path`` with new Study, Series and SOP Instance UIDs, without file meta."""
    ds = dcmread(path)
    del ds.file_meta
    ds.StudyInstanceUID, ds.SeriesInstanceUID = generate_uid(), generate_uid()
    ds.SOPInstanceUID = generate_uid()
    return ds


def encoded(ds: Dataset) -> bytes:
    """``ds`` in Explicit VR Little Endian, without File Meta Information."""
    fp = DicomBytesIO()
    fp.is_little_endian, fp.is_implicit_VR = True, False
    write_dataset(fp, ds)
    return fp.getvalue()


def bomb(head: bytes, inflated: int) -> bytes:
    """Raw deflate of ``head`` and then a native Pixel Data (OW) of ``inflated`` zero bytes."""
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    out = [c.compress(head + struct.pack("<HH2s2xI", 0x7FE0, 0x0010, b"OW", inflated))]
    chunk = bytes(8 * MiB)
    for start in range(0, inflated, len(chunk)):
        out.append(c.compress(chunk[: inflated - start]))
    out.append(c.flush())
    return b"".join(out)


#: The Error Comments (0000,0902) of the responses send_raw got, in order.
comments: list[str] = []


def send_raw(
    h: Harness,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sop_uid: str,
    dataset: bytes,
    *,
    syntax: str = ExplicitVRLittleEndian,
) -> int:
    """C-STORE ``dataset`` (bytes as sent) as CT Image Storage under ``sop_uid``."""
    monkeypatch.setattr(pynetdicom_config, "STORE_SEND_CHUNKED_DATASET", True)
    path = tmp_path / f"{sop_uid}.dcm"
    path.write_bytes(file_meta(CT, sop_uid, syntax, "MODALITY") + dataset)
    a = h.assoc(contexts=[(CT, syntax)])
    try:
        rsp = a.send_c_store(path)  # type: ignore[attr-defined]
        comments.append(str(rsp.get("ErrorComment", "")))
        return int(rsp.Status)
    finally:
        a.release()  # type: ignore[attr-defined]


def nothing_stored(h: Harness) -> bool:
    spooled = [p for p in h.spool.root.rglob("*.dcm") if ".incoming" not in p.parts]
    return h.ledger.counts()["instances"] == 0 and not spooled


# -- deflate bombs ---------------------------------------------------------------------------


def test_inflate_stops_at_the_limit() -> None:
    """64 MiB of zeros deflate to ~64 KiB; with a 1 MiB limit the parse stops after about a
    megabyte of output instead of inflating all of it."""
    stream = bomb(b"", 64 * MiB)
    tracemalloc.start()
    try:
        with pytest.raises(InflateLimitError, match="1 MiB instance limit"):
            parse_header(stream, DeflatedExplicitVRLittleEndian, max_inflated=MiB)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * MiB


def test_inflate_within_the_limit_and_truncated_stream(series: list[Path]) -> None:
    head = encoded(fresh(series[0]))
    stream = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    whole = stream.compress(head) + stream.flush()
    header = parse_header(whole, DeflatedExplicitVRLittleEndian, max_inflated=len(head))
    assert header.has_pixel_data
    with pytest.raises(InflateLimitError):
        parse_header(whole, DeflatedExplicitVRLittleEndian, max_inflated=len(head) - 1)
    with pytest.raises(HeaderError, match="cannot be inflated") as info:
        parse_header(whole[: len(whole) // 2], DeflatedExplicitVRLittleEndian)
    assert not isinstance(info.value, InflateLimitError)


def test_deflate_bomb_refused_with_a700_and_not_stored(
    h: Harness,
    series: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ds = fresh(series[0])
    del ds.PixelData
    ds.Rows = ds.Columns = 2048  # 8 MiB of 16-bit pixels, eight times node.max_instance_mb
    data = bomb(encoded(ds), 2048 * 2048 * 2)
    assert len(data) < MiB // 4  # the compressed size passes every limit
    with caplog.at_level(logging.WARNING, logger="segnode.node.ingest.scp"):
        status = send_raw(
            h, tmp_path, monkeypatch, ds.SOPInstanceUID, data, syntax=DeflatedExplicitVRLittleEndian
        )
    assert status == 0xA700
    assert comments[-1] == "deflated dataset inflates past the 1 MiB instance limit"
    assert nothing_stored(h)
    assert any(
        "MODALITY" in r.getMessage() and "instance limit" in r.getMessage() for r in caplog.records
    )


def test_deflated_instance_within_the_limit_is_stored(h: Harness, series: list[Path]) -> None:
    ds = fresh(series[1])
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = DeflatedExplicitVRLittleEndian
    a = h.assoc(contexts=[(CT, DeflatedExplicitVRLittleEndian)])
    assert send(a, ds) == 0
    a.release()  # type: ignore[attr-defined]
    assert h.ledger.counts()["instances"] == 1


# -- datasets that do not match their request or SOP class -----------------------------------


def _no_sop_instance(ds: Dataset) -> None:
    del ds.SOPInstanceUID


def _mr_class(ds: Dataset) -> None:
    ds.SOPClassUID = MRImageStorage


def _no_sop_class(ds: Dataset) -> None:
    del ds.SOPClassUID


def _no_pixels(ds: Dataset) -> None:
    del ds.PixelData


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (_no_sop_instance, "no SOP Instance UID"),
        (_mr_class, "SOP Class UID differs"),
        (_no_sop_class, "no SOP Class UID"),
        (_no_pixels, "no Pixel Data"),
    ],
    ids=["no-sop-instance-uid", "mr-dataset-on-ct-request", "no-sop-class-uid", "no-pixel-data"],
)
def test_mismatched_dataset_refused_with_a900(
    h: Harness,
    series: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    mutate: Callable[[Dataset], None],
    reason: str,
) -> None:
    ds = fresh(series[0])
    sop_uid = str(ds.SOPInstanceUID)
    mutate(ds)
    with caplog.at_level(logging.WARNING, logger="segnode.node.ingest.scp"):
        assert send_raw(h, tmp_path, monkeypatch, sop_uid, encoded(ds)) == 0xA900
    assert reason in comments[-1]
    assert nothing_stored(h)
    assert any("MODALITY" in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    # The node keeps serving: the same slice, whole, is stored.
    whole = fresh(series[0])
    assert send_raw(h, tmp_path, monkeypatch, str(whole.SOPInstanceUID), encoded(whole)) == 0
    assert h.ledger.counts()["instances"] == 1
