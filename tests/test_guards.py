"""Resource guards and access control of the SCP, and retention, on real loopback sockets."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from pydicom import dcmread

from segnode.node.config import NodeConfig, PeerRule, from_dict
from segnode.node.dicom.guards import AccessPolicy, DiskGuard, SeriesBudget
from segnode.node.ops.retention import Retention
from segnode.storage.ledger import InstanceRecord, Ledger
from segnode.storage.spool import Spool
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series
from tests.scp_harness import SCPHarness, store
from tests.test_outbox import encoded_job, one_instance


@pytest.fixture(scope="module")
def series(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_synthetic_series(
        tmp_path_factory.mktemp("guards"),
        PhantomGeometry(rows=128, columns=128, slices=6),
        seed=401,
    )


def test_disk_floor_refuses_associations_and_stores(tmp_path: Path, series: list[Path]) -> None:
    h = SCPHarness(tmp_path / "n", {"node": {"min_free_disk_mb": 1}})
    try:
        a = h.assoc()
        assert a.is_established
        assert store(a, series[0]) == 0
        # The disk "fills" while the association is open: C-STORE answers 0xA700.
        h.scp.disk.min_free = 1 << 62
        h.scp.disk.ttl = 0
        assert store(a, series[1]) == 0xA700
        a.release()
        # New associations are rejected as transient congestion (PS3.8 9.3.4).
        b = h.assoc()
        assert b.is_rejected
        assert (b.acceptor.primitive.result, b.acceptor.primitive.result_source) == (2, 3)
        assert b.acceptor.primitive.diagnostic == 1
        h.scp.disk.min_free = 1
        c = h.assoc()
        assert c.is_established and store(c, series[1]) == 0
        c.release()
        assert h.ledger.counts()["instances"] == 2
    finally:
        h.close()


def test_series_instance_and_byte_limits(tmp_path: Path, series: list[Path]) -> None:
    h = SCPHarness(tmp_path / "n", {"node": {"max_series_instances": 3}})
    try:
        a = h.assoc()
        assert [store(a, p) for p in series[:5]] == [0, 0, 0, 0xA700, 0xA700]
        assert store(a, series[0]) == 0  # a duplicate costs nothing
        a.release()
    finally:
        h.close()
    # 128x128x2 bytes per slice = 32 KiB; 1 MB allows 31 slices; use a bigger series.
    big = write_synthetic_series(
        tmp_path / "big", PhantomGeometry(rows=512, columns=512, slices=3), seed=402
    )
    h = SCPHarness(tmp_path / "m", {"node": {"max_series_mb": 1}})
    try:
        a = h.assoc()
        assert [store(a, p) for p in big] == [0, 0xA700, 0xA700]  # 512 KiB each
        a.release()
        # The limit counts what is already in the ledger (e.g. from before a restart).
        h.scp.budget._totals.clear()
        b = h.assoc()
        assert store(b, big[1]) == 0xA700
        b.release()
    finally:
        h.close()


def test_max_associations_rejects_the_extra_one(tmp_path: Path) -> None:
    h = SCPHarness(tmp_path / "n", {"node": {"max_associations": 2}})
    try:
        a, b = h.assoc(), h.assoc()
        assert a.is_established and b.is_established
        c = h.assoc()
        assert c.is_rejected
        a.release()
        b.release()
    finally:
        h.close()


def test_access_policy_hosts_networks_and_names() -> None:
    p = AccessPolicy(
        NodeConfig(
            allowed_calling_aes=("ANYWHERE",),
            peers=(
                PeerRule("CT1", "127.0.0.1"),
                PeerRule("CT2", "10.0.0.0/8"),
                PeerRule("CT3", "localhost"),
                PeerRule("CT4", None),
                PeerRule("CT5", "no-such-host.invalid"),
            ),
        )
    )
    assert p.allows("ANYWHERE", "192.0.2.7")
    assert p.allows("CT1", "127.0.0.1") and not p.allows("CT1", "127.0.0.2")
    assert p.allows("CT2", "10.20.30.40") and not p.allows("CT2", "11.0.0.1")
    assert p.allows("CT3", "127.0.0.1")
    assert p.allows("CT4", "203.0.113.9")
    assert not p.allows("CT5", "127.0.0.1")
    assert not p.allows("STRANGER", "127.0.0.1")
    assert p.allows("CT1", "::ffff:127.0.0.1")  # IPv4-mapped IPv6
    assert AccessPolicy(NodeConfig()).allows("WHOEVER", "192.0.2.1")


def test_peer_host_binding_on_the_wire(tmp_path: Path, series: list[Path]) -> None:
    raw = {
        "node": {
            "peers": [
                {"ae_title": "CT_LOCAL", "host": "127.0.0.0/8"},
                {"ae_title": "CT_REMOTE", "host": "192.0.2.10"},
            ]
        }
    }
    h = SCPHarness(tmp_path / "n", raw)
    try:
        ok = h.assoc("CT_LOCAL")
        assert ok.is_established and store(ok, series[0]) == 0
        ok.release()
        for calling in ("CT_REMOTE", "STRANGER"):
            r = h.assoc(calling)
            assert r.is_rejected, calling
            prim = r.acceptor.primitive
            assert (prim.result, prim.result_source, prim.diagnostic) == (1, 1, 3)
    finally:
        h.close()


def test_peers_config_errors_name_the_key() -> None:
    from segnode.node.errors import ConfigError

    with pytest.raises(ConfigError, match=r"node.peers\[0\].ae_title"):
        from_dict({"node": {"peers": [{"ae_title": "A" * 17}]}})
    with pytest.raises(ConfigError, match=r"node.peers\[1\]: unknown"):
        from_dict({"node": {"peers": [{"ae_title": "A"}, {"ae_title": "B", "colour": 1}]}})
    with pytest.raises(ConfigError, match="node.min_free_disk_mb"):
        from_dict({"node": {"min_free_disk_mb": -1}})


def test_guard_units(tmp_path: Path) -> None:
    d = DiskGuard(tmp_path, 0)
    assert d.ok(10**18)  # off
    d = DiskGuard(tmp_path, 1)
    assert d.ok() and not d.ok(10**18)
    b = SeriesBudget(2, 0, lambda uid: (1, 100))
    assert b.admits("1.2", 10) is None
    b.add("1.2", 10)
    assert "max_series_instances" in (b.admits("1.2", 10) or "")
    assert SeriesBudget(0, 0, lambda uid: (10**6, 10**12)).admits("1.2", 1) is None


def test_retention_deletes_delivered_series_only(tmp_path: Path) -> None:
    data = tmp_path / "data"
    led = Ledger(data / "ledger.sqlite")
    try:
        dest = "PACS@127.0.0.1:1"
        sent = encoded_job(led, data, [dest])
        failed = encoded_job(led, data, [dest])
        view = led.job(sent)
        assert view is not None
        for d in led.due_deliveries():
            if d.job_id == sent:
                led.delivery_done(d.id, 0)
            else:
                led.delivery_failed(d.id, "test")
        assert led.job_state(sent) == "sent" and led.job_state(failed) == "failed"
        spool_files = sorted((data / "spool").glob("*.dcm"))
        assert len(spool_files) == 2
        cfg = from_dict({"retention": {"spool_days": 1e-5, "check_interval_s": 1}})
        r = Retention(replace(cfg, data_dir=data), led)
        r.spool_root = data / "spool"
        assert r.run_once() == 0  # delivered less than ~1 s ago
        time.sleep(1.0)
        assert r.run_once() == 3  # its instance + SEG + SR
        assert not (data / "results" / str(sent)).exists()
        assert (data / "results" / str(failed)).is_dir()
        left = sorted((data / "spool").glob("*.dcm"))
        assert len(left) == 1 and left[0] in spool_files
        assert r.run_once() == 0  # recorded: not purged twice
        assert led.job(sent) is not None  # history stays
        off = Retention(replace(from_dict({}), data_dir=data), led)
        assert not off.enabled and off.maybe_run() == 0
    finally:
        led.close()


def test_retention_keeps_a_series_whose_other_models_job_failed(tmp_path: Path) -> None:
    """Two models' jobs of one series: one failed before its results (its retry runs again on
    the spool files), the other sent. The series is kept until the retry succeeds; it used to
    be purged because only the latest job was looked at, and the retry then found no files."""
    from pydicom.uid import generate_uid

    from segnode.storage.ledger import NewJob

    data = tmp_path / "data"
    led = Ledger(data / "ledger.sqlite")
    try:
        series = generate_uid()
        spool = one_instance(led, data, series, generate_uid())
        bad, good = led.create_jobs(
            series, trigger="test", jobs=[NewJob("bad", "b", "e"), NewJob("good", "g", "e")]
        )
        for _ in range(2):
            job = led.claim_next_job()
            assert job is not None
            if job.id == bad:
                led.fail_job(bad, "ONNX file not found")
            else:
                assert led.save_results(good, [], [])  # nothing to send: done
        assert led.job_state(bad) == "failed" and led.job_state(good) == "done"
        cfg = from_dict({"retention": {"spool_days": 1e-5, "check_interval_s": 1}})
        r = Retention(replace(cfg, data_dir=data), led)
        r.spool_root = data / "spool"
        time.sleep(1.0)
        assert r.run_once() == 0 and spool.exists()  # the failed job may be retried
        assert led.retry_job(bad)
        job = led.claim_next_job()
        assert job is not None and job.id == bad and spool.exists()
        assert led.save_results(bad, [], [])
        time.sleep(1.0)
        assert r.run_once() == 1 and not spool.exists()  # retried and done: let go
    finally:
        led.close()


def test_retention_keeps_files_outside_the_spool(tmp_path: Path) -> None:
    data = tmp_path / "data"
    led = Ledger(data / "ledger.sqlite")
    try:
        outside = tmp_path / "precious.dcm"
        outside.write_bytes(b"keep me")
        rec = InstanceRecord("1.2.3.4", "1.2.840.10008.5.1.4.1.1.2", "1.2.3", "1.2", "", "CT", "M")
        led.record_instance(rec, outside, 7)
        job = led.create_job("1.2.3", trigger="t", model="m", engine="e")
        assert job is not None and led.claim_next_job() is not None
        led.save_results(job, [], [])  # nothing to send: done
        Spool(data / "spool")
        cfg = replace(from_dict({"retention": {"spool_days": 1e-9}}), data_dir=data)
        time.sleep(0.01)
        Retention(cfg, led).run_once()
        assert outside.exists()
    finally:
        led.close()


def test_instances_stored_are_private(tmp_path: Path, series: list[Path]) -> None:
    old = os.umask(0o022)
    try:
        h = SCPHarness(tmp_path / "n")
        try:
            a = h.assoc()
            assert store(a, series[0]) == 0
            a.release()
            (path,) = h.ledger.instance_paths(str(dcmread(series[0]).SeriesInstanceUID))
            assert path.stat().st_mode & 0o777 == 0o600
            assert path.parent.stat().st_mode & 0o777 == 0o700
        finally:
            h.close()
    finally:
        os.umask(old)
