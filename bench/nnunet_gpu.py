"""segnode's imported nnU-Net v2 model against ``nnUNetPredictor`` on the GPU (issue 15).

Run on a CUDA machine with torch, onnx2torch, nnunetv2 and SimpleITK::

    python -m bench.nnunet_gpu --out bench/out            # part of make bench-gpu

The model is the one nnU-Net's own trainer trained on the phantom
(:mod:`scripts.make_nnunet_trained`; ``--model`` names its ``nnunet_phantom_model.tar.gz`` or
trained-model folder; without one the script trains it first, a few minutes on a GPU). Parts
(``--parts``, all by default), each written to ``nnunet_gpu.json`` / ``.md`` as it finishes:

``oracle``
    The oracle series of :func:`scripts.nnunet_phantom.oracle_cases` (0.7 x 0.7 x 1.25 mm
    head- and feet-first, 0.8 x 0.8 x 5 mm, 1.5 mm isotropic, coronal), written as DICOM and
    assembled by the node's own volume code. ``nnUNetPredictor`` on the GPU (both folds,
    mirroring, Gaussian, step 0.5) regenerates the golden segmentations live; segnode runs the
    model imported here with ``segnode model import nnunet`` on the ``torch`` engine on the
    GPU (FP16 and FP32), everything after the DICOM volume on the GPU. Dice per label against
    the live predictor, against the committed golden file (made on the CPU) and against
    segnode's own CPU path (ONNX Runtime).
``speed``
    One 512 x 512 x 300 CT (0.7 x 0.7 x 1.25 mm) in memory; preprocessing + inference +
    export (labels back on the CT's grid, on the host) timed for ``nnUNetPredictor``
    (``predict_single_npy_array``, the image read beforehand with the plans' own reader) and
    for segnode (:func:`segnode.engines.trained.segment_trained`, torch engine FP16 on the GPU),
    with and without mirroring, for two networks: the trained tiny model and nnU-Net's default
    3d_fullres architecture (32-320 features, 6 stages, 128^3 patch, as nnU-Net plans it for
    CT at 1.5 mm; weights from nnU-Net's own initialisation - the speed does not depend on
    them). Medians of ``--repeats`` runs after one warm-up each.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from scripts.make_nnunet_trained import trained_model_folder
from scripts.nnunet_phantom import LABELS, Anatomy, Grid, dice, oracle_cases, sample, write_nifti

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "data" / "nnunet_trained_golden.npz"
FOLDS = (0, 1)
FULL_FEATURES = [32, 64, 128, 256, 320, 320]
FULL_PATCH = [128, 128, 128]


def agreement(got: npt.NDArray[Any], want: npt.NDArray[Any]) -> dict[str, float]:
    """Dice per label and the share of identical voxels (percent)."""
    scores = {k: round(dice(got, want, v), 5) for k, v in LABELS.items() if v}
    scores["identical_pct"] = round(100.0 * float((got == want).mean()), 5)
    return scores


# --------------------------------------------------------------------------- the models


def full_size_folder(tiny: Path, work: Path) -> Path:
    """nnU-Net's default 3d_fullres network for this dataset, as a trained-model folder.

    The plans are the tiny model's with nnU-Net's default architecture for a 128^3 patch at
    1.5 mm (what its planner chooses for CT there: 6 stages of 32-320 features); the
    checkpoints hold weights from nnU-Net's own network builder and initialisation, in the
    trainer's checkpoint format, so that ``nnUNetPredictor`` and ``segnode model import``
    read them like any trained model.
    """
    import torch  # noqa: PLC0415
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer  # noqa: PLC0415

    plans = json.loads((tiny / "plans.json").read_text())
    plans["plans_name"] = "nnUNetPlansFull"
    cfg = plans["configurations"]["3d_fullres"]
    cfg["patch_size"] = list(FULL_PATCH)
    kw = cfg["architecture"]["arch_kwargs"]
    kw.update(
        n_stages=6,
        features_per_stage=list(FULL_FEATURES),
        kernel_sizes=[[3, 3, 3]] * 6,
        strides=[[1, 1, 1]] + [[2, 2, 2]] * 5,
        n_conv_per_stage=[2] * 6,
        n_conv_per_stage_decoder=[2] * 5,
    )
    dataset = json.loads((tiny / "dataset.json").read_text())
    folder = work / "full" / tiny.parent.name / "nnUNetTrainer__nnUNetPlansFull__3d_fullres"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plans.json").write_text(json.dumps(plans, indent=2))
    for name in ("dataset.json", "dataset_fingerprint.json"):
        shutil.copy(tiny / name, folder / name)
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager  # noqa: PLC0415

    manager = PlansManager(plans)
    for fold in FOLDS:
        ckpt = torch.load(
            tiny / f"fold_{fold}" / "checkpoint_final.pth", map_location="cpu", weights_only=False
        )
        torch.manual_seed(fold)
        net = nnUNetTrainer.build_network_architecture(
            manager,
            manager.get_configuration("3d_fullres"),
            1,
            len(dataset["labels"]),
            True,
        )
        ckpt = copy.copy(ckpt)
        ckpt["network_weights"] = net.state_dict()
        ckpt["optimizer_state"] = None
        ckpt["init_args"] = {**ckpt["init_args"], "plans": plans}
        (folder / f"fold_{fold}").mkdir(exist_ok=True)
        torch.save(ckpt, folder / f"fold_{fold}" / "checkpoint_final.pth")
    return folder


def import_folder(folder: Path, out: Path, name: str) -> tuple[Path, Path, float]:
    """``segnode model import nnunet`` of ``folder`` (both folds); the manifest, a copy of it
    without mirroring, and the import's wall time."""
    from segnode.engines.importers.nnunet import import_nnunet  # noqa: PLC0415

    t0 = time.perf_counter()
    report = import_nnunet(folder, out, name, folds=FOLDS, allow_generic=True)
    seconds = time.perf_counter() - t0
    for line in report.lines():
        print("  " + line)
    doc = json.loads(report.manifest_path.read_text())
    doc["name"] = f"{name}-nomirror"
    doc["mirror_axes"] = []
    plain = report.manifest_path.with_name(f"{name}-nomirror.json")
    plain.write_text(json.dumps(doc, indent=2))
    return report.manifest_path, plain, seconds


