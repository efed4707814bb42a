"""OpenVINO on the CPU: BF16 where the processor has it (an optional extra, ``[openvino]``).

Registered as ``"openvino"`` in :mod:`segnode.engines.base`. The same ONNX files as ONNX
Runtime; OpenVINO compiles each for the CPU with ``INFERENCE_PRECISION_HINT`` from the
``precision`` option:

* ``"bf16"``: the convolutions in bfloat16 on a CPU with AVX-512 BF16 or AMX (Intel Xeon of
  the 4th generation on, some AMD Zen 4/5), accumulating in float32; on a CPU without them
  OpenVINO runs float32 and the engine says so when it loads;
* ``"fp32"``: float32 throughout (the reference).

**The first convolutions in float32** (``fp32_leading``, or the manifest's
``calibration.fp32_leading_convolutions`` written by ``segnode model calibrate --precision
bf16``). Most of BF16's error enters at the input: a normalised CT value keeps 8 bits of
mantissa, about 3 significant digits. Every operation before the network's
``fp32_leading``-th convolution (in topological order: the convolutions, their normalisation
and activation) is then marked to stay in float32, and the network is compiled once in BF16
(:func:`_compile_leading`); an OpenVINO that ignores the mark gets the network cut in two
instead, float32 before the cut and BF16 after it (:func:`_compile_split`). On the tiny
phantom model's 512 x 512 x 300 CT (docs/performance.md) the first convolution in float32
raised its lowest Dice against ``nnUNetPredictor`` from 0.9898 to 0.9947, at no measurable
cost (85.4 s against 89.2 s for BF16 alone, one run each).

On this project's 2-core development CPU (AMX), one patch of TotalSegmentator's ``--fast``
network (16.6 M parameters, 128 x 112 x 112, 118 outputs) took 1.3 s in BF16 against 7.8 s
for ONNX Runtime FP32 and 4.0 s for OpenVINO FP32 (``python -m bench.cpu_runtimes``,
docs/performance.md); arg-max agreement with FP32 0.995 with random weights.

A tile at a time (batch 1, the network's batch axis fixed to 1 when compiled): these are
large networks whose output alone is hundreds of megabytes a tile, and OpenVINO's threads
share each tile by operator. Version-2 (trained) models only: the bundled tissue model stays
on ONNX Runtime. Not a requirement of ``make run``: without the ``openvino`` package the
engine fails to load with that reason.
"""

from __future__ import annotations

import html
import logging
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from segnode.engines.base import (
    EngineError,
    HostArrays,
    PatchPredictor,
    precision_of,
    usable_cores,
)
from segnode.engines.manifest import ModelManifest

logger = logging.getLogger(__name__)

PRECISIONS = {"bf16": "bf16", "fp32": "f32"}
"""``precision`` option -> OpenVINO's ``INFERENCE_PRECISION_HINT``."""


def _import_openvino() -> Any:
    try:
        import openvino
    except ImportError as exc:
        raise EngineError(
            f"the openvino engine needs OpenVINO (pip install 'segnode[openvino]'): {exc}"
        ) from exc
    return openvino


