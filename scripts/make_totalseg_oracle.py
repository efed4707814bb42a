"""TotalSegmentator's own Python API against segnode's TotalSegmentator profile (issues 15, 37).

The model nnU-Net trained on the phantom (:mod:`scripts.make_nnunet_trained`) is placed under
TotalSegmentator's folder names for one of its tasks (:data:`STANDINS`), so that a part taken
in the wrong order or mapped to the wrong names shows:

* ``total`` (datasets 291-295, ``nnUNetTrainerNoMirroring__nnUNetPlans__3d_fullres/fold_0``):
  once per dataset, each copy with its three labels renamed to the first three structures of
  that part (``class_map_5_parts``) and its output channels permuted differently;
* ``total_fast`` (``--fast``: dataset 297, 3 mm) and ``total_fastest`` (``--fastest``: dataset
  298, 6 mm; ``nnUNetTrainer_4000epochs_NoMirroring__nnUNetPlans__3d_fullres/fold_0``): one
  copy whose plans say 3 mm (6 mm), with its output channels permuted; TotalSegmentator reads
  such a dataset's output value ``v`` as ``class_map["total"][v]`` (no per-part map), so its
  three labels carry the names of values 1-3 (spleen, kidney_right, kidney_left).

Then, for each oracle series (:func:`oracle_series`: the phantom's oracle cases, head-first,
feet-first and coronal, ``wide_hfs``, on which step 0.8 and 0.5 tile differently at 3 and
6 mm, and ``long_ffs``, 800 slices feet-first, tiled along z at 3 and 6 mm):

* ``totalsegmentator.python_api.totalsegmentator(..., task="total", ml=True)`` (with
  ``fast=True`` or ``fastest=True`` for the one-dataset tasks) - its own pipeline (canonical
  RAS, order-1 resampling to 1.5, 3 or 6 mm, nnU-Net with step 0.8 and no mirroring on each
  dataset, the parts merged, the labels back on the input grid at order 0) - on the series as
  NIfTI; its multi-label output is the golden file;
* ``segnode model import totalsegmentator --task TASK`` of the same weights folder, and
  segnode's composite model on ONNX Runtime on the series read as DICOM by the node's volume
  assembly.

Both label maps are compared per structure name (Dice). Outputs in ``--out``
(``tests/data/totalseg_phantom``, ``..._fast``, ``..._fastest``): the composite manifests the
import wrote (``<task>.json``, ``part_<id>/model.json``; the ONNX folds are not kept: the test
rebuilds each part from the committed phantom fold with :func:`permuted_onnx`),
``golden.npz`` (TotalSegmentator's label maps and its structure names) and ``oracle.json``
(task, versions, timings, Dice).

Without ``--model`` the phantom's checkpoint is rebuilt from the committed ONNX fold
(:func:`checkpoint_from_onnx`: the same float16-stored weights the test runs, so both sides
compute with identical weights).

Run (torch, nnunetv2 and TotalSegmentator installed; a few minutes on a CPU)::

    python -m scripts.make_totalseg_oracle --task total_fast --work /tmp/tsw \\
        --out tests/data/totalseg_phantom_fast
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from scripts.make_nnunet_trained import trained_model_folder
from scripts.nnunet_phantom import (
    AXIAL_FFS,
    Grid,
    OracleCase,
    dice,
    oracle_cases,
    sample,
    write_dicom_case,
    write_nifti,
)

PERMUTATIONS = ([0, 1, 2, 3], [0, 2, 3, 1], [0, 3, 1, 2], [0, 2, 1, 3], [0, 3, 2, 1])
"""Per part (291..295): new output channel ``j`` is the phantom model's channel ``perm[j]``."""

STANDINS: dict[str, tuple[list[int], ...]] = {
    "total": PERMUTATIONS,
    # one dataset: a permutation other than the identity, so that a channel read in the
    # phantom's own order (body, lung, bone) shows as the wrong structure
    "total_fast": ([0, 3, 1, 2],),
    "total_fastest": ([0, 2, 3, 1],),
}
"""Per task: the output-channel permutation of each of its datasets, in TotalSegmentator's
order (:data:`segnode.engines.importers.totalsegmentator.TASKS`)."""

RUN_FLAGS = {"total": {}, "total_fast": {"fast": True}, "total_fastest": {"fastest": True}}
"""``totalsegmentator(task="total", **flags)`` for each of segnode's tasks."""

