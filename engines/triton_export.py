"""``segnode engine export-triton``: a Triton model repository for a configured model.

Triton (and KServe's Triton runtime) serves a folder with one sub-folder per model::

    DIR/<name>/config.pbtxt
    DIR/<name>/1/model.onnx

``config.pbtxt`` is the text form of Triton's ``ModelConfig`` protobuf (``model_config.proto``):
platform ``onnxruntime_onnx``, the input and output names, data types and dims read from the
ONNX graph, and ``max_batch_size`` from the manifest's ``batch.max`` when the graph's batch axis
is dynamic (Triton then leaves the batch axis out of ``dims``), 0 when it is fixed (``dims``
are the whole shape). A version-2 (trained) manifest gets one model per fold file, named as
the ``kserve`` engine asks for them (:func:`segnode.engines.kserve_backend.remote_model_names`).

``tensorrt="FP16"`` (or ``"FP32"``) adds a GPU instance group and ONNX Runtime's TensorRT
execution accelerator (Triton's ``onnxruntime`` backend: ``optimization {
execution_accelerators { gpu_execution_accelerator: [{ name: "tensorrt" ... }] } }``), which
builds TensorRT engines for the server's own GPU when the model loads and caches them. A
TensorRT plan (``tensorrt_plan``) is not written: a plan is tied to the exact TensorRT version
and GPU of the server, which segnode cannot know here.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from segnode.engines.base import EngineError
from segnode.engines.kserve_backend import remote_model_names
from segnode.engines.manifest import ModelManifest

_TRITON_TYPES: dict[int, str] = {
    onnx.TensorProto.FLOAT: "TYPE_FP32",
    onnx.TensorProto.FLOAT16: "TYPE_FP16",
    onnx.TensorProto.DOUBLE: "TYPE_FP64",
    onnx.TensorProto.UINT8: "TYPE_UINT8",
    onnx.TensorProto.INT8: "TYPE_INT8",
    onnx.TensorProto.INT32: "TYPE_INT32",
    onnx.TensorProto.INT64: "TYPE_INT64",
    onnx.TensorProto.BOOL: "TYPE_BOOL",
}


@dataclass(frozen=True)
class ExportedModel:
    """One model written into the repository."""

    name: str
    folder: Path
    max_batch_size: int


def _tensor(value: onnx.ValueInfoProto, where: str) -> tuple[str, list[int]]:
    """Triton's data type and the full dims (-1 where the graph names a dimension)."""
    tensor = value.type.tensor_type
    data_type = _TRITON_TYPES.get(int(tensor.elem_type))
    if data_type is None:
        raise EngineError(f"{where}: tensor {value.name!r} has a type Triton's config lacks")
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim]
    return data_type, dims


def _block(kind: str, name: str, data_type: str, dims: list[int]) -> str:
    return (
        f'{kind} [\n  {{\n    name: "{name}"\n    data_type: {data_type}\n'
        f"    dims: [ {', '.join(map(str, dims))} ]\n  }}\n]\n"
    )


def triton_config(unit: ModelManifest, name: str, tensorrt: str | None = None) -> tuple[str, int]:
    """The ``config.pbtxt`` text of one ONNX file and its ``max_batch_size``; ``tensorrt``
    (``"FP16"`` or ``"FP32"``) asks for ONNX Runtime's TensorRT accelerator on the GPU.

    Raises
    ------
    EngineError
        If the ONNX file cannot be read or lacks the manifest's input or output.
    """
    where = f"model {unit.name!r} ({unit.onnx_path})"
    try:
        graph = onnx.load(str(unit.onnx_path), load_external_data=False).graph
    except (OSError, ValueError, DecodeError, onnx.checker.ValidationError) as exc:
        raise EngineError(f"{where}: cannot read the ONNX file: {exc}") from exc
    initialisers = {i.name for i in graph.initializer}
    inputs = {v.name: v for v in graph.input if v.name not in initialisers}
    outputs = {v.name: v for v in graph.output}
    unit.check_tensors(where, inputs, outputs)
    in_type, in_dims = _tensor(inputs[unit.input_name], where)
    out_type, out_dims = _tensor(outputs[unit.output_name], where)
    dynamic = bool(in_dims) and in_dims[0] == -1 and bool(out_dims) and out_dims[0] == -1
    max_batch = max(1, unit.batch_max) if dynamic else 0
    if dynamic:
        in_dims, out_dims = in_dims[1:], out_dims[1:]
    text = (
        f'name: "{name}"\nplatform: "onnxruntime_onnx"\nmax_batch_size: {max_batch}\n'
        + _block("input", unit.input_name, in_type, in_dims)
        + _block("output", unit.output_name, out_type, out_dims)
    )
    if tensorrt is not None:
        if tensorrt not in ("FP16", "FP32"):
            raise EngineError(f"tensorrt precision must be FP16 or FP32, got {tensorrt!r}")
        text += _TENSORRT.format(precision=tensorrt)
    return text, max_batch


_TENSORRT = """instance_group [
  {{
    kind: KIND_GPU
    count: 1
  }}
]
optimization {{
  execution_accelerators {{
    gpu_execution_accelerator: [
      {{
        name: "tensorrt"
        parameters {{ key: "precision_mode" value: "{precision}" }}
        parameters {{ key: "max_workspace_size_bytes" value: "4294967296" }}
        parameters {{ key: "trt_engine_cache_enable" value: "1" }}
      }}
    ]
  }}
}}
"""


def export_triton(
    manifest: ModelManifest, folder: Path, name: str | None = None, tensorrt: str | None = None
) -> list[ExportedModel]:
    """Write ``manifest``'s model(s) into the Triton repository ``folder``.

    Parameters
    ----------
    manifest
        The model (a version-2 one gives one Triton model per fold file).
    folder
        The repository; created if needed; a model folder already there is replaced.
    name
        The remote model's name (default: the manifest's name).
    tensorrt
        ``"FP16"`` or ``"FP32"``: run on the server's GPU through ONNX Runtime's TensorRT
        accelerator (None: Triton's defaults for the ONNX Runtime backend).

    Raises
    ------
    EngineError
        If an ONNX file cannot be read, lacks the manifest's tensors, or cannot be written.
    """
    units = manifest.model_files() if manifest.is_trained else (manifest,)
    written = []
    for unit, remote in zip(units, remote_model_names(manifest, name), strict=True):
        text, max_batch = triton_config(unit, remote, tensorrt)
        target = Path(folder) / remote
        try:
            if target.exists():
                shutil.rmtree(target)
            (target / "1").mkdir(parents=True)
            shutil.copyfile(unit.onnx_path, target / "1" / "model.onnx")
            (target / "config.pbtxt").write_text(text, encoding="utf-8")
        except OSError as exc:
            raise EngineError(f"cannot write the Triton model {target}: {exc}") from exc
        written.append(ExportedModel(remote, target, max_batch))
    return written
