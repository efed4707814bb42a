"""segnode: a DICOM node that segments CT series on the hospital's edge.

Everything the node runs is importable under this one name (the repository keeps the
layout of its design card, and ``segnode/node``, ``segnode/engines`` and ``segnode/storage``
are links to those folders; the built wheel holds the files themselves):

* :mod:`segnode.node` - DICOM networking and the pipeline: the acceptor and its protocol
  layer, ingest, series completion and volume assembly, the worker, results (SEG, SR and
  their checks), routing, the outbox, the service, metrics and the command line;
* :mod:`segnode.engines` - inference: the engine interface, the backends (ONNX Runtime,
  TensorRT, PyTorch), the sliding window, the model contract, preprocessing, model import;
* :mod:`segnode.storage` - durable state: the ledger (SQLAlchemy; SQLite by default) and the
  instance spool.

``python -m segnode`` is the ``segnode`` command.
"""
