"""The job worker: series -> volume -> label map -> SEG + SR files -> outbox rows.

Several lanes (``[engine] lanes``, threads) each take the most urgent queued job from the
ledger, run each stage, and record each stage's timestamp. The models run one job at a time,
through :class:`segnode.node.pipeline.gate.EngineGate` (the most urgent waiting job next):
while one job's model runs, the next jobs assemble their volumes and prepare their results, and
the last ones encode, check and write theirs. A lane starts a job only while the estimated
peaks of the jobs in progress fit ``[engine] memory_limit`` (:class:`MemoryBudget`). Any
failure becomes a failed job with a reason; the node keeps serving. The result objects are
written to ``<data_dir>/results/<job id>/`` atomically before the ledger says ``encoded``, so
the outbox always sends exactly the bytes that were encoded, with UIDs allocated when the job
was created.

Everything of the SEG and SR that depends only on the source series (headers, references,
per-frame geometry, segment descriptions, evidence) is encoded by a helper thread while the
engine runs (:class:`segnode.node.results.seg_encode.SegPlan`,
:class:`segnode.node.results.sr_encode.SrPlan`); after inference only the frames, the statistics and
the measurement values are spliced in, and the SEG bytes are checked
(:func:`segnode.node.results.seg_check.check_encoded`) before they are written. Their dates and
times are the job's creation time, so a re-encoding after a crash writes the same bytes. With
``[results] prepare = "before"`` the plans are prepared in the worker thread before the engine runs
instead: a GPU engine launching kernels from Python then does not share the GIL with the ~0.1 s of
pure Python the preparation is.

An engine that can sum the HU per label where its label map is
(:class:`segnode.engines.base.SumsEngine`, the torch backend on a GPU) hands those sums over, and
the SR's statistics are derived from them
(:func:`segnode.node.results.statistics.statistics_from_sums`) instead of reading the label map and
the volume again on the CPU. One INFO line per job splits the work after inference into its parts.

A version-2 (trained) model runs through :func:`segnode.engines.trained.segment_trained_with_sums`
with the volume's geometry (reorientation, resampling to the model's spacing, nnU-Net's window
over every fold, the labels back on the source grid; the per-label sums on the device where the
engine computes them, :class:`segnode.engines.base.DeviceSumsEngine`); a series it does not
accept (gantry tilt, an oblique series) fails its job with the reason.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from io import BytesIO
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt
from pydicom import Dataset
from pydicom.dataset import FileMetaDataset
from pydicom.uid import UID, ExplicitVRLittleEndian, generate_uid
from sqlalchemy.exc import SQLAlchemyError

from segnode.engines.base import Engine, EngineError, LabelSums, SlotEngine
from segnode.engines.manifest import ModelManifest
from segnode.engines.memory import (
    JobEstimate,
    available_bytes,
    estimate_job,
    peak_resident_bytes,
    reset_peak,
    resident_bytes,
)
from segnode.engines.model_process import segment_volume
from segnode.node import __version__
from segnode.node.config import Config
from segnode.node.dicom.rejection import KOS_SOP_CLASS, build_rejection_note
from segnode.node.errors import JobError
from segnode.node.ingest.volume import (
    CT_IMAGE_STORAGE,
    Volume,
    VolumeError,
    assemble_from_datasets,
    assemble_volume,
)
from segnode.node.peers import Peer
from segnode.node.pipeline.engine_pool import EnginePool
from segnode.node.pipeline.gate import EngineGate, Hold
from segnode.node.results.build import (
    Equipment,
    NoSegmentsError,
    ResultError,
    ResultUIDs,
    derived_uid,
    load_standard_tables,
    segment_statistics,
)
from segnode.node.results.encode_process import SegEncoders, WrittenSeg, encode_and_write
from segnode.node.results.seg_encode import SegPlan
from segnode.node.results.sr_encode import SrPlan
from segnode.node.results.statistics import statistics_from_sums
from segnode.storage.ledger import MISSING_FILES, JobState, JobView, Ledger
from segnode.storage.spool import write_atomic

log = logging.getLogger(__name__)

PREPARE_SWITCH_INTERVAL_S = 0.0005
"""Python's thread switch interval while the helper prepares beside the engine (default
0.005 s). An engine that launches GPU work from Python releases the GIL at every call into
torch and must win it back from the preparing thread each time; with the default interval
each of those hand-overs can wait up to 5 ms (the tissue model's inference on the H200 took
126 ms beside the preparation against 52 ms alone). Restored when inference ends."""


def encode(ds: Dataset) -> bytes:
    """Encode a dataset in the DICOM File Format (PS3.10) with its file meta."""
    buf = BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


class Volumes(Protocol):
    """Where the worker gets volumes prebuilt while their series arrived
    (:class:`~segnode.node.ingest.streaming.StreamingAssembler`)."""

    def take(self, series_uid: str, paths: Sequence[Path], timeout: float = 60.0) -> Volume | None:
        """The prebuilt volume of exactly ``paths``, or None (assemble from the spool)."""

    def recycle(self, volume: Volume) -> None:
        """Take back the memory of a volume whose job is done."""


MIB = 1024 * 1024
GIB = 1024.0**3

#: How long the worker waits after a job found no room for its results before it runs again.
NO_SPACE_WAIT_S = 10.0


class NoSpace(Exception):
    """A job's files could not be written for lack of space (ENOSPC, EDQUOT): the job is not
    at fault and runs again when there is room."""


def _no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a file system out of room."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


CPU_LANES = 2
"""Lanes of ``[engine] lanes = 0`` for an engine that computes on this machine's CPU
(:data:`CPU_ENGINES`): the model shares the cores with the work around it, and a third lane
slowed the model more than it gained (docs/performance.md, issue 36)."""

CPU_ENGINES = frozenset({"onnxruntime", "openvino"})

BEFORE_MODEL = frozenset({"started", "volume", "waiting for the model"})
"""The stages of a job in progress that has not yet entered its model."""


def auto_lanes(config: Config) -> int:
    """The lanes of ``[engine] lanes = 0``: :data:`CPU_LANES` where the default model's engine
    computes on this machine's CPU, else the model slots plus one job preparing and one
    finishing."""
    return CPU_LANES if config.model.engine in CPU_ENGINES else config.engine.model_slots + 2


class MemoryBudget:
    """The memory of the jobs in progress: a job starts its model only while the node's
    resident memory (``base``) plus every job's share fits ``limit``; otherwise it waits for
    the jobs ahead to finish. A job alone over the limit is refused before (``_check_memory``).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[int, int] = {}
        self._cond = threading.Condition()

    @contextmanager
    def reserve(self, job_id: int, base: int, need: int) -> Iterator[float]:
        """Hold ``need`` bytes for ``job_id`` inside; yields the seconds waited for them."""
        t0 = time.monotonic()
        with self._cond:
            while self._held and base + sum(self._held.values()) + need > self.limit:
                self._cond.wait()
            self._held[job_id] = need
        try:
            yield time.monotonic() - t0
        finally:
            with self._cond:
                self._held.pop(job_id, None)
                self._cond.notify_all()

    def held(self) -> int:
        """Bytes held by the jobs in progress."""
        with self._cond:
            return sum(self._held.values())


