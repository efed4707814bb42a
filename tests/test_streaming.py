"""Streaming assembly: the prebuilt volume is exactly ``assemble_volume``'s, geometry
completeness fires once at the right instance, memory stays under the cap."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydicom.uid import (
    DeflatedExplicitVRLittleEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEGLSLossless,
)

from segnode.node.ingest.geometry import SeriesGeometry, uniform_stack
from segnode.node.ingest.streaming import Arrival, SlabPool, StreamingAssembler, _permute_in_place
from segnode.node.ingest.volume import Volume, assemble_volume, rescale_into
from tests.fixtures.synthetic import (
    SAGITTAL,
    PhantomGeometry,
    write_enhanced_ct,
    write_synthetic_series,
)

# Series small enough to write quickly; the assembler does not care about the matrix size.
TINY = PhantomGeometry(rows=16, columns=16, slices=8)
# More slices than one default slab (64) when there is no count hint.
TWO_SLABS = PhantomGeometry(rows=48, columns=40, slices=70)


def assert_same_volume(a: Volume, b: Volume) -> None:
    """Every field of two volumes is identical (voxels bit for bit)."""
    assert a.hu.dtype == b.hu.dtype and a.hu.shape == b.hu.shape
    assert a.hu.flags.c_contiguous and b.hu.flags.c_contiguous
    np.testing.assert_array_equal(a.hu, b.hu)
    for name in (
        "origin",
        "row_direction",
        "column_direction",
        "normal",
        "spacing",
        "positions",
        "frame_numbers",
        "frame_of_reference_uid",
        "study_instance_uid",
        "series_instance_uid",
    ):
        assert getattr(a, name) == getattr(b, name), name
    assert len(a.sources) == len(b.sources)
    for x, y in zip(a.sources, b.sources, strict=True):
        assert x == y
        assert x.file_meta == y.file_meta
        assert "PixelData" not in x


def feed(asm: StreamingAssembler, paths: list[Path], series_uid: str, order: list[int]) -> None:
    for i in order:
        asm.submit(Arrival(series_uid, f"sop{i}", paths[i], "MODALITY", 0))


def series_uid_of(path: Path) -> str:
    from pydicom import dcmread

    return str(dcmread(path, stop_before_pixels=True).SeriesInstanceUID)


@pytest.mark.parametrize(
    ("syntax", "geometry", "hint", "seed"),
    [
        (ExplicitVRLittleEndian, TWO_SLABS, True, 41),
        (ExplicitVRLittleEndian, TWO_SLABS, False, 42),
        (ImplicitVRLittleEndian, replace(TWO_SLABS, orientation=SAGITTAL), True, 43),
        (DeflatedExplicitVRLittleEndian, TWO_SLABS, False, 44),
        (JPEGLSLossless, TWO_SLABS, True, 45),
    ],
)
def test_prebuilt_volume_is_exactly_assemble_volume(
    asm: StreamingAssembler,
    tmp_path: Path,
    syntax: str,
    geometry: PhantomGeometry,
    hint: bool,
    seed: int,
) -> None:
    paths = write_synthetic_series(
        tmp_path, geometry, transfer_syntax=syntax, seed=seed, images_in_acquisition=hint
    )
    uid = series_uid_of(paths[0])
    order = list(range(len(paths)))
    random.Random(seed).shuffle(order)  # arrival order differs from slice order
    feed(asm, paths, uid, order)
    ledger_order = [paths[i] for i in order]  # the ledger lists instances as they arrived
    got = asm.take(uid, ledger_order)
    assert got is not None
    assert_same_volume(got, assemble_volume(ledger_order))
    assert asm.memory_bytes == 0 and asm.series_in_memory == 0


def test_multiframe_prebuilt(asm: StreamingAssembler, tmp_path: Path) -> None:
    path = write_enhanced_ct(
        tmp_path / "mf.dcm", PhantomGeometry(rows=32, columns=32, slices=12), seed=46
    )
    uid = series_uid_of(path)
    fired: list[str] = []
    asm.on_geometry = lambda s, _ae: fired.append(s)
    feed(asm, [path], uid, [0])
    got = asm.take(uid, [path])
    assert got is not None
    assert_same_volume(got, assemble_volume([path]))
    assert fired == [uid]  # one multi-frame instance holds its whole stack


def test_fallback_when_the_ledger_lists_other_instances(
    asm: StreamingAssembler, tmp_path: Path
) -> None:
    paths = write_synthetic_series(tmp_path, replace(TINY, slices=6), seed=47)
    uid = series_uid_of(paths[0])
    feed(asm, paths, uid, list(range(5)))  # the sixth was stored but never streamed
    assert asm.take(uid, paths) is None
    assert asm.take(uid, paths) is None  # the state is gone either way
    assert asm.memory_bytes == 0


def test_broken_series_falls_back(asm: StreamingAssembler, tmp_path: Path) -> None:
    """A series assembly would refuse (a gap) is never served from memory."""
    paths = write_synthetic_series(tmp_path, replace(TINY, slices=6), seed=48)
    del paths[2]
    uid = series_uid_of(paths[0])
    feed(asm, paths, uid, list(range(len(paths))))
    assert asm.take(uid, paths) is None


def test_geometry_fires_once_at_the_last_slice(tmp_path: Path) -> None:
    paths = write_synthetic_series(tmp_path / "a", TINY, seed=49, images_in_acquisition=True)
    gap = write_synthetic_series(tmp_path / "b", TINY, seed=50, images_in_acquisition=True)
    plain = write_synthetic_series(tmp_path / "c", TINY, seed=51)
    fired: list[tuple[str, str]] = []
    asm = StreamingAssembler(workers=1, on_geometry=lambda s, ae: fired.append((s, ae)))
    asm.start()
    try:
        uid, gap_uid, plain_uid = (series_uid_of(p[0]) for p in (paths, gap, plain))
        feed(asm, paths, uid, [7, 0, 3, 1, 6, 2, 5])
        feed(asm, gap[:3] + gap[4:], gap_uid, list(range(7)))  # 7 of 8: never complete
        feed(asm, plain, plain_uid, list(range(8)))  # no count hint: never by geometry
        assert asm.wait_idle()
        assert fired == []  # seven of eight
        feed(asm, paths, uid, [4])
        assert asm.wait_idle()
        assert fired == [(uid, "MODALITY")]
        assert asm.take(plain_uid, plain) is not None
        assert asm.take(gap_uid, gap) is None
    finally:
        asm.stop()


def test_series_geometry_rules() -> None:
    axial = np.array([1.0, 0, 0, 0, 1, 0])
    g = SeriesGeometry()
    pos = [np.array([0.0, 0.0, 2.5 * k]) for k in range(4)]
    assert not g.add("a", pos[0], axial, 4)
    assert not g.add("b", pos[3], axial, 4)
    assert not g.add("c", pos[1], axial, 4)
    assert g.add("d", pos[2], axial, 4)
    assert not g.add("e", np.array([0.0, 0.0, 10.0]), axial, 4)  # fires once only
    assert not uniform_stack([pos[0], pos[1], pos[3]], axial)  # a gap
    assert not uniform_stack([pos[0], pos[0]], axial)  # a duplicate
    tilted = SeriesGeometry()
    tilted.add("a", pos[0], axial, 2)
    assert not tilted.add("b", pos[1], np.array([1.0, 0, 0, 0, 0, -1]), 2)  # mixed orientation


def test_memory_cap_spills_least_recent_series(tmp_path: Path) -> None:
    a = write_synthetic_series(
        tmp_path / "a", PhantomGeometry(rows=64, columns=64, slices=8), seed=52
    )
    b = write_synthetic_series(
        tmp_path / "b", PhantomGeometry(rows=64, columns=64, slices=8), seed=53
    )
    slab = 64 * 64 * 64 * 4  # one default slab of 64 slices
    asm = StreamingAssembler(workers=1, max_bytes=slab + slab // 2)
    asm.start()
    try:
        ua, ub = series_uid_of(a[0]), series_uid_of(b[0])
        feed(asm, a, ua, list(range(8)))
        assert asm.wait_idle()
        assert asm.memory_bytes == slab
        feed(asm, b, ub, list(range(8)))
        vb = asm.take(ub, b)
        assert vb is not None  # b fitted by spilling a
        assert asm.take(ua, a) is None  # a falls back to the spool
        assert asm.memory_bytes <= asm.max_bytes
        assert_same_volume(vb, assemble_volume(b))
    finally:
        asm.stop()


def test_geometry_only_when_streaming_disabled(tmp_path: Path) -> None:
    paths = write_synthetic_series(
        tmp_path, replace(TINY, slices=4), seed=54, images_in_acquisition=True
    )
    fired: list[str] = []
    asm = StreamingAssembler(
        workers=1, decode_pixels=False, on_geometry=lambda s, _ae: fired.append(s)
    )
    asm.start()
    try:
        uid = series_uid_of(paths[0])
        feed(asm, paths, uid, [3, 1, 0, 2])
        assert asm.take(uid, paths) is None
        assert fired == [uid] and asm.memory_bytes == 0
    finally:
        asm.stop()


def test_permute_in_place() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((9, 2, 3)).astype(np.float32)
    perm = [int(i) for i in rng.permutation(9)]
    want = a[perm].copy()
    _permute_in_place(a, perm)
    np.testing.assert_array_equal(a, want)


def test_geometry_survives_a_job_taking_the_series(tmp_path: Path) -> None:
    """The quiet period made a job of the first half of a split transfer: the second half
    still completes the series by geometry (a new version)."""
    paths = write_synthetic_series(tmp_path, TINY, seed=55, images_in_acquisition=True)
    fired: list[str] = []
    asm = StreamingAssembler(workers=1, on_geometry=lambda s, _ae: fired.append(s))
    asm.start()
    try:
        uid = series_uid_of(paths[0])
        feed(asm, paths, uid, [0, 1, 2, 3])
        assert asm.take(uid, paths[:4]) is not None  # job v1 took the first half
        feed(asm, paths, uid, [4, 5, 6, 7])
        assert asm.wait_idle()
        assert fired == [uid]
        assert asm.take(uid, paths) is None  # v2 has all eight: assembled from the spool
    finally:
        asm.stop()


def test_slab_pool_reuses_blocks_and_frees_them_on_a_miss() -> None:
    pool = SlabPool()
    a = pool.take((4, 8, 8))
    assert a.shape == (4, 8, 8) and a.dtype == np.float32 and a.flags.c_contiguous
    pool.give(a)
    assert pool.idle_bytes == a.nbytes
    b = pool.take((2, 8, 8))  # smaller, within three times the size: the same memory
    assert np.shares_memory(a, b) and pool.idle_bytes == 0 and pool.reused == 1
    pool.give(b)
    pool.give(b)  # given twice: kept once
    assert pool.idle_bytes == a.nbytes
    c = pool.take((1, 8, 8))  # under a third of it: not worth holding 4x the memory
    assert not np.shares_memory(a, c) and pool.idle_bytes == 0  # the miss freed the idle block
    pool.give(np.zeros((2, 2), np.float64))  # not one of ours: ignored
    pool.give(None)
    assert pool.idle_bytes == 0
    assert pool.warm(3 * 8 * 8 * 4 * 2, (3, 8, 8)) == 2 and pool.idle_bytes == 2 * 3 * 8 * 8 * 4
    pool.trim(3 * 8 * 8 * 4)
    assert pool.idle_bytes == 3 * 8 * 8 * 4
    pool.trim(0)
    assert pool.idle_bytes == 0


def test_slabs_are_reused_by_the_next_series(tmp_path: Path) -> None:
    """Slabs drained into one series' volume decode the next series; volumes stay exact."""
    asm = StreamingAssembler(workers=1, max_bytes=64 * 2**20)
    asm.start()
    try:
        for k, seed in enumerate((61, 62)):
            paths = write_synthetic_series(
                tmp_path / str(k), PhantomGeometry(rows=32, columns=32, slices=70), seed=seed
            )  # no count hint: two slabs of 64 slices
            uid = series_uid_of(paths[0])
            feed(asm, paths, uid, list(range(len(paths))))
            got = asm.take(uid, paths)
            assert got is not None
            assert_same_volume(got, assemble_volume(paths))
            assert asm.memory_bytes == 0
        assert asm.pool.reused == 2
        assert asm.pool.idle_bytes == 2 * 64 * 32 * 32 * 4
    finally:
        asm.stop()
    assert asm.pool.idle_bytes == 0


