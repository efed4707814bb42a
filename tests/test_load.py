"""Load, reduced: 4 concurrent DCMTK storescu associations x 25 instances, zero failures.

``python -m bench.load`` is the full run (8 x 200 slices of 512 x 512).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.load import run_load
from tests.conftest import require_tool

pytestmark = pytest.mark.interop


def test_concurrent_associations_zero_failures(tmp_path: Path) -> None:
    require_tool("storescu")
    report = run_load(tmp_path, associations=4, instances=25, rows=64, wait_jobs=False)
    print(report.summary())
    assert report.storescu_errors == []
    assert report.failures == 0 and report.missing_in_ledger == 0
    assert report.peak_rss_ingest_mb > 0