def predictor(folder: Path, mirroring: bool) -> Any:
    """``nnUNetPredictor`` on the GPU with nnU-Net's defaults (Gaussian, step 0.5)."""
    import torch  # noqa: PLC0415
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor  # noqa: PLC0415

    p = nnUNetPredictor(
        tile_step_size=0.5,
        use_gaussian=True,
        use_mirroring=mirroring,
        perform_everything_on_device=True,
        device=torch.device("cuda"),
        allow_tqdm=False,
    )
    p.initialize_from_trained_model_folder(
        str(folder), use_folds=FOLDS, checkpoint_name="checkpoint_final.pth"
    )
    return p


def torch_engine(manifest_path: Path, precision: str = "fp16") -> Any:
    """segnode's torch engine on the GPU, loaded with ``manifest_path``."""
    from segnode.engines.manifest_parse import load_manifest  # noqa: PLC0415
    from segnode.engines.torch_backend import TorchEngine  # noqa: PLC0415

    engine = TorchEngine(device="cuda", precision=precision)
    engine.load(load_manifest(manifest_path))
    return engine


def read_labels(path: Path) -> npt.NDArray[np.uint8]:
    """A NIfTI label map in (slice, row, column) order (SimpleITK)."""
    import SimpleITK as sitk  # noqa: N813, PLC0415

    return sitk.GetArrayFromImage(sitk.ReadImage(str(path))).astype(np.uint8)


# --------------------------------------------------------------------------- oracle


