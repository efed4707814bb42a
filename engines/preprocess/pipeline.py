"""Run a model on a CT volume the way its training pipeline expects, and come back to the
source grid.

:func:`run_model` is nnU-Net v2's ``preprocess -> predict -> export`` around any predictor:

1. reorient the ``(z, y, x)`` HU volume to the model's orientation (exact re-indexing,
   :mod:`~segnode.engines.preprocess.orientation`), then apply ``transpose_forward``;
2. crop to the non-zero bounding box (``crop_to_nonzero``);
3. normalise (:mod:`~segnode.engines.preprocess.intensity`) - before resampling, as nnU-Net;
4. resample the image to the target spacing (order 3, separate z when anisotropic);
5. ``predict``: the model's scores on that grid (sliding window, folds, mirroring - the
   engine's business);
6. resample the scores back to the cropped source shape (order 1, separate z decided from the
   target spacing first, as nnU-Net's export), then arg-max (or the regions' thresholds) -
   slab by slab when the predictor gives slabs (:mod:`~segnode.engines.preprocess.export`);
7. paste into the uncropped shape (background outside), undo the transpose and the
   reorientation.

The result is a label map of the source volume's shape: the SEG stays on the source grid.

With ``resampling.scheme = "totalsegmentator"`` the order is TotalSegmentator's instead
(``nnunet.py``: ``change_spacing`` around nnU-Net): reorient; resample the HU image to the
target spacing on corner-aligned grids (``scipy.ndimage.zoom``, ``grid_mode=False``) with
``data_order`` and truncate it to integers (its ``dtype=np.int32``); crop, normalise and
predict on that grid (nnU-Net's own resampling is then the identity); arg-max there, paste
into the resampled shape, and take the label map back with nearest neighbours on the same
corner-aligned grids; undo the transpose and the reorientation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from array_api_compat import array_namespace
from array_api_compat import device as array_device

from segnode.engines.manifest import ModelContract, ModelManifest
from segnode.engines.preprocess.export import Decision, Slabs, labels_from_slabs
from segnode.engines.preprocess.intensity import nonzero_bbox
from segnode.engines.preprocess.orientation import Geometry, plan_reorientation
from segnode.engines.preprocess.resampling import (
    compute_new_shape,
    resample,
    resample_labels,
    separate_z_axis,
)

Predict = Callable[[Any], Any]
"""``predict(image)``: the preprocessed float32 ``(z, y, x)`` image on the model's grid in,
``(C, z, y, x)`` logits or probabilities (C: :attr:`ModelManifest.output_channels`) or a
``(z, y, x)`` integer label map out, in the image's namespace and device."""


def run_model(
    hu: Any,
    geometry: Geometry,
    manifest: ModelManifest,
    predict: Predict,
    *,
    precise: bool = True,
) -> Any:
    """Label map of ``hu`` on its own grid from a model with ``manifest``'s contract.

    Parameters
    ----------
    hu
        float32 ``(z, y, x)`` HU volume (NumPy, or torch / CuPy on a GPU) on the source grid.
    geometry
        Its geometry (:meth:`Geometry.from_volume`).
    manifest
        A version-2 manifest, or a version-1 one (source grid, its clip/scale/offset).
    predict
        See :data:`Predict`. A label map coming back is taken back to the source grid with
        order 0 (nearest): nnU-Net resamples logits instead, so give scores to agree with it.
    precise
        Resample in float64 (nnU-Net's arithmetic) rather than float32.

    Returns
    -------
    array
        uint8 label map, shape of ``hu``, same namespace and device.

    Raises
    ------
    GeometryError
        A tilted or oblique series the model does not accept.
    ValueError
        ``predict`` returned an unexpected shape.
    """
    xp = array_namespace(hu)
    if hu.ndim != 3:
        raise ValueError(f"hu must be (z, y, x), got shape {tuple(hu.shape)}")
    contract = manifest.model_contract()
    if contract.scheme == "totalsegmentator":
        grid, reorient = model_grid(hu, geometry, contract, precise=precise)
        labels = labels_on_grid(grid, manifest, predict, precise=precise)
        return grid_to_source(labels, grid, reorient, contract)
    image, spacing, reorient = _to_model(hu, geometry, contract)
    full_shape = tuple(int(n) for n in image.shape)

    box = (
        nonzero_bbox(image) if contract.crop_to_nonzero else tuple(slice(0, n) for n in full_shape)
    )
    image = image[box]
    cropped_shape = tuple(int(n) for n in image.shape)
    image = contract.normalization(image)

    target = contract.spacing if contract.spacing is not None else spacing
    model_shape = compute_new_shape(cropped_shape, spacing, target)
    axis = separate_z_axis(
        spacing,
        target,
        threshold=contract.anisotropy_threshold,
        force=contract.force_separate_z,
    )
    image = resample(
        image[None, ...],
        model_shape,
        order=contract.data_order,
        separate_axis=axis,
        order_z=contract.order_z,
        precise=precise,
    )[0, ...]

    labels = _labels_on_source(
        predict, image, manifest, contract, model_shape, cropped_shape, target, spacing, precise
    )
    del image
    dev = array_device(hu)
    full = xp.zeros(full_shape, dtype=xp.uint8, device=dev)
    full[box] = labels
    full = xp.permute_dims(full, contract.transpose_backward)
    return reorient.to_source(full, xp)


