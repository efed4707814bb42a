"""The preprocessing runtime of trained models: orientation, intensity normalisation and
resampling as nnU-Net v2 does them, on NumPy or on a GPU array through the same code.

* :mod:`~segnode.engines.preprocess.orientation`: from a volume's direction cosines to a model's
  axis order and orientation and back (exact re-indexing); gantry tilt refused unless allowed.
* :mod:`~segnode.engines.preprocess.intensity`: nnU-Net's CT normalisation, the linear mapping of
  version-1 manifests, cropping to the non-zero region.
* :mod:`~segnode.engines.preprocess.resampling`: nnU-Net's resampling rules without SciPy.
* :mod:`~segnode.engines.preprocess.pipeline`:
  :func:`~segnode.engines.preprocess.pipeline.run_model`, the whole way from a source-grid HU volume
  to a source-grid label map around a predictor (import it from there: it needs
  :mod:`segnode.engines.manifest`, which imports this package).
"""

from segnode.engines.preprocess.intensity import CTNormalization, LinearNormalization, nonzero_bbox
from segnode.engines.preprocess.orientation import (
    Geometry,
    GeometryError,
    Reorientation,
    plan_reorientation,
)
from segnode.engines.preprocess.resampling import (
    ANISO_THRESHOLD,
    compute_new_shape,
    resample,
    separate_z_axis,
)

__all__ = [
    "ANISO_THRESHOLD",
    "CTNormalization",
    "Geometry",
    "GeometryError",
    "LinearNormalization",
    "Reorientation",
    "compute_new_shape",
    "nonzero_bbox",
    "plan_reorientation",
    "resample",
    "separate_z_axis",
]
