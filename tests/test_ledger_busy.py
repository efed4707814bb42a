"""A ledger that another process keeps locked: every C-STORE is answered 0xA700 within the
hot path's bound (``HOT_WAIT_S``), not after SQLite's 30 s, concurrent associations included,
and the node stores again once the lock goes."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydicom import dcmread

from segnode.storage.ledger import connection, instances
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.scp_harness import SCPHarness, store

WAIT_S = 1.0


@pytest.fixture
def h(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[SCPHarness]:
    monkeypatch.setattr(connection, "HOT_WAIT_S", WAIT_S)
    monkeypatch.setattr(instances, "HOT_WAIT_S", WAIT_S)
    harness = SCPHarness(tmp_path / "node")
    try:
        yield harness
    finally:
        harness.close()


@pytest.fixture
def series(tmp_path: Path) -> list[list[Path]]:
    """Two series of four slices."""
    return [
        write_synthetic_series(
            tmp_path / f"s{i}", PhantomGeometry(rows=32, columns=32, slices=4), seed=7400 + i
        )
        for i in range(2)
    ]


def _timed_stores(h: SCPHarness, paths: list[Path]) -> list[tuple[int, float]]:
    """C-STORE each path on its own association, all at once; (status, seconds) each."""
    out: list[tuple[int, float]] = [(-2, 0.0)] * len(paths)

    def one(i: int) -> None:
        a = h.assoc(timeout=30)
        t = time.monotonic()
        out[i] = (store(a, paths[i]), time.monotonic() - t)
        a.release()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(paths))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_locked_ledger_is_answered_promptly_and_recovers(
    h: SCPHarness, series: list[list[Path]]
) -> None:
    known, new = series
    a = h.assoc()
    assert store(a, known[0]) == 0  # the series' row exists: its next instances take the hot path
    a.release()
    other = sqlite3.connect(h.config.data_dir / "ledger.sqlite", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    try:
        # Three instances of the known series and the first of a new one, at once.
        answers = _timed_stores(h, [*known[1:], new[0]])
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert [status for status, _ in answers] == [0xA700] * 4, answers
    # Each waits at most the lock and then SQLite's busy wait: never SQLite's usual 30 s.
    assert max(seconds for _, seconds in answers) < 2 * WAIT_S + 1.5, answers
    assert h.ledger.counts()["instances"] == 1
    assert not list(h.spool.root.rglob(f"{dcmread(new[0]).SOPInstanceUID}.dcm"))
    # The lock is gone: the resends are stored.
    assert [status for status, _ in _timed_stores(h, [*known[1:], new[0]])] == [0] * 4
    assert h.ledger.counts()["instances"] == 5
