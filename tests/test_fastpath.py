"""The fast path end to end (``segnode serve`` subprocess, DCMTK storescu as the modality):
per-sender completion policies, a series split over two associations, a late instance that
reopens a series, priority scheduling, delivery acknowledgement times and the Prometheus
endpoint scraped over loopback."""

from __future__ import annotations

import contextlib
import sqlite3
import urllib.request
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LOOPBACK, NodeProcess, Orthanc, free_port, wait_for
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.test_interop import storescu

pytestmark = pytest.mark.interop

SENDERS = """
[[series.senders]]
ae_title = "SPLITTER"
completion = "geometry"

[[series.senders]]
ae_title = "TIMER"
completion = "quiet"

[[series.senders]]
ae_title = "URGENT"
priority = 10
"""


def start_with_senders(make_node: Any, **sections: dict[str, Any]) -> NodeProcess:
    """A node whose config also has the ``[[series.senders]]`` tables above."""
    node: NodeProcess = make_node(start=False, **sections)
    with node.config_path.open("a") as f:
        f.write(SENDERS)
    node.start()
    return node


def jobs_of(node: NodeProcess) -> list[dict[str, Any]]:
    return sorted(node.jobs()["jobs"], key=lambda j: j["id"])


def jobs_started(node: NodeProcess) -> int:
    """Jobs with a start time, read from the ledger file (read-only, no CLI process)."""
    db = node.data_dir / "ledger.sqlite"
    if not db.exists():
        return 0
    with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)) as c:
        row = c.execute("SELECT count(*) FROM jobs WHERE started_at IS NOT NULL").fetchone()
    return int(row[0])


def ts(job: dict[str, Any], stage: str) -> datetime:
    return datetime.fromisoformat(job["stages"][stage])


def test_completion_policies_split_series_and_late_instance(make_node: Any, tmp_path: Path) -> None:
    node = start_with_senders(make_node, series={"quiet_period_s": 4.0})
    # A sender that splits one series over two associations: geometry completes it.
    split = write_synthetic_series(
        tmp_path / "split",
        PhantomGeometry(rows=32, columns=32, slices=12),
        seed=61,
        images_in_acquisition=True,
    )
    assert storescu(node, *split[:6], calling="SPLITTER").returncode == 0
    wait_for(lambda: "association released; 0 series complete" in node.log(), 10, "release")
    assert storescu(node, *split[6:], calling="SPLITTER").returncode == 0
    wait_for(lambda: [j["state"] for j in jobs_of(node)] == ["done"], 60, "split series done")
    (job,) = jobs_of(node)
    assert job["trigger"] == "geometry" and job["instances"] == 12  # not at the release

    # The default policy: released before the last slice arrives, then a late instance.
    late = write_synthetic_series(
        tmp_path / "late", PhantomGeometry(rows=32, columns=32, slices=9), seed=62
    )
    assert storescu(node, *late[:8]).returncode == 0
    wait_for(lambda: len(jobs_of(node)) == 2 and jobs_of(node)[1]["state"] == "done", 60, "v1")
    assert storescu(node, late[8]).returncode == 0
    wait_for(lambda: len(jobs_of(node)) == 3 and jobs_of(node)[2]["state"] == "done", 60, "v2")
    v1, v2 = jobs_of(node)[1:]
    assert (v1["version"], v1["instances"]) == (1, 8)
    # One instance on its association: the node waits the sender's gap before completing.
    assert (v2["version"], v2["instances"], v2["trigger"]) == (2, 9, "sender-gap")
    assert v1["superseded_by"] == v2["id"] and v2["superseded_by"] is None
    assert f"results superseded by job {v2['id']}" in node.cli("jobs").stdout

    # A sender on the quiet-period policy: neither release nor geometry count.
    quiet = write_synthetic_series(
        tmp_path / "quiet",
        PhantomGeometry(rows=32, columns=32, slices=6),
        seed=63,
        images_in_acquisition=True,
    )
    assert storescu(node, tmp_path / "quiet", calling="TIMER").returncode == 0
    wait_for(lambda: len(jobs_of(node)) == 4, 30, "quiet-period job")
    assert jobs_of(node)[3]["trigger"] == "quiet-period"
    assert len(quiet) == jobs_of(node)[3]["instances"]
    assert "volume prebuilt while the series arrived" in node.log()


