"""Input a sender controls that must be refused with a reason, never crash or loop: UIDs that
name spool files, slice geometry and rescale values (both volume assembly paths), and a
series whose completion raises."""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pydicom
import pytest
from pydicom.dataelem import RawDataElement
from pydicom.dataset import Dataset
from pydicom.tag import Tag

from segnode.node.ingest.series import MAX_COMPLETION_FAILURES, CompletionLoop
from segnode.node.ingest.streaming import Arrival, StreamingAssembler
from segnode.node.ingest.volume import VolumeError, assemble_volume
from segnode.storage.spool import valid_uid
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

TINY = PhantomGeometry(rows=16, columns=16, slices=6)

# -- UIDs --------------------------------------------------------------------------------


@pytest.mark.parametrize("uid", ["1", "1.2.840.10008.1.1", "0.0", "1." + "2" * 62])
def test_valid_uids(uid: str) -> None:
    assert valid_uid(uid)


@pytest.mark.parametrize(
    "uid",
    [
        "",
        "1.2²",  # SUPERSCRIPT TWO: str.isdigit() holds for it
        "1.٣",  # ARABIC-INDIC DIGIT THREE
        "1.２",  # FULLWIDTH DIGIT TWO
        "1.2.a",
        "1..2",
        ".1",
        "1.",
        "1.2\n",
        "1/2",
        "1." + "2" * 63,
    ],
)
def test_invalid_uids(uid: str) -> None:
    assert not valid_uid(uid)


# -- volume assembly: spool and streaming refuse the same input ----------------------------


def _as_read(ds: Dataset, keyword: str, text: bytes) -> None:
    """Give ``ds`` a DS element holding ``text`` as a file would."""
    tag = Tag(keyword)
    ds[tag] = RawDataElement(tag, "DS", len(text), text, 0, True, True)


def _each(keyword: str, text: bytes) -> Callable[[list[Dataset]], None]:
    return lambda d: [_as_read(x, keyword, text) for x in d]


_BAD_INPUT: dict[str, tuple[Callable[[list[Dataset]], None], str]] = {
    "nan_position": (
        lambda d: _as_read(d[2], "ImagePositionPatient", b"nan\\0\\0 "),
        r"instance 3 \(.*\): ImagePositionPatient \[nan, 0.0, 0.0\] is not finite",
    ),
    "infinite_orientation": (
        _each("ImageOrientationPatient", b"1\\0\\0\\0\\1\\inf "),
        r"instance 1 \(.*\): ImageOrientationPatient .* is not finite",
    ),
    "nan_pixel_spacing": (
        _each("PixelSpacing", b"nan\\0.7 "),
        r"instance 1 \(.*\): PixelSpacing \[nan, 0.7\] is not finite",
    ),
    "zero_pixel_spacing": (
        _each("PixelSpacing", b"0\\0 "),
        r"instance 1 \(.*\): PixelSpacing \[0.0, 0.0\] must be positive",
    ),
    "negative_pixel_spacing": (
        _each("PixelSpacing", b"-0.7\\-0.7 "),
        r"instance 1 \(.*\): PixelSpacing \[-0.7, -0.7\] must be positive",
    ),
    "one_value_pixel_spacing": (
        _each("PixelSpacing", b"0.7 "),
        r"instance 1 \(.*\): PixelSpacing must have 2 values, got 1",
    ),
    "zero_slope": (
        _each("RescaleSlope", b"0 "),
        r"instance 1 \(.*\): RescaleSlope 0.0 must be a finite non-zero number",
    ),
    "nan_slope": (
        lambda d: _as_read(d[4], "RescaleSlope", b"nan "),
        r"instance 5 \(.*\): RescaleSlope nan must be a finite non-zero number",
    ),
    "infinite_intercept": (
        lambda d: _as_read(d[1], "RescaleIntercept", b"inf "),
        r"instance 2 \(.*\): RescaleIntercept inf is not finite",
    ),
    "huge_slope": (
        _each("RescaleSlope", b"1e30"),
        r"instance 1 \(.*\): RescaleSlope 1e\+30 and RescaleIntercept -1024 map 16-bit stored "
        r"values .* beyond ±1e\+07 HU: not a CT modality LUT",
    ),
    "huge_intercept": (
        _each("RescaleIntercept", b"-1e9"),
        r"instance 1 \(.*\): RescaleSlope 1 and RescaleIntercept -1e\+09 map",
    ),
    "unreadable_slope": (
        lambda d: _as_read(d[3], "RescaleSlope", b"abc "),
        r"instance 4 \(.*\): unreadable RescaleSlope 'abc'",
    ),
}


