"""nnU-Net v2's sliding window, returning logits, for version-2 (trained) models.

:mod:`segnode.engines.sliding_window` is the node's own Gaussian sliding window for version-1 models
(its tile placement, a Gaussian centred at ``(patch - 1) / 2``, arg-max out). A model trained
by nnU-Net expects nnU-Net's own inference, reproduced here from nnunetv2 2.8.1
(``nnunetv2/inference/sliding_window_prediction.py`` and ``predict_from_raw_data.py``,
``nnUNetPredictor.predict_sliding_window_return_logits``, ``_internal_maybe_mirror_and_predict``,
``predict_logits_from_preprocessed_data``;
``acvl_utils.cropping_and_padding.padding.pad_nd_image``):

* an image smaller than the patch along an axis is padded to the patch with zeros, centred,
  the odd voxel after the image (:func:`pad_to_patch`), and the padding is cut off the logits;
* tiles per axis: ``n = ceil((size - patch) / (patch * step)) + 1`` at
  ``round(i * (size - patch) / (n - 1))`` (:func:`compute_steps_for_sliding_window`);
* the Gaussian importance map is a unit delta at ``patch // 2`` filtered with SciPy's truncated
  Gaussian (sigma ``patch * sigma_scale``), scaled to a maximum of ``value_scaling_factor``
  (10), rounded to float16, zeros replaced by the smallest non-zero value
  (:func:`compute_gaussian`; bit-identical to nnU-Net's, computed in NumPy once per patch size
  and then moved to the image's device);
* test-time mirroring: the network's output for the tile plus, for every non-empty combination
  of the mirror axes, the output for the flipped tile flipped back, divided by the number of
  terms (:func:`maybe_mirror_and_predict`);
* folds: the fold models' logits averaged;
* per tile ``logits * gaussian`` and ``gaussian`` are summed and the sum divided by the summed
  Gaussian at the end; the result is the ``(C, z, y, x)`` logits, not the arg-max.

Deliberate differences from nnU-Net's code:

* The accumulators are float32. nnU-Net's are float16 (``predicted_logits``,
  ``n_predictions``): where only the tails of the Gaussian cover a voxel (float16 subnormals,
  steps of 6e-8 against weights of 1e-7 .. 1e-3) its logits are off by up to about 0.1 for
  logits of a few units; float32 gives the value of the same formula within 1e-6.
  ``accumulator_dtype="float16"`` reproduces nnU-Net's rounding instead (then the folds run
  one pass each, as nnU-Net; in the tests: torch bit for bit with its predictor, NumPy within
  one float16 step, whose half-precision arithmetic rounds a fold sum differently).
* With float32 accumulators, folds are averaged per tile, in one pass over the tiles, not by
  running the whole sliding window once per fold and averaging the volumes:
  ``n_predictions`` is the same for every fold, so
  ``mean_f(sum_t g p_f / n) = sum_t g mean_f(p_f) / n``. One accumulator instead of two, and
  each tile is cut out of the image once.
* Tiles may be batched (``batch_size``); nnU-Net predicts one tile at a time. A predictor
  that treats the batch items independently (every network in eval mode) gives the same.
* Non-finite logits raise ``ValueError`` (nnU-Net raises on infinities only).
* The logits can be had slab by slab along z (:func:`sliding_window_slabs`, issue 37): the
  accumulator then spans about one patch depth instead of the image, with the same values.

Everything goes through the array-API namespace of the image (NumPy, torch, CuPy), as
:mod:`segnode.engines.sliding_window` does.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt
from array_api_compat import array_namespace
from array_api_compat import device as array_device

from segnode.engines.manifest import ModelManifest

Array: TypeAlias = Any
"""An array of any array-API namespace (NumPy, CuPy, torch ...)."""

PatchPredictor: TypeAlias = Callable[[Array], Array]
"""One fold's network: ``(N, 1, pz, py, px)`` float32 in, ``(N, C, pz, py, px)`` logits out,
same namespace and device."""

ImagePredictor: TypeAlias = Callable[[Array], Array]
"""``predict(image)``: float32 ``(z, y, x)`` in, float32 ``(C, z, y, x)`` logits out (what
:func:`segnode.engines.preprocess.pipeline.run_model` takes)."""

GAUSSIAN_DTYPES = ("float16", "float32", "float64")

_TRUNCATE = 4.0
"""``scipy.ndimage.gaussian_filter``'s default ``truncate`` (kernel radius in sigmas)."""