def run_oracle(folder: Path, manifest_path: Path, work: Path) -> dict[str, Any]:
    """nnUNetPredictor live on the GPU vs segnode's GPU (and CPU) path on the oracle series."""
    from scripts.nnunet_phantom import write_dicom_case  # noqa: PLC0415
    from segnode.engines.manifest_parse import load_manifest  # noqa: PLC0415
    from segnode.engines.ort_backend import OrtEngine  # noqa: PLC0415
    from segnode.engines.preprocess.orientation import Geometry  # noqa: PLC0415
    from segnode.engines.trained import segment_trained  # noqa: PLC0415
    from segnode.node.ingest.volume import assemble_volume  # noqa: PLC0415

    test, pred = work / "oracle_in", work / "oracle_pred"
    test.mkdir(parents=True, exist_ok=True)
    volumes = {}
    for case in oracle_cases():
        hu, _ = sample(case.grid, case.anatomy)
        write_nifti(str(test / f"{case.name}_0000.nii.gz"), case.grid, hu)
        volumes[case.name] = assemble_volume(write_dicom_case(case, work / "dicom" / case.name, 11))
    t0 = time.perf_counter()
    predictor(folder, True).predict_from_files(
        str(test), str(pred), num_processes_preprocessing=4, num_processes_segmentation_export=4
    )
    predict_s = time.perf_counter() - t0
    committed: dict[str, npt.NDArray[np.uint8]] = {}
    if GOLDEN.is_file():
        with np.load(GOLDEN) as z:
            committed = {k: z[k] for k in z.files}
    manifest = load_manifest(manifest_path)
    engines = {
        "torch_cuda_fp16": torch_engine(manifest_path, "fp16"),
        "torch_cuda_fp32": torch_engine(manifest_path, "fp32"),
    }
    ort = OrtEngine()
    ort.load(manifest)
    cases: dict[str, Any] = {}
    for case in oracle_cases():
        live = read_labels(pred / f"{case.name}.nii.gz")
        volume = volumes[case.name]
        geometry = Geometry.from_volume(volume)
        cpu = segment_trained(ort, manifest, volume.hu, geometry)
        row: dict[str, Any] = {"shape": list(live.shape)}
        if f"{case.name}__nnunet" in committed:
            row["live_predictor_vs_committed_golden"] = agreement(
                live, committed[f"{case.name}__nnunet"]
            )
        row["segnode_ort_cpu_vs_live_predictor"] = agreement(cpu, live)
        for key, engine in engines.items():
            t0 = time.perf_counter()
            got = segment_trained(engine, manifest, volume.hu, geometry)
            row[f"{key}_seconds"] = round(time.perf_counter() - t0, 3)
            row[f"segnode_{key}_vs_live_predictor"] = agreement(got, live)
            row[f"segnode_{key}_vs_segnode_ort_cpu"] = agreement(got, cpu)
            if f"{case.name}__nnunet" in committed:
                row[f"segnode_{key}_vs_committed_golden"] = agreement(
                    got, committed[f"{case.name}__nnunet"]
                )
        cases[case.name] = row
        print(f"  {case.name}: " + json.dumps(row))
    worst = min(
        min(v for k, v in row[f"segnode_{key}_vs_live_predictor"].items() if k != "identical_pct")
        for row in cases.values()
        for key in engines
    )
    return {"predictor_seconds_all_cases": round(predict_s, 1), "cases": cases, "min_dice": worst}


# --------------------------------------------------------------------------- speed


def speed_volume(shape: tuple[int, int, int]) -> tuple[Grid, npt.NDArray[np.int16]]:
    """A whole-FOV CT of ``shape`` (slices, rows, columns) at 0.7 x 0.7 x 1.25 mm."""
    grid = Grid(slices=shape[0], rows=shape[1], columns=shape[2], pixel=0.7, slice=1.25)
    half_z = shape[0] * 1.25 / 2
    anatomy = Anatomy(body_axes=(150.0, 110.0), body_z=(-0.8 * half_z, 0.8 * half_z), seed=3)
    hu, _ = sample(grid, anatomy)
    return grid, hu


