"""From a volume's patient geometry to a model's axis order and orientation, and back.

A CT volume arrives as an array ``(slices, rows, columns)`` whose axes point wherever the
modality put them: Image Orientation (Patient) gives the row and column directions and the
slice positions give the stacking direction (PS3.3 C.7.6.2.1.1). A trained model expects its
arrays in one convention, e.g. the ``(S, A, R)`` array that SimpleITK returns for a NIfTI file
that nibabel made RAS-canonical (TotalSegmentator), or the array as stored (nnU-Net with
``SimpleITKIO`` and DICOM-converted data). This module finds the axis permutation and flips
that take one to the other. Nothing is interpolated: a voxel keeps its value, the grid is only
re-indexed, so the way back is exact.

Orientation codes name, for each array axis in order, the patient direction toward which the
index increases, with the letters of the patient coordinate system (PS3.3 C.7.6.1.1.1, with S
and I for head and feet as in NIfTI): ``L``/``R`` (patient left/right), ``P``/``A``
(posterior/anterior), ``S``/``I`` (superior/inferior). The node's own volume of a head-first
supine axial series is ``"SPL"``: slices toward the head, rows toward the back, columns toward
the patient's left.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from segnode.engines.base import EngineError

Vector = tuple[float, float, float]

TILT_TOLERANCE_DEGREES = 1.0
"""Largest angle between an array axis and its patient axis, or between the slice stacking
direction and the slice normal, that still counts as an untilted, axis-aligned series."""

_LETTERS: dict[str, tuple[int, int]] = {
    "L": (0, 1),
    "R": (0, -1),
    "P": (1, 1),
    "A": (1, -1),
    "S": (2, 1),
    "I": (2, -1),
}
"""Letter -> (LPS axis, sign): DICOM's patient coordinates are +x left, +y posterior, +z head."""

SOURCE = "source"
"""Orientation value meaning "the array as the node stores it": no reorientation."""


class GeometryError(EngineError):
    """A volume's geometry does not fit the model (gantry tilt, oblique or degenerate axes);
    the message says why."""


class VolumeGeometry(Protocol):
    """What :meth:`Geometry.from_volume` reads (:class:`segnode.node.ingest.volume.Volume` provides
    it)."""

    @property
    def row_direction(self) -> Vector:
        """Direction cosines of the rows (the first three of Image Orientation (Patient))."""

    @property
    def column_direction(self) -> Vector:
        """Direction cosines of the columns (the last three)."""

    @property
    def spacing(self) -> Vector:
        """Voxel spacing in millimetres, ``(z, y, x)``."""

    @property
    def slice_positions(self) -> tuple[Vector, ...]:
        """Image Position (Patient) of each slice, in volume order."""


def check_orientation_code(code: str) -> str:
    """Return ``code`` upper-cased if it names one direction per patient axis.

    Raises
    ------
    ValueError
        Unless ``code`` is three letters of ``LRPASI`` with one of L/R, one of P/A and one of
        S/I.
    """
    upper = code.upper()
    if len(upper) != 3 or any(c not in _LETTERS for c in upper):
        raise ValueError(f"orientation {code!r} must be three letters of L, R, P, A, S, I")
    if sorted(_LETTERS[c][0] for c in upper) != [0, 1, 2]:
        raise ValueError(f"orientation {code!r} must name each of L/R, P/A and S/I once")
    return upper


