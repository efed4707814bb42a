"""From a model's scores on its grid to labels on the source grid, slab by slab (issue 37).

nnU-Net's export (``nnunetv2/inference/export_prediction.py``) resamples the logits of every
label to the source shape, then takes the arg-max (or the regions' thresholds). For a model
of 118 labels and a 512 x 512 x 300 CT that is 9 G values, 69 GiB in float64: the memory goes
to labels x source voxels. Here the scores arrive in slabs along the model grid's first axis
(:func:`segnode.engines.nnunet_window.sliding_window_slabs`, or the whole array as one slab)
and each step keeps only a few slices:

* When the resampling back only picks voxels (order 0, as TotalSegmentator takes its labels
  back, or the identity when the grids are the same), the arg-max commutes with it: the labels
  are taken on the model grid, slab by slab, and the uint8 label map is resampled
  (:func:`~segnode.engines.preprocess.resampling.resample_labels`).
* At order 1 (nnU-Net's default), the source grid is made a few slices at a time: the model
  slices each output slice reads along the first axis (:func:`source_rows`), the same 1-D
  passes as :func:`~segnode.engines.preprocess.resampling.resample` in the same order, a group
  of channels at a time, cast to float32, then the arg-max. Each value is the one the whole
  resampling gives, but for scikit-image's clipping to the input's range, which is left out:
  a linear interpolation never leaves that range but by float64 rounding, which the cast to
  float32 removes. Only with ``precise=True`` (float64, as nnU-Net); in float32 the clipping
  could move a value by one step, so ``precise=False`` resamples the whole array.
* For the arg-max of NumPy scores at order 0/1 the same values are computed only where the
  model grid's labels do not already decide (:func:`_streamed_argmax`: an output whose
  interpolation box has one label, with a margin, takes it; elsewhere only the channels that
  can win are interpolated); same labels as :func:`_streamed`, which regions and other
  namespaces keep.
* Otherwise (order 3 back) the slabs are put together and resampled whole, as before.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from array_api_compat import array_namespace
from array_api_compat import device as array_device

from segnode.engines.preprocess.resampling import (
    _coordinates,
    _interpolate,
    resample,
    resample_labels,
    source_rows,
)

Slabs = Iterable[tuple[int, int, Any]]
"""``(start, stop, scores)``: float ``(C, stop - start, y, x)`` scores of consecutive ranges of
the model grid's first axis, from 0 to its end."""

_CHUNK_BYTES = 32 * 1024 * 1024
"""Largest float64 array of one group of channels of one output chunk."""


@dataclass(frozen=True)
class Decision:
    """How scores become labels: the arg-max, or nnU-Net's regions.

    Attributes
    ----------
    regions_class_order
        Label value of each channel, for region-based models (``None``: arg-max).
    threshold
        A region's channel is on above it (0 for logits, 0.5 for probabilities).
    """

    regions_class_order: tuple[int, ...] | None = None
    threshold: float = 0.0

    def __call__(self, scores: Any) -> Any:
        """uint8 labels of ``(C, ...)`` scores."""
        xp = array_namespace(scores)
        if self.regions_class_order is None:
            return xp.astype(xp.argmax(scores, axis=0), xp.uint8)
        dev = array_device(scores)
        labels = xp.zeros(tuple(scores.shape[1:]), dtype=xp.uint8, device=dev)
        for channel, value in enumerate(self.regions_class_order):
            fill = xp.asarray(value, dtype=xp.uint8, device=dev)
            labels = xp.where(scores[channel, ...] > self.threshold, fill, labels)
        return labels


def labels_from_slabs(
    slabs: Slabs,
    decide: Decision,
    *,
    model_shape: tuple[int, ...],
    new_shape: tuple[int, ...],
    order: int,
    separate_axis: int | None,
    order_z: int,
    precise: bool,
) -> Any:
    """uint8 labels of ``new_shape`` from model-grid scores, as
    ``decide(resample(scores, new_shape, order=order, separate_axis=separate_axis,
    order_z=order_z, precise=precise))`` (see the module docstring for what is kept in
    memory and the one rounding left out).

    Raises
    ------
    ValueError
        A slab of the wrong shape, or slabs that do not cover the model grid in order.
    """
    stream = _checked(slabs, model_shape)
    picks = order == 0 and (
        separate_axis is None
        or order_z == 0
        or model_shape[separate_axis] == new_shape[separate_axis]
    )
    if picks or model_shape == new_shape:
        return resample_labels(_decided(stream, decide, model_shape), new_shape)
    if order <= 1 and precise:
        first = next(stream)
        stream = itertools.chain([first], stream)
        if decide.regions_class_order is None and isinstance(first[2], np.ndarray):
            return _streamed_argmax(stream, model_shape, new_shape, separate_axis, order, order_z)
        return _streamed(stream, decide, model_shape, new_shape, order, separate_axis, order_z)
    scores: Any = None
    for start, stop, slab in stream:
        if scores is None:
            xp = array_namespace(slab)
            shape = (int(slab.shape[0]), *model_shape)
            scores = xp.empty(shape, dtype=slab.dtype, device=array_device(slab))
        scores[:, start:stop, ...] = slab
    back = resample(
        scores,
        new_shape,
        order=order,
        separate_axis=separate_axis,
        order_z=order_z,
        precise=precise,
    )
    return decide(back)