WIDE_FOV = (480.0, 126.0, 100.0)
"""A wide field of view (mm along row, column, normal): at 3 mm its 160 columns take four
48-voxel tiles with step 0.8 and six with nnU-Net's default 0.5 (at 6 mm: two and three),
so that the fast tasks' step size shows; the oracle cases fit one or two tiles there."""


LONG_FOV = (180.0, 150.0, 800.0)
"""A long axial series (mm along row, column, normal): 72 x 60 pixels of 2.5 mm (the
phantom's body, at most 114 x 94 mm across, with a margin; rows and columns differ so that a
transposition shows) and 800 slices of 1 mm, which TotalSegmentator's 3 mm (6 mm) grid tiles
in seven (four) 48-voxel tiles along z and two (one) across."""

LONG_BODY_Z = (-350.0, 300.0)
"""The long series' body (mm, before the anatomy's shift): most of its 800 mm, so that every
tile along z holds anatomy, and not centred, so that a z flip moves it."""


def oracle_series() -> tuple[OracleCase, ...]:
    """:func:`scripts.nnunet_phantom.oracle_cases`, ``wide_hfs``, the same anatomy on a
    2 mm x 5 mm axial grid of :data:`WIDE_FOV`, and ``long_ffs``, a feet-first series of 800
    slices (:data:`LONG_FOV`) whose body spans :data:`LONG_BODY_Z`."""
    cases = oracle_cases()
    anatomy = cases[0].anatomy
    wide = OracleCase("wide_hfs", Grid.covering(WIDE_FOV, 2.0, 5.0), anatomy)
    long = OracleCase(
        "long_ffs",
        Grid.covering(LONG_FOV, 2.5, 1.0, AXIAL_FFS),
        dataclasses.replace(anatomy, body_z=LONG_BODY_Z),
    )
    return (*cases, wide, long)


PHANTOM = Path(__file__).resolve().parent.parent / "tests" / "data" / "nnunet_phantom"
"""The committed phantom model: plans, dataset and its ONNX folds (float16-stored weights)."""


def permuted_onnx(src: Path, dst: Path, perm: list[int]) -> None:
    """Copy the ONNX model ``src`` with its output channels reordered by ``perm``.

    A ``Gather`` on the channel axis after the network: the same arithmetic as a network whose
    last convolution's filters were reordered (which is what the permuted checkpoint holds).
    """
    import onnx  # noqa: PLC0415
    from onnx import helper, numpy_helper  # noqa: PLC0415

    model = onnx.load(str(src))
    graph = model.graph
    out = graph.output[0].name
    raw = f"{out}_before_permutation"
    for node in graph.node:
        for i, name in enumerate(node.output):
            if name == out:
                node.output[i] = raw
    index = numpy_helper.from_array(np.asarray(perm, dtype=np.int64), f"{out}_permutation")
    graph.initializer.append(index)
    graph.node.append(helper.make_node("Gather", [raw, index.name], [out], axis=1))
    onnx.checker.check_model(model)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))


def rebuild_composite(oracle: Path, dst: Path, phantom_fold: Path) -> Path:
    """The composite an oracle folder (``tests/data/totalseg_phantom*``) was made with, in
    ``dst``: its committed manifests, each part's fold rebuilt from ``phantom_fold`` with the
    part's channel permutation (:func:`permuted_onnx`); return the composite manifest."""
    summary = json.loads((oracle / "oracle.json").read_text())
    name = summary.get("manifest", "total.json")
    shutil.copy(oracle / name, dst / name)
    for task_id, part in summary["parts"].items():
        folder = dst / f"part_{task_id}"
        folder.mkdir()
        shutil.copy(oracle / f"part_{task_id}" / "model.json", folder / "model.json")
        permuted_onnx(phantom_fold, folder / "fold_0.onnx", list(part["permutation"]))
    return dst / name


def by_name(labels: npt.NDArray[Any], names: dict[int, str]) -> dict[str, npt.NDArray[np.bool_]]:
    """Masks of every named structure present in ``labels``."""
    return {names[int(v)]: labels == v for v in np.unique(labels) if int(v) in names}


def compare(
    ours: npt.NDArray[Any],
    our_names: dict[int, str],
    theirs: npt.NDArray[Any],
    their_names: dict[int, str],
) -> dict[str, float]:
    """Dice per structure name over the union of the names either map contains."""
    a, b = by_name(ours, our_names), by_name(theirs, their_names)
    empty = np.zeros(ours.shape, dtype=bool)
    return {
        name: round(dice(a.get(name, empty), b.get(name, empty), True), 5)
        for name in sorted(set(a) | set(b))
    }


