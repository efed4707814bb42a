"""Oracle: a model trained by nnU-Net v2 itself, imported, agrees with ``nnUNetPredictor``.

``scripts/make_nnunet_trained.py`` trained the model with nnU-Net's own planner,
preprocessor and trainer on the patient-space phantom (:mod:`scripts.nnunet_phantom`), and ran
``nnUNetPredictor`` (both folds, mirroring, Gaussian, step 0.5, ``NibabelIOWithReorient``) on
the oracle series: 0.7 x 0.7 x 1.25 mm head-first and feet-first, 0.8 x 0.8 x 5 mm, 1.5 mm
isotropic and a coronal acquisition. Its segmentations are the golden file
``tests/data/nnunet_trained_golden.npz``; ``segnode model import nnunet`` turned the trained
folder into ``tests/data/nnunet_phantom/`` (two ONNX folds and a version-2 manifest; the
folds' weights are stored as float16 and computed in float32, ``scripts/onnx_fp16_storage.py``,
to keep each file under 2 MB).

Here segnode reads the same series as DICOM (the node's own volume assembly from the
headers), runs the imported model on ONNX Runtime, and must agree with ``nnUNetPredictor``
at Dice >= 0.99 for every label; one series goes through a whole node and its SEG is read
back with highdicom.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from scripts.nnunet_phantom import LABELS, dice, oracle_cases, write_dicom_case
from segnode.engines.manifest import ModelManifest
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.ort_backend import OrtEngine
from segnode.engines.preprocess.orientation import Geometry
from segnode.engines.trained import segment_trained

DATA = Path(__file__).resolve().parent / "data"
MODEL = DATA / "nnunet_phantom" / "phantom.json"
GOLDEN = DATA / "nnunet_trained_golden.npz"
CASES = {case.name: case for case in oracle_cases()}

pytestmark = pytest.mark.skipif(
    not (MODEL.is_file() and GOLDEN.is_file()),
    reason="the trained phantom model or its golden file is missing "
    "(python -m scripts.make_nnunet_trained, then segnode model import nnunet)",
)


@pytest.fixture(scope="module")
def manifest() -> ModelManifest:
    return load_manifest(MODEL)


@pytest.fixture(scope="module")
def golden() -> dict[str, npt.NDArray[np.uint8]]:
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def engine(manifest: ModelManifest) -> OrtEngine:
    e = OrtEngine()
    e.load(manifest)
    return e


def test_the_golden_model_learnt_the_phantom(golden: dict[str, npt.NDArray[np.uint8]]) -> None:
    """The reference is a real segmentation, not an empty or trivial one: nnUNetPredictor's
    labels match the phantom's truth (so an agreement below is not two empty maps)."""
    for name in CASES:
        got, truth = golden[f"{name}__nnunet"], golden[f"{name}__truth"]
        for label in (LABELS["body"], LABELS["lung"], LABELS["bone"]):
            assert dice(got, truth, label) > 0.8, (name, label, dice(got, truth, label))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_segnode_agrees_with_nnunet_predictor(
    name: str,
    tmp_path: Path,
    manifest: ModelManifest,
    engine: OrtEngine,
    golden: dict[str, npt.NDArray[np.uint8]],
) -> None:
    """The DICOM series through the node's volume assembly and the imported model on ONNX
    Runtime: Dice >= 0.99 with nnUNetPredictor for every label, on the series' own grid."""
    from segnode.node.ingest.volume import assemble_volume

    files = write_dicom_case(CASES[name], tmp_path / name, seed=11)
    volume = assemble_volume(files)
    labels = segment_trained(engine, manifest, volume.hu, Geometry.from_volume(volume))
    want = golden[f"{name}__nnunet"]
    assert labels.shape == want.shape
    scores = {k: dice(labels, want, v) for k, v in LABELS.items() if v}
    assert min(scores.values()) >= 0.99, scores


@pytest.mark.slow
def test_node_seg_agrees_with_nnunet_predictor(
    make_node: Any, tmp_path: Path, golden: dict[str, npt.NDArray[np.uint8]]
) -> None:
    """``segnode serve`` with the imported model: a feet-first series sent over DICOM gives a
    SEG whose labels, read back by highdicom per source instance, agree with nnUNetPredictor
    at Dice >= 0.99 for every label."""
    from scripts.harness import send_files
    from segnode.node.pipeline.worker import result_paths
    from tests.conftest import wait_for_the_job
    from tests.fixtures.seg_readback import seg_labels

    case = CASES["native_ffs"]
    files = write_dicom_case(case, tmp_path / "in", seed=12)
    node = make_node(model={"manifest": str(MODEL)})
    assert send_files(files, node.port).complete

    job = wait_for_the_job(node, 180, "the trained model's job")
    seg_path, _ = sorted(result_paths(node.data_dir, int(job["id"])))
    # Source instances in the order of the golden array: ascending along the slice normal.
    normal = np.cross(case.grid.orientation[:3], case.grid.orientation[3:])
    labels = seg_labels(seg_path, files, lambda name: LABELS[name.lower()], normal)
    want = golden["native_ffs__nnunet"]
    scores = {k: dice(labels, want, v) for k, v in LABELS.items() if v}
    assert min(scores.values()) >= 0.99, scores
