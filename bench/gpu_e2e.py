"""GPU end-to-end benchmark: ``python -m bench.gpu_e2e --out DIR`` (``make bench-gpu-e2e``).

Runs on a CUDA machine with torch and onnx2torch, and needs no DCMTK or Orthanc: everything
on loopback, in one invocation, per model (``--models``; the nnU-Net-style U-Net of
:mod:`bench.unet`, whose manifest gives 3 segments, and the bundled tissue model by default):

1. A pynetdicom Storage SCP (this process, ``127.0.0.1``) accepts Segmentation Storage,
   Label Map Segmentation Storage, Comprehensive 3D SR and Key Object Selection, stores
   nothing, and records when it acknowledges each object.
2. ``segnode engine build --engine torch`` compiles the model into ``data_dir/engines``
   (timed), then ``segnode serve`` starts with ``[model] engine = "torch"``, the
   ``--precision`` and ``compile = true`` (unless ``--no-compile``) and the SCP as its only
   destination; the time from its spawn to its port accepting connections is the
   restart-to-ready time with the compiled model cached.
3. Synthetic 512 x 512 x ``--slices`` CT series
   (:func:`tests.fixtures.synthetic.synthetic_datasets`, new Study/Series/SOP Instance UIDs
   each, made before anything is timed) are sent by a
   pynetdicom SCU on one association each: one warm-up, then ``--runs`` measured series.
   Per series: last C-STORE response (taken at the SCU) -> SEG and SR both acknowledged by
   the SCP, and the stages from the node's ledger (completion, queue, volume, inference,
   encode, delivery), as ``bench.ingest`` reads them for the CPU end-to-end figure.

4. With several ``--prepare`` values (``[results] prepare``: ``concurrent``, ``before``) the
   node is restarted once per value on the same engine build and fresh series, and each
   variant is reported on its own row. The worker's per-job timing lines (``timing ms: ...``
   in the node's log: inference, prepare, and the split of the work after inference) of the
   measured series are kept, with their medians.

Outputs in ``--out``: ``gpu_e2e.json``, ``gpu_e2e.md`` and ``timeline-<model>.png`` (the
median run's stages; ``timeline-<model>-<prepare>.png`` with several ``--prepare`` values).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from bench.ingest import (
    LOOPBACK,
    STAGES,
    free_port,
    job_stages,
    ledger_job,
    plot,
    serving,
    wait,
)

ROOT = Path(__file__).resolve().parent.parent
TISSUE = ROOT / "engines" / "models" / "tissue" / "tissue.json"

SEG_CLASSES = {
    "1.2.840.10008.5.1.4.1.1.66.4": "SEG",  # Segmentation Storage
    "1.2.840.10008.5.1.4.1.1.66.7": "SEG",  # Label Map Segmentation Storage
}
SR_CLASSES = {"1.2.840.10008.5.1.4.1.1.88.34": "SR"}  # Comprehensive 3D SR Storage
KOS_CLASSES = {"1.2.840.10008.5.1.4.1.1.88.59": "KOS"}  # Key Object Selection Document

#: The parts of the worker's per-job timing line (segnode.node.pipeline.worker), in milliseconds.
TIMING_PARTS = re.compile(
    r"(inference waited|after inference|SEG encode|SR encode|inference|prepare|mark|check|"
    r"statistics|files|notes|ledger) ([0-9.]+)"
)


# -- the results SCP ----------------------------------------------------------------------------


class ResultsSCP:
    """A pynetdicom Storage SCP that records ``(ack time, kind, study UID)`` of each object."""

    def __init__(self) -> None:
        self.records: list[tuple[float, str, str, str]] = []
        self._lock = threading.Lock()
        self.port = free_port()
        self._server: Any = None

    def _on_store(self, event: Any) -> int:
        ds = event.dataset
        cls = str(event.request.AffectedSOPClassUID)
        kind = {**SEG_CLASSES, **SR_CLASSES, **KOS_CLASSES}.get(cls, cls)
        study = str(ds.get("StudyInstanceUID", ""))
        with self._lock:
            self.records.append((time.time(), kind, study, str(ds.get("SOPInstanceUID", ""))))
        return 0x0000

    def __enter__(self) -> ResultsSCP:
        from pynetdicom import AE, ALL_TRANSFER_SYNTAXES, evt
        from pynetdicom.sop_class import Verification  # type: ignore[attr-defined]

        ae = AE(ae_title="RESULTS")
        ae.maximum_pdu_size = 0
        for uid in (*SEG_CLASSES, *SR_CLASSES, *KOS_CLASSES):
            ae.add_supported_context(uid, ALL_TRANSFER_SYNTAXES)
        ae.add_supported_context(Verification)
        self._server = ae.start_server(
            (LOOPBACK, self.port), block=False, evt_handlers=[(evt.EVT_C_STORE, self._on_store)]
        )
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()

    def acks(self, study_uid: str) -> dict[str, float]:
        """Latest acknowledgement time per kind (SEG, SR, KOS) for one study."""
        out: dict[str, float] = {}
        with self._lock:
            for t, kind, study, _uid in self.records:
                if study == study_uid:
                    out[kind] = max(out.get(kind, 0.0), t)
        return out


# -- the node ---------------------------------------------------------------------------------


def config_text(
    data: Path, port: int, scp_port: int, manifest: Path, args: Any, prepare: str = "concurrent"
) -> str:
    """``segnode serve`` configuration: the torch engine, results to the SCP."""
    model = f'[model]\nmanifest = "{manifest}"\nengine = "{args.engine}"\n'
    if args.engine == "torch":
        model += f'precision = "{args.precision}"\n'
        model += f"compile = {'false' if args.no_compile else 'true'}\n"
        model += f"eager_while_compiling = {'false' if args.wait_compiled else 'true'}\n"
    if args.engine == "openvino":
        model += f'precision = "{"bf16" if args.precision == "fp16" else args.precision}"\n'
    return (
        f'data_dir = "{data}"\nlog_level = "INFO"\n\n'
        f'[node]\nae_title = "SEGNODE"\nhost = "{LOOPBACK}"\nport = {port}\n\n'
        f"{model}\n"
        f'[dispatch]\ndestinations = ["RESULTS@{LOOPBACK}:{scp_port}"]\n\n'
        f'[results]\nprepare = "{prepare}"\n'
    )


def engine_build(work: Path, cfg: Path, args: Any) -> dict[str, Any]:
    """``segnode engine build --engine torch`` (skipped with ``--no-compile`` or ``--cold``)."""
    if args.no_compile or args.cold or args.engine != "torch":
        why = "--no-compile" if args.no_compile else "--cold" if args.cold else args.engine
        return {"skipped": why}
    cmd = [sys.executable, "-m", "segnode.node.ops.cli", "engine", "build", "--engine", "torch"]
    cmd += ["--config", str(cfg), "--precision", args.precision]
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = {
        "seconds": round(time.monotonic() - t0, 2),
        "returncode": done.returncode,
        "stdout": done.stdout.strip().splitlines()[-3:],
    }
    if done.returncode != 0:
        out["stderr"] = done.stderr.strip()[-2000:]
    (work / "engine-build.log").write_text(done.stdout + done.stderr)
    return out


@contextmanager
def serve(work: Path, cfg: Path, port: int) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    """``segnode serve``; yields the process and seconds from spawn to the port listening."""
    t0 = time.monotonic()
    with serving(work, cfg, port, timeout=900) as proc:
        yield proc, time.monotonic() - t0


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (``/proc/PID/task/*/children``; the node's model
    processes, ``[engine] model_process``)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            with suppress(OSError, ValueError):
                todo.extend(int(c) for c in task.read_text().split())
    return found


class GpuMemory:
    """The most GPU memory a process and its children held (NVML's per-process figures,
    what ``nvidia-smi`` shows: the CUDA context, PyTorch's reserved blocks, cuDNN's
    workspace), sampled every 50 ms on a thread between ``start`` and ``stop``; ``peak`` is
    None without NVML."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, None
        #: ``(epoch, NVML utilisation %)`` of GPU 0 at each sample.
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start sampling; False without NVML."""
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as exc:  # no NVML: no figure, and the bench goes on
            print(f"[gpu-e2e] no GPU memory figures: {exc}", flush=True)
            return False

        def sample() -> None:
            while not self._stop.wait(0.05):
                util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                self.samples.append((time.time(), int(util)))
                ours = set(process_tree(self.pid))  # the node and its model processes
                held = sum(
                    int(proc.usedGpuMemory or 0)
                    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                    if proc.pid in ours
                )
                if held:
                    self.peak = max(self.peak or 0, held)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return True

    def busy(self, start: float, end: float) -> float | None:
        """Mean utilisation (%) of the samples in ``[start, end]``."""
        inside = [u for t, u in self.samples if start <= t <= end]
        return round(statistics.mean(inside), 1) if inside else None

    def stop(self) -> float | None:
        """Stop sampling; the peak in GiB."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return None if self.peak is None else round(self.peak / 2**30, 2)