def checkpoint_from_onnx(phantom: Path, work: Path, fold: int = 0) -> Path:
    """An nnU-Net trained-model folder whose ``fold_0`` holds the weights of the committed
    ONNX fold ``phantom/fold_<fold>.onnx`` (stored as float16 there, float32 here).

    The network is built from the committed ``plans.json`` as nnU-Net's predictor builds it;
    every parameter it uses is set by name from the ONNX initialisers (``<name>_fp16``,
    :mod:`scripts.onnx_fp16_storage`); the deep-supervision heads the inference graph does not
    contain (``decoder.seg_layers.0..2``) stay as built, unused. Returns the folder.
    """
    import onnx  # noqa: PLC0415
    import torch  # noqa: PLC0415
    from nnunetv2.utilities.get_network_from_plans import get_network_from_plans  # noqa: PLC0415
    from onnx import numpy_helper  # noqa: PLC0415

    plans = json.loads((phantom / "plans.json").read_text())
    dataset = json.loads((phantom / "dataset.json").read_text())
    arch = plans["configurations"]["3d_fullres"]["architecture"]
    network = get_network_from_plans(
        arch["network_class_name"],
        arch["arch_kwargs"],
        arch["_kw_requires_import"],
        len(dataset["channel_names"]),
        len(dataset["labels"]),
        allow_init=True,
        deep_supervision=False,
    )
    stored = {
        init.name.removesuffix("_fp16"): numpy_helper.to_array(init)
        for init in onnx.load(str(phantom / f"fold_{fold}.onnx")).graph.initializer
    }
    params = dict(network.named_parameters())  # shared modules once, by their first name
    missing = [k for k in params if k not in stored and not k.startswith("decoder.seg_layers.")]
    if missing or set(stored) - set(params):
        raise SystemExit(
            f"{phantom}: ONNX initialisers do not match the network: {missing}, "
            f"{sorted(set(stored) - set(params))}"
        )
    with torch.no_grad():
        for key, param in params.items():
            if key in stored:
                param.copy_(torch.from_numpy(stored[key].astype(np.float32)))
    state = network.state_dict()
    folder = work / "phantom_from_onnx" / "nnUNetTrainer__nnUNetPlansTiny__3d_fullres"
    (folder / "fold_0").mkdir(parents=True, exist_ok=True)
    shutil.copy(phantom / "plans.json", folder)
    shutil.copy(phantom / "dataset.json", folder)
    checkpoint = {
        "network_weights": state,
        "optimizer_state": None,
        "grad_scaler_state": None,
        "logging": {},
        "_best_ema": None,
        "current_epoch": 0,
        "init_args": {
            "plans": plans,
            "configuration": "3d_fullres",
            "fold": fold,
            "dataset_json": dataset,
        },
        "trainer_name": "nnUNetTrainer",
        "inference_allowed_mirroring_axes": (0, 1, 2),
    }
    torch.save(checkpoint, folder / "fold_0" / "checkpoint_final.pth")
    return folder


def standin_parts(task: str) -> list[tuple[int, str, list[str], list[int]]]:
    """``(task id, folder name, three structure names, permutation)`` per dataset of
    ``task``: the names TotalSegmentator gives that dataset's output values 1-3."""
    from totalsegmentator.map_to_binary import (  # noqa: PLC0415
        class_map,
        class_map_5_parts,
        map_taskid_to_partname_ct,
    )

    from segnode.engines.importers.totalsegmentator import TASKS  # noqa: PLC0415

    profile = TASKS[task]
    parts = []
    for (task_id, folder_name), perm in zip(profile.datasets, STANDINS[task], strict=True):
        if len(profile.datasets) > 1:  # merged through class_map_5_parts (nnunet.py, lut)
            names = class_map_5_parts[map_taskid_to_partname_ct[task_id]]
        else:  # one dataset: its output values are class_map["total"]'s ids
            names = class_map["total"]
        parts.append((task_id, folder_name, [names[1], names[2], names[3]], perm))
    return parts


