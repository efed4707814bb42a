"""Intensity normalisation and cropping to the non-zero region, as nnU-Net v2 does them.

* CT normalisation (``CTNormalization`` in
  ``nnunetv2/preprocessing/normalization/default_normalization_schemes.py``): clip to the
  training set's foreground 0.5 and 99.5 percentiles, subtract the foreground mean, divide by
  ``max(std, 1e-8)``, all in float32.
* Today's linear mapping of version-1 manifests: ``clip(HU) * scale + offset``.
* Cropping (``nnunetv2/preprocessing/cropping/cropping.py``): the bounding box of the non-zero
  voxels (nnU-Net fills holes in the mask first, which does not change its bounding box).

Every function takes and returns arrays of any array-API namespace (NumPy, torch, CuPy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from array_api_compat import array_namespace

_EPS = 1e-8  # nnU-Net's eps for a float32 target


@dataclass(frozen=True)
class CTNormalization:
    """nnU-Net's CT normalisation, from ``plans.json``'s
    ``foreground_intensity_properties_per_channel["0"]``.

    Attributes
    ----------
    mean, std
        Foreground mean and standard deviation of the training set (HU).
    lower, upper
        Its ``percentile_00_5`` and ``percentile_99_5`` (HU).
    """

    mean: float
    std: float
    lower: float
    upper: float

    def __call__(self, image: Any) -> Any:
        """float32 ``(clip(image, lower, upper) - mean) / max(std, 1e-8)``."""
        xp = array_namespace(image)
        out = xp.clip(xp.astype(image, xp.float32), self.lower, self.upper)
        out = out - self.mean
        return out / max(self.std, _EPS)


@dataclass(frozen=True)
class LinearNormalization:
    """``clip(HU, *clip) * scale + offset`` in float32 (the version-1 manifest's mapping).

    Attributes
    ----------
    clip
        ``(low, high)`` HU, or ``None`` for no clipping.
    scale, offset
        Applied after clipping.
    """

    clip: tuple[float, float] | None = None
    scale: float = 1.0
    offset: float = 0.0

    def __call__(self, image: Any) -> Any:
        """The mapped float32 image (a new array)."""
        xp = array_namespace(image)
        out = xp.astype(image, xp.float32, copy=True)
        if self.clip is not None:
            out = xp.clip(out, self.clip[0], self.clip[1])
        if self.scale != 1.0:
            out = out * self.scale
        if self.offset != 0.0:
            out = out + self.offset
        return out


Normalization = CTNormalization | LinearNormalization


def nonzero_bbox(image: Any) -> tuple[slice, slice, slice]:
    """Bounding box of the non-zero voxels of a ``(z, y, x)`` image, as slices.

    The whole image when every voxel is zero (nothing to crop to).
    """
    xp = array_namespace(image)
    mask = image != 0
    box: list[slice] = []
    for axis in range(3):
        others = tuple(a for a in range(3) if a != axis)
        hits = xp.nonzero(xp.any(mask, axis=others))[0]
        if int(hits.shape[0]) == 0:
            return (slice(0, image.shape[0]), slice(0, image.shape[1]), slice(0, image.shape[2]))
        box.append(slice(int(hits[0]), int(hits[-1]) + 1))
    return (box[0], box[1], box[2])