def test_slab_pool_hands_out_the_best_fit_among_blocks_of_several_sizes() -> None:
    """Idle blocks of different sizes (slabs and recycled volumes): the smallest that fits
    is handed out and removed by identity (comparing arrays would fail or match wrongly)."""
    pool = SlabPool()
    blocks = [pool.take((n, 8, 8)) for n in (30, 64, 64, 128)]
    for b in blocks:
        pool.give(b)
    got = pool.take((60, 8, 8))
    assert np.shares_memory(got, blocks[1]) and pool.reused == 1
    assert pool.idle_bytes == (30 + 64 + 128) * 8 * 8 * 4
    got = pool.take((100, 8, 8))
    assert np.shares_memory(got, blocks[3])
    got = pool.take((30, 8, 8))
    assert np.shares_memory(got, blocks[0])


def test_recycled_volumes_make_the_next_series_decode_into_touched_memory(
    tmp_path: Path,
) -> None:
    """Without a count hint a 128-slice series decodes into two 64-slice slabs and is
    gathered into a new 128-slice array; once the job hands that volume back (the worker's
    recycle), every later series of that size finds all three blocks in the pool: no fresh
    memory at all, and the volumes stay exact."""
    asm = StreamingAssembler(workers=1, max_bytes=256 * 2**20)
    asm.start()
    try:
        fresh = []
        for k, seed in enumerate((71, 72, 73)):
            paths = write_synthetic_series(tmp_path / str(k), replace(TINY, slices=128), seed=seed)
            uid = series_uid_of(paths[0])
            reused = asm.pool.reused
            feed(asm, paths, uid, list(range(len(paths))))
            got = asm.take(uid, paths)
            assert got is not None
            assert_same_volume(got, assemble_volume(paths))
            fresh.append(3 - (asm.pool.reused - reused))  # blocks not found in the pool
            asm.recycle(got)
        assert fresh[1:] == [0, 0], fresh
        asm.recycle(got)  # twice: the pool keeps one reference to a block
        assert asm.pool.idle_bytes == (64 + 64 + 128) * 16 * 16 * 4
    finally:
        asm.stop()