def run_speed(
    name: str,
    folder: Path,
    manifests: dict[bool, Path],
    grid: Grid,
    hu: npt.NDArray[np.int16],
    work: Path,
    repeats: int,
    peer_repeats: int,
) -> dict[str, Any]:
    """Both sides, with and without mirroring, on the same in-memory CT."""
    import torch  # noqa: PLC0415

    from segnode.engines.manifest_parse import load_manifest  # noqa: PLC0415
    from segnode.engines.trained import segment_trained  # noqa: PLC0415

    geometry = plane_geometry(grid, grid.slices)
    hu32 = hu.astype(np.float32)
    nifti = work / f"speed_{grid.slices}_0000.nii.gz"
    if not nifti.is_file():
        write_nifti(str(nifti), grid, hu)
    out: dict[str, Any] = {"network": name, "shape": list(hu.shape)}
    for mirroring in (True, False):
        key = "mirroring" if mirroring else "no_mirroring"
        p = predictor(folder, mirroring)
        reader = p.plans_manager.image_reader_writer_class()
        image, props = reader.read_images([str(nifti)])
        p.predict_single_npy_array(image[:, :64, :64, :64].copy(), props)  # warm-up (cuDNN)
        peer_times = []
        for _ in range(peer_repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            theirs = p.predict_single_npy_array(image, props)
            torch.cuda.synchronize()
            peer_times.append(time.perf_counter() - t0)
        reader.write_seg(theirs, str(work / "peer_seg.nii.gz"), props)
        theirs_grid = read_labels(work / "peer_seg.nii.gz")
        del p, theirs
        torch.cuda.empty_cache()

        manifest = load_manifest(manifests[mirroring])
        engine = torch_engine(manifests[mirroring], "fp16")
        segment_trained(engine, manifest, hu32[:64], plane_geometry(grid, 64))  # warm-up
        ours_times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ours = segment_trained(engine, manifest, hu32, geometry)
            torch.cuda.synchronize()
            ours_times.append(time.perf_counter() - t0)
        del engine
        torch.cuda.empty_cache()
        peer, mine = statistics.median(peer_times), statistics.median(ours_times)
        out[key] = {
            "nnunet_predictor_s": [round(t, 3) for t in peer_times],
            "segnode_s": [round(t, 3) for t in ours_times],
            "nnunet_predictor_median_s": round(peer, 3),
            "segnode_median_s": round(mine, 3),
            "speedup": round(peer / mine, 2),
            "agreement": agreement(ours, theirs_grid),
        }
        print(f"  {name} {key}: " + json.dumps(out[key]))
    return out


def plane_geometry(grid: Grid, slices: int) -> Any:
    """Geometry of the first ``slices`` slices of ``grid`` (as the node reads a series)."""
    from segnode.engines.preprocess.orientation import Geometry  # noqa: PLC0415

    row_dir, col_dir, normal = grid.directions
    positions = [grid.origin + k * grid.slice * normal for k in range(slices)]
    return Geometry.from_image_plane(row_dir, col_dir, positions, (grid.pixel, grid.pixel))


# --------------------------------------------------------------------------- report


def environment() -> dict[str, Any]:
    """Machine and versions."""
    import torch  # noqa: PLC0415

    try:
        from importlib.metadata import version  # noqa: PLC0415

        nnunet = version("nnunetv2")
    except Exception:  # noqa: BLE001 - only a label
        nnunet = "?"
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(0),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "nnunetv2": nnunet,
    }