def compute_steps_for_sliding_window(
    image_size: Sequence[int], tile_size: Sequence[int], tile_step_size: float | Sequence[float]
) -> list[list[int]]:
    """Tile start positions per axis, as nnU-Net's function of the same name.

    Parameters
    ----------
    image_size
        Image shape, at least ``tile_size`` along every axis (pad first: :func:`pad_to_patch`).
    tile_size
        Patch shape.
    tile_step_size
        Step between tiles as a fraction of the patch, in ``(0, 1]``: one for every axis (as
        nnU-Net) or one per axis.

    Returns
    -------
    list of list of int
        For each axis, the start of every tile: ``n = ceil((size - tile) / (tile * step)) + 1``
        tiles at ``round(i * (size - tile) / (n - 1))`` (round half to even, as ``np.round``).

    Raises
    ------
    ValueError
        Lengths differ, a step is outside ``(0, 1]`` or the image is smaller than the tile.
    """
    dims = len(tile_size)
    steps = _per_axis(tile_step_size, dims)
    if len(image_size) != dims:
        raise ValueError(f"image_size {tuple(image_size)} and tile_size {tuple(tile_size)}")
    if not all(0.0 < s <= 1.0 for s in steps):
        raise ValueError(f"tile_step_size must be in (0, 1], got {tile_step_size}")
    if any(int(t) < 1 or int(i) < int(t) for i, t in zip(image_size, tile_size, strict=True)):
        raise ValueError(
            f"image {tuple(image_size)} must be at least the tile {tuple(tile_size)} everywhere"
        )
    result = []
    for size, tile, step in zip(image_size, tile_size, steps, strict=True):
        # the same float64 operations as nnU-Net's numpy code
        num = math.ceil((int(size) - int(tile)) / (int(tile) * step)) + 1
        largest = int(size) - int(tile)
        actual = largest / (num - 1) if num > 1 else 99999999999
        result.append([int(round(actual * i)) for i in range(num)])
    return result


def compute_gaussian(
    tile_size: Sequence[int],
    sigma_scale: float = 1.0 / 8,
    value_scaling_factor: float = 10.0,
    dtype: str = "float16",
) -> npt.NDArray[Any]:
    """nnU-Net's Gaussian importance map, bit for bit, as a NumPy array.

    ``nnunetv2.inference.sliding_window_prediction.compute_gaussian``: a unit delta at
    ``tile // 2`` filtered by ``scipy.ndimage.gaussian_filter`` (sigma ``tile * sigma_scale``,
    kernel truncated at 4 sigma, constant 0 outside), divided by ``max / value_scaling_factor``
    in float64, converted to ``dtype`` as torch converts a float64 tensor (through float32),
    and every zero replaced by the smallest non-zero value. The filter of a delta is the
    product of the three normalised 1-D kernels, which is computed here without SciPy.

    Parameters
    ----------
    tile_size
        Patch shape.
    sigma_scale, value_scaling_factor
        As nnU-Net (its predictor passes 1/8 and 10).
    dtype
        ``"float16"`` (nnU-Net's default, used by its predictor), ``"float32"`` or
        ``"float64"``.

    Returns
    -------
    numpy.ndarray
        Shape ``tile_size``, dtype ``dtype``, every value positive.
    """
    if dtype not in GAUSSIAN_DTYPES:
        raise ValueError(f"dtype must be one of {GAUSSIAN_DTYPES}, got {dtype!r}")
    if not sigma_scale > 0.0 or not value_scaling_factor > 0.0:
        raise ValueError("sigma_scale and value_scaling_factor must be positive")
    if not tile_size or any(int(t) < 1 for t in tile_size):
        raise ValueError(f"tile_size must be positive integers, got {tuple(tile_size)}")
    weights = np.ones((), dtype=np.float64)
    for axis, size in enumerate(int(t) for t in tile_size):
        profile = _filtered_delta(size, size * sigma_scale)
        shape = [1] * len(tile_size)
        shape[axis] = size
        weights = weights * profile.reshape(shape)  # the order gaussian_filter multiplies in
    weights = weights / (np.max(weights) / value_scaling_factor)
    if dtype == "float16":
        out = weights.astype(np.float32).astype(np.float16)  # torch: double -> float -> half
    else:
        out = weights.astype(dtype)
    zero = out == 0
    if np.any(zero):
        out[zero] = np.min(out[~zero])
    return out


