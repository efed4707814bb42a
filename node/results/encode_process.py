"""The SEG's encoding and its check, in the node or in processes of their own.

After the model, a job encodes its SEG (:meth:`~segnode.node.results.seg_encode.SegPlan.encode`),
writes it to a synced temp file and checks the bytes
(:func:`~segnode.node.results.seg_check.check_encoded`). With many segments that is seconds of
work in thousands of short numpy calls; each gives the interpreter lock away and must take it
back, so while the node's other threads (receiving a burst, other jobs) hold that lock the
SEG takes several times as long, and slows them in turn (docs/performance.md, "A burst on
the H200"). :func:`encode_and_write` does it in this process; :class:`SegEncoders`
(``[results] encode_processes``) in child processes with their own interpreter lock.

The label map reaches the child through a file in ``/dev/shm`` that both map, kept mapped
for the next SEGs (:class:`segnode.engines.child_process.SharedPool`); the plan goes pickled
through the socket; the child writes the SEG's temp file itself and answers with its path.
A check that fails, no segment found, or no room on the disk come back as the same
exceptions as in the node. A child that dies fails only the jobs it was encoding, with that
reason; the next job starts it again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import numpy.typing as npt

from segnode.engines.child_process import (
    ChildProcess,
    ChildServer,
    SharedBuffer,
    SharedMaps,
    SharedPool,
    child_main,
    shared_dir,
)
from segnode.node.errors import ResultError
from segnode.node.results.seg_check import check_encoded
from segnode.node.results.seg_encode import SegPlan
from segnode.node.results.statistics import SegmentStatistics, segment_statistics
from segnode.storage.spool import write_synced

log = logging.getLogger(__name__)

#: Seconds the node waits for an encoder process to start (its imports) before it gives up.
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class WrittenSeg:
    """A SEG encoded, checked and written to a synced temp file next to its path.

    Attributes
    ----------
    temp
        The temp file; the caller renames it to the SEG's path (``os.replace``) and syncs the
        folder, or removes it.
    size
        Bytes of the file.
    segment_numbers
        ``{label value: segment number}`` of the labels present.
    frames
        Number of Frames.
    encode_s, check_s
        Seconds of the encoding and of the check.
    pid
        The process that encoded it.
    statistics, statistics_s
        The segments' statistics and their seconds, where the HU were given (else None, 0).
    """

    temp: Path
    size: int
    segment_numbers: dict[int, int]
    frames: int
    encode_s: float
    check_s: float
    pid: int
    statistics: list[SegmentStatistics] | None = None
    statistics_s: float = 0.0


@dataclass(frozen=True)
class _HU:
    """The HU of a volume and its voxel volume: what the statistics read of a Volume."""

    hu: npt.NDArray[np.floating]
    voxel_volume_ml: float

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.hu.shape)


def encode_and_write(
    plan: SegPlan,
    labels: npt.NDArray[np.integer],
    path: Path,
    helper: Executor,
    hu: _HU | None = None,
) -> WrittenSeg:
    """Encode ``labels`` with ``plan``, write the bytes to a synced temp file next to
    ``path`` on ``helper`` while they are checked; the temp file is removed when the check
    (or the statistics) fail. With ``hu``, also the segments' statistics
    (:func:`segnode.node.results.statistics.segment_statistics`).

    Raises
    ------
    NoSegmentsError
        No label is present.
    ResultError
        The label map does not fit the plan, or the check failed.
    OSError
        The file could not be written (ENOSPC: no room).
    """
    started = time.perf_counter()
    seg = plan.encode(labels)
    encoded = time.perf_counter()
    written = helper.submit(write_synced, path, seg.data)
    try:
        check_encoded(plan, seg, labels)  # the bytes that will be sent
        checked = time.perf_counter()
        statistics = None if hu is None else segment_statistics(hu, labels, plan.manifest)
    except BaseException:
        with contextlib.suppress(Exception):
            written.result()[0].unlink(missing_ok=True)
        raise
    counted = time.perf_counter()
    temp, size = written.result()
    return WrittenSeg(
        temp=temp,
        size=size,
        segment_numbers=dict(seg.segment_numbers),
        frames=seg.number_of_frames,
        encode_s=encoded - started,
        check_s=checked - encoded,
        pid=os.getpid(),
        statistics=statistics,
        statistics_s=counted - checked if hu is not None else 0.0,
    )


class _Encoder(ChildProcess):
    """One encoder process."""

    def __init__(self, number: int, pools: _Pools) -> None:
        super().__init__(
            "segnode.node.results.encode_process",
            f"the SEG encoder process {number}",
            error=ResultError,
        )
        self.pools = pools

    def start(self) -> None:
        """Start the child and wait until it has imported what it encodes with."""
        if self._spawn():
            try:
                self.call(("ready",), START_TIMEOUT_S)
            except BaseException:
                self.close()
                raise

    def submit(
        self,
        plan: SegPlan,
        labels: npt.NDArray[np.integer],
        path: Path,
        hu: _HU | None = None,
    ) -> Future[WrittenSeg]:
        self.ensure_running(self.start)
        arrays = [np.ascontiguousarray(labels)]
        if hu is not None:
            arrays.append(np.ascontiguousarray(hu.hu))
        taken: list[tuple[SharedPool, SharedBuffer]] = []

        def give_back(_: object = None) -> None:
            for pool, buffer in taken:
                pool.give(buffer)

        try:
            for data, pool in zip(arrays, (self.pools.labels, self.pools.hu), strict=False):
                try:
                    buffer = pool.take(data.nbytes)
                except OSError as exc:
                    raise ResultError(
                        f"no room in {shared_dir()} for {data.nbytes / 2**20:.0f} MiB of "
                        f"the label map and HU for the SEG encoder: {exc}"
                    ) from exc
                taken.append((pool, buffer))
                np.copyto(buffer.array(data.shape, data.dtype), data)
            described = [
                (str(b.path), a.shape, a.dtype.str) for (_, b), a in zip(taken, arrays, strict=True)
            ]
            future = self.request(
                (
                    "encode",
                    plan,
                    described,
                    None if hu is None else hu.voxel_volume_ml,
                    str(path),
                )
            )
        except BaseException:
            give_back()
            raise
        # answered (or the child died): the files go back for the next SEG
        future.add_done_callback(give_back)
        return future


@dataclass
class _Pools:
    """The shared files of the encoders' label maps and HU, kept between SEGs
    (:class:`~segnode.engines.child_process.SharedPool`)."""

    labels: SharedPool
    hu: SharedPool

    def close(self) -> None:
        self.labels.close()
        self.hu.close()


class SegEncoders:
    """``processes`` SEG encoder processes; each SEG goes to the one with the fewest in
    flight. Started by :meth:`start`, ended by :meth:`close`."""

    def __init__(self, processes: int) -> None:
        if processes < 1:
            raise ValueError("SegEncoders needs at least one process")
        # two idle files of each kind per process: one SEG in flight, the next being copied
        self._pools = _Pools(
            SharedPool(".seglabels", 2 * processes), SharedPool(".seghu", 2 * processes)
        )
        self._encoders = [_Encoder(k + 1, self._pools) for k in range(processes)]
        self._pick = threading.Lock()
        self._assigned = [0] * processes

    def start(self) -> None:
        """Start the processes (each imports the encoder: about a second)."""
        for encoder in self._encoders:
            encoder.start()
        log.info(
            "SEG encoder process(es) started: %s",
            ", ".join(str(e.pid) for e in self._encoders),
        )

    def submit(
        self,
        plan: SegPlan,
        labels: npt.NDArray[np.integer],
        path: Path,
        hu: npt.NDArray[np.floating] | None = None,
        voxel_volume_ml: float = 0.0,
    ) -> Future[WrittenSeg]:
        """:func:`encode_and_write` in an encoder process: the future holds its result (or
        raises its error); with ``hu`` (and the volume's ``voxel_volume_ml``) also the
        segments' statistics. ``labels`` and ``hu`` are copied before this returns."""
        with self._pick:
            k = min(range(len(self._encoders)), key=lambda i: self._assigned[i])
            self._assigned[k] += 1

        def done(_: Future[WrittenSeg]) -> None:
            with self._pick:
                self._assigned[k] -= 1

        try:
            volume = None if hu is None else _HU(hu, voxel_volume_ml)
            future = self._encoders[k].submit(plan, labels, path, volume)
        except BaseException:
            done(Future())
            raise
        future.add_done_callback(done)
        return future

    def close(self) -> None:
        """End the processes."""
        for encoder in self._encoders:
            encoder.close()
        self._pools.close()

    def figures(self) -> list[dict[str, int | None]]:
        """Per process: its id (None while it is not running) and its restarts."""
        return [{"pid": e.pid, "restarts": e.restarts} for e in self._encoders]


# -- the child -------------------------------------------------------------------------------


class _Child:
    def __init__(self, conn: Connection) -> None:
        self.server = ChildServer(
            conn,
            {"ready": (self.ready, False), "encode": (self.encode, True)},
            threads=2,
            error=ResultError,
        )
        self.helper = ThreadPoolExecutor(2, thread_name_prefix="segnode-seg-write")
        self.maps = SharedMaps()
        self.server.on_close = lambda: self.helper.shutdown(wait=True)

    def ready(self, request: int) -> None:
        from segnode.node.results.build import load_standard_tables

        load_standard_tables()
        self.server.answer(request, True, None)

    def encode(
        self,
        request: int,
        plan: SegPlan,
        arrays: list[tuple[str, tuple[int, ...], str]],
        voxel_volume_ml: float | None,
        path: str,
    ) -> None:
        try:
            maps = [self.maps.array(name, shape, np.dtype(dtype)) for name, shape, dtype in arrays]
            hu = None if voxel_volume_ml is None else _HU(maps[1], voxel_volume_ml)
            written = encode_and_write(plan, maps[0], Path(path), self.helper, hu)
            del maps, hu
        except BaseException as exc:
            self.server.answer(request, False, exc)
        else:
            self.server.answer(request, True, written)


def main(argv: list[str] | None = None) -> None:
    """The child: ``python -m segnode.node.results.encode_process FD`` (FD: its socket)."""
    child_main(argv, lambda conn: _Child(conn).server)


__all__ = ["SegEncoders", "WrittenSeg", "encode_and_write"]

if __name__ == "__main__":
    # run as the module itself, not as __main__: its answers (WrittenSeg) unpickle in the node
    from segnode.node.results import encode_process

    encode_process.main()
