"""SEG bytes read by a reader we did not write: dcmqi's ``segimage2itkimage``.

dcmqi (QIICR; ``pip install dcmqi``) converts each segment of a SEG into an image with its own
geometry and writes the segment attributes to ``meta.json``. The SEGs the node encodes
(:class:`segnode.node.results.seg_encode.SegPlan`) must come out with every voxel where the label
map has it, on the grid SimpleITK reads from the source CT series (axial and sagittal), and with the
codes of every segment, laterality and anatomic region included.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.test_results import small_volume, truth
from tests.test_seg_encode import lateral_manifest, prepare


def segimage2itkimage() -> str:
    tool = shutil.which("segimage2itkimage") or str(
        Path(sys.executable).parent / "segimage2itkimage"
    )
    if not Path(tool).is_file():
        pytest.skip("dcmqi is not installed (pip install dcmqi)")
    return tool


def convert(seg: bytes, folder: Path) -> dict[str, Any]:
    """Run dcmqi on ``seg``; its meta.json (the segments, one list per file)."""
    tool = segimage2itkimage()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "seg.dcm").write_bytes(seg)
    out = folder / "itk"
    out.mkdir()
    command = [tool, "--inputDICOM", str(folder / "seg.dcm"), "--outputDirectory", str(out)]
    proc = subprocess.run([*command, "-t", "nrrd"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(json.loads((out / "meta.json").read_text()))


def test_dcmqi_places_every_segment_on_the_source_grid(tmp_path: Path) -> None:
    """Axial and sagittal series, the bundled model's five labels: each segment image dcmqi
    writes has the source CT's origin, spacing, direction and size as SimpleITK reads the
    series, and exactly the label map's voxels (``bench.seg_dcmqi``)."""
    segimage2itkimage()
    pytest.importorskip("SimpleITK", reason="SimpleITK is not installed")
    from bench.seg_dcmqi import main

    assert main([str(tmp_path)]) == 0


def test_dcmqi_reads_the_codes_with_laterality_and_region(tmp_path: Path) -> None:
    """kidney_left / kidney_right keep their laterality (a modifier of the type), the third
    segment its anatomic region with its modifier, in dcmqi's reading of the segment
    attributes; the masks are the label map's."""
    manifest = lateral_manifest()
    volume = small_volume()
    labels = truth(volume)
    labels[labels > 3] = 3
    encoded = prepare(volume, "BINARY", manifest).encode(labels)
    meta = convert(encoded.data, tmp_path)
    found = {}
    for group in meta["segmentAttributes"]:
        for seg in group:
            code = seg.get("SegmentedPropertyTypeModifierCodeSequence") or {}
            region = seg.get("AnatomicRegionSequence") or {}
            region_mod = seg.get("AnatomicRegionModifierSequence") or {}
            found[seg["SegmentLabel"]] = (
                seg["SegmentedPropertyTypeCodeSequence"]["CodeValue"],
                code.get("CodeMeaning"),
                region.get("CodeValue"),
                region_mod.get("CodeMeaning"),
            )
    assert found == {
        "kidney_left": ("64033007", "Left", None, None),
        "kidney_right": ("64033007", "Right", None, None),
        "fat": (manifest.labels[2].type[0], None, "818981001", "Left"),
    }
    sitk = pytest.importorskip("SimpleITK", reason="SimpleITK is not installed")
    for value, number in encoded.segment_numbers.items():
        mask = sitk.GetArrayFromImage(sitk.ReadImage(str(tmp_path / "itk" / f"{number}.nrrd")))
        # dcmqi writes the frames in the order of their positions along the slice normal,
        # which is the volume's order here (ascending positions)
        np.testing.assert_array_equal(mask.astype(bool), labels == value)