def test_warm_slabs_count_against_the_memory_cap() -> None:
    asm = StreamingAssembler(workers=1, max_bytes=200 * 2**20, warm_bytes=1 << 40)
    assert asm.warm_bytes == 200 * 2**20  # never more than the cap
    asm.start()
    try:
        assert asm.pool.idle_bytes == 3 * 64 * 2**20  # three 64-slice 512x512 slabs
    finally:
        asm.stop()
    off = StreamingAssembler(workers=1, decode_pixels=False, warm_bytes=1 << 30)
    assert off.warm_bytes == 0


@pytest.mark.parametrize("dtype", [np.int16, np.uint16, np.int32, np.uint8])
@pytest.mark.parametrize(("slope", "intercept"), [(1.0, 0.0), (1.0, -1024.0), (2.5, -1024.0)])
def test_rescale_into_matches_cast_then_rescale(
    dtype: type[np.integer], slope: float, intercept: float
) -> None:
    info = np.iinfo(dtype)
    stored = np.random.default_rng(5).integers(info.min, info.max, (16, 16), dtype=dtype)
    expected = stored.astype(np.float32) * np.float32(slope) + np.float32(intercept)
    out = np.empty((16, 16), np.float32)
    rescale_into(out, stored, slope, intercept)
    np.testing.assert_array_equal(out, expected)