def build_weights(model_dir: Path, weights: Path, task: str) -> list[tuple[int, list[str]]]:
    """TotalSegmentator's weights folder of ``task`` made of the phantom model (see the
    module docstring); returns each dataset's task id and its three structure names."""
    import torch  # noqa: PLC0415

    from segnode.engines.importers.totalsegmentator import TASKS  # noqa: PLC0415

    profile = TASKS[task]
    trainer = profile.trainer_folder.split("__")[0]
    plans = json.loads((model_dir / "plans.json").read_text())
    plans["plans_name"] = "nnUNetPlans"
    # the dataset's spacing (nnU-Net's own resampling after TotalSegmentator's is then a
    # no-op, as with the real 3 mm / 6 mm models; segnode's import checks it)
    plans["configurations"]["3d_fullres"]["spacing"] = [profile.spacing] * 3
    dataset = json.loads((model_dir / "dataset.json").read_text())
    ckpt = torch.load(model_dir / "fold_0" / "checkpoint_final.pth", map_location="cpu",
                      weights_only=False)  # fmt: skip
    parts = []
    for task_id, folder_name, names, perm in standin_parts(task):
        folder = weights / folder_name / profile.trainer_folder
        (folder / "fold_0").mkdir(parents=True, exist_ok=True)
        labels = {"background": 0, **{n: i + 1 for i, n in enumerate(names)}}
        (folder / "dataset.json").write_text(json.dumps({**dataset, "labels": labels}, indent=2))
        (folder / "plans.json").write_text(json.dumps(plans, indent=2))
        if (model_dir / "dataset_fingerprint.json").is_file():
            shutil.copy(model_dir / "dataset_fingerprint.json", folder)
        state = dict(ckpt["network_weights"])
        for key, value in state.items():
            if key.startswith("decoder.seg_layers."):
                state[key] = value[perm].clone()
        part_ckpt = copy.copy(ckpt)
        part_ckpt.update(
            network_weights=state,
            optimizer_state=None,
            trainer_name=trainer,
            inference_allowed_mirroring_axes=None,
            init_args={**ckpt["init_args"], "plans": plans, "dataset_json": {**dataset,
                                                                            "labels": labels}},
        )  # fmt: skip
        torch.save(part_ckpt, folder / "fold_0" / "checkpoint_final.pth")
        parts.append((task_id, names))
    return parts


def register_trainers() -> None:
    """Put the trainer classes TotalSegmentator's ``total`` datasets name in its own table of
    custom trainers.

    nnU-Net finds a trainer class by importing every trainer module, one of which needs timm
    (and so a torchvision built for this torch); the same classes, found directly.
    """
    import totalsegmentator.nnunet as ts_nnunet  # noqa: PLC0415
    from nnunetv2.training.nnUNetTrainer.variants.data_augmentation.nnUNetTrainerNoMirroring import (  # noqa: E501, PLC0415
        nnUNetTrainerNoMirroring,
    )
    from nnunetv2.training.nnUNetTrainer.variants.training_length.nnUNetTrainer_Xepochs_NoMirroring import (  # noqa: E501, PLC0415
        nnUNetTrainer_4000epochs_NoMirroring,
    )

    ts_nnunet.custom_trainers.setdefault("nnUNetTrainerNoMirroring", nnUNetTrainerNoMirroring)
    ts_nnunet.custom_trainers.setdefault(
        "nnUNetTrainer_4000epochs_NoMirroring", nnUNetTrainer_4000epochs_NoMirroring
    )