@dataclass(frozen=True)
class Geometry:
    """Where the axes of a ``(z, y, x)`` volume point in the patient, and their spacing.

    Attributes
    ----------
    directions
        Unit LPS vector of increasing index along array axes 0, 1 and 2.
    spacing
        Distance in mm between neighbouring voxel centres along axes 0, 1 and 2.
    plane_normal
        Normal of the image plane (row x column direction); differs from ``directions[0]``
        only for a sheared (gantry-tilted) stack.
    """

    directions: tuple[Vector, Vector, Vector]
    spacing: Vector
    plane_normal: Vector

    @classmethod
    def from_image_plane(
        cls,
        row_direction: Sequence[float],
        column_direction: Sequence[float],
        slice_positions: Sequence[Sequence[float]],
        pixel_spacing: Sequence[float],
    ) -> Geometry:
        """Geometry of a stack of slices of the Image Plane Module (PS3.3 C.7.6.2.1.1).

        Parameters
        ----------
        row_direction, column_direction
            Image Orientation (Patient) ``[:3]`` (direction of increasing column index, array
            axis 2) and ``[3:]`` (increasing row index, array axis 1).
        slice_positions
            Image Position (Patient) of each slice in array order (at least two); the slice
            axis points from the first to the last, so a descending stack is handled too.
        pixel_spacing
            Pixel Spacing: (between rows, between columns) in mm.

        Raises
        ------
        GeometryError
            Fewer than two slices, coincident first and last slices, or directions that are
            not unit vectors.
        """
        if len(slice_positions) < 2:
            raise GeometryError("a volume needs at least two slice positions for its geometry")
        first = np.asarray(slice_positions[0], dtype=np.float64)
        last = np.asarray(slice_positions[-1], dtype=np.float64)
        span = float(np.linalg.norm(last - first))
        if span <= 0.0:
            raise GeometryError("the first and last slices are at the same position")
        row = np.asarray(row_direction, dtype=np.float64)
        col = np.asarray(column_direction, dtype=np.float64)
        for name, vec in (("row direction", row), ("column direction", col)):
            if abs(float(np.linalg.norm(vec)) - 1.0) > 1e-3:
                raise GeometryError(f"{name} {vec.tolist()} is not a unit vector")
        normal = np.cross(row, col)
        return cls(
            directions=(_vec((last - first) / span), _vec(col), _vec(row)),
            spacing=(
                span / (len(slice_positions) - 1),
                float(pixel_spacing[0]),
                float(pixel_spacing[1]),
            ),
            plane_normal=_vec(normal / np.linalg.norm(normal)),
        )

    @classmethod
    def from_volume(cls, volume: VolumeGeometry) -> Geometry:
        """Geometry of a :class:`segnode.node.ingest.volume.Volume` (or anything with its
        attributes)."""
        return cls.from_image_plane(
            volume.row_direction,
            volume.column_direction,
            volume.slice_positions,
            volume.spacing[1:],
        )

    @property
    def shear_degrees(self) -> float:
        """Angle between the slice stacking direction and the image plane's normal: gantry
        tilt stored as a sheared stack (non-orthogonal grid)."""
        cos = abs(float(np.dot(self.directions[0], self.plane_normal)))
        return math.degrees(math.acos(min(1.0, cos)))

    @property
    def obliquity_degrees(self) -> float:
        """Largest angle between an array axis and the patient axis nearest to it."""
        worst = 0.0
        for d in self.directions:
            cos = float(np.max(np.abs(d)))
            worst = max(worst, math.degrees(math.acos(min(1.0, cos))))
        return worst

    def orientation_code(self) -> str:
        """The nearest orientation code, e.g. ``"SPL"`` for a head-first supine axial series."""
        code = ""
        for d in self.directions:
            axis = int(np.argmax(np.abs(d)))
            sign = 1 if d[axis] > 0 else -1
            code += next(c for c, v in _LETTERS.items() if v == (axis, sign))
        return code