def process_peak_rss(pid: int) -> float | None:
    """A process' peak resident set since it started (``VmHWM``), GiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) * 1024 / 2**30, 2)
    except OSError:
        pass
    return None


def wait_log(path: Path, offset: int, text: str, timeout: float, *others: str) -> str:
    """Wait until ``text`` (or one of ``others``) appears in the log file after ``offset``;
    return the one found."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with path.open("rb") as f:
            f.seek(offset)
            log = f.read()
        for found in (text, *others):
            if found.encode() in log:
                return found
        time.sleep(0.05)
    raise TimeoutError(f"{text!r} not in {path} after {timeout:.0f} s")


# -- one series -------------------------------------------------------------------------------


_ANATOMY: dict[int, Any] = {}


def make_series(slices: int, seed: int, phantom: str = "synthetic") -> list[Any]:
    """A synthetic CT series in memory (UIDs derived from ``seed``: new for every seed);
    ``phantom="anatomy"``: :func:`bench.totalseg_standin.anatomy_hu`'s 117 structures (for
    the stand-ins built with ``--anatomy``, whose label map is then those structures)."""
    from tests.fixtures.synthetic import PhantomGeometry, synthetic_datasets

    geometry = PhantomGeometry(rows=512, columns=512, slices=slices)
    hu = None
    if phantom == "anatomy":
        from bench.totalseg_standin import anatomy_hu

        if slices not in _ANATOMY:  # the same anatomy in every series (new UIDs each)
            _ANATOMY[slices] = anatomy_hu(geometry.shape, seed=34)[0]
        hu = _ANATOMY[slices]
    return synthetic_datasets(geometry, seed=seed, hu=hu)


