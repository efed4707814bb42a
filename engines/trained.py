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

Where the GPU runs out of memory (:class:`~segnode.engines.base.GpuMemoryError`), the job is
not failed at once: a model on the ``"totalsegmentator"`` scheme's grid (a composite of such
parts, or one such model) runs again with fewer tiles per network call and then in more
overlapping pieces along the slice axis (:func:`memory_ladder`), each attempt after the cached
memory is handed back; only when the last attempt runs out too does the job fail, with what
was tried in the reason.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
from array_api_compat import array_namespace
from array_api_compat import device as array_device

from segnode.engines.base import (
    DeviceSumsEngine,
    EngineError,
    GpuMemoryError,
    LabelSums,
    PatchPredictor,
    TrainedEngine,
)
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

log = logging.getLogger(__name__)

#: The fewest model-grid slices a piece of the memory split may keep (its margins come on top).
MIN_PIECE_SLICES = 48


@dataclass(frozen=True)
class Attempt:
    """One try at a volume: tiles per network call and pieces along the slice axis (1: the
    whole grid, or TotalSegmentator's thirds where its rule applies)."""

    batch: int
    pieces: int
    #: Whether the model grid is made on the host (the whole source volume then never goes
    #: to the GPU, nor the float64 passes of its resampling): only the grid, the networks
    #: and their window are on the device, and the labels go back to the source grid on
    #: the host.
    host_grid: bool = False

    def __str__(self) -> str:
        text = f"batch {self.batch}, {self.pieces} piece{'s' if self.pieces > 1 else ''}"
        return text + (", the grid made on the host" if self.host_grid else "")


