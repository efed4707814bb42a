"""scripts/lazyfs.py: what survives its power cut is what POSIX promises, and no more.

Each test mounts a fresh lazy filesystem over a temporary folder, does something through the
mount, cuts the power and looks at what came back.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.lazyfs import LazyFS, fuse_usable


@contextlib.contextmanager
def mounted(tmp_path: Path, *, torn: bool = False) -> Iterator[LazyFS]:
    """A lazy filesystem over tmp_path/backing (made if absent), mounted on tmp_path/mnt."""
    reason = fuse_usable()
    if reason is not None:
        pytest.skip(reason)
    backing, mount = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir(exist_ok=True)
    mount.mkdir()
    fs = LazyFS(backing, mount, torn=torn, seed=7)
    fs.start()
    try:
        yield fs
    finally:
        fs.stop()
        subprocess.run(["fusermount3", "-u", "-z", str(mount)], capture_output=True)
        assert not os.path.ismount(mount)


@pytest.fixture
def lazyfs(tmp_path: Path) -> Iterator[LazyFS]:
    with mounted(tmp_path) as fs:
        yield fs


def write(path: Path, data: bytes, *, sync: bool = False, flags: int = 0) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    try:
        os.write(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_file(path: Path, data: bytes) -> None:
    """A file whose content and name are durable."""
    write(path, data, sync=True)
    fsync_dir(path.parent)


def test_unsynced_write_is_lost_synced_kept(lazyfs: LazyFS) -> None:
    m = lazyfs.mount
    durable_file(m / "old", b"old content")
    with open(m / "old", "ab") as f:
        f.write(b" and more, never synced")
    write(m / "synced", b"synced", sync=True)
    write(m / "unsynced", b"unsynced")
    fsync_dir(m)
    assert lazyfs.stats()["pending_files"] == 2
    lazyfs.cut()
    assert (m / "old").read_bytes() == b"old content"
    assert (m / "synced").read_bytes() == b"synced"
    assert (m / "unsynced").read_bytes() == b""  # durable name, data never synced
    assert lazyfs.stats()["pending_files"] == 0


def test_state_at_mount_is_durable(tmp_path: Path) -> None:
    (tmp_path / "backing" / "dir").mkdir(parents=True)
    (tmp_path / "backing" / "big").write_bytes(b"b" * 1_000_000)
    (tmp_path / "backing" / "dir" / "f").write_bytes(b"f")
    with mounted(tmp_path) as fs:
        m = fs.mount
        os.rename(m / "big", m / "dir" / "moved")
        os.unlink(m / "dir" / "f")
        fsync_dir(m / "dir")  # "moved" and the unlink are durable; "big" is still in "/"
        before = fs.stats()
        assert before["copies"] == 0  # unchanged files are durable where they are
        with open(m / "dir" / "moved", "r+b") as f:  # first change: one copy of the file
            f.seek(500_000)
            f.write(b"0123456789")
            f.flush()
            os.fsync(f.fileno())
        after = fs.stats()
        assert after["copies"] == 1
        assert after["synced_bytes"] - before["synced_bytes"] == 10  # the dirty range
        fs.cut()
        assert sorted(os.listdir(m)) == ["big", "dir"]
        assert os.listdir(m / "dir") == ["moved"]
        assert (m / "big").read_bytes() == (m / "dir" / "moved").read_bytes()  # one file
        assert (m / "big").read_bytes()[499_995:500_015] == b"bbbbb0123456789bbbbb"


def test_odsync_write_is_kept(lazyfs: LazyFS) -> None:
    m = lazyfs.mount
    write(m / "staged", b"x" * 70_000, flags=os.O_DSYNC)  # no fsync: O_DSYNC is enough
    fsync_dir(m)
    assert lazyfs.stats()["dsync_writes"] >= 1
    lazyfs.cut()
    assert (m / "staged").read_bytes() == b"x" * 70_000


def test_new_file_needs_its_folder_fsynced(lazyfs: LazyFS) -> None:
    m = lazyfs.mount
    write(m / "lost", b"data", sync=True)
    lazyfs.cut()
    assert not (m / "lost").exists()

    write(m / "kept", b"data", sync=True)
    before = lazyfs.stats()["fsyncdir"]
    fsync_dir(m)  # the kernel forwards fsync() of a directory fd as FUSE fsyncdir
    assert lazyfs.stats()["fsyncdir"] == before + 1
    lazyfs.cut()
    assert (m / "kept").read_bytes() == b"data"


def test_rename_needs_the_folder_fsynced(lazyfs: LazyFS) -> None:
    m = lazyfs.mount
    durable_file(m / "target", b"old")
    # the atomic-replace pattern: temp file, fsync, rename; without the folder fsync...
    write(m / "target.tmp", b"new", sync=True)
    os.replace(m / "target.tmp", m / "target")
    assert (m / "target").read_bytes() == b"new"
    lazyfs.cut()
    assert (m / "target").read_bytes() == b"old"
    assert not (m / "target.tmp").exists()
    # ...and with it
    write(m / "target.tmp", b"new", sync=True)
    os.replace(m / "target.tmp", m / "target")
    fsync_dir(m)
    lazyfs.cut()
    assert sorted(os.listdir(m)) == ["target"]
    assert (m / "target").read_bytes() == b"new"


def test_unlink_needs_the_folder_fsynced(lazyfs: LazyFS) -> None:
    m = lazyfs.mount
    durable_file(m / "f", b"content")
    os.unlink(m / "f")
    lazyfs.cut()
    assert (m / "f").read_bytes() == b"content"
    os.unlink(m / "f")
    fsync_dir(m)
    lazyfs.cut()
    assert not (m / "f").exists()


def test_new_folder_needs_its_parent_fsynced(lazyfs: LazyFS) -> None:
    m = lazyfs.mount
    (m / "new").mkdir()
    write(m / "new" / "f", b"data", sync=True)
    fsync_dir(m / "new")
    lazyfs.cut()
    assert not (m / "new").exists()  # the parent was not fsynced: gone with its file

    for name in ("kept", "empty"):
        (m / name).mkdir()
        write(m / name / "f", b"data", sync=True)
    fsync_dir(m / "kept")
    fsync_dir(m)
    lazyfs.cut()
    assert (m / "kept" / "f").read_bytes() == b"data"
    assert os.listdir(m / "empty") == []  # its name is durable, it was never fsynced


_WRITER = """
import os, sqlite3, sys, time
db = sys.argv[1]
con = sqlite3.connect(db, isolation_level=None)
assert con.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
con.execute("PRAGMA synchronous=FULL")
con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, body BLOB)")
# SQLite syncs the folder for a new journal or WAL, not for a new database file
fd = os.open(os.path.dirname(db), os.O_RDONLY)
os.fsync(fd)
os.close(fd)
for i in range(100):
    con.execute("INSERT INTO t (body) VALUES (?)", (os.urandom(3000),))
