"""Three ``segnode serve`` processes on one PostgreSQL ledger and one shared folder, with
DCMTK senders, Orthanc and a counting Storage SCP (scripts/multinode.py, whose ``kill`` mode
runs the ten-trial version of the second test)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from scripts.multinode import kill_trial, throughput
from tests.conftest import require_tool

pytestmark = pytest.mark.interop


def _args(**kw: Any) -> argparse.Namespace:
    defaults = {
        "nodes": [3],
        "series": 12,
        "runs": 1,
        "lease_s": 3.0,
        "seed": 7,
        "engine": "onnxruntime",
        "ledger": "postgresql",
    }
    return argparse.Namespace(**{**defaults, **kw})


def test_three_nodes_segment_every_series_once(postgres_cluster: Any, tmp_path: Path) -> None:
    """Three senders, one per node, 12 series in all: every series has one job, ``sent``,
    and Orthanc holds exactly its one SEG and one SR, with the UIDs the ledger allocated;
    the jobs are spread over the nodes."""
    require_tool("storescu")
    [run] = throughput(_args(), postgres_cluster, tmp_path)
    assert run["problems"] == [], run
    assert sum(run["jobs_by_node"].values()) == 12
    assert len(run["jobs_by_node"]) >= 2, run["jobs_by_node"]


def test_a_killed_nodes_jobs_finish_on_another_node_once(
    postgres_cluster: Any, tmp_path: Path
) -> None:
    """SIGKILL of one node while it runs a job or holds deliveries: after its lease (3 s)
    another node finishes its work; every series ends ``sent`` with one job, and the SCP
    received exactly the ledger's SEG and SR UIDs."""
    require_tool("storescu")
    result = kill_trial(_args(), postgres_cluster, tmp_path, 0)
    assert result["problems"] == [], result
    assert result["killed_running_jobs"] + result["killed_claimed_deliveries"] >= 1
    # Not before the lease: 3 s after the last heartbeat, which is at most 0.75 s old.
    assert all(t >= 2.2 for t in result["taken_over_finished_after_kill_s"]), result
