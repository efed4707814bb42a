"""TotalSegmentator's own Python API against segnode's TotalSegmentator profile (issue 15).

The model nnU-Net trained on the phantom (:mod:`scripts.make_nnunet_trained`) is placed under
TotalSegmentator's folder names for its ``total`` task (datasets 291-295,
``nnUNetTrainerNoMirroring__nnUNetPlans__3d_fullres/fold_0``), once per dataset, each copy
with its three labels renamed to the first three structures of that part
(``class_map_5_parts``) and its output channels permuted differently (:data:`PERMUTATIONS`),
so that a part taken in the wrong order or mapped to the wrong names shows. Then, for each
oracle series (:func:`scripts.nnunet_phantom.oracle_cases`):

* ``totalsegmentator.python_api.totalsegmentator(..., task="total", ml=True)`` - its own
  pipeline (canonical RAS, order-1 resampling to 1.5 mm, nnU-Net with step 0.8 and no
  mirroring on each part, the parts merged, the labels back on the input grid) - on the
  series as NIfTI; its multi-label output is the golden file;
* ``segnode model import totalsegmentator`` of the same weights folder, and segnode's
  composite model on ONNX Runtime on the series read as DICOM by the node's volume assembly.

Both label maps are compared per structure name (Dice). Outputs in ``--out``
(``tests/data/totalseg_phantom``): the composite manifests the import wrote (``total.json``,
``part_<id>/model.json``; the ONNX folds are not kept: the test rebuilds each part from the
committed phantom fold with :func:`permuted_onnx`), ``golden.npz`` (TotalSegmentator's label
maps and its structure names) and ``oracle.json`` (versions, timings, Dice).

Run (torch, nnunetv2 and TotalSegmentator installed; a few minutes on a CPU)::

    python -m scripts.make_totalseg_oracle --model nnunet_phantom_model.tar.gz \\
        --work /tmp/tsw --out tests/data/totalseg_phantom
"""

from __future__ import annotations

import argparse
import copy
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
from scripts.nnunet_phantom import dice, oracle_cases, sample, write_dicom_case, write_nifti

PERMUTATIONS = ([0, 1, 2, 3], [0, 2, 3, 1], [0, 3, 1, 2], [0, 2, 1, 3], [0, 3, 2, 1])
"""Per part (291..295): new output channel ``j`` is the phantom model's channel ``perm[j]``."""


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


def build_weights(model_dir: Path, weights: Path) -> list[tuple[int, list[str]]]:
    """TotalSegmentator's ``total`` weights folder made of the phantom model (see the module
    docstring); returns each part's task id and its three structure names."""
    import torch  # noqa: PLC0415
    from totalsegmentator.map_to_binary import (  # noqa: PLC0415
        class_map_5_parts,
        map_taskid_to_partname_ct,
    )

    from segnode.engines.importers.totalsegmentator import TASKS  # noqa: PLC0415

    profile = TASKS["total"]
    plans = json.loads((model_dir / "plans.json").read_text())
    plans["plans_name"] = "nnUNetPlans"
    dataset = json.loads((model_dir / "dataset.json").read_text())
    ckpt = torch.load(model_dir / "fold_0" / "checkpoint_final.pth", map_location="cpu",
                      weights_only=False)  # fmt: skip
    parts = []
    for (task_id, folder_name), perm in zip(profile.datasets, PERMUTATIONS, strict=True):
        part = class_map_5_parts[map_taskid_to_partname_ct[task_id]]
        names = [part[1], part[2], part[3]]
        folder = weights / folder_name / profile.trainer_folder
        (folder / "fold_0").mkdir(parents=True, exist_ok=True)
        labels = {"background": 0, **{n: i + 1 for i, n in enumerate(names)}}
        (folder / "dataset.json").write_text(json.dumps({**dataset, "labels": labels}, indent=2))
        (folder / "plans.json").write_text(json.dumps(plans, indent=2))
        shutil.copy(model_dir / "dataset_fingerprint.json", folder)
        state = dict(ckpt["network_weights"])
        for key, value in state.items():
            if key.startswith("decoder.seg_layers."):
                state[key] = value[perm].clone()
        part_ckpt = copy.copy(ckpt)
        part_ckpt.update(
            network_weights=state,
            optimizer_state=None,
            trainer_name="nnUNetTrainerNoMirroring",
            inference_allowed_mirroring_axes=None,
            init_args={**ckpt["init_args"], "plans": plans, "dataset_json": {**dataset,
                                                                            "labels": labels}},
        )  # fmt: skip
        torch.save(part_ckpt, folder / "fold_0" / "checkpoint_final.pth")
        parts.append((task_id, names))
    return parts


def main(argv: list[str] | None = None) -> int:
    """Build the weights, run both sides, write the artefacts; print a summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="trained model .tar.gz or folder")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu", help="TotalSegmentator's device: cpu or gpu")
    args = ap.parse_args(argv)
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
    model_dir = trained_model_folder(args.model, work)

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    parts = build_weights(model_dir, weights)
    timings["weights_s"] = time.perf_counter() - t0

    import totalsegmentator.nnunet as ts_nnunet  # noqa: PLC0415
    from nnunetv2.training.nnUNetTrainer.variants.data_augmentation.nnUNetTrainerNoMirroring import (  # noqa: E501, PLC0415
        nnUNetTrainerNoMirroring,
    )
    from totalsegmentator.map_to_binary import class_map  # noqa: PLC0415

    # nnU-Net finds the trainer class by importing every trainer module, one of which needs
    # timm (and so a torchvision built for this torch); register the one class the parts name
    # in TotalSegmentator's own table of custom trainers instead (same class either way)
    ts_nnunet.custom_trainers.setdefault("nnUNetTrainerNoMirroring", nnUNetTrainerNoMirroring)
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
        "total",
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
    for case in oracle_cases():
        hu, _ = sample(case.grid, case.anatomy)
        nifti = work / f"{case.name}.nii.gz"
        write_nifti(str(nifti), case.grid, hu)
        t0 = time.perf_counter()
        totalsegmentator(nifti, work / f"{case.name}_total.nii.gz", ml=True, task="total",
                         device=args.device, quiet=True, nr_thr_saving=1)  # fmt: skip
        timings[f"totalsegmentator_{case.name}_s"] = time.perf_counter() - t0
        import SimpleITK as sitk  # noqa: N813, PLC0415

        theirs = sitk.GetArrayFromImage(sitk.ReadImage(str(work / f"{case.name}_total.nii.gz")))
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

    import nnunetv2  # noqa: F401, PLC0415

    summary = {
        "totalsegmentator": version("TotalSegmentator"),
        "nnunetv2": version("nnunetv2"),
        "device": args.device,
        "parts": {
            str(t): {"structures": n, "permutation": p}
            for (t, n), p in zip(parts, PERMUTATIONS, strict=True)
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
