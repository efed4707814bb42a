"""Train a small nnU-Net v2 model on the phantom with nnunetv2 itself, and record its predictions.

This is the "real thing" of issue 15's oracle: a model trained by nnU-Net's own planner,
preprocessor and trainer (not a stand-in network), and ``nnUNetPredictor``'s segmentations of
the oracle series (:func:`scripts.nnunet_phantom.oracle_cases`), which segnode must reproduce.

Steps (nnunetv2 installed; about 15 minutes on a 2-core CPU, less on a GPU):

1. write ``Dataset555_Phantom`` (NIfTI, read with ``NibabelIOWithReorient``, so the model sees
   every series in RAS-canonical orientation, as TotalSegmentator's models do): ``--cases``
   phantoms with random anatomy (:meth:`Anatomy.random`), at 1.5 mm, head-first, feet-first
   and coronal;
2. ``extract_fingerprints`` / ``plan_experiments`` / ``preprocess`` (nnU-Net's defaults), then a
   plans file ``nnUNetPlansTiny`` with fewer features per stage and a 48 x 48 x 48 patch (a plans
   edit of the kind nnU-Net's documentation describes), so that the model and its ONNX export
   stay small enough to commit;
3. nnU-Net's ``nnUNetTrainer`` on folds 0 and 1, with :data:`EPOCHS` epochs of
   :data:`ITERATIONS_PER_EPOCH` iterations (the trainer's own loop, losses, augmentation and
   checkpoints; only the schedule is shorter);
4. ``nnUNetPredictor`` (both folds, mirroring, Gaussian, step 0.5) on the oracle series, written
   as NIfTI with the series' own geometry.

Outputs in ``--out``: ``nnunet_phantom_model.tar.gz`` (the trained-model folder as nnU-Net writes
it: plans.json, dataset.json, dataset_fingerprint.json, fold_N/checkpoint_final.pth),
``nnunet_trained_golden.npz`` (for each oracle case, ``nnUNetPredictor``'s labels in the series'
(slice, row, column) order and the phantom's true labels) and ``nnunet_trained.json`` (timings,
Dice of the model against the truth).

Run::

    python -m scripts.make_nnunet_trained --out /tmp/nnout --work /tmp/nnwork
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from scripts.nnunet_phantom import (
    AXIAL_FFS,
    AXIAL_HFS,
    CORONAL,
    FOV,
    LABELS,
    Anatomy,
    Grid,
    dice,
    oracle_cases,
    sample,
    write_nifti,
)

DATASET_ID = 555
DATASET = f"Dataset{DATASET_ID}_Phantom"
TRAINER = "nnUNetTrainer"
PLANS = "nnUNetPlansTiny"
CONFIGURATION = "3d_fullres"
PATCH = [48, 48, 48]
EPOCHS = 20
ITERATIONS_PER_EPOCH = 50
"""nnU-Net's own trainer with a shorter schedule (1000 iterations instead of 250 000), so that
the model trains in minutes on a CPU; the phantom's structures are learnt long before that."""


def trained_model_folder(model: Path | None, work: Path) -> Path:
    """The trained-model folder (``.../nnUNetTrainer__nnUNetPlansTiny__3d_fullres``) of
    ``model``: the ``nnunet_phantom_model.tar.gz`` this script writes (extracted into
    ``work``), a folder holding it, or ``None`` to train it now (into ``work``)."""
    if model is None:
        out = work / "trained"
        main(["--out", str(out), "--work", str(work / "train")])
        model = out / "nnunet_phantom_model.tar.gz"
    if model.is_file():
        with tarfile.open(model) as tar:
            tar.extractall(work / "model", filter="data")
        model = work / "model"
    found = sorted(p.parent for p in model.rglob("plans.json") if (p.parent / "fold_0").is_dir())
    if not found:
        raise SystemExit(f"{model}: no nnU-Net trained-model folder (plans.json, fold_0/)")
    return found[0]


def write_dataset(raw: Path, cases: int, seed: int) -> None:
    """Training images and labels, and dataset.json (``NibabelIOWithReorient``)."""
    folder = raw / DATASET
    (folder / "imagesTr").mkdir(parents=True, exist_ok=True)
    (folder / "labelsTr").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    orientations = (AXIAL_HFS, AXIAL_FFS, CORONAL)
    for i in range(cases):
        orientation = orientations[i % len(orientations)]
        fov = (FOV[0], FOV[2], FOV[1]) if orientation == CORONAL else FOV
        grid = Grid.covering(fov, 1.5, 1.5, orientation)
        hu, labels = sample(grid, Anatomy.random(rng))
        write_nifti(str(folder / "imagesTr" / f"case_{i:03d}_0000.nii.gz"), grid, hu)
        write_nifti(str(folder / "labelsTr" / f"case_{i:03d}.nii.gz"), grid, labels)
    dataset = {
        "channel_names": {"0": "CT"},
        "labels": dict(LABELS),
        "numTraining": cases,
        "file_ending": ".nii.gz",
        "overwrite_image_reader_writer": "NibabelIOWithReorient",
        "name": "Phantom",
        "description": "segnode's patient-space phantom (scripts/nnunet_phantom.py)",
    }
    (folder / "dataset.json").write_text(json.dumps(dataset, indent=2))


def tiny_plans(preprocessed: Path) -> None:
    """``nnUNetPlansTiny``: nnU-Net's plans with at most 64 features and a 64^3 patch."""
    plans = json.loads((preprocessed / DATASET / "nnUNetPlans.json").read_text())
    plans["plans_name"] = PLANS
    cfg = plans["configurations"][CONFIGURATION]
    cfg["patch_size"] = PATCH
    cfg["batch_size"] = 2
    kwargs = cfg["architecture"]["arch_kwargs"]
    kwargs["features_per_stage"] = [min(8 * 2**i, 64) for i in range(kwargs["n_stages"])]
    (preprocessed / DATASET / f"{PLANS}.json").write_text(json.dumps(plans, indent=2))


