"""Oracle: segnode's TotalSegmentator profile agrees with TotalSegmentator's own Python API.

``scripts/make_totalseg_oracle.py`` placed the model nnU-Net trained on the phantom under
TotalSegmentator's folder names for its ``total`` task (datasets 291-295, each part with the
names of its first three structures and its output channels permuted differently), ran
``totalsegmentator.python_api.totalsegmentator(task="total", ml=True)`` on the oracle series
and imported the same weights with ``segnode model import totalsegmentator``. It committed
TotalSegmentator's label maps (``tests/data/totalseg_phantom/golden.npz``) and the composite
manifests the import wrote; the parts' ONNX folds are rebuilt here from the committed phantom
fold with the same channel permutations (:func:`scripts.make_totalseg_oracle.permuted_onnx`).

segnode reads each series as DICOM, runs the composite on ONNX Runtime, and must agree with
TotalSegmentator at Dice >= 0.99 for every structure, by name; the SEG codes every structure
as the SNOMED CT mapping TotalSegmentator ships says, laterality included.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from scripts.nnunet_phantom import oracle_cases, write_dicom_case
from segnode.engines.manifest import ModelManifest
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.ort_backend import OrtEngine
from segnode.engines.preprocess.orientation import Geometry
from segnode.engines.trained import segment_trained

DATA = Path(__file__).resolve().parent / "data"
ORACLE = DATA / "totalseg_phantom"
PHANTOM_FOLD = DATA / "nnunet_phantom" / "fold_0.onnx"
CASES = {case.name: case for case in oracle_cases()}

pytestmark = pytest.mark.skipif(
    not ((ORACLE / "golden.npz").is_file() and PHANTOM_FOLD.is_file()),
    reason="the TotalSegmentator oracle files are missing (python -m scripts.make_totalseg_oracle)",
)


@pytest.fixture(scope="module")
def summary() -> dict[str, Any]:
    return json.loads((ORACLE / "oracle.json").read_text())


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, summary: dict[str, Any]) -> Path:
    """The composite model folder: committed manifests, parts rebuilt from the phantom fold."""
    pytest.importorskip("onnx")
    from scripts.make_totalseg_oracle import permuted_onnx

    folder = tmp_path_factory.mktemp("totalseg")
    shutil.copy(ORACLE / "total.json", folder / "total.json")
    for task_id, part in summary["parts"].items():
        dst = folder / f"part_{task_id}"
        dst.mkdir()
        shutil.copy(ORACLE / f"part_{task_id}" / "model.json", dst / "model.json")
        permuted_onnx(PHANTOM_FOLD, dst / "fold_0.onnx", list(part["permutation"]))
    return folder / "total.json"


@pytest.fixture(scope="module")
def manifest(model: Path) -> ModelManifest:
    return load_manifest(model)


@pytest.fixture(scope="module")
def engine(manifest: ModelManifest) -> OrtEngine:
    e = OrtEngine()
    e.load(manifest)
    return e


@pytest.fixture(scope="module")
def golden() -> tuple[dict[str, npt.NDArray[np.uint8]], dict[int, str]]:
    with np.load(ORACLE / "golden.npz") as z:
        names = {int(k): str(v) for k, v in json.loads(str(z["names"])).items()}
        maps = {k.split("__")[0]: z[k] for k in z.files if k.endswith("__totalsegmentator")}
    return maps, names


def test_the_profile_is_totalsegmentators(manifest: ModelManifest) -> None:
    """Five parts in TotalSegmentator's order, each with its pipeline: canonical RAS, order-1
    corner-aligned resampling to 1.5 mm before normalisation, step 0.8, no mirroring."""
    assert [p.manifest.name for p in manifest.parts] == [
        f"total_part_{t}" for t in (291, 292, 293, 294, 295)
    ]
    for part in manifest.parts:
        c = part.manifest.model_contract()
        assert c.scheme == "totalsegmentator" and c.data_order == 1
        assert c.spacing == (1.5, 1.5, 1.5) and c.orientation == "SAR"
        assert c.mirror_axes == () and part.manifest.overlap == pytest.approx(0.2)


def test_structures_are_coded_as_totalsegmentator_maps_them(
    manifest: ModelManifest, summary: dict[str, Any]
) -> None:
    """Every structure of the merged label space carries the SNOMED CT category and type of
    TotalSegmentator's mapping, and lateral ones their laterality (kidney_left: Kidney, Left)."""
    by_name = {label.name: label for label in manifest.labels}
    assert len(by_name) == 15
    for name, codes in summary["codes"].items():
        assert list(by_name[name].category) == codes["category"], name
        assert list(by_name[name].type) == codes["type"], name
    kidney_left = by_name["kidney_left"]
    assert kidney_left.type[2] == "Kidney"
    assert kidney_left.modifier is not None and kidney_left.modifier[2] == "Left"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_segnode_agrees_with_totalsegmentator(
    name: str,
    tmp_path: Path,
    manifest: ModelManifest,
    engine: OrtEngine,
    golden: tuple[dict[str, npt.NDArray[np.uint8]], dict[int, str]],
) -> None:
    """The series as DICOM through the node's volume assembly and the composite on ONNX
    Runtime: Dice >= 0.99 with TotalSegmentator's own output for every structure present."""
    from scripts.make_totalseg_oracle import compare
    from segnode.node.ingest.volume import assemble_volume

    maps, their_names = golden
    volume = assemble_volume(write_dicom_case(CASES[name], tmp_path / name, seed=11))
    labels = segment_trained(engine, manifest, volume.hu, Geometry.from_volume(volume))
    theirs = maps[name]
    assert labels.shape == theirs.shape
    our_names = {label.value: label.name for label in manifest.labels}
    scores = compare(labels, our_names, theirs, their_names)
    assert scores, "neither side found a structure"
    assert len(scores) == 3, scores  # the last part's three structures, as TotalSegmentator
    assert min(scores.values()) >= 0.99, scores
