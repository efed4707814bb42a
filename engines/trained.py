"""Run a version-2 (trained) model, or a composite of several, on a CT volume.

:func:`segment_trained` is the one entry point the worker calls for a version-2 manifest:

1. the HU volume goes to the backend's device once (:meth:`TrainedEngine.to_device`);
2. per model (the manifest itself, or each part of a composite in order):
   :func:`segnode.engines.preprocess.pipeline.run_model` around
   :func:`segnode.engines.nnunet_window.predict_for_manifest` with that model's fold predictors -
   reorientation, cropping, normalisation, resampling to the model's spacing, nnU-Net's
   Gaussian window with mirroring and the fold average, the scores back to the source grid,
   arg-max - all on the device, inside :meth:`TrainedEngine.device_scope`;
3. the uint8 labels come back to the host (:meth:`TrainedEngine.to_host`);
4. a composite's parts are merged: wherever a part's label maps to a merged value it is
   written, later parts overwriting earlier ones (as TotalSegmentator). Parts that share
   one model grid (:func:`~segnode.engines.preprocess.pipeline.grid_key`: TotalSegmentator's
   five ``total`` parts) are resampled once, merged on that grid on the device and taken
   back to the source grid once; other composites are merged on the source grid.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from array_api_compat import array_namespace
from array_api_compat import device as array_device

from segnode.engines.base import EngineError, PatchPredictor, TrainedEngine
from segnode.engines.manifest import ModelManifest
from segnode.engines.nnunet_window import predict_for_manifest
from segnode.engines.preprocess.orientation import Geometry
from segnode.engines.preprocess.pipeline import (
    grid_key,
    grid_to_source,
    labels_on_grid,
    model_grid,
    run_model,
    split_in_thirds,
)


def segment_trained(
    engine: Any,
    manifest: ModelManifest,
    hu: npt.NDArray[np.float32],
    geometry: Geometry,
    *,
    precise: bool = True,
) -> npt.NDArray[np.uint8]:
    """Label map of ``hu`` on its own grid from a version-2 model (or composite).

    Parameters
    ----------
    engine
        A :class:`~segnode.engines.base.TrainedEngine` loaded with ``manifest``.
    manifest
        The version-2 manifest the engine was loaded with.
    hu
        float32 ``(z, y, x)`` HU volume on the source grid.
    geometry
        Its geometry (:meth:`Geometry.from_volume`).
    precise
        Resample in float64 (nnU-Net's arithmetic) rather than float32.

    Returns
    -------
    numpy.ndarray
        uint8 label map of ``hu``'s shape, values of ``manifest.labels``.

    Raises
    ------
    GeometryError
        A tilted or oblique series that a model does not accept (an :class:`EngineError`).
    EngineError
        The engine cannot run trained models, was loaded with another model, or inference
        failed.
    """
    if not isinstance(engine, TrainedEngine):
        raise EngineError(
            f"engine {getattr(engine, 'name', type(engine).__name__)!r} cannot run trained "
            "(version-2) models"
        )
    if not manifest.is_trained:
        raise EngineError(f"model {manifest.name}: segment_trained needs a version-2 manifest")
    volume = np.asarray(hu)
    if volume.ndim != 3 or min(volume.shape) < 1:
        raise EngineError(f"expected a non-empty (z, y, x) volume, got shape {volume.shape}")
    predictors = engine.fold_predictors()
    expected = len(manifest.model_files())
    if len(predictors) != expected:
        raise EngineError(
            f"model {manifest.name}: the engine holds {len(predictors)} fold network(s), "
            f"the manifest has {expected} (loaded with another model?)"
        )
    batch = max(1, int(engine.window_batch()))
    with engine.device_scope():
        image = engine.to_device(np.ascontiguousarray(volume, dtype=np.float32))
        if not manifest.parts:
            labels = _run(manifest, image, geometry, predictors, batch, precise)
            return engine.to_host(labels)
        if _shares_one_grid(manifest):
            return engine.to_host(
                _run_on_grid(manifest, image, geometry, predictors, batch, precise)
            )
        merged = np.zeros(volume.shape, dtype=np.uint8)
        first = 0
        for part in manifest.parts:
            count = len(part.manifest.model_files())
            found = _run(
                part.manifest, image, geometry, predictors[first : first + count], batch, precise
            )
            first += count
            mapped = part.lookup_table()[engine.to_host(found)]
            np.copyto(merged, mapped, where=mapped > 0)
        return merged


def _shares_one_grid(manifest: ModelManifest) -> bool:
    """Whether every part of a composite has the same model grid
    (:func:`~segnode.engines.preprocess.pipeline.grid_key`, ``None`` for schemes without
    one); otherwise each part runs on its own."""
    keys = {grid_key(part.manifest.model_contract()) for part in manifest.parts}
    return len(keys) == 1 and None not in keys


def _run_on_grid(
    manifest: ModelManifest,
    image: Any,
    geometry: Geometry,
    predictors: list[PatchPredictor],
    batch: int,
    precise: bool,
) -> Any:
    """A composite whose parts share one model grid (TotalSegmentator's ``total``: five
    parts at 1.5 mm): the image is reoriented, resampled and cropped once, each part predicts
    on it, the parts are merged there (later parts overwriting, as TotalSegmentator merges
    them on its resampled image), and the merged labels go back to the source grid once.
    Nearest-neighbour resampling picks voxels, so merging before it gives the same labels
    as merging after it. A grid above TotalSegmentator's size limit is predicted in its
    three overlapping thirds along the slice axis (:func:`split_in_thirds`), as it does."""
    xp = array_namespace(image)
    contract = manifest.parts[0].manifest.model_contract()
    try:
        grid, reorient = model_grid(image, geometry, contract, precise=precise)
        whole = slice(0, grid.model_shape[0])
        regions = (
            grid.thirds() if split_in_thirds(grid, len(manifest.parts)) else [(whole, whole, whole)]
        )
        dev = array_device(grid.image)
        merged = xp.zeros(grid.model_shape, dtype=xp.uint8, device=dev)
        first = 0
        for part in manifest.parts:
            count = len(part.manifest.model_files())
            predict = predict_for_manifest(
                part.manifest, predictors[first : first + count], batch_size=batch
            )
            first += count
            table = xp.asarray(part.lookup_table(), device=dev)
            for predicted, kept, written in regions:
                found = labels_on_grid(
                    grid, part.manifest, predict, precise=precise, region=predicted
                )
                found = found[kept]
                mapped = xp.reshape(
                    xp.take(table, xp.reshape(xp.astype(found, xp.int64), (-1,))), found.shape
                )
                del found
                merged[written] = xp.where(mapped > 0, mapped, merged[written])
        return grid_to_source(merged, grid, reorient, contract)
    except ValueError as exc:
        raise EngineError(f"model {manifest.name}: {exc}") from exc


def _run(
    manifest: ModelManifest,
    image: Any,
    geometry: Geometry,
    predictors: list[PatchPredictor],
    batch: int,
    precise: bool,
) -> Any:
    """One model's uint8 labels on the source grid, on the engine's device."""
    try:
        predict = predict_for_manifest(manifest, predictors, batch_size=batch)
        return run_model(image, geometry, manifest, predict, precise=precise)
    except ValueError as exc:
        raise EngineError(f"model {manifest.name}: {exc}") from exc