def memory_ladder(batch: int, slices: int, *, split: bool) -> Iterator[Attempt]:
    """The attempts of a job that runs out of GPU memory, in order: the engine's batch on
    the whole grid; the batch halved down to 1 (the network's activations and the window's
    accumulator shrink with it); then, where ``split`` (a model on the shared grid), 3
    overlapping pieces of the ``slices`` model-grid slices, and 3, 6, 12 ... with the grid made
    on the host (the source volume and its resampling, the largest buffers of a long series,
    stay off the GPU), as long as each piece keeps at least :data:`MIN_PIECE_SLICES`. Three
    pieces are TotalSegmentator's own thirds, so the first split gives its answer for a large
    volume; a network that sees less context across a seam may label near it otherwise (on the
    phantom, 2 and 4 pieces agreed with the whole grid less than the thirds did)."""
    yield Attempt(batch, 1)
    while batch > 1:
        batch //= 2
        yield Attempt(batch, 1)
    if not split or slices // 3 < MIN_PIECE_SLICES:
        return
    yield Attempt(1, 3)
    pieces = 3
    while slices // pieces >= MIN_PIECE_SLICES:
        yield Attempt(1, pieces, host_grid=True)
        pieces *= 2


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
        failed (out of GPU memory after every attempt of :func:`memory_ladder`).
    """
    labels, _ = _segment(engine, manifest, hu, geometry, precise=precise, sums=False)
    return labels


def segment_trained_with_sums(
    engine: Any,
    manifest: ModelManifest,
    hu: npt.NDArray[np.float32],
    geometry: Geometry,
    *,
    precise: bool = True,
) -> tuple[npt.NDArray[np.uint8], LabelSums | None]:
    """:func:`segment_trained`, and where the engine sums on its device
    (:class:`~segnode.engines.base.DeviceSumsEngine`) the label map's
    :class:`~segnode.engines.base.LabelSums` over ``hu``, computed there before the map goes
    to the host (``None`` for other engines: the caller sums on the host)."""
    return _segment(engine, manifest, hu, geometry, precise=precise, sums=True)


def _segment(
    engine: Any,
    manifest: ModelManifest,
    hu: npt.NDArray[np.float32],
    geometry: Geometry,
    *,
    precise: bool,
    sums: bool,
) -> tuple[npt.NDArray[np.uint8], LabelSums | None]:
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
    summing = engine if sums and isinstance(engine, DeviceSumsEngine) else None
    units = _grid_units(manifest)
    if units is None and manifest.parts:  # parts on grids of their own
        return _merge_on_source(engine, manifest, volume, geometry, predictors, batch, precise)
    if units is None:  # one model of another scheme
        with engine.device_scope():
            image = engine.to_device(np.ascontiguousarray(volume, dtype=np.float32))
            labels = _run(manifest, image, geometry, predictors, batch, precise)
            found = summing.label_sums(labels, image) if summing is not None else None
            return engine.to_host(labels), found
    tried: list[str] = []
    slices = _grid_slices(units[0][0], volume.shape, geometry)
    ladder = list(memory_ladder(batch, slices, split=True))
    for attempt, following in zip(ladder, [*ladder[1:], None], strict=True):
        try:
            with engine.device_scope():
                if attempt.host_grid:  # labels on the host, summed there by the caller
                    host = np.ascontiguousarray(volume, dtype=np.float32)
                    done = _run_on_grid(
                        manifest, units, host, geometry, predictors, attempt, precise, engine
                    )
                    return np.asarray(done, dtype=np.uint8), None
                image = engine.to_device(np.ascontiguousarray(volume, dtype=np.float32))
                labels = _run_on_grid(
                    manifest, units, image, geometry, predictors, attempt, precise, engine
                )
                found = summing.label_sums(labels, image) if summing is not None else None
                del image
                return engine.to_host(labels), found
        except GpuMemoryError as exc:  # its first two sentences: what ran out, and by how much
            tried.append(f"{attempt}: {'. '.join(str(exc).split('. ')[:2])}")
        # Out of the handler: the error's frames (and the tensors they hold) are gone now.
        gc.collect()
        release = getattr(engine, "release_memory", None)
        if release is not None:
            release()
        if following is not None:
            log.warning(
                "model %s: out of GPU memory on a %s volume with %s; trying %s",
                manifest.name,
                "x".join(map(str, volume.shape)),
                attempt,
                following,
            )
    raise GpuMemoryError(
        f"model {manifest.name}: a {'x'.join(map(str, volume.shape))} volume does not fit the "
        f"GPU, tried {'; '.join(tried)}"
    )


def _merge_on_source(
    engine: Any,
    manifest: ModelManifest,
    volume: npt.NDArray[np.float32],
    geometry: Geometry,
    predictors: list[PatchPredictor],
    batch: int,
    precise: bool,
) -> tuple[npt.NDArray[np.uint8], None]:
    """A composite whose parts have grids of their own: each part on the source grid, merged
    on the host (later parts overwriting)."""
    merged = np.zeros(volume.shape, dtype=np.uint8)
    with engine.device_scope():
        image = engine.to_device(np.ascontiguousarray(volume, dtype=np.float32))
        first = 0
        for part in manifest.parts:
            count = len(part.manifest.model_files())
            found = _run(
                part.manifest, image, geometry, predictors[first : first + count], batch, precise
            )
            first += count
            mapped = part.lookup_table()[engine.to_host(found)]
            np.copyto(merged, mapped, where=mapped > 0)
    return merged, None


Unit = tuple[ModelManifest, "npt.NDArray[np.uint8] | None"]
"""A model run on the shared grid and the lookup table of its labels into the merged values
(``None``: its own values, a model that is not a composite's part)."""


def _grid_units(manifest: ModelManifest) -> list[Unit] | None:
    """The models that run on one shared model grid: every part of a composite whose parts
    share it (:func:`~segnode.engines.preprocess.pipeline.grid_key`: TotalSegmentator's five
    ``total`` parts), or one model of the ``"totalsegmentator"`` scheme; ``None`` otherwise
    (parts on grids of their own, other schemes)."""
    if not manifest.parts:
        if grid_key(manifest.model_contract()) is None:
            return None
        return [(manifest, None)]
    keys = {grid_key(part.manifest.model_contract()) for part in manifest.parts}
    if len(keys) != 1 or None in keys:
        return None
    return [(part.manifest, part.lookup_table()) for part in manifest.parts]


def _grid_slices(unit: ModelManifest, shape: tuple[int, ...], geometry: Geometry) -> int:
    """About how many slices the model grid has along the source's slice axis (the memory
    ladder's bound on its pieces)."""
    contract = unit.model_contract()
    finest = min(contract.spacing) if contract.spacing is not None else geometry.spacing[0]
    return max(1, round(shape[0] * geometry.spacing[0] / finest))


def _run_on_grid(
    manifest: ModelManifest,
    units: list[Unit],
    image: Any,
    geometry: Geometry,
    predictors: list[PatchPredictor],
    attempt: Attempt,
    precise: bool,
    engine: Any,
) -> Any:
    """Models that share one model grid (TotalSegmentator's ``total``: five parts at 1.5 mm;
    or one ``"totalsegmentator"`` model): the image is reoriented, resampled and cropped
    once, each model predicts on it, the parts are merged there (later parts overwriting, as
    TotalSegmentator merges them on its resampled image), and the merged labels go back to
    the source grid once. Nearest-neighbour resampling picks voxels, so merging before it
    gives the same labels as merging after it. A composite's grid above TotalSegmentator's
    size limit is predicted in its three overlapping thirds along the slice axis
    (:func:`split_in_thirds`), as it does; an ``attempt`` of more pieces splits it so (after
    running out of GPU memory). With ``attempt.host_grid`` the ``image`` is the host's, the
    grid is made there and moved to the ``engine``'s device, and the merged labels come back
    to the host before they go back to the source grid (the result is then the host's)."""
    contract = units[0][0].model_contract()
    try:
        grid, reorient = model_grid(image, geometry, contract, precise=precise)
        if attempt.host_grid:
            grid = replace(grid, image=engine.to_device(grid.image))
        xp = array_namespace(grid.image)
        pieces = attempt.pieces
        if pieces == 1 and len(units) > 1 and split_in_thirds(grid, len(units)):
            pieces = 3
        regions = grid.pieces(pieces)
        dev = array_device(grid.image)
        merged = xp.zeros(grid.model_shape, dtype=xp.uint8, device=dev)
        first = 0
        for unit, lookup in units:
            count = len(unit.model_files())
            predict = predict_for_manifest(
                unit, predictors[first : first + count], batch_size=attempt.batch
            )
            first += count
            table = None if lookup is None else xp.asarray(lookup, device=dev)
            for predicted, kept, written in regions:
                found = labels_on_grid(grid, unit, predict, precise=precise, region=predicted)
                found = found[kept]
                if table is not None:
                    found = xp.reshape(
                        xp.take(table, xp.reshape(xp.astype(found, xp.int64), (-1,))),
                        found.shape,
                    )
                merged[written] = xp.where(found > 0, found, merged[written])
                del found
        if attempt.host_grid:
            grid = replace(grid, image=None)  # the device's copy goes
            merged = engine.to_host(merged)
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
