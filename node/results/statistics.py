"""Per-label measurements of a label map: voxel counts and HU statistics.

* :func:`label_counts` checks a label map against the model's labels and counts the voxels
  of each value (one comparison per label, a few hundred thousand voxels at a time);
* :func:`segment_numbers` numbers the non-empty labels 1..n in ascending label value, the
  segment numbers of the SEG and the SR;
* :class:`SegmentStatsAccumulator` sums voxel counts, HU and squared HU per label, slab by
  slab (the worker can feed it while inference produces slabs), and
  :func:`segment_statistics` runs it over a whole volume for the TID 1500 report;
* :func:`statistics_from_sums` gives the same statistics from the sums an engine computed
  where its label map is (:class:`segnode.engines.base.LabelSums`, summed on the GPU), with the same
  checks of the label values.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from segnode.engines.base import LabelSums
from segnode.engines.manifest import LabelSpec, ModelManifest
from segnode.node.errors import ResultError
from segnode.node.ingest.volume import Volume


class Shaped(Protocol):
    """What :func:`label_counts` reads of a volume."""

    @property
    def shape(self) -> tuple[int, ...]:
        """``(slices, rows, columns)``."""
        ...


class Measured(Shaped, Protocol):
    """What :func:`segment_statistics` reads of a volume (a
    :class:`~segnode.node.ingest.volume.Volume`, or its HU alone in an encoder process)."""

    @property
    def hu(self) -> npt.NDArray[np.floating]:
        """The HU, of :attr:`shape`."""
        ...

    @property
    def voxel_volume_ml(self) -> float:
        """Millilitres per voxel."""
        ...


@dataclass(frozen=True)
class _Shape:
    """A slab's shape, standing for the volume :func:`label_counts` checks it against."""

    shape: tuple[int, ...]


_T = TypeVar("_T", bound=np.generic)

#: Voxels per step of the label scans: their temporaries stay in the CPU caches.
_CHUNK_VOXELS = 1 << 18
#: Up to this many manifest labels, counting compares once per label; beyond, np.bincount.
_MASK_LABELS = 32
#: Label maps whose runs of equal labels are shorter than this on average are summed by
#: np.bincount (copying a selection and summing runs cost per run).
_MIN_RUN = 8
#: Fragmentation is judged on one block of this many voxels in _SAMPLE_STEP.
_SAMPLE_VOXELS = 4096
_SAMPLE_STEP = 8


@dataclass(frozen=True)
class SegmentStatistics:
    """Measurements of one segment."""

    segment_number: int
    label: LabelSpec
    voxels: int
    volume_ml: float
    mean_hu: float
    std_hu: float  # population standard deviation (ddof = 0)


def label_counts(
    volume: Shaped, labels: npt.NDArray[np.integer], manifest: ModelManifest
) -> npt.NDArray[np.intp]:
    """Voxel count of every label value 0..max manifest value, after checking ``labels``.

    Only ``volume.shape`` is read.
    """
    if labels.shape != volume.shape:
        raise ResultError(f"label map has shape {labels.shape}, volume has {volume.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ResultError(f"label map must be integer, got {labels.dtype}")
    fast = _known_counts(labels, manifest)
    if fast is not None:
        return fast
    known = {spec.value for spec in manifest.labels}
    top = max(known)
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) > top):
        outside = labels[(labels < 0) | (labels > top)]
        raise ResultError(
            f"label map contains values {sorted({int(v) for v in outside[:100_000]})} that "
            f"model {manifest.name} {manifest.version} does not describe (known: "
            f"{sorted(known)})"
        )
    counts: npt.NDArray[np.intp] = _bincount(labels, top + 1)
    unknown = [v for v in np.flatnonzero(counts).tolist() if v != 0 and v not in known]
    if unknown:
        raise ResultError(
            f"label map contains values {unknown} that model {manifest.name} "
            f"{manifest.version} does not describe (known: {sorted(known)})"
        )
    return counts