class Worker:
    """Runs jobs from the ledger, several at once (``lanes``), each on its model's engine,
    the engines one job at a time.

    Parameters
    ----------
    config, ledger
        Node configuration and durable state.
    pool
        Engines of every configured model, the default one (``[model]``) loaded or loading
        (:meth:`EnginePool.of_config`); other models load on their first job.
    volumes
        Prebuilt volumes (:class:`~segnode.node.ingest.streaming.StreamingAssembler`); every
        job is assembled from the spool when None.
    on_encoded
        Called (on the worker thread) with the job id once its results are encoded (wakes
        the outbox, queues the web preview).
    lanes
        Jobs in progress at once; default ``[engine] lanes``, and :func:`auto_lanes` for 0.
    """

    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        pool: EnginePool,
        *,
        volumes: Volumes | None = None,
        on_encoded: Callable[[int], None] | None = None,
        lanes: int | None = None,
    ) -> None:
        self.config = config
        self.lanes = lanes or config.engine.lanes or auto_lanes(config)
        #: The models, ``model_slots`` jobs at a time, the most urgent waiting job first.
        self.gate = EngineGate(config.engine.max_wait_s, config.engine.model_slots)
        self.ledger = ledger
        self.pool = pool
        self.manifest = pool.default_manifest
        #: The last volume, kept while other models' jobs of the same series version wait.
        self._volume: tuple[str, int, list[Path], Volume] | None = None
        self._volume_lock = threading.Lock()
        #: Per lane: the volume of its job, handed back to the assembler's pool after it.
        self._lane = threading.local()
        #: The jobs in progress, by id: the stage each is in.
        self.running: dict[int, str] = {}
        self._priority: dict[int, int] = {}
        #: Jobs a lane may take ahead of the models (more only for a more urgent one): an
        #: urgent job is never queued behind routine ones the lanes already hold.
        self.ahead = max(1, self.lanes - self.gate.slots - 1)
        #: With several lanes, one more thread takes a job only while every lane holds
        #: one, and only a job more urgent than all of them: an urgent series starts at
        #: once (its volume and its place at the models' gate), not when a lane's job ends.
        self.spare_lane = self.lanes > 1
        self._running_lock = threading.Lock()
        self.results_dir = config.data_dir / "results"
        # Destinations that take IOCM rejection notes for superseded results.
        self._rejecting = {
            t.name
            for t in config.configured_destinations()
            if isinstance(t, Peer) and t.reject_superseded
        }
        #: Bytes a job may bring the node to (``[engine] memory_limit``, or its share of the
        #: memory available now).
        self.memory_limit = config.engine.memory_limit * MIB or int(
            config.engine.memory_fraction * available_bytes()
        )
        self.budget = MemoryBudget(self.memory_limit)
        self._alone_rss: int | None = None
        #: The peak resident set of the last job that encoded (bytes; metrics).
        self.last_peak_rss = 0
        self.segmentation_type = config.results.segmentation_type
        self.seg_transfer_syntax = config.results.seg_transfer_syntax_uid
        self.prepare_mode = config.results.prepare
        # Prepares the SEG and SR of a job while its inference runs (one per lane).
        self._helper = ThreadPoolExecutor(
            self.lanes + self.spare_lane, thread_name_prefix="segnode-prepare"
        )
        #: The SEG encoder processes (``[results] encode_processes``), or None: in the node.
        self.encoders = (
            SegEncoders(config.results.encode_processes)
            if config.results.encode_processes
            else None
        )
        self.wake = threading.Event()
        #: Set once the default model's engine is loaded; jobs wait for it (a node that
        #: loads its engine in the background clears it until then).
        self.engine_ready = threading.Event()
        self.engine_ready.set()
        self._stop = threading.Event()
        #: Jobs a ledger outage interrupted, to put back in the queue (``_run``).
        self._interrupted: list[int] = []
        self._threads: list[threading.Thread] = []
        self.warming: Future[None] | None = None
        self.last_result: str = "none yet"
        self.volumes = volumes
        self.on_encoded = on_encoded

    @property
    def current_job(self) -> int | None:
        """The job running its model, else one of the jobs in progress, else None."""
        holder = self.gate.holder()
        if holder is not None:
            return holder
        with self._running_lock:
            return next(iter(self.running), None)

    def _stage(self, job_id: int, stage: str | None) -> None:
        with self._running_lock:
            if stage is None:
                self.running.pop(job_id, None)
                self._priority.pop(job_id, None)
            else:
                self.running[job_id] = stage
        if stage in (None, "model", "loading its model"):
            self.wake.set()  # a lane may take the next job

    def _claim(self, spare: bool = False) -> JobView | None:
        """The next job for a lane: the most urgent queued one while fewer than
        :attr:`ahead` jobs in progress wait for the models, else only a more urgent one.

        ``spare``: the urgent lane's claim, only while every lane holds a job, and only a
        job more urgent than every job in progress (it would otherwise wait until one of
        them ended, model and SEG included)."""
        with self._running_lock:
            if spare:
                if len(self.running) < self.lanes:
                    return None  # a lane is free: it takes the job
                above: int | None = max(self._priority.values(), default=0)
            else:
                waiting = [
                    self._priority[j] for j, st in self.running.items() if st in BEFORE_MODEL
                ]
                above = max(waiting) if len(waiting) >= self.ahead else None
        job = self.ledger.claim_next_job(self.config.engine.max_wait_s, above)
        if job is not None:
            with self._running_lock:
                self.running[job.id], self._priority[job.id] = "started", job.priority
        return job

    def alive(self) -> bool:
        """Whether every lane's thread is running."""
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    def start(self) -> None:
        """Start the lanes' threads; a helper thread prepares a tiny result once, so that
        the default model's SR template is cached before the first job (highdicom's tables
        of the standard are read first, here: see
        :func:`segnode.node.results.build.load_standard_tables`)."""
        load_standard_tables()
        self.warming = self._helper.submit(self._warm)
        if self.encoders is not None:
            self._helper.submit(self._start_encoders)
        for k in range(self.lanes):
            name = "segnode-worker" + (f"-{k + 1}" if self.lanes > 1 else "")
            thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._threads.append(thread)
            thread.start()
        if self.spare_lane:
            thread = threading.Thread(
                target=self._run, args=(True,), name="segnode-worker-urgent", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        log.info(
            "worker: %d lane(s)%s, %d model slot(s)%s",
            self.lanes,
            " and one for an urgent job when they are full" if self.spare_lane else "",
            self.gate.slots,
            " (a second job only on a GPU with room for it)" if self.gate.slots > 1 else "",
        )

    def _start_encoders(self) -> None:
        assert self.encoders is not None
        try:
            self.encoders.start()
        except Exception as exc:  # each job tries again, and fails with the reason
            log.error("the SEG encoder processes did not start: %s", exc)

    def _warm(self) -> None:
        try:
            for charset in WARM_UP_CHARACTER_SETS:
                volume = assemble_from_datasets(warm_up_series(charset), min_slices=2)
                self._prepare(volume, self.manifest, ResultUIDs.new(), datetime.now())
        except Exception as exc:  # the first job then prepares the slow way
            log.debug("preparing the result templates at start failed: %s", exc)

    def stop(self, timeout: float | None = None) -> None:
        """Ask the lanes to stop after their jobs in progress and wait for them."""
        self._stop.set()
        self.wake.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._helper.shutdown(wait=False)
        if self.encoders is not None:
            self.encoders.close()

    def _run(self, spare: bool = False) -> None:
        while not self._stop.is_set():
            try:
                self._requeue_interrupted()
                found = self.run_once(spare)
            except SQLAlchemyError as exc:  # the ledger's database is away (PostgreSQL)
                log.error("the ledger cannot be reached (%s); jobs wait until it can", exc)
                self._stop.wait(2.0)
                continue
            if not found:
                self.wake.wait(1.0)
                self.wake.clear()
            else:
                self.wake.set()  # the other lanes look too (more may be queued)

    def _requeue_interrupted(self) -> None:
        """Put back in the queue the jobs a ledger outage interrupted (still ``running`` and
        this node's), now that the ledger answers."""
        while True:
            with self._running_lock:  # every lane runs this: one takes each job
                if not self._interrupted:
                    return
                job_id = self._interrupted[0]
            # (a ledger still away raises here: the job stays in the list for the next look)
            if self.ledger.requeue_job(job_id, "the ledger could not be reached while it ran"):
                log.info("job %d queued again after a ledger outage", job_id)
            with self._running_lock:
                if self._interrupted and self._interrupted[0] == job_id:
                    self._interrupted.pop(0)

    def run_once(self, spare: bool = False) -> bool:
        """Take and run one job; return False when the queue was empty (or the engine is
        still loading: jobs stay queued). ``spare``: as the urgent lane (:meth:`_claim`)."""
        if not self.engine_ready.is_set():
            return False
        job = self._claim(spare)
        if job is None:
            return False
        try:
            self.process(job)
        except SQLAlchemyError:
            with self._running_lock:
                self._interrupted.append(job.id)
            raise
        except NoSpace as exc:
            # Its results could not be written: the job waits in the queue, and the worker
            # with it, until the disk has room (an operator frees it, retention runs).
            self.ledger.requeue_job(job.id, f"no space for its results ({exc}); queued again")
            log.error(
                "job %d: no space left for its results under %s (%s); it runs again in %g s",
                job.id,
                self.results_dir,
                exc,
                NO_SPACE_WAIT_S,
            )
            self._stop.wait(NO_SPACE_WAIT_S)
        finally:
            self._stage(job.id, None)
            self._recycle_volume()
        return True

    def _recycle_volume(self) -> None:
        """Hand the finished job's prebuilt volume back to the streaming assembler's pool,
        unless it is kept for the next model's job of the same series."""
        volume, self._lane.prebuilt = getattr(self._lane, "prebuilt", None), None
        with self._volume_lock:
            kept = self._volume[3] if self._volume is not None else None
        if volume is not None and volume is not kept and self.volumes is not None:
            self.volumes.recycle(volume)

    def process(self, job: JobView) -> None:
        """Run every stage of ``job``; failures end it as failed with a reason."""
        t0 = time.perf_counter()
        queued, started = job.stages.get("queued"), job.stages.get("started")
        waited = (
            f", queued {(started - queued).total_seconds():.2f} s" if queued and started else ""
        )
        with self._running_lock:
            beside = ", ".join(f"{j} {stage}" for j, stage in self.running.items() if j != job.id)
        log.info(
            "job %d: start (series v%d, %d instances; priority %d%s; %s)",
            job.id,
            job.version,
            job.instance_count,
            job.priority,
            waited,
            f"in progress: {beside}" if beside else "nothing else in progress",
        )
        try:
            self._process(job)
        except NoSegmentsError as exc:
            reason = f"nothing to send: {exc}"
            log.info("job %d: %s", job.id, reason)
            self.ledger.finish_empty(job.id, reason)
            self.last_result = f"job {job.id} found no segment"
        except (VolumeError, EngineError, ResultError, JobError) as exc:
            self._fail(job, str(exc))
        except MemoryError:
            self._fail(job, "out of memory while processing the series")
        except SQLAlchemyError:
            raise  # not the job's fault: it is queued again once the ledger answers (_run)
        except Exception as exc:
            if _no_space(exc):
                raise NoSpace(str(exc)) from exc  # not the job's fault either (run_once)
            log.exception("job %d: unexpected error", job.id)
            self._fail(job, f"internal error: {type(exc).__name__}: {exc}")
        else:
            self.last_result = f"job {job.id} encoded in {time.perf_counter() - t0:.2f} s"
            log.info("job %d: %s", job.id, self.last_result)

    def _fail(self, job: JobView, reason: str) -> None:
        if self.ledger.fail_job(job.id, reason) is JobState.SUPERSEDED:
            log.info(
                "job %d: superseded: it failed on part of the series (%s), and more instances "
                "arrived while it ran; the next version runs on all of them",
                job.id,
                reason,
            )
            self.last_result = f"job {job.id} superseded"
            return
        log.warning("job %d failed: %s", job.id, reason)
        self.last_result = f"job {job.id} failed"

    def _process(self, job: JobView) -> None:
        paths = self.ledger.instance_paths(job.series_instance_uid)
        missing = [p for p in paths if not p.exists()]
        if missing:
            raise JobError(
                f"{len(missing)} {MISSING_FILES}, e.g. {missing[0].name}; the job runs again "
                "by itself when the sender sends them again (or: segnode retry)"
            )
        loading = job.model_name not in self.pool.loaded()
        if loading:  # not a job ahead of the models while its model loads: lanes take others
            self._stage(job.id, "loading its model")
        engine, manifest = self.pool.get(job.model_name)
        if loading:
            self._stage(job.id, "started")
        volume = self._sibling_volume(job, paths)
        if volume is None and self.volumes is not None:
            volume = self.volumes.take(job.series_instance_uid, paths)
            if volume is not None:
                log.info("job %d: volume prebuilt while the series arrived", job.id)
        self._lane.prebuilt = volume
        if volume is None:
            self._stage(job.id, "volume")
            volume = assemble_volume(paths, min_slices=self.config.series.min_slices)
        if self.ledger.queued_siblings(job.id):  # another model will need the same volume
            with self._volume_lock:
                self._volume = (job.series_instance_uid, job.version, paths, volume)
        self.ledger.mark(job.id, "volume_at")
        uids = ResultUIDs(
            seg_series_uid=job.seg_series_uid,
            seg_sop_uid=job.seg_sop_uid,
            sr_series_uid=job.sr_series_uid,
            sr_sop_uid=job.sr_sop_uid,
        )
        # Local time (DICOM dates and times are local) of the job's creation: the same on a
        # re-run, so a re-encoding after a crash gives the same bytes.
        queued = job.stages.get("queued") or datetime.now(UTC).replace(tzinfo=None)
        created = queued.replace(tzinfo=UTC).astimezone().replace(tzinfo=None)
        estimate = self._check_memory(engine, manifest, volume)
        if estimate is not None:
            base, need = estimate.base, max(0, estimate.peak - estimate.base)
        else:  # a version-1 model: the volume in float32, the label map, the SEG's frames
            base, need = self._base_bytes(), 3 * int(volume.hu.nbytes)
        self.budget.limit = self.memory_limit
        with self.budget.reserve(job.id, base, need) as budget_wait:
            self._run_job(job, engine, manifest, volume, uids, created, estimate, budget_wait)

    def _run_job(
        self,
        job: JobView,
        engine: Engine,
        manifest: ModelManifest,
        volume: Volume,
        uids: ResultUIDs,
        created: datetime,
        estimate: JobEstimate | None,
        budget_wait: float,
    ) -> None:
        with self._running_lock:
            alone = len(self.running) == 1
        if alone:
            reset_peak()  # the timing line gives this job's peak
        clock = _Clock()
        queued = job.stages.get("queued")
        now = datetime.now(UTC).replace(tzinfo=None)
        queued_s = (now - queued).total_seconds() if queued is not None else 0.0
        self._stage(job.id, "waiting for the model")
        if self.prepare_mode == "before":
            seg_plan, sr_plan = self._prepare(volume, manifest, uids, created)
            clock.lap("prepare")
            with self.gate.hold(job.id, job.priority, queued_s, self._room(engine)) as held:
                self._stage(job.id, "model")
                clock.restart()
                with _job_scope(engine, held):
                    labels, sums = _segment(engine, manifest, volume)
            clock.lap("inference")
        else:
            with _switch_interval(PREPARE_SWITCH_INTERVAL_S):
                plans = self._helper.submit(self._timed_prepare, volume, manifest, uids, created)
                with self.gate.hold(job.id, job.priority, queued_s, self._room(engine)) as held:
                    self._stage(job.id, "model")
                    clock.restart()
                    try:
                        with _job_scope(engine, held):
                            labels, sums = _segment(engine, manifest, volume)
                    finally:
                        clock.lap("inference")
                (seg_plan, sr_plan), prepared = plans.result()  # its errors fail the job
                clock.lap("waited")
                clock.laps["prepare"] = prepared
        self._stage(job.id, "results")
        self.ledger.mark(job.id, "inference_at")
        clock.lap("mark")
        out = self.results_dir / str(job.id)
        seg_path = out / f"seg-{uids.seg_sop_uid}.dcm"
        sr_path = out / f"sr-{uids.sr_sop_uid}.dcm"
        # Encoded and checked in an encoder process (with the statistics where the engine
        # gave no sums, else while this thread computes them from the sums) or here; the SEG
        # goes to disk (a synced temp file) while it is checked, and gets its name only
        # once the check passed and the SR is encoded.
        encoding: Future[WrittenSeg] | None = None
        seg: WrittenSeg | None = None
        if self.encoders is not None:
            hu = volume.hu if sums is None else None
            encoding = self.encoders.submit(
                seg_plan, labels, seg_path, hu, voxel_volume_ml=volume.voxel_volume_ml
            )
        else:
            seg = encode_and_write(seg_plan, labels, seg_path, self._helper)
        clock.lap("seg")
        try:
            where = "engine sums"
            if sums is not None:
                stats = statistics_from_sums(volume, sums, manifest)
            elif encoding is None:
                stats, where = segment_statistics(volume, labels, manifest), "CPU"
            clock.lap("statistics")
            if encoding is not None:
                seg = encoding.result()  # its errors fail the job
                clock.laps["seg"] += clock.lap("seg waited")
                if seg.statistics is not None:
                    stats = seg.statistics
                    where = f"CPU in encoder process {seg.pid}, {seg.statistics_s * 1e3:.1f} there"
            sr_bytes = sr_plan.encode(stats, now=created)
            clock.lap("sr")
        except BaseException:
            _discard(encoding, seg)
            raise
        assert seg is not None
        try:
            os.replace(seg.temp, seg_path)
        except BaseException:
            seg.temp.unlink(missing_ok=True)
            raise
        write_atomic(sr_path, sr_bytes)  # its fsync of the folder makes both names durable
        clock.lap("files")
        notes = self._rejection_notes(job, out)
        clock.lap("notes")
        self.last_peak_rss = peak = peak_resident_bytes()
        memory = f"peak RSS {peak / GIB:.2f} GiB" + (
            f" (estimated {estimate.peak / GIB:.2f} GiB)" if estimate is not None else ""
        )
        kept = self.ledger.save_results(
            job.id,
            [
                ("SEG", seg_plan.sop_class_uid, uids.seg_sop_uid, uids.seg_series_uid, seg_path),
                ("SR", sr_plan.sop_class_uid, uids.sr_sop_uid, uids.sr_series_uid, sr_path),
            ],
            list(job.destinations),
            notes,
            memory=memory,
        )
        clock.lap("ledger")
        ms = {name: seconds * 1e3 for name, seconds in clock.laps.items()}
        after = ("mark", "seg", "statistics", "sr", "files", "notes", "ledger")
        log.info(
            "job %d: timing ms: waited for memory %.1f, for the model %.1f; "
            "inference %.1f, prepare %.1f (%s, inference waited %.1f); "
            "after inference %.1f = mark %.1f, SEG %.1f (SEG encode %.1f, check %.1f, %s), "
            "statistics %.1f (%s), SR encode %.1f, files %.1f (%.1f MB), notes %.1f, "
            "ledger %.1f; %s",
            job.id,
            budget_wait * 1e3,
            held.waited * 1e3,
            ms["inference"],
            ms["prepare"],
            self.prepare_mode,
            ms.get("waited", 0.0),
            sum(ms[name] for name in after),
            ms["mark"],
            ms["seg"],
            seg.encode_s * 1e3,
            seg.check_s * 1e3,
            "in the node" if seg.pid == os.getpid() else f"encoder process {seg.pid}",
            ms["statistics"],
            where,
            ms["sr"],
            ms["files"],
            (seg.size + len(sr_bytes)) / 1e6,
            ms["notes"],
            ms["ledger"],
            memory,
        )
        if not kept:
            log.info(
                "job %d: superseded while it ran (a newer version, or more instances of the "
                "series arrived); its results are kept on disk and not sent",
                job.id,
            )
            return
        if self.on_encoded is not None:
            self.on_encoded(job.id)

    def _base_bytes(self) -> int:
        """The node's resident set without the other jobs in progress: measured now when
        this job is the only one, else as last measured so (the engines, the caches, the
        streaming assembler's volumes), so a job is not refused, nor its estimate inflated,
        for memory that jobs beside it hold and will give back."""
        with self._running_lock:
            alone = len(self.running) <= 1
        if alone or self._alone_rss is None:
            self._alone_rss = resident_bytes()
        return self._alone_rss

    def _check_memory(
        self, engine: Engine, manifest: ModelManifest, volume: Volume
    ) -> JobEstimate | None:
        """A trained model's estimated peak (:func:`segnode.engines.memory.estimate_job`);
        a job that would not fit ``[engine] memory_limit`` fails here, with the figures,
        before it takes the memory (the node keeps serving). Version-1 models stream their
        window along z (:mod:`segnode.engines.sliding_window`) and are not estimated."""
        if not manifest.is_trained:
            return None
        window_batch = getattr(engine, "window_batch", None)
        z, y, x = (int(n) for n in volume.hu.shape)
        dz, dy, dx = (float(s) for s in volume.spacing)
        estimate = estimate_job(
            manifest,
            (z, y, x),
            (dz, dy, dx),
            window_batch=int(window_batch()) if callable(window_batch) else 1,
            base=self._base_bytes(),
        )
        if estimate.peak > self.memory_limit:
            raise JobError(
                f"not enough memory: model {manifest.name} on this {x}x{y}x{z} series needs "
                f"about {estimate.peak / GIB:.1f} GiB (the node holds "
                f"{estimate.base / GIB:.1f} GiB), more than [engine] memory_limit "
                f"{self.memory_limit / GIB:.1f} GiB"
            )
        return estimate

    def _room(self, engine: Engine) -> Callable[[], bool] | None:
        """What the gate asks before this engine's job enters beside others: the device's
        room for it (:meth:`SlotEngine.has_room`); None (alone only) for other engines."""
        if self.gate.slots > 1 and isinstance(engine, SlotEngine):
            return engine.has_room
        return None

    def _timed_prepare(
        self, volume: Volume, manifest: ModelManifest, uids: ResultUIDs, created: datetime
    ) -> tuple[tuple[SegPlan, SrPlan], float]:
        """:meth:`_prepare` and the seconds it took (on the helper thread)."""
        started = time.perf_counter()
        plans = self._prepare(volume, manifest, uids, created)
        return plans, time.perf_counter() - started

    def _prepare(
        self, volume: Volume, manifest: ModelManifest, uids: ResultUIDs, created: datetime
    ) -> tuple[SegPlan, SrPlan]:
        """The SEG and SR of ``volume`` encoded but for what the label map decides."""
        seg = SegPlan.prepare(
            volume,
            manifest,
            uids,
            segmentation_type=self.segmentation_type,
            transfer_syntax=self.seg_transfer_syntax,
            equipment=Equipment.for_seg(__version__),
            created=created,
        )
        sr = SrPlan.prepare(volume, seg, equipment=Equipment.for_sr(__version__))
        return seg, sr

    def _rejection_notes(
        self, job: JobView, out: Path
    ) -> list[tuple[str, str, str, str, Path, list[str]]]:
        """IOCM rejection notes for the destinations with ``reject_superseded`` that
        received results of an older version of the series (one note per set of rejected
        objects; UIDs derived from the job's, so a re-run makes the same note)."""
        rejecting = self._rejecting & set(job.destinations)
        if not rejecting:
            return []
        by_set: dict[tuple[str, ...], tuple[list[Path], list[str]]] = {}
        for dest, sent in self.ledger.superseded_sent(job.id).items():
            if dest in rejecting:
                key = tuple(sorted(uid for uid, _ in sent))
                by_set.setdefault(key, ([p for _, p in sent], []))[1].append(dest)
        notes = []
        for key, (paths, dests) in by_set.items():
            uid = derived_uid("segnode-kos", job.seg_sop_uid, *key)
            series_uid = derived_uid("segnode-kos-series", job.seg_sop_uid, *key)
            try:
                note = build_rejection_note(
                    paths, series_instance_uid=series_uid, sop_instance_uid=uid
                )
            except (OSError, ValueError) as exc:
                log.error("job %d: no rejection note for %s: %s", job.id, ", ".join(dests), exc)
                continue
            path = out / f"kos-{uid}.dcm"
            write_atomic(path, encode(note))
            notes.append(("KOS", KOS_SOP_CLASS, uid, series_uid, path, sorted(dests)))
            log.info(
                "job %d: rejection note for %d superseded object(s) to %s",
                job.id,
                len(key),
                ", ".join(sorted(dests)),
            )
        return notes

    def _sibling_volume(self, job: JobView, paths: list[Path]) -> Volume | None:
        """The volume of the previous job if it was the same series version (another model)."""
        with self._volume_lock:
            cached, self._volume = self._volume, None
        if cached is None:
            return None
        uid, version, cached_paths, volume = cached
        if (uid, version, cached_paths) != (job.series_instance_uid, job.version, paths):
            return None
        log.info("job %d: volume shared with the previous model's job", job.id)
        return volume


WARM_UP_CHARACTER_SETS: tuple[str | None, ...] = (None, "ISO_IR 100")
"""Specific Character Sets a result is prepared for at start: the SR template is cached per
character set, and these two (none, that is ASCII, and Latin-1) are what most CT carries."""


def warm_up_series(charset: str | None = None) -> list[Dataset]:
    """Two 8 x 8 axial CT slices with the attributes the SEG and SR copy from a series
    (no patient data) in ``charset``: what :meth:`Worker.start` prepares a result for, so
    that the default model's SR template is cached before the first job
    (:class:`segnode.node.results.sr_encode.SrPlan`)."""
    study, series, frame = (generate_uid(prefix=None) for _ in range(3))
    out = []
    for k in range(2):
        ds = Dataset()
        if charset is not None:
            ds.SpecificCharacterSet = charset
        ds.file_meta = FileMetaDataset()
        ds.file_meta.MediaStorageSOPClassUID = UID(CT_IMAGE_STORAGE)
        ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds.SOPClassUID = CT_IMAGE_STORAGE
        ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid(prefix=None)
        ds.PatientID, ds.PatientName, ds.PatientSex, ds.PatientBirthDate = "WARMUP", "", "", ""
        ds.StudyInstanceUID, ds.StudyID, ds.AccessionNumber = study, "", ""
        ds.StudyDate, ds.StudyTime, ds.ReferringPhysicianName = "20240101", "120000", ""
        ds.Modality, ds.SeriesInstanceUID, ds.SeriesNumber = "CT", series, 1
        ds.FrameOfReferenceUID, ds.PositionReferenceIndicator = frame, ""
        ds.Manufacturer, ds.InstanceNumber = "segnode", k + 1
        ds.PixelSpacing, ds.SliceThickness = [1.0, 1.0], 1.0
        ds.ImageOrientationPatient = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        ds.ImagePositionPatient = [0.0, 0.0, float(k)]
        ds.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL"]
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.Rows = ds.Columns = 8
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
        ds.RescaleIntercept, ds.RescaleSlope, ds.RescaleType = -1024, 1, "HU"
        ds.PixelData = np.full((8, 8), 1024, dtype=np.uint16).tobytes()
        out.append(ds)
    return out


_switch_lock = threading.Lock()
_switch = {"inside": 0.0, "saved": 0.005}  # lanes inside, and the interval before the first


@contextmanager
def _switch_interval(seconds: float) -> Iterator[None]:
    """Python's thread switch interval set to ``seconds`` inside, restored after the last of
    the lanes inside leaves."""
    with _switch_lock:
        if not _switch["inside"]:
            _switch["saved"] = sys.getswitchinterval()
        _switch["inside"] += 1
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        with _switch_lock:
            _switch["inside"] -= 1
            if not _switch["inside"]:
                sys.setswitchinterval(_switch["saved"])


def _segment(
    engine: Engine, manifest: ModelManifest, volume: Volume
) -> tuple[npt.NDArray[np.uint8], LabelSums | None]:
    """The engine's label map, and its per-label HU sums when the engine computes them
    (:func:`segnode.engines.model_process.segment_volume`, in the node or in the model's
    process of its own).

    A version-2 (trained) model runs with the volume's geometry; a series the model cannot
    take (gantry tilt, oblique) raises :class:`segnode.engines.preprocess.GeometryError`, an
    :class:`EngineError`: the job fails with that reason.
    """
    geometry = None
    if manifest.is_trained:
        from segnode.engines.preprocess.orientation import Geometry

        geometry = Geometry.from_volume(volume)
    return segment_volume(engine, manifest, volume.hu, geometry)


def _job_scope(engine: Engine, held: Hold) -> contextlib.AbstractContextManager[None]:
    """The engine's scope for one job in its model (:meth:`SlotEngine.job_scope`: its own
    CUDA stream, and its memory peak measured where it ran alone); nothing for others."""
    if isinstance(engine, SlotEngine):
        return engine.job_scope(lambda: held.shared)
    return contextlib.nullcontext()


class _Clock:
    """Seconds between successive :meth:`lap` calls, by name (for the per-job timing line)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def restart(self) -> None:
        """The next lap counts from now."""
        self._last = time.perf_counter()

    def lap(self, name: str) -> float:
        """Record the seconds since the last lap as ``name``; returns them."""
        now = time.perf_counter()
        self.laps[name] = seconds = now - self._last
        self._last = now
        return seconds


def _discard(encoding: Future[WrittenSeg] | None, seg: WrittenSeg | None) -> None:
    """Remove the temp file of a SEG whose job failed after its encoding (waiting for an
    encoder process to finish it first)."""
    if encoding is not None:
        try:
            seg = encoding.result()
        except Exception:
            return  # it failed too: nothing was left
    if seg is not None:
        seg.temp.unlink(missing_ok=True)


def result_paths(data_dir: Path, job_id: int) -> list[Path]:
    """Files written for a job (for tests and the CLI)."""
    return sorted((data_dir / "results" / str(job_id)).glob("*.dcm"))
