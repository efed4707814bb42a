"""Resampling to a model's voxel spacing and back, with nnU-Net v2's rules.

nnU-Net (``nnunetv2/preprocessing/resampling/default_resampling.py``) resamples

* the image with a cubic B-spline (order 3), the logits back with order 1, label maps with
  order 0 (nearest);
* in one 3-D pass when the grid is roughly isotropic, but in two passes when it is
  anisotropic: each slice in-plane with the order above, then the low-resolution axis with
  order 0 (``order_z``). It resamples "separately in z" when the current spacing's largest /
  smallest ratio exceeds ``ANISO_THRESHOLD`` = 3, else when the target spacing's does; the
  low-resolution axis is the one with the largest spacing, and there is no separate pass when
  two or three axes share it.

Its in-plane and 3-D passes call scikit-image's ``resize(order, mode="edge",
anti_aliasing=False)``, which is ``scipy.ndimage.zoom(grid_mode=True, mode="nearest")``
followed by clipping to the input's range; the separate z pass is ``map_coordinates`` with
``mode="nearest"``. This module does the same arithmetic without SciPy, written against the
array API so that one code path runs on NumPy (CPU) and on torch or CuPy (GPU):

* a B-spline of order 3 is separable, so a 3-D zoom is three 1-D zooms; each pads the axis by
  12 edge voxels (SciPy's ``_prepad_for_spline_filter``), applies the exact recursive
  prefilter (pole sqrt(3) - 2, mirror-symmetric initialisation, as SciPy's ``ni_splines.c``),
  and evaluates the spline at ``(o + 0.5) * n_in / n_out - 0.5``;
* order 1 is linear and order 0 the nearest voxel (``floor(c + 0.5)``) at the same
  coordinates, indices clamped to the edge (SciPy's ``"nearest"`` mode).

``grid="corners"`` evaluates at ``o * (n_in - 1) / (n_out - 1)`` instead: the first and last
voxel centres stay in place, as ``scipy.ndimage.zoom(grid_mode=False, mode="nearest")``, which
TotalSegmentator's ``change_spacing`` calls (orders 0 and 1; no clipping, which linear and
nearest interpolation never need).

Coordinates and weights are computed on the host in float64 (small 1-D tables) and moved to
the array's device; the volume arithmetic runs in float64 unless ``precise=False``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from array_api_compat import array_namespace
from array_api_compat import device as array_device

ANISO_THRESHOLD = 3.0
"""nnU-Net's ``nnunetv2.configuration.ANISO_THRESHOLD``."""

ORDERS = (0, 1, 3)
"""Interpolation orders this module implements."""

GRIDS = ("centers", "corners")
"""Coordinate conventions: scikit-image / nnU-Net (``"centers"``) and ``scipy.ndimage.zoom``
with ``grid_mode=False`` (``"corners"``, TotalSegmentator)."""

_PAD = 12  # SciPy pads by 12 edge voxels before an order > 1 spline prefilter
_POLE = math.sqrt(3.0) - 2.0  # the cubic B-spline's prefilter pole


def compute_new_shape(
    old_shape: Sequence[int], old_spacing: Sequence[float], new_spacing: Sequence[float]
) -> tuple[int, ...]:
    """Shape of a grid resampled from ``old_spacing`` to ``new_spacing``.

    ``round(old_spacing / new_spacing * old_shape)`` per axis, with Python's rounding (half to
    even), as nnU-Net's ``compute_new_shape``.
    """
    if not len(old_shape) == len(old_spacing) == len(new_spacing):
        raise ValueError("shape and spacings must have the same length")
    return tuple(
        int(round(s / t * n)) for n, s, t in zip(old_shape, old_spacing, new_spacing, strict=True)
    )


def separate_z_axis(
    current_spacing: Sequence[float],
    new_spacing: Sequence[float],
    *,
    threshold: float = ANISO_THRESHOLD,
    force: bool | None = None,
) -> int | None:
    """The axis to resample separately (with ``order_z``), or ``None`` for one 3-D pass.

    nnU-Net's ``determine_do_sep_z_and_axis``: with ``force=None`` the current spacing
    decides if its max/min ratio exceeds ``threshold``, else the new spacing does; the axis is
    the one with the largest spacing of the deciding spacing, and ``None`` when two or three
    axes tie for it. ``force=False`` never separates; ``force=True`` always does (the current
    spacing's coarsest axis).
    """
    if force is False:
        return None
    if force is True:
        deciding: Sequence[float] | None = current_spacing
    elif max(current_spacing) / min(current_spacing) > threshold:
        deciding = current_spacing
    elif max(new_spacing) / min(new_spacing) > threshold:
        deciding = new_spacing
    else:
        deciding = None
    if deciding is None:
        return None
    largest = max(deciding)
    axes = [i for i, s in enumerate(deciding) if largest / s == 1]
    return axes[0] if len(axes) == 1 else None


