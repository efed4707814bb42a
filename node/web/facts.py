"""The facts about jobs and the node as JSON-ready dictionaries.

One builder per fact, shared by the command line (``segnode jobs --json``, ``segnode
status``) and the HTTP API (:mod:`segnode.node.web.app`), so that both say the same thing. Only
UIDs, AE titles, states, times and reasons: no patient names or IDs.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from segnode.node.ingest.senders import load_patterns
from segnode.storage.ledger import JobState, JobView, Ledger
from segnode.storage.models import Job

#: Job states, for the API's ``state`` filter.
JOB_STATES = tuple(s.value for s in JobState)


def send_seconds(start: datetime | None, ack: datetime | None) -> float | None:
    """Seconds from the start of a delivery's last attempt to its acknowledgement."""
    if start is None or ack is None or ack < start:
        return None
    return round((ack - start).total_seconds(), 4)


def _iso(t: datetime | None) -> str | None:
    return t.isoformat() if t else None


def job_facts(j: JobView) -> dict[str, Any]:
    """One job as ``segnode jobs --json`` prints it (times are naive UTC, ISO 8601)."""
    n = len(j.deliveries)
    return {
        "id": j.id,
        "state": j.state,
        "version": j.version,
        "series": j.series_instance_uid,
        "instances": j.instance_count,
        "trigger": j.trigger,
        "model": j.model,
        "model_name": j.model_name,
        "rule": j.rule,
        "destinations": list(j.destinations),
        "reason": j.reason,
        "attempts": j.attempts,
        "stages": {k: _iso(v) for k, v in j.stages.items()},
        "seg_sop_uid": j.seg_sop_uid,
        "sr_sop_uid": j.sr_sop_uid,
        "deliveries": [
            {
                "kind": k,
                "destination": d,
                "status": s,
                "attempts": a,
                "last_error": e,
                "sending_at": _iso(t0),
                "acked_at": _iso(t),
                "send_s": send_seconds(t0, t) if s == "sent" else None,
            }
            for (k, d, s, a), e, t0, t in zip(
                j.deliveries,
                j.delivery_errors or (None,) * n,
                j.delivery_starts or (None,) * n,
                j.delivery_acks or (None,) * n,
                strict=False,
            )
        ],
        "priority": j.priority,
        "superseded_by": j.superseded_by,
        "node": j.owner,
    }


def ignored_facts(ledger: Ledger, limit: int) -> list[dict[str, Any]]:
    """Series accepted but not processed, with the reason (most recent first)."""
    return [
        {"series": s, "calling_ae": ae, "reason": r} for s, ae, r in ledger.ignored_series(limit)
    ]


def waiting_facts(ledger: Ledger, limit: int) -> list[dict[str, Any]]:
    """Series with instances and no job yet (waiting for more instances, or held)."""
    return [
        {"series": s, "instances": n, "held": r or None, "pending_since": t.isoformat()}
        for s, n, r, t in ledger.held_series(limit)
    ]


def jobs_facts(ledger: Ledger, limit: int) -> dict[str, Any]:
    """``segnode jobs --json``: the ``limit`` most recent jobs, ignored and waiting series."""
    return {
        "jobs": [job_facts(j) for j in ledger.jobs(limit)],
        "ignored": ignored_facts(ledger, limit),
        "waiting": waiting_facts(ledger, limit),
    }


def job_page(
    ledger: Ledger, *, limit: int, offset: int = 0, state: str | None = None
) -> dict[str, Any]:
    """One page of jobs, most recent first, optionally of one state (the API's job list).

    Parameters
    ----------
    ledger
        The node's ledger.
    limit, offset
        Page size and how many of the most recent (matching) jobs to skip.
    state
        Only jobs in this state (one of :data:`JOB_STATES`); all when None.

    Returns
    -------
    dict
        ``{"jobs": [...], "total": n, "offset": offset, "limit": limit, "state": state}``,
        each job as :func:`job_facts` builds it.
    """
    query = select(Job.id)
    total = select(func.count(Job.id))
    if state is not None:
        query = query.where(Job.state == state)
        total = total.where(Job.state == state)
    with Session(ledger.engine) as s:
        ids = list(s.scalars(query.order_by(Job.id.desc()).limit(limit).offset(offset)))
        count = int(s.scalar(total) or 0)
    jobs = [job_facts(v) for v in (ledger.job(i) for i in ids) if v is not None]
    return {"jobs": jobs, "total": count, "offset": offset, "limit": limit, "state": state}


def ledger_status(ledger: Ledger, quiet_period_s: float) -> dict[str, Any]:
    """The ledger's counts and the learnt sender patterns (``segnode status``, without
    ``data_dir``); a hold waits at most ``quiet_period_s`` (``series.quiet_period_s``)."""
    counts = ledger.counts()
    learnt = {
        p.calling_ae: {
            "pattern": p.describe(),
            "associations": p.associations,
            "instances": p.instances,
            "splits_series": p.splits_series,
            "gap_ms": None if p.gap_s is None else round(p.gap_s * 1000, 1),
            "wait_after_release_s": round(p.wait_s(quiet_period_s), 2) if p.splits_series else 0.0,
        }
        for p in load_patterns(ledger)
    }
    nodes = [
        {
            "name": n.name,
            "address": n.address,
            "alive": n.alive,
            "running_jobs": n.running_jobs,
            "started_at": _iso(n.started_at),
            "heartbeat_at": _iso(n.heartbeat_at),
            "stopped_at": _iso(n.stopped_at),
        }
        for n in ledger.nodes()
    ]
    return {**counts, "expected_wait_s": expected_wait(counts), "senders": learnt, "nodes": nodes}


def expected_wait(counts: dict[str, Any]) -> float | None:
    """Seconds a job queued now would wait before its results are encoded, from the jobs
    ahead of it (queued and running) and the rate jobs were encoded at in the last 10 minutes
    (None without a job encoded then: no rate to go by)."""
    done = counts.get("encoded_last_10_min", 0)
    if not done:
        return None
    jobs = counts.get("jobs", {})
    ahead = jobs.get("queued", 0) + jobs.get("running", 0)
    return round(float(ahead) * 600.0 / float(done), 1)