def test_urgent_series_waits_only_for_the_job_in_progress(make_node: Any, tmp_path: Path) -> None:
    node = start_with_senders(make_node)
    routine = tmp_path / "routine"
    # A backlog that outlasts the CLI polls below (each routine job takes about 0.3 s now).
    for k in range(6):
        write_synthetic_series(
            routine / str(k), PhantomGeometry(rows=512, columns=512, slices=48), seed=70 + k
        )
    urgent = write_synthetic_series(
        tmp_path / "urgent", PhantomGeometry(rows=32, columns=32, slices=6), seed=95
    )
    # One association delivers the routine backlog: six jobs queued at its release.
    assert storescu(node, routine, calling="ROUTINE").returncode == 0
    # Read the ledger directly: a `segnode jobs` poll takes seconds under load, long enough
    # for the backlog to drain before the urgent series is sent.
    wait_for(lambda: jobs_started(node) > 0, 30, "first job started")
    assert storescu(node, *urgent, calling="URGENT").returncode == 0
    wait_for(lambda: [j["state"] for j in jobs_of(node)] == ["done"] * 7, 120, "all jobs done")
    jobs = jobs_of(node)
    (hot,) = [j for j in jobs if j["priority"] == 10]
    cold = [j for j in jobs if j["priority"] == 0]
    waiting = [j for j in cold if ts(j, "started") > ts(hot, "queued")]
    assert waiting, "no routine backlog when the urgent series arrived; test is vacuous"
    for j in waiting:  # every routine job not yet started when the urgent one was queued
        assert ts(j, "started") >= ts(hot, "finished"), (j["id"], hot["id"])
    running = [j for j in cold if ts(j, "started") <= ts(hot, "queued")]
    # It started as soon as the job in progress when it was queued had finished.
    assert ts(hot, "started") <= max(ts(j, "finished") for j in running) + timedelta(seconds=0.5)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_metrics_endpoint_and_delivery_ack_times(
    make_node: Any, orthanc: Orthanc, tmp_path: Path
) -> None:
    port = free_port()
    node = make_node(
        metrics={"enabled": True, "host": LOOPBACK, "port": port},
        dispatch={"destinations": [orthanc.peer]},
    )
    files = write_synthetic_series(
        tmp_path / "s",
        PhantomGeometry(rows=64, columns=64, slices=10),
        seed=64,
        images_in_acquisition=True,
    )
    size = sum(f.stat().st_size for f in files)
    assert storescu(node, tmp_path / "s").returncode == 0
    wait_for(lambda: jobs_of(node) and jobs_of(node)[0]["state"] == "sent", 60, "job sent")
    (job,) = jobs_of(node)
    assert job["trigger"] in ("geometry", "association-release")
    acks = [d["acked_at"] for d in job["deliveries"]]
    assert len(acks) == 2 and all(acks)
    assert "SEG -> ORTHANC" in node.cli("jobs").stdout and "acked +" in node.cli("jobs").stdout
    m = scrape(port)
    assert m["segnode_instances_received_total"] == 10
    assert abs(m["segnode_received_bytes_total"] - size) < 0.01 * size  # file meta re-encoded
    assert m['segnode_jobs{state="sent"}'] == 1
    assert 0 < m["segnode_model_busy_ratio"] <= 1 and m["segnode_jobs_in_progress"] == 0
    assert m["segnode_jobs_waiting_for_model"] == 0 and m["segnode_jobs_in_model"] == 0
    for stage in ("completion", "queue", "volume", "inference", "encode", "total"):
        assert m[f'segnode_stage_seconds_count{{stage="{stage}"}}'] == 1, stage
    assert m['segnode_stage_seconds_count{stage="delivery"}'] == 2
    assert m['segnode_series_completed_total{trigger="' + job["trigger"] + '"}'] == 1
    assert scrape(port)['segnode_stage_seconds_count{stage="inference"}'] == 1  # observed once
