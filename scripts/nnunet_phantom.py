"""A CT phantom defined in patient space, for training and checking a real nnU-Net model.

The phantom is a function of the patient coordinate (LPS, millimetres), so the same anatomy can
be sampled on any grid: head-first or feet-first, axial or coronal, 0.7 mm or 5 mm. It has
three structures whose labels are known exactly:

1. body (soft tissue, about 40 HU), an elliptic cylinder along the patient axis;
2. lungs (about -820 HU), two ellipsoids of different size, the left one higher;
3. bone (about 650 HU), a spine behind and a sternum in front of the upper half only.

Nothing is symmetric under a flip of any axis, so an orientation error shows as a low Dice.
:mod:`scripts.make_nnunet_trained` trains nnU-Net v2 on it; the oracle tests sample the same
phantom as DICOM series and compare segnode with nnU-Net's own predictor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

AXIAL_HFS = (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)
"""Image Orientation (Patient) of an axial head-first supine series."""
AXIAL_FFS = (-1.0, 0.0, 0.0, 0.0, 1.0, 0.0)
"""Axial feet-first supine: rows run toward the patient's right, slices toward the feet."""
CORONAL = (1.0, 0.0, 0.0, 0.0, 0.0, -1.0)
"""Coronal: rows toward the patient's left, columns toward the feet, slices posterior."""

LABELS = {"background": 0, "body": 1, "lung": 2, "bone": 3}


@dataclass(frozen=True)
class Anatomy:
    """Shape parameters of one phantom (millimetres, LPS)."""

    body_axes: tuple[float, float] = (60.0, 45.0)
    body_z: tuple[float, float] = (-40.0, 40.0)
    shift: tuple[float, float, float] = (0.0, 0.0, 0.0)
    right_lung: tuple[float, ...] = (-27.0, -2.0, 5.0, 20.0, 27.0, 28.0)
    """Centre (x, y, z) and radii of the right lung (patient right is -x)."""
    left_lung: tuple[float, ...] = (28.0, -2.0, 12.0, 16.0, 24.0, 22.0)
    spine_radius: float = 9.0
    spine_y: float = 32.0
    noise_hu: float = 20.0
    seed: int = 0

    @staticmethod
    def random(rng: np.random.Generator) -> Anatomy:
        """A random variation of the default anatomy (sizes within 15 %, shifts within 8 mm)."""

        def jitter(values: Sequence[float], rel: float) -> tuple[float, ...]:
            return tuple(float(v) * float(rng.uniform(1 - rel, 1 + rel)) for v in values)

        base = Anatomy()
        rl, ll = base.right_lung, base.left_lung
        return Anatomy(
            body_axes=(jitter(base.body_axes, 0.15)[0], jitter(base.body_axes, 0.15)[1]),
            body_z=base.body_z,
            shift=tuple(float(v) for v in rng.uniform(-8, 8, size=3)),  # type: ignore[arg-type]
            right_lung=tuple(rl[:3]) + jitter(rl[3:], 0.15),
            left_lung=tuple(ll[:3]) + jitter(ll[3:], 0.15),
            spine_radius=float(rng.uniform(7.5, 10.5)),
            spine_y=float(rng.uniform(28, 35)),
            noise_hu=float(rng.uniform(10, 30)),
            seed=int(rng.integers(1 << 30)),
        )


@dataclass(frozen=True)
class Grid:
    """A DICOM-style sampling grid: ``slices`` images of ``rows`` x ``columns``.

    Voxel ``(k, r, c)`` lies at ``origin + c * pixel * row + r * pixel * column + k * slice *
    normal`` with ``normal = row x column``; this is the order in which segnode stacks a
    series and in which SimpleITK reads the NIfTI written by :func:`write_nifti`.
    """

    slices: int
    rows: int
    columns: int
    pixel: float
    slice: float
    orientation: tuple[float, ...] = AXIAL_HFS
    centre: tuple[float, float, float] = (0.0, 0.0, 0.0)
    extra: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def covering(
        fov: tuple[float, float, float],
        pixel: float,
        slice: float,
        orientation: tuple[float, ...] = AXIAL_HFS,
    ) -> Grid:
        """The grid whose rows, columns and slices span ``fov`` (mm along row, column, normal)."""
        return Grid(
            slices=round(fov[2] / slice),
            rows=round(fov[1] / pixel),
            columns=round(fov[0] / pixel),
            pixel=pixel,
            slice=slice,
            orientation=orientation,
        )

    @property
    def directions(self) -> tuple[npt.NDArray[np.float64], ...]:
        """Row, column and normal unit vectors (LPS)."""
        row = np.asarray(self.orientation[:3], dtype=np.float64)
        col = np.asarray(self.orientation[3:], dtype=np.float64)
        return row, col, np.cross(row, col)

    @property
    def origin(self) -> npt.NDArray[np.float64]:
        """Image Position (Patient) of the first slice (the grid is centred on ``centre``)."""
        row, col, normal = self.directions
        return np.asarray(self.centre, dtype=np.float64) - (
            (self.columns - 1) / 2 * self.pixel * row
            + (self.rows - 1) / 2 * self.pixel * col
            + (self.slices - 1) / 2 * self.slice * normal
        )

    def points(self) -> npt.NDArray[np.float64]:
        """LPS coordinates of every voxel centre, shape ``(slices, rows, columns, 3)``."""
        row, col, normal = self.directions
        k = np.arange(self.slices, dtype=np.float64)[:, None, None, None]
        r = np.arange(self.rows, dtype=np.float64)[None, :, None, None]
        c = np.arange(self.columns, dtype=np.float64)[None, None, :, None]
        return self.origin + c * self.pixel * row + r * self.pixel * col + k * self.slice * normal