def write_report(out: Path, result: dict[str, Any]) -> None:
    """``nnunet_gpu.json`` and a Markdown summary."""
    (out / "nnunet_gpu.json").write_text(json.dumps(result, indent=2))
    env = result["environment"]
    lines = [
        "# segnode vs nnUNetPredictor on the GPU",
        "",
        f"{env['date']}, {env['gpu']}, {env['cpu_count']} CPU cores, torch {env['torch']}, "
        f"nnunetv2 {env['nnunetv2']} (`python -m bench.nnunet_gpu`).",
        "",
    ]
    if "oracle" in result:
        o = result["oracle"]
        lines += [
            "## Oracle (GPU path)",
            "",
            f"Lowest Dice of segnode (torch, GPU) against nnUNetPredictor (GPU, live): "
            f"**{o['min_dice']:.4f}**",
            "",
            "| series | engine | body | lung | bone | identical voxels |",
            "|---|---|---|---|---|---|",
        ]
        for case, row in o["cases"].items():
            for key in ("torch_cuda_fp16", "torch_cuda_fp32", "ort_cpu"):
                s = row.get(f"segnode_{key}_vs_live_predictor")
                if s:
                    lines.append(
                        f"| {case} | {key} | {s['body']:.4f} | {s['lung']:.4f} | "
                        f"{s['bone']:.4f} | {s['identical_pct']:.4f} % |"
                    )
        lines.append("")
    for part in result.get("speed", []):
        lines += [
            f"## Speed: {part['network']}, CT {' x '.join(map(str, part['shape']))}",
            "",
            "| | nnUNetPredictor (s) | segnode (s) | speed-up | identical voxels |",
            "|---|---|---|---|---|",
        ]
        for key in ("mirroring", "no_mirroring"):
            if key in part:
                r = part[key]
                lines.append(
                    f"| {key.replace('_', ' ')} | {r['nnunet_predictor_median_s']:.2f} | "
                    f"{r['segnode_median_s']:.2f} | **{r['speedup']:.1f}x** | "
                    f"{r['agreement']['identical_pct']:.3f} % |"
                )
        lines.append("")
    (out / "nnunet_gpu.md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    """Command line entry; see the module docstring."""
    ap = argparse.ArgumentParser(prog="python -m bench.nnunet_gpu")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out")
    ap.add_argument("--model", type=Path, default=None, help="trained model .tar.gz or folder")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--parts", default="oracle,speed-tiny,speed-full")
    ap.add_argument("--shape", type=int, nargs=3, default=(300, 512, 512))
    ap.add_argument("--repeats", type=int, default=3, help="timed segnode runs")
    ap.add_argument("--peer-repeats", type=int, default=1, help="timed nnUNetPredictor runs")
    args = ap.parse_args(argv)
    os.environ.setdefault("nnUNet_raw", "/nonexistent")
    os.environ.setdefault("nnUNet_preprocessed", "/nonexistent")
    os.environ.setdefault("nnUNet_results", "/nonexistent")
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        print("no CUDA GPU: this benchmark needs one")
        return 2
    try:
        import nnunetv2  # noqa: F401, PLC0415
    except ImportError:
        print("skipped: nnunetv2 is not installed (pip install -e '.[nnunet]')")
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="segnode-nnunet-"))
    args.out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    result: dict[str, Any] = {"environment": environment(), "speed": []}
    tiny = trained_model_folder(args.model, work)
    print(f"model: {tiny}")
    manifest, plain, seconds = import_folder(tiny, work / "imported" / "tiny", "phantom")
    result["import_tiny_s"] = round(seconds, 1)
    if "oracle" in parts:
        result["oracle"] = run_oracle(tiny, manifest, work)
        write_report(args.out, result)
    if parts & {"speed-tiny", "speed-full"}:
        t0 = time.perf_counter()
        grid, hu = speed_volume(tuple(args.shape))
        print(f"speed volume {hu.shape} in {time.perf_counter() - t0:.1f} s")
        if "speed-tiny" in parts:
            result["speed"].append(
                run_speed("trained tiny model (8-64 features, 48^3 patch, 2 folds)", tiny,
                          {True: manifest, False: plain}, grid, hu, work, args.repeats,
                          args.peer_repeats)
            )  # fmt: skip
            write_report(args.out, result)
        if "speed-full" in parts:
            full = full_size_folder(tiny, work)
            fm, fp, seconds = import_folder(full, work / "imported" / "full", "full")
            result["import_full_s"] = round(seconds, 1)
            result["speed"].append(
                run_speed("nnU-Net default 3d_fullres (32-320 features, 128^3 patch, 2 folds)",
                          full, {True: fm, False: fp}, grid, hu, work, args.repeats,
                          args.peer_repeats)
            )  # fmt: skip
            write_report(args.out, result)
    print((args.out / "nnunet_gpu.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
