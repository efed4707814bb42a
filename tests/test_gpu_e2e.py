"""``segnode serve`` with a GPU engine, end to end (skips without a CUDA GPU).

A synthetic CT series is sent over loopback by a pynetdicom SCU; the node (engine "torch")
segments it on the GPU; the SEG it encoded must agree with ONNX Runtime on the CPU.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import highdicom as hd
import numpy as np
import pytest
from pydicom import dcmread
from pynetdicom import AE

from segnode.engines.manifest_parse import load_manifest
from segnode.engines.ort_backend import OrtEngine
from segnode.node.config import DEFAULT_MODEL
from segnode.node.ingest.volume import assemble_volume
from tests.conftest import LOOPBACK, wait_for
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

torch: Any = pytest.importorskip("torch", reason="PyTorch not installed (GPU machines only)")
pytest.importorskip("onnx2torch", reason="onnx2torch not installed (pip install onnx2torch)")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU available"),
]


def send_series(port: int, files: list[Path]) -> float:
    """Send ``files`` in one association; return the monotonic time of the last response."""
    ae = AE(ae_title="MODALITY")
    first = dcmread(files[0], stop_before_pixels=True)
    ae.add_requested_context(first.SOPClassUID, first.file_meta.TransferSyntaxUID)
    assoc = ae.associate(LOOPBACK, port, ae_title="SEGNODE")
    assert assoc.is_established
    for f in files:
        assert int(assoc.send_c_store(f).Status) == 0
    t_last = time.monotonic()
    assoc.release()
    return t_last


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_serve_with_torch_engine_on_gpu(make_node: Any, tmp_path: Path, precision: str) -> None:
    node = make_node(start=False, model={"engine": "torch", "precision": precision})
    node.start(timeout=180)
    files = write_synthetic_series(
        tmp_path / "ct", PhantomGeometry(rows=512, columns=512, slices=64), seed=50 + len(precision)
    )
    t_last = send_series(node.port, files)
    wait_for(lambda: any(j["state"] == "done" for j in node.jobs()["jobs"]), 180, "GPU job done")
    elapsed = time.monotonic() - t_last
    job = node.jobs()["jobs"][0]
    print(
        f"torch {precision}: last C-STORE response -> SEG+SR encoded {elapsed:.2f} s; "
        f"{job['stages']}"
    )
    seg_file = next((node.data_dir / "results" / str(job["id"])).glob("seg-*.dcm"))
    seg = hd.seg.segread(seg_file)
    vol = assemble_volume(files)
    uids = [str(s.SOPInstanceUID) for s in vol.sources]
    gpu = seg.get_pixels_by_source_instance(
        source_sop_instance_uids=uids,
        combine_segments=True,
        relabel=False,
        skip_overlap_checks=True,
    ).astype(np.uint8)
    eng = OrtEngine()
    eng.load(load_manifest(DEFAULT_MODEL))
    cpu = eng.segment(vol.hu)
    eng.close()
    # SEG segment numbers are 1..n in ascending label value; map back to label values.
    values = sorted(int(v) for v in np.unique(cpu) if v)
    lut = np.zeros(256, dtype=np.uint8)
    for number, value in enumerate(values, start=1):
        lut[number] = value
    agreement = float(np.mean(lut[gpu] == cpu))
    print(f"torch {precision} vs onnxruntime CPU voxel agreement: {agreement:.6f}")
    assert agreement >= 0.999