@dataclass(frozen=True)
class Reorientation:
    """An exact re-indexing of a ``(z, y, x)`` grid: a permutation, then flips.

    Model axis ``t`` is source axis ``permutation[t]``, reversed where ``flips[t]``.
    """

    permutation: tuple[int, int, int] = (0, 1, 2)
    flips: tuple[bool, bool, bool] = (False, False, False)

    @property
    def is_identity(self) -> bool:
        """Whether the model's grid is the source grid."""
        return self.permutation == (0, 1, 2) and not any(self.flips)

    def to_model(self, array: Any, xp: Any) -> Any:
        """The source-grid ``array`` (last three axes spatial) on the model's grid (a view
        where the namespace makes one; ``array`` itself for the identity)."""
        if self.is_identity:
            return array
        lead = array.ndim - 3
        axes = (*range(lead), *(lead + p for p in self.permutation))
        out = xp.permute_dims(array, axes)
        flipped = tuple(lead + t for t, f in enumerate(self.flips) if f)
        return xp.flip(out, axis=flipped) if flipped else out

    def to_source(self, array: Any, xp: Any) -> Any:
        """The model-grid ``array`` (last three axes spatial) back on the source grid."""
        if self.is_identity:
            return array
        lead = array.ndim - 3
        flipped = tuple(lead + t for t, f in enumerate(self.flips) if f)
        out = xp.flip(array, axis=flipped) if flipped else array
        inverse = [0, 0, 0]
        for t, p in enumerate(self.permutation):
            inverse[p] = t
        return xp.permute_dims(out, (*range(lead), *(lead + i for i in inverse)))

    def spacing_to_model(self, spacing: Sequence[float]) -> Vector:
        """Source spacing ``(z, y, x)`` in the model's axis order."""
        a, b, c = (float(spacing[p]) for p in self.permutation)
        return (a, b, c)


def plan_reorientation(
    geometry: Geometry,
    orientation: str,
    *,
    tilt_allowed: bool = False,
    tolerance_degrees: float = TILT_TOLERANCE_DEGREES,
) -> Reorientation:
    """The re-indexing that takes a volume with ``geometry`` to a model's ``orientation``.

    Parameters
    ----------
    geometry
        The source volume's geometry.
    orientation
        The model's orientation code (e.g. ``"SAR"``), or ``"source"`` for the array as
        stored (identity; the tilt check still applies).
    tilt_allowed
        Accept a sheared (gantry-tilted) or oblique grid: its axes are then mapped to the
        nearest patient axes, as nibabel's ``as_closest_canonical`` does.
    tolerance_degrees
        Largest shear or obliquity accepted when ``tilt_allowed`` is false.

    Raises
    ------
    GeometryError
        A tilted or oblique series when not allowed (the message gives the angle), or axes
        that do not map one-to-one onto patient axes.
    """
    if not tilt_allowed:
        if geometry.shear_degrees > tolerance_degrees:
            raise GeometryError(
                f"gantry-tilted series: the slices are stacked {geometry.shear_degrees:.1f} "
                "degrees off the image plane's normal (non-orthogonal grid); the model does not "
                "accept tilted series (gantry_tilt_allowed); reconstruct without tilt"
            )
        if geometry.obliquity_degrees > tolerance_degrees:
            raise GeometryError(
                f"oblique series: an image axis is {geometry.obliquity_degrees:.1f} degrees "
                "off the nearest patient axis (gantry tilt or an oblique reformat); the model "
                "does not accept it (gantry_tilt_allowed)"
            )
    if orientation == SOURCE:
        return Reorientation()
    wanted = check_orientation_code(orientation)
    source = geometry.orientation_code()
    source_axes = [_LETTERS[c] for c in source]
    if sorted(axis for axis, _ in source_axes) != [0, 1, 2]:
        raise GeometryError(
            f"array axes {geometry.directions} do not map one-to-one onto patient axes "
            f"(nearest orientation {source!r})"
        )
    permutation: list[int] = []
    flips: list[bool] = []
    for letter in wanted:
        axis, sign = _LETTERS[letter]
        a = next(i for i, (ax, _) in enumerate(source_axes) if ax == axis)
        permutation.append(a)
        flips.append(source_axes[a][1] != sign)
    return Reorientation(
        permutation=(permutation[0], permutation[1], permutation[2]),
        flips=(flips[0], flips[1], flips[2]),
    )


def _vec(a: Any) -> Vector:
    x, y, z = (float(v) for v in np.asarray(a, dtype=np.float64))
    return (x, y, z)