def resample(
    data: Any,
    new_shape: Sequence[int],
    *,
    order: int,
    separate_axis: int | None = None,
    order_z: int = 0,
    precise: bool = True,
    grid: str = "centers",
) -> Any:
    """Resample a ``(C, z, y, x)`` array to ``(C, *new_shape)``, as nnU-Net's
    ``resample_data_or_seg`` with ``is_seg=False``.

    Parameters
    ----------
    data
        Array of any array-API namespace (NumPy, torch, CuPy), channels first.
    new_shape
        Spatial shape wanted.
    order
        0, 1 or 3: interpolation order (in-plane only when ``separate_axis`` is given).
    separate_axis
        Spatial axis (0, 1 or 2) resampled in a second pass with ``order_z``; see
        :func:`separate_z_axis`.
    order_z
        0 or 1: order along ``separate_axis``.
    precise
        Compute in float64 (as nnU-Net does); ``False`` keeps float32 (faster on a GPU,
        differences about 1e-6 relative).
    grid
        ``"centers"`` (nnU-Net) or ``"corners"`` (TotalSegmentator; orders 0 and 1, one 3-D
        pass): see the module docstring.

    Returns
    -------
    array
        Same namespace, device and dtype as ``data`` (the input itself when the shape is
        already ``new_shape``).
    """
    xp = array_namespace(data)
    if data.ndim != 4:
        raise ValueError(f"data must be (C, z, y, x), got shape {tuple(data.shape)}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order}")
    if order_z not in (0, 1):
        raise ValueError(f"order_z must be 0 or 1, got {order_z}")
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
    if grid == "corners" and (order > 1 or separate_axis is not None):
        raise ValueError("grid='corners' supports orders 0 and 1 in one 3-D pass")
    shape = tuple(int(n) for n in data.shape[1:])
    target = tuple(int(n) for n in new_shape)
    if len(target) != 3 or min(target) < 1:
        raise ValueError(f"new_shape must be three positive sizes, got {tuple(new_shape)}")
    if shape == target:
        return data
    work_dtype = xp.float64 if precise else xp.float32
    if grid == "corners":
        out = data
        for axis in (1, 2, 3):
            if shape[axis - 1] != target[axis - 1]:
                out = _pass(out, axis, target[axis - 1], order, xp, work_dtype, corners=True)
    elif separate_axis is None:
        out = _zoom(data, shape, target, (1, 2, 3), order, xp, work_dtype)
    else:
        if separate_axis not in (0, 1, 2):
            raise ValueError(f"separate_axis must be 0, 1, 2 or None, got {separate_axis}")
        plane = tuple(1 + a for a in range(3) if a != separate_axis)
        out = _zoom(data, shape, target, plane, order, xp, work_dtype)
        axis = 1 + separate_axis
        if shape[separate_axis] != target[separate_axis]:
            out = _pass(out, axis, target[separate_axis], order_z, xp, work_dtype)
    return xp.astype(out, data.dtype)


def resample_labels(labels: Any, new_shape: Sequence[int], *, grid: str = "centers") -> Any:
    """A ``(z, y, x)`` label map (any integer dtype) resampled to ``new_shape`` with nearest
    neighbours: :func:`resample` with ``order=0`` (and ``order_z=0``), which picks voxels
    and so gives the same labels whatever the separate axis, without a float copy of the
    output grid."""
    xp = array_namespace(labels)
    if grid not in GRIDS:
        raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
    target = tuple(int(n) for n in new_shape)
    if len(target) != 3 or min(target) < 1:
        raise ValueError(f"new_shape must be three positive sizes, got {tuple(new_shape)}")
    out = labels
    for axis in range(3):
        if int(out.shape[axis]) != target[axis]:
            out = _interpolate(out, axis, target[axis], 0, xp, corners=grid == "corners")
    return out