def send(port: int, datasets: list[Any]) -> float:
    """Send on one association; return the epoch time of the last C-STORE response."""
    from pydicom.uid import ExplicitVRLittleEndian
    from pynetdicom import AE

    ae = AE(ae_title="MODALITY")
    ae.maximum_pdu_size = 0
    ae.add_requested_context(datasets[0].SOPClassUID, ExplicitVRLittleEndian)
    assoc = ae.associate(LOOPBACK, port, ae_title="SEGNODE")
    if not assoc.is_established:
        raise RuntimeError("association rejected")
    last = 0.0
    try:
        for ds in datasets:
            status = assoc.send_c_store(ds)
            last = time.time()
            if not status or int(status.Status) != 0:
                raise RuntimeError(f"C-STORE failed: {status}")
    finally:
        assoc.release()
    return last


def one_series(
    port: int, data: Path, scp: ResultsSCP, datasets: list[Any], timeout: float
) -> dict[str, Any]:
    study, series_uid = str(datasets[0].StudyInstanceUID), str(datasets[0].SeriesInstanceUID)
    first = time.time()
    last = send(port, datasets)
    acks = wait(
        lambda: (a := scp.acks(study)) and "SEG" in a and "SR" in a and a, timeout, "SEG+SR"
    )
    acked = max(acks["SEG"], acks["SR"])
    job = wait(
        lambda: (j := ledger_job(data, series_uid)) and j["state"] in ("sent", "failed") and j,
        60,
        "job sent in the ledger",
    )
    return {
        "acked_epoch": acked,
        "total_s": round(acked - last, 3),
        "seg_ack_s": round(acks["SEG"] - last, 3),
        "sr_ack_s": round(acks["SR"] - last, 3),
        "receive_s": round(last - first, 3),
        "job_state": job["state"],
        "trigger": job["trigger"],
        "stages": job_stages(job, acked, last)[1],
    }


# -- one model --------------------------------------------------------------------------------


def model_manifest(name: str, work: Path) -> Path:
    """``unet`` (generated, 3 segments), ``tissue`` (bundled), or a manifest path."""
    if name == "unet":
        from bench.unet import FULL, write_unet

        return write_unet(work / "unet", FULL)
    if name == "tissue":
        return TISSUE
    return Path(name).resolve()


