"""Golden outputs of nnU-Net v2's own preprocessing and export, for tests without nnunetv2.

For each case below, a small random CT volume goes through nnU-Net's
``DefaultPreprocessor.run_case_npy`` (transpose, crop to non-zero, CTNormalization, resampling
to the target spacing), a fixed elementwise "network" (:func:`fake_logits`) and
``convert_predicted_logits_to_segmentation_with_correct_shape`` (logits back to the source
shape with order 1, arg-max, uncrop, transpose back). The inputs, the preprocessed image and
the final label map are written to ``tests/data/nnunet_golden_<case>.npz``; the tests run
:func:`segnode.engines.preprocess.pipeline.run_model` on the same inputs and compare.

Run (needs ``pip install -e .[nnunet]``)::

    python -m scripts.make_nnunet_golden            # writes tests/data/nnunet_golden_*.npz

The tests also call :func:`nnunet_reference` live when nnunetv2 is importable.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from tests.fixtures.nnunet import plans_json

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"

INTENSITY = {"mean": 60.0, "std": 310.0, "percentile_00_5": -980.0, "percentile_99_5": 1350.0}
"""Foreground intensity properties of the fake dataset (HU)."""

CENTRES = (-1.5, 0.0, 1.0)
"""Class centres of :func:`fake_logits` in normalised intensity."""


@dataclass(frozen=True)
class Case:
    """One golden case: a source grid and the model's target grid."""

    name: str
    shape: tuple[int, int, int]
    spacing: tuple[float, float, float]
    target: tuple[float, float, float]
    transpose: tuple[int, int, int] = (0, 1, 2)
    zero_border: bool = False
    seed: int = 0
    regions: bool = False
    """A region-based model (sigmoid outputs, :data:`DATASET_JSON_REGIONS`)."""


CASES = (
    Case("iso", (10, 16, 14), (1.0, 1.0, 1.0), (1.5, 1.5, 1.5), seed=1),
    Case("aniso", (6, 20, 18), (5.0, 0.8, 0.8), (1.5, 1.5, 1.5), seed=2),
    Case("native", (12, 24, 22), (1.25, 0.7, 0.7), (1.5, 1.5, 1.5), seed=3),
    Case("target_aniso", (14, 12, 12), (1.0, 1.0, 1.0), (3.5, 0.8, 0.8), seed=4),
    Case(
        "transposed_cropped",
        (9, 18, 16),
        (1.5, 0.9, 0.8),
        (1.2, 1.6, 1.6),
        transpose=(2, 0, 1),
        zero_border=True,
        seed=5,
    ),
    Case("regions", (8, 20, 18), (2.5, 0.8, 0.8), (1.5, 1.2, 1.2), seed=6, regions=True),
)


def make_volume(case: Case) -> npt.NDArray[np.int16]:
    """A random CT-like volume in HU (integers), with zero slabs when ``zero_border``."""
    rng = np.random.default_rng(case.seed)
    hu = rng.normal(40.0, 450.0, size=case.shape).clip(-1024, 2500).astype(np.int16)
    if case.zero_border:  # a region outside the field of view stored as 0: nnU-Net crops it
        hu[:2] = 0
        hu[:, :, -3:] = 0
    return hu


def fake_logits(image: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """A deterministic stand-in for a network: ``-(image - centre_c)^2`` per class."""
    x = np.asarray(image, dtype=np.float32)
    return np.stack([-((x - np.float32(c)) ** 2) for c in CENTRES]).astype(np.float32)


def fake_region_logits(image: npt.NDArray[Any]) -> npt.NDArray[np.float32]:
    """A stand-in for a region-based network: region 1 where the image exceeds -0.3, region
    2 where it exceeds 0.8 (logits, sigmoid > 0.5 inside)."""
    x = np.asarray(image, dtype=np.float32)
    return np.stack([x + np.float32(0.3), x - np.float32(0.8)]).astype(np.float32)


def predictor(case: Case) -> Any:
    """The stand-in network of ``case``."""
    return fake_region_logits if case.regions else fake_logits


def plans(case: Case) -> dict[str, Any]:
    """A minimal ``plans.json`` for ``case`` (3d_fullres, CTNormalization, default resampling)."""
    return plans_json(
        dataset_name="Dataset999_Golden",
        spacing=case.target,
        shape=case.shape,
        transpose=case.transpose,
        patch=(16, 16, 16),
        architecture={"network_class_name": "x", "arch_kwargs": {}, "_kw_requires_import": []},
        batch_dice=True,
        intensity=INTENSITY,
    )


DATASET_JSON = {
    "channel_names": {"0": "CT"},
    "labels": {"background": 0, "low": 1, "high": 2},
    "numTraining": 1,
    "file_ending": ".nii.gz",
}

DATASET_JSON_REGIONS = {
    "channel_names": {"0": "CT"},
    "labels": {"background": 0, "organ": [1, 2], "core": [2]},
    "regions_class_order": [1, 2],
    "numTraining": 1,
    "file_ending": ".nii.gz",
}


def nnunet_reference(
    hu: npt.NDArray[Any], case: Case
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.uint8]]:
    """nnU-Net's preprocessed image and exported label map for ``hu`` (``case``'s grids).

    Returns
    -------
    tuple
        ``(image, labels)``: the float32 network input (model grid, after transpose) and the
        uint8 label map on the source grid.
    """
    import torch
    from nnunetv2.inference.export_prediction import (
        convert_predicted_logits_to_segmentation_with_correct_shape,
    )
    from nnunetv2.preprocessing.preprocessors.default_preprocessor import DefaultPreprocessor
    from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

    manager = PlansManager(plans(case))
    configuration = manager.get_configuration("3d_fullres")
    dataset_json = DATASET_JSON_REGIONS if case.regions else DATASET_JSON
    properties: dict[str, Any] = {"spacing": list(case.spacing)}
    data, _, properties = DefaultPreprocessor(verbose=False).run_case_npy(
        hu[None].astype(np.float32), None, properties, manager, configuration, dataset_json
    )
    logits = torch.from_numpy(predictor(case)(data[0]))
    labels = convert_predicted_logits_to_segmentation_with_correct_shape(
        logits,
        manager,
        configuration,
        manager.get_label_manager(dataset_json),
        properties,
        num_threads_torch=1,
    )
    return data[0].astype(np.float32), np.asarray(labels, dtype=np.uint8)


def main(argv: list[str] | None = None) -> int:
    """Write one ``.npz`` per case."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DATA, help="folder for the .npz files")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from importlib.metadata import version

    for case in CASES:
        hu = make_volume(case)
        image, labels = nnunet_reference(hu, case)
        path = args.out / f"nnunet_golden_{case.name}.npz"
        np.savez_compressed(
            path,
            hu=hu,
            image=image,
            labels=labels,
            nnunetv2_version=np.array(version("nnunetv2")),
        )
        counts = np.bincount(labels.ravel(), minlength=len(CENTRES))
        print(
            f"{path.name}: {hu.shape} -> {image.shape}, labels {counts.tolist()}, "
            f"{path.stat().st_size} bytes"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