_CHUNK_BYTES = 64 * 1024 * 1024
"""Largest working array of one chunk of a resampling pass (about: the prefilter holds a
few of them)."""


def _pass(
    data: Any,
    axis: int,
    size: int,
    order: int,
    xp: Any,
    work_dtype: Any,
    *,
    corners: bool = False,
) -> Any:
    """``data`` (``(C, z, y, x)``, any float dtype) interpolated along ``axis`` to ``size``
    in ``work_dtype``, chunk by chunk along another axis: each output element is computed
    from the same inputs with the same operations as in one piece, and no temporary is
    larger than about :data:`_CHUNK_BYTES` (a copy of the whole input in ``work_dtype``
    never exists)."""
    shape = [int(n) for n in data.shape]
    others = [a for a in range(4) if a != axis]
    along = max(others, key=lambda a: shape[a])
    row = (shape[axis] + 2 * _PAD) * 8
    for a in others:
        if a != along:
            row *= shape[a]
    step = max(1, _CHUNK_BYTES // max(1, row))
    out_shape = list(shape)
    out_shape[axis] = size
    out = xp.empty(tuple(out_shape), dtype=work_dtype, device=array_device(data))
    for first in range(0, shape[along], step):
        where = [slice(None)] * 4
        where[along] = slice(first, min(shape[along], first + step))
        piece = xp.astype(data[tuple(where)], work_dtype)
        if order > 1:
            piece = _prefilter(_pad_edge(piece, axis, xp), axis, xp)
        out[tuple(where)] = _interpolate(
            piece, axis, size, order, xp, padded=order > 1, corners=corners
        )
    return out


def _zoom(
    data: Any,
    shape: tuple[int, ...],
    target: tuple[int, ...],
    axes: tuple[int, ...],
    order: int,
    xp: Any,
    work_dtype: Any,
) -> Any:
    """scikit-image ``resize`` over ``axes`` of ``data`` (each channel and, for in-plane
    axes, each slice on its own): separable zoom, then clip to the input's range."""
    changed = [a for a in axes if shape[a - 1] != target[a - 1]]
    if not changed:
        return data
    out = data
    for axis in changed:
        out = _pass(out, axis, target[axis - 1], order, xp, work_dtype)
    if order > 0:  # scikit-image clips the output to the input's range (clip=True)
        low = xp.astype(xp.min(data, axis=axes, keepdims=True), work_dtype)
        high = xp.astype(xp.max(data, axis=axes, keepdims=True), work_dtype)
        along = axes[0]  # reduced in the bounds: a chunk along it broadcasts against them
        step = max(1, _CHUNK_BYTES // max(1, _nbytes(out) // int(out.shape[along])))
        for first in range(0, int(out.shape[along]), step):
            where = [slice(None)] * 4
            where[along] = slice(first, first + step)
            part = out[tuple(where)]
            out[tuple(where)] = xp.minimum(xp.maximum(part, low), high)
    return out


def _nbytes(array: Any) -> int:
    count = 1
    for n in array.shape:
        count *= int(n)
    return count * 8


def _pad_edge(data: Any, axis: int, xp: Any) -> Any:
    n = int(data.shape[axis])
    index = np.clip(np.arange(-_PAD, n + _PAD), 0, n - 1)
    return xp.take(data, xp.asarray(index, device=array_device(data)), axis=axis)


def _prefilter(data: Any, axis: int, xp: Any) -> Any:
    """Cubic B-spline coefficients along ``axis`` (SciPy's ``spline_filter1d``, order 3,
    mirror initialisation, gain 6)."""
    moved = xp.moveaxis(data, axis, 0)
    c = moved * 6.0  # gain (1 - z)(1 - 1/z) of the single pole
    n = int(c.shape[0])
    z = _POLE
    if n == 1:
        return xp.moveaxis(c, 0, axis)
    # causal initialisation (mirror): c0 = sum of z^i c_i over the mirrored signal
    weights = np.zeros(n)
    z_n_1 = z ** (n - 1)
    weights[0] += 1.0
    weights[n - 1] += z_n_1
    powers = z ** np.arange(1, n - 1, dtype=np.float64)
    weights[1 : n - 1] += powers
    weights[n - 2 : 0 : -1] += powers * z_n_1
    weights /= 1.0 - z_n_1 * z_n_1
    w = xp.asarray(weights, dtype=c.dtype, device=array_device(c))
    w = xp.reshape(w, (n,) + (1,) * (c.ndim - 1))
    rows = [xp.sum(c * w, axis=0)]
    for i in range(1, n):
        rows.append(c[i, ...] + z * rows[i - 1])
    # anti-causal initialisation (mirror), then the backward recursion
    last = (z * rows[n - 2] + rows[n - 1]) * z / (z * z - 1.0)
    out = [last]
    for i in range(n - 2, -1, -1):
        out.append(z * (out[-1] - rows[i]))
    out.reverse()
    return xp.moveaxis(xp.stack(out, axis=0), 0, axis)


def _interpolate(
    data: Any,
    axis: int,
    size: int,
    order: int,
    xp: Any,
    *,
    padded: bool = False,
    corners: bool = False,
    window: tuple[int, int, int, int] | None = None,
) -> Any:
    """Evaluate ``data`` along ``axis`` at ``size`` grid-mode coordinates (order 0, 1 or 3;
    order 3 expects spline coefficients padded by ``_PAD``), or corner-aligned ones.

    ``window = (n, start, out_start, out_stop)`` (orders 0 and 1): ``data`` holds input
    rows ``start ..`` of an axis of ``n`` rows (at least those that outputs ``out_start ..
    out_stop - 1`` read, :func:`source_rows`); only those outputs are computed, each as
    in the whole axis' evaluation."""
    if window is None:
        n = int(data.shape[axis]) - (2 * _PAD if padded else 0)
        start, out_start, out_stop = 0, 0, size
    else:
        n, start, out_start, out_stop = window
    coords = _coordinates(n, size, corners)[out_start:out_stop]
    dev = array_device(data)
    shape = [1] * data.ndim
    shape[axis] = out_stop - out_start

    def weighted(index: Any, weight: Any) -> Any:
        taken = xp.take(data, xp.asarray(index - start, dtype=xp.int64, device=dev), axis=axis)
        return taken * xp.reshape(xp.asarray(weight, dtype=data.dtype, device=dev), shape)

    if order == 0:
        index = np.clip(np.floor(coords + 0.5).astype(np.int64), 0, n - 1)
        return xp.take(data, xp.asarray(index - start, device=dev), axis=axis)
    base = np.floor(coords)
    t = coords - base
    first = base.astype(np.int64)
    if order == 1:
        left = np.clip(first, 0, n - 1)
        right = np.clip(first + 1, 0, n - 1)
        return weighted(left, 1.0 - t) + weighted(right, t)
    first = first - 1 + _PAD
    t2, t3 = t * t, t * t * t
    taps = (
        (1.0 - t) ** 3 / 6.0,
        (3.0 * t3 - 6.0 * t2 + 4.0) / 6.0,
        (-3.0 * t3 + 3.0 * t2 + 3.0 * t + 1.0) / 6.0,
        t3 / 6.0,
    )
    out = weighted(first, taps[0])
    for k in range(1, 4):
        out = out + weighted(first + k, taps[k])
    return out


def _coordinates(n: int, size: int, corners: bool) -> npt.NDArray[np.float64]:
    """Input coordinates of ``size`` outputs along an axis of ``n`` inputs."""
    if corners:
        step = (n - 1) / (size - 1) if size > 1 else 0.0
        return np.arange(size, dtype=np.float64) * step
    scale = float(n) / size
    return scale * (np.arange(size, dtype=np.float64) + 0.5) - 0.5


def source_rows(
    n: int, size: int, order: int, out_start: int, out_stop: int, *, corners: bool = False
) -> tuple[int, int]:
    """Input rows ``(start, stop)`` that outputs ``out_start .. out_stop - 1`` of an axis of
    ``n`` inputs resampled to ``size`` read at ``order`` 0 or 1."""
    if order not in (0, 1):
        raise ValueError(f"source_rows: order 0 or 1, got {order}")
    coords = _coordinates(n, size, corners)[[out_start, out_stop - 1]]
    if order == 0:
        index = np.clip(np.floor(coords + 0.5).astype(np.int64), 0, n - 1)
        return int(index[0]), int(index[1]) + 1
    base = np.floor(coords).astype(np.int64)
    return int(np.clip(base[0], 0, n - 1)), int(np.clip(base[1] + 1, 0, n - 1)) + 1
