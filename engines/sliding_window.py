"""Sliding-window inference, written once against the Python array API standard.

The same code runs on NumPy arrays (CPU, ONNX Runtime) and on CuPy arrays or torch tensors
(GPU backends): every operation goes through the namespace that
:func:`array_api_compat.array_namespace` returns for the input volume, and every new array is
created on the input's device.

The method is nnU-Net's (Isensee et al., Nature Methods 18, 2021): overlapping patches on a
regular grid, each patch's class probabilities weighted by a Gaussian importance map that
favours the patch centre, summed, and the arg-max taken per voxel. Memory is kept bounded:

* The sum is never divided by the summed weights: that divisor is the same for every class of
  a voxel, so it cannot change the arg-max, and skipping it saves a full float32 volume.
* Accumulation is streamed along z. Patches are visited in z-major order; as soon as no
  remaining patch can touch a slice, that slice's arg-max is written to the uint8 output and
  its accumulator rows are dropped. The float32 accumulator therefore spans about one patch
  depth (``num_classes x patch_z x Y x X``), not the whole volume, whatever the number of
  slices. This is why accumulation stays in float32: half precision would halve a buffer that
  is already small, and would flush the Gaussian tails (about 1e-10 at a patch corner) to zero.
* Voxels that only one patch covers skip the weighting, the softmax and the accumulator:
  a positive weight and the softmax are both monotonic per voxel, so the arg-max of the raw
  output is the same label. This is exploited when all patches share one in-plane window
  (a model whose patch holds the whole slice, such as the default "tissue" model): there a
  slice covered by a single z position is labelled straight from that patch, and only the
  overlap slices are blended. With several in-plane windows every voxel is blended.

A model may also return the label itself (``output_kind="labels"``: one channel holding the
class index, as a model with the arg-max inside its graph does). Such a patch is copied where
it alone covers a voxel; where patches overlap its one-hot encoding is blended, so the result
is exactly that of a model returning one-hot probabilities. The overlap may differ per axis: a
model that looks at each slice on its own (every kernel ``1 x k x k``) gains nothing from
overlap along z, whereas in-plane overlap still matters where a matrix exceeds the patch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

from array_api_compat import array_namespace
from array_api_compat import device as array_device

if TYPE_CHECKING:
    from segnode.engines.manifest import ModelManifest

Array: TypeAlias = Any
"""An array of any array-API namespace (NumPy, CuPy, torch ...)."""

Predict: TypeAlias = Callable[[Array], Array]
"""``predict(batch)``: ``(N, 1, pz, py, px)`` float32 in, ``(N, C, pz, py, px)`` out."""

Patch: TypeAlias = tuple[slice, slice, slice]

OUTPUT_KINDS = ("logits", "probabilities", "labels")
"""What a model returns per patch: ``(N, C, ...)`` logits or probabilities, or ``(N, 1, ...)``
class indices (``"labels"``)."""

_SWEEP_MAX_CLASSES = 16


def output_channels(output_kind: str, num_classes: int) -> int:
    """Channels of a model's output: 1 for ``"labels"``, else ``num_classes``."""
    return 1 if output_kind == "labels" else num_classes


def axis_overlaps(overlap: float | Sequence[float]) -> tuple[float, float, float]:
    """``(z, y, x)`` overlaps from one overlap for every axis or three per-axis ones.

    Raises
    ------
    ValueError
        If there are not three values or one is outside ``[0, 1)``.
    """
    values = [overlap] * 3 if isinstance(overlap, int | float) else list(overlap)
    if len(values) != 3 or not all(0.0 <= float(v) < 1.0 for v in values):
        raise ValueError(f"overlap must be in [0, 1), once or per axis (z, y, x), got {overlap}")
    return (float(values[0]), float(values[1]), float(values[2]))


def _axis_starts(size: int, patch: int, overlap: float) -> list[int]:
    if size <= patch:
        return [0]
    step = max(1, math.floor(patch * (1.0 - overlap) + 1e-9))
    starts = list(range(0, size - patch, step))
    starts.append(size - patch)
    return starts


