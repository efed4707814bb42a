"""The ledger's schema under Alembic on both databases, and a node on a real PostgreSQL ledger.

A throwaway cluster from Debian's ``postgresql`` package runs for the session
(tests/fixtures/postgres.py); each test gets an empty database.
"""

from __future__ import annotations

import io
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from pydicom import dcmread
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from segnode.storage.ledger import InstanceRecord, Ledger
from segnode.storage.migrations import HEAD, SchemaError, upgrade_database
from segnode.storage.models import Base
from tests.conftest import Orthanc, wait_for
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.test_interop import count_results, orthanc_results, storescu
from tests.test_outbox_bytes import load_v1_ledger


def _url(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    return str(request.getfixturevalue("pg_url"))


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_the_migrations_make_exactly_the_models_tables(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """``segnode db upgrade`` on an empty database gives the tables, columns, indexes and
    constraints of storage/models.py: no drift between the revisions and the code."""
    url = _url(kind, request, tmp_path)
    found = upgrade_database(url)
    assert found.empty
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
            version = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
            meta = conn.execute(
                text("SELECT value FROM meta WHERE key = 'schema_version'")
            ).scalar()
    finally:
        engine.dispose()
    assert diff == [], diff
    assert version == HEAD and int(str(meta)) == int(HEAD)
    # Running it again changes nothing.
    assert upgrade_database(url).alembic == HEAD


def test_a_ledger_from_before_alembic_is_stamped_then_upgraded(tmp_path: Path) -> None:
    """A schema version 1 SQLite ledger (no alembic_version) is stamped 0001, upgraded to the
    head revision when the node opens it, and keeps its rows."""
    path = load_v1_ledger(tmp_path / "data")
    Ledger(path).close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchone()[0] == HEAD
        assert conn.execute("SELECT count(*) FROM jobs").fetchone()[0] == 2


def test_a_shared_ledger_changes_only_by_db_upgrade(pg_url: str) -> None:
    """On PostgreSQL the node never migrates by itself: an empty or older database is refused
    with the command to run; after ``segnode db upgrade`` it opens; a revision this segnode
    does not know (a newer release) is refused, and so is ``upgrade``."""
    with pytest.raises(SchemaError, match="segnode db upgrade"):
        Ledger(url=pg_url)
    assert upgrade_database(pg_url).empty
    Ledger(url=pg_url).close()
    engine = create_engine(pg_url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    engine.dispose()
    with pytest.raises(SchemaError, match="unknown to this segnode"):
        Ledger(url=pg_url)
    with pytest.raises(SchemaError, match="unknown to this segnode"):
        upgrade_database(pg_url)


def test_concurrent_upgrades_make_the_schema_once(pg_url: str) -> None:
    """Four nodes running ``segnode db upgrade`` at once: one creates the schema (under the
    advisory lock), the others find it current."""
    results: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(upgrade_database(pg_url))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert sorted(r.empty for r in results) == [False, False, False, True]


def _rec(sop: str, series: str) -> InstanceRecord:
    return InstanceRecord(
        sop, "1.2.840.10008.5.1.4.1.1.2", series, "1.2.3", "1.2.840.10008.1.2.1", "CT", "CT1"
    )


def test_two_nodes_record_the_same_instances_once(pg_url: str, tmp_path: Path) -> None:
    """Two ledgers on one database (two nodes) record the same 200 instances of 4 series at
    once, on the hot path: each instance is stored once, and exactly one of the two calls
    reports it new."""
    upgrade_database(pg_url)
    nodes = [Ledger(url=pg_url), Ledger(url=pg_url)]
    new: list[list[str]] = [[], []]

    def record(i: int) -> None:
        for n in range(200):
            sop = f"1.2.3.{n}"
            if nodes[i].record_instance(_rec(sop, f"1.2.9.{n % 4}"), tmp_path / sop, 100):
                new[i].append(sop)

    threads = [threading.Thread(target=record, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    try:
        assert sorted(new[0] + new[1]) == sorted(f"1.2.3.{n}" for n in range(200))
        counts = nodes[0].counts()
        assert counts["instances"] == 200
        assert sorted(nodes[1].pending_series()) == [f"1.2.9.{k}" for k in range(4)]
        assert [nodes[0].series_totals(f"1.2.9.{k}") for k in range(4)] == [(50, 5000)] * 4
    finally:
        for led in nodes:
            led.close()


@pytest.mark.interop
def test_a_node_on_postgresql_segments_and_delivers_once(
    make_node: Any, orthanc: Orthanc, pg_url: str, tmp_path: Path
) -> None:
    """``segnode db upgrade``, then ``segnode serve`` with ``[ledger] url``: DCMTK sends a
    series, its SEG and SR reach Orthanc once, and ``segnode jobs`` reads the shared ledger."""
    node = make_node(
        start=False,
        ledger={"url": pg_url},
        dispatch={"destinations": [orthanc.peer], "retry_initial_s": 0.2},
    )
    refused = node.cli("status")
    assert refused.returncode == 1 and "segnode db upgrade" in refused.stderr, refused
    up = node.cli("db", "upgrade")
    assert up.returncode == 0 and f"now schema {HEAD}" in up.stdout, up
    assert "segnode" in up.stdout and "@" in up.stdout  # names the database, no password
    node.start()
    files = write_synthetic_series(
        tmp_path / "series",
        PhantomGeometry(rows=64, columns=64, slices=24),
        patient_id="PGE2E",
        seed=3,
    )
    r = storescu(node, files[0].parent)
    assert r.returncode == 0, r.stdout + r.stderr
    study = str(dcmread(files[0], stop_before_pixels=True).StudyInstanceUID)
    wait_for(lambda: count_results(orthanc, study) == (1, 1), 120, "SEG+SR in Orthanc")
    wait_for(lambda: node.jobs()["jobs"][0]["state"] == "sent", 30, "job sent")
    [job] = node.jobs()["jobs"]
    seg = dcmread(io.BytesIO(orthanc_results(orthanc, study)["SEG"][0]))
    assert str(seg.SOPInstanceUID) == job["seg_sop_uid"]
    assert job["instances"] == 24
    current = node.cli("db", "current")
    assert current.returncode == 0 and f"schema {HEAD}" in current.stdout


@pytest.mark.interop
def test_two_processes_cannot_run_as_one_node(make_node: Any, pg_url: str) -> None:
    """Two ``segnode serve`` with the same ``[ledger] node_name`` would each take the other's
    running jobs for its own: the second exits with the reason; once the first is killed with
    SIGKILL, the server drops its lock and the name is free."""
    first = make_node(start=False, ledger={"url": pg_url, "node_name": "ct-a"})
    assert first.cli("db", "upgrade").returncode == 0
    first.start()
    second = make_node(start=False, ledger={"url": pg_url, "node_name": "ct-a"})
    with pytest.raises(RuntimeError, match="node exited with code 1"):
        second.start(timeout=20)
    assert "a node named 'ct-a' is already running on it" in second.log(), second.log()
    other = make_node(start=False, ledger={"url": pg_url, "node_name": "ct-b"})
    other.start()  # another name shares the ledger
    first.kill()
    wait_for(lambda: _try_start(second), 30, "the name free after the holder was killed")


def _try_start(node: Any) -> bool:
    try:
        node.start(timeout=20)
    except RuntimeError:
        return False
    return True
