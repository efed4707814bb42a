"""The web viewers' SEG readers read the node's SEG exactly: dcmjs and @cornerstonejs/adapters.

``tests/node`` pins dcmjs (its ``adapters.Cornerstone.Segmentation.generateToolState``, the
reader of Cornerstone-tools-4 viewers) and ``@cornerstonejs/adapters`` (its
``Cornerstone3D.Segmentation.createFromDICOMSegBuffer``, OHIF 3's SEG loader); the harness
installs them with ``npm ci`` into the tool cache (``tests/node/harness.py``) and runs them under
Node.js with the CT's metadata, as a viewer's metadata provider gives it. A SEG the node's own
encoder makes of a known label map (117 structures, a few slices) must come back from each
reader with every voxel of every segment on its slice: the label map the reader builds equals
ours, so its per-segment voxel counts and the slices it put each segment on do too. Both read
the Deflated Explicit VR Little Endian default; dcmjs does not read LABELMAP, Cornerstone does.

Skipped where node, npm or the npm registry is missing, unless SEGNODE_REQUIRE_TOOLS is set.
"""

from __future__ import annotations

import datetime
import os
from collections import Counter
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from pydicom.uid import DeflatedExplicitVRLittleEndian, ExplicitVRLittleEndian

from bench.seg_size import blob_labels, blob_manifest, blob_volume
from segnode.node.ingest.volume import Volume
from segnode.node.results.build import Equipment, ResultUIDs
from segnode.node.results.seg_check import check_encoded
from segnode.node.results.seg_encode import EncodedSeg, SegPlan
from tests.node.harness import Unavailable, install, read_seg

#: few slices, so that the readers run in about a second each; 117 structures
SHAPE = (12, 96, 96)
UIDS = ResultUIDs("2.25.3501", "2.25.3502", "2.25.3503", "2.25.3504")


@pytest.fixture(scope="module")
def installed() -> Path:
    try:
        return install()
    except Unavailable as exc:
        if os.environ.get("SEGNODE_REQUIRE_TOOLS"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def scene() -> tuple[Volume, npt.NDArray[np.uint8]]:
    labels = blob_labels(SHAPE)
    labels[labels == 5] = 0  # an absent label: segment numbers are not the label values
    return blob_volume(SHAPE), labels


def encode(volume: Volume, labels: npt.NDArray[np.uint8], kind: str, syntax: str) -> EncodedSeg:
    plan = SegPlan.prepare(
        volume,
        blob_manifest(),
        UIDS,
        segmentation_type=kind,
        transfer_syntax=syntax,
        equipment=Equipment.for_seg("test"),
        created=datetime.datetime(2026, 12, 6, 12, 0, 0),
    )
    encoded = plan.encode(labels)
    check_encoded(plan, encoded, labels)
    return encoded


def numbered(labels: npt.NDArray[np.uint8], encoded: EncodedSeg) -> npt.NDArray[np.uint16]:
    lut = np.zeros(256, dtype=np.uint16)
    for value, number in encoded.segment_numbers.items():
        lut[value] = number
    out: npt.NDArray[np.uint16] = lut[labels]
    return out


CASES = [
    ("dcmjs", "BINARY", DeflatedExplicitVRLittleEndian),
    ("dcmjs", "BINARY", ExplicitVRLittleEndian),
    ("cornerstone", "BINARY", DeflatedExplicitVRLittleEndian),
    ("cornerstone", "BINARY", ExplicitVRLittleEndian),
    ("cornerstone", "LABELMAP", DeflatedExplicitVRLittleEndian),
]


@pytest.mark.parametrize(
    ("reader", "kind", "syntax"),
    CASES,
    ids=[f"{r}-{k}-{'deflated' if s.endswith('.99') else 'explicit'}" for r, k, s in CASES],
)
@pytest.mark.parametrize("stack", ["ascending", "descending"])
def test_reader_rebuilds_the_label_map(
    installed: Path,
    scene: tuple[Volume, npt.NDArray[np.uint8]],
    tmp_path: Path,
    reader: str,
    kind: str,
    syntax: str,
    stack: str,
) -> None:
    """The reader's label map, per-segment voxel counts and segments per slice equal the
    label map's, with the viewer's stack in either order (frames are placed by their source
    references and positions, not by their order)."""
    volume, labels = scene
    encoded = encode(volume, labels, kind, syntax)
    assert len(encoded.segment_numbers) > 100
    seg = tmp_path / "seg.dcm"
    seg.write_bytes(encoded.data)
    sources = list(volume.sources)
    expected = numbered(labels, encoded)
    if stack == "descending":
        sources, expected = sources[::-1], expected[::-1]
    report = read_seg(reader, seg, sources, tmp_path / "work", labels=True)
    counts = Counter(expected[expected > 0].tolist())
    assert {int(n): c for n, c in report["counts"].items()} == dict(counts)
    per_slice = [sorted(set(np.unique(s).tolist()) - {0}) for s in expected]
    assert report["slices"] == per_slice
    if kind == "BINARY":  # the encoder's frames (segment, slice) are where the reader put them
        last = len(sources) - 1
        frames = zip(encoded.frame_segments.tolist(), encoded.frame_slices.tolist(), strict=True)
        placed = {(n, last - k if stack == "descending" else k) for n, k in frames}
        found = {(n, i) for i, numbers in enumerate(report["slices"]) for n in numbers}
        assert placed == found
    assert np.array_equal(report["labels"], expected)
    assert report["seconds"] > 0 and report["peak_rss_mib"] > 0


def test_dcmjs_does_not_read_a_labelmap_seg(
    installed: Path, scene: tuple[Volume, npt.NDArray[np.uint8]], tmp_path: Path
) -> None:
    """dcmjs takes a LABELMAP SEG's 8-bit frames for a fractional segmentation and gives up:
    why the node's default is BINARY."""
    volume, labels = scene
    encoded = encode(volume, labels, "LABELMAP", DeflatedExplicitVRLittleEndian)
    seg = tmp_path / "seg.dcm"
    seg.write_bytes(encoded.data)
    with pytest.raises(AssertionError, match="Fractional segmentations are not yet supported"):
        read_seg("dcmjs", seg, volume.sources, tmp_path / "work")