def worker_timings(log_text: str) -> list[dict[str, float]]:
    """The worker's per-job timing lines (``timing ms: ...``) as ``{part: ms}``, in order."""
    return [
        {part: float(ms) for part, ms in TIMING_PARTS.findall(line.split("timing ms:", 1)[1])}
        for line in log_text.splitlines()
        if "timing ms:" in line
    ]


def run_model(name: str, args: Any, tmp: Path) -> list[dict[str, Any]]:
    """One result per ``--prepare`` value: the node restarted for each, one engine build."""
    work = tmp / f"e2e-{Path(name).stem}"
    work.mkdir(parents=True)
    manifest = model_manifest(name, work)
    out: list[dict[str, Any]] = []
    with ResultsSCP() as scp:
        port, data, cfg = free_port(), work / "data", work / "config.toml"
        cfg.write_text(config_text(data, port, scp.port, manifest, args, args.prepare[0]))
        if args.engine_cache is not None:  # compiled artefacts shared with other runs
            args.engine_cache.mkdir(parents=True, exist_ok=True)
            data.mkdir(mode=0o700)
            (data / "engines").symlink_to(args.engine_cache.resolve(), target_is_directory=True)
        print(f"[gpu-e2e] {name}: segnode engine build ...", flush=True)
        build = engine_build(work, cfg, args)
        for index, prepare in enumerate(args.prepare):
            try:
                result = run_variant(name, args, work, scp, manifest, prepare, index)
            except Exception as exc:  # one variant failing must not lose the other's figures
                result = {"model": name, "error": f"{type(exc).__name__}: {exc}"}
            result.update(prepare=prepare, engine_build=build)
            out.append(result)
    return out


def run_variant(
    name: str,
    args: Any,
    work: Path,
    scp: ResultsSCP,
    manifest: Path,
    prepare: str,
    index: int,
) -> dict[str, Any]:
    """Serve with ``[results] prepare = prepare`` and send the warm-up and measured series."""
    print(f"[gpu-e2e] {name} ({prepare}): generating {args.runs + 1} series ...", flush=True)
    seed = args.seed + 1000 * index
    series = [make_series(args.slices, seed + k, args.phantom) for k in range(args.runs + 1)]
    result: dict[str, Any] = {"model": name, "manifest": str(manifest), "prepare": prepare}
    port, data, cfg = free_port(), work / "data", work / "config.toml"
    cfg.write_text(config_text(data, port, scp.port, manifest, args, prepare))
    node_log = work / "node.log"
    log_start = node_log.stat().st_size if node_log.exists() else 0
    stem = Path(name).stem
    first_series = make_series(args.slices, seed + 999, args.phantom)
    with serve(work, cfg, port) as (proc, ready_s):
        gpu = GpuMemory(proc.pid)
        gpu.start()
        spawned = time.time() - ready_s
        result["serve_ready_s"] = round(ready_s, 2)
        # The engine loads in the background ([model] load): the node logs when jobs can start.
        listening = time.monotonic()
        wait_log(node_log, log_start, "; jobs start", args.timeout + 900)
        result["engine_ready_s"] = round(ready_s + time.monotonic() - listening, 2)
        runs = []
        # Restart to first result: a series sent as soon as jobs start. With a compiled model
        # not cached (--cold), it runs eagerly while the model compiles; the measured series
        # then wait for the compiled one.
        first = one_series(port, data, scp, first_series, args.timeout)
        result["first_result"] = first
        result["first_result_s"] = round(first["acked_epoch"] - spawned, 2)
        print(f"[gpu-e2e] {name}: first result {result['first_result_s']} s after spawn")
        if "eager while compiling" in node_log.read_text(errors="replace"):
            found = wait_log(
                node_log, log_start, "in use from the next job", args.timeout, "failed ("
            )
            result["compiled_ready_s"] = round(time.time() - spawned, 2)
            if found != "in use from the next job":
                result["compile_failed"] = True
        for k, datasets in enumerate(series):
            r = one_series(port, data, scp, datasets, args.timeout)
            print(f"[gpu-e2e] {name} ({prepare}): series {k} {json.dumps(r)[:400]}", flush=True)
            if k:  # the first series is the warm-up
                runs.append(r)
            else:
                result["warm_up"] = r
            partial = args.out / f"partial-{stem}-{prepare}.json"  # if cut short
            partial.write_text(json.dumps({**result, "runs": runs}, indent=1) + "\n")
        result["gpu_peak_gib"] = gpu.stop()  # the node process, engine load included
        result["node_vmhwm_gib"] = process_peak_rss(proc.pid)
    with node_log.open("rb") as f:
        f.seek(log_start)
        log = f.read().decode(errors="replace")
    result["engine_ready_log"] = [x for x in log.splitlines() if "engine ready" in x][-1:]
    timings = worker_timings(log)[1:]  # the first job is the warm-up
    peaks = [float(x) for x in re.findall(r"peak RSS ([0-9.]+) GiB", log)[1:]]
    result["job_peak_rss_gib"] = max(peaks) if peaks else None
    result["worker_ms"] = timings
    result["worker_ms_medians"] = {
        part: round(statistics.median(t[part] for t in timings if part in t), 1)
        for part in dict.fromkeys(p for t in timings for p in t)
    }
    totals = [r["total_s"] for r in runs]
    median = sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2]
    per_stage: dict[str, list[float]] = {}
    for r in runs:
        for s in r["stages"]:
            per_stage.setdefault(s["stage"], []).append(s["seconds"])
    result.update(
        series=f"512x512x{args.slices}",
        engine=args.engine,
        runs_s=totals,
        total_s=round(statistics.median(totals), 3),
        receive_s=median["receive_s"],
        trigger=median["trigger"],
        stages=median["stages"],
        stage_medians_s={k: round(statistics.median(v), 3) for k, v in per_stage.items()},
        runs=runs,
    )
    return result