def _checked(slabs: Slabs, model_shape: tuple[int, ...]) -> Iterator[tuple[int, int, Any]]:
    """The slabs, checked to cover ``model_shape`` in order, one channel count."""
    expected, channels = 0, None
    for start, stop, slab in slabs:
        if channels is None:
            channels = int(slab.shape[0])
        want = (channels, stop - start, *model_shape[1:])
        if start != expected or tuple(slab.shape) != want or slab.ndim != 4:
            raise ValueError(
                f"predict returned scores {tuple(slab.shape)} for slices {start}..{stop}, "
                f"expected {want} from slice {expected} of {model_shape}"
            )
        expected = stop
        yield start, stop, slab
    if expected != model_shape[0]:
        raise ValueError(f"predict returned slices up to {expected}, expected {model_shape[0]}")


def _decided(
    stream: Iterator[tuple[int, int, Any]], decide: Decision, shape: tuple[int, ...]
) -> Any:
    labels: Any = None
    for start, stop, slab in stream:
        if labels is None:
            xp = array_namespace(slab)
            labels = xp.empty(shape, dtype=xp.uint8, device=array_device(slab))
        labels[start:stop, ...] = decide(slab)
    return labels


def _passes(
    model_shape: tuple[int, ...],
    new_shape: tuple[int, ...],
    order: int,
    separate_axis: int | None,
    order_z: int,
) -> list[tuple[int, int]]:
    """``(axis, order)`` of the 1-D passes of :func:`resample`, in its order."""
    plane = (0, 1, 2) if separate_axis is None else tuple(a for a in range(3) if a != separate_axis)
    passes = [(a, order) for a in plane if model_shape[a] != new_shape[a]]
    if separate_axis is not None and model_shape[separate_axis] != new_shape[separate_axis]:
        passes.append((separate_axis, order_z))
    return passes


