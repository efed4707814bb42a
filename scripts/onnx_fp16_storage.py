"""Store an ONNX model's float32 weights as float16, computed in float32 (half the file).

Every float32 initializer becomes a float16 initializer followed by a ``Cast`` to float32, so
the graph, its inputs and outputs and its arithmetic stay float32; only the weights are rounded
to float16 (relative error <= 2**-11). ONNX Runtime folds the casts when it loads the model.
Used for the trained test model in ``tests/data/nnunet_phantom`` (kept under 2 MB a fold).

Run::

    python -m scripts.onnx_fp16_storage IN.onnx OUT.onnx
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def fp16_storage(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with float32 initializers stored as float16 and cast back on load."""
    graph = model.graph
    casts = []
    for init in graph.initializer:
        if init.data_type != TensorProto.FLOAT:
            continue
        name = init.name
        half = numpy_helper.from_array(
            numpy_helper.to_array(init).astype(np.float16), name + "_fp16"
        )
        init.CopyFrom(half)
        casts.append(helper.make_node("Cast", [name + "_fp16"], [name], to=TensorProto.FLOAT))
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(casts + nodes)
    onnx.checker.check_model(model)
    return model


def main(argv: list[str] | None = None) -> int:
    """Convert IN.onnx to OUT.onnx."""
    src, dst = (argv or sys.argv[1:])[:2]
    onnx.save(fp16_storage(onnx.load(src)), dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