def _filtered_delta(size: int, sigma: float) -> npt.NDArray[np.float64]:
    """``gaussian_filter1d`` of a unit delta at ``size // 2`` (mode constant 0)."""
    if sigma <= 1e-15:  # SciPy skips such an axis
        profile = np.zeros(size)
        profile[size // 2] = 1.0
        return profile
    radius = int(_TRUNCATE * float(sigma) + 0.5)
    x = np.arange(-radius, radius + 1)
    phi = np.exp(-0.5 / (sigma * sigma) * x**2)  # scipy.ndimage._filters._gaussian_kernel1d
    phi = phi / phi.sum()
    offsets = np.arange(size) - size // 2
    inside = np.abs(offsets) <= radius
    profile = np.zeros(size)
    profile[inside] = phi[offsets[inside] + radius]
    return profile


def pad_to_patch(
    image_size: Sequence[int], patch_size: Sequence[int]
) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    """Padded shape and where the image lies in it, as ``pad_nd_image(image, patch_size,
    'constant', {'value': 0}, True)``: an axis shorter than the patch grows to the patch,
    ``(patch - size) // 2`` voxels before the image and the rest after; longer axes stay."""
    if len(image_size) != len(patch_size):
        raise ValueError(f"image {tuple(image_size)} and patch {tuple(patch_size)}")
    shape = tuple(max(int(i), int(p)) for i, p in zip(image_size, patch_size, strict=True))
    slicer = tuple(
        slice((n - int(i)) // 2, (n - int(i)) // 2 + int(i))
        for i, n in zip(image_size, shape, strict=True)
    )
    return shape, slicer


def mirror_combinations(mirror_axes: Sequence[int]) -> list[tuple[int, ...]]:
    """Every non-empty combination of ``mirror_axes``, shortest first, in nnU-Net's order."""
    axes = tuple(int(a) for a in mirror_axes)
    if len(set(axes)) != len(axes) or any(not 0 <= a <= 2 for a in axes):
        raise ValueError(f"mirror_axes must be distinct spatial axes 0..2, got {mirror_axes}")
    return [c for i in range(len(axes)) for c in itertools.combinations(axes, i + 1)]


def maybe_mirror_and_predict(
    batch: Array, predictor: PatchPredictor, mirror_axes: Sequence[int]
) -> Array:
    """One fold's float32 prediction of a ``(N, 1, pz, py, px)`` batch with test-time mirroring.

    As ``nnUNetPredictor._internal_maybe_mirror_and_predict``: ``predictor(batch)`` plus
    ``flip(predictor(flip(batch, axes)), axes)`` for every combination of the spatial
    ``mirror_axes`` (0 = z of the patch), divided by the number of terms.
    """
    xp = array_namespace(batch)
    combos = mirror_combinations(mirror_axes)
    # Without mirroring nothing is added into the prediction: it is used as it came (a
    # second copy of a batch of many-label logits is what issue 37 ran out of memory on).
    prediction = xp.astype(predictor(batch), xp.float32, copy=bool(combos))
    for axes in combos:
        shifted = tuple(a + 2 for a in axes)
        flipped = predictor(xp.flip(batch, axis=shifted))
        prediction += xp.astype(xp.flip(flipped, axis=shifted), xp.float32)
    if combos:
        prediction /= float(len(combos) + 1)
    return prediction


@dataclass(frozen=True)
class WindowSettings:
    """How :func:`sliding_window_logits` runs: everything but the image and the folds.

    Sequences are stored as tuples (``patch_size`` and ``mirror_axes`` of ints,
    ``tile_step_size`` of floats when it is one per axis); the patch, the number of steps and
    the mirror axes are checked here, the values of the steps and of the Gaussian's settings
    where they are used.

    Attributes
    ----------
    patch_size
        The model's patch ``(pz, py, px)``.
    tile_step_size
        nnU-Net's ``tile_step_size`` (``1 - overlap``): 0.5 by default, TotalSegmentator 0.8;
        one for every axis or one per axis.
    mirror_axes
        Spatial axes for test-time mirroring (nnU-Net's ``allowed_mirroring_axes``); empty for
        none.
    sigma_scale, value_scaling_factor, gaussian_dtype
        :func:`compute_gaussian`'s; nnU-Net's predictor uses 1/8, 10 and float16.
    use_gaussian
        ``False``: every tile weighs 1 (nnU-Net's ``use_gaussian=False``).
    batch_size
        Tiles per predictor call.
    channels
        Expected output channels; ``None`` takes them from the first prediction.
    accumulator_dtype
        ``"float32"`` (default), or ``"float16"`` to reproduce the rounding of nnU-Net's
        float16 ``predicted_logits`` / ``n_predictions`` (bit for bit with one fold; with
        several folds the fold average is taken per tile in float32 before the float16 sum,
        where nnU-Net averages float16 volumes). Up to about 0.1 apart for logits of a few
        units, mostly where only Gaussian tails cover a voxel: float16's subnormal steps.

    Raises
    ------
    ValueError
        On a patch that is not three positive sizes, a step count other than one or three,
        malformed mirror axes, a batch size below 1 or an unknown accumulator dtype.
    """

    patch_size: tuple[int, ...]
    tile_step_size: float | tuple[float, ...] = 0.5
    mirror_axes: tuple[int, ...] = ()
    sigma_scale: float = 1.0 / 8
    value_scaling_factor: float = 10.0
    use_gaussian: bool = True
    gaussian_dtype: str = "float16"
    batch_size: int = 1
    channels: int | None = None
    accumulator_dtype: str = "float32"

    def __post_init__(self) -> None:
        patch = tuple(int(p) for p in self.patch_size)
        if len(patch) != 3 or min(patch) < 1:
            raise ValueError(f"patch {patch} must be 3-D, non-empty")
        step = self.tile_step_size
        _per_axis(step, 3)  # validates the count
        axes = tuple(int(a) for a in self.mirror_axes)
        mirror_combinations(axes)  # validates
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if self.accumulator_dtype not in ("float32", "float16"):
            raise ValueError(
                f"accumulator_dtype: float32 or float16, got {self.accumulator_dtype!r}"
            )
        object.__setattr__(self, "patch_size", patch)
        if not isinstance(step, int | float):
            object.__setattr__(self, "tile_step_size", tuple(float(s) for s in step))
        object.__setattr__(self, "mirror_axes", axes)


def sliding_window_logits(
    image: Array, fold_predictors: Sequence[PatchPredictor], settings: WindowSettings
) -> Array:
    """nnU-Net's blended logits of a preprocessed image, averaged over folds and mirrors.

    Parameters
    ----------
    image
        Preprocessed float ``(z, y, x)`` image on the model's grid, any array-API namespace.
    fold_predictors
        One :data:`PatchPredictor` per fold (at least one), in the image's namespace.
    settings
        Patch, step, mirroring, Gaussian, batch and accumulator (:class:`WindowSettings`).

    Returns
    -------
    array
        float32 ``(C, z, y, x)`` logits, namespace and device of ``image``: the slabs of
        :func:`sliding_window_slabs` put together.

    Raises
    ------
    ValueError
        On a malformed image, no folds, a prediction of the wrong shape, or non-finite logits.
    """
    xp = array_namespace(image)
    logits: Array = None
    for start, stop, slab in sliding_window_slabs(image, fold_predictors, settings):
        if logits is None:
            shape = (int(slab.shape[0]), *(int(n) for n in image.shape))
            logits = xp.empty(shape, dtype=xp.float32, device=array_device(image))
        logits[:, start:stop, ...] = slab
    return logits


def sliding_window_slabs(
    image: Array, fold_predictors: Sequence[PatchPredictor], settings: WindowSettings
) -> Iterator[tuple[int, int, Array]]:
    """:func:`sliding_window_logits` slab by slab along z: ``(start, stop, logits)`` with
    float32 ``(C, stop - start, y, x)`` logits, for consecutive ranges that cover the image.

    The tiles are visited in z-major order, and a slice's logits are final (and given out)
    as soon as no remaining tile reaches it, so the accumulator spans about one patch depth,
    not the image: memory in proportion to labels x one patch depth, whatever the number of
    slices. Each value is the one the whole-image accumulation gives, bit for bit (the same
    tiles added in the same order). nnU-Net's float16 reproduction with several folds sums
    whole volumes, one per fold: that case is accumulated whole and given as one slab.

    Raises
    ------
    ValueError
        As :func:`sliding_window_logits` (a slab's non-finite logits when it is given out).
    """
    xp = array_namespace(image)
    dev = array_device(image)
    patch = settings.patch_size
    if image.ndim != 3 or min(image.shape) < 1:
        raise ValueError(f"image {tuple(image.shape)} must be 3-D, non-empty")
    if not fold_predictors:
        raise ValueError("at least one fold predictor is needed")
    acc_dtype = getattr(xp, settings.accumulator_dtype)

    size = tuple(int(n) for n in image.shape)
    padded_shape, inner = pad_to_patch(size, patch)
    data = xp.astype(image, xp.float32, copy=False)
    if padded_shape != size:
        data = xp.zeros(padded_shape, dtype=xp.float32, device=dev)
        data[inner] = xp.astype(image, xp.float32)
    steps = compute_steps_for_sliding_window(padded_shape, patch, settings.tile_step_size)
    tiles = [
        tuple(slice(s, s + p) for s, p in zip(starts, patch, strict=True))
        for starts in itertools.product(*steps)
    ]
    if settings.use_gaussian:
        weights = compute_gaussian(
            patch, settings.sigma_scale, settings.value_scaling_factor, settings.gaussian_dtype
        )
        gaussian = xp.asarray(weights.astype(np.float32), device=dev)
    else:
        gaussian = xp.ones(patch, dtype=xp.float32, device=dev)

    if settings.accumulator_dtype == "float16" and len(fold_predictors) > 1:
        stream = _per_fold_volumes(data, tiles, fold_predictors, gaussian, acc_dtype, settings)
    else:
        stream = _blend(data, tiles, fold_predictors, gaussian, acc_dtype, settings)
    first_z, last_z = inner[0].start, inner[0].stop
    for start, stop, slab in stream:
        low, high = max(start, first_z), min(stop, last_z)
        if low >= high:
            continue
        part = slab[(slice(None), slice(low - start, high - start), *inner[1:])]
        del slab
        part = xp.astype(part, xp.float32, copy=False)
        if not bool(xp.all(xp.isfinite(part))):
            raise ValueError("the blended logits are not all finite (a predictor returned inf/nan)")
        yield low - first_z, high - first_z, part


def _per_fold_volumes(
    data: Array,
    tiles: list[tuple[slice, ...]],
    fold_predictors: Sequence[PatchPredictor],
    gaussian: Array,
    acc_dtype: Any,
    settings: WindowSettings,
) -> Iterator[tuple[int, int, Array]]:
    """nnU-Net's float16 fold average: one blended volume per fold, summed and divided by
    the number of folds in float16; one slab, the whole padded image."""
    xp = array_namespace(data)
    depth = int(data.shape[0])
    logits: Array = None
    channels = settings.channels
    for predictor in fold_predictors:
        window: Array = None
        for start, stop, slab in _blend(
            data, tiles, [predictor], gaussian, acc_dtype, settings, channels
        ):
            if window is None:
                channels = int(slab.shape[0])
                shape = (channels, *(int(n) for n in data.shape))
                window = xp.empty(shape, dtype=acc_dtype, device=array_device(data))
            window[:, start:stop, ...] = slab
        logits = window if logits is None else logits + window
    logits /= float(len(fold_predictors))
    yield 0, depth, logits


_SLAB_BYTES = 64 * 1024 * 1024
"""Largest slab of final logits given out at once (at least one slice), and largest
product of a prediction and the Gaussian added into the accumulator at once."""


def _blend(
    data: Array,
    tiles: list[tuple[slice, ...]],
    fold_predictors: Sequence[PatchPredictor],
    gaussian: Array,
    acc_dtype: Any,
    settings: WindowSettings,
    channels: int | None = None,
) -> Iterator[tuple[int, int, Array]]:
    """``sum_t g p_t / sum_t g`` over ``tiles`` (z-major) of the padded ``data``, in
    ``acc_dtype``, given out as ``(start, stop, slab)`` as soon as slices are final, with
    ``p_t`` the mirror-averaged prediction averaged over ``fold_predictors`` (the mirror
    axes and the batch size of ``settings``).

    The accumulator holds the slices from the first unfinished one to the deepest a batch
    reaches (about a patch depth); finished slices are divided by their summed weight and
    given out in slabs of at most :data:`_SLAB_BYTES`, and the rest moves to the front."""
    xp = array_namespace(data)
    dev = array_device(data)
    patch = tuple(int(n) for n in gaussian.shape)
    half = acc_dtype != xp.float32
    depth, rows, cols = (int(n) for n in data.shape)
    batch_size = settings.batch_size
    groups = [tiles[i : i + batch_size] for i in range(0, len(tiles), batch_size)]
    # the first slice each group leaves unfinished, and the rows the accumulator needs
    ends = [group[0][0].start for group in groups[1:]] + [depth]
    span, low = 1, 0
    for group, end in zip(groups, ends, strict=True):
        span = max(span, max(int(t[0].stop) for t in group) - low)
        low = max(low, end)
    weight_sum = xp.zeros((span, rows, cols), dtype=acc_dtype, device=dev)
    tile_weight = xp.astype(gaussian, acc_dtype)
    folds = len(fold_predictors)
    acc: Array = None
    low = used = 0
    for group, end in zip(groups, ends, strict=True):
        batch = xp.stack([data[t] for t in group])[:, None, ...]
        prediction: Array = None
        for predictor in fold_predictors:
            fold = maybe_mirror_and_predict(batch, predictor, settings.mirror_axes)
            if channels is None:
                channels = int(fold.shape[1]) if fold.ndim == 5 else -1
            want = (len(group), channels, *patch)
            if tuple(fold.shape) != want:
                raise ValueError(f"a predictor returned {tuple(fold.shape)}, expected {want}")
            prediction = fold if prediction is None else prediction + fold
            del fold  # the next fold's prediction is not made beside this one
        del batch
        if folds > 1:
            prediction /= float(folds)
        assert channels is not None
        if acc is None:
            acc = xp.zeros((channels, span, rows, cols), dtype=acc_dtype, device=dev)
        step = max(1, _SLAB_BYTES // (4 * math.prod(patch)))  # channels per product
        for index, (zs, ys, xs) in enumerate(group):
            rz = slice(zs.start - low, zs.stop - low)
            for c0 in range(0, channels, step):
                where = (slice(c0, c0 + step), rz, ys, xs)
                weighted = prediction[index, c0 : c0 + step, ...] * gaussian
                if half:  # float32 sum rounded to float16, as nnU-Net's half += float32
                    weighted = xp.astype(acc[where], xp.float32) + weighted
                    acc[where] = xp.astype(weighted, acc_dtype)
                else:
                    acc[where] += weighted
                del weighted
            weight_sum[rz, ys, xs] += tile_weight
            used = max(used, zs.stop - low)
        del prediction  # not alive while the next batch is predicted
        if end <= low:
            continue
        count = end - low
        per_slab = max(1, _SLAB_BYTES // (channels * rows * cols * 4))
        for first in range(0, count, per_slab):
            last = min(count, first + per_slab)
            yield low + first, low + last, acc[:, first:last, ...] / weight_sum[None, first:last]
        rest = max(0, used - count)
        for c in range(channels):  # one channel at a time: no copy of the whole buffer
            if rest:
                acc[c, :rest, ...] = xp.asarray(acc[c, count:used, ...], copy=True)
            acc[c, rest:used, ...] = 0
        if rest:
            weight_sum[:rest, ...] = xp.asarray(weight_sum[count:used, ...], copy=True)
        weight_sum[rest:used, ...] = 0
        low, used = end, rest


def tile_step_size_from_overlap(
    overlap: float | Sequence[float],
) -> float | tuple[float, float, float]:
    """nnU-Net's ``tile_step_size`` from a manifest's ``overlap`` (``1 - overlap``), rounded to
    12 decimals so that an overlap written as 0.2 gives TotalSegmentator's 0.8 exactly."""
    if isinstance(overlap, int | float):
        return round(1.0 - float(overlap), 12)
    values = [round(1.0 - float(o), 12) for o in overlap]
    if len(values) != 3:
        raise ValueError(f"overlap must be one value or three, got {overlap}")
    return (values[0], values[1], values[2])


def make_predict(
    fold_predictors: Sequence[PatchPredictor], settings: WindowSettings
) -> ImagePredictor:
    """``predict(image) -> (C, z, y, x)`` logits for
    :func:`segnode.engines.preprocess.pipeline.run_model`, from per-fold patch predictors
    (:func:`sliding_window_logits` with ``settings``)."""
    folds = tuple(fold_predictors)
    if not folds:
        raise ValueError("at least one fold predictor is needed")
    return WindowPredictor(folds, settings)


@dataclass(frozen=True)
class WindowPredictor:
    """An :data:`ImagePredictor` over fold predictors that can also give its logits slab by
    slab (:meth:`slabs`), which :func:`segnode.engines.preprocess.pipeline.run_model` prefers:
    the logits of every label over the whole model grid then never exist at once."""

    folds: tuple[PatchPredictor, ...]
    settings: WindowSettings

    def __call__(self, image: Array) -> Array:
        """:func:`sliding_window_logits` of ``image``."""
        return sliding_window_logits(image, self.folds, self.settings)

    def slabs(self, image: Array) -> Iterator[tuple[int, int, Array]]:
        """:func:`sliding_window_slabs` of ``image``."""
        return sliding_window_slabs(image, self.folds, self.settings)


def predict_for_manifest(
    manifest: ModelManifest,
    fold_predictors: Sequence[PatchPredictor],
    *,
    batch_size: int = 1,
) -> ImagePredictor:
    """:func:`make_predict` with a manifest's patch, overlap, sigma, mirror axes and output
    channels; one predictor per entry of ``manifest.fold_paths`` (version 2)."""
    contract = manifest.model_contract()
    if manifest.fold_paths and len(fold_predictors) != len(manifest.fold_paths):
        raise ValueError(
            f"{len(fold_predictors)} predictors for the {len(manifest.fold_paths)} folds of "
            f"{manifest.name}"
        )
    if manifest.output_kind == "labels":
        raise ValueError(f"{manifest.name}: nnU-Net's window blends scores, not labels")
    settings = WindowSettings(
        patch_size=manifest.patch_size,
        tile_step_size=tile_step_size_from_overlap(manifest.overlap),
        mirror_axes=contract.mirror_axes,
        sigma_scale=contract.sigma_scale,
        batch_size=batch_size,
        channels=manifest.output_channels,
    )
    return make_predict(fold_predictors, settings)


def _per_axis(value: float | Sequence[float], dims: int) -> list[float]:
    values = [float(value)] * dims if isinstance(value, int | float) else [float(v) for v in value]
    if len(values) != dims:
        raise ValueError(f"expected one value or {dims}, got {value}")
    return values
