"""A job's memory: the process' resident set, and the peak a trained model's job will reach.

:func:`estimate_job` is what the worker checks against ``[engine] memory_limit`` before a job
runs (issue 37). Since the sliding window gives its logits slab by slab and the export takes
them to the source grid a few slices at a time
(:mod:`segnode.engines.preprocess.export`), nothing grows with labels x source voxels; what
is left is, above the resident set before the job:

* the largest of preprocessing (about 8 bytes a source voxel: the reoriented, normalised
  image and the float64 output of the first resampling pass), the sliding window, and the
  SEG's encoding (its frames: one bit a voxel per segment present, in the worst case every
  label);
* the window: the accumulator (labels x the rows one batch of tiles spans x the model
  grid's plane, float32), the tiles in flight (output and about half again for the
  network's intermediates: ONNX Runtime without its arena), the model-grid image, the
  export's chunks (:data:`EXPORT_BYTES`) and the uint8 labels.

Measured against it on the stand-in for TotalSegmentator's fast model (docs/performance.md):
the estimate was about 20 % above the peak.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from segnode.engines.manifest import ModelManifest

EXPORT_BYTES = 256 * 1024 * 1024
"""The export's working chunks, the Gaussian products and the slabs given out (each kind
bounded by 32-64 MiB, a few alive at once)."""


def available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` (the physical memory where it is not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _status(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_bytes() -> int:
    """This process' resident set now (``VmRSS``; 0 where there is no ``/proc``)."""
    return _status("VmRSS:")


def peak_resident_bytes() -> int:
    """This process' peak resident set (``VmHWM``) since start or :func:`reset_peak`."""
    return _status("VmHWM:")


def reset_peak() -> bool:
    """Start the peak resident set again from the current one (Linux ``clear_refs``); False
    where it cannot (the peak then counts from the start of the process)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


@dataclass(frozen=True)
class JobEstimate:
    """A job's estimated peak resident set and its parts, in bytes.

    Attributes
    ----------
    base
        The resident set before it (the node, its engines and the job's volume).
    preprocess, window, encode
        What each stage adds at its peak; the largest counts.
    """

    base: int
    preprocess: int
    window: int
    encode: int

    @property
    def peak(self) -> int:
        """``base`` plus the largest stage."""
        return self.base + max(self.preprocess, self.window, self.encode)


def estimate_job(
    manifest: ModelManifest,
    shape: tuple[int, int, int],
    spacing: tuple[float, float, float],
    *,
    window_batch: int = 1,
    base: int | None = None,
) -> JobEstimate:
    """The peak a version-2 (trained) model's job on a ``shape`` volume of ``spacing`` (mm,
    ``(z, y, x)``) will reach: see the module docstring. A composite's parts run one after
    the other: the largest part counts.

    Parameters
    ----------
    manifest
        The model (its parts, patch, labels, target spacing and overlap).
    shape, spacing
        The source volume's.
    window_batch
        Tiles per predictor call (:meth:`segnode.engines.base.TrainedEngine.window_batch`).
    base
        Resident bytes before the job (default: this process' now).
    """
    voxels = math.prod(int(n) for n in shape)
    units = [part.manifest for part in manifest.parts] if manifest.parts else [manifest]
    window = 0
    for unit in units:
        contract = unit.model_contract()
        target = contract.spacing if contract.spacing is not None else spacing
        depth = max(1, round(shape[0] * spacing[0] / min(target)))
        model = max(1.0, voxels * math.prod(spacing) / math.prod(target))
        plane = model / depth
        patch = tuple(int(n) for n in unit.patch_size)
        overlap = unit.overlap if isinstance(unit.overlap, int | float) else unit.overlap[0]
        step = max(1, int(patch[0] * (1.0 - float(overlap))))
        rows = min(max(depth, patch[0]), patch[0] + (max(1, window_batch) - 1) * step)
        channels = unit.output_channels
        accumulator = int(channels * rows * plane * 4 + rows * plane * 4)
        tiles = int(max(1, window_batch) * 4 * channels * math.prod(patch) * 1.5)
        window = max(window, accumulator + tiles + int(model * 8) + EXPORT_BYTES + voxels)
    labels = len(manifest.labels) if manifest.labels else max(u.output_channels for u in units)
    return JobEstimate(
        base=resident_bytes() if base is None else base,
        preprocess=8 * voxels,
        window=window,
        encode=int(voxels * (labels / 8 + 2)),
    )