def patch_grid(
    shape: Sequence[int], patch_size: Sequence[int], overlap: float | Sequence[float]
) -> list[Patch]:
    """Patches that tile a volume, in z-major order.

    Along each axis the patches start every ``floor(patch * (1 - overlap))`` voxels and the
    last one ends flush with the volume, so consecutive patches overlap by at least
    ``overlap`` of the patch and every voxel is covered.

    Parameters
    ----------
    shape
        Volume shape ``(z, y, x)``.
    patch_size
        Patch shape ``(pz, py, px)``. An axis shorter than the patch gets a single patch at 0
        that overhangs the end; :func:`sliding_window_segment` pads such axes first.
    overlap
        Fraction of the patch shared by neighbours, in ``[0, 1)``: one value for every axis
        or three, ``(z, y, x)``.

    Returns
    -------
    list of tuple of slice
        One ``(z, y, x)`` slice triple per patch, each slice as long as the patch.
    """
    _check_triple(shape, "shape", minimum=1)
    _check_triple(patch_size, "patch_size", minimum=1)
    overlaps = axis_overlaps(overlap)
    axes = [
        [slice(s, s + p) for s in _axis_starts(n, p, o)]
        for n, p, o in zip(shape, patch_size, overlaps, strict=True)
    ]
    return [(z, y, x) for z in axes[0] for y in axes[1] for x in axes[2]]


def gaussian_importance(
    patch_size: Sequence[int], sigma_scale: float, xp: Any, *, device: Any = None
) -> Array:
    """Gaussian importance map of a patch, nnU-Net style.

    A separable Gaussian centred on the patch centre with ``sigma = sigma_scale * size`` per
    axis, scaled so that its maximum is 1. Values that underflow to zero are raised to the
    smallest positive value, so every voxel of a patch keeps some weight.

    Parameters
    ----------
    patch_size
        Patch shape ``(pz, py, px)``.
    sigma_scale
        Standard deviation as a fraction of the patch size (nnU-Net uses 1/8).
    xp
        Array namespace to build the map in.
    device
        Device to build the map on (default: the namespace's default device).

    Returns
    -------
    array
        float32 array of shape ``patch_size``, positive, maximum 1, symmetric per axis.
    """
    _check_triple(patch_size, "patch_size", minimum=1)
    if not sigma_scale > 0.0:
        raise ValueError(f"sigma_scale must be positive, got {sigma_scale}")
    profiles = []
    for size in patch_size:
        centre = (size - 1) / 2.0
        sigma = sigma_scale * size
        offsets = xp.arange(size, dtype=xp.float32, device=device) - centre
        profiles.append(xp.exp(-0.5 * (offsets / sigma) ** 2))
    weights = profiles[0][:, None, None] * profiles[1][None, :, None] * profiles[2][None, None, :]
    weights = weights / xp.max(weights)
    infinity = xp.asarray(xp.inf, dtype=xp.float32, device=device)
    smallest = xp.min(xp.where(weights > 0, weights, infinity))
    return xp.where(weights > 0, weights, smallest)