def main(argv: list[str] | None = None) -> int:
    """Build the weights, run both sides, write the artefacts; print a summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="total", choices=sorted(STANDINS))
    ap.add_argument(
        "--model",
        type=Path,
        help="trained model .tar.gz or folder (default: rebuilt from the committed ONNX fold)",
    )
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu", help="TotalSegmentator's device: cpu or gpu")
    ap.add_argument("--cases", nargs="*", help="oracle case names (default: all)")
    args = ap.parse_args(argv)
    task: str = args.task
    work: Path = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    home = work / "totalseg_home"
    weights = home / "nnunet" / "results"
    weights.mkdir(parents=True)
    os.environ["TOTALSEG_HOME_DIR"] = str(home)
    os.environ.pop("TOTALSEG_WEIGHTS_PATH", None)
    # no usage statistics sent from a test run
    (home / "config.json").write_text(
        json.dumps(
            {"totalseg_id": "segnode-oracle", "send_usage_stats": False, "prediction_counter": 0}
        )  # fmt: skip
    )
    if args.model is None:
        model_dir = checkpoint_from_onnx(PHANTOM, work)
    else:
        model_dir = trained_model_folder(args.model, work)

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    parts = build_weights(model_dir, weights, task)
    timings["weights_s"] = time.perf_counter() - t0

    register_trainers()
    from totalsegmentator.map_to_binary import class_map  # noqa: PLC0415
    from totalsegmentator.python_api import totalsegmentator  # noqa: PLC0415

    from segnode.engines.importers.labels import load_label_csv  # noqa: PLC0415
    from segnode.engines.importers.totalsegmentator import import_totalsegmentator  # noqa: PLC0415
    from segnode.engines.manifest_parse import load_manifest  # noqa: PLC0415
    from segnode.engines.ort_backend import OrtEngine  # noqa: PLC0415
    from segnode.engines.preprocess.orientation import Geometry  # noqa: PLC0415
    from segnode.engines.trained import segment_trained  # noqa: PLC0415
    from segnode.node.ingest.volume import assemble_volume  # noqa: PLC0415

    t0 = time.perf_counter()
    imported = work / "imported"
    _, composite, manifest_path, notes = import_totalsegmentator(
        weights,
        imported,
        task,
        task=task,
        codes=load_label_csv("totalsegmentator"),
        codes_source="totalsegmentator_snomed_mapping.csv",
    )
    timings["import_s"] = time.perf_counter() - t0
    manifest = load_manifest(manifest_path)
    our_names = {int(item["value"]): str(item["name"]) for item in composite["labels"]}
    their_names = {int(k): str(v) for k, v in class_map["total"].items()}
    engine = OrtEngine()
    engine.load(manifest)

    golden: dict[str, Any] = {}
    results: dict[str, Any] = {}
    cases = [c for c in oracle_series() if not args.cases or c.name in args.cases]
    for case in cases:
        hu, _ = sample(case.grid, case.anatomy)
        nifti = work / f"{case.name}.nii.gz"
        write_nifti(str(nifti), case.grid, hu)
        t0 = time.perf_counter()
        totalsegmentator(nifti, work / f"{case.name}_{task}.nii.gz", ml=True, task="total",
                         device=args.device, quiet=True, nr_thr_saving=1,
                         **RUN_FLAGS[task])  # fmt: skip
        timings[f"totalsegmentator_{case.name}_s"] = time.perf_counter() - t0
        import SimpleITK as sitk  # noqa: N813, PLC0415

        theirs = sitk.GetArrayFromImage(sitk.ReadImage(str(work / f"{case.name}_{task}.nii.gz")))
        theirs = theirs.astype(np.uint8)
        volume = assemble_volume(write_dicom_case(case, work / "dicom" / case.name, 11))
        t0 = time.perf_counter()
        ours = segment_trained(engine, manifest, volume.hu, Geometry.from_volume(volume))
        timings[f"segnode_{case.name}_s"] = time.perf_counter() - t0
        assert ours.shape == theirs.shape, (case.name, ours.shape, theirs.shape)
        golden[case.name] = theirs
        results[case.name] = compare(ours, our_names, theirs, their_names)
        print(f"{case.name}: {results[case.name]}")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(manifest_path, out / manifest_path.name)
    for task_id, _ in parts:
        (out / f"part_{task_id}").mkdir(exist_ok=True)
        shutil.copy(imported / f"part_{task_id}" / "model.json", out / f"part_{task_id}")
    np.savez_compressed(
        out / "golden.npz",
        names=np.asarray(json.dumps(their_names)),
        **{f"{k}__totalsegmentator": v for k, v in golden.items()},
    )
    from importlib.metadata import version  # noqa: PLC0415

    summary = {
        "task": task,
        "manifest": manifest_path.name,
        "totalsegmentator_call": {"task": "total", "ml": True, **RUN_FLAGS[task]},
        "totalsegmentator": version("TotalSegmentator"),
        "nnunetv2": version("nnunetv2"),
        "torch": version("torch"),
        "weights": "--model" if args.model is not None else "checkpoint_from_onnx(fold_0.onnx)",
        "device": args.device,
        "parts": {
            str(t): {"structures": n, "permutation": p}
            for (t, n), p in zip(parts, STANDINS[task], strict=True)
        },  # fmt: skip
        "import_notes": notes,
        "codes": {
            str(item["name"]): {k: item[k] for k in ("category", "type") if k in item}
            for item in composite["labels"]
        },
        "dice": results,
        "min_dice": min(min(r.values()) for r in results.values()),
        "timings": {k: round(v, 2) for k, v in timings.items()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    (out / "oracle.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