def _streamed(
    stream: Iterator[tuple[int, int, Any]],
    decide: Decision,
    model_shape: tuple[int, ...],
    new_shape: tuple[int, ...],
    order: int,
    separate_axis: int | None,
    order_z: int,
) -> Any:
    """Order 0/1 resampling back, a few output slices at a time (module docstring)."""
    passes = _passes(model_shape, new_shape, order, separate_axis, order_z)
    first_order = dict(passes).get(0)
    labels: Any = None
    held: list[tuple[int, int, Any]] = []  # model slabs still needed, in order
    received = 0
    out = 0
    per_slice = 8
    for axis_size in new_shape[1:]:
        per_slice *= axis_size
    for start, stop, slab in stream:
        xp = array_namespace(slab)
        if labels is None:
            labels = xp.empty(new_shape, dtype=xp.uint8, device=array_device(slab))
        held.append((start, stop, slab))
        received = stop
        channels = int(slab.shape[0])
        group = max(1, min(channels, _CHUNK_BYTES // per_slice))
        while out < new_shape[0]:
            end = min(new_shape[0], out + max(1, _CHUNK_BYTES // (per_slice * channels)))
            if first_order is None:
                lo, hi = out, end
            else:
                lo, hi = source_rows(model_shape[0], new_shape[0], first_order, out, end)
            if hi > received:
                break
            rows = _rows(held, lo, hi, xp)
            back = xp.empty(
                (channels, end - out, *new_shape[1:]), dtype=xp.float32, device=array_device(slab)
            )
            for c0 in range(0, channels, group):
                piece = xp.astype(rows[c0 : c0 + group, ...], xp.float64)
                for axis, axis_order in passes:
                    window = None
                    if axis == 0:
                        window = (model_shape[0], lo, out, end)
                    piece = _interpolate(
                        piece, axis + 1, new_shape[axis], axis_order, xp, window=window
                    )
                back[c0 : c0 + group, ...] = xp.astype(piece, xp.float32)
                del piece
            del rows
            labels[out:end, ...] = decide(back)
            del back
            out = end
            held = [h for h in held if h[1] > lo]
    return labels


def _rows(held: list[tuple[int, int, Any]], lo: int, hi: int, xp: Any) -> Any:
    """Model rows ``lo .. hi - 1`` (first axis) from the slabs held."""
    parts = [
        slab[:, max(lo, start) - start : min(hi, stop) - start, ...]
        for start, stop, slab in held
        if start < hi and stop > lo
    ]
    return parts[0] if len(parts) == 1 else xp.concat(parts, axis=1)


_MARGIN = 2.0**-18
"""Relative gap (to the largest score of the box) that proves a strict order survives the
float64 passes and the cast to float32 (which move a value by at most 2^-24 of the box's
largest score): see :func:`_streamed_argmax`."""

_TINY = 1e-30
"""Absolute part of the margin (float32's subnormal steps)."""

_LARGEST = 1e37
"""Boxes with a score beyond it (or not finite) are always computed in full."""

_TILE = 32
"""Output rows and columns of one tile of :func:`_streamed_argmax`."""


@dataclass(frozen=True)
class _Axis:
    """One axis of the resampling back: which model cells each output reads.

    ``order`` is ``None`` where the axis is not resampled. ``box[o]`` is the first model cell
    output ``o`` reads; at order 1 it also reads ``box[o] + 1`` (clipped to the axis)."""

    size: int
    new_size: int
    order: int | None
    box: npt.NDArray[np.int64]

    @classmethod
    def of(cls, size: int, new_size: int, order: int | None) -> _Axis:
        if order is None:
            return cls(size, new_size, None, np.arange(new_size, dtype=np.int64))
        coords = _coordinates(size, new_size, False)
        shift = 0.5 if order == 0 else 0.0
        box = np.clip(np.floor(coords + shift).astype(np.int64), 0, size - 1)
        return cls(size, new_size, order, box)

    def reads(self, out_start: int, out_stop: int) -> tuple[int, int]:
        """Model cells ``(start, stop)`` outputs ``out_start .. out_stop - 1`` read."""
        if self.order is None:
            return out_start, out_stop
        return source_rows(self.size, self.new_size, self.order, out_start, out_stop)


def _streamed_argmax(
    stream: Iterator[tuple[int, int, Any]],
    model_shape: tuple[int, ...],
    new_shape: tuple[int, ...],
    separate_axis: int | None,
    order: int,
    order_z: int,
) -> Any:
    """:func:`_streamed` for the arg-max of NumPy scores, computing only where the labels of
    the model grid do not already decide.

    The passes give an output the weights ``w >= 0`` of the model cells of its box (two per
    order-1 axis, one per order-0 axis), the same for every channel, and every rounded
    product and sum is monotone. So where every cell of the box has the arg-max ``k`` (the
    first of the largest scores) and ``l_k - l_c`` exceeds the margin for every ``c < k``,
    the output's ``k`` score is ``>=`` every later channel's and ``>`` every earlier one's:
    the arg-max is ``k`` without interpolating (:data:`_MARGIN`: the exact convex
    combination keeps the gap, the float64 passes move it by about 2^-50 and the float32
    cast by 2^-23 of the box's largest score). Elsewhere, a tile at a time, only the
    channels that can win are interpolated, by the same passes on the same values: channel
    ``c`` cannot win in a box where its largest score is under the largest of the channels'
    smallest ones by more than the margin.
    """
    passes = _passes(model_shape, new_shape, order, separate_axis, order_z)
    orders = dict(passes)
    axes = [_Axis.of(model_shape[a], new_shape[a], orders.get(a)) for a in range(3)]
    labels = np.empty(new_shape, dtype=np.uint8)
    cell_label = np.empty(model_shape, dtype=np.int32)
    cell_gap = np.empty(model_shape, dtype=np.float64)
    cell_size = np.empty(model_shape, dtype=np.float64)
    held: list[tuple[int, int, Any]] = []
    received = 0
    out = 0
    step = max(1, _CHUNK_BYTES // (8 * new_shape[1] * new_shape[2]))
    for start, stop, slab in stream:
        held.append((start, stop, slab))
        received = stop
        _cells(slab, cell_label[start:stop], cell_gap[start:stop], cell_size[start:stop])
        while out < new_shape[0]:
            end = min(new_shape[0], out + step)
            lo, hi = axes[0].reads(out, end)
            if hi > received:
                break
            for y0 in range(0, new_shape[1], _TILE):
                for x0 in range(0, new_shape[2], _TILE):
                    y1 = min(new_shape[1], y0 + _TILE)
                    x1 = min(new_shape[2], x0 + _TILE)
                    outs = ((out, end), (y0, y1), (x0, x1))
                    labels[out:end, y0:y1, x0:x1] = _tile(
                        held, axes, passes, outs, cell_label, cell_gap, cell_size
                    )
            out = end
            held = [h for h in held if h[1] > lo]
    return labels


def _cells(slab: Any, label: Any, gap: Any, size: Any) -> None:
    """Per model cell of ``slab``: the arg-max, its margin over the earlier channels
    (``inf`` for channel 0) and the largest absolute score (NaN where a score is NaN)."""
    best = np.array(slab[0], dtype=np.float64)
    label[...] = 0
    gap[...] = np.inf
    size[...] = np.abs(best)
    for channel in range(1, int(slab.shape[0])):
        value = slab[channel].astype(np.float64)
        wins = value > best
        np.copyto(gap, value - best, where=wins)
        np.copyto(label, channel, where=wins)
        np.maximum(best, value, out=best)
        np.maximum(size, np.abs(value), out=size)


def _box(array: Any, axes: list[_Axis], offset: int, reduce: Any) -> Any:
    """``array`` reduced by ``reduce`` over each cell and the next along the order-1 axes
    (the last cell alone)."""
    for a, axis in enumerate(axes):
        if axis.order != 1 or int(array.shape[a + offset]) < 2:
            continue
        head = [slice(None)] * array.ndim
        tail = [slice(None)] * array.ndim
        head[a + offset] = slice(0, -1)
        tail[a + offset] = slice(1, None)
        array = array.copy()
        array[tuple(head)] = reduce(array[tuple(head)], array[tuple(tail)])
    return array


def _tile(
    held: list[tuple[int, int, Any]],
    axes: list[_Axis],
    passes: list[tuple[int, int]],
    outs: tuple[tuple[int, int], ...],
    cell_label: Any,
    cell_gap: Any,
    cell_size: Any,
) -> Any:
    """uint8 labels of the outputs ``outs`` (``(start, stop)`` per axis)."""
    reads = [axis.reads(a, b) for axis, (a, b) in zip(axes, outs, strict=True)]
    cells = tuple(slice(a, b) for a, b in reads)
    index = np.ix_(
        *[axis.box[a:b] - r for axis, (a, b), (r, _) in zip(axes, outs, reads, strict=True)]
    )
    label = _box(cell_label[cells], axes, 0, np.minimum)
    uniform = label == _box(cell_label[cells], axes, 0, np.maximum)
    size = _box(cell_size[cells], axes, 0, np.maximum)
    bounded = size <= _LARGEST
    margin = _MARGIN * size + _TINY
    safe = uniform & bounded & (_box(cell_gap[cells], axes, 0, np.minimum) > margin)
    found = label[index].astype(np.uint8)
    decided = safe[index]
    if decided.all():
        return found
    scores = _window(held, reads)
    floor = np.max(_box(scores, axes, 1, np.minimum), axis=0)
    high = _box(scores, axes, 1, np.maximum)
    possible = ~(high < floor - margin) | ~bounded  # under another channel's box minimum
    channels = np.nonzero(np.any(possible[:, ~safe], axis=1))[0]
    piece = scores[channels].astype(np.float64)
    for a, axis_order in passes:
        window = (axes[a].size, reads[a][0], outs[a][0], outs[a][1])
        piece = _interpolate(piece, a + 1, axes[a].new_size, axis_order, np, window=window)
    computed = channels[np.argmax(piece.astype(np.float32), axis=0)].astype(np.uint8)
    return np.where(decided, found, computed)


def _window(held: list[tuple[int, int, Any]], reads: list[tuple[int, int]]) -> Any:
    """Scores of the model cells ``reads`` (``(start, stop)`` per axis) from the slabs held."""
    (lo, hi), (y0, y1), (x0, x1) = reads
    parts = [
        slab[:, max(lo, start) - start : min(hi, stop) - start, y0:y1, x0:x1]
        for start, stop, slab in held
        if start < hi and stop > lo
    ]
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
