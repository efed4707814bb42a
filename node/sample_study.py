"""A sample CT study as a scanner sends it: a localizer, an axial series and a dose report.

Used by the routing tests and by ``docs/integration.md``::

    python -m node.sample_study OUT_DIR     # then: segnode rules test OUT_DIR

The study has three series, all synthetic (see :mod:`node.synthetic`):

1. **Topogram** - 2 CT images with Image Type ``ORIGINAL\\PRIMARY\\LOCALIZER`` (a frontal and a
   lateral scout view);
2. **Thorax** - the axial phantom, ``ORIGINAL\\PRIMARY\\AXIAL``, 1.25 mm slices;
3. **Dose Report** - one X-Ray Radiation Dose SR (PS3.3 A.35.8, TID 10011 root only), a
   non-image object.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.sequence import Sequence as DicomSequence
from pydicom.uid import PYDICOM_IMPLEMENTATION_UID, UID, ExplicitVRLittleEndian, generate_uid

from node.synthetic import CORONAL, SAGITTAL, synthetic_datasets

XRAY_RADIATION_DOSE_SR = "1.2.840.10008.5.1.4.1.1.88.67"
MANUFACTURER = "SYNTHETIC SCANNER"


def _uid(seed: int, *parts: object) -> UID:
    return generate_uid(entropy_srcs=["segnode-sample-study", str(seed), *map(str, parts)])


def localizer_datasets(*, study_uid: str, seed: int, patient_id: str, size: int) -> list[Dataset]:
    """Two scout views (frontal and lateral) as CT Image Storage with Image Type LOCALIZER."""
    out = []
    for k, orientation in enumerate((CORONAL, SAGITTAL)):
        ds = synthetic_datasets(
            rows=size,
            columns=size,
            slices=1,
            pixel_spacing=1.0,
            slice_spacing=1.0,
            orientation=orientation,
            seed=seed,
            study_uid=study_uid,
            series_uid=_uid(seed, "localizer"),
            frame_of_reference_uid=_uid(seed, "for"),
            patient_id=patient_id,
            series_number=1,
        )[0]
        ds.SOPInstanceUID = _uid(seed, "localizer", k)
        ds.file_meta.MediaStorageSOPInstanceUID = ds.SOPInstanceUID
        ds.InstanceNumber = k + 1
        ds.ImageType = ["ORIGINAL", "PRIMARY", "LOCALIZER"]
        ds.SeriesDescription = "Topogram 0.6 T20f"
        out.append(ds)
    return out


def dose_report(*, study_uid: str, seed: int, patient_id: str) -> Dataset:
    """A minimal X-Ray Radiation Dose SR: the TID 10011 root container, no content items."""
    template = synthetic_datasets(
        rows=8, columns=8, slices=1, seed=seed, study_uid=study_uid, patient_id=patient_id
    )[0]
    sop_uid = _uid(seed, "dose")
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = UID(XRAY_RADIATION_DOSE_SR)
    meta.MediaStorageSOPInstanceUID = sop_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    meta.ImplementationClassUID = PYDICOM_IMPLEMENTATION_UID
    ds = Dataset()
    ds.file_meta = meta
    for keyword in (
        "SpecificCharacterSet",
        "PatientName",
        "PatientID",
        "PatientBirthDate",
        "PatientSex",
        "StudyInstanceUID",
        "StudyDate",
        "StudyTime",
        "ReferringPhysicianName",
        "StudyID",
        "AccessionNumber",
        "StudyDescription",
    ):
        setattr(ds, keyword, template.get(keyword))
    ds.Modality = "SR"
    ds.SeriesInstanceUID = _uid(seed, "dose-series")
    ds.SeriesNumber = 997
    ds.SeriesDescription = "Dose Report"
    ds.Manufacturer = MANUFACTURER
    ds.InstanceNumber = 1
    ds.ContentDate = "20240101"
    ds.ContentTime = "120500"
    ds.ValueType = "CONTAINER"
    concept = Dataset()
    concept.CodeValue = "113701"
    concept.CodingSchemeDesignator = "DCM"
    concept.CodeMeaning = "X-Ray Radiation Dose Report"
    ds.ConceptNameCodeSequence = DicomSequence([concept])
    ds.ContinuityOfContent = "SEPARATE"
    ds.CompletionFlag = "COMPLETE"
    ds.VerificationFlag = "UNVERIFIED"
    tpl = Dataset()
    tpl.MappingResource = "DCMR"
    tpl.TemplateIdentifier = "10011"
    ds.ContentTemplateSequence = DicomSequence([tpl])
    ds.ReferencedPerformedProcedureStepSequence = DicomSequence([])
    ds.PerformedProcedureCodeSequence = DicomSequence([])
    ds.SOPClassUID = UID(XRAY_RADIATION_DOSE_SR)
    ds.SOPInstanceUID = sop_uid
    return ds


def write_sample_study(
    out_dir: Path,
    *,
    seed: int = 40,
    slices: int = 64,
    size: int = 128,
    patient_id: str = "ROUTING",
) -> dict[str, list[Path]]:
    """Write the study; return the files of each series (``localizer``, ``axial``, ``dose``).

    Parameters
    ----------
    out_dir
        Created if missing; one subfolder per series.
    seed
        Seeds the noise and every UID, so a call is reproducible.
    slices, size
        Slices and matrix size of the axial series.
    patient_id
        Patient ID of every object.
    """
    study_uid = str(_uid(seed, "study"))
    series: dict[str, list[Dataset]] = {
        "localizer": localizer_datasets(
            study_uid=study_uid, seed=seed, patient_id=patient_id, size=size
        ),
        "axial": synthetic_datasets(
            rows=size,
            columns=size,
            slices=slices,
            seed=seed,
            study_uid=study_uid,
            series_uid=_uid(seed, "axial"),
            frame_of_reference_uid=_uid(seed, "for"),
            patient_id=patient_id,
            series_number=2,
        ),
        "dose": [dose_report(study_uid=study_uid, seed=seed, patient_id=patient_id)],
    }
    for ds in series["axial"]:
        ds.SeriesDescription = "Thorax 1.25 mm"
    for ds in series["axial"] + series["localizer"]:
        ds.Manufacturer = MANUFACTURER
    out: dict[str, list[Path]] = {}
    for name, datasets in series.items():
        folder = out_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        out[name] = []
        for k, ds in enumerate(datasets, start=1):
            path = folder / f"{name}{k:04d}.dcm"
            ds.save_as(path, enforce_file_format=True)
            out[name].append(path)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m node.sample_study OUT_DIR``: write the sample study."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--slices", type=int, default=64)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args(argv)
    files = write_sample_study(args.out_dir, slices=args.slices, size=args.size)
    for name, paths in files.items():
        print(f"{name}: {len(paths)} file(s) in {args.out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