# -- report -----------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError:
        env["torch"] = env["gpu"] = "not installed"
    return env


def markdown(report: dict[str, Any]) -> str:
    env = report["env"]
    lines = [
        f"# GPU end to end ({env['gpu']}, torch {env.get('torch')}, {env['date']})",
        "",
        f"Command: `{report['command']}`. Last C-STORE response (at the SCU) -> SEG and SR "
        "both acknowledged by a pynetdicom SCP on loopback; one warm-up series, then "
        f"{report['runs']} fresh series (new UIDs), one association each; median.",
        "",
        "| model | prepare | median s | runs s | engine build s | listening s | engine ready s | "
        + " | ".join(s for s, _, _ in STAGES)
        + " |",
        "|---|---|---:|---|---:|---:|---:|" + "---:|" * len(STAGES),
    ]
    for r in report["models"]:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r.get('prepare', '-')} | error: {r['error'][-300:]!r} |"
            )
            continue
        med = r["stage_medians_s"]
        build = r["engine_build"].get("seconds", "-")
        lines.append(
            f"| {r['model']} | {r.get('prepare', '-')} | **{r['total_s']}** | "
            f"{', '.join(map(str, r['runs_s']))} | "
            f"{build} | {r['serve_ready_s']} | {r.get('engine_ready_s', '-')} | "
            + " | ".join(str(med.get(s, "-")) for s, _, _ in STAGES)
            + " |"
        )
    lines += [
        "",
        "Listening / engine ready: seconds from `segnode serve`'s spawn to its DICOM port "
        "accepting connections and to its engine being loaded (jobs start), the compiled "
        "model cached. Stage columns: median seconds over the measured runs (ledger "
        "timestamps).",
        "",
    ]
    parts = [p for p, _ in WORKER_COLUMNS]
    lines += [
        "Worker, per job (its `timing ms` log lines; medians, ms):",
        "",
        "| model | prepare | " + " | ".join(title for _, title in WORKER_COLUMNS) + " |",
        "|---|---|" + "---:|" * len(parts),
    ]
    for r in report["models"]:
        if "error" not in r:
            w = r.get("worker_ms_medians", {})
            lines.append(
                f"| {r['model']} | {r.get('prepare', '-')} | "
                + " | ".join(str(w.get(p, "-")) for p in parts)
                + " |"
            )
    lines.append("")
    for r in report["models"]:
        if "error" not in r:
            lines.append(f"- {r['model']} ({r.get('prepare')}): engine {r['engine_ready_log']}")
            lines.append(
                f"  - memory: node peak RSS per job {r.get('job_peak_rss_gib')} GiB (process "
                f"VmHWM {r.get('node_vmhwm_gib')} GiB); GPU, the node process per NVML, peak "
                f"{r.get('gpu_peak_gib')} GiB"
            )
            if "first_result_s" in r:
                compiled = (
                    f"; eager while compiling, compiled model in use {r['compiled_ready_s']} s "
                    "after spawn"
                    if "compiled_ready_s" in r
                    else ""
                )
                lines.append(
                    f"  - restart to first result (spawn -> SEG+SR acknowledged, the series "
                    f"sent when jobs can start): **{r['first_result_s']} s** (its last "
                    f"response -> acks {r['first_result']['total_s']} s, its sending "
                    f"{r['first_result']['receive_s']} s){compiled}"
                )
    return "\n".join(lines) + "\n"


