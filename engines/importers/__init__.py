"""Importers: turn models trained elsewhere into the node's model folders.

``segnode model import nnunet FOLDER --name NAME`` reads an nnU-Net v2 trained-model folder,
exports each fold to ONNX and writes a version-2 manifest (docs/integration.md, section 8);
``segnode model import totalsegmentator WEIGHTS_DIR`` does the same for TotalSegmentator's
"total" task (five nnU-Net datasets) and writes a composite manifest over them.
docs/import.md shows the commands and their output.

The modules that only read JSON and CSV (:mod:`segnode.engines.importers.labels`,
:mod:`segnode.engines.importers.nnunet_plans`) need neither torch nor nnU-Net; the export
(:mod:`segnode.engines.importers.export`) imports them when it runs.
"""

from __future__ import annotations

from segnode.engines.base import EngineError


class ModelImportError(EngineError):
    """A model folder cannot be imported; the message names the file, fold or field."""
