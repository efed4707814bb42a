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


# ------------------------------------------------------------------------------ fp32_leading


def _phantom_manifest(tmp_path: Path, **changes: Any) -> Path:
    """The trained phantom model, fold 0, with ``changes`` in its manifest."""
    folder = tmp_path / "model"
    shutil.copytree(DATA / "nnunet_phantom", folder)
    path = folder / "phantom.json"
    doc = json.loads(path.read_text())
    doc["folds"] = ["fold_0.onnx"]
    doc.update(changes)
    path.write_text(json.dumps(doc, indent=2))
    return path


def _tiles(n: int = 2) -> np.ndarray:
    return (np.random.default_rng(7).normal(size=(n, 1, 48, 48, 48)) * 0.5).astype(np.float32)


def test_the_cut_network_computes_what_the_whole_one_does() -> None:
    """Both parts in float32: the cut (skip connections crossing it) changes nothing."""
    from segnode.engines.openvino_backend import _compile_split

    core = ov.Core()
    model = core.read_model(str(PHANTOM_FOLD))
    model.reshape({model.inputs[0].get_any_name(): [1, 1, 48, 48, 48]})
    config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": 1}
    whole = core.compile_model(model, "CPU", config)
    for leading in (1, 3, 6, 12):
        head, tail = _compile_split(ov, core, model, leading, config)
        assert len(head.outputs) == len(tail.inputs) >= 1
        x = _tiles(1)
        crossing = head(x)
        got = tail([crossing[o] for o in head.outputs])[0]
        np.testing.assert_allclose(got, whole(x)[0], rtol=0, atol=2e-4)


def test_the_first_convolutions_are_marked_float32_in_one_bf16_network() -> None:
    """OpenVINO honours the per-operation mark: one network, whose first ``leading``
    convolutions (and what lies between them) run in float32 and the rest in BF16."""
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU has no BF16 instructions: OpenVINO runs FP32")
    from segnode.engines.openvino_backend import _compile_leading

    core = ov.Core()
    model = core.read_model(str(PHANTOM_FOLD))
    model.reshape({model.inputs[0].get_any_name(): [1, 1, 48, 48, 48]})
    config = {"INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": 1}
    for leading in (1, 3):
        networks = _compile_leading(ov, core, model, leading, config)
        assert len(networks) == 1
        runtime = [op.get_rt_info() for op in networks[0].get_runtime_model().get_ordered_ops()]
        convolutions = [
            str(info["runtimePrecision"].astype(str))
            for info in runtime
            if str(info["layerType"].astype(str)) in ("Convolution", "Deconvolution")
        ]
        assert convolutions[:leading] == ["f32"] * leading, convolutions
        assert set(convolutions[leading:]) == {"bf16"}, convolutions


def test_fp32_first_convolutions_bring_bf16_closer_to_fp32(tmp_path: Path) -> None:
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU has no BF16 instructions: OpenVINO runs FP32")
    from segnode.engines.openvino_backend import OpenVinoEngine

    manifest = load_manifest(_phantom_manifest(tmp_path))
    x = _tiles()
    out = {}
    for precision, leading in (("fp32", None), ("bf16", 0), ("bf16", 1), ("bf16", 3)):
        with OpenVinoEngine(threads=1, precision=precision, fp32_leading=leading) as engine:
            engine.load(manifest)
            assert engine.fp32_leading_used == (leading or 0)
            out[leading] = engine.fold_predictors()[0](x)
    error = {k: float(np.abs(out[k] - out[None]).mean()) for k in (0, 1, 3)}
    assert 0 < error[3] < error[1] < error[0], error


def test_fp32_leading_errors_say_what_is_wrong(tmp_path: Path) -> None:
    from segnode.engines.openvino_backend import OpenVinoEngine

    with pytest.raises(EngineError, match="fp32_leading must be 0 or more"):
        OpenVinoEngine(fp32_leading=-1)
    manifest = load_manifest(_phantom_manifest(tmp_path))
    with (
        OpenVinoEngine(threads=1, fp32_leading=500) as engine,
        pytest.raises(EngineError, match="convolutions; the cut must leave"),
    ):
        if engine.precision == "bf16" and "BF16" not in ov.Core().get_property(
            "CPU", "OPTIMIZATION_CAPABILITIES"
        ):
            pytest.skip("this CPU runs OpenVINO in FP32: no cut is made")
        engine.load(manifest)
    bad = tmp_path / "bad"
    bad.mkdir()
    path = _phantom_manifest(
        bad, precision="bf16", calibration={"fp32_leading_convolutions": "three"}
    )
    with (
        OpenVinoEngine(threads=1) as engine,
        pytest.raises(EngineError, match="fp32_leading_convolutions must be a count"),
    ):
        engine.load(load_manifest(path))
