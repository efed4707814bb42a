"""The job worker: series -> volume -> label map -> SEG + SR files -> outbox rows.

One worker thread takes the most urgent queued job from the ledger, runs each stage, and
records each stage's timestamp. Any failure becomes a failed job with a reason; the node keeps
serving. The result objects are written to ``<data_dir>/results/<job id>/`` atomically before
the ledger says ``encoded``, so the outbox always sends exactly the bytes that were encoded,
with UIDs allocated when the job was created.
"""

from __future__ import annotations

import logging
import threading
import time
from io import BytesIO
from pathlib import Path

from pydicom import Dataset

from engines.base import Engine, EngineError
from engines.manifest import ModelManifest
from node import __version__
from node.config import Config
from node.errors import JobError
from node.results import ResultError, ResultUIDs, build_seg, build_sr, verify_seg
from node.volume import VolumeError, assemble_volume
from storage.ledger import JobView, Ledger
from storage.spool import write_atomic

log = logging.getLogger(__name__)


def encode(ds: Dataset) -> bytes:
    """Encode a dataset in the DICOM File Format (PS3.10) with its file meta."""
    buf = BytesIO()
    ds.save_as(buf, enforce_file_format=True)
    return buf.getvalue()


class Worker:
    """Runs jobs from the ledger, one at a time, on one engine.

    Parameters
    ----------
    config, ledger
        Node configuration and durable state.
    engine, manifest
        A loaded inference engine and its model.
    """

    def __init__(
        self, config: Config, ledger: Ledger, engine: Engine, manifest: ModelManifest
    ) -> None:
        self.config = config
        self.ledger = ledger
        self.engine = engine
        self.manifest = manifest
        self.results_dir = config.data_dir / "results"
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.current_job: int | None = None
        self.last_result: str = "none yet"

    def start(self) -> None:
        """Start the worker thread."""
        self._thread = threading.Thread(target=self._run, name="segnode-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the thread to stop after the job in progress and wait for it."""
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.run_once():
                self.wake.wait(1.0)
                self.wake.clear()

    def run_once(self) -> bool:
        """Take and run one job; return False when the queue was empty."""
        job = self.ledger.claim_next_job()
        if job is None:
            return False
        self.current_job = job.id
        try:
            self.process(job)
        finally:
            self.current_job = None
        return True

    def process(self, job: JobView) -> None:
        """Run every stage of ``job``; failures end it as failed with a reason."""
        t0 = time.perf_counter()
        log.info(
            "job %d: start (series v%d, %d instances)", job.id, job.version, job.instance_count
        )
        try:
            self._process(job)
        except (VolumeError, EngineError, ResultError, JobError) as exc:
            self._fail(job, str(exc))
        except MemoryError:
            self._fail(job, "out of memory while processing the series")
        except Exception as exc:
            log.exception("job %d: unexpected error", job.id)
            self._fail(job, f"internal error: {type(exc).__name__}: {exc}")
        else:
            self.last_result = f"job {job.id} encoded in {time.perf_counter() - t0:.2f} s"
            log.info("job %d: %s", job.id, self.last_result)

    def _fail(self, job: JobView, reason: str) -> None:
        log.warning("job %d failed: %s", job.id, reason)
        self.ledger.fail_job(job.id, reason)
        self.last_result = f"job {job.id} failed"

    def _process(self, job: JobView) -> None:
        paths = self.ledger.instance_paths(job.series_instance_uid)
        missing = [p for p in paths if not p.exists()]
        if missing:
            raise JobError(
                f"{len(missing)} spooled instance file(s) are missing, e.g. {missing[0].name}"
            )
        volume = assemble_volume(paths, min_slices=self.config.series.min_slices)
        self.ledger.mark(job.id, "volume_at")
        labels = self.engine.segment(volume.hu)
        self.ledger.mark(job.id, "inference_at")
        uids = ResultUIDs(
            seg_series_uid=job.seg_series_uid,
            seg_sop_uid=job.seg_sop_uid,
            sr_series_uid=job.sr_series_uid,
            sr_sop_uid=job.sr_sop_uid,
        )
        seg = build_seg(volume, labels, self.manifest, uids, software_version=__version__)
        verify_seg(seg, volume, labels)
        sr = build_sr(volume, labels, self.manifest, seg, uids, software_version=__version__)
        out = self.results_dir / str(job.id)
        seg_path = out / f"seg-{uids.seg_sop_uid}.dcm"
        sr_path = out / f"sr-{uids.sr_sop_uid}.dcm"
        write_atomic(seg_path, encode(seg))
        write_atomic(sr_path, encode(sr))
        self.ledger.save_results(
            job.id,
            [
                ("SEG", str(seg.SOPClassUID), uids.seg_sop_uid, uids.seg_series_uid, seg_path),
                ("SR", str(sr.SOPClassUID), uids.sr_sop_uid, uids.sr_series_uid, sr_path),
            ],
            [p.name for p in self.config.dispatch.destinations],
        )


def result_paths(data_dir: Path, job_id: int) -> list[Path]:
    """Files written for a job (for tests and the CLI)."""
    return sorted((data_dir / "results" / str(job_id)).glob("*.dcm"))
