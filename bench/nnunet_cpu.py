"""Real nnU-Net models on a CPU: segnode FP32, INT8 and BF16 against ``nnUNetPredictor`` (issue 35).

Run on the CPU machine, with OpenVINO in the project's venv and a second Python that has
nnunetv2 (``--peer-python``; nnU-Net's own predictor runs there, in its own process)::

    python -m bench.nnunet_cpu --peer-python /path/to/nnunet-venv/bin/python --out bench/out

Networks (``--networks``):

``tiny``
    The model nnU-Net's own trainer trained on the phantom (``tests/data/nnunet_phantom``,
    :mod:`scripts.make_nnunet_trained`), fold 0 (``nnUNetPredictor`` reads it from a
    checkpoint rebuilt from the committed ONNX:
    :func:`scripts.make_totalseg_oracle.checkpoint_from_onnx`), mirroring on all three axes
    as trained.
``full``
    nnU-Net's default 3d_fullres architecture for CT at 1.5 mm (32-320 features, 6 stages,
    128^3 patch: the 31 M-parameter network of :mod:`bench.nnunet_gpu`), weights from nnU-Net's
    own initialisation but for the last decoder stage and the segmentation head, trained on
    the phantom's labels (:func:`fit_head`: random weights everywhere give near-tie logits, a
    label map of noise, on which no precision's Dice means anything), one fold, mirroring
    ``--full-mirroring``
    (default off: on 2 cores its 8 mirrored passes take hours a series).

For each CT (``--shapes``, default a 512 x 512 x 140 head CT and a 512 x 512 x 300 body CT at
0.7 x 0.7 x 1.25 mm, the phantom's anatomy) and network, side by side in this run:
``nnUNetPredictor`` on the CPU (``predict_single_npy_array``, its own reader, the peer
process), and segnode's :func:`segnode.engines.trained.segment_trained` with ONNX Runtime FP32
(segnode's CPU path before issue 35), ONNX Runtime INT8 (the model calibrated by
:func:`segnode.engines.calibrate.calibrate` on phantom series; for the random-weight ``full``
network the guard is off, its labels are noise), and OpenVINO BF16 (``--paths``: ``bf16``
alone, ``bf16l1`` with the first convolution in float32, ``bf16cal`` as ``segnode model
calibrate --precision bf16 --threshold`` ``--bf16-threshold`` chose). Times are medians of
``--repeats`` runs after a warm-up on a slab; Dice per label against FP32 and against
``nnUNetPredictor``. Writes ``nnunet_cpu.json`` and ``nnunet_cpu.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "nnunet_phantom"


def body_anatomy(
    rng: np.random.Generator,
    sizes: tuple[float, float],
    shift_mm: float,
    body_z: tuple[float, float],
    seed: int | None = None,
) -> Any:
    """A phantom of the benchmark CT's family (:func:`bench.nnunet_gpu.speed_volume`: a body of
    150 x 110 mm half-axes), its size scaled within ``sizes``, shifted within ``shift_mm``,
    with its own noise (``seed``: the noise pattern's, else drawn from ``rng``)."""
    from scripts.nnunet_phantom import Anatomy

    size = float(rng.uniform(*sizes))
    return Anatomy(
        body_axes=(150.0 * size, 110.0 * size),
        body_z=body_z,
        shift=tuple(float(v) for v in rng.uniform(-shift_mm, shift_mm, size=3)),  # type: ignore[arg-type]
        noise_hu=float(rng.uniform(10, 30)),
        seed=int(rng.integers(1 << 30)) if seed is None else seed,
    )


# --------------------------------------------------------------------------- peer side


def peer_main(argv: list[str]) -> int:
    """In the nnunetv2 Python: the trained-model folders (``tiny`` from the committed ONNX's
    fold 0, ``full`` beside it) and ``full``'s import, or ``nnUNetPredictor``'s timings."""
    ap = argparse.ArgumentParser()
    ap.add_argument("action", choices=("folders", "predict"))
    ap.add_argument("--folder", type=Path)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--nifti", type=Path)
    ap.add_argument("--folds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--mirroring", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--bf16-threshold",
        type=float,
        default=0.995,
        help="the accuracy guard of the bf16cal path (segnode model calibrate --threshold)",
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    for key in ("nnUNet_raw", "nnUNet_preprocessed", "nnUNet_results"):
        os.environ.setdefault(key, "/nonexistent")
    import torch  # noqa: PLC0415

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.action == "folders":
        import bench.nnunet_gpu as gpu  # noqa: PLC0415
        from scripts.make_totalseg_oracle import checkpoint_from_onnx  # noqa: PLC0415

        gpu.FOLDS = (0,)  # the committed model's fold 0, as nnU-Net's checkpoint
        tiny = checkpoint_from_onnx(TINY, args.work)
        fingerprint = tiny / "dataset_fingerprint.json"
        if not fingerprint.is_file():  # optional for the import; full_size_folder copies it
            fingerprint.write_text("{}")
        full = gpu.full_size_folder(tiny, args.work)
        fitted = fit_head(full)
        manifest, _, seconds = gpu.import_folder(full, args.work / "imported" / "full", "full")
        args.out.write_text(
            json.dumps(
                {
                    "tiny": str(tiny),
                    "full": str(full),
                    "manifest": str(manifest),
                    "import_s": seconds,
                    "head": fitted,
                }
            )
        )
        return 0
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor  # noqa: PLC0415

    p = nnUNetPredictor(
        tile_step_size=0.5,
        use_gaussian=True,
        use_mirroring=bool(args.mirroring),
        perform_everything_on_device=False,
        device=torch.device("cpu"),
        allow_tqdm=False,
    )
    p.initialize_from_trained_model_folder(
        str(args.folder), use_folds=tuple(args.folds), checkpoint_name="checkpoint_final.pth"
    )
    reader = p.plans_manager.image_reader_writer_class()
    image, props = reader.read_images([str(args.nifti)])
    p.predict_single_npy_array(image[:, :32, :96, :96].copy(), props)  # warm-up
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        labels = p.predict_single_npy_array(image, props)
        times.append(time.perf_counter() - t0)
    seg = args.out.with_suffix(".nii.gz")
    reader.write_seg(labels, str(seg), props)
    args.out.write_text(json.dumps({"times": times, "seg": str(seg)}))
    return 0


def fit_head(folder: Path, steps: int = 150) -> dict[str, Any]:
    """Train the last decoder stage and the segmentation head of the ``full`` network (the
    other weights stay nnU-Net's initialisation) on the phantom's labels: 128^3 phantom
    patches at 1.5 mm through the frozen network once, then ``steps`` Adam steps on random
    64^3 crops of the last stage's input. With random weights everywhere the logits are near
    ties and the label map is noise, on which no precision's Dice means anything; trained this
    way every layer feeds decisions with margins, as in a trained network. Writes the
    checkpoint back; returns the accuracy on the patches."""
    import torch  # noqa: PLC0415
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer  # noqa: PLC0415
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager  # noqa: PLC0415

    from scripts.nnunet_phantom import Grid, sample  # noqa: PLC0415

    torch.manual_seed(0)
    plans = json.loads((folder / "plans.json").read_text())
    dataset = json.loads((folder / "dataset.json").read_text())
    manager = PlansManager(plans)
    net = nnUNetTrainer.build_network_architecture(
        manager, manager.get_configuration("3d_fullres"), 1, len(dataset["labels"]), True
    )
    path = folder / "fold_0" / "checkpoint_final.pth"
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    net.load_state_dict(ckpt["network_weights"])
    net.decoder.deep_supervision = False
    net.eval()
    props = plans["foreground_intensity_properties_per_channel"]["0"]
    lo, hi = props["percentile_00_5"], props["percentile_99_5"]
    stage, head = net.decoder.stages[-1], net.decoder.seg_layers[-1]
    captured: list[Any] = []
    hook = stage.register_forward_pre_hook(lambda _m, inp: captured.append(inp[0].detach()))
    rng = np.random.default_rng(2)
    inputs, targets = [], []
    for i in range(4):
        anatomy = body_anatomy(rng, (0.6, 1.1), 30.0, (-80.0, 80.0), seed=i)
        hu, labels = sample(Grid(slices=128, rows=128, columns=128, pixel=1.5, slice=1.5), anatomy)
        x = (np.clip(hu.astype(np.float32), lo, hi) - props["mean"]) / props["std"]
        with torch.no_grad():
            net(torch.from_numpy(x[None, None]))
        inputs.append(captured.pop())
        targets.append(torch.from_numpy(labels.astype(np.int64))[None])
    hook.remove()
    trained = torch.nn.Sequential(stage, head)
    trained.train()
    opt = torch.optim.Adam(trained.parameters(), lr=2e-3)
    crop = 64
    for step in range(steps):
        k = step % len(inputs)
        z, y, x0 = (int(v) for v in rng.integers(0, 128 - crop + 1, size=3))
        window = (slice(None), slice(None), slice(z, z + crop), slice(y, y + crop))
        window += (slice(x0, x0 + crop),)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(
            trained(inputs[k][window]), targets[k][window[0:1] + window[2:]]
        )
        loss.backward()
        opt.step()
    trained.eval()
    with torch.no_grad():
        hits = sum(
            int((trained(inp).argmax(1) == t).sum()) for inp, t in zip(inputs, targets, strict=True)
        )
    accuracy = hits / sum(t.numel() for t in targets)
    ckpt["network_weights"] = net.state_dict()
    torch.save(ckpt, path)
    final = float(loss.detach())
    print(
        f"  full network: last stage and head trained, accuracy {accuracy:.4f} (loss {final:.4f})"
    )
    return {"accuracy": round(accuracy, 4), "loss": round(final, 4), "steps": steps}


# --------------------------------------------------------------------------- segnode side


def calibrated_copy(
    manifest: Path, work: Path, name: str, *, rounds: int, tiles: int
) -> tuple[Path, dict[str, Any]]:
    """A copy of the model folder calibrated to INT8 on four series like the benchmark's CTs
    (the same anatomy's family: body size within 10 %, shifted, other noise; 256 x 256 at
    1.4 mm, 2.5 mm slices), the last held out for the guard."""
    from scripts.nnunet_phantom import Grid, OracleCase, write_dicom_case
    from segnode.engines.calibrate import GuardFailed, calibrate

    folder = work / f"int8-{name}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(manifest.parent, folder)
    series = []
    rng = np.random.default_rng(11)
    for i in range(4):
        grid = Grid(slices=72, rows=256, columns=256, pixel=1.4, slice=2.5)
        half_z = 72 * 2.5 / 2
        anatomy = body_anatomy(rng, (0.9, 1.1), 8.0, (-0.8 * half_z, 0.8 * half_z))
        case = OracleCase(f"cal{i}", grid, anatomy)
        series.append(work / "calibration" / case.name)
        if not series[-1].is_dir():
            write_dicom_case(case, series[-1], 40 + i)
    t0 = time.perf_counter()
    info: dict[str, Any] = {}
    try:
        report = calibrate(
            folder / manifest.name,
            series,
            held_out=1,
            threshold=0.99,
            tiles_per_series=tiles,
            max_rounds=rounds,
            progress=lambda line: print("   ", line, flush=True),
        )
    except GuardFailed as exc:  # measured all the same, for its speed: the guard off
        print(f"    {exc}", flush=True)
        info["guard_failed_dice_min"] = exc.report.dice_min
        report = calibrate(
            folder / manifest.name,
            series,
            held_out=1,
            threshold=0.0,
            tiles_per_series=tiles,
            max_rounds=1,
        )
    info.update(
        seconds=round(time.perf_counter() - t0, 1),
        tiles=report.tiles,
        kept_float=[n for n, _ in report.kept_float],
        dice_min_vs_fp32_held_out=report.dice_min,
    )
    return folder / manifest.name, info


def bf16_calibrated_copy(
    manifest: Path, work: Path, name: str, threshold: float
) -> tuple[Path, dict[str, Any]]:
    """A copy of the model folder through ``segnode model calibrate --precision bf16`` on
    the INT8 calibration's series (:func:`calibrated_copy` writes them; the last held out) at
    ``threshold``: the tool chooses how many first convolutions run in float32."""
    from segnode.engines.calibrate import GuardFailed, calibrate

    folder = work / f"bf16-{name}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(manifest.parent, folder)
    series = sorted((work / "calibration").glob("cal*"))
    t0 = time.perf_counter()
    info: dict[str, Any] = {"threshold": threshold}
    try:
        report = calibrate(
            folder / manifest.name,
            series,
            precision="bf16",
            held_out=1,
            threshold=threshold,
            progress=lambda line: print("   ", line, flush=True),
        )
    except GuardFailed as exc:
        info["guard_failed"] = str(exc)
        info["rounds"] = exc.report.rounds
        return manifest, info
    doc = json.loads((folder / manifest.name).read_text())
    info.update(
        seconds=round(time.perf_counter() - t0, 1),
        rounds=report.rounds,
        fp32_leading=doc["calibration"].get("fp32_leading_convolutions", 0),
        dice_min_vs_fp32_held_out=report.dice_min,
    )
    return folder / manifest.name, info


def run_segnode(
    engine: Any, manifest: Any, hu: npt.NDArray[np.float32], geometry: Any, warm: Any,
    repeats: int,
) -> tuple[list[float], npt.NDArray[np.uint8]]:  # fmt: skip
    from segnode.engines.trained import segment_trained

    segment_trained(engine, manifest, *warm)
    times = []
    labels = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        labels = segment_trained(engine, manifest, hu, geometry)
        times.append(time.perf_counter() - t0)
    assert labels is not None
    return times, labels


def environment() -> dict[str, Any]:
    import onnxruntime
    import openvino

    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "openvino": openvino.__version__.split("-")[0],
    }


def write_report(out: Path, result: dict[str, Any]) -> None:
    (out / "nnunet_cpu.json").write_text(json.dumps(result, indent=2))
    env = result["environment"]
    lines = [
        "# segnode vs nnUNetPredictor on the CPU",
        "",
        f"{env['date']}, {env['cpu']}, {env['cores']} cores, ONNX Runtime {env['onnxruntime']}, "
        f"OpenVINO {env['openvino']} (`python -m bench.nnunet_cpu`). Medians; speed-ups "
        "against segnode's ONNX Runtime FP32 and against nnUNetPredictor; Dice per label, lowest.",
        "",
        "| network | CT | path | time (s) | vs FP32 | vs nnUNetPredictor | Dice vs FP32 | "
        "Dice vs nnUNetPredictor |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['network']} | {row['ct']} | {row['path']} | {row['median_s']:.1f} | "
            f"{row.get('speedup_vs_fp32', 1.0):.2f}x | {row.get('speedup_vs_peer', 0):.2f}x | "
            f"{row.get('dice_min_vs_fp32', 1.0):.4f} | {row.get('dice_min_vs_peer', 0):.4f} |"
        )
    lines.append("")
    (out / "nnunet_cpu.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--peer":
        return peer_main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench.nnunet_cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--peer-python", required=True, help="a Python with nnunetv2 and torch")
    ap.add_argument("--networks", default="tiny,full")
    ap.add_argument("--shapes", default="140,300", help="slices of the 512 x 512 CTs")
    ap.add_argument("--paths", default="fp32,int8,bf16")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--bf16-threshold",
        type=float,
        default=0.995,
        help="the accuracy guard of the bf16cal path (segnode model calibrate --threshold)",
    )
    ap.add_argument("--full-mirroring", choices=("on", "off"), default="off")
    ap.add_argument(
        "--reuse-peer",
        action="store_true",
        help="take nnUNetPredictor's labels and times from an earlier run in --work",
    )
    args = ap.parse_args(argv)
    from bench.nnunet_gpu import plane_geometry, speed_volume
    from scripts.nnunet_phantom import write_nifti
    from segnode.engines.calibrate import dice_per_label
    from segnode.engines.manifest_parse import load_manifest
    from segnode.engines.openvino_backend import OpenVinoEngine
    from segnode.engines.ort_backend import OrtEngine

    work = args.work or Path(tempfile.mkdtemp(prefix="segnode-nnunet-cpu-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    threads = len(os.sched_getaffinity(0))
    result: dict[str, Any] = {"environment": environment(), "rows": [], "calibration": {}}
    peer = [args.peer_python, "-m", "bench.nnunet_cpu", "--peer"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    models: dict[str, dict[str, Any]] = {}
    nets = args.networks.split(",")
    info_path = work / "folders.json"
    if not info_path.is_file():
        subprocess.run(
            [*peer, "folders", "--work", str(work / "folders"), "--out", str(info_path)],
            check=True,
            env=env,
        )
    info = json.loads(info_path.read_text())
    if "tiny" in nets:
        tiny_manifest = work / "tiny" / "phantom.json"
        shutil.copytree(TINY, tiny_manifest.parent, dirs_exist_ok=True)
        doc = json.loads(tiny_manifest.read_text())
        doc["folds"] = ["fold_0.onnx"]
        tiny_manifest.write_text(json.dumps(doc, indent=2))
        models["tiny"] = {
            "manifest": tiny_manifest,
            "folder": Path(info["tiny"]),
            "folds": [0],
            "mirroring": True,
        }
    if "full" in nets:
        src = Path(info["manifest"])
        doc = json.loads(src.read_text())
        if args.full_mirroring == "off":
            doc["mirror_axes"] = []
        src.with_name("full-bench.json").write_text(json.dumps(doc, indent=2))
        models["full"] = {
            "manifest": src.with_name("full-bench.json"),
            "folder": Path(info["full"]),
            "folds": [0],
            "mirroring": args.full_mirroring == "on",
        }
    paths = args.paths.split(",")
    for name, model in models.items():
        if "int8" in paths:
            print(f"calibrating {name} to INT8", flush=True)
            model["int8"], result["calibration"][name] = calibrated_copy(
                model["manifest"],
                work,
                name,
                rounds=4 if name == "tiny" else 2,
                tiles=8 if name == "tiny" else 2,
            )
            write_report(args.out, result)
        if "bf16cal" in paths:
            if not (work / "calibration").is_dir():
                calibrated_copy(model["manifest"], work, name, rounds=1, tiles=2)
            print(f"calibrating {name} to BF16", flush=True)
            model["bf16cal"], result["calibration"][f"{name}-bf16"] = bf16_calibrated_copy(
                model["manifest"], work, name, args.bf16_threshold
            )
            write_report(args.out, result)
    for slices in (int(s) for s in args.shapes.split(",")):
        grid, hu16 = speed_volume((slices, 512, 512))
        hu = hu16.astype(np.float32)
        geometry = plane_geometry(grid, grid.slices)
        warm = (hu[:32, 160:352, 160:352].copy(), plane_geometry(grid, 32))
        nifti = work / f"ct_{slices}_0000.nii.gz"
        if not nifti.is_file():
            write_nifti(str(nifti), grid, hu16)
        ct = f"512x512x{slices}"
        for name, model in models.items():
            print(f"{name} on {ct}: nnUNetPredictor", flush=True)
            out = work / f"peer_{name}_{slices}.json"
            if not (args.reuse_peer and out.is_file()):
                subprocess.run(
                    [*peer, "predict", "--folder", str(model["folder"]), "--nifti", str(nifti),
                     "--folds", *map(str, model["folds"]),
                     "--mirroring", str(int(model["mirroring"])), "--repeats", str(args.repeats),
                     "--threads", str(threads), "--out", str(out)],
                    check=True, env=env,
                )  # fmt: skip
            peer_info = json.loads(out.read_text())
            import SimpleITK as sitk  # noqa: N813

            theirs = sitk.GetArrayFromImage(sitk.ReadImage(peer_info["seg"])).astype(np.uint8)
            peer_s = statistics.median(peer_info["times"])
            base = load_manifest(model["manifest"])
            result["rows"].append(
                {"network": name, "ct": ct, "path": "nnUNetPredictor (torch FP32)",
                 "times_s": peer_info["times"], "median_s": round(peer_s, 2),
                 "speedup_vs_peer": 1.0}
            )  # fmt: skip
            fp32_labels = None
            fp32_s = None
            runs = [
                ("fp32", "segnode ONNX Runtime FP32", OrtEngine, {}, model["manifest"]),
                ("int8", "segnode ONNX Runtime INT8", OrtEngine, {}, model.get("int8")),
                ("bf16", "segnode OpenVINO BF16", OpenVinoEngine,
                 {"precision": "bf16", "fp32_leading": 0}, model["manifest"]),
                ("bf16l1", "segnode OpenVINO BF16, first convolution in FP32",
                 OpenVinoEngine, {"precision": "bf16", "fp32_leading": 1}, model["manifest"]),
                ("bf16cal", "segnode OpenVINO BF16, calibrated (first convolutions in FP32 "
                 "as the guard chose)", OpenVinoEngine, {"precision": "bf16"},
                 model.get("bf16cal")),
                ("int8", "segnode OpenVINO INT8+BF16", OpenVinoEngine, {"precision": "bf16"},
                 model.get("int8")),
            ]  # fmt: skip
            for key, label, cls, options, manifest_path in runs:
                if key not in paths or manifest_path is None:
                    continue
                print(f"{name} on {ct}: {label}", flush=True)
                manifest = load_manifest(manifest_path)
                with cls(threads=threads, **options) as engine:
                    engine.load(manifest)
                    times, labels = run_segnode(engine, manifest, hu, geometry, warm, args.repeats)
                med = statistics.median(times)
                row: dict[str, Any] = {
                    "network": name,
                    "ct": ct,
                    "path": label,
                    "times_s": [round(t, 2) for t in times],
                    "median_s": round(med, 2),
                    "speedup_vs_peer": round(peer_s / med, 2),
                    "dice_vs_peer": dice_per_label([labels], [theirs], base),
                }
                if fp32_labels is None:
                    fp32_labels, fp32_s = labels, med
                row["speedup_vs_fp32"] = round((fp32_s or med) / med, 2)
                row["dice_vs_fp32"] = dice_per_label([labels], [fp32_labels], base)
                row["dice_min_vs_fp32"] = min(row["dice_vs_fp32"].values(), default=1.0)
                row["dice_min_vs_peer"] = min(row["dice_vs_peer"].values(), default=1.0)
                result["rows"].append(row)
                print("   ", json.dumps(row), flush=True)
                write_report(args.out, result)
            result["rows"][-1 - sum(1 for r in runs if r[0] in paths and r[4])][
                "speedup_vs_fp32"
            ] = round((fp32_s or peer_s) / peer_s, 2)
            write_report(args.out, result)
    print((args.out / "nnunet_cpu.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