def _to_model(
    hu: Any, geometry: Geometry, contract: ModelContract
) -> tuple[Any, tuple[float, ...], Any]:
    """``hu`` reoriented to the model's orientation and transposed (``transpose_forward``):
    the image, its spacing and the reorientation to undo."""
    xp = array_namespace(hu)
    reorient = plan_reorientation(
        geometry, contract.orientation, tilt_allowed=contract.gantry_tilt_allowed
    )
    forward = contract.transpose_forward
    image = xp.permute_dims(reorient.to_model(hu, xp), forward)
    spacing_model = reorient.spacing_to_model(geometry.spacing)
    return image, tuple(spacing_model[i] for i in forward), reorient


SPLIT_VOXELS = 512 * 512 * 900
"""TotalSegmentator's ``nr_voxels_thr`` (``nnunet.py``): a multi-part task (``total``) whose
resampled image has more voxels than this, and more than :data:`SPLIT_MIN_Z` slices, is
predicted in three overlapping thirds along the slice axis."""
SPLIT_MIN_Z = 200
SPLIT_MARGIN = 20
"""Slices each third reaches into its neighbours (TotalSegmentator's ``margin``)."""


@dataclass(frozen=True)
class ModelGrid:
    """The ``"totalsegmentator"`` scheme's input on the model grid, made once and shared by
    every model whose :func:`grid_key` is the same (the parts of a composite).

    Attributes
    ----------
    image
        Resampled, integer-truncated HU of shape ``model_shape`` (not yet normalised: each
        model normalises with its own intensity properties).
    crop
        Whether the models crop to the non-zero bounding box (``crop_to_nonzero``).
    model_shape, source_shape
        Shapes of the resampled grid and of the reoriented, transposed source image.
    target
        The model's spacing.
    """

    image: Any
    crop: bool
    model_shape: tuple[int, ...]
    source_shape: tuple[int, ...]
    target: tuple[float, ...]

    def thirds(self) -> list[tuple[slice, slice, slice]]:
        """TotalSegmentator's split of the slice axis (axis 0, superior, on this grid; the
        third axis of its RAS array): ``(predicted, kept from the prediction, written to)``
        per third. ``s01 = [:t+m]``, ``s02 = [t+1-m : 2t+m]``, ``s03 = [2t+1-m:]``, combined
        as ``[:t] = s01[:-m]``, ``[t:2t] = s02[m-1:-m]``, ``[2t:] = s03[m-1:]``."""
        return self.pieces(3)

    def pieces(self, count: int) -> list[tuple[slice, slice, slice]]:
        """:meth:`thirds` generalised to ``count`` overlapping pieces of the slice axis (the
        same slices for 3; one piece, the whole axis, for 1): piece ``i`` of ``t = n //
        count`` slices writes ``[i t : (i + 1) t]`` (the last to the end), predicted with
        :data:`SPLIT_MARGIN` slices more on each inner side."""
        n, m = self.model_shape[0], SPLIT_MARGIN
        if count == 1:
            whole = slice(0, n)
            return [(whole, whole, whole)]
        t = n // count
        if t + 1 - m < 0 or t < m:
            raise ValueError(f"{n} slices are too few to split in {count} with a margin of {m}")
        regions = [(slice(0, t + m), slice(0, t), slice(0, t))]
        for i in range(1, count):
            end = n if i == count - 1 else (i + 1) * t
            regions.append(
                (
                    slice(i * t + 1 - m, n if i == count - 1 else end + m),
                    slice(m - 1, m - 1 + end - i * t),
                    slice(i * t, end),
                )
            )
        return regions


def split_in_thirds(grid: ModelGrid, parts: int) -> bool:
    """TotalSegmentator's rule: a multi-part task on a grid of more than
    :data:`SPLIT_VOXELS` voxels and :data:`SPLIT_MIN_Z` slices runs in thirds."""
    voxels = 1
    for n in grid.model_shape:
        voxels *= n
    return parts > 1 and voxels > SPLIT_VOXELS and grid.model_shape[0] > SPLIT_MIN_Z


def grid_key(contract: ModelContract) -> tuple[Any, ...] | None:
    """What the ``"totalsegmentator"`` scheme's model grid depends on (``None`` for the
    other schemes): models with equal keys share one :class:`ModelGrid`."""
    if contract.scheme != "totalsegmentator":
        return None
    return (
        contract.orientation,
        contract.gantry_tilt_allowed,
        tuple(contract.transpose_forward),
        tuple(contract.transpose_backward),
        contract.spacing,
        contract.data_order,
        contract.crop_to_nonzero,
    )


