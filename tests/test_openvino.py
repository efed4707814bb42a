"""The ``openvino`` engine (OpenVINO on the CPU, BF16 where the processor has it).

Its answer is checked the way the ONNX Runtime path is: against TotalSegmentator 2.18's own
``--fast`` output (``tests/data/totalseg_phantom_fast``, made by
``scripts/make_totalseg_oracle.py`` from the phantom-trained model under Dataset297), through
the node's DICOM volume assembly, on the feet-first, coronal and 800-slice series: FP32 at the
same Dice as ONNX Runtime, BF16 (the accuracy guard of a lower precision) at >= 0.99 per
structure; and the engine's errors say what is wrong.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from segnode.engines.base import EngineError, create_engine
from segnode.engines.manifest_parse import load_manifest
from segnode.engines.preprocess.orientation import Geometry
from segnode.engines.trained import segment_trained

ov = pytest.importorskip("openvino", reason="the openvino engine needs OpenVINO (extra [openvino])")

DATA = Path(__file__).resolve().parent / "data"
FAST = DATA / "totalseg_phantom_fast"
PHANTOM_FOLD = DATA / "nnunet_phantom" / "fold_0.onnx"


@pytest.fixture(scope="module")
def fast_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``total_fast`` composite of the oracle, its fold rebuilt from the phantom fold."""
    if not ((FAST / "golden.npz").is_file() and PHANTOM_FOLD.is_file()):
        pytest.skip("the TotalSegmentator --fast oracle files are missing")
    pytest.importorskip("onnx")
    from scripts.make_totalseg_oracle import rebuild_composite

    return rebuild_composite(FAST, tmp_path_factory.mktemp("fast"), PHANTOM_FOLD)


@pytest.fixture(scope="module")
def golden() -> tuple[dict[str, Any], dict[int, str]]:
    with np.load(FAST / "golden.npz") as z:
        names = {int(k): str(v) for k, v in json.loads(str(z["names"])).items()}
        maps = {k.split("__")[0]: z[k] for k in z.files if k.endswith("__totalsegmentator")}
    return maps, names


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["native_ffs", "coronal", "long_ffs"])
def test_openvino_agrees_with_totalsegmentator(
    name: str,
    precision: str,
    fast_model: Path,
    golden: tuple[dict[str, Any], dict[int, str]],
    tmp_path: Path,
) -> None:
    """TotalSegmentator's ``--fast`` on the phantom-trained Dataset297, structure by
    structure: OpenVINO FP32 >= 0.999 Dice, BF16 >= 0.99 (it ran in BF16 where the CPU has
    it: the engine reports what OpenVINO compiled with)."""
    from scripts.make_totalseg_oracle import compare, oracle_series
    from scripts.nnunet_phantom import write_dicom_case
    from segnode.node.ingest.volume import assemble_volume

    case = {c.name: c for c in oracle_series()}[name]
    manifest = load_manifest(fast_model)
    engine = create_engine("openvino", precision=precision, threads=2)
    engine.load(manifest)
    bf16_cpu = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    want = "bf16" if precision == "bf16" and bf16_cpu else "fp32"
    assert engine.inference_precision == want  # type: ignore[attr-defined]
    volume = assemble_volume(write_dicom_case(case, tmp_path / name, seed=11))
    labels = segment_trained(engine, manifest, volume.hu, Geometry.from_volume(volume))
    maps, their_names = golden
    our_names = {label.value: label.name for label in manifest.labels}
    scores = compare(labels, our_names, maps[name], their_names)
    assert scores
    assert min(scores.values()) >= (0.999 if precision == "fp32" else 0.99), scores


def test_openvino_refuses_what_it_cannot_run(tmp_path: Path, fast_model: Path) -> None:
    """A version-1 model, a precision it has not, a file cut short: errors that name them."""
    with pytest.raises(EngineError, match="precision must be bf16 or fp32, got 'fp16'"):
        create_engine("openvino", precision="fp16")
    tissue = Path(__file__).resolve().parent.parent / "engines" / "models" / "tissue"
    engine = create_engine("openvino")
    with pytest.raises(EngineError, match="version-1 model.*use onnxruntime"):
        engine.load(load_manifest(tissue / "tissue.json"))
    broken = tmp_path / "broken"
    shutil.copytree(fast_model.parent, broken)
    fold = next(broken.glob("part_*/fold_0.onnx"))
    fold.write_bytes(fold.read_bytes()[:1000])  # cut short
    with pytest.raises(EngineError, match=r"cannot load .*fold_0\.onnx"):
        engine.load(load_manifest(broken / fast_model.name))
