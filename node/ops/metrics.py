"""Prometheus metrics: per-stage latency histograms and ingest counters (``[metrics]``).

Off by default. When enabled, an HTTP endpoint on ``metrics.host:metrics.port`` (loopback by
default) serves the Prometheus text format at ``/metrics``. Everything lives in one
:class:`Metrics` object with its own registry (no process-wide state).

Stage durations come from the ledger, not from timers in the pipeline, so they are exactly the
figures ``segnode jobs`` prints: at each scrape, jobs that finished since the previous scrape
are read once and their stage intervals observed in ``segnode_stage_seconds{stage=...}``:

========== ===================================================
receive    first instance -> last instance
completion last instance -> job queued (series complete)
queue      queued -> started by the worker
volume     started -> volume ready
inference  volume ready -> inference done
encode     inference done -> SEG and SR encoded
delivery   encoded -> each delivery acknowledged (per object and destination)
total      last instance -> job finished
========== ===================================================
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from datetime import datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from segnode.storage.ledger import JobView, Ledger, utcnow

log = logging.getLogger(__name__)

#: (stage, from, to) over :attr:`segnode.storage.ledger.JobView.stages` keys.
STAGES = (
    ("receive", "first_instance", "last_instance"),
    ("completion", "last_instance", "queued"),
    ("queue", "queued", "started"),
    ("volume", "started", "volume"),
    ("inference", "volume", "inference"),
    ("encode", "inference", "encoded"),
    ("total", "last_instance", "finished"),
)
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The node's metrics.

    Parameters
    ----------
    ledger
        Source of job stage timestamps and job counts.
    gauges
        Extra ``name -> callable`` gauges read at scrape time (e.g. streaming memory).
    """

    def __init__(self, ledger: Ledger, gauges: dict[str, Any] | None = None) -> None:
        self.ledger = ledger
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self._since: datetime = utcnow()
        self._gauges = dict(gauges or {})
        # Registered first: brings the histograms up to date before they are collected.
        self.registry.register(_LedgerCollector(self))
        self.instances = Counter(
            "segnode_instances_received", "CT instances stored", registry=self.registry
        )
        self.bytes = Counter(
            "segnode_received_bytes", "Bytes of CT instances stored", registry=self.registry
        )
        self.series_completed = Counter(
            "segnode_series_completed",
            "Series that became jobs, by completion signal",
            ["trigger"],
            registry=self.registry,
        )
        self.jobs_finished = Counter(
            "segnode_jobs_finished",
            "Jobs that finished, by end state",
            ["state"],
            registry=self.registry,
        )
        self.stage = Histogram(
            "segnode_stage_seconds",
            "Duration of each job stage (from the ledger's timestamps)",
            ["stage"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- feeding -----------------------------------------------------------------------------

    def instance_stored(self, size: int) -> None:
        """One CT instance of ``size`` bytes was stored."""
        self.instances.inc()
        self.bytes.inc(size)

    def series_complete(self, trigger: str) -> None:
        """A series became a job."""
        self.series_completed.labels(trigger=trigger).inc()

    def observe_job(self, job: JobView) -> None:
        """Observe the stage intervals of one finished job."""
        st = job.stages
        for name, a, b in STAGES:
            t0, t1 = st.get(a), st.get(b)
            if t0 is not None and t1 is not None and t1 >= t0:
                self.stage.labels(stage=name).observe((t1 - t0).total_seconds())
        encoded = st.get("encoded")
        for ack in job.delivery_acks:
            if encoded is not None and ack is not None and ack >= encoded:
                self.stage.labels(stage="delivery").observe((ack - encoded).total_seconds())
        self.jobs_finished.labels(state=job.state).inc()

    def refresh(self) -> None:
        """Observe jobs that finished since the last refresh (called at each scrape)."""
        with self._lock:
            for job in self.ledger.jobs_finished_since(self._since):
                self.observe_job(job)
                finished = job.stages.get("finished")
                if finished is not None and finished > self._since:
                    self._since = finished

    # -- serving -----------------------------------------------------------------------------

    def start(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: any free port); return the bound port."""
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        bound = int(self._server.server_address[1])
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def stop(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


class _LedgerCollector(Collector):
    """Scrape-time figures: job counts by state, outbox, pending series, extra gauges."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        try:
            self.metrics.refresh()
            counts = self.metrics.ledger.counts()
        except Exception:  # a scrape must not fail because the ledger is busy
            log.exception("metrics: reading the ledger failed")
            return
        jobs = GaugeMetricFamily("segnode_jobs", "Jobs in the ledger by state", labels=["state"])
        for state, n in sorted(counts["jobs"].items()):
            jobs.add_metric([state], n)
        yield jobs
        yield GaugeMetricFamily(
            "segnode_series_pending", "Series received, not yet a job", counts["series_pending"]
        )
        yield GaugeMetricFamily(
            "segnode_deliveries_pending", "Outbox rows waiting", counts["deliveries_pending"]
        )
        for name, fn in self.metrics._gauges.items():
            yield GaugeMetricFamily(name, name.replace("_", " "), float(fn()))