class OpenVinoEngine(HostArrays):
    """Segment CT volumes with OpenVINO on the CPU (version-2 models).

    Parameters
    ----------
    threads
        CPU threads for each tile (default: every core this process may use).
    precision
        ``"bf16"`` (default) or ``"fp32"``: see the module docstring.
    fp32_leading
        BF16 only: run the network's first ``fp32_leading`` convolutions in float32 (see
        the module docstring). ``None`` (default): the manifest's
        ``calibration.fp32_leading_convolutions``, else 0.
    """

    name = "openvino"

    def __init__(
        self,
        *,
        threads: int | None = None,
        precision: str = "bf16",
        fp32_leading: int | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise EngineError(f"openvino: precision must be bf16 or fp32, got {precision!r}")
        if threads is not None and threads < 1:
            raise EngineError(f"openvino: threads must be at least 1, got {threads}")
        if fp32_leading is not None and fp32_leading < 0:
            raise EngineError(f"openvino: fp32_leading must be 0 or more, got {fp32_leading}")
        self.threads = threads
        self.precision = precision
        self.fp32_leading = fp32_leading
        #: The convolutions each network runs in float32 before BF16 (0: none).
        self.fp32_leading_used = 0
        self._manifest: ModelManifest | None = None
        self._folds: list[PatchPredictor] = []
        self._compiled: list[Any] = []
        #: What OpenVINO compiled with: ``"bf16"`` or ``"fp32"`` (its
        #: ``INFERENCE_PRECISION_HINT`` as it reports it).
        self.inference_precision = ""
        #: What the loaded model runs in: ``"int8"`` for a model calibrated to INT8 (its
        #: QDQ files: the quantized convolutions in INT8, the rest in
        #: :attr:`inference_precision`), else :attr:`inference_precision`.
        self.precision_used = ""

    @property
    def manifest(self) -> ModelManifest | None:
        """The loaded model's manifest, or ``None`` before :meth:`load`."""
        return self._manifest

    def load(self, manifest: ModelManifest) -> None:
        """Compile every fold file of ``manifest`` (every part's, for a composite).

        Raises
        ------
        EngineError
            OpenVINO is not installed, the manifest is not a version-2 model, a file is
            missing or unreadable, or its input and output disagree with the manifest.
        """
        ov = _import_openvino()
        if not manifest.is_trained:
            raise EngineError(
                f"openvino: model {manifest.name!r} is a version-1 model; the openvino engine "
                "runs version-2 (trained) models, use onnxruntime for it"
            )
        core = ov.Core()
        threads = self.threads or usable_cores()
        config = {
            "INFERENCE_PRECISION_HINT": PRECISIONS[self.precision],
            "INFERENCE_NUM_THREADS": threads,
            "PERFORMANCE_HINT": "LATENCY",
            "NUM_STREAMS": 1,
        }
        if self.precision == "bf16":
            capabilities = core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
            if "BF16" not in capabilities:
                logger.warning(
                    "openvino: this CPU has no BF16 instructions (%s): running float32",
                    ", ".join(capabilities),
                )
                config["INFERENCE_PRECISION_HINT"] = "f32"
        leading = self.fp32_leading
        if leading is None:
            leading = _manifest_leading(manifest)
        if config["INFERENCE_PRECISION_HINT"] != "bf16":
            leading = 0
        compiled: list[Any] = []
        folds: list[PatchPredictor] = []
        units = manifest.model_files(int8=True)
        for unit in units:
            path = Path(unit.onnx_path)
            if not path.is_file():
                raise EngineError(f"model {manifest.name!r}: ONNX file {path} not found")
            try:
                model = core.read_model(str(path))
                _check_signature(model, unit)
                model.reshape({unit.input_name: [1, 1, *unit.patch_size]})
                networks: Sequence[Any] = (
                    _compile_leading(ov, core, model, leading, config)
                    if leading
                    else (core.compile_model(model, "CPU", config),)
                )
            except EngineError:
                raise
            except Exception as exc:  # OpenVINO raises RuntimeError subclasses of its own
                raise EngineError(f"model {manifest.name!r}: cannot load {path}: {exc}") from exc
            compiled.extend(networks)
            folds.append(_predictor(networks, unit))
        self.close()
        self._compiled, self._folds, self._manifest = compiled, folds, manifest
        self.fp32_leading_used = leading
        hint = compiled[-1].get_property("INFERENCE_PRECISION_HINT")
        name = hint.to_string() if hasattr(hint, "to_string") else str(hint)
        self.inference_precision = {"f32": "fp32"}.get(name, name)
        self.precision_used = precision_of(units, self.inference_precision)
        logger.info(
            "loaded model %s %s on OpenVINO %s (CPU, %s%s, %d thread(s)), %d network(s), patch %s",
            manifest.name,
            manifest.version,
            ov.__version__,
            self.inference_precision,
            f", the first {leading} convolutions in fp32" if leading else "",
            threads,
            len(folds),
            "x".join(map(str, manifest.model_files()[0].patch_size)),
        )

    def fold_predictors(self) -> list[PatchPredictor]:
        """The compiled fold networks, NumPy in and out (one tile per inference).

        Raises
        ------
        EngineError
            Before :meth:`load`.
        """
        if self._manifest is None:
            raise EngineError("openvino: fold_predictors() called before load()")
        return list(self._folds)

    def window_batch(self) -> int:
        """Tiles per predictor call: one (each is run on its own)."""
        return 1

    def segment(self, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """Version-1 models are not run here (see :meth:`load`)."""
        raise EngineError("openvino: segment() runs version-1 models, which this engine does not")

    def close(self) -> None:
        """Drop the compiled networks (OpenVINO frees their memory with them)."""
        self._compiled, self._folds, self._manifest = [], [], None

    def __enter__(self) -> OpenVinoEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _predictor(networks: Sequence[Any], unit: ModelManifest) -> PatchPredictor:
    """float32 ``(N, 1, *patch)`` tiles in, float32 ``(N, C, *patch)`` scores out, a tile per
    inference of one request. ``networks``: one compiled network, or the parts of one cut by
    :func:`_compile_split`, each part's outputs the next one's inputs."""
    requests = [n.create_infer_request() for n in networks]
    passed = [len(n.outputs) for n in networks[:-1]]
    shape = (unit.output_channels, *unit.patch_size)

    def predict(batch: Any) -> Any:
        tiles = np.ascontiguousarray(batch, dtype=np.float32)
        out = np.empty((len(tiles), *shape), dtype=np.float32)
        for i in range(len(tiles)):
            try:
                requests[0].infer({0: tiles[i : i + 1]})
                for before, request, count in zip(requests[:-1], requests[1:], passed, strict=True):
                    request.infer({k: before.get_output_tensor(k) for k in range(count)})
            except Exception as exc:
                raise EngineError(f"model {unit.name!r}: inference failed: {exc}") from exc
            out[i] = requests[-1].get_output_tensor(0).data[0]
        return out

    return predict


def _manifest_leading(manifest: ModelManifest) -> int:
    """``calibration.fp32_leading_convolutions`` of a model calibrated to BF16, else 0."""
    if manifest.precision != "bf16":
        return 0
    value = manifest.calibration.get("fp32_leading_convolutions", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise EngineError(
            f"model {manifest.name!r}: calibration.fp32_leading_convolutions must be a "
            f"count of 0 or more, got {value!r}"
        )
    return value


CONVOLUTIONS = frozenset({"Convolution", "ConvolutionBackpropData", "GroupConvolution"})

KEEP_FP32 = (
    '<rt_info><attribute name="DisablePrecisionConversion" version="0" value="dynamic:dynamic" />'
    "</rt_info>"
)
"""The IR's run-time attribute that keeps one operation in its own precision (float32) when the
network is compiled for BF16 (OpenVINO's ``ov::disable_conversion``)."""


def _cut(model: Any, leading: int) -> tuple[list[Any], int, set[str]]:
    """``model``'s operations in topological order, the position of its ``leading``-th
    convolution, and the names of the operations that depend on the input."""
    ops = model.get_ordered_ops()
    names = {op.get_friendly_name() for op in ops}
    if len(names) != len(ops):
        raise EngineError("openvino: operation names are not unique; cannot cut the network")
    convolutions = [i for i, op in enumerate(ops) if op.get_type_name() in CONVOLUTIONS]
    if leading >= len(convolutions):
        raise EngineError(
            f"openvino: fp32_leading {leading}: the network has {len(convolutions)} "
            "convolutions; the cut must leave at least one in BF16"
        )
    live: set[str] = set()  # operations that depend on the input
    for op in ops:
        if op.get_type_name() == "Parameter" or any(
            i.get_source_output().get_node().get_friendly_name() in live for i in op.inputs()
        ):
            live.add(op.get_friendly_name())
    return ops, convolutions[leading], live


def _compile_leading(
    ov: Any, core: Any, model: Any, leading: int, config: dict[str, Any]
) -> tuple[Any, ...]:
    """``model`` compiled with ``config`` (BF16), every operation before its ``leading``-th
    convolution kept in float32: one network.

    Each such operation carries :data:`KEEP_FP32` (written into the model's IR and read back,
    the attribute has no Python setter). Where this OpenVINO does not honour it (fewer than
    ``leading`` convolutions run in float32), the network is cut in two instead
    (:func:`_compile_split`), which computes the same but crosses the cut's tensors between
    two inferences: on the tiny phantom model's 48**3 tile, 24 ms against 12.7 ms (BF16 alone
    9.2 ms, float32 20 ms).
    """
    ops, cut, live = _cut(model, leading)
    keep = {
        op.get_friendly_name()
        for op in ops[:cut]
        if op.get_friendly_name() in live and op.get_type_name() not in ("Parameter", "Result")
    }
    with tempfile.TemporaryDirectory(prefix="segnode-ov-") as folder:
        xml = Path(folder) / "model.xml"
        ov.save_model(model, str(xml), compress_to_fp16=False)
        text = re.sub(
            r'(<layer id="\d+" name="([^"]*)" type="[^"]*" version="[^"]*">)',
            lambda m: m.group(1) + KEEP_FP32 if html.unescape(m.group(2)) in keep else m.group(1),
            xml.read_text(encoding="utf-8"),
        )
        weights = ov.Tensor(np.fromfile(xml.with_suffix(".bin"), dtype=np.uint8))
    compiled = core.compile_model(core.read_model(text, weights), "CPU", config)
    precisions = [
        str(info["runtimePrecision"].astype(str))
        for info in (op.get_rt_info() for op in compiled.get_runtime_model().get_ordered_ops())
        if "layerType" in info
        and str(info["layerType"].astype(str)) in ("Convolution", "Deconvolution")
    ]
    kept = precisions.index("bf16") if "bf16" in precisions else len(precisions)
    if kept >= leading:
        return (compiled,)
    logger.info(
        "openvino %s keeps %d of the first %d convolutions in fp32: cutting the network instead",
        ov.__version__,
        kept,
        leading,
    )
    return _compile_split(ov, core, model, leading, config)


def _compile_split(
    ov: Any, core: Any, model: Any, leading: int, config: dict[str, Any]
) -> tuple[Any, Any]:
    """``model`` cut before its ``leading``-th convolution: the part before the cut compiled
    in float32, the rest with ``config`` (BF16). Returns the two compiled networks; the
    first's outputs are the second's inputs, in order.

    The cut is topological: every operation after the ``leading``-th convolution's position
    in ``model.get_ordered_ops()`` is in the second part, and every tensor of the first part
    that depends on the input and feeds the second part (the skip connections too) crosses
    the cut. Weights, whatever operations make them (an fp16 storage's Convert, a shared
    parameter's Identity), stay with the operations that use them.
    """
    ops, cut, live = _cut(model, leading)
    position = {op.get_friendly_name(): i for i, op in enumerate(ops)}
    crossing: list[tuple[str, int]] = []
    for op in ops[cut:]:
        for i in op.inputs():
            source = i.get_source_output()
            name = source.get_node().get_friendly_name()
            key = (name, source.get_index())
            if name in live and position[name] < cut and key not in crossing:
                crossing.append(key)
    head = ov.Model(
        [ov.opset13.result(ops[position[n]].output(k)) for n, k in crossing],
        model.get_parameters(),
        "fp32_leading",
    )
    tail_model = model.clone()
    tail_ops = {op.get_friendly_name(): op for op in tail_model.get_ordered_ops()}
    parameters: list[Any] = []
    for n, k in crossing:
        source = tail_ops[n].output(k)
        parameter = ov.opset13.parameter(
            source.get_partial_shape(), source.get_element_type(), f"cut_{len(parameters)}"
        )
        for target in list(source.get_target_inputs()):
            if position[target.get_node().get_friendly_name()] >= cut:
                target.replace_source_output(parameter.output(0))
        parameters.append(parameter)
    tail = ov.Model(tail_model.get_results(), parameters, "bf16_rest")
    return (
        core.compile_model(head, "CPU", {**config, "INFERENCE_PRECISION_HINT": "f32"}),
        core.compile_model(tail, "CPU", config),
    )


def _check_signature(model: Any, unit: ModelManifest) -> None:
    """The model's input and output are the manifest's: names, one channel in,
    ``output_channels`` out, the patch (any batch)."""
    where = f"model {unit.name!r}"
    inputs = {name: port for port in model.inputs for name in port.get_names()}
    outputs = {name: port for port in model.outputs for name in port.get_names()}
    if unit.input_name not in inputs:
        raise EngineError(f"{where}: no input named {unit.input_name!r} (has {sorted(inputs)})")
    if unit.output_name not in outputs:
        raise EngineError(f"{where}: no output named {unit.output_name!r} (has {sorted(outputs)})")
    for label, port, channels in (
        ("input", inputs[unit.input_name], 1),
        ("output", outputs[unit.output_name], unit.output_channels),
    ):
        shape = port.get_partial_shape()
        dims = [d.get_length() if d.is_static else None for d in shape]
        want = [None, channels, *unit.patch_size]
        if len(dims) != 5 or any(
            d is not None and w is not None and d != w for d, w in zip(dims, want, strict=True)
        ):
            raise EngineError(
                f"{where}: {label} shape {dims} does not match the manifest "
                f"(N, {channels}, {', '.join(map(str, unit.patch_size))})"
            )