def sample(grid: Grid, anatomy: Anatomy) -> tuple[npt.NDArray[np.int16], npt.NDArray[np.uint8]]:
    """HU image and label map of ``anatomy`` on ``grid``, both ``(slices, rows, columns)``."""
    p = grid.points() - np.asarray(anatomy.shift)
    x, y, z = p[..., 0], p[..., 1], p[..., 2]
    a, b = anatomy.body_axes
    body = (
        ((x / a) ** 2 + (y / b) ** 2 <= 1.0) & (z >= anatomy.body_z[0]) & (z <= anatomy.body_z[1])
    )

    def ellipsoid(spec: tuple[float, ...]) -> npt.NDArray[np.bool_]:
        cx, cy, cz, rx, ry, rz = spec
        return ((x - cx) / rx) ** 2 + ((y - cy) / ry) ** 2 + ((z - cz) / rz) ** 2 <= 1.0

    lung = body & (ellipsoid(anatomy.right_lung) | ellipsoid(anatomy.left_lung))
    spine = body & (x**2 + (y - anatomy.spine_y) ** 2 <= anatomy.spine_radius**2)
    sternum = body & (np.abs(x) <= 6.0) & (np.abs(y + b * 0.82) <= 4.0) & (z >= 0.0)
    bone = (spine | sternum) & ~lung

    labels = np.zeros(body.shape, dtype=np.uint8)
    labels[body] = LABELS["body"]
    labels[lung] = LABELS["lung"]
    labels[bone] = LABELS["bone"]
    hu = np.full(body.shape, -1000.0)
    hu[body] = 40.0
    hu[lung] = -820.0
    hu[bone] = 650.0
    rng = np.random.default_rng(anatomy.seed)
    hu += rng.normal(0.0, anatomy.noise_hu, size=hu.shape)
    return np.clip(np.rint(hu), -1024, 3071).astype(np.int16), labels


def dice(a: npt.NDArray[Any], b: npt.NDArray[Any], label: Any) -> float:
    """Dice of ``label`` between two label maps (1.0 when both lack it); ``label=True`` on
    two boolean masks compares the masks."""
    x, y = a == label, b == label
    total = int(x.sum()) + int(y.sum())
    return 1.0 if total == 0 else 2.0 * int((x & y).sum()) / total


def write_nifti(path: str, grid: Grid, array: npt.NDArray[np.generic]) -> None:
    """Write ``array`` (``(slices, rows, columns)``) with ``grid``'s geometry (SimpleITK)."""
    import SimpleITK as sitk  # noqa: N813 - its conventional name

    image = sitk.GetImageFromArray(array)
    image.SetSpacing((grid.pixel, grid.pixel, grid.slice))
    image.SetOrigin(tuple(float(v) for v in grid.origin))
    row, col, normal = grid.directions
    image.SetDirection(tuple(float(v) for v in np.stack([row, col, normal], axis=1).ravel()))
    sitk.WriteImage(image, path)


FOV = (150.0, 120.0, 100.0)
"""Field of view of the test series (mm along rows, columns and slices)."""


@dataclass(frozen=True)
class OracleCase:
    """One series of the oracle comparison."""

    name: str
    grid: Grid
    anatomy: Anatomy


def oracle_cases() -> tuple[OracleCase, ...]:
    """The series segnode and ``nnUNetPredictor`` are compared on."""
    anatomy = Anatomy(
        body_axes=(57.0, 47.0), shift=(3.0, -2.0, 4.0), spine_radius=8.5, noise_hu=18.0, seed=7
    )
    return (
        OracleCase("native_hfs", Grid.covering(FOV, 0.7, 1.25), anatomy),
        OracleCase("aniso_hfs", Grid.covering(FOV, 0.8, 5.0), anatomy),
        OracleCase("iso15_hfs", Grid.covering(FOV, 1.5, 1.5), anatomy),
        OracleCase("native_ffs", Grid.covering(FOV, 0.7, 1.25, AXIAL_FFS), anatomy),
        OracleCase(
            "coronal",
            Grid.covering((FOV[0], FOV[2], FOV[1]), 0.8, 1.5, CORONAL),
            anatomy,
        ),
    )


def write_dicom_case(case: OracleCase, folder: Path, seed: int) -> list[Path]:
    """The case's phantom written as a CT series (one file per slice) with the case's geometry."""
    from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series  # noqa: PLC0415 - only this helper needs it

    hu, _ = sample(case.grid, case.anatomy)
    g = case.grid
    assert g.orientation is not None
    return write_synthetic_series(
        folder,
        PhantomGeometry(
            rows=g.rows,
            columns=g.columns,
            slices=g.slices,
            pixel_spacing=g.pixel,
            slice_spacing=g.slice,
            orientation=g.orientation,
            origin=tuple(float(v) for v in g.origin),
        ),
        seed=seed,
        hu=hu,
    )