def sliding_window_segment(
    volume: Array,
    predict: Predict,
    *,
    patch_size: tuple[int, int, int],
    overlap: float | Sequence[float],
    num_classes: int,
    batch_size: int = 1,
    output_kind: str = "logits",
    sigma_scale: float = 0.125,
) -> Array:
    """Segment a volume patch by patch and blend the patches into one label map.

    Parameters
    ----------
    volume
        Preprocessed float32 volume ``(z, y, x)`` in any array-API namespace.
    predict
        Called with float32 batches ``(N, 1, pz, py, px)`` (``N <= batch_size``) in the
        volume's namespace and device; returns ``(N, num_classes, pz, py, px)`` logits or
        probabilities in the same namespace (any float dtype), or ``(N, 1, pz, py, px)``
        labels (any integer or float dtype holding ``0 .. num_classes - 1``). The returned
        array is consumed: it may be overwritten (softmax in place), so return a buffer the
        caller can spare.
    patch_size
        Patch shape ``(pz, py, px)`` the model takes.
    overlap
        Fraction of the patch shared by neighbouring patches, in ``[0, 1)``: one value for
        every axis or three, ``(z, y, x)``.
    num_classes
        Output channels, background included (at most 256).
    batch_size
        Patches per ``predict`` call.
    output_kind
        ``"logits"`` (softmax is applied before blending), ``"probabilities"`` or
        ``"labels"`` (one-hot encoded where patches overlap).
    sigma_scale
        Standard deviation of the Gaussian importance map as a fraction of the patch size.

    Returns
    -------
    array
        uint8 label map, same shape, namespace and device as ``volume``; voxel value ``c`` is
        the channel with the highest blended score (ties go to the lower channel).

    Raises
    ------
    ValueError
        On a malformed argument, when ``predict`` returns the wrong shape, or labels outside
        ``0 .. num_classes - 1``.

    Notes
    -----
    An axis shorter than the patch is padded on both sides (centred) by repeating the edge
    slice; for CT this extends the anatomy rather than inventing air or water at the border.
    """
    xp = array_namespace(volume)
    if volume.ndim != 3 or min(volume.shape) < 1:
        raise ValueError(f"volume must be a non-empty (z, y, x) array, got {volume.shape}")
    _check_triple(patch_size, "patch_size", minimum=1)
    if not 1 <= num_classes <= 256:
        raise ValueError(f"num_classes must be in 1..256 for a uint8 label map: {num_classes}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if output_kind not in OUTPUT_KINDS:
        raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
    dev = array_device(volume)
    shape = tuple(int(n) for n in volume.shape)
    padded, offsets = _pad_edge(xp.astype(volume, xp.float32, copy=False), patch_size, xp)
    grid = patch_grid(padded.shape, patch_size, overlap)
    run = _Runner(predict, xp, num_classes, patch_size, output_kind)
    if _slabs_tile(grid, padded.shape, patch_size):
        labels = _tiled(padded, run, patch_size, batch_size, output_kind, xp)
    else:
        weights = gaussian_importance(patch_size, sigma_scale, xp, device=dev)
        labels = _blend(padded, grid, run, weights, num_classes, batch_size, output_kind, xp)
    run.check_labels()

    if tuple(labels.shape) == shape:
        return labels
    crop = tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))
    return xp.asarray(labels[crop], copy=True)


def segment_with_manifest(
    volume: Array, predict: Predict, manifest: ModelManifest, *, batch_size: int
) -> Array:
    """:func:`sliding_window_segment` with ``manifest``'s patch size, overlap, classes and
    output kind: what every engine runs on a preprocessed volume."""
    return sliding_window_segment(
        volume,
        predict,
        patch_size=manifest.patch_size,
        overlap=manifest.overlap,
        num_classes=manifest.num_classes,
        batch_size=batch_size,
        output_kind=manifest.output_kind,
    )


def _slabs_tile(grid: list[Patch], shape: Sequence[int], patch_size: Sequence[int]) -> bool:
    """Whether the patches are whole slices stacked without overlap: each covers every row
    and column, and their z ranges follow each other from 0 to the end."""
    depth, rows, cols = (int(n) for n in shape)
    pz = int(patch_size[0])
    if depth % pz or len(grid) != depth // pz:
        return False
    return all(
        zs.start == k * pz and (ys.start, ys.stop, xs.start, xs.stop) == (0, rows, 0, cols)
        for k, (zs, ys, xs) in enumerate(grid)
    )


def _tiled(
    padded: Array,
    run: _Runner,
    patch_size: Sequence[int],
    batch_size: int,
    output_kind: str,
    xp: Any,
) -> Array:
    """Label map of a volume that whole-slice patches tile without overlap (every voxel in
    one patch): each batch is a reshaped view of consecutive slices (no stacking) and its
    labels go back in one assignment, a handful of array operations per batch instead of
    several per patch (the default tissue model on a GPU: 2 batches of 32 two-slice patches
    for 128 slices). The labels equal those of the general path, which labels a voxel that
    only one patch covers straight from that patch (module docstring)."""
    depth, rows, cols = (int(n) for n in padded.shape)
    pz = int(patch_size[0])
    labels = xp.zeros((depth, rows, cols), dtype=xp.uint8, device=array_device(padded))
    per_batch = batch_size * pz
    for z0 in range(0, depth, per_batch):
        z1 = min(depth, z0 + per_batch)
        n = (z1 - z0) // pz
        scores = run.batch(xp.reshape(padded[z0:z1, ...], (n, 1, pz, rows, cols)))
        if output_kind == "labels":
            labels[z0:z1, ...] = xp.reshape(scores, (z1 - z0, rows, cols))
            continue
        for i in range(n):
            labels[z0 + i * pz : z0 + (i + 1) * pz, ...] = _argmax(scores[i, ...], xp)
    return labels


