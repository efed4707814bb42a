"""Ingest and end-to-end benchmark: ``make bench`` (``python -m bench.ingest --out bench/out``).

Everything runs on loopback in one invocation, against real peers:

1. **Ingest.** DCMTK ``storescu`` sends a synthetic 512x512x256 CT (one association) to
   (a) ``segnode serve``, (b) pynetdicom's bundled ``python -m pynetdicom storescp`` (its
   defaults, and with ``-pdu 0``), (c) Orthanc. Each target is started fresh for each of
   ``--runs`` runs; we report the median MB/s and instances/s (wall time of ``storescu``) and
   the receiver's CPU time (user + system, from ``/proc``) per MB.
2. **Completion latency.** An in-process pynetdicom SCU sends the same series to a fresh
   node; the time of the last C-STORE response is taken right where the SCU receives it, the
   job's ``created_at`` (series complete, job queued) from the ledger. Default config (quiet
   period 30 s): the release (no count hint) and geometry (Images in Acquisition present)
   signals are measured separately.
3. **End to end.** 512x512x128 CT to a node that sends results to Orthanc, default model on
   the CPU: last C-STORE response -> SEG and SR acknowledged by Orthanc (the delivery ack times
   in the ledger), with each stage's share, and a timeline plot.
4. **Memory.** Peak RSS of the node (sampled every 10 ms from ``/proc``) while it receives a
   512x512x1000 series, up to the moment the job is queued, against the volume's size in memory
   (float32).

Outputs in ``--out``: ``ingest.json``, ``ingest.md`` (the tables), ``timeline.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scripts.harness import orthanc_config, query_ledger
from segnode.node.ops import metrics

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- data -------------------------------------------------------------------------------------


def series(name: str, slices: int, seed: int, hint: bool) -> Path:
    """A cached synthetic 512x512 series under bench/generated/."""
    from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

    out = ROOT / "bench" / "generated" / name
    done = out.with_name(f"{name}.done")
    if not done.exists():
        shutil.rmtree(out, ignore_errors=True)
        print(f"generating {name} ({slices} slices)...", flush=True)
        write_synthetic_series(
            out,
            PhantomGeometry(rows=512, columns=512, slices=slices),
            seed=seed,
            images_in_acquisition=hint,
        )
        done.write_text("")
    return out


def files_of(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.dcm"))


# -- processes --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (and its reaped children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12)) / CLK_TCK


def rss_bytes(pid: int, key: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} not listening after {timeout} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def segnode(
    work: Path, extra: str = "", node: str = ""
) -> Iterator[tuple[int, subprocess.Popen[bytes], Path]]:
    """A fresh ``segnode serve`` on loopback; yields (port, process, data dir). ``extra``:
    TOML before the ``[node]`` table (top-level keys, other tables); ``node``: lines in it."""
    port = free_port()
    data = work / "data"
    cfg = work / "config.toml"
    cfg.write_text(
        f'data_dir = "{data}"\nlog_level = "INFO"\n{extra}\n'
        f'[node]\nae_title = "SEGNODE"\nhost = "{LOOPBACK}"\nport = {port}\n{node}\n'
    )
    with serving(work, cfg, port) as proc:
        yield port, proc, data


@contextmanager
def serving(
    work: Path, cfg: Path, port: int, timeout: float = 60
) -> Iterator[subprocess.Popen[bytes]]:
    """``segnode serve --config cfg`` (output appended to ``work/node.log``), yielded once
    ``port`` listens, stopped afterwards."""
    with (work / "node.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "segnode.node.ops.cli", "serve", "--config", str(cfg)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_port(port, proc, timeout)
            yield proc
        finally:
            stop(proc)


@contextmanager
def storescp(work: Path, *args: str) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """pynetdicom's bundled storescp application writing to a fresh folder."""
    port = free_port()
    out = work / "out"
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pynetdicom", "storescp", str(port), "-ba", LOOPBACK]
    proc = subprocess.Popen(
        [*cmd, "-od", str(out), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_port(port, proc)
        yield port, proc
    finally:
        stop(proc)


NOOP_SCP = """
import sys, time
from pynetdicom import AE, ALL_TRANSFER_SYNTAXES, evt
from pynetdicom.sop_class import CTImageStorage
ae = AE("NOOP"); ae.maximum_pdu_size = 0
ae.add_supported_context(CTImageStorage, ALL_TRANSFER_SYNTAXES)
ae.start_server(("127.0.0.1", int(sys.argv[1])), evt_handlers=[(evt.EVT_C_STORE, lambda e: 0)])
"""


@contextmanager
def noop_scp(work: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """pynetdicom with a C-STORE handler that stores nothing: the ceiling of any SCP built on
    pynetdicom (its receive path and reactor polling alone)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", NOOP_SCP, str(port)])
    try:
        wait_port(port, proc)
        yield port, proc
    finally:
        stop(proc)


@contextmanager
def orthanc(work: Path) -> Iterator[tuple[int, int, subprocess.Popen[bytes]]]:
    """A fresh Orthanc; yields (DICOM port, HTTP port, process)."""
    exe = shutil.which("Orthanc")
    if exe is None:
        raise RuntimeError("Orthanc not installed (apt-get install orthanc)")
    dicom, http = free_port(), free_port()
    work.mkdir(parents=True, exist_ok=True)
    cfg = orthanc_config(work, dicom, http, Name="bench")
    (work / "orthanc.json").write_text(json.dumps(cfg))
    log = (work / "orthanc.log").open("ab")
    proc = subprocess.Popen([exe, str(work / "orthanc.json")], stdout=log, stderr=log)
    try:
        wait_port(http, proc)
        wait_port(dicom, proc)
        yield dicom, http, proc
    finally:
        stop(proc)


def warm_page_cache(paths: list[Path]) -> None:
    """Read every file once, so that the sender reads from memory, not from the disk."""
    for p in paths:
        with p.open("rb") as f:
            while f.read(1 << 20):
                pass


def storescu(port: int, folder: Path, called: str = "SEGNODE") -> float:
    """Send a folder with DCMTK storescu (one association); return the wall time."""
    t0 = time.perf_counter()
    r = subprocess.run(
        ["storescu", "-aet", "MODALITY", "-aec", called, "+sd", LOOPBACK, str(port), str(folder)],
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"storescu failed: {r.stdout}{r.stderr}")
    return elapsed


def storescu_parallel(port: int, folders: list[Path], called: str) -> float:
    """Send each folder with its own storescu at the same time; return the wall time."""
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            ["storescu", "-aet", "MODALITY", "-aec", called, "+sd", LOOPBACK, str(port), str(f)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for f in folders
    ]
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"storescu failed: {out.decode(errors='replace')}")
    return time.perf_counter() - t0


def send_pynetdicom(port: int, paths: list[Path]) -> float:
    """Send with an in-process pynetdicom SCU; return the wall-clock time (epoch seconds) at
    which the last C-STORE response was received (before the release)."""
    from pydicom import dcmread
    from pydicom.uid import ExplicitVRLittleEndian
    from pynetdicom import AE
    from pynetdicom.sop_class import CTImageStorage  # type: ignore[attr-defined]

    ae = AE(ae_title="MODALITY")
    ae.add_requested_context(CTImageStorage, ExplicitVRLittleEndian)
    ae.maximum_pdu_size = 0
    datasets = [dcmread(p) for p in paths]
    assoc = ae.associate(LOOPBACK, port, ae_title="SEGNODE")
    if not assoc.is_established:
        raise RuntimeError("association rejected")
    last = 0.0
    for ds in datasets:
        status = assoc.send_c_store(ds)
        last = time.time()
        if not status or int(status.Status) != 0:
            raise RuntimeError(f"C-STORE failed: {status}")
    assoc.release()
    return last


# -- ledger -----------------------------------------------------------------------------------


def epoch(text: str | None) -> float | None:
    """A ledger timestamp (naive UTC) as epoch seconds."""
    if not text:
        return None
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def ledger_job(data: Path, series_uid: str | None = None) -> dict[str, Any] | None:
    """The latest job (of ``series_uid``, when given), with its delivery acknowledgement
    times (``acks``); ``None`` before there is one."""
    rows = query_ledger(
        data, "jobs.*", "jobs", series_uid=series_uid, tail="ORDER BY jobs.id DESC LIMIT 1"
    )
    if not rows:
        return None
    job = dict(rows[0])
    acks = query_ledger(
        data, "sent_at", "deliveries", where="job_id = ?", args=(job["id"],), tail="ORDER BY id"
    )
    job["acks"] = [a[0] for a in acks]
    return job


def wait(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.01)
    raise RuntimeError(f"timed out waiting for {what}")


# -- measurements -----------------------------------------------------------------------------


SYNCED_STORESCP = "pynetdicom storescp (defaults), then sync"


def audited(work: Path) -> str:
    """``[audit]`` on, to a file in ``work`` (RFC 5424 lines; the messages go through the
    durable queue and a delivery thread as to a repository)."""
    return f'[audit]\nenabled = true\ndestinations = ["file:{work / "audit.log"}"]\n'


def ingest(folder: Path, runs: int, tmp: Path, only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Throughput of every receiver; runs are interleaved (run 1 of each target, then run 2
    of each, ...) so that a change in the machine's load affects all targets alike."""
    paths = files_of(folder)
    mb = sum(p.stat().st_size for p in paths) / 1e6
    # The same series split over 4 simultaneous associations (quarters, one storescu each).
    quarters = []
    for q in range(4):
        d = tmp / "quarters" / str(q)
        d.mkdir(parents=True)
        for p in paths[q::4]:
            (d / p.name).symlink_to(p)
        quarters.append(d)
    targets: list[tuple[str, Callable[[Path], Any], str, list[Path] | None]] = [
        ("segnode", segnode, "SEGNODE", None),
        (
            "segnode, nothing warm (staging_pool_mb = 0, warm_mb = 0)",
            lambda w: segnode(w, "[streaming]\nwarm_mb = 0", "staging_pool_mb = 0"),
            "SEGNODE",
            None,
        ),
        (
            "segnode, max_pdu = 16 MiB (the largest allowed)",
            lambda w: segnode(w, "", "max_pdu = 16777216"),
            "SEGNODE",
            None,
        ),
        ("pynetdicom storescp (defaults)", storescp, "STORESCP", None),
        # storescp does not fsync: the same bytes on disk, for a fair figure, take a sync after it
        (SYNCED_STORESCP, storescp, "STORESCP", None),
        ("pynetdicom storescp -pdu 0", lambda w: storescp(w, "-pdu", "0"), "STORESCP", None),
        ("orthanc", orthanc, "ORTHANC", None),
        ("pynetdicom, no-op handler (ceiling)", noop_scp, "NOOP", None),
        ("segnode, 4 associations", segnode, "SEGNODE", quarters),
        ("pynetdicom storescp (defaults), 4 associations", storescp, "STORESCP", quarters),
        # [audit] on against off (issue 33: >= 0.97x)
        ("segnode, audit on", lambda w: segnode(w, audited(w)), "SEGNODE", None),
        (
            "segnode, audit on, 4 associations",
            lambda w: segnode(w, audited(w)),
            "SEGNODE",
            quarters,
        ),
    ]
    if only:  # --targets: the exact names given
        targets = [t for t in targets if t[0] in only]
    times: dict[str, list[float]] = {t[0]: [] for t in targets}
    cpus: dict[str, list[float]] = {t[0]: [] for t in targets}
    for r in range(runs):
        for name, start, called, folders in targets:
            work = tmp / f"{name.replace(' ', '_')}-{r}"
            work.mkdir(parents=True)
            # Every target starts with no dirty pages left by the one before: storescp and
            # Orthanc do not fsync, and their write-back would otherwise land in the next
            # target's timing (on segnode's fsyncs in particular).
            os.sync()
            # ... and with the sender's files in the page cache: this VM reclaims cold page
            # cache (DAMON), and the first target of a run used to pay storescu's disk reads
            # (13.6 s instead of about 1 s, twice in a row).
            warm_page_cache(paths)
            with start(work) as handle:
                port = handle[0]
                proc = next(x for x in handle if isinstance(x, subprocess.Popen))
                c0 = cpu_seconds(proc.pid)
                if folders:
                    times[name].append(storescu_parallel(port, folders, called))
                else:
                    times[name].append(storescu(port, folder, called))
                if name == SYNCED_STORESCP:
                    t_sync = time.perf_counter()
                    os.sync()  # what it wrote, on disk as segnode's is before each answer
                    times[name][-1] += time.perf_counter() - t_sync
                cpus[name].append(cpu_seconds(proc.pid) - c0)
            shutil.rmtree(work, ignore_errors=True)
            print(f"  run {r + 1} {name}: {times[name][-1]:.2f} s", flush=True)
    rows = []
    for name, *_ in targets:
        t = statistics.median(times[name])
        rows.append(
            {
                "target": name,
                "runs_s": [round(x, 3) for x in times[name]],
                "median_s": round(t, 3),
                "mb_per_s": round(mb / t, 1),
                "instances_per_s": round(len(paths) / t, 1),
                "cpu_s_per_mb": round(statistics.median(cpus[name]) / mb, 4),
            }
        )
    return rows


def completion(folder: Path, runs: int, tmp: Path, label: str) -> dict[str, Any]:
    paths = files_of(folder)
    lat, triggers = [], []
    for r in range(runs):
        work = tmp / f"completion-{label}-{r}"
        work.mkdir(parents=True)
        with segnode(work) as (port, _proc, data):
            last = send_pynetdicom(port, paths)
            job = wait(lambda: ledger_job(data), 60, "job queued")
            created = epoch(job["created_at"])
            assert created is not None
            lat.append((created - last) * 1000)
            triggers.append(job["trigger"])
        shutil.rmtree(work, ignore_errors=True)
    out = {
        "series": label,
        "runs_ms": [round(x, 1) for x in lat],
        "median_ms": round(statistics.median(lat), 1),
        "trigger": sorted(set(triggers)),
    }
    print(f"  completion {label}: {out}", flush=True)
    return out


#: The jobs-table column of each :attr:`segnode.storage.ledger.JobView.stages` key we use.
STAGE_COLUMNS = {
    "first_instance": "first_instance_at",
    "last_instance": "last_instance_at",
    "queued": "created_at",
    "started": "started_at",
    "volume": "volume_at",
    "inference": "inference_at",
    "encoded": "encoded_at",
}
#: The node's stages (its metrics' ``segnode_stage_seconds``) from the last instance to the
#: encoded results, then delivery up to the last acknowledgement; receive and total apart.
STAGES = (
    *(s for s in metrics.STAGES if s[0] not in ("receive", "total")),
    ("delivery", "encoded", "last ack"),
)


def phantom_copies(runs: int) -> list[Path] | None:
    """``runs`` copies of the real phantom (../shared/data) under bench/generated/, each with
    fresh Study/Series/SOP Instance UIDs (pixel data and transfer syntax untouched), so each
    run is a new series; None when the phantom is absent."""
    from pydicom import dcmread
    from pydicom.uid import generate_uid

    source = ROOT.parent / "shared" / "data" / "ct-phantom-philips-28"
    files = sorted(p for p in source.rglob("*") if p.is_file()) if source.is_dir() else []
    if not files:
        return None
    out = []
    for k in range(runs):
        folder = ROOT / "bench" / "generated" / f"phantom-{k}"
        done = folder.with_name(f"phantom-{k}.done")
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            study, series_uid = generate_uid(), generate_uid()
            for i, f in enumerate(files):
                ds = dcmread(f)
                ds.StudyInstanceUID, ds.SeriesInstanceUID = study, series_uid
                ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
                ds.save_as(folder / f"{i:04d}.dcm", enforce_file_format=True)
            done.write_text("")
        out.append(folder)
    return out


def end_to_end(name: str, folders: list[Path], tmp: Path) -> dict[str, Any]:
    """Last C-STORE response -> SEG and SR acknowledged by Orthanc, for each folder after the
    first (the warm-up), each sent by DCMTK storescu on one association to one node.

    The start is the ledger's time of the series' last instance, recorded before its
    response is sent: the figure slightly overstates the true latency, never understates it.
    """
    work = tmp / f"e2e-{name}"
    work.mkdir(parents=True)
    runs: list[dict[str, Any]] = []
    with orthanc(work / "orthanc") as (dport, hport, _o):
        extra = f'[dispatch]\ndestinations = ["ORTHANC@{LOOPBACK}:{dport}"]\n'
        (work / "node").mkdir()
        with segnode(work / "node", extra) as (port, _proc, data):
            for k, folder in enumerate(folders):
                paths = files_of(folder)
                warm_page_cache(paths)
                storescu(port, folder)
                job = wait(
                    lambda k=k: (
                        (j := ledger_job(data))
                        and j["id"] > k
                        and j["state"] in ("sent", "failed")
                        and j
                    ),
                    900,
                    "job sent",
                )
                if job["state"] != "sent":
                    raise RuntimeError(f"job failed: {job['reason']}")
                if k:
                    runs.append(job)
            n_series = orthanc_series_count(hport)
    results = [_e2e_run(job) for job in runs]
    totals = [r["total_s"] for r in results]
    median = sorted(results, key=lambda r: r["total_s"])[len(results) // 2]
    out = {
        "series": name,
        "runs_s": totals,
        "total_s": round(statistics.median(totals), 3),
        "receive_s": median["receive_s"],
        "trigger": median["trigger"],
        "orthanc_series": n_series,
        "stages": median["stages"],
    }
    print(f"  end to end: {out}", flush=True)
    return out


def end_to_end_all(runs: int, tmp: Path) -> list[dict[str, Any]]:
    """The synthetic 512x512x128 series and, when ../shared/data has it, the real phantom:
    one warm-up and ``runs`` measured series each (fresh UIDs every time)."""
    synthetic = [series(f"e2e128-{k}", 128, 9800 + k, hint=False) for k in range(runs + 1)]
    out = [end_to_end("512x512x128", synthetic, tmp)]
    phantom = phantom_copies(runs + 1)
    if phantom is not None:
        out.append(end_to_end("phantom (28 slices)", phantom, tmp))
    return out


def job_stages(
    job: dict[str, Any], acked: float, last: float | None = None
) -> tuple[float, list[dict[str, Any]]]:
    """The :data:`STAGES` of ``job`` (a :func:`ledger_job` row) up to ``acked`` (epoch s).

    The stages start at ``last``, the sender's last C-STORE response, where the caller
    measured it, else at the ledger's last instance. Returns that start and the stages (a
    stage whose ends the ledger lacks is left out), each with its start (seconds after
    ``last``), length and share of the whole.
    """
    t: dict[str, float | None] = {k: epoch(job[c]) for k, c in STAGE_COLUMNS.items()}
    if last is not None:
        t["last_instance"] = last
    start0 = t["last_instance"]
    if start0 is None:
        raise ValueError(f"job {job.get('id')} has no last instance time")
    t["last ack"] = acked
    total = acked - start0
    stages = []
    for name, a, b in STAGES:
        start, end = t[a], t[b]
        if start is None or end is None:
            continue
        stages.append(
            {
                "stage": name,
                "start_s": round(start - start0, 3),
                "seconds": round(end - start, 3),
                "share": round((end - start) / total, 4) if total > 0 else 0.0,
            }
        )
    return start0, stages


def _e2e_run(job: dict[str, Any]) -> dict[str, Any]:
    acked = max(a for a in (epoch(x) for x in job["acks"]) if a is not None)
    last, stages = job_stages(job, acked)
    first = epoch(job["first_instance_at"])
    return {
        "total_s": round(acked - last, 3),
        "receive_s": round(last - first, 3) if first is not None else None,
        "trigger": job["trigger"],
        "stages": stages,
    }


def orthanc_series_count(hport: int) -> int:
    with urllib.request.urlopen(f"http://{LOOPBACK}:{hport}/series", timeout=10) as r:
        return len(json.loads(r.read()))


def per_instance(slices: int, runs: int, tmp: Path) -> dict[str, Any]:
    """Last C-STORE response -> SEG and SR stored in Orthanc, for one series sent by DCMTK
    storescu on one association, and the same size of series sent by storescu once per file
    (one association per instance), each against a node that has seen its sender before
    (one warm-up series first). Fresh series every run (new UIDs)."""
    out: dict[str, Any] = {"series": f"512x512x{slices}", "runs": runs}
    for mode in ("one association", "one association per instance"):
        work = tmp / f"per-instance-{slices}-{mode.replace(' ', '_')}"
        work.mkdir(parents=True)
        folders = [
            series(f"pi{slices}-{k}", slices, 9600 + slices + k, hint=False)
            for k in range(runs + 1)
        ]
        times: list[float] = []
        with orthanc(work / "orthanc") as (dport, hport, _o):
            extra = f'[dispatch]\ndestinations = ["ORTHANC@{LOOPBACK}:{dport}"]\n'
            (work / "node").mkdir()
            with segnode(work / "node", extra) as (port, _proc, _data):
                for k, folder in enumerate(folders):
                    warm_page_cache(files_of(folder))
                    if mode == "one association":
                        storescu(port, folder)
                    else:
                        for f in files_of(folder):
                            r = subprocess.run(
                                ["storescu", "-aet", "SCRIPT", "-aec", "SEGNODE"]
                                + [LOOPBACK, str(port), str(f)],
                                capture_output=True,
                            )
                            if r.returncode != 0:
                                raise RuntimeError("storescu failed")
                    last = time.monotonic()
                    wait(lambda k=k: orthanc_series_count(hport) >= 2 * (k + 1), 600, "SEG+SR")
                    if k:  # the first series is the warm-up
                        times.append(time.monotonic() - last)
                time.sleep(2)
                n = orthanc_series_count(hport)
        out[mode] = {
            "runs_s": [round(x, 3) for x in times],
            "median_s": round(statistics.median(times), 3),
            "orthanc_series": n,
            "expected_series": 2 * len(folders),
        }
        print(f"  per instance {slices} slices, {mode}: {out[mode]}", flush=True)
    return out


def memory(folder: Path, tmp: Path) -> dict[str, Any]:
    n = len(files_of(folder))
    volume_bytes = n * 512 * 512 * 4
    work = tmp / "memory"
    work.mkdir(parents=True)
    with segnode(work) as (port, proc, data):
        base = rss_bytes(proc.pid)
        sender = subprocess.Popen(
            ["storescu", "-aet", "MODALITY", "-aec", "SEGNODE", "+sd", LOOPBACK, str(port)]
            + [str(folder)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        peak = base
        while True:
            peak = max(peak, rss_bytes(proc.pid))
            if sender.poll() is not None and ledger_job(data):
                break
            time.sleep(0.01)
        peak = max(peak, rss_bytes(proc.pid))
        hwm = rss_bytes(proc.pid, "VmHWM")
        proc.kill()
    out = {
        "series": f"512x512x{n}",
        "volume_mb": round(volume_bytes / 2**20, 1),
        "idle_rss_mb": round(base / 2**20, 1),
        "peak_rss_mb": round(peak / 2**20, 1),
        "vm_hwm_mb": round(hwm / 2**20, 1),
        "ratio": round(peak / volume_bytes, 3),
        "target_ratio": 1.5,
    }
    print(f"  memory: {out}", flush=True)
    return out


# -- report -----------------------------------------------------------------------------------


def markdown(res: dict[str, Any]) -> str:
    lines = [
        f"Measured {res['date']} on {res['machine']}.",
        "",
        "| receiver (512x512x256 CT, storescu, 1 association) | MB/s | instances/s | "
        "CPU s per MB | runs (s) |",
        "|---|---:|---:|---:|---|",
    ]
    for r in res["ingest"]:
        lines.append(
            f"| {r['target']} | {r['mb_per_s']} | {r['instances_per_s']} | "
            f"{r['cpu_s_per_mb']} | {', '.join(map(str, r['runs_s']))} |"
        )
    by = {r["target"]: r["mb_per_s"] for r in res["ingest"]}
    ref = "pynetdicom storescp (defaults)"
    lines.append("")
    for suffix in ("", ", 4 associations"):
        if f"segnode{suffix}" in by and f"{ref}{suffix}" in by:
            ratio = by[f"segnode{suffix}"] / by[f"{ref}{suffix}"]
            lines.append(f"segnode / {ref}{suffix}: **{ratio:.2f}x**  ")
    for suffix in ("", ", 4 associations"):
        on, off = f"segnode, audit on{suffix}", f"segnode{suffix}"
        if on in by and off in by:
            lines.append(f"{on} / {off}: **{by[on] / by[off]:.2f}x**  ")
    cold = next((t for t in by if t.startswith("segnode, nothing warm")), None)
    if cold and ref in by:
        lines.append(f"{cold} / {ref}: {by[cold] / by[ref]:.2f}x  ")
    lines.append("")
    lines += [
        "| completion latency (last C-STORE response -> job queued) | median (ms) | runs (ms) "
        "| signal |",
        "|---|---:|---|---|",
    ]
    for c in res["completion"]:
        lines.append(
            f"| {c['series']} | {c['median_ms']} | {', '.join(map(str, c['runs_ms']))} | "
            f"{', '.join(c['trigger'])} |"
        )
    for e in res["end_to_end"]:
        lines += [
            "",
            f"End to end {e['series']} (last C-STORE response -> SEG and SR acknowledged by "
            f"Orthanc; DCMTK storescu, one association), default model on CPU: median of "
            f"{len(e['runs_s'])} **{e['total_s']} s** (runs {', '.join(map(str, e['runs_s']))}; "
            f"completion by {e['trigger']}; receiving took {e.get('receive_s')} s before that)",
            "",
            "| stage (median run) | starts at (s) | seconds | share |",
            "|---|---:|---:|---:|",
        ]
        for s in e["stages"]:
            lines.append(f"| {s['stage']} | {s['start_s']} | {s['seconds']} | {s['share']:.1%} |")
    m = res["memory"]
    lines += [
        "",
        f"Memory while receiving {m['series']}: peak RSS {m['peak_rss_mb']} MiB (idle "
        f"{m['idle_rss_mb']} MiB) for a {m['volume_mb']} MiB float32 volume: "
        f"**{m['ratio']}x** (target <= {m['target_ratio']}x).",
        "",
    ]
    return "\n".join(lines)


def plot(e2e: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.4))
    colors = ["#8c564b", "#7f7f7f", "#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    if e2e.get("receive_s"):
        receive = e2e["receive_s"]
        ax.barh(0, receive, left=-receive, color="#bcbd22", label="receive (+ streaming decode)")
        ax.axvline(0, color="black", linewidth=0.8)
    for i, s in enumerate(e2e["stages"]):
        ax.barh(0, s["seconds"], left=s["start_s"], color=colors[i % len(colors)], label=s["stage"])
    ax.set_yticks([])
    ax.set_xlabel("seconds after the last C-STORE response")
    ax.set_title(f"segnode end to end, {e2e['series']} CT, total {e2e['total_s']} s")
    ax.legend(ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--skip-memory", action="store_true", help="skip the 1000-slice series")
    p.add_argument(
        "--only",
        choices=["ingest", "completion", "end_to_end", "memory", "per_instance"],
        help="run one section and print its JSON (no tables written)",
    )
    p.add_argument(
        "--targets",
        default="",
        help="with --only ingest: the ingest targets to run, by name, separated by '|' "
        "(e.g. 'segnode|segnode, audit on')",
    )
    args = p.parse_args(argv)
    for tool in ("storescu", "Orthanc"):
        if shutil.which(tool) is None:
            print(f"{tool} not installed: make tools", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    ct256 = series("ct256", 256, 900, hint=False)
    ct256h = series("ct256-hint", 256, 903, hint=True)
    res: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} CPUs, {os.uname().machine}, Python {sys.version.split()[0]}",
    }
    if args.only:
        sections: dict[str, Callable[[Path], Any]] = {
            "ingest": lambda tmp: ingest(
                ct256, args.runs, tmp, tuple(t for t in args.targets.split("|") if t)
            ),
            "completion": lambda tmp: [
                completion(ct256, args.runs, tmp, "512x512x256, no count hint"),
                completion(ct256h, args.runs, tmp, "512x512x256, Images in Acquisition"),
            ],
            "end_to_end": lambda tmp: end_to_end_all(args.runs, tmp),
            "memory": lambda tmp: memory(series("ct1000", 1000, 902, hint=True), tmp),
            "per_instance": lambda tmp: [
                per_instance(40, args.runs, tmp),
                per_instance(128, args.runs, tmp),
            ],
        }
        with tempfile.TemporaryDirectory(prefix="segnode-bench-") as t:
            print(json.dumps(sections[args.only](Path(t)), indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="segnode-bench-") as t:
        tmp = Path(t)
        print("ingest", flush=True)
        res["ingest"] = ingest(ct256, args.runs, tmp)
        print("completion latency", flush=True)
        res["completion"] = [
            completion(ct256, args.runs, tmp, "512x512x256, no count hint"),
            completion(ct256h, args.runs, tmp, "512x512x256, Images in Acquisition"),
        ]
        print("end to end", flush=True)
        res["end_to_end"] = end_to_end_all(args.runs, tmp)
        if not args.skip_memory:
            print("memory", flush=True)
            res["memory"] = memory(series("ct1000", 1000, 902, hint=True), tmp)
    (args.out / "ingest.json").write_text(json.dumps(res, indent=2))
    if "memory" not in res:
        res["memory"] = {k: "-" for k in ("series", "peak_rss_mb", "idle_rss_mb", "volume_mb")}
        res["memory"].update(ratio="-", target_ratio=1.5)
    (args.out / "ingest.md").write_text(markdown(res))
    plot(res["end_to_end"][0], args.out / "timeline.png")
    print((args.out / "ingest.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