def _bincount(labels: npt.NDArray[np.integer], minlength: int) -> npt.NDArray[np.intp]:
    """``np.bincount`` over a label volume, a few slices at a time (no GB-sized temporaries)."""
    counts = np.zeros(minlength, dtype=np.intp)
    step = max(1, (1 << 22) // max(1, labels[0].size)) if labels.ndim > 1 else labels.size or 1
    for z in range(0, labels.shape[0], step):
        part = np.bincount(labels[z : z + step].ravel().astype(np.intp), minlength=minlength)
        if len(part) > len(counts):
            counts = np.concatenate([counts, np.zeros(len(part) - len(counts), np.intp)])
        counts[: len(part)] += part
    return counts


def _chunks(flat: npt.NDArray[np.generic]) -> Iterator[slice]:
    """Slices of ``flat`` small enough for their temporaries to stay in cache."""
    for start in range(0, flat.size, _CHUNK_VOXELS):
        yield slice(start, start + _CHUNK_VOXELS)


def _fragmented(chunk: npt.NDArray[np.integer]) -> bool:
    """Whether runs of equal labels in ``chunk`` are shorter than ``_MIN_RUN`` on average,
    judged on one block of ``_SAMPLE_VOXELS`` in ``_SAMPLE_STEP`` (a cost estimate only)."""
    usable = chunk.size - chunk.size % _SAMPLE_VOXELS
    if usable:
        sample = chunk[:usable].reshape(-1, _SAMPLE_VOXELS)[::_SAMPLE_STEP]
    else:
        sample = chunk.reshape(1, -1)
    changes = int(np.count_nonzero(sample[:, 1:] != sample[:, :-1]))
    return changes * _MIN_RUN > sample.size


def _known_counts(
    labels: npt.NDArray[np.integer], manifest: ModelManifest
) -> npt.NDArray[np.intp] | None:
    """Voxel count of every value 0..max manifest value, one comparison per manifest label.

    Cheaper than ``np.bincount`` (which widens every voxel to ``intp``) for the few labels
    of a model. None when ``labels`` holds a value other than 0 and the manifest's (the
    caller then finds which, for its message), or when the manifest has too many labels or
    a label 0 for this way of counting.
    """
    values = sorted({spec.value for spec in manifest.labels})
    if values[0] <= 0 or len(values) > _MASK_LABELS:
        return None
    counts = np.zeros(values[-1] + 1, dtype=np.intp)
    flat = labels.reshape(-1)
    for part in _chunks(flat):
        chunk = flat[part]
        labelled = int(np.count_nonzero(chunk))
        seen = 0
        for value in values:
            if seen == labelled:
                break
            n = int(np.count_nonzero(chunk == value))
            counts[value] += n
            seen += n
        if seen != labelled:
            return None
    counts[0] = flat.size - int(counts.sum())
    return counts


def numbering(counts: npt.NDArray[np.integer], manifest: ModelManifest) -> dict[int, int]:
    """``{label value: segment number}`` of the labels with a count, numbered 1..n in
    ascending label value; ``counts`` is indexed by label value."""
    present = [s.value for s in sorted(manifest.labels, key=lambda s: s.value) if counts[s.value]]
    return {value: number for number, value in enumerate(present, start=1)}


def segment_numbers(labels: npt.NDArray[np.integer], manifest: ModelManifest) -> dict[int, int]:
    """Map each non-empty label value to its segment number (1..n, ascending label value).

    Parameters
    ----------
    labels
        Label map; 0 is background; other values must be manifest label values.
    manifest
        The model whose labels the map uses.

    Returns
    -------
    dict
        ``{label value: segment number}`` for the labels present in ``labels``.

    Raises
    ------
    ResultError
        ``labels`` holds a value the manifest does not describe.
    """
    top = max(s.value for s in manifest.labels)
    counts = _known_counts(labels, manifest)
    if counts is None:
        if labels.size and (int(labels.min()) < 0 or int(labels.max()) > top):
            raise ResultError(f"label map holds values outside 0..{top}")
        counts = _bincount(labels, top + 1)
    return numbering(counts, manifest)


class SegmentStatsAccumulator:
    """Voxel count, sum and sum of squares of the HU of each label, fed slab by slab.

    The worker can feed the slabs of a label map as inference produces them; the result
    does not depend on how the map was cut into slabs. Sums are accumulated in float64.
    They are exact, whatever the order of the additions, when the HU are integers and each
    sum of squares stays below 2**53 (CT: stored integers, slope 1, integer intercept), so
    they equal those of the ``np.bincount`` this replaced bit for bit; for other HU they
    agree to float64 rounding.

    Each chunk of a few hundred thousand voxels is reduced to its labelled voxels, whose
    runs of equal labels are summed (``np.add.reduceat``) and the run sums added up by
    label: the work per voxel is a few copies and additions, instead of widening every
    voxel to ``intp`` and ``float64`` for ``np.bincount``, whose additions into the same
    bin wait for each other. Copying a selection and summing runs cost per run, so a
    fragmented chunk (runs shorter than ``_MIN_RUN`` voxels on average) is summed by
    ``np.bincount``.

    Parameters
    ----------
    manifest
        The model whose label values the maps use; 0 is background.
    """

    def __init__(self, manifest: ModelManifest) -> None:
        self.manifest = manifest
        self._values = sorted({spec.value for spec in manifest.labels})
        self._top = self._values[-1]
        size = self._top + 1
        #: Voxels per label value 0..max manifest value (0: background).
        self.counts = np.zeros(size, dtype=np.int64)
        #: Sum of the HU per label value.
        self.sums = np.zeros(size, dtype=np.float64)
        #: Sum of the squared HU per label value.
        self.squares = np.zeros(size, dtype=np.float64)
        self._unknown = np.ones(size, dtype=bool)
        self._unknown[[0, *self._values]] = False
        self._zero_known = self._values[0] <= 0

    def add(self, labels: npt.NDArray[np.integer], hu: npt.NDArray[np.number]) -> None:
        """Accumulate one slab (any shape; ``labels`` and ``hu`` of the same shape).

        Raises
        ------
        ResultError
            The shapes differ, ``labels`` is not integer, or it holds a value the manifest
            does not describe (the message names those of this slab). The accumulator is
            then partly updated and should be dropped.
        """
        if labels.shape != hu.shape:
            raise ResultError(f"label slab has shape {labels.shape}, HU slab {hu.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ResultError(f"label map must be integer, got {labels.dtype}")
        if not self._accumulate(labels, hu):
            label_counts(_Shape(labels.shape), labels, self.manifest)
            raise ResultError("label map holds values the model does not describe")

    def result(self, voxel_volume_ml: float) -> list[SegmentStatistics]:
        """Statistics of every non-empty label, segment numbers 1..n by ascending value.

        Parameters
        ----------
        voxel_volume_ml
            Volume of one voxel in millilitres (``Volume.voxel_volume_ml``).
        """
        return _statistics(self.counts, self.sums, self.squares, self.manifest, voxel_volume_ml)

    def _accumulate(self, labels: npt.NDArray[np.integer], hu: npt.NDArray[np.number]) -> bool:
        """Add a slab; False when it holds a value other than 0 and the manifest's."""
        flat_labels, flat_hu = labels.reshape(-1), hu.reshape(-1)
        for part in _chunks(flat_labels):
            chunk, values = flat_labels[part], flat_hu[part]
            if _fragmented(chunk):
                ok = self._add_by_bincount(chunk, values)
            else:
                ok = self._add_by_runs(chunk, values)
            if not ok:
                return False
        return True

    def _add_by_runs(self, chunk: npt.NDArray[np.integer], values: npt.NDArray[np.number]) -> bool:
        """Select the labelled voxels, sum each run of equal labels among them
        (``np.add.reduceat``), then the runs by label."""
        if not self._zero_known:
            mask = chunk != 0
            labelled = int(np.count_nonzero(mask))
            self.counts[0] += chunk.size - labelled
            if labelled == 0:
                return True
            if labelled < chunk.size:
                chunk, values = chunk[mask], values[mask]
        starts = np.flatnonzero(chunk[1:] != chunk[:-1])
        starts += 1
        starts = np.concatenate((np.zeros(1, dtype=starts.dtype), starts))
        runs = chunk[starts]
        if int(runs.min()) < 0 or int(runs.max()) > self._top:
            return False
        index = runs.astype(np.intp)
        if np.any(self._unknown[index]):
            return False
        size = self._top + 1
        lengths = np.diff(starts, append=chunk.size)
        self.counts += np.bincount(index, weights=lengths, minlength=size).astype(np.int64)
        wide = values.astype(np.float64)
        self.sums += np.bincount(index, weights=np.add.reduceat(wide, starts), minlength=size)
        np.multiply(wide, wide, out=wide)
        self.squares += np.bincount(index, weights=np.add.reduceat(wide, starts), minlength=size)
        return True

    def _add_by_bincount(
        self, chunk: npt.NDArray[np.integer], values: npt.NDArray[np.number]
    ) -> bool:
        """One ``np.bincount`` each for counts, sums and sums of squares."""
        size = self._top + 1
        if chunk.size and (int(chunk.min()) < 0 or int(chunk.max()) > self._top):
            return False
        index = chunk.astype(np.intp)
        counts = np.bincount(index, minlength=size)
        if np.any(counts[self._unknown]):
            return False
        wide = values.astype(np.float64)
        self.counts += counts
        self.sums += np.bincount(index, weights=wide, minlength=size)
        np.multiply(wide, wide, out=wide)
        self.squares += np.bincount(index, weights=wide, minlength=size)
        return True


def segment_statistics(
    volume: Measured, labels: npt.NDArray[np.integer], manifest: ModelManifest
) -> list[SegmentStatistics]:
    """Voxel count, volume (mL), mean and standard deviation (HU) of each non-empty label.

    The volume is ``voxels * volume.voxel_volume_ml`` (voxel summation); mean and
    population standard deviation are over the HU of the voxels with that label
    (:class:`SegmentStatsAccumulator` over the whole map).

    Raises
    ------
    ResultError
        ``labels`` does not fit the volume or holds a value the manifest does not describe.
    """
    if labels.shape != volume.shape:
        raise ResultError(f"label map has shape {labels.shape}, volume has {volume.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ResultError(f"label map must be integer, got {labels.dtype}")
    accumulator = SegmentStatsAccumulator(manifest)
    if not accumulator._accumulate(labels, volume.hu):
        label_counts(volume, labels, manifest)  # raises, naming the values of the whole map
        raise ResultError("label map holds values the model does not describe")
    return accumulator.result(volume.voxel_volume_ml)


def _statistics(
    counts: npt.NDArray[np.integer],
    sums: npt.NDArray[np.floating],
    squares: npt.NDArray[np.floating],
    manifest: ModelManifest,
    voxel_volume_ml: float,
) -> list[SegmentStatistics]:
    """Statistics of every label with a count (arrays indexed by label value)."""
    out = []
    for value, number in numbering(counts, manifest).items():
        n = int(counts[value])
        mean = float(sums[value] / n)
        variance = max(float(squares[value] / n) - mean * mean, 0.0)
        out.append(
            SegmentStatistics(
                segment_number=number,
                label=manifest.label(value),
                voxels=n,
                volume_ml=n * voxel_volume_ml,
                mean_hu=mean,
                std_hu=float(np.sqrt(variance)),
            )
        )
    return out


def statistics_from_sums(
    volume: Volume, sums: LabelSums, manifest: ModelManifest
) -> list[SegmentStatistics]:
    """:func:`segment_statistics` of a label map from its per-label sums.

    The label map itself is not read: ``sums`` (an engine's, computed where the map and the
    HU are) hold every value the map has, so the checks and their messages are those of
    :func:`label_counts`. Equal to :func:`segment_statistics` when the sums are (float64
    sums of integer HU are exact in any order).

    Parameters
    ----------
    volume
        The volume the map labels (its shape and voxel volume are read).
    sums
        Per label value ``0 .. len - 1``: voxel count, sum and sum of squares of the HU.
    manifest
        The model whose label values the map uses; 0 is background.

    Raises
    ------
    ResultError
        The counts do not add up to the volume's voxels, or the map holds a value the
        manifest does not describe.
    """
    counts = np.asarray(sums.counts, dtype=np.int64)
    if not (len(counts) == len(sums.sums) == len(sums.squares)):
        raise ResultError(
            f"label sums have {len(counts)} counts, {len(sums.sums)} sums and "
            f"{len(sums.squares)} sums of squares"
        )
    voxels = int(np.prod(volume.shape))
    if int(counts.sum()) != voxels or bool(np.any(counts < 0)):
        raise ResultError(
            f"label sums count {int(counts.sum())} voxels, volume {volume.shape} has {voxels}"
        )
    known = {spec.value for spec in manifest.labels}
    top = max(known)
    present = np.flatnonzero(counts).tolist()
    outside = [v for v in present if v > top]
    unknown = outside or [v for v in present if v != 0 and v not in known]
    if unknown:
        raise ResultError(
            f"label map contains values {unknown} that model {manifest.name} "
            f"{manifest.version} does not describe (known: {sorted(known)})"
        )
    size = top + 1
    return _statistics(
        _fit(counts, size),
        _fit(sums.sums, size),
        _fit(sums.squares, size),
        manifest,
        volume.voxel_volume_ml,
    )


def _fit(values: npt.NDArray[_T], size: int) -> npt.NDArray[_T]:
    """``values`` cut or zero-padded to ``size`` entries."""
    if len(values) >= size:
        return values[:size]
    return np.concatenate([values, np.zeros(size - len(values), dtype=values.dtype)])