class _Runner:
    """Calls ``predict`` on a list of patches and checks what comes back.

    Scores come back as float32, labels as uint8. The smallest and largest label are taken
    from the values ``predict`` returned, before the cast to uint8 (which would turn 256 into
    0 and -256 into 0), kept on the device and checked once, at the end
    (:meth:`check_labels`), so that a GPU is not synchronised after every batch.
    """

    def __init__(
        self,
        predict: Predict,
        xp: Any,
        num_classes: int,
        patch_size: tuple[int, int, int],
        output_kind: str,
    ) -> None:
        self._predict = predict
        self._xp = xp
        self._labels = output_kind == "labels"
        self._num_classes = num_classes
        self._channels_and_patch = (output_channels(output_kind, num_classes), *patch_size)
        self._smallest: Array = None
        self._largest: Array = None

    def __call__(self, patches: list[Array]) -> Array:
        xp = self._xp
        if len(patches) == 1:  # a view: no copy of a contiguous patch
            batch = patches[0][None, None, ...]
        else:
            batch = xp.stack(patches)[:, None, ...]
        return self.batch(batch)

    def batch(self, batch: Array) -> Array:
        """The checked output of ``predict`` for a ``(N, 1, pz, py, px)`` batch."""
        xp = self._xp
        out = self._predict(batch)
        want = (int(batch.shape[0]), *self._channels_and_patch)
        if tuple(out.shape) != want:
            raise ValueError(f"predict returned shape {tuple(out.shape)}, expected {want}")
        if not self._labels:
            return xp.astype(out, xp.float32, copy=False)
        smallest, largest = xp.min(out), xp.max(out)  # a NaN makes both NaN
        if self._largest is not None:
            smallest = xp.minimum(self._smallest, smallest)
            largest = xp.maximum(self._largest, largest)
        self._smallest, self._largest = smallest, largest
        return xp.astype(out, xp.uint8, copy=False)

    def check_labels(self) -> None:
        """Raise ``ValueError`` if a patch held a label outside ``0 .. num_classes - 1``
        (or a NaN)."""
        if self._largest is None:
            return
        smallest, largest = float(self._smallest), float(self._largest)
        if smallest >= 0 and largest < self._num_classes:
            return
        bad = largest if smallest >= 0 else smallest
        raise ValueError(
            f"predict returned label {bad:g}; the model has {self._num_classes} classes "
            f"(0 to {self._num_classes - 1})"
        )


def _blend(
    padded: Array,
    grid: list[Patch],
    run: _Runner,
    weights: Array,
    num_classes: int,
    batch_size: int,
    output_kind: str,
    xp: Any,
) -> Array:
    """Gaussian-weighted sum streamed along z; returns the uint8 arg-max (padded shape)."""
    dev = array_device(padded)
    depth, rows, cols = (int(n) for n in padded.shape)
    labels = xp.zeros((depth, rows, cols), dtype=xp.uint8, device=dev)
    shared = _shared_slices(grid, depth)
    # acc[:, i] holds the weighted scores of slice low + i for i < used. Allocated when first
    # needed, one patch deep (more only if a batch spans several z starts), then reused.
    acc: Array = None
    low = used = 0
    for first in range(0, len(grid), batch_size):
        batch = grid[first : first + batch_size]
        scores = run([padded[patch] for patch in batch])
        for index, (zs, ys, xs) in enumerate(batch):
            for begin, end, blended in _runs(shared, zs.start, zs.stop):
                part = scores[index : index + 1, :, begin - zs.start : end - zs.start, ...]
                if not blended:
                    if output_kind == "labels":
                        labels[begin:end, ys, xs] = part[0, 0, ...]
                    else:
                        labels[begin:end, ys, xs] = _argmax(part[0, ...], xp)
                    continue
                if output_kind == "logits":
                    part = _softmax(part, xp)
                elif output_kind == "labels":
                    part = _one_hot(part[0, 0, ...], num_classes, xp)[None, ...]
                part = part[0, ...] * weights[begin - zs.start : end - zs.start, ...]
                if acc is None or end - low > acc.shape[1]:
                    depth_needed = max(end - low, zs.stop - zs.start)
                    grown = xp.zeros(
                        (num_classes, depth_needed, rows, cols), dtype=xp.float32, device=dev
                    )
                    if acc is not None:
                        grown[:, :used, ...] = acc[:, :used, ...]
                    acc = grown
                acc[:, begin - low : end - low, ys, xs] += part
                used = max(used, end - low)
        # Slices before the next patch's start are final: no later patch reaches back.
        done = grid[first + batch_size][0].start if first + batch_size < len(grid) else depth
        if done <= low:
            continue
        for begin, end, blended in _runs(shared, low, done):
            if blended:
                labels[begin:end, ...] = _argmax(acc[:, begin - low : end - low, ...], xp)
        count = done - low
        rest = max(0, used - count)
        if rest:
            acc[:, :rest, ...] = xp.asarray(acc[:, count:used, ...], copy=True)
        if used > rest:
            acc[:, rest:used, ...] = 0.0
        low, used = done, rest
    return labels


