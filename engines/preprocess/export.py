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
* Otherwise (order 3 back) the slabs are put together and resampled whole, as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from array_api_compat import array_namespace
from array_api_compat import device as array_device

from segnode.engines.preprocess.resampling import (
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
    plane = (0, 1, 2) if separate_axis is None else tuple(a for a in range(3) if a != separate_axis)
    passes = [(a, order) for a in plane if model_shape[a] != new_shape[a]]
    if separate_axis is not None and model_shape[separate_axis] != new_shape[separate_axis]:
        passes.append((separate_axis, order_z))
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