def test_hints_say_how_far_decoding_is_behind(tmp_path: Path) -> None:
    """While instances wait for the decoder, the hints say so (the headers read so far
    under-count them: completion waits for the rest before reading 'complete' or 'short'
    from them); once decoded, the hints count every instance."""
    paths = write_synthetic_series(tmp_path, TINY, seed=57, images_in_acquisition=True)
    uid = series_uid_of(paths[0])
    asm = StreamingAssembler(workers=1)
    assert asm.hints(uid) is None  # nothing received
    feed(asm, paths, uid, list(range(5)))  # the pool has not started: all five wait
    hints = asm.hints(uid)
    assert hints is not None and hints.behind == 5 and hints.received == 0
    asm.start()
    try:
        assert asm.wait_idle()
        hints = asm.hints(uid)
        assert hints is not None and hints.behind == 0 and hints.received == 5
        assert hints.incomplete_reason() == "5 of 8 instances received (Images in Acquisition)"
    finally:
        asm.stop()


def test_an_urgent_senders_instances_are_decoded_before_a_routine_backlog(
    tmp_path: Path,
) -> None:
    """Queued instances of a more urgent calling AE go to the decoder first (the oldest first
    among equals): an urgent series' release is not held behind routine headers."""
    routine = write_synthetic_series(tmp_path / "routine", TWO_SLABS, seed=61)
    urgent = write_synthetic_series(tmp_path / "urgent", TINY, seed=62)
    routine_uid, urgent_uid = series_uid_of(routine[0]), series_uid_of(urgent[0])
    order: list[str] = []
    asm = StreamingAssembler(workers=1, priority=lambda ae: 10 if ae == "URGENT" else 0)
    decode = asm._decode

    def recording(state: Any, arrival: Arrival) -> bool:
        order.append(arrival.calling_ae)
        return decode(state, arrival)

    asm._decode = recording  # type: ignore[method-assign]
    for i, path in enumerate(routine):  # the backlog, queued before the pool starts
        asm.submit(Arrival(routine_uid, f"r{i}", path, "ROUTINE", 0))
    for i, path in enumerate(urgent):
        asm.submit(Arrival(urgent_uid, f"u{i}", path, "URGENT", 0))
    asm.start()
    try:
        assert asm.wait_idle()
        assert order == ["URGENT"] * len(urgent) + ["ROUTINE"] * len(routine)
        hints = asm.hints(urgent_uid)
        assert hints is not None and hints.received == len(urgent)
        volume = asm.take(routine_uid, routine)  # the routine series is whole, in order
        assert volume is not None and volume.hu.shape[0] == len(routine)
        assert_same_volume(volume, assemble_volume(routine))
    finally:
        asm.stop()