def main(argv: list[str] | None = None) -> int:
    """Train, predict, write the artefacts; print a summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--cases", type=int, default=24)
    ap.add_argument("--folds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--device", default="cuda", help="torch device: cuda or cpu")
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    ap.add_argument("--seed", type=int, default=555)
    args = ap.parse_args(argv)
    raw, pre, results = (args.work / n for n in ("raw", "preprocessed", "results"))
    for path, var in (
        (raw, "nnUNet_raw"),
        (pre, "nnUNet_preprocessed"),
        (results, "nnUNet_results"),
    ):
        path.mkdir(parents=True, exist_ok=True)
        os.environ[var] = str(path)
    os.environ.setdefault("nnUNet_compile", "f")
    os.environ.setdefault("nnUNet_n_proc_DA", str(min(12, os.cpu_count() or 1)))
    args.out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    write_dataset(raw, args.cases, args.seed)
    timings["dataset_s"] = time.perf_counter() - t0

    import torch  # noqa: PLC0415 - after the nnU-Net paths are set
    from nnunetv2.experiment_planning.plan_and_preprocess_api import (  # noqa: PLC0415
        extract_fingerprints,
        plan_experiments,
        preprocess,
    )
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor  # noqa: PLC0415
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer  # noqa: PLC0415

    device = torch.device(args.device)

    t0 = time.perf_counter()
    procs = min(8, os.cpu_count() or 1)
    extract_fingerprints([DATASET_ID], check_dataset_integrity=True, num_processes=procs)
    plan_experiments([DATASET_ID])
    tiny_plans(pre)
    preprocess([DATASET_ID], PLANS, configurations=(CONFIGURATION,), num_processes=(procs,))
    plans = json.loads((pre / DATASET / f"{PLANS}.json").read_text())
    dataset_json = json.loads((pre / DATASET / "dataset.json").read_text())
    timings["plan_preprocess_s"] = time.perf_counter() - t0

    for fold in args.folds:
        t0 = time.perf_counter()
        trainer = nnUNetTrainer(
            {**plans, "continue_training": False}, CONFIGURATION, fold, dataset_json, device=device
        )
        trainer.num_epochs = args.epochs
        trainer.num_iterations_per_epoch = ITERATIONS_PER_EPOCH
        trainer.num_val_iterations_per_epoch = 10
        trainer.run_training()
        timings[f"train_fold{fold}_s"] = time.perf_counter() - t0

    model_dir = results / DATASET / f"{TRAINER}__{PLANS}__{CONFIGURATION}"
    test = args.work / "test"
    pred = args.work / "pred"
    test.mkdir(exist_ok=True)
    golden: dict[str, Any] = {}
    truths = {}
    for case in oracle_cases():
        hu, labels = sample(case.grid, case.anatomy)
        write_nifti(str(test / f"{case.name}_0000.nii.gz"), case.grid, hu)
        truths[case.name] = labels
    predictor = nnUNetPredictor(
        tile_step_size=0.5,
        use_gaussian=True,
        use_mirroring=True,
        perform_everything_on_device=True,
        device=device,
        allow_tqdm=False,
    )
    predictor.initialize_from_trained_model_folder(
        str(model_dir), use_folds=tuple(args.folds), checkpoint_name="checkpoint_final.pth"
    )
    t0 = time.perf_counter()
    predictor.predict_from_files(
        str(test),
        str(pred),
        num_processes_preprocessing=procs,
        num_processes_segmentation_export=procs,
    )
    timings["predict_s"] = time.perf_counter() - t0

    import SimpleITK as sitk  # noqa: N813, PLC0415

    quality: dict[str, dict[str, float]] = {}
    for name, truth in truths.items():
        got = sitk.GetArrayFromImage(sitk.ReadImage(str(pred / f"{name}.nii.gz"))).astype(np.uint8)
        assert got.shape == truth.shape, (name, got.shape, truth.shape)
        golden[f"{name}__nnunet"] = got
        golden[f"{name}__truth"] = truth
        quality[name] = {k: round(dice(got, truth, v), 4) for k, v in LABELS.items() if v}
    np.savez_compressed(args.out / "nnunet_trained_golden.npz", **golden)

    keep = args.work / "model" / DATASET / model_dir.name
    keep.mkdir(parents=True, exist_ok=True)
    for name in ("plans.json", "dataset.json", "dataset_fingerprint.json"):
        shutil.copy(model_dir / name, keep / name)
    for fold in args.folds:
        (keep / f"fold_{fold}").mkdir(exist_ok=True)
        shutil.copy(model_dir / f"fold_{fold}" / "checkpoint_final.pth", keep / f"fold_{fold}")
    with tarfile.open(args.out / "nnunet_phantom_model.tar.gz", "w:gz") as tar:
        tar.add(args.work / "model" / DATASET, arcname=DATASET)
    import nnunetv2  # noqa: PLC0415

    summary = {
        "trainer": TRAINER,
        "epochs": args.epochs,
        "iterations_per_epoch": ITERATIONS_PER_EPOCH,
        "plans": PLANS,
        "folds": args.folds,
        "cases": args.cases,
        "nnunetv2": getattr(nnunetv2, "__version__", "?"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "timings": {k: round(v, 1) for k, v in timings.items()},
        "dice_vs_truth": quality,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    (args.out / "nnunet_trained.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
