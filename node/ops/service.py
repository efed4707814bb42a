"""The running node: SCP, completion, worker and outbox wired together around the ledger.

Every collaborator is given to its constructor (the SCP its completion events and hooks, the
worker its prebuilt volumes and ``on_encoded``); series complete on the completion thread
(:class:`~segnode.node.ingest.series.CompletionLoop`), which also runs the quiet-period scan,
so the main loop only does retention and systemd's STATUS and WATCHDOG.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from pydicom.errors import InvalidDicomError
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from segnode.engines.base import Engine, EngineError
from segnode.engines.manifest import ModelManifest, check_runnable
from segnode.node.audit.trail import AuditTrail
from segnode.node.config import Config
from segnode.node.errors import ConfigError, SegnodeError, log_failure
from segnode.node.ingest.scp import StoreSCP, record_from_file
from segnode.node.ingest.senders import SenderBook, load_patterns, save_pattern
from segnode.node.ingest.series import CompletionLoop
from segnode.node.ingest.streaming import Arrival, StreamingAssembler
from segnode.node.modelspec import load_spec_manifest
from segnode.node.ops.gpu import gpu_busy_percent
from segnode.node.ops.metrics import Metrics
from segnode.node.ops.notify import Notifier
from segnode.node.ops.retention import Retention
from segnode.node.outbox.scu import Dispatcher
from segnode.node.pipeline.engine_pool import EnginePool, make_engine
from segnode.node.pipeline.worker import Worker
from segnode.node.routing.rules import (
    Decision,
    Router,
    model_specs,
    read_facts,
    senders_from_peers,
)
from segnode.storage.durable import ensure_folder
from segnode.storage.ledger import Ledger, LedgerInUse, NewJob, utcnow
from segnode.storage.spool import POOL_FILE_BYTES, Spool

if TYPE_CHECKING:
    from segnode.node.web.console import WebConsole

log = logging.getLogger(__name__)


def _gpu_ratio() -> float:
    busy = gpu_busy_percent()
    return float("nan") if busy is None else busy / 100


def open_state(config: Config, *, create: bool = True) -> tuple[Ledger, Spool]:
    """Open (creating with private permissions) the ledger and spool under the data dir; the
    ledger is ``[ledger] url`` when set (PostgreSQL: its schema must be current).

    With ``create=False`` (the CLI's commands on a node's state) an SQLite ledger must exist
    already: a mistyped ``--data-dir`` or a missing ``--config`` is an error, not an empty ledger.

    Raises
    ------
    ConfigError
        ``data_dir`` cannot be created (a file is in the way, no permission, ...).
    SegnodeError
        ``create=False`` and there is no SQLite ledger in ``data_dir``.
    """
    if not create and not config.ledger.url:
        path = config.data_dir / "ledger.sqlite"
        if not path.is_file():
            raise SegnodeError(
                f"no ledger at {path}: no segnode has run with this data directory; name the "
                "node's configuration with --config, or its data directory with --data-dir"
            )
    make_data_dir(config.data_dir)
    pool_files = config.node.staging_pool_mb * 2**20 // POOL_FILE_BYTES
    if config.ledger.url:
        ledger = Ledger(url=config.ledger.url)
    else:
        ledger = Ledger(config.data_dir / "ledger.sqlite")
    ledger.lease = timedelta(seconds=config.ledger.lease_s)  # which nodes count as alive
    return ledger, Spool(config.data_dir / "spool", pool_files)


def make_data_dir(path: Path) -> None:
    """Create ``data_dir`` (private to the service user) unless it exists.

    Raises
    ------
    ConfigError
        It cannot be created, or something other than a folder is in its place.
    """
    try:
        ensure_folder(path)  # a new data_dir's name (and its new parents') durable
    except FileExistsError as exc:
        raise ConfigError(f"data_dir: {path} exists and is not a folder") from exc
    except OSError as exc:
        raise ConfigError(f"data_dir: cannot create {path}: {exc.strerror or exc}") from exc


class DataDirInUse(SegnodeError):
    """Another segnode process is serving from the same data directory."""


class DataDirLock:
    """An exclusive lock on ``data_dir`` for the life of one serving node.

    The spool's staging files, its series folders and start-up recovery (which clears staged
    files and requeues running jobs) belong to one process; a second node on the same folder
    would mix their files. The lock is ``flock`` on ``data_dir/segnode.lock``, which also holds
    the owner's pid; the kernel drops it when the process ends, however it ends.

    Raises
    ------
    DataDirInUse
        Another process holds the lock.
    """

    NAME = "segnode.lock"

    def __init__(self, data_dir: Path) -> None:
        make_data_dir(data_dir)
        self.path = data_dir / self.NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUse(
                f"data_dir {data_dir} is in use by another segnode process (pid {owner}); "
                "give each node its own data_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """Release the lock (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def node_name(config: Config) -> str:
    """``[ledger] node_name``, else ``<hostname>:<port>`` (``<hostname>:pid<pid>`` for port 0)."""
    if config.ledger.node_name:
        return config.ledger.node_name
    port = config.node.port or f"pid{os.getpid()}"
    return f"{socket.gethostname()}:{port}"


class Node:
    """One segnode process.

    Parameters
    ----------
    config
        The validated configuration.
    engine
        An already loaded engine (tests may share one); created from config when None.
    """

    def __init__(self, config: Config, engine: Engine | None = None) -> None:
        self.config = config
        self.data_dir_lock = DataDirLock(config.data_dir)
        try:
            self.ledger, self.spool = open_state(config)
            try:
                self.ledger.join(node_name(config), self.address, config.ledger.lease_s)
            except LedgerInUse:
                self.ledger.close()
                raise
            self._last_heartbeat = time.monotonic()
            self.manifest: ModelManifest = load_spec_manifest(config.model)
            check_runnable(self.manifest)
            #: The engine still to load in the background (``[model] load = "background"``).
            self._unloaded: Engine | None = None
            self._loader: threading.Thread | None = None
            #: Why the node stops on its own: the engine could not be loaded in the background,
            #: or the ledger file went.
            self.failure: str | None = None
            if engine is None:
                engine = make_engine(
                    model_specs(config)[0],
                    config.data_dir,
                    gpu_memory_limit=config.engine.gpu_memory_limit,
                    model_process=config.engine.model_process,
                )
                if config.model.load == "background":
                    self._unloaded = engine
                else:
                    engine.load(self.manifest)
            self.engine = engine
            self.pool = EnginePool.of_config(config, engine, self.manifest)
            self.router = Router(
                config.routing,
                config.dispatch.destinations,
                senders_from_peers(config.node.peers),
                lambda ae: config.series.policy_for(ae).priority,
            )
            self.senders = SenderBook(
                load_patterns(self.ledger), save=lambda p: save_pattern(self.ledger, p)
            )
            # The one owner of series-completion state: its thread runs _series_complete and
            # the quiet-period scan.
            self.completion = CompletionLoop(
                self._series_complete,
                complete_on_release=config.series.complete_on_release,
                policy=lambda ae: config.series.policy_for(ae).completion,
                senders=self.senders,
                hints=lambda uid: self.streaming.hints(uid),
                on_hold=self.ledger.record_hold,
                quiet=self._quiet_series,
                quiet_every_s=self._tick,
                on_failure=self._completion_failed,
                quiet_period_s=config.series.quiet_period_s,
            )
            # Fast path: decode while receiving, geometric completeness, no timer between stages.
            sc = config.streaming
            self.streaming = StreamingAssembler(
                workers=sc.workers,
                max_bytes=sc.max_memory_mb * 2**20,
                min_slices=config.series.min_slices,
                on_geometry=self.completion.geometry_complete,
                decode_pixels=sc.enabled,
                warm_bytes=sc.warm_mb * 2**20,
                priority=lambda ae: config.series.policy_for(ae).priority,
            )
            # [audit]: ATNA messages in a durable queue of their own (off: does nothing)
            self.audit = AuditTrail.from_config(config, node_name(config))
            self.scp = StoreSCP(
                config,
                self.ledger,
                self.spool,
                self.completion,
                on_instance=self._instance_stored,
                busy_elsewhere=lambda: self.worker.current_job is not None,
                audit=self.audit,
            )
            self.worker = Worker(
                config,
                self.ledger,
                self.pool,
                volumes=self.streaming,  # (geometry-only when disabled: take() is None)
                on_encoded=self._encoded,
            )
            self.dispatcher = Dispatcher(config, self.ledger, audit=self.audit)
            self.web: WebConsole | None = None  # [web]: the console and the result previews
            if config.web.enabled:
                from segnode.node.web.console import WebConsole  # needs the web extra

                self.web = WebConsole(self)
            self.metrics: Metrics | None = None
            if config.metrics.enabled:
                self.metrics = Metrics(
                    self.ledger,
                    {
                        "segnode_streaming_bytes": lambda: self.streaming.memory_bytes,
                        "segnode_streaming_series": lambda: self.streaming.series_in_memory,
                        # the job's peak resident set (VmHWM since it started), last job
                        "segnode_job_peak_rss_bytes": lambda: self.worker.last_peak_rss,
                        # the share of the last minute the models ran a job (0 to 1)
                        "segnode_model_busy_ratio": lambda: self.worker.gate.busy_fraction(),
                        "segnode_jobs_in_progress": lambda: len(self.worker.running),
                        # jobs running their models now (up to [engine] model_slots)
                        "segnode_jobs_in_model": lambda: len(self.worker.gate.holders()),
                        "segnode_jobs_waiting_for_model": lambda: sum(
                            self.worker.gate.waiting().values()
                        ),
                        # NVML's utilisation of GPU 0 (0 to 1); NaN without NVML
                        "segnode_gpu_busy_ratio": _gpu_ratio,
                    },
                )
            self.retention = Retention(config, self.ledger, audit=self.audit)
            self.notifier = Notifier()
            self._stop = threading.Event()
            self._create_lock = threading.Lock()
        except BaseException:  # the next node on this data_dir (a restart, a test) may start
            self.data_dir_lock.release()
            raise

    def _instance_stored(self, arrival: Arrival) -> None:
        """SCP hook, after an instance is durable: queue its decoding, count it."""
        self.streaming.submit(arrival)
        if self.metrics is not None:
            self.metrics.instance_stored(arrival.size)

    def _work_elsewhere(self) -> None:
        """A node on the shared ledger queued a job or encoded results: look now."""
        self.worker.wake.set()
        self.dispatcher.wake.set()

    def _encoded(self, job_id: int) -> None:
        """Worker hook, a job's results are encoded: wake the outbox, queue the preview."""
        self.dispatcher.wake.set()
        if self.web is not None:
            self.web.encoded(job_id)

    def _series_complete(self, series_uid: str, trigger: str) -> None:
        """A series is complete: apply the routing rules; queue one job per model, or record
        the series as ignored with the reason."""
        summary = self.ledger.series_summary(series_uid)
        if summary is None:
            return  # another signal already took its instances
        try:
            facts = read_facts(
                summary.first_instance,
                calling_ae=summary.calling_ae,
                instances=summary.instance_count,
                series_uid=series_uid,
            )
        except (OSError, InvalidDicomError, ValueError) as exc:
            decision = Decision(ignored=f"cannot read the first instance of the series: {exc}")
        else:
            decision = self.router.decide(facts)
        jobs = [
            NewJob(
                p.model,
                self.pool.label(p.model),
                self.pool.engine_name(p.model),
                p.destinations,
                p.priority,
                p.rule,
            )
            for p in decision.jobs
        ]
        with self._create_lock:
            if decision.ignored is not None:
                if self.ledger.ignore_series(series_uid, decision.ignored):
                    log.info("series ignored (trigger: %s): %s", trigger, decision.ignored)
                    self.streaming.discard(series_uid)
                return
            job_ids = self.ledger.create_jobs(series_uid, trigger=trigger, jobs=jobs)
        if job_ids:
            for job_id, p in zip(job_ids, decision.jobs, strict=True):
                log.info(
                    "job %d queued (trigger: %s, rule %s, model %s, priority %d)",
                    job_id,
                    trigger,
                    p.rule,
                    p.model,
                    p.priority,
                )
            self.worker.wake.set()
            if self.metrics is not None:
                self.metrics.series_complete(trigger)

    def _completion_failed(self, series_uid: str, error: Exception) -> bool:
        """Completion hook: completing the series raised again and again; record it as
        ignored with the reason, as routing records a series no rule selects (its instances
        stay in the spool and the ledger, ``segnode jobs`` lists it; new instances reopen
        it). Returns whether it is settled: a ledger that cannot be reached is retried."""
        if isinstance(error, OperationalError):
            return False
        reason = f"completing the series failed: {type(error).__name__}: {error}"
        with self._create_lock:
            if self.ledger.ignore_series(series_uid, reason):
                log.error("series ignored: %s", reason)
                self.streaming.discard(series_uid)
        return True

    @property
    def address(self) -> str:
        """``AE@host:port`` as configured (for ``segnode status`` on a shared ledger)."""
        n = self.config.node
        return f"{n.ae_title}@{n.host}:{n.port}"

    def _keep_lease(self) -> None:
        """Every ``lease / 4``: the heartbeat, then take over the running jobs of nodes whose
        heartbeat is older than the lease (none on a ledger of one node)."""
        if time.monotonic() - self._last_heartbeat < self.config.ledger.lease_s / 4:
            return
        self._last_heartbeat = time.monotonic()
        try:
            self.ledger.heartbeat()
            n = self.ledger.take_over(self.config.job_max_attempts)
        except SQLAlchemyError as exc:  # the database is away: the next round tries again
            log.warning("ledger heartbeat failed: %s", exc)
            return
        if n:
            log.warning("took over %d job(s) of a node whose lease expired", n)
            self.worker.wake.set()

    @property
    def _tick(self) -> float:
        """Seconds between two quiet-period scans (and main-loop rounds)."""
        return min(1.0, max(0.05, self.config.series.quiet_period_s / 4))

    def _quiet_series(self) -> list[str]:
        """Pending series nothing was received for during the quiet period (the completion
        thread completes those no open association is delivering)."""
        quiet = timedelta(seconds=self.config.series.quiet_period_s)
        return self.ledger.pending_series(quiet_before=utcnow() - quiet)

    def check_quiet(self) -> None:
        """Run the quiet-period scan now (on the completion thread; it also runs there every
        few tenths of a second on its own)."""
        self.completion.scan_quiet()

    def _record_lost_rows(self) -> None:
        """Record spool files whose instance row a power cut lost (those rows are committed
        without a WAL fsync; their files were fsynced before the instance was acknowledged).
        The series is then pending again and completes by the quiet period."""
        lost = self.ledger.missing_instances(self.spool.instance_files())
        recorded = 0
        for path in lost:
            try:
                rec = record_from_file(path)
                if (
                    self.spool.path_for(
                        rec.study_instance_uid, rec.series_instance_uid, rec.sop_instance_uid
                    )
                    != path
                ):
                    raise ValueError(f"{path.name}: UIDs do not match its spool path")
            except ValueError as exc:
                log.error("spool file %s has no ledger row and cannot be recorded: %s", path, exc)
                continue
            if self.ledger.record_instance(rec, path, path.stat().st_size):
                recorded += 1
        if recorded:
            log.warning(
                "recorded %d spooled instance(s) whose ledger row was lost (power cut?)",
                recorded,
            )

    def start(self) -> None:
        """Recover interrupted work, then start listening and working."""
        n = self.ledger.recover(self.config.job_max_attempts)
        self.ledger.release_deliveries()  # what it was sending when it stopped: due now
        if n:
            log.info("resuming %d job(s) interrupted by a restart", n)
        dropped = self.ledger.drop_unstored_instances(self.spool.root)
        if dropped:
            log.warning("removed %d unacknowledged instance row(s) without a file", dropped)
        staged = self.spool.clear_incoming()
        if staged:
            log.info("removed %d unacknowledged staged file(s) left by a restart", staged)
        self._record_lost_rows()
        self.audit.start()
        self.audit.started(self.config)
        self.scp.fill_staging_pool()
        self.completion.start()
        self.streaming.start()
        if self.metrics is not None:
            mc = self.config.metrics
            try:
                self.metrics.start(mc.host, mc.port)
            except OSError as exc:  # named here: the caller's message is about node.port
                raise SegnodeError(
                    f"metrics.port {mc.host}:{mc.port}: cannot listen: {exc.strerror or exc}"
                ) from exc
        if self._unloaded is not None:
            self.worker.engine_ready.clear()  # jobs wait for the engine
        self.scp.start()
        self.worker.start()
        self.dispatcher.start()
        self.ledger.listen(self._work_elsewhere)  # a shared ledger: other nodes' jobs wake us
        if self.web is not None:
            self.web.start()
        if self._unloaded is not None:  # once listening (a failed listen loads nothing)
            self._loader = threading.Thread(
                target=self._load_engine, name="segnode-engine-load", daemon=True
            )
            self._loader.start()
        nc = self.config.node
        log.info(
            "segnode listening as %s on %s:%d; engine %s, model %s %s; data in %s",
            nc.ae_title,
            nc.host,
            self.scp.port,
            self.config.model.engine,
            self.manifest.name,
            self.manifest.version,
            self.config.data_dir,
        )
        routing = self.config.routing
        log.info(
            "routing: %s; models: %s",
            f"{len(routing.rules)} rule(s), mode {routing.mode}"
            if routing.rules
            else "implicit default rule",
            ", ".join(f"{n} ({self.pool.label(n)})" for n in self.pool.specs),
        )
        self.notifier.send("READY=1", f"STATUS={self.status_line()}")

    def _load_engine(self) -> None:
        """Load the default model's engine while the node already listens; jobs start when
        it is ready. A failure stops the node with the reason (:meth:`run_forever` raises)."""
        engine, started = self._unloaded, time.monotonic()
        assert engine is not None
        try:
            engine.load(self.manifest)
        except Exception as exc:  # any failure of the backend: the node cannot segment
            why = str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
            self.failure = f"engine {self.config.model.engine} could not load model "
            self.failure += f"{self.manifest.name}: {why}"
            log.error("%s; stopping (received series stay queued)", self.failure)
            self.request_stop()
            return
        log.info(
            "engine %s ready for model %s %s after %.1f s; jobs start",
            self.config.model.engine,
            self.manifest.name,
            self.manifest.version,
            time.monotonic() - started,
        )
        self.worker.engine_ready.set()
        self.worker.wake.set()
        try:
            self.notifier.send(f"STATUS={self.status_line()}")
        except Exception as exc:  # informative only: the main loop sends it again
            log_failure(log, "the status line after loading failed", exc=exc)

    @property
    def engine_loading(self) -> bool:
        """Whether the default engine is still loading in the background."""
        return self._unloaded is not None and not self.worker.engine_ready.is_set()

    def status_line(self) -> str:
        """One line for systemd's STATUS= and ``segnode status``."""
        c = self.ledger.counts()
        jobs = c["jobs"]
        queued = jobs.get("queued", 0) + jobs.get("running", 0)
        loading = "; engine loading" if self.engine_loading else ""
        return (
            f"listening on {self.config.node.host}:{self.scp.port}{loading}; queue {queued}; "
            f"outbox {c['deliveries_pending']}; last: {self.worker.last_result}"
        )

    def run_forever(self) -> None:
        """Main loop: retention, status and watchdog, until :meth:`request_stop` (the
        quiet-period scan runs on the completion thread)."""
        tick = self._tick
        wd = self.notifier.watchdog_interval()
        # A ping every quarter of systemd's watchdog timeout, on a schedule of its own: the
        # wait is cut by the time the tick's work took (the lease, retention, the status
        # line's ledger counts, slow on a loaded disk), so the gap between two pings is that
        # work or the beat, whichever is longer, not their sum.
        beat = None if wd is None else wd / 2
        next_ping = time.monotonic()
        last_status = 0.0
        while True:
            wait = tick if beat is None else min(tick, max(0.0, next_ping - time.monotonic()))
            if self._stop.wait(wait):
                break
            if beat is not None and time.monotonic() >= next_ping:
                next_ping = time.monotonic() + beat
                if self.healthy():
                    self.notifier.send("WATCHDOG=1")
            gone = self.ledger.gone()
            if gone is not None:
                self.failure = (
                    f"{gone}: stopping, so that nothing more is acknowledged into it; start the "
                    "node again: it makes a new ledger and records again the instances in its "
                    "spool (the jobs' history is lost with the file)"
                )
                log.critical("%s", self.failure)
                break
            self._keep_lease()
            self.retention.maybe_run()
            if time.monotonic() - last_status > 5:
                last_status = time.monotonic()
                self.notifier.send(f"STATUS={self.status_line()}")
        self.shutdown()
        if self.failure is not None:
            raise SegnodeError(self.failure)

    def healthy(self) -> bool:
        """Whether the listener, completion, worker and outbox threads are alive (gates
        WATCHDOG=1).

        A dead thread stops the pings, so systemd's ``WatchdogSec=`` restarts the node.
        """
        alive = self.worker.alive() and self.dispatcher.is_alive()
        alive = alive and self.completion.alive
        return alive and self.scp.server is not None and self.scp.server.alive

    def request_stop(self, *_: Any) -> None:
        """Ask the main loop to stop (signal handler)."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop gracefully; SIGHUP (a closed terminal, or a reload asked
        of a service that has none) is logged and ignored, not the default sudden death."""

        def handler(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %d: stopping", signum)
            self.request_stop()

        def hangup(_signum: int, _frame: FrameType | None) -> None:
            log.warning(
                "SIGHUP ignored: segnode does not reload its configuration; restart it "
                "(systemctl restart segnode) to apply a change"
            )

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGHUP, hangup)

    def shutdown(self) -> None:
        """Stop accepting, let the association and job in flight finish, close the ledger."""
        self.notifier.send("STOPPING=1")
        if self.web is not None:
            self.web.stop()
        self.scp.stop()
        self.completion.stop()  # what the last associations' ends complete, then the thread
        self.worker.stop()
        self.dispatcher.stop()
        self.streaming.stop()
        if self.metrics is not None:
            self.metrics.stop()
        if self._loader is not None:  # a load in progress ends before its engine is closed
            self._loader.join()
        try:
            self.pool.close()  # every loaded engine, the default one included
        finally:
            try:
                self.ledger.leave()
            except SQLAlchemyError as exc:
                log.warning("could not record the stop in the ledger: %s", exc)
            self.ledger.close()
            self.audit.stopped()
            self.audit.stop()
            self.notifier.close()
            self.data_dir_lock.release()
        log.info("segnode stopped")
