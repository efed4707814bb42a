"""The order-1 arg-max export's short cut (:func:`segnode.engines.preprocess.export.
_streamed_argmax`) gives the labels of the full streamed resampling
(:func:`~segnode.engines.preprocess.export._streamed`), bit for bit: random logits of many
channels, smooth blobs, piecewise-constant regions with duplicated channels (exact ties), near
ties one float32 step apart at mixed magnitudes, non-finite scores; in one 3-D pass and with a
separate axis (order 0 or 1 along it); grids that grow, shrink or stay along each axis; tiles and
output chunks forced small so that their edges fall everywhere."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import pytest

from segnode.engines.preprocess import export
from segnode.engines.preprocess.export import Decision, labels_from_slabs


def _scores(rng: np.random.Generator, kind: str, channels: int, shape: tuple[int, ...]) -> Any:
    if kind == "random":
        return rng.normal(size=(channels, *shape)).astype(np.float32)
    if kind == "blobs":
        grid = np.meshgrid(*[np.linspace(0, 1, n) for n in shape], indexing="ij")
        centres = rng.uniform(0, 1, (channels, 3))
        return np.stack(
            [
                -sum((g - c[i]) ** 2 for i, g in enumerate(grid)) * rng.uniform(5, 50)
                for c in centres
            ]
        ).astype(np.float32)
    if kind == "ties":
        return rng.integers(0, 3, size=(channels, *shape)).astype(np.float32)
    if kind == "regions":
        coarse = rng.integers(0, channels, size=tuple(max(1, n // 3) for n in shape))
        label = np.kron(coarse, np.ones((3, 3, 3), dtype=np.int64))
        pad = [(0, max(0, n - m)) for n, m in zip(shape, label.shape, strict=True)]
        label = np.pad(label, pad, mode="edge")[: shape[0], : shape[1], : shape[2]]
        scores = (np.arange(channels)[:, None, None, None] == label[None]) * 5.0
        scores = (scores + rng.normal(size=scores.shape) * 0.01).astype(np.float32)
        scores[-1] = scores[0]  # an exact tie everywhere: the lower channel wins
        return scores
    # near ties: channels one float32 step apart, magnitudes 1e-3 .. 1e3
    base = (rng.normal(size=shape) * 10.0 ** rng.integers(-3, 4, size=shape)).astype(np.float32)
    steps = rng.integers(-1, 2, size=(channels, *shape)).astype(np.float32)
    return (base + steps * np.spacing(base)).astype(np.float32)


def _both(
    scores: Any, new_shape: tuple[int, ...], separate_axis: int | None, order: int, order_z: int
) -> tuple[Any, Any]:
    model_shape = tuple(int(n) for n in scores.shape[1:])
    cuts = sorted({0, model_shape[0], model_shape[0] // 3, model_shape[0] // 2 + 1})

    def slabs() -> Any:
        return iter([(a, b, scores[:, a:b]) for a, b in zip(cuts, cuts[1:], strict=False)])

    full = export._streamed(
        slabs(), Decision(), model_shape, new_shape, order, separate_axis, order_z
    )
    short = labels_from_slabs(
        slabs(),
        Decision(),
        model_shape=model_shape,
        new_shape=new_shape,
        order=order,
        separate_axis=separate_axis,
        order_z=order_z,
        precise=True,
    )
    return full, short


@pytest.mark.parametrize("kind", ["random", "blobs", "ties", "regions", "near"])
@pytest.mark.parametrize(
    ("separate_axis", "order", "order_z"),
    [(None, 1, 0), (0, 1, 0), (0, 1, 1), (1, 1, 0), (2, 1, 1), (0, 0, 1)],
)
def test_short_cut_gives_the_labels_of_the_full_resampling(
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    separate_axis: int | None,
    order: int,
    order_z: int,
) -> None:
    monkeypatch.setattr(export, "_TILE", 5)
    monkeypatch.setattr(export, "_CHUNK_BYTES", 64 * 64)  # a few output slices at a time
    rng = np.random.default_rng(zlib.crc32(repr((kind, separate_axis, order, order_z)).encode()))
    decided = 0
    for _ in range(12):
        channels = int(rng.choice([2, 5, 40, 118]))
        model_shape = tuple(int(n) for n in rng.integers(1, 13, 3))
        factors = rng.choice([0.5, 0.7, 1.0, 1.6, 2.0, 2.7], size=3)
        new_shape = tuple(max(1, int(n * f)) for n, f in zip(model_shape, factors, strict=True))
        if new_shape == model_shape:
            continue
        full, short = _both(
            _scores(rng, kind, channels, model_shape), new_shape, separate_axis, order, order_z
        )
        np.testing.assert_array_equal(short, full)
        decided += 1
    assert decided >= 6


def test_short_cut_leaves_non_finite_scores_to_the_full_resampling() -> None:
    rng = np.random.default_rng(3)
    scores = _scores(rng, "blobs", 6, (8, 9, 10))
    scores[2, 3, 4, 5] = np.nan
    scores[4, 0, 0, :] = np.inf
    scores[1, 6, :, 2] = -np.inf
    scores[3, 7, 8, 9] = np.finfo(np.float32).max
    full, short = _both(scores, (15, 20, 7), None, 1, 0)
    np.testing.assert_array_equal(short, full)


def test_short_cut_interpolates_only_near_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Far from a boundary between labels nothing is interpolated, and near one only the
    channels that can win are."""
    calls: list[int] = []
    interpolate = export._interpolate

    def counted(piece: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(int(piece.shape[0]))
        return interpolate(piece, *args, **kwargs)

    monkeypatch.setattr(export, "_interpolate", counted)
    scores = np.full((50, 20, 24, 24), -10.0, dtype=np.float32)
    scores[0] = 0.0
    scores[7, 8:14, 8:14, 8:14] = 5.0  # one organ inside the background
    full, short = _both(scores, (40, 60, 60), None, 1, 0)
    np.testing.assert_array_equal(short, full)
    assert set(np.unique(short)) == {0, 7}
    calls.clear()
    labels_from_slabs(
        [(0, 20, scores)],
        Decision(),
        model_shape=(20, 24, 24),
        new_shape=(40, 60, 60),
        order=1,
        separate_axis=None,
        order_z=0,
        precise=True,
    )
    assert calls and max(calls) == 2  # channels 0 and 7 only, in the tiles at the organ's edge