@pytest.mark.filterwarnings("ignore:Invalid value for VR")
@pytest.mark.parametrize(("damage", "match"), _BAD_INPUT.values(), ids=_BAD_INPUT)
def test_both_assembly_paths_refuse_bad_values(
    asm: StreamingAssembler,
    tmp_path: Path,
    damage: Callable[[list[Dataset]], None],
    match: str,
) -> None:
    """The spool path says why; the streaming path, fed the same files, builds nothing (the
    job then assembles from the spool and fails with that reason)."""
    paths = write_synthetic_series(tmp_path, TINY, seed=61, images_in_acquisition=True)
    datasets = [pydicom.dcmread(p) for p in paths]
    damage(datasets)
    for ds, path in zip(datasets, paths, strict=True):
        ds.save_as(path)
    with pytest.raises(VolumeError, match=match):
        assemble_volume(paths)
    uid = str(datasets[0].SeriesInstanceUID)
    for i, path in enumerate(paths):
        asm.submit(Arrival(uid, f"sop{i}", path, "MODALITY", 0))
    assert asm.wait_idle()
    assert asm.take(uid, paths) is None
    assert asm.memory_bytes == 0


def test_streaming_still_serves_a_good_series(asm: StreamingAssembler, tmp_path: Path) -> None:
    """(The refusals above are not the assembler refusing everything.)"""
    paths = write_synthetic_series(tmp_path, replace(TINY, slices=5), seed=62)
    uid = str(pydicom.dcmread(paths[0]).SeriesInstanceUID)
    for i, path in enumerate(paths):
        asm.submit(Arrival(uid, f"sop{i}", path, "MODALITY", 0))
    assert asm.take(uid, paths) is not None


# -- completing a series that raises --------------------------------------------------------


class Failing:
    """``on_complete`` that raises like a header the routing code cannot read, while the
    series stays pending (the quiet-period scan offers it again every tick)."""

    def __init__(self, fail: int | None = None) -> None:
        self.fail = fail  # raise this many times, then succeed (None: always)
        self.calls = 0
        self.pending = True
        self.settled: list[tuple[str, Exception]] = []
        self.done = threading.Event()

    def complete(self, series_uid: str, trigger: str) -> None:
        self.calls += 1
        if self.fail is None or self.calls <= self.fail:
            raise TypeError("object of type 'DSfloat' has no len()")
        self.pending = False
        self.done.set()

    def quiet(self) -> list[str]:
        return ["1.2.3"] if self.pending else []

    def on_failure(self, series_uid: str, error: Exception) -> bool:
        self.settled.append((series_uid, error))
        self.pending = False  # recorded as ignored: no longer pending
        self.done.set()
        return True


def test_a_series_whose_completion_keeps_raising_is_settled_once() -> None:
    f = Failing()
    loop = CompletionLoop(f.complete, quiet=f.quiet, quiet_every_s=0.01, on_failure=f.on_failure)
    loop.start()
    try:
        assert f.done.wait(10)
        loop.flush()
        for _ in range(5):  # more scans: nothing is retried once settled
            loop.scan_quiet()
        loop.flush()
    finally:
        loop.stop()
    assert f.calls == MAX_COMPLETION_FAILURES
    [(uid, error)] = f.settled
    assert uid == "1.2.3" and isinstance(error, TypeError) and "DSfloat" in str(error)


def test_a_completion_that_recovers_is_not_settled() -> None:
    f = Failing(fail=MAX_COMPLETION_FAILURES - 1)
    loop = CompletionLoop(f.complete, quiet=f.quiet, quiet_every_s=0.01, on_failure=f.on_failure)
    loop.start()
    try:
        assert f.done.wait(10)
    finally:
        loop.stop()
    assert f.calls == MAX_COMPLETION_FAILURES and f.settled == []


def test_a_settling_hook_that_declines_keeps_the_series_retried() -> None:
    f = Failing()
    declined = threading.Event()
    calls: list[str] = []

    def decline(series_uid: str, error: Exception) -> bool:
        calls.append(series_uid)
        if len(calls) == 2:
            declined.set()
        return False  # e.g. the ledger cannot be reached: keep the series pending

    loop = CompletionLoop(f.complete, quiet=f.quiet, quiet_every_s=0.01, on_failure=decline)
    loop.start()
    try:
        assert declined.wait(10)
    finally:
        loop.stop()
    assert f.calls >= MAX_COMPLETION_FAILURES + 1 and f.pending


@pytest.mark.parametrize(
    ("error", "traceback"),
    [(sqlite3.OperationalError("database or disk is full"), False), (TypeError("bug"), True)],
)
def test_a_ledger_outage_is_one_line_and_a_bug_keeps_its_traceback(
    caplog: pytest.LogCaptureFixture, error: Exception, traceback: bool
) -> None:
    """Completion runs again every second while the ledger cannot write: one line each time
    (78 tracebacks of about 40 lines in 25 s before); anything else is a bug, with its
    traceback."""

    def complete(_uid: str, _trigger: str) -> None:
        raise error

    caplog.set_level(logging.ERROR, logger="segnode.node.ingest.series")
    loop = CompletionLoop(complete, quiet=lambda: ["1.2.3"], quiet_every_s=60)
    loop.start()
    try:
        loop.scan_quiet()
        loop.flush()
    finally:
        loop.stop()
    [record, *_] = [r for r in caplog.records if "completing series 1.2.3" in r.getMessage()]
    assert (record.exc_info is not None) is traceback
    if not traceback:
        assert "the ledger cannot be written now (database or disk is full)" in record.getMessage()