con.execute("PRAGMA synchronous=OFF")
for i in range(20):  # committed, never synced: lost at the cut
    con.execute("INSERT INTO t (body) VALUES (?)", (os.urandom(3000),))
print(con.execute("SELECT count(*) FROM t").fetchone()[0], flush=True)
time.sleep(60)
"""


def test_sqlite_wal_survives_the_cut(lazyfs: LazyFS) -> None:
    import sqlite3

    db = lazyfs.mount / "ledger.sqlite3"
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(db)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "120"
    finally:
        writer.kill()
        writer.wait()
    assert (lazyfs.mount / "ledger.sqlite3-wal").stat().st_size > 0  # not checkpointed
    lazyfs.cut()
    con = sqlite3.connect(db)
    try:
        assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert con.execute("SELECT count(*) FROM t").fetchone()[0] == 100
        assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        con.close()


def test_torn_keeps_a_prefix_of_the_last_write(tmp_path: Path) -> None:
    with mounted(tmp_path, torn=True) as fs:
        durable_file(fs.mount / "f", b"A" * 100)
        with open(fs.mount / "f", "ab") as f:
            f.write(b"B" * 100)
        fs.cut()
        data = (fs.mount / "f").read_bytes()
        assert data[:100] == b"A" * 100
        assert data[100:] == b"B" * (len(data) - 100)
