"""Prometheus metrics: per-stage latency histograms and ingest counters (``[metrics]``).

Off by default. When enabled, an HTTP endpoint on ``metrics.host:metrics.port`` (loopback by
default) serves the Prometheus text format at ``/metrics``. Everything lives in one
:class:`Metrics` object with its own registry (no process-wide state).

Stage durations come from the ledger, not from timers in the pipeline, so they are exactly the
figures ``segnode jobs`` prints: at each scrape, jobs that finished since the previous scrape
are read once and their stage intervals observed in ``segnode_stage_seconds{stage=...}``
(a job that finishes again after a retry adds only the intervals it ran again, while
``segnode_jobs_finished_total`` counts each finish by its end state):

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
from collections import OrderedDict
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
#: How many recent jobs' observed intervals are remembered (a retry comes within days).
OBSERVED_JOBS = 10_000
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
        #: The intervals already observed per job (the most recent jobs): a job that finishes
        #: again (failed, then retried and sent) adds only what it did since.
        self._observed: OrderedDict[int, set[tuple[str, datetime, datetime]]] = OrderedDict()

    # -- feeding -----------------------------------------------------------------------------

    def instance_stored(self, size: int) -> None:
        """One CT instance of ``size`` bytes was stored."""
        self.instances.inc()
        self.bytes.inc(size)

    def series_complete(self, trigger: str) -> None:
        """A series became a job."""
        self.series_completed.labels(trigger=trigger).inc()

    def observe_job(self, job: JobView) -> None:
        """Observe the stage intervals of one finished job (each interval once: a retried job's
        inference is not counted again when only its delivery was redone)."""
        st = job.stages
        intervals = [(name, st.get(a), st.get(b)) for name, a, b in STAGES]
        intervals += [("delivery", st.get("encoded"), ack) for ack in job.delivery_acks]
        seen = self._observed.pop(job.id, set())
        self._observed[job.id] = seen
        while len(self._observed) > OBSERVED_JOBS:
            self._observed.popitem(last=False)
        for name, t0, t1 in intervals:
            if t0 is None or t1 is None or t1 < t0 or (name, t0, t1) in seen:
                continue
            seen.add((name, t0, t1))
            self.stage.labels(stage=name).observe((t1 - t0).total_seconds())
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
        queued = GaugeMetricFamily(
            "segnode_jobs_queued", "Queued jobs by priority", labels=["priority"]
        )
        for priority, n in counts["queued_by_priority"].items():
            queued.add_metric([priority], n)
        yield queued
        yield GaugeMetricFamily(
            "segnode_series_pending", "Series received, not yet a job", counts["series_pending"]
        )
        yield GaugeMetricFamily(
            "segnode_deliveries_pending", "Outbox rows waiting", counts["deliveries_pending"]
        )
        for name, fn in self.metrics._gauges.items():
            yield GaugeMetricFamily(name, name.replace("_", " "), float(fn()))
