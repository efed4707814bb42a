"""The ONNX model converted to a ``torch.nn.Module`` with onnx2torch, on the CPU in float32.

:func:`convert_onnx` is the one entry point: it folds the ``Identity`` and ``Cast`` nodes
that stand between a convolution and its weights (:func:`fold_initializer_nodes`), converts
the graph with onnx2torch imported without torchvision (:func:`import_onnx2torch`) and,
when onnx2torch does not know the model's opset, converts it to opset 17 first.

This module moves nothing to a device and knows no precision, batch or compilation: those
belong to :class:`segnode.engines.torch_backend.TorchEngine`. onnx, onnx2torch and
torchvision are imported inside its functions, so importing it needs none of them.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable
from typing import Any

from segnode.engines.base import EngineError

logger = logging.getLogger(__name__)

_ONNX2TORCH_OPSET = 17


#: What onnx2torch takes from torchvision (its NonMaxSuppression and RoiAlign converters).
_TORCHVISION_OPS = ("nms", "box_convert", "roi_align")


def _torchvision_stand_in(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        import torchvision.ops

        return getattr(torchvision.ops, name)(*args, **kwargs)

    call.__name__ = name
    return call


def import_onnx2torch() -> Any:
    """Import onnx2torch without importing torchvision.

    onnx2torch imports torchvision at import time (about 5 s on a GPU server, half of an
    engine's load) for two converters, NonMaxSuppression and RoiAlign, that segmentation
    models do not use. While onnx2torch is imported, ``torchvision`` and ``torchvision.ops``
    are stand-ins whose functions import the real torchvision when first called; they are
    removed again at once, so any later ``import torchvision`` gets the real package.

    Raises
    ------
    ImportError
        If onnx2torch is not installed.
    """
    if "onnx2torch" in sys.modules or "torchvision" in sys.modules:
        import onnx2torch

        return onnx2torch
    package, ops = types.ModuleType("torchvision"), types.ModuleType("torchvision.ops")
    for name in _TORCHVISION_OPS:
        setattr(ops, name, _torchvision_stand_in(name))
    package.ops = ops  # type: ignore[attr-defined]
    package.__path__ = []  # a package, so that ``from torchvision.ops import ...`` resolves
    stand_ins = {"torchvision": package, "torchvision.ops": ops}
    sys.modules.update(stand_ins)
    try:
        import onnx2torch
    finally:
        for name, module in stand_ins.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
    return onnx2torch


def fold_initializer_nodes(model: Any) -> Any:
    """Turn ``Identity`` and ``Cast`` nodes fed by an initializer into initializers.

    onnx2torch wants a convolution's weight and bias as initializers, but exporters and
    storage tricks put nodes in between: deduplicated equal weights (the all-zero biases of a
    freshly initialised network) are read through ``Identity``, and weights stored in float16
    (``scripts/onnx_fp16_storage.py``) are cast to float32 in the graph, which would also pin
    them to float32 against an FP16 engine's half inputs. Each such node becomes an
    initializer of its output's name (copied, or cast), and the stored originals of cast
    weights that no node reads any more are dropped. Returns ``model``, changed in place.
    """
    from onnx import helper, numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    keep, cast_sources = [], set()
    for node in graph.node:
        source, out = node.input[0] if node.input else "", node.output[0]
        if node.op_type not in ("Identity", "Cast") or source not in inits or out in outputs:
            keep.append(node)
            continue
        value = numpy_helper.to_array(inits[source])
        if node.op_type == "Cast":
            to = next(a.i for a in node.attribute if a.name == "to")
            value = value.astype(helper.tensor_dtype_to_np_dtype(to))
            cast_sources.add(source)
        folded = numpy_helper.from_array(value, out)
        graph.initializer.append(folded)
        inits[out] = folded
    if len(keep) != len(graph.node):
        del graph.node[:]
        graph.node.extend(keep)
        used = {name for node in graph.node for name in node.input} | outputs
        for t in [t for t in graph.initializer if t.name in cast_sources - used]:
            graph.initializer.remove(t)
    return model


def convert_onnx(path: Any) -> Any:
    """Convert the ONNX file at ``path`` to a ``torch.nn.Module`` (on the CPU, float32).

    Models whose opset onnx2torch does not know are first converted to opset 17 with
    :func:`onnx.version_converter.convert_version`.

    Raises
    ------
    EngineError
        If the file is not a readable ONNX model, or onnx2torch is missing or cannot convert
        a node (the message names it).
    """
    import onnx

    try:
        convert = import_onnx2torch().convert
    except ImportError as exc:
        raise EngineError(
            f"the torch engine needs onnx2torch (pip install onnx2torch): {exc}"
        ) from exc
    from google.protobuf.message import DecodeError

    try:
        model = fold_initializer_nodes(onnx.load(str(path)))
    except (OSError, DecodeError) as exc:  # missing, unreadable, or not an ONNX protobuf
        raise EngineError(f"cannot load {path}: not a readable ONNX model: {exc}") from exc
    try:
        return convert(model)
    except NotImplementedError as first:
        try:
            from onnx import version_converter

            older = version_converter.convert_version(model, _ONNX2TORCH_OPSET)
            module = convert(older)
        except Exception as exc:
            raise EngineError(f"onnx2torch cannot convert {path}: {first}; {exc}") from first
        logger.info("converted %s to opset %d for onnx2torch", path, _ONNX2TORCH_OPSET)
        return module