def _shared_slices(grid: list[Patch], depth: int) -> list[bool]:
    """Per slice, whether its voxels may lie in more than one patch and need blending.

    When all patches span the same in-plane window, a slice that one z position covers
    is covered by exactly one patch: its label is that patch's arg-max, no weights needed.
    """
    windows = {(ys.start, xs.start) for _, ys, xs in grid}
    if len(windows) > 1:
        return [True] * depth
    coverage = [0] * depth
    for zs in {zs.start: zs for zs, _, _ in grid}.values():
        for z in range(zs.start, min(zs.stop, depth)):
            coverage[z] += 1
    return [count > 1 for count in coverage]


def _runs(flags: list[bool], start: int, stop: int) -> list[tuple[int, int, bool]]:
    """Maximal runs ``(begin, end, flag)`` of equal ``flags`` within ``[start, stop)``."""
    runs: list[tuple[int, int, bool]] = []
    begin = start
    for z in range(start + 1, stop + 1):
        if z == stop or flags[z] != flags[begin]:
            runs.append((begin, z, flags[begin]))
            begin = z
    return runs


def _argmax(scores: Array, xp: Any) -> Array:
    """uint8 index of the largest of ``(C, ...)`` scores along axis 0; ties go to the lower.

    For the few classes of a segmentation model a pairwise sweep is faster than NumPy's
    ``argmax(axis=0)`` (which walks the class axis with a stride) and works in any namespace.
    """
    classes = int(scores.shape[0])
    if classes > _SWEEP_MAX_CLASSES:
        return xp.astype(xp.argmax(scores, axis=0), xp.uint8)
    best = scores[0, ...]
    dev = array_device(scores)
    index = xp.zeros(best.shape, dtype=xp.uint8, device=dev)
    for c in range(1, classes):
        better = scores[c, ...] > best
        index = xp.where(better, xp.asarray(c, dtype=xp.uint8, device=dev), index)
        best = xp.where(better, scores[c, ...], best)
    return index


def _one_hot(labels: Array, num_classes: int, xp: Any) -> Array:
    """float32 ``(C, ...)`` one-hot encoding of uint8 ``labels``."""
    dev = array_device(labels)
    return xp.stack(
        [
            xp.astype(labels == xp.asarray(c, dtype=xp.uint8, device=dev), xp.float32)
            for c in range(num_classes)
        ]
    )


def _softmax(logits: Array, xp: Any) -> Array:
    """Softmax over the class axis (1) of ``(N, C, ...)``; overwrites ``logits``."""
    logits -= xp.max(logits, axis=1, keepdims=True)
    exp = xp.exp(logits)
    exp /= xp.sum(exp, axis=1, keepdims=True)
    return exp


def _pad_edge(
    volume: Array, patch_size: Sequence[int], xp: Any
) -> tuple[Array, tuple[int, int, int]]:
    """Pad axes shorter than the patch to the patch size, centred, repeating edge slices."""
    dev = array_device(volume)
    offsets = [0, 0, 0]
    for axis, (size, patch) in enumerate(zip(volume.shape, patch_size, strict=True)):
        if size >= patch:
            continue
        before = (patch - size) // 2
        index = [min(max(i - before, 0), size - 1) for i in range(patch)]
        volume = xp.take(volume, xp.asarray(index, dtype=xp.int64, device=dev), axis=axis)
        offsets[axis] = before
    return volume, (offsets[0], offsets[1], offsets[2])


def _check_triple(values: Sequence[int], name: str, *, minimum: int) -> None:
    if len(values) != 3 or any(int(v) != v or v < minimum for v in values):
        raise ValueError(f"{name} must be three integers >= {minimum}, got {tuple(values)}")
