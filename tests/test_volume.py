"""segnode.node.ingest.volume: assembling CT series (single-frame and Enhanced CT) into HU
volumes."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import highdicom as hd
import numpy as np
import pydicom
import pytest
from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset
from pydicom.tag import Tag
from pydicom.uid import (
    DeflatedExplicitVRLittleEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    RLELossless,
    generate_uid,
)

from segnode.node.ingest.volume import VolumeError, assemble_from_datasets, assemble_volume
from tests.conftest import LIVER, PHANTOM, require_data
from tests.fixtures.synthetic import (
    AXIAL,
    OBLIQUE,
    SAGITTAL,
    PhantomGeometry,
    jpeg_lossless_sv1,
    phantom_hu,
    synthetic_datasets,
    write_enhanced_ct,
    write_synthetic_series,
)

ROWS, COLUMNS, SLICES = 32, 40, 6
SMALL = PhantomGeometry(rows=ROWS, columns=COLUMNS, slices=SLICES)


def small(geometry: PhantomGeometry = SMALL, **options: Any) -> list[Dataset]:
    """A small phantom series (32 x 40 x 6 unless ``geometry`` says otherwise) in memory."""
    return synthetic_datasets(geometry, **options)


def enhanced(tmp_path: Path, **kwargs: Any) -> Path:
    """The small phantom (32 x 40 x 6) as one Enhanced CT file."""
    return write_enhanced_ct(tmp_path / "enhanced.dcm", SMALL, **kwargs)


def reread(ds: Dataset) -> Dataset:
    """Encode and decode ``ds`` so changed pixel attributes take effect."""
    from io import BytesIO

    buffer = BytesIO()
    ds.save_as(buffer, enforce_file_format=True)
    buffer.seek(0)
    return pydicom.dcmread(buffer)


# ------------------------------------------------------------------------ happy paths


def test_synthetic_series_round_trip(tmp_path: Path) -> None:
    paths = write_synthetic_series(
        tmp_path, dataclasses.replace(SMALL, pixel_spacing=0.7, slice_spacing=1.25)
    )
    shuffled = list(paths)
    random.Random(1).shuffle(shuffled)
    volume = assemble_volume(shuffled)

    assert volume.shape == (SLICES, ROWS, COLUMNS)
    assert volume.hu.dtype == np.float32
    np.testing.assert_array_equal(volume.hu, phantom_hu(ROWS, COLUMNS, SLICES))
    assert volume.spacing == pytest.approx((1.25, 0.7, 0.7))
    assert volume.normal == pytest.approx((0.0, 0.0, 1.0))
    assert volume.row_direction == (1.0, 0.0, 0.0)
    assert volume.column_direction == (0.0, 1.0, 0.0)
    assert volume.voxel_volume_ml == pytest.approx(1.25 * 0.7 * 0.7 / 1000)
    z = [float(ds.ImagePositionPatient[2]) for ds in volume.sources]
    assert z == sorted(z)
    assert volume.origin == pytest.approx(
        [float(v) for v in volume.sources[0].ImagePositionPatient]
    )
    assert [int(ds.InstanceNumber) for ds in volume.sources] == list(range(1, SLICES + 1))
    assert all("PixelData" not in ds for ds in volume.sources)
    assert len({ds.SOPInstanceUID for ds in volume.sources}) == SLICES
    assert not volume.is_multiframe
    # affine maps voxel (k, i, j) to the patient position of that voxel
    k, i, j = 3, 5, 7
    expected = (
        np.array(volume.slice_positions[k])
        + i * 0.7 * np.array(volume.column_direction)
        + j * 0.7 * np.array(volume.row_direction)
    )
    np.testing.assert_allclose(volume.affine @ [k, i, j, 1], [*expected, 1.0], atol=1e-6)


@pytest.mark.parametrize(
    "syntax",
    [
        ExplicitVRLittleEndian,
        ImplicitVRLittleEndian,
        DeflatedExplicitVRLittleEndian,
        RLELossless,
        JPEGLSLossless,
        JPEG2000Lossless,
        JPEGLosslessSV1,
    ],
    ids=lambda uid: uid.name,
)
def test_transfer_syntaxes_decode_to_same_hu(tmp_path: Path, syntax: str) -> None:
    paths = write_synthetic_series(tmp_path, SMALL, transfer_syntax=syntax)
    assert pydicom.dcmread(paths[0]).file_meta.TransferSyntaxUID == syntax
    volume = assemble_volume(paths)
    np.testing.assert_array_equal(volume.hu, phantom_hu(ROWS, COLUMNS, SLICES))


@pytest.mark.parametrize("precision", [12, 16])
def test_jpeg_lossless_encoder_is_lossless(precision: int) -> None:
    # the test encoder must be exact for every difference category, 0..16
    from pylibjpeg.utils import decode

    rng = np.random.default_rng(precision)
    frame = rng.integers(0, 1 << precision, (17, 23)).astype(np.uint16)
    frame[0, :2] = (0, (1 << precision) - 1)
    np.testing.assert_array_equal(decode(jpeg_lossless_sv1(frame, precision)), frame)


def test_signed_pixels_and_per_slice_rescale() -> None:
    datasets = small()
    hu = phantom_hu(ROWS, COLUMNS, SLICES)
    for k, ds in enumerate(datasets):
        slope, intercept = (1.0, -1024.0) if k % 2 else (0.5, -20.0 * k)
        stored = np.rint((hu[k].astype(np.float64) - intercept) / slope).astype(np.int16)
        ds.PixelRepresentation = 1
        ds.BitsStored = 16
        ds.HighBit = 15
        ds.RescaleSlope = slope
        ds.RescaleIntercept = intercept
        ds.PixelData = stored.tobytes()
    volume = assemble_from_datasets([reread(ds) for ds in datasets])
    np.testing.assert_allclose(volume.hu, hu, atol=0.5)


def test_reverse_order_and_flipped_normal() -> None:
    # column direction -y: normal is -z, so ascending along the normal is descending in z
    datasets = small(dataclasses.replace(SMALL, orientation=(1.0, 0.0, 0.0, 0.0, -1.0, 0.0)))
    volume = assemble_from_datasets(datasets[::-1])
    assert volume.normal == pytest.approx((0.0, 0.0, -1.0))
    z = [p[2] for p in volume.slice_positions]
    assert z == sorted(z, reverse=True)
    np.testing.assert_array_equal(volume.hu, phantom_hu(ROWS, COLUMNS, SLICES))


@pytest.mark.parametrize("orientation", [SAGITTAL, OBLIQUE], ids=["sagittal", "oblique"])
def test_non_axial_geometry(orientation: tuple[float, ...]) -> None:
    datasets = small(dataclasses.replace(SMALL, orientation=orientation, slice_spacing=2.0))
    volume = assemble_from_datasets(datasets[::-1])
    row, col = np.array(orientation[:3]), np.array(orientation[3:])
    assert volume.normal == pytest.approx(tuple(np.cross(row, col)))
    assert volume.spacing == pytest.approx((2.0, 0.7, 0.7), abs=1e-3)  # positions have 4 decimals
    np.testing.assert_array_equal(volume.hu, phantom_hu(ROWS, COLUMNS, SLICES))
    assert [ds.SOPInstanceUID for ds in volume.sources] == [ds.SOPInstanceUID for ds in datasets]


def test_datasets_are_not_modified() -> None:
    datasets = small()
    assemble_from_datasets(datasets)
    assert all("PixelData" in ds for ds in datasets)


@pytest.mark.parametrize("per_frame_rescale", [False, True], ids=["shared", "per-frame"])
def test_enhanced_ct(tmp_path: Path, per_frame_rescale: bool) -> None:
    order = [3, 1, 0, 5, 4, 2]
    path = enhanced(tmp_path, frame_order=order, per_frame_rescale=per_frame_rescale)
    volume = assemble_volume([path])
    np.testing.assert_array_equal(volume.hu, phantom_hu(ROWS, COLUMNS, SLICES))
    assert volume.is_multiframe
    assert len(volume.sources) == 1
    assert "PixelData" not in volume.sources[0]
    # slice k came from the frame that holds phantom slice k
    assert volume.frame_numbers == tuple(order.index(k) + 1 for k in range(SLICES))
    assert volume.spacing == pytest.approx((1.25, 0.7, 0.7))


def test_enhanced_ct_compressed(tmp_path: Path) -> None:
    path = enhanced(tmp_path, transfer_syntax=RLELossless)
    np.testing.assert_array_equal(assemble_volume([path]).hu, phantom_hu(ROWS, COLUMNS, SLICES))


def test_legacy_converted_enhanced_ct() -> None:
    datasets = small()
    legacy = hd.legacy.LegacyConvertedEnhancedCTImage(
        legacy_datasets=datasets,
        series_instance_uid=generate_uid(),
        series_number=3,
        sop_instance_uid=generate_uid(),
        instance_number=1,
    )
    volume = assemble_from_datasets([reread(legacy)])
    np.testing.assert_array_equal(volume.hu, phantom_hu(ROWS, COLUMNS, SLICES))


def test_real_phantom_series() -> None:
    paths = sorted(p for p in require_data(PHANTOM).iterdir() if p.is_file())
    volume = assemble_volume(paths)
    assert volume.shape == (28, 512, 512)
    assert volume.spacing == pytest.approx((5.0, 0.451171875, 0.451171875))
    assert float(volume.hu.min()) == -1024.0
    assert float(volume.hu.max()) == 782.0
    z = [p[2] for p in volume.slice_positions]
    assert z == sorted(z)


def test_real_liver_three_slices() -> None:
    paths = sorted(require_data(LIVER).glob("*.dcm"))
    volume = assemble_volume(paths)
    assert volume.shape == (3, 512, 512)
    assert volume.spacing == pytest.approx((1.0, 0.810547, 0.810547))
    assert float(volume.hu.min()) == -3024.0
    assert float(volume.hu.max()) == 1381.0
    # files are numbered from the top; the volume goes from the bottom up
    assert [ds.InstanceNumber for ds in volume.sources] == [3, 2, 1]


def test_volume_validates_itself() -> None:
    volume = assemble_from_datasets(small())
    with pytest.raises(ValueError, match="float32"):
        dataclasses.replace(volume, hu=volume.hu.astype(np.float64))


# ------------------------------------------------------------------------ failures


def test_single_slice_is_rejected() -> None:
    with pytest.raises(VolumeError, match="1 slice"):
        assemble_from_datasets(small()[:1])


def test_min_slices() -> None:
    with pytest.raises(VolumeError, match="at least 8"):
        assemble_from_datasets(small(), min_slices=8)
    with pytest.raises(ValueError, match="at least 2"):
        assemble_from_datasets(small(), min_slices=1)


def test_no_instances() -> None:
    with pytest.raises(VolumeError, match="no instances"):
        assemble_from_datasets([])


def test_mixed_orientations() -> None:
    datasets = small()
    datasets[2].ImageOrientationPatient = [0.99, 0.141067, 0.0, -0.141067, 0.99, 0.0]
    with pytest.raises(VolumeError, match="mixed orientations: instance 3"):
        assemble_from_datasets(datasets)


def test_small_orientation_jitter_is_tolerated() -> None:
    datasets = small()
    datasets[2].ImageOrientationPatient = [1.0, 0.00002, 0.0, -0.00002, 1.0, 0.0]
    assemble_from_datasets(datasets)


def test_invalid_orientation() -> None:
    datasets = small()
    for ds in datasets:
        ds.ImageOrientationPatient = [1.0, 0.0, 0.0, 0.5, 0.5, 0.0]
    with pytest.raises(VolumeError, match="not two orthogonal unit vectors"):
        assemble_from_datasets(datasets)


def test_missing_slice_is_a_gap() -> None:
    datasets = small()
    del datasets[3]
    with pytest.raises(VolumeError, match="non-uniform slice spacing: 2.500 mm between instance 3"):
        assemble_from_datasets(datasets)


def test_non_uniform_spacing() -> None:
    datasets = small()
    x, y, z = (float(v) for v in datasets[4].ImagePositionPatient)
    datasets[4].ImagePositionPatient = [x, y, z + 0.3]
    with pytest.raises(VolumeError, match="non-uniform slice spacing") as info:
        assemble_from_datasets(datasets)
    assert "median spacing is 1.250 mm" in str(info.value)


def test_spacing_rounding_is_tolerated() -> None:
    datasets = small()
    x, y, z = (float(v) for v in datasets[4].ImagePositionPatient)
    datasets[4].ImagePositionPatient = [x, y, z + 0.005]
    assert assemble_from_datasets(datasets).spacing[0] == pytest.approx(1.25)


def test_gantry_tilt() -> None:
    datasets = small()
    shift = np.tan(np.radians(15)) * 1.25
    for k, ds in enumerate(datasets):
        x, y, z = (float(v) for v in ds.ImagePositionPatient)
        ds.ImagePositionPatient = [x, y + k * shift, z]
    with pytest.raises(VolumeError, match=r"not stacked along the slice normal.*15\.0 degrees"):
        assemble_from_datasets(datasets)


def _as_read(ds: Dataset, keyword: str, text: bytes) -> None:
    """Give ``ds`` a DS element holding ``text`` as a file would (pydicom refuses to set a
    value that is not a number, but reads one)."""
    tag = Tag(keyword)
    ds[tag] = RawDataElement(tag, "DS", len(text), text, 0, True, True)


def _claim_jpeg_ls(datasets: list[Dataset]) -> None:
    datasets[0].file_meta.TransferSyntaxUID = JPEGLSLossless  # claims JPEG-LS, holds raw bytes


_ONE_BAD_ATTRIBUTE = {
    "missing_pixel_data": (lambda d: delattr(d[1], "PixelData"), "no Pixel Data"),
    "duplicate_positions": (
        lambda d: setattr(d[3], "ImagePositionPatient", list(d[2].ImagePositionPatient)),
        "duplicate slice position: instance 3 .* and instance 4",
    ),
    "mismatched_frame_of_reference": (
        lambda d: setattr(d[1], "FrameOfReferenceUID", generate_uid()),
        "2 different Frames of Reference",
    ),
    "mixed_series": (
        lambda d: setattr(d[1], "SeriesInstanceUID", generate_uid()),
        "2 different series",
    ),
    "mixed_pixel_spacing": (
        lambda d: setattr(d[5], "PixelSpacing", [0.8, 0.8]),
        "mixed pixel spacing: instance 6",
    ),
    "missing_position": (
        lambda d: delattr(d[0], "ImagePositionPatient"),
        "instance 1 .* lacks ImagePositionPatient",
    ),
    "undecodable_pixel_data": (
        _claim_jpeg_ls,
        "cannot decode pixel data in transfer syntax JPEG-LS",
    ),
    # Values pydicom reads without complaint that no geometry or HU can come from.
    "nan_position": (
        lambda d: setattr(d[2], "ImagePositionPatient", ["nan", 0, 0]),
        r"instance 3 \(.*\): ImagePositionPatient \[nan, 0.0, 0.0\] is not finite",
    ),
    "infinite_position": (
        lambda d: setattr(d[2], "ImagePositionPatient", [0, "inf", 0]),
        r"instance 3 \(.*\): ImagePositionPatient .* is not finite",
    ),
    "nan_orientation": (
        lambda d: setattr(d[0], "ImageOrientationPatient", [1, 0, 0, 0, 1, "nan"]),
        r"instance 1 \(.*\): ImageOrientationPatient .* is not finite",
    ),
    "nan_pixel_spacing": (
        lambda d: setattr(d[4], "PixelSpacing", ["nan", 0.7]),
        r"instance 5 \(.*\): PixelSpacing \[nan, 0.7\] is not finite",
    ),
    "zero_pixel_spacing": (
        lambda d: [setattr(x, "PixelSpacing", [0, 0]) for x in d],
        r"instance 1 \(.*\): PixelSpacing \[0.0, 0.0\] must be positive",
    ),
    "negative_pixel_spacing": (
        lambda d: [setattr(x, "PixelSpacing", [-0.7, -0.7]) for x in d],
        r"instance 1 \(.*\): PixelSpacing \[-0.7, -0.7\] must be positive",
    ),
    "one_value_pixel_spacing": (
        lambda d: setattr(d[1], "PixelSpacing", 0.7),
        r"instance 2 \(.*\): PixelSpacing must have 2 values, got 1",
    ),
    "zero_rescale_slope": (
        lambda d: [setattr(x, "RescaleSlope", 0) for x in d],
        r"instance 1 \(.*\): RescaleSlope 0.0 must be a finite non-zero number",
    ),
    "nan_rescale_slope": (
        lambda d: setattr(d[2], "RescaleSlope", "nan"),
        r"instance 3 \(.*\): RescaleSlope nan must be a finite non-zero number",
    ),
    "infinite_rescale_intercept": (
        lambda d: setattr(d[3], "RescaleIntercept", "-inf"),
        r"instance 4 \(.*\): RescaleIntercept -inf is not finite",
    ),
    "unreadable_rescale_slope": (
        lambda d: _as_read(d[3], "RescaleSlope", b"abc "),
        r"instance 4 \(.*\): unreadable RescaleSlope 'abc'",
    ),
}


@pytest.mark.filterwarnings("ignore:The number of bytes of compressed pixel data")
@pytest.mark.filterwarnings("ignore:Invalid value for VR DS")
@pytest.mark.parametrize(("damage", "match"), _ONE_BAD_ATTRIBUTE.values(), ids=_ONE_BAD_ATTRIBUTE)
def test_one_bad_attribute_is_refused(damage: Callable[[list[Dataset]], None], match: str) -> None:
    datasets = small()
    damage(datasets)
    with pytest.raises(VolumeError, match=match):
        assemble_from_datasets(datasets)


def test_enhanced_ct_bad_frame_values_are_refused(tmp_path: Path) -> None:
    """The multi-frame path reads its functional groups through the same checks."""
    ds = pydicom.dcmread(enhanced(tmp_path, per_frame_rescale=True))
    ds.PerFrameFunctionalGroupsSequence[2].PixelValueTransformationSequence[0].RescaleSlope = 0
    with pytest.raises(VolumeError, match=r"frame 3 of instance .*: RescaleSlope 0.0 must be"):
        assemble_from_datasets([ds])
    ds = pydicom.dcmread(enhanced(tmp_path))
    ds.SharedFunctionalGroupsSequence[0].PixelMeasuresSequence[0].PixelSpacing = [0.7, 0]
    with pytest.raises(
        VolumeError, match=r"frame 1 of instance .*: PixelSpacing \[0.7, 0.0\] must"
    ):
        assemble_from_datasets([ds])


def test_non_ct_modality() -> None:
    with pytest.raises(VolumeError, match="modality 'MR'"):
        assemble_from_datasets(small(modality="MR"))


def test_mixed_sizes() -> None:
    datasets = small()
    other = small(dataclasses.replace(SMALL, rows=16))
    datasets[2].Rows = 16
    datasets[2].PixelData = other[2].PixelData
    with pytest.raises(VolumeError, match=r"mixed sizes: instance 3 \(.*\) is 16x40"):
        assemble_from_datasets(datasets)


def test_not_dicom(tmp_path: Path) -> None:
    paths = write_synthetic_series(tmp_path, SMALL)
    junk = tmp_path / "notes.txt"
    junk.write_text("not an image")
    with pytest.raises(VolumeError, match="notes.txt is not a DICOM file"):
        assemble_volume([*paths, junk])


def test_multiframe_mixed_with_single_frames(tmp_path: Path) -> None:
    path = enhanced(tmp_path)
    with pytest.raises(VolumeError, match="of which 1 are multi-frame"):
        assemble_from_datasets([pydicom.dcmread(path), *small()])


def test_axial_constant_is_identity_orientation() -> None:
    assert AXIAL == (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)
