"""Streaming assembly: decode each instance into its series' volume while the series arrives.

The C-STORE handler stays write-record-reply: after the instance is durable it hands
:meth:`StreamingAssembler.submit` a small :class:`Arrival` (no pixel data, nothing decoded) and
answers. A bounded pool of threads then reads the spooled file (still in the page cache),
decodes its pixels with the same code as :func:`segnode.node.ingest.volume.assemble_volume` and
rescales them to HU straight into a slot of the series' in-memory slab. The same threads track the
slice geometry (:class:`segnode.node.ingest.geometry.SeriesGeometry`) and report geometric
completeness.

When the worker starts a job it calls :meth:`StreamingAssembler.take` with the instance files
the ledger lists for the series. If every one of them was decoded, the volume is built from
the slab - sorted along the normal with :mod:`segnode.node.ingest.volume`'s own checks, so it is
exactly the :class:`~segnode.node.ingest.volume.Volume` that ``assemble_volume`` returns - usually
without copying the voxels (the slab is permuted in place when it was sized from Images in
Acquisition). Anything else (a restart, an instance missing, a decode error, memory pressure)
returns None and the worker assembles from the spool as before; an error is then reported by the
canonical path with its usual message.

Memory is bounded: slabs of all series together stay under ``streaming.max_memory_mb``; the
least recently active series is spilled (its pixels dropped, so it falls back to the spool)
when a new slab would not fit. A series leaves memory when a job takes it.

Slab memory is reused (:class:`SlabPool`): a slab drained into a volume or spilled goes back
to the pool, and the next series' slabs come from it. Fresh memory is expensive to touch
(a page fault per page, and on virtual machines that return freed memory to their host,
the host's fault too): decoding into fresh slabs measured 1.7-2.6 ms per 512x512 slice,
into reused ones 0.1 ms. ``streaming.warm_mb`` of slabs are touched at start-up so that the
first series after a start is decoded like every later one.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pydicom
from pydicom.dataelem import DataElement
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import UID

from segnode.node.ingest.geometry import SeriesGeometry, SeriesHints
from segnode.node.ingest.volume import (
    MIN_SLICES,
    Slice,
    Volume,
    VolumeError,
    assemble_from_datasets,
    check_instance,
    decode_stored,
    rescale_into,
    same_uid,
    single_frame_slice,
    sort_and_check,
    source_header,
)
from segnode.node.pipeline.parallel import map_blocks

log = logging.getLogger(__name__)

#: Slab size (slices) when the instances do not announce how many there will be.
DEFAULT_SLAB_SLICES = 64
#: Largest Images in Acquisition used to size one slab.
MAX_SLAB_SLICES = 4096
#: Series tracked at once; beyond it the least recently active idle ones are forgotten.
MAX_SERIES = 256
#: Series whose slice geometry is remembered (a few hundred bytes per slice each).
MAX_GEOMETRIES = 1024
#: Queued instances beyond this many are handed over without their bytes (read from the
#: spool when their turn comes): at most this many received datasets are held.
MAX_INLINE = 32
PIXEL_DATA = 0x7FE00010

OnGeometry = Callable[[str, str], object]


class SlabPool:
    """Float32 blocks kept for reuse as slabs (thread-safe).

    :meth:`take` hands out a block's memory shaped as asked, reusing an idle block of at
    least that size (and at most three times it: a 28-slice series gathered into a 64-slice
    slab's block) when there is one. On a miss every idle block is
    freed first, so that the pool never adds to the peak when series change size.
    :meth:`give` takes a slab back once nothing writes to it any more.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[npt.NDArray[np.float32]] = []
        self.idle_bytes = 0
        self.reused = 0  # blocks handed out again (tests, metrics)

    def take(self, shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
        """Memory for a float32 array of ``shape`` (contents undefined)."""
        n = int(np.prod(shape))
        with self._lock:
            fits = [b for b in self._idle if n <= b.size <= 3 * n]
            if fits:
                block = min(fits, key=lambda b: b.size)
                # By identity: list.remove compares with ==, elementwise for arrays.
                del self._idle[next(i for i, b in enumerate(self._idle) if b is block)]
                self.idle_bytes -= block.nbytes
                self.reused += 1
                return block[:n].reshape(shape)
            self._idle.clear()
            self.idle_bytes = 0
        return np.empty(n, dtype=np.float32).reshape(shape)

    def give(self, slab: npt.NDArray[np.float32] | None) -> None:
        """Keep ``slab``'s block for reuse (the caller guarantees nothing writes to it)."""
        if slab is None:
            return
        block = slab
        while isinstance(block.base, np.ndarray):
            block = block.base
        if block.dtype != np.float32 or block.ndim != 1 or not block.flags.owndata:
            return  # not one of ours
        with self._lock:
            if any(b is block for b in self._idle):
                return
            self._idle.append(block)
            self.idle_bytes += block.nbytes

    def trim(self, keep: int) -> None:
        """Free idle blocks, largest first, until at most ``keep`` bytes are idle."""
        with self._lock:
            self._idle.sort(key=lambda b: b.size)
            while self._idle and self.idle_bytes > max(0, keep):
                self.idle_bytes -= self._idle.pop().nbytes

    def warm(self, nbytes: int, shape: tuple[int, ...]) -> int:
        """Touch blocks for slabs of ``shape`` (every page), up to ``nbytes``; return the
        number of blocks now warm."""
        n = int(np.prod(shape))
        count = nbytes // (4 * n) if n else 0
        for _ in range(count):
            block = np.empty(n, dtype=np.float32)
            block.fill(0.0)
            self.give(block)
        return count


@dataclass(frozen=True)
class Arrival:
    """A stored (durable, recorded) instance, as the SCP hands it over."""

    series_uid: str
    sop_uid: str
    path: Path
    calling_ae: str
    size: int = 0
    #: The elements before Pixel Data, as the SCP parsed them, and the native Pixel Data
    #: value (a view of the received bytes): the pool then decodes without re-reading the
    #: file. Dropped (None) when the queue is long, so that memory stays bounded.
    header: Dataset | None = None
    pixels: bytes | memoryview | None = None
    transfer_syntax: str = ""


@dataclass(eq=False)
class _Series:
    """Streaming state of one series (guarded by the assembler's condition)."""

    uid: str
    calling_ae: str
    pending: int = 0
    last_used: float = 0.0
    rows: int = 0
    columns: int = 0
    slab_slices: int = 0
    slabs: list[npt.NDArray[np.float32] | None] = field(default_factory=list)
    used: int = 0  # slots handed out
    nbytes: int = 0
    slots: dict[str, int] = field(default_factory=dict)  # spool path -> slot
    headers: dict[int, Dataset] = field(default_factory=dict)
    slices: dict[int, Slice] = field(default_factory=dict)
    multiframe: tuple[str, Volume] | None = None
    spilled: bool = False
    broken: bool = False


class StreamingAssembler:
    """Decodes arriving instances into per-series volumes on a bounded thread pool.

    Parameters
    ----------
    workers
        Decoding threads.
    max_bytes
        Cap on the slabs of all series together; 0 keeps no pixels (geometry only).
    min_slices
        As ``series.min_slices`` (passed to the volume checks).
    on_geometry
        Called as ``on_geometry(series_uid, calling_ae)`` when a series becomes geometrically
        complete (from a pool thread, after the instance's ledger row was committed).
    decode_pixels
        False tracks geometry only (``streaming.enabled = false``).
    warm_bytes
        Slab memory touched by :meth:`start` (``streaming.warm_mb``), for 512x512 slices.
    priority
        The priority of a calling AE's series (``[[series.senders]] priority``): queued
        instances of a more urgent sender are decoded first (the oldest first among equals),
        so that an urgent series' release is not held behind a backlog of routine headers.
    """

    def __init__(
        self,
        *,
        workers: int = 2,
        max_bytes: int = 2 * 2**30,
        min_slices: int = MIN_SLICES,
        on_geometry: OnGeometry | None = None,
        decode_pixels: bool = True,
        warm_bytes: int = 0,
        priority: Callable[[str], int] | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        self.priority = priority
        self.warm_bytes = min(warm_bytes, max_bytes) if decode_pixels else 0
        self.pool = SlabPool()
        self.min_slices = min_slices
        self.on_geometry = on_geometry
        self.decode_pixels = decode_pixels and max_bytes > 0
        self._cond = threading.Condition()
        self._series: dict[str, _Series] = {}
        # Geometry outlives a state taken by a job: a series reopened by the quiet period
        # half-way through a split transfer is still completed by geometry when the rest
        # arrives. Insertion-ordered, the oldest forgotten beyond MAX_GEOMETRIES.
        self._geometry: dict[str, SeriesGeometry] = {}
        self._bytes = 0
        # (-priority, arrival order, item): the most urgent sender's instances first
        self._queue: queue.PriorityQueue[tuple[int, int, tuple[_Series, Arrival] | None]] = (
            queue.PriorityQueue()
        )
        self._order = itertools.count()
        self._threads = [
            threading.Thread(target=self._run, name=f"segnode-decode-{i}", daemon=True)
            for i in range(workers)
        ]
        self._started = False
        self._stopping = False
        self.taken = 0  # volumes handed to the worker (for tests and metrics)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Touch the warm slabs, then start the decoding threads."""
        if not self._started:
            if self.warm_bytes:
                t0 = time.perf_counter()
                blocks = self.pool.warm(self.warm_bytes, (DEFAULT_SLAB_SLICES, 512, 512))
                log.info(
                    "streaming: %d slab(s) of %d MB warm in %.2f s",
                    blocks,
                    DEFAULT_SLAB_SLICES * 512 * 512 * 4 >> 20,
                    time.perf_counter() - t0,
                )
            self._started = True
            for t in self._threads:
                t.start()

    def stop(self) -> None:
        """Stop the threads (instances still queued are skipped); drop every volume."""
        self._stopping = True
        if self._started:
            for _ in self._threads:
                self._queue.put((-(2**62), next(self._order), None))
            for t in self._threads:
                t.join(30)
            self._started = False
        with self._cond:
            self._series.clear()
            self._geometry.clear()
            self._bytes = 0
        self.pool.trim(0)

    @property
    def memory_bytes(self) -> int:
        """Bytes held in slabs now."""
        with self._cond:
            return self._bytes

    @property
    def series_in_memory(self) -> int:
        """Series with streaming state now."""
        with self._cond:
            return len(self._series)

    # -- the SCP side ---------------------------------------------------------------------

    def submit(self, arrival: Arrival) -> None:
        """Queue a stored instance for decoding; O(1), never blocks the SCP thread."""
        if arrival.pixels is not None and self._queue.qsize() >= MAX_INLINE:
            arrival = replace(arrival, header=None, pixels=None)
        with self._cond:
            state = self._series.get(arrival.series_uid)
            if state is None:
                if len(self._series) >= MAX_SERIES:
                    self._forget_idle()
                state = _Series(uid=arrival.series_uid, calling_ae=arrival.calling_ae)
                self._series[arrival.series_uid] = state
            state.pending += 1
            state.last_used = time.monotonic()
        urgency = self.priority(arrival.calling_ae) if self.priority is not None else 0
        self._queue.put((-urgency, next(self._order), (state, arrival)))

    # -- the pool -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            _, _, item = self._queue.get()
            if item is None:
                return
            state, arrival = item
            fired = False
            try:
                if not self._stopping:
                    fired = self._decode(state, arrival)
            except Exception as exc:  # any failure only costs the fast path  # noqa: BLE001
                log.debug("streaming: %s not decoded: %s", arrival.path.name, exc)
                with self._cond:
                    state.broken = True
            finally:
                with self._cond:
                    state.pending -= 1
                    self._cond.notify_all()
            if fired and self.on_geometry is not None:
                self.on_geometry(state.uid, arrival.calling_ae)

    def _decode(self, state: _Series, arrival: Arrival) -> bool:
        """Decode one instance into its slot; return True when the series just became
        geometrically complete."""
        with self._cond:
            pixels = self.decode_pixels and not state.spilled and not state.broken
        ds = _dataset_of(arrival, pixels)
        frames = int(ds.get("NumberOfFrames", 1) or 1)
        if frames > 1:
            return self._multiframe(state, arrival, ds, pixels)
        position = orientation = None
        expected = ds.get("ImagesInAcquisition")
        number = _int_or_none(ds.get("InstanceNumber"))
        try:
            sl = single_frame_slice(ds, 0)
            position, orientation = sl.position, sl.orientation
        except VolumeError:
            sl = None
        if pixels and sl is not None:
            # Received pixels stay out of the dataset unless pydicom must decode them.
            check_instance(ds, pixel_data=arrival.pixels is not None or PIXEL_DATA in ds)
            stored = native_pixels(ds, arrival, reuse=True)
            if stored is None:
                _attach_pixels(ds, arrival)
                stored = decode_stored(ds, sl.label)
            if stored.shape != (sl.rows, sl.columns):
                raise VolumeError(f"{sl.label}: decoded shape {stored.shape}")
            header = source_header(ds, share=True) if PIXEL_DATA in ds else ds
            del ds
            slot = self._slot(state, sl.rows, sl.columns, _int_or_none(expected))
            with self._cond:
                slab = None if slot is None else state.slabs[slot // state.slab_slices]
            if slab is not None and slot is not None:
                rescale_into(slab[slot % state.slab_slices], stored, sl.slope, sl.intercept)
                with self._cond:
                    state.slots[str(arrival.path)] = slot
                    state.headers[slot] = header
                    state.slices[slot] = sl
        with self._cond:
            return self._geometry_of(state.uid).add(
                arrival.sop_uid, position, orientation, _int_or_none(expected), number
            )

    def _multiframe(self, state: _Series, arrival: Arrival, ds: Dataset, pixels: bool) -> bool:
        """One multi-frame instance is a whole volume: assemble it now."""
        frames = int(ds.NumberOfFrames)
        if not pixels:
            with self._cond:
                self._geometry_of(state.uid).mixed = True  # by release or quiet period only
            return False
        volume = assemble_from_datasets([ds], min_slices=self.min_slices)
        del ds
        nbytes = int(volume.hu.nbytes)
        with self._cond:
            alone = state.used == 0 and state.multiframe is None and not state.slots
            if not alone or not self._reserve(state, nbytes):
                state.broken = True
                return False
            state.multiframe = (str(arrival.path), volume)
            state.nbytes += nbytes
            self._geometry_of(state.uid).fired = True
        log.debug("streaming: multi-frame %s assembled (%d frames)", arrival.sop_uid, frames)
        return True

    def _geometry_of(self, series_uid: str) -> SeriesGeometry:
        """The series' geometry tracker (caller holds the lock)."""
        g = self._geometry.get(series_uid)
        if g is None:
            while len(self._geometry) >= MAX_GEOMETRIES:
                del self._geometry[next(iter(self._geometry))]
            g = self._geometry[series_uid] = SeriesGeometry()
        return g

    def _slot(self, state: _Series, rows: int, columns: int, expected: int | None) -> int | None:
        """Hand out the next slab slot, allocating (and possibly evicting) as needed."""
        with self._cond:
            if state.spilled or state.broken:
                return None
            if state.slab_slices == 0:
                state.rows, state.columns = rows, columns
                ok = expected is not None and MIN_SLICES <= expected <= MAX_SLAB_SLICES
                state.slab_slices = expected if ok and expected else DEFAULT_SLAB_SLICES
            if (rows, columns) != (state.rows, state.columns):
                state.broken = True  # mixed sizes: the spool path reports it
                return None
            slot = state.used
            if slot // state.slab_slices >= len(state.slabs):
                size = state.slab_slices * rows * columns * 4
                if not self._reserve(state, size):
                    return None
                state.slabs.append(self.pool.take((state.slab_slices, rows, columns)))
                state.nbytes += size
            state.used += 1
            return slot

    def _reserve(self, state: _Series, size: int) -> bool:
        """Make room for ``size`` bytes (caller holds the lock); spill ``state`` if none.
        Idle pool blocks count against the cap and are freed first."""
        self.pool.trim(self.max_bytes - self._bytes - size)
        while self._bytes + size > self.max_bytes:
            victims = [
                s for s in self._series.values() if s is not state and s.nbytes and not s.spilled
            ]
            if not victims:
                log.info(
                    "streaming: series %s does not fit in streaming.max_memory_mb; "
                    "it will be assembled from the spool",
                    state.uid,
                )
                self._spill(state)
                return False
            self._spill(min(victims, key=lambda s: s.last_used))
        self._bytes += size
        return True

    def _forget_idle(self) -> None:
        """Drop the least recently active half of the idle series (caller holds the lock):
        series whose jobs never ran (cancelled, failed early) must not accumulate."""
        idle = [s for s in self._series.values() if not s.pending]
        idle.sort(key=lambda s: s.last_used)
        for state in idle[: max(1, len(idle) // 2)]:
            self._spill(state)
            del self._series[state.uid]

    def _spill(self, state: _Series) -> None:
        """Drop a series' pixels (caller holds the lock); it falls back to the spool.

        Its slabs go back to the pool only when no decode of the series is in flight (a
        decoding thread may hold a slab outside the lock until its instance is done)."""
        self._bytes -= state.nbytes
        state.nbytes = 0
        if state.pending == 0:
            for slab in state.slabs:
                self.pool.give(slab)
        state.slabs = []
        state.multiframe = None
        state.headers.clear()
        state.slices.clear()
        state.slots.clear()
        state.spilled = True

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until every queued instance was processed (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(s.pending for s in self._series.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def hints(self, series_uid: str) -> SeriesHints | None:
        """What the decoded headers of a series say about its extent (None: nothing of it
        received). While decoding is behind the instances received, :attr:`SeriesHints.behind`
        says by how many (the rest may under-count them)."""
        with self._cond:
            state = self._series.get(series_uid)
            behind = 0 if state is None else state.pending
            g = self._geometry.get(series_uid)
            if g is None:
                return SeriesHints(received=0, behind=behind) if behind else None
            hints = g.hints()
            return replace(hints, behind=behind) if behind else hints

    # -- the worker side ------------------------------------------------------------------

    def discard(self, series_uid: str) -> None:
        """Forget a series (its job was cancelled or failed before taking the volume)."""
        with self._cond:
            state = self._series.pop(series_uid, None)
            if state is not None:
                self._spill(state)

    def recycle(self, volume: Volume) -> None:
        """Take back the memory of a volume whose job is done (the caller keeps no reference
        to ``volume.hu``): the next series decodes into memory that is already touched, not
        into fresh pages whose faults slow the decoder behind a fast sender. Within the
        memory cap; an array the pool did not hand out is ignored."""
        self.pool.give(volume.hu)
        with self._cond:
            self.pool.trim(self.max_bytes - self._bytes)

    def take(self, series_uid: str, paths: Sequence[Path], timeout: float = 60.0) -> Volume | None:
        """The prebuilt volume of exactly ``paths`` (ledger order), or None.

        Waits for decodes still in flight. The series' state leaves the assembler either way;
        instances arriving afterwards start a new state (a new job version).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            state = self._series.pop(series_uid, None)
            if state is None:
                return None
            while state.pending > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            if state.pending > 0 or state.spilled or state.broken:
                self._spill(state)  # late decodes of this state then allocate nothing
                return None
            multiframe = state.multiframe
            slots = dict(state.slots)
            self._bytes -= state.nbytes
            state.nbytes = 0
        try:
            if multiframe is not None:
                path, volume = multiframe
                ok = len(paths) == 1 and str(paths[0]) == path and not slots
                return self._taken(volume) if ok else None
            keys = [str(p) for p in paths]
            if len(keys) != len(slots) or any(k not in slots for k in keys):
                return None
            try:
                volume = self._build(state, [slots[k] for k in keys])
            except VolumeError as exc:
                log.debug("streaming: series %s not usable: %s", series_uid, exc)
                return None
            return self._taken(volume)
        finally:
            # No decode of this state is in flight (pending is 0): what the volume did not
            # take goes back to the pool, within the memory cap.
            for slab in state.slabs:
                self.pool.give(slab)
            state.slabs = []
            with self._cond:
                self.pool.trim(self.max_bytes - self._bytes)

    def _taken(self, volume: Volume) -> Volume:
        self.taken += 1
        return volume

    def _build(self, state: _Series, slot_of: list[int]) -> Volume:
        """:func:`segnode.node.ingest.volume._assemble_single_frames` over decoded slots, same
        checks."""
        headers = [state.headers[s] for s in slot_of]
        study = same_uid(headers, "StudyInstanceUID", "studies")
        series = same_uid(headers, "SeriesInstanceUID", "series")
        frame_of_reference = same_uid(headers, "FrameOfReferenceUID", "Frames of Reference")
        slices = [replace(state.slices[s], source_index=i) for i, s in enumerate(slot_of)]
        order, geometry = sort_and_check(slices, self.min_slices)
        hu = _gather(state, [slot_of[i] for i in order], self.pool)
        return Volume(
            hu=hu,
            sources=tuple(headers[i] for i in order),
            frame_of_reference_uid=frame_of_reference,
            study_instance_uid=study,
            series_instance_uid=series,
            **geometry,
        )


def _gather(state: _Series, perm: list[int], pool: SlabPool) -> npt.NDArray[np.float32]:
    """Slices in the order ``perm`` (slot numbers) as one ``(z, y, x)`` array.

    A single full slab is permuted in place (no second copy of the volume); otherwise the
    slices are copied into a new array (blocks of slices on several threads,
    :func:`segnode.node.pipeline.parallel.map_blocks`) and the slabs go back to ``pool``.
    """
    n, per = len(perm), state.slab_slices
    if len(state.slabs) == 1 and n == per and state.slabs[0] is not None:
        slab = state.slabs[0]
        state.slabs = []
        _permute_in_place(slab, perm)
        return slab
    out = pool.take((n, state.rows, state.columns))
    slabs = state.slabs

    def copy(start: int, stop: int) -> None:
        for k in range(start, stop):
            part = slabs[perm[k] // per]
            assert part is not None
            out[k] = part[perm[k] % per]

    # Slices copied by a few threads (numpy copies without the GIL): 128 MB of slices took
    # ~30 ms on one thread, the largest step between the last C-STORE and inference.
    map_blocks(copy, n, 1)
    for i, part in enumerate(slabs):
        pool.give(part)
        slabs[i] = None
    return out


def _permute_in_place(a: npt.NDArray[np.float32], perm: list[int]) -> None:
    """``a[k] = a_before[perm[k]]`` for every k, following cycles with one spare slice."""
    done = np.zeros(len(perm), dtype=bool)
    spare = np.empty(a.shape[1:], dtype=a.dtype)
    for start in range(len(perm)):
        if done[start] or perm[start] == start:
            done[start] = True
            continue
        spare[...] = a[start]
        k = start
        while True:
            done[k] = True
            src = perm[k]
            if src == start:
                a[k] = spare
                break
            a[k] = a[src]
            k = src


def _int_or_none(value: object) -> int | None:
    try:
        return int(value) if value not in (None, "") else None  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return None


def _dataset_of(arrival: Arrival, pixels: bool) -> Dataset:
    """The instance's dataset: from what the SCP handed over when it can, else the file."""
    ds = arrival.header
    if ds is None or (pixels and arrival.pixels is None):
        return pydicom.dcmread(arrival.path, stop_before_pixels=not pixels)
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = UID(arrival.transfer_syntax)
    return ds


def _attach_pixels(ds: Dataset, arrival: Arrival) -> None:
    """Put the received Pixel Data on the header dataset (for pydicom's decoders)."""
    if arrival.pixels is not None and PIXEL_DATA not in ds:
        vr = "OB" if int(ds.get("BitsAllocated", 16) or 16) <= 8 else "OW"
        ds[PIXEL_DATA] = DataElement(PIXEL_DATA, vr, bytes(arrival.pixels))


_local = threading.local()


def _scratch(n: int, dtype: type[np.integer]) -> npt.NDArray[np.integer]:
    """This thread's reusable buffer of at least ``n`` values of ``dtype``."""
    buf: npt.NDArray[np.integer] | None = getattr(_local, "buf", None)
    if buf is None or buf.size < n or buf.dtype != dtype:
        buf = _local.buf = np.empty(n, dtype=dtype)
    return buf


NATIVE_LE = frozenset({"1.2.840.10008.1.2", "1.2.840.10008.1.2.1"})


def native_pixels(
    ds: Dataset, arrival: Arrival, *, reuse: bool = False
) -> npt.NDArray[np.generic] | None:
    """Stored values of a native little-endian 16-bit greyscale frame straight from the
    received bytes, or None where pydicom's decoders must do it.

    The same values as ``ds.pixel_array`` (tested): unsigned or signed 16-bit, the unused
    high bits cleared or sign-extended as pydicom's ``correct_unused_bits`` does. With
    ``reuse`` the result is the calling thread's scratch array, valid until its next call
    (no fresh allocation, hence no page faults, per slice).
    """
    buf = arrival.pixels
    if buf is None or arrival.transfer_syntax not in NATIVE_LE:
        return None
    try:
        rows, cols = int(ds.Rows), int(ds.Columns)
        bits, stored = int(ds.BitsAllocated), int(ds.BitsStored)
        signed = int(ds.get("PixelRepresentation", 0) or 0)
        samples = int(ds.get("SamplesPerPixel", 1) or 1)
        frames = int(ds.get("NumberOfFrames", 1) or 1)
    except (AttributeError, TypeError, ValueError):
        return None
    n = rows * cols
    if bits != 16 or samples != 1 or frames != 1 or signed not in (0, 1) or len(buf) < 2 * n:
        return None
    if not 1 <= stored <= 16 or n == 0:
        return None
    dtype = np.int16 if signed else np.uint16
    received = np.frombuffer(buf, dtype=np.dtype(dtype).newbyteorder("<"), count=n)
    shift = 16 - stored
    if reuse:
        arr = _scratch(n, dtype)[:n].reshape(rows, cols)
        if shift:  # the copy (into native byte order) and the first shift in one pass
            np.left_shift(received.reshape(rows, cols), shift, out=arr, casting="unsafe")
        else:
            np.copyto(arr, received.reshape(rows, cols))
    else:
        arr = received.reshape(rows, cols).astype(dtype)
        if shift:
            np.left_shift(arr, shift, out=arr)
    if shift:
        np.right_shift(arr, shift, out=arr)
    return arr
