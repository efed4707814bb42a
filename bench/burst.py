"""A burst of series at once: ``python -m bench.burst`` (``make bench-burst``).

The same node, the same series, twice in one invocation: first one job at a time
(``[engine] lanes = 1``), then with the lanes of ``--lanes`` (default 0: the node's automatic
choice). Per variant:

1. ``segnode serve`` starts on a fresh data directory, results to a pynetdicom Storage SCP of
   this process (everything on ``127.0.0.1``); a warm-up series runs, then the urgent series
   alone (its *solo* time: last C-STORE response -> SEG and SR acknowledged).
2. The burst: ``--series`` series of 512 x 512 x ``--slices`` (distinct UIDs, made before
   anything is timed), sent by ``--senders`` concurrent senders as fast as they go (DCMTK
   ``storescu`` where it is installed, else pynetdicom, one process per association), each
   series on its own association. ``--bad 1`` makes one of them corrupt (a slice with
   RescaleSlope 0): its job must fail with the reason, and the others must not notice.
3. ``--urgent-at S`` seconds into the burst, one more series arrives from the calling AE
   ``URGENT``, which ``[[series.senders]]`` gives priority 10. Its latency is compared with
   its solo time plus one job (the one-at-a-time variant's seconds per series).

Reported per variant: series per minute (first C-STORE to the last SEG and SR acknowledged),
GPU busy % (NVML utilisation, 50 ms samples, over the same span; none on a CPU), the node's
share of time in its models (the worker's ``timing ms`` lines), jobs failed and why, the
urgent series' latency, the node's peak RSS and GPU memory, and pages swapped out. The ratio
of the variants' throughput is the figure of issue 36.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.gpu_e2e import (
    GpuMemory,
    ResultsSCP,
    config_text,
    engine_build,
    environment,
    make_series,
    model_manifest,
    process_peak_rss,
    process_tree,
    serve,
    wait_log,
)
from bench.ingest import LOOPBACK, free_port, ledger_job, wait
from segnode.engines.models import default_manifest_path

FAILING_AE = "FAILING"
URGENT_AE = "URGENT"
#: ``[results] encode_processes`` of a variant with the suffix ``e``.
ENCODERS = 2
SLOWEST = [0.0]  # the slowest C-STORE response of the variant, seconds


def swapped_out() -> int:
    """Pages swapped out since boot (``/proc/vmstat`` pswpout)."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("pswpout "):
            return int(line.split()[1])
    return 0


class HostCpu:
    """The host's CPU use and one process's CPU time (with its children's), sampled every
    0.25 s on a thread (``/proc/stat`` and ``/proc/PID/stat``), so that a span's figures can
    be read afterwards: on a CPU-only machine they say whether a burst is bound by the
    cores."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        #: ``(epoch, host busy ticks, host total ticks, process ticks)``.
        self.samples: list[tuple[float, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-cpu", daemon=True)

    def _sample(self) -> tuple[float, int, int, int]:
        cpu = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)  # idle + iowait
        own = 0
        for pid in process_tree(self.pid):  # the node and its model processes
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                own += int(fields[11]) + int(fields[12])  # utime + stime
            except (OSError, IndexError, ValueError):
                pass
        if not own and self.samples:
            own = self.samples[-1][3]
        return time.time(), sum(cpu) - idle, sum(cpu), own

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self._sample())
            self._stop.wait(0.25)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def figures(self, start: float, end: float) -> dict[str, float | None]:
        """Host CPU busy % and the process's CPU seconds between ``start`` and ``end``."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {"host_cpu_busy_pct": None, "node_cpu_s": None}
        first, last = inside[0], inside[-1]
        hz = os.sysconf("SC_CLK_TCK")
        total = last[2] - first[2]
        return {
            "host_cpu_busy_pct": round(100 * (last[1] - first[1]) / total, 1) if total else None,
            "node_cpu_s": round((last[3] - first[3]) / hz, 2),
        }


