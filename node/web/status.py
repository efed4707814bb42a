"""The live facts of a running node for ``/api/v1/status`` and ``/readyz``."""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any

from segnode.node import __version__
from segnode.node.ops.gpu import gpu_busy_percent
from segnode.node.web.facts import expected_wait, ledger_status

if TYPE_CHECKING:  # segnode.node.ops.service imports segnode.node.web lazily
    from segnode.node.ops.service import Node


def node_status(node: Node) -> dict[str, Any]:
    """Listening, engine and models, queue, outbox, disk, destinations and their breakers.

    The ledger's part (``ledger``) is what ``segnode status`` prints. Only AE titles,
    addresses, states and counts: no patient data.
    """
    cfg = node.config
    ledger = ledger_status(node.ledger, cfg.series.quiet_period_s)
    jobs = ledger["jobs"]
    try:
        usage = shutil.disk_usage(cfg.data_dir)
        disk: dict[str, Any] = {"free_bytes": usage.free, "total_bytes": usage.total}
    except OSError as exc:
        disk = {"error": str(exc)}
    disk["min_free_bytes"] = cfg.node.min_free_disk_mb * 2**20
    breakers = node.dispatcher.breakers
    destinations = []
    for dest in cfg.configured_destinations():
        name = dest.name
        blocked = breakers.blocked_for(name)
        state = "open" if breakers.is_open(name) else ("backing-off" if blocked > 0 else "closed")
        destinations.append({"name": name, "breaker": state, "blocked_for_s": round(blocked, 1)})
    nc = cfg.node
    return {
        "version": __version__,
        "listening": {
            "ae_title": nc.ae_title,
            "host": nc.host,
            "port": node.scp.port if node.scp.server is not None else None,
            "tls_port": node.scp.tls_port,
        },
        "healthy": node.healthy(),
        # [audit]: queued, sent, dropped; per audit repository connected, last error
        "audit": node.audit.status(),
        "engine": {
            "name": cfg.model.engine,
            "loading": node.engine_loading,
            "failure": node.failure,
            "model": {"name": node.manifest.name, "version": node.manifest.version},
            "models": {name: node.pool.label(name) for name in node.pool.specs},
        },
        "queue": {
            "depth": jobs.get("queued", 0) + jobs.get("running", 0),
            "queued": jobs.get("queued", 0),
            "running": jobs.get("running", 0),
            "current_job": node.worker.current_job,
            "last_result": node.worker.last_result,
            **worker_figures(node),
            "queued_by_priority": ledger["queued_by_priority"],
        },
        "outbox": {
            "pending": ledger["deliveries_pending"],
            "failed": ledger["deliveries_failed"],
        },
        "disk": disk,
        "destinations": destinations,
        "ledger": ledger,
        "node_name": node.ledger.node_name,
    }


def worker_figures(node: Node) -> dict[str, Any]:
    """The lanes, the jobs in progress and their stages, the share of the last minute the
    models were busy (and the GPU, where NVML reports it), the jobs waiting for the models by
    priority, the expected wait of a job queued now (the models' mean time per job times
    the jobs ahead of it, or the ledger's rate before the node has run a job), and the models'
    own processes (``[engine] model_process``: id and restarts) and the SEG encoder
    processes' (``[results] encode_processes``)."""
    worker = node.worker
    gate = worker.gate
    jobs = node.ledger.counts()
    mean = gate.mean_model_s()
    ahead = jobs["jobs"].get("queued", 0) + len(worker.running)
    if mean is not None:
        wait: float | None = round(ahead * mean, 1)
    else:
        wait = expected_wait(jobs)
    return {
        "lanes": worker.lanes,
        "model_slots": gate.slots,
        "in_model": gate.holders(),
        "in_progress": {str(job): stage for job, stage in sorted(worker.running.items())},
        "waiting_for_model": {str(p): n for p, n in sorted(gate.waiting().items())},
        "model_busy_pct": round(100 * gate.busy_fraction(), 1),
        "model_mean_s": None if mean is None else round(mean, 3),
        "gpu_busy_pct": gpu_busy_percent(),
        "expected_wait_s": wait,
        "model_processes": node.pool.model_processes(),
        "encode_processes": worker.encoders.figures() if worker.encoders is not None else [],
    }


def node_ready(node: Node) -> tuple[bool, str]:
    """Whether the node can take and finish jobs, and why not."""
    if node.failure is not None:
        return False, node.failure
    if node.engine_loading:
        return False, "engine loading"
    if not node.healthy():
        return False, "a node thread (listener, worker or outbox) is not running"
    return True, "ready"