def model_grid(
    hu: Any, geometry: Geometry, contract: ModelContract, *, precise: bool = True
) -> tuple[ModelGrid, Any]:
    """Reorient, transpose, resample (corner-aligned, ``data_order``) and truncate ``hu``
    for a ``"totalsegmentator"`` model: the grid, and the reorientation to undo."""
    xp = array_namespace(hu)
    image, spacing, reorient = _to_model(hu, geometry, contract)
    source_shape = tuple(int(n) for n in image.shape)
    target = contract.spacing if contract.spacing is not None else spacing
    model_shape = compute_new_shape(source_shape, spacing, target)
    resampled = resample(
        image[None, ...], model_shape, order=contract.data_order, precise=precise, grid="corners"
    )[0, ...]
    del image
    resampled = xp.astype(xp.trunc(resampled), xp.float32)  # change_spacing(dtype=np.int32)
    grid = ModelGrid(
        resampled, contract.crop_to_nonzero, tuple(model_shape), source_shape, tuple(target)
    )
    return grid, reorient


def labels_on_grid(
    grid: ModelGrid,
    manifest: ModelManifest,
    predict: Predict,
    *,
    precise: bool = True,
    region: slice | None = None,
) -> Any:
    """One ``"totalsegmentator"`` model's uint8 labels on the model grid (of ``region``
    along the slice axis: one of :meth:`ModelGrid.thirds`), as nnU-Net predicts the image
    TotalSegmentator saved: cropped to its non-zero box, normalised with the model's
    intensity properties, arg-max on that grid (nnU-Net's export resampling is the identity
    on its own grid), background outside the box."""
    contract = manifest.model_contract()
    image = grid.image if region is None else grid.image[region]
    shape = tuple(int(n) for n in image.shape)
    box = nonzero_bbox(image) if grid.crop else tuple(slice(0, n) for n in shape)
    cropped = contract.normalization(image[box])
    cropped_shape = tuple(int(n) for n in cropped.shape)
    labels = _labels_on_source(
        predict,
        cropped,
        manifest,
        contract,
        cropped_shape,
        cropped_shape,
        grid.target,
        grid.target,
        precise,
    )
    del cropped
    xp = array_namespace(labels)
    full = xp.zeros(shape, dtype=xp.uint8, device=array_device(labels))
    full[box] = labels
    return full


def grid_to_source(labels: Any, grid: ModelGrid, reorient: Any, contract: ModelContract) -> Any:
    """uint8 labels on the model grid back to the source volume: nearest neighbours on the
    corner-aligned grids, the transpose and the reorientation undone."""
    xp = array_namespace(labels)
    back = resample_labels(labels, grid.source_shape, grid="corners")
    return reorient.to_source(xp.permute_dims(back, contract.transpose_backward), xp)


def _labels_on_source(
    predict: Predict,
    image: Any,
    manifest: ModelManifest,
    contract: ModelContract,
    model_shape: tuple[int, ...],
    cropped_shape: tuple[int, ...],
    target: tuple[float, ...],
    spacing: tuple[float, ...],
    precise: bool,
) -> Any:
    """uint8 labels of the cropped source shape from ``predict``'s scores of ``image`` (on
    the model grid), slab by slab where the predictor gives slabs
    (:mod:`~segnode.engines.preprocess.export`)."""
    back_axis = separate_z_axis(
        target,
        spacing,
        threshold=contract.anisotropy_threshold,
        force=contract.force_separate_z,
    )
    slabs = getattr(predict, "slabs", None)
    if slabs is not None:
        stream: Slabs = slabs(image)
    else:
        scores = predict(image)
        if scores.ndim == 3:
            if tuple(scores.shape) != model_shape:
                raise ValueError(
                    f"predict returned labels {tuple(scores.shape)}, expected {model_shape}"
                )
            return resample_labels(scores, cropped_shape)
        want = (manifest.output_channels, *model_shape)
        if tuple(scores.shape) != want:
            raise ValueError(f"predict returned shape {tuple(scores.shape)}, expected {want}")
        stream = [(0, model_shape[0], scores)]
    decide = Decision()
    if contract.regions is not None and contract.regions_class_order is not None:
        # region-based: sigmoid(logit) > 0.5 <=> logit > 0 (probabilities: > 0.5), later wins
        threshold = 0.0 if manifest.output_kind == "logits" else 0.5
        decide = Decision(tuple(contract.regions_class_order), threshold)
    return labels_from_slabs(
        stream,
        decide,
        model_shape=model_shape,
        new_shape=cropped_shape,
        order=contract.logits_order,
        separate_axis=back_axis,
        order_z=contract.order_z,
        precise=precise,
    )