#: The worker's timing parts shown in the report, and their column titles.
WORKER_COLUMNS = (
    ("inference", "inference"),
    ("prepare", "prepare"),
    ("inference waited", "waited for prepare"),
    ("after inference", "after inference"),
    ("SEG encode", "SEG encode"),
    ("check", "check"),
    ("statistics", "statistics"),
    ("SR encode", "SR encode"),
    ("files", "files"),
    ("ledger", "ledger"),
)


def _have_matplotlib() -> bool:
    """Whether the timelines can be drawn (the ``[bench]`` extra); the figures need not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    p = argparse.ArgumentParser(prog="python -m bench.gpu_e2e", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    p.add_argument(
        "--models", nargs="+", default=["unet", "tissue"], help="unet, tissue or manifest paths"
    )
    p.add_argument("--runs", type=int, default=5, help="measured series after the warm-up")
    p.add_argument("--slices", type=int, default=128)
    p.add_argument(
        "--precision",
        choices=("fp16", "fp32", "bf16"),
        default="fp16",
        help="torch: fp16 or fp32; openvino: bf16 (fp16 is taken as bf16) or fp32",
    )
    p.add_argument("--no-compile", action="store_true", help="run the model eagerly")
    p.add_argument(
        "--cold",
        action="store_true",
        help="no `segnode engine build` first: the node starts with nothing compiled",
    )
    p.add_argument(
        "--wait-compiled",
        action="store_true",
        help="[model] eager_while_compiling = false: no job before the compiled model is loaded",
    )
    p.add_argument(
        "--engine",
        choices=("torch", "onnxruntime", "openvino"),
        default="torch",
        help="onnxruntime or openvino: the same run on the CPU (the CPU-only hospital)",
    )
    p.add_argument(
        "--prepare",
        nargs="+",
        choices=("concurrent", "before"),
        default=["concurrent"],
        help="[results] prepare of the node; several: one node start per value",
    )
    p.add_argument("--seed", type=int, default=4200)
    p.add_argument(
        "--phantom",
        choices=("synthetic", "anatomy"),
        default="synthetic",
        help="anatomy: 117 structures of their own HU (bench.totalseg_standin.anatomy_hu)",
    )
    p.add_argument("--timeout", type=float, default=300, help="per series, seconds")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument(
        "--engine-cache",
        type=Path,
        default=None,
        help="use this folder as the node's data_dir/engines (keep compiled models between "
        "runs; `python -m bench.torch_warm --work W` leaves them in W/engines)",
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "env": environment(),
        "command": "python -m bench.gpu_e2e "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "runs": args.runs,
        "models": [],
    }
    tmp = args.work or Path(tempfile.mkdtemp(prefix="segnode-gpu-e2e-"))
    for name in args.models:
        try:
            results = run_model(name, args, tmp)
        except Exception as exc:  # one model failing must not lose the other's figures
            results = [{"model": name, "error": f"{type(exc).__name__}: {exc}"}]
        for result in results:
            report["models"].append(result)
            if "stages" in result and _have_matplotlib():
                stem = Path(name).stem
                if len(args.prepare) > 1:
                    stem += f"-{result['prepare']}"
                plot(
                    {k: result[k] for k in ("series", "total_s", "stages", "receive_s")}
                    | {
                        "series": f"{result['series']} ({Path(name).stem}, {args.engine}, "
                        f"prepare {result['prepare']})"
                    },
                    args.out / f"timeline-{stem}.png",
                )
        (args.out / "gpu_e2e.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "gpu_e2e.md").write_text(markdown(report))
    for partial in args.out.glob("partial-*.json"):  # the report holds them now
        partial.unlink()
    print(markdown(report))
    return 0 if all("error" not in r for r in report["models"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