def corrupt(datasets: list[Any]) -> list[Any]:
    """The series with its middle slice's RescaleSlope 0: no volume can be built from it."""
    middle = datasets[len(datasets) // 2]
    middle.RescaleSlope = 0
    return datasets


def write_series(folder: Path, datasets: list[Any]) -> Path:
    folder.mkdir(parents=True)
    for k, ds in enumerate(datasets):
        ds.save_as(folder / f"{k:04d}.dcm", enforce_file_format=True)
    return folder


def send_dcmtk(port: int, folder: Path, calling: str) -> float:
    """``storescu`` of one series folder on one association; epoch of its end."""
    cmd = ["storescu", "-aet", calling, "-aec", "SEGNODE", "+sd", "-xs", LOOPBACK, str(port)]
    done = subprocess.run([*cmd, str(folder)], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"storescu exit {done.returncode}: {done.stderr[-500:]}")
    return time.time()


def failing_model(work: Path) -> Path:
    """A model whose network file is corrupt (the bundled tissue model's manifest beside a
    file that is not ONNX): every job of it fails when its engine cannot load it."""
    folder = work / "failing-model"
    folder.mkdir(parents=True, exist_ok=True)
    raw = json.loads(default_manifest_path().read_text())
    raw["name"] = "failing"
    (folder / "failing.json").write_text(json.dumps({**raw, "onnx": "failing.onnx"}))
    (folder / "failing.onnx").write_bytes(b"this is not an ONNX model\n" * 64)
    return folder / "failing.json"


def send_any(port: int, series: dict[str, Any], calling: str = "MODALITY") -> float:
    """Send one series on one association as ``calling``; epoch of the last response."""
    if series.get("folder") is not None and series.get("sender") == "pynetdicom":
        return send_pynetdicom_process(port, series["folder"], calling)
    if series.get("folder") is not None:
        return send_dcmtk(port, series["folder"], calling)
    return send_datasets(port, series["datasets"], calling)


def send_pynetdicom_process(port: int, folder: Path, calling: str) -> float:
    """A pynetdicom sender in its own process (``python -m bench.burst --send``): several
    pynetdicom associations in threads of one process lose a C-STORE response now and then
    (pynetdicom's reactor race with fast peers: the sender waits for it until the node's
    idle timeout aborts the association), which a real modality does not."""
    cmd = [sys.executable, "-m", "bench.burst", "--send", str(folder), "--port", str(port)]
    done = subprocess.run([*cmd, "--calling", calling], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"sender exit {done.returncode}: {done.stderr.strip()[-500:]}")
    last, slowest = (float(x) for x in done.stdout.split())
    SLOWEST[0] = max(SLOWEST[0], slowest)
    return last


def send_datasets(port: int, datasets: list[Any], calling: str) -> float:
    """Send ``datasets`` on one association (pynetdicom, this thread)."""
    from pydicom.uid import ExplicitVRLittleEndian
    from pynetdicom import AE

    ae = AE(ae_title=calling)
    ae.maximum_pdu_size = 0
    # a modality waits for its responses: pynetdicom's 30 s default aborts a slow one
    ae.dimse_timeout = ae.network_timeout = ae.acse_timeout = 600
    ae.add_requested_context(datasets[0].SOPClassUID, ExplicitVRLittleEndian)
    assoc = ae.associate(LOOPBACK, port, ae_title="SEGNODE")
    if not assoc.is_established:
        raise RuntimeError("association rejected")
    last = 0.0
    try:
        for k, ds in enumerate(datasets):
            t0 = time.time()
            status = assoc.send_c_store(ds)
            last = time.time()
            SLOWEST[0] = max(SLOWEST[0], last - t0)
            if not status or int(status.Status) != 0:
                why = "no response (aborted)" if not status else f"0x{int(status.Status):04X}"
                raise RuntimeError(
                    f"C-STORE {k} failed after {last - t0:.1f} s: {why}; "
                    f"association {'aborted' if assoc.is_aborted else 'open'}"
                )
    finally:
        if assoc.is_established:
            assoc.release()
    return last


def stage_offsets(job: dict[str, Any], since: float) -> dict[str, float]:
    """A ledger job's stage timestamps (``*_at``, UTC) as seconds after the epoch ``since``."""
    out = {}
    for key, value in job.items():
        if key.endswith("_at") and value:
            at = datetime.fromisoformat(str(value)).replace(tzinfo=UTC).timestamp()
            out[key] = round(at - since, 3)
    return out


def profile_node(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    """``py-spy record --gil`` of the node (only the threads holding the GIL: what the
    threads compete for), collapsed stacks into ``out``; None where py-spy is missing."""
    exe = shutil.which("py-spy")
    if exe is None:
        print("[burst] --profile: py-spy not found", flush=True)
        return None
    cmd = [exe, "record", "--gil", "--threads", "--nonblocking", "--rate", "200"]
    cmd += ["--format", "raw", "--output", str(out), "--pid", str(pid)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def acked(scp: ResultsSCP, study: str) -> float | None:
    a = scp.acks(study)
    return max(a["SEG"], a["SR"]) if "SEG" in a and "SR" in a else None


def model_seconds(log: str) -> list[float]:
    """The worker's inference seconds per job, from its ``timing ms`` lines."""
    return [float(m) / 1e3 for m in re.findall(r"; inference ([0-9.]+), prepare", log)]


def run_variant(
    args: Any, work: Path, manifest: Path, variant: str, series: list[dict[str, Any]],
    warm: dict[str, Any], urgent: dict[str, Any], period_one: float | None,
) -> dict[str, Any]:  # fmt: skip
    base = variant.rstrip("pe")
    process = "p" in variant[len(base) :]  # [engine] model_process = true
    encoders = ENCODERS if "e" in variant[len(base) :] else 0  # [results] encode_processes
    lanes, _, slots_text = base.partition(":")
    lanes_n, slots = int(lanes), int(slots_text or 0)
    tag = variant.replace(":", "-")
    data = work / f"data-lanes{tag}"
    # one compiled-model cache for every variant: the one-at-a-time variant builds it
    # (segnode engine build), the others load it instead of compiling again at their start
    (work / "engines").mkdir(exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    if not (data / "engines").exists():
        (data / "engines").symlink_to((work / "engines").resolve(), target_is_directory=True)
    port = free_port()
    cfg = work / f"config-lanes{tag}.toml"
    out: dict[str, Any] = {
        "lanes_setting": lanes_n,
        "model_slots_setting": slots,
        "model_process": process,
        "encode_processes": encoders,
    }
    with ResultsSCP() as scp:
        text = config_text(data, port, scp.port, manifest, args)
        if lanes_n != 1 and args.lane_threads:
            text = text.replace("[model]\n", f"[model]\nthreads = {args.lane_threads}\n", 1)
        text += f"\n[engine]\nlanes = {lanes_n}\n" + (f"model_slots = {slots}\n" if slots else "")
        text += "model_process = true\n" if process else ""
        if encoders:
            text = text.replace("[results]\n", f"[results]\nencode_processes = {encoders}\n", 1)
        text += f'\n[[series.senders]]\nae_title = "{URGENT_AE}"\npriority = 10\n'
        if args.failing_model:  # its series go to a model whose network file is corrupt
            text += (
                f'\n[models.failing]\nmanifest = "{failing_model(work)}"\n'
                f'engine = "{args.engine}"\n'
                f'\n[[rules]]\nname = "failing"\ncalling_ae = ["{FAILING_AE}"]\n'
                'models = ["failing"]\n\n[[rules]]\nname = "default"\n'
            )
        cfg.write_text(text)
        if variant == "1" and args.engine == "torch":
            out["engine_build"] = engine_build(work, cfg, args)
        node_log = work / "node.log"
        offset = node_log.stat().st_size if node_log.exists() else 0
        with serve(work, cfg, port) as (proc, _ready):
            gpu = GpuMemory(proc.pid)
            has_gpu = gpu.start()
            host = HostCpu(proc.pid)
            host.start()
            wait_log(node_log, offset, "; jobs start", 900)
            for name, one, calling in (
                ("warm_up", warm, "MODALITY"),
                ("urgent_solo", urgent, URGENT_AE),
            ):
                last = send_any(port, one[name], calling)
                done = wait(lambda o=one[name]: acked(scp, o["study"]), args.timeout, name)
                out[f"{name}_s"] = round(done - last, 3)
            started = node_log.read_text(errors="replace")[offset:]
            lanes_line = re.findall(r"worker: (\d+) lane", started)
            out["lanes"] = int(lanes_line[-1]) if lanes_line else None
            slots_line = re.findall(r"(\d+) model slot", started)
            out["model_slots"] = int(slots_line[-1]) if slots_line else None
            log_mark = node_log.stat().st_size
            swap0 = swapped_out()
            SLOWEST[0] = 0.0
            print(
                f"[burst] lanes={variant}: {len(series)} series from {args.senders} senders",
                flush=True,
            )
            profile = args.out / f"pyspy-lanes{tag}.txt"
            spy = profile_node(proc.pid, profile) if args.profile else None
            start = time.time()
            sent: dict[str, float] = {}
            errors: list[str] = []

            def sender(share: list[dict[str, Any]]) -> None:
                for s in share:
                    try:
                        calling = FAILING_AE if s.get("bad") == "model" else "MODALITY"
                        sent[s["study"]] = send_any(port, s, calling)
                    except Exception as exc:
                        errors.append(f"{s['study']}: {exc}")

            threads = [
                threading.Thread(target=sender, args=(series[k :: args.senders],))
                for k in range(args.senders)
            ]
            for t in threads:
                t.start()
            time.sleep(max(0.0, start + args.urgent_at - time.time()))
            try:
                urgent_last = send_any(port, urgent["burst"], URGENT_AE)
            except Exception as exc:
                errors.append(f"urgent: {exc}")
                urgent_last = time.time()
            for t in threads:
                t.join()
            good = [s for s in series if not s.get("bad")]
            deadline = time.time() + args.timeout  # after the last series was sent
            while time.time() < deadline:
                if all(acked(scp, s["study"]) for s in good) and acked(
                    scp, urgent["burst"]["study"]
                ):
                    break
                time.sleep(0.1)
            end = max(acked(scp, s["study"]) or time.time() for s in good)
            urgent_done = acked(scp, urgent["burst"]["study"])
            jobs = {
                s["study"]: wait(
                    lambda s=s: (
                        (j := ledger_job(data, s["uid"]))
                        and j["state"] in ("sent", "failed", "done")
                        and j
                    ),
                    120,
                    "job state",
                )
                for s in series
            }
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
                spy.wait(30)
            urgent_job = ledger_job(data, urgent["burst"]["uid"]) or {}
            gpu_peak = gpu.stop()
            host.stop()
            out["node_vmhwm_gib"] = process_peak_rss(proc.pid)
            children = [process_peak_rss(pid) for pid in process_tree(proc.pid)[1:]]
            out["model_process_vmhwm_gib"] = max((c for c in children if c), default=None)
            out["children_vmhwm_gib"] = [c for c in children if c]
        log = node_log.read_text(errors="replace")[log_mark:]
    span = end - start
    inference = model_seconds(log)
    out.update(
        series=len(series),
        senders=args.senders,
        sender=f"{series[0]['sender']} (a process per association)",
        send_errors=errors,
        slowest_store_response_s=round(SLOWEST[0], 2),
        node_warnings=[x[:300] for x in log.splitlines() if " WARNING " in x or " ERROR " in x][
            :20
        ],
        span_s=round(span, 2),
        # the senders' last response: after it the node only catches up
        sent_span_s=round(max(sent.values(), default=start) - start, 2),
        series_per_min=round(60 * len(good) / span, 2),
        seconds_per_series=round(span / len(good), 3),
        gpu_busy_pct=gpu.busy(start, end) if has_gpu else None,
        gpu_peak_gib=gpu_peak,
        model_busy_pct=round(100 * sum(inference) / span, 1),
        model_s_median=round(statistics.median(inference), 3) if inference else None,
        swapped_out_pages=swapped_out() - swap0,
        **host.figures(start, end),
        unacknowledged=[s["study"] for s in good if not acked(scp, s["study"])],
        failed={k: v.get("reason") for k, v in jobs.items() if v["state"] == "failed"},
        bad_failed_with_reason=[
            jobs[s["study"]]["state"] == "failed" and bool(jobs[s["study"]].get("reason"))
            for s in series
            if s.get("bad")
        ],
        urgent_s=round(urgent_done - urgent_last, 3) if urgent_done else None,
        urgent_sent_at_s=round(urgent_last - start, 2),
        # the urgent job's stages, seconds after its last instance was acknowledged
        urgent_stages=stage_offsets(urgent_job, urgent_last),
        urgent_timing=next(
            (
                x.split("timing ms: ", 1)[1]
                for x in log.splitlines()
                if f"job {urgent_job.get('id')}: timing ms" in x
            ),
            None,
        ),  # fmt: skip
    )
    if period_one is not None and out["urgent_s"] is not None:
        out["urgent_bound_s"] = round(out["urgent_solo_s"] + period_one, 3)
        out["urgent_within_bound"] = out["urgent_s"] <= out["urgent_bound_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--send", type=Path, help=argparse.SUPPRESS)  # one sender process
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--calling", default="MODALITY", help=argparse.SUPPRESS)
    p.add_argument("--model", default="unet", help="unet, tissue, or a manifest path")
    p.add_argument("--engine", default="torch", help="torch (GPU) or onnxruntime (CPU)")
    p.add_argument("--precision", default="fp16")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--series", type=int, default=20)
    p.add_argument("--slices", type=int, default=300)
    p.add_argument("--senders", type=int, default=4)
    p.add_argument(
        "--lanes",
        default="0",
        help="[engine] lanes of the variants after the one at a time, comma-separated, each "
        "LANES or LANES:MODEL_SLOTS (0: the node's automatic choice), then p: the models in "
        "a process of their own ([engine] model_process), e: the SEGs encoded in "
        f"{ENCODERS} processes of their own ([results] encode_processes)",
    )
    p.add_argument("--urgent-at", type=float, default=10.0)
    p.add_argument(
        "--lane-threads", type=int, default=0, help="[model] threads of the lanes' variant"
    )
    p.add_argument("--bad", type=int, default=1, help="corrupt series in the burst")
    p.add_argument(
        "--failing-model",
        type=int,
        default=1,
        help="series of the burst (sent as FAILING) whose model fails: a [models.failing] "
        "whose network file is corrupt, chosen by a routing rule",
    )
    p.add_argument("--sender", choices=("auto", "storescu", "pynetdicom"), default="auto")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument(
        "--profile", action="store_true", help="py-spy --gil of the node during each burst"
    )
    p.add_argument("--seed", type=int, default=36000)
    p.add_argument("--work", type=Path)
    p.add_argument("--out", type=Path, default=Path("bench/out/burst"))
    args = p.parse_args(argv)
    if args.send is not None:
        from pydicom import dcmread

        files = sorted(args.send.glob("*.dcm"))
        last = send_datasets(args.port, [dcmread(f) for f in files], args.calling)
        print(last, SLOWEST[0])
        return 0
    args.wait_compiled, args.cold, args.engine_cache, args.phantom = True, False, None, "synthetic"
    sender = args.sender
    if sender == "auto":
        sender = "storescu" if shutil.which("storescu") else "pynetdicom"
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="segnode-burst-"))
    work.mkdir(parents=True, exist_ok=True)
    manifest = model_manifest(args.model, work)
    print(f"[burst] making {args.series + 3} series of {args.slices} slices ...", flush=True)

    def one(seed: int, name: str, bad: bool | str = False) -> dict[str, Any]:
        datasets = make_series(args.slices, seed)
        if bad is True:
            corrupt(datasets)
        s = {"datasets": datasets, "study": str(datasets[0].StudyInstanceUID),
             "uid": str(datasets[0].SeriesInstanceUID), "bad": bad}  # fmt: skip
        s["folder"] = write_series(work / "series" / name, datasets)
        s["datasets"], s["sender"] = None, sender
        return s

    def bad(k: int) -> bool | str:
        """Series 3 corrupt (--bad), series 7 sent to a model that fails (--failing-model)."""
        if k == 3 and args.bad > 0:
            return True
        return "model" if k == 7 and args.failing_model > 0 else False

    burst = [one(args.seed + k, f"s{k:02d}", bad=bad(k)) for k in range(args.series)]
    warm = {"warm_up": one(args.seed + 900, "warm")}
    urgent = {
        "urgent_solo": one(args.seed + 901, "urgent-solo"),
        "burst": one(args.seed + 902, "urgent"),
    }
    report: dict[str, Any] = {
        "environment": environment(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    variants = []
    period_one = None
    for variant in ("1", *str(args.lanes).split(",")):
        # the same series for every variant: fresh data directories, so new jobs
        v = run_variant(args, work, manifest, variant, burst, warm, urgent, period_one)
        if variant == "1":
            period_one = v["seconds_per_series"]
        variants.append(v)
        print(f"[burst] {json.dumps(v)}", flush=True)
        (args.out / "burst.json").write_text(json.dumps({**report, "variants": variants}, indent=1))
    if args.work is None:  # the series and the two data folders: gigabytes
        shutil.rmtree(work, ignore_errors=True)
    one_at_a_time = variants[0]
    report["variants"] = variants
    ratios = [round(v["series_per_min"] / one_at_a_time["series_per_min"], 2) for v in variants]
    for v, ratio in zip(variants[1:], ratios[1:], strict=True):
        v["throughput_ratio"] = ratio
    report["throughput_ratio"] = max(ratios[1:])
    (args.out / "burst.json").write_text(json.dumps(report, indent=1) + "\n")
    for lanes_run in variants[1:]:
        print(
            f"[burst] one at a time {one_at_a_time['series_per_min']} series/min, "
            f"lanes {lanes_run['lanes']} (model slots {lanes_run['model_slots']}"
            f"{', model process' if lanes_run['model_process'] else ''}"
            f"{', SEG encoders' if lanes_run.get('encode_processes') else ''}) "
            f"{lanes_run['series_per_min']} series/min: "
            f"{lanes_run['throughput_ratio']}x; GPU busy {one_at_a_time['gpu_busy_pct']} -> "
            f"{lanes_run['gpu_busy_pct']} %; model busy {one_at_a_time['model_busy_pct']} -> "
            f"{lanes_run['model_busy_pct']} %; host CPU {one_at_a_time['host_cpu_busy_pct']} -> "
            f"{lanes_run['host_cpu_busy_pct']} %; sent by {lanes_run['sent_span_s']} s of "
            f"{lanes_run['span_s']} s; urgent {lanes_run['urgent_s']} s "
            f"(bound {lanes_run.get('urgent_bound_s')} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
