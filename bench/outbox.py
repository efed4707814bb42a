"""Outbox send benchmark: one job's ~19 MB SEG + SR to Orthanc on loopback
(``python -m bench.outbox``).

1. **Objects.** The SEG and SR come from the real pipeline: ``segnode serve`` without
   destinations segments ``bench/generated/ct128`` (synthetic 512x512x128 CT, default model on
   the CPU); the results are cached under ``bench/generated/outbox-results``.
2. **Variants**, interleaved round by round (``--rounds``), each with its own ledger and
   :class:`~segnode.node.outbox.scu.Dispatcher` sending to one Orthanc:

   * ``before`` - ``node/outbox/scu.py`` as of ``--before`` (a git revision; skipped when empty):
     the file decoded with ``dcmread`` and encoded again by pynetdicom, a new association;
   * ``fresh`` - this code with ``dispatch.keep_open_s = 0``: the file's bytes, a new
     association per job;
   * ``kept`` - this code with ``keep_open_s = 60``: the file's bytes over the association
     kept open since the previous job (a warm-up job opens it).

   Each round sends a new job: copies of the two objects with new SOP Instance UIDs, so that
   Orthanc stores each one in full. The figure is the wall time of ``Dispatcher.run_once()``
   for that job (both objects acknowledged, the ledger updated), and the CPU time of the
   sending process (all its threads; Orthanc's not included) meanwhile; Orthanc's copies are
   deleted between rounds, outside the time. A last job per variant runs under
   :mod:`tracemalloc` for the peak of the Python allocations while it is sent.

Prints the medians and writes ``outbox.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

from pydicom import dcmread
from pydicom.uid import generate_uid

from bench.ingest import orthanc
from scripts.harness import NodeRunner, free_port, send_files, write_config
from segnode.node.config import Config, from_dict
from segnode.node.outbox.scu import Dispatcher
from segnode.storage.ledger import InstanceRecord, Ledger
from segnode.storage.spool import write_atomic

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
RESULTS = ROOT / "bench" / "generated" / "outbox-results"


def pipeline_results() -> tuple[Path, Path]:
    """The SEG and SR of ``bench/generated/ct128`` through ``segnode serve`` (cached)."""
    seg, sr = RESULTS / "seg.dcm", RESULTS / "sr.dcm"
    if seg.exists() and sr.exists():
        return seg, sr
    from bench.ingest import series

    ct = series("ct128", 128, 11, False)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        port = free_port()
        node = NodeRunner(
            write_config(base / "c.toml", base / "data", port), base / "data", port, base / "log"
        )
        node.start(120)
        try:
            sent = send_files(sorted(ct.glob("*.dcm")), port)
            assert len(sent.acknowledged) == 128, sent
            deadline = time.monotonic() + 900
            while time.monotonic() < deadline:
                jobs = json.loads(node.cli("jobs", "--json").stdout)["jobs"]
                if jobs and jobs[0]["state"] in ("done", "failed"):
                    break
                time.sleep(2)
        finally:
            node.stop()
        RESULTS.mkdir(parents=True, exist_ok=True)
        for path in (base / "data" / "results").rglob("*.dcm"):
            shutil.copyfile(path, seg if path.name.startswith("seg") else sr)
    return seg, sr


def copy_with_new_uid(src: Path, dst: Path) -> tuple[str, str, str]:
    """``src`` saved as ``dst`` with a new SOP Instance UID; (class, instance, series)."""
    ds = dcmread(src)
    uid = generate_uid()
    ds.SOPInstanceUID = uid
    ds.file_meta.MediaStorageSOPInstanceUID = uid
    ds.save_as(dst, enforce_file_format=True)
    return str(ds.SOPClassUID), uid, str(ds.SeriesInstanceUID)


def encoded_job(ledger: Ledger, work: Path, seg: Path, sr: Path, dest: str) -> int:
    """A job whose results are new copies of ``seg`` and ``sr``, due to ``dest``."""
    study, series_uid = generate_uid(), generate_uid()
    spool = work / "spool" / f"{generate_uid()}.dcm"
    write_atomic(spool, b"x")
    rec = InstanceRecord(
        generate_uid(), "1.2.840.10008.5.1.4.1.1.2", series_uid, study, "", "CT", "B"
    )
    ledger.record_instance(rec, spool, 1)
    job_id = ledger.create_job(series_uid, trigger="bench", model="m", engine="e")
    assert job_id is not None and ledger.claim_next_job() is not None
    out = work / "results" / str(job_id)
    out.mkdir(parents=True)
    results = []
    for kind, src in (("SEG", seg), ("SR", sr)):
        path = out / f"{kind.lower()}.dcm"
        cls, uid, series_of = copy_with_new_uid(src, path)
        results.append((kind, cls, uid, series_of, path))
    assert ledger.save_results(job_id, results, [dest])
    return job_id


def load_scu(revision: str, work: Path) -> ModuleType:
    """``node/outbox/scu.py`` as of a git revision, as a module of its own."""
    text = subprocess.run(
        ["git", "show", f"{revision}:node/outbox/scu.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = work / "scu_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("scu_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def config(work: Path, dest: str, keep_open_s: float) -> Config:
    cfg = from_dict({"dispatch": {"destinations": [dest], "keep_open_s": keep_open_s}})
    return replace(cfg, data_dir=work)


def delete_all(http: int) -> None:
    """Delete every study Orthanc holds."""
    with urllib.request.urlopen(f"http://{LOOPBACK}:{http}/studies", timeout=30) as r:
        studies = json.loads(r.read())
    for sid in studies:
        req = urllib.request.Request(f"http://{LOOPBACK}:{http}/studies/{sid}", method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()


def run(rounds: int, before: str, out: Path) -> dict[str, Any]:
    seg, sr = pipeline_results()
    tmp = Path(tempfile.mkdtemp(prefix="outbox-bench-"))
    times: dict[str, list[float]] = {}
    send_s: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    peak_mb: dict[str, float] = {}
    try:
        with orthanc(tmp / "orthanc") as (dicom, http, _):
            dest = f"ORTHANC@{LOOPBACK}:{dicom}"
            setups: dict[str, tuple[Any, Ledger, Path]] = {}
            names = (["before"] if before else []) + ["fresh", "kept"]
            for name in names:
                work = tmp / name
                work.mkdir()
                ledger = Ledger(work / "ledger.sqlite")
                if name == "before":
                    cls = load_scu(before, tmp).Dispatcher
                    d = cls(config(work, dest, 0), ledger, rng=random.Random(1))
                else:
                    d = Dispatcher(config(work, dest, 0 if name == "fresh" else 60), ledger)
                setups[name] = (d, ledger, work)
                # Warm-up job: imports, page cache, and the kept variant's association.
                encoded_job(ledger, work, seg, sr, dest)
                assert d.run_once() == 2, name
                delete_all(http)
            for _ in range(rounds):
                for name in names:
                    d, ledger, work = setups[name]
                    job_id = encoded_job(ledger, work, seg, sr, dest)
                    t0, c0 = time.perf_counter(), time.process_time()
                    n = d.run_once()
                    times.setdefault(name, []).append(time.perf_counter() - t0)
                    cpu.setdefault(name, []).append(time.process_time() - c0)
                    assert n == 2 and ledger.job_state(job_id) == "sent", name
                    view = ledger.job(job_id)
                    assert view is not None
                    for (kind, *_), t0s, t1 in zip(
                        view.deliveries,
                        view.delivery_starts or (None, None),
                        view.delivery_acks,
                        strict=True,
                    ):
                        if t0s is not None and t1 is not None:
                            send_s.setdefault(f"{name} {kind}", []).append(
                                (t1 - t0s).total_seconds()
                            )
                    delete_all(http)
            for name in names:
                # One more job per variant under tracemalloc: the peak of Python allocations.
                d, ledger, work = setups[name]
                encoded_job(ledger, work, seg, sr, dest)
                tracemalloc.start()
                assert d.run_once() == 2
                peak_mb[name] = tracemalloc.get_traced_memory()[1] / 2**20
                tracemalloc.stop()
                delete_all(http)
            for d, ledger, _ in setups.values():
                d.stop()
                ledger.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "seg_bytes": seg.stat().st_size,
        "sr_bytes": sr.stat().st_size,
        "rounds": rounds,
        "before": before,
        "job_s": {k: {"median": statistics.median(v), "all": v} for k, v in times.items()},
        "cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
        "peak_alloc_mb": peak_mb,
        "send_s": {k: statistics.median(v) for k, v in send_s.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "outbox.json").write_text(json.dumps(res, indent=2))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--before", default="", help="git revision of node/outbox/scu.py to compare")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    args = p.parse_args(argv)
    res = run(args.rounds, args.before, args.out)
    print(f"SEG {res['seg_bytes']} bytes, SR {res['sr_bytes']} bytes, {res['date']}")
    for name, v in res["job_s"].items():
        runs = ", ".join(f"{t * 1000:.0f}" for t in v["all"])
        print(
            f"{name:>7}: median {v['median'] * 1000:.0f} ms per job (SEG + SR) [{runs}], "
            f"CPU {res['cpu_s'][name] * 1000:.0f} ms, "
            f"peak allocations {res['peak_alloc_mb'][name]:.1f} MiB"
        )
    for name, t in res["send_s"].items():
        print(f"{name:>10}: median {t * 1000:.0f} ms sending_at -> acked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
