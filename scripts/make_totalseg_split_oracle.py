"""TotalSegmentator's split of a large volume in thirds, against segnode's (issue 34).

TotalSegmentator predicts a multi-part task (``total``) in three overlapping thirds along
the slice axis when the resampled image has more than 512 x 512 x 900 voxels and more than
200 slices (``nnunet.py``: ``do_triple_split``, margin 20); ``force_split=True`` makes it
split any image. This runs :mod:`scripts.make_totalseg_oracle` for ``--task total`` with
``force_split=True`` in TotalSegmentator's call and segnode's limits
(:data:`segnode.engines.preprocess.pipeline.SPLIT_VOXELS`, ``SPLIT_MIN_Z``) set to 0, so
that both sides split the phantom series; the golden file goes to
``tests/data/totalseg_phantom_split`` (``tests/test_totalseg_oracle.py``).

Run (torch, nnunetv2 and TotalSegmentator installed; a few minutes on a CPU)::

    python -m scripts.make_totalseg_split_oracle --work /tmp/tss \\
        --out tests/data/totalseg_phantom_split --cases native_hfs long_ffs
"""

from __future__ import annotations

import sys

from scripts import make_totalseg_oracle
from segnode.engines.preprocess import pipeline


def main(argv: list[str] | None = None) -> int:
    """``scripts.make_totalseg_oracle --task total`` with both sides splitting."""
    make_totalseg_oracle.RUN_FLAGS["total"] = {"force_split": True}
    pipeline.SPLIT_VOXELS = 0
    pipeline.SPLIT_MIN_Z = 0
    args = list(sys.argv[1:] if argv is None else argv)
    return make_totalseg_oracle.main(["--task", "total", *args])


if __name__ == "__main__":
    raise SystemExit(main())
