"""External check of segnode.node.results.seg_encode with dcmqi: ``python -m bench.seg_dcmqi OUT``.

Writes a synthetic CT series (axial and sagittal), encodes a BINARY SEG of the phantom's five
labels with :class:`segnode.node.results.seg_encode.SegPlan`, converts it with dcmqi's
``segimage2itkimage`` (``pip install dcmqi``) and compares each segment image with the label map and
its geometry (origin, spacing, direction, size) with SimpleITK's reading of the CT series
(``pip install SimpleITK``; both are in the ``test`` extra, and
``tests/test_seg_dcmqi.py`` runs this check in CI).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from segnode.engines.manifest_parse import load_manifest
from segnode.node.ingest.volume import assemble_volume
from segnode.node.results.build import Equipment, ResultUIDs
from segnode.node.results.seg_check import check_encoded
from segnode.node.results.seg_encode import SegPlan
from tests.fixtures.synthetic import (
    AXIAL,
    SAGITTAL,
    PhantomGeometry,
    phantom_labels,
    write_synthetic_series,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    try:
        import SimpleITK as sitk  # noqa: N813
    except ImportError:
        print("SimpleITK is not installed")
        return 2
    tool = shutil.which("segimage2itkimage") or str(
        Path(sys.executable).parent / "segimage2itkimage"
    )
    manifest = load_manifest("engines/models/tissue/tissue.json")
    failures = 0
    for name, orientation in (("axial", AXIAL), ("sagittal", SAGITTAL)):
        ct = args.out / name / "ct"
        write_synthetic_series(
            ct, PhantomGeometry(rows=256, columns=256, slices=64, orientation=orientation)
        )
        volume = assemble_volume(sorted(ct.glob("*.dcm")))
        labels = phantom_labels(256, 256, 64)
        plan = SegPlan.prepare(
            volume, manifest, ResultUIDs.new(), equipment=Equipment.for_seg("bench")
        )
        encoded = plan.encode(labels)
        check_encoded(plan, encoded, labels)
        seg = args.out / name / "seg.dcm"
        seg.write_bytes(encoded.data)
        itk = args.out / name / "itk"
        itk.mkdir(parents=True, exist_ok=True)
        command = [tool, "--inputDICOM", str(seg), "--outputDirectory", str(itk), "-t", "nrrd"]
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        print(f"{name}: {' '.join(command[1:])} -> rc {proc.returncode} {proc.stderr.strip()}")
        reader = sitk.ImageSeriesReader()
        reader.SetFileNames(reader.GetGDCMSeriesFileNames(str(ct)))
        image = reader.Execute()
        corners = [
            image.TransformIndexToPhysicalPoint((0, 0, k)) for k in range(image.GetSize()[2])
        ]
        positions = np.array(volume.slice_positions)
        order = [int(np.argmin(np.linalg.norm(positions - np.array(p), axis=1))) for p in corners]
        for value, number in encoded.segment_numbers.items():
            segment = sitk.ReadImage(str(itk / f"{number}.nrrd"))
            geometry = (
                np.allclose(segment.GetOrigin(), image.GetOrigin(), atol=1e-3)
                and np.allclose(segment.GetSpacing(), image.GetSpacing(), atol=1e-4)
                and np.allclose(segment.GetDirection(), image.GetDirection(), atol=1e-6)
                and segment.GetSize() == image.GetSize()
            )
            mask = sitk.GetArrayFromImage(segment).astype(bool)
            same = bool(np.array_equal(mask, (labels == value)[order]))
            failures += not (geometry and same)
            print(f"  segment {number} (label {value}): geometry {geometry}, voxels {same}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
