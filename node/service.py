"""The running node: SCP, completion, worker and outbox wired together around the ledger."""

from __future__ import annotations

import logging
import signal
import threading
import time
from datetime import timedelta
from types import FrameType
from typing import Any

from engines.base import Engine, create_engine
from engines.manifest import ModelManifest, load_manifest
from node.config import Config
from node.notify import Notifier
from node.scp import StoreSCP
from node.scu import Dispatcher
from node.series import CompletionTracker
from node.worker import Worker
from storage.ledger import Ledger, utcnow
from storage.spool import Spool

log = logging.getLogger(__name__)


def engine_options(config: Config) -> dict[str, Any]:
    """Backend constructor options from ``[model]``."""
    m = config.model
    if m.engine == "onnxruntime":
        return {"threads": m.threads or None}
    if m.engine == "tensorrt":
        return {"cache_dir": config.data_dir / "engines", "precision": m.precision}
    if m.engine == "torch":
        return {"precision": m.precision}
    return {}


def open_state(config: Config) -> tuple[Ledger, Spool]:
    """Open (creating with private permissions) the ledger and spool under the data dir."""
    config.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Ledger(config.data_dir / "ledger.sqlite"), Spool(config.data_dir / "spool")


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
        self.ledger, self.spool = open_state(config)
        self.manifest: ModelManifest = load_manifest(config.model.manifest)
        if engine is None:
            engine = create_engine(config.model.engine, **engine_options(config))
            engine.load(self.manifest)
        self.engine = engine
        self.tracker = CompletionTracker(
            self._series_complete, complete_on_release=config.series.complete_on_release
        )
        self.scp = StoreSCP(config, self.ledger, self.spool, self.tracker)
        self.worker = Worker(config, self.ledger, engine, self.manifest)
        self.dispatcher = Dispatcher(config, self.ledger)
        self.notifier = Notifier()
        self._stop = threading.Event()
        self._create_lock = threading.Lock()

    def _series_complete(self, series_uid: str, trigger: str) -> None:
        with self._create_lock:
            job_id = self.ledger.create_job(
                series_uid,
                trigger=trigger,
                model=f"{self.manifest.name} {self.manifest.version}",
                engine=self.config.model.engine,
            )
        if job_id is not None:
            log.info("job %d queued (trigger: %s)", job_id, trigger)
            self.worker.wake.set()

    def check_quiet(self) -> None:
        """Fallback: complete pending series that have been quiet for the configured period."""
        quiet = timedelta(seconds=self.config.series.quiet_period_s)
        for uid in self.ledger.pending_series(quiet_before=utcnow() - quiet):
            if not self.tracker.busy(uid):
                self._series_complete(uid, "quiet-period")

    def start(self) -> None:
        """Recover interrupted work, then start listening and working."""
        n = self.ledger.recover(self.config.job_max_attempts)
        if n:
            log.info("resuming %d job(s) interrupted by a restart", n)
        self.scp.start()
        self.worker.start()
        self.dispatcher.start()
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
        self.notifier.send("READY=1", f"STATUS={self.status_line()}")

    def status_line(self) -> str:
        """One line for systemd's STATUS= and ``segnode status``."""
        c = self.ledger.counts()
        jobs = c["jobs"]
        queued = jobs.get("queued", 0) + jobs.get("running", 0)
        return (
            f"listening on {self.config.node.host}:{self.scp.port}; queue {queued}; "
            f"outbox {c['deliveries_pending']}; last: {self.worker.last_result}"
        )

    def run_forever(self) -> None:
        """Main loop: quiet-period scan, status and watchdog, until :meth:`request_stop`."""
        tick = min(1.0, max(0.05, self.config.series.quiet_period_s / 4))
        wd = self.notifier.watchdog_interval()
        last_status = 0.0
        while not self._stop.wait(tick if wd is None else min(tick, wd)):
            try:
                self.check_quiet()
            except Exception:
                log.exception("quiet-period scan failed")
            if wd is not None:
                self.notifier.send("WATCHDOG=1")
            if time.monotonic() - last_status > 5:
                last_status = time.monotonic()
                self.notifier.send(f"STATUS={self.status_line()}")
        self.shutdown()

    def request_stop(self, *_: Any) -> None:
        """Ask the main loop to stop (signal handler)."""
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop gracefully."""

        def handler(signum: int, _frame: FrameType | None) -> None:
            log.info("signal %d: stopping", signum)
            self.request_stop()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def shutdown(self) -> None:
        """Stop accepting, let the association and job in flight finish, close the ledger."""
        self.notifier.send("STOPPING=1")
        self.scp.stop()
        self.worker.stop()
        self.dispatcher.stop()
        try:
            self.engine.close()
        finally:
            self.ledger.close()
            self.notifier.close()
        log.info("segnode stopped")
