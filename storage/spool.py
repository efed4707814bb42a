"""The instance spool: received bytes on disk, written atomically.

Layout: ``<data_dir>/spool/<study uid>/<series uid>/<sop instance uid>.dcm``. Every name comes
from a UID that has been validated against PS3.5 §9.1 (digits and dots, at most 64
characters), never from a raw string, so a hostile UID cannot escape the spool.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from segnode.storage.durable import ensure_folder, fsync_folder

#: Anything os.write accepts.
Buffer = bytes | bytearray | memoryview

# Components of ASCII digits joined by single dots ([0-9], not \d: \d matches any Unicode digit).
_UID = re.compile(r"[0-9]+(?:\.[0-9]+)*")


class SpoolError(Exception):
    """Writing to the spool failed (disk full, permissions): the sender gets 0xA700."""


def valid_uid(uid: str) -> bool:
    """Whether ``uid`` is a syntactically valid DICOM UID (PS3.5 §9.1).

    Leading zeros in components are tolerated when reading real data elsewhere; for file
    names we only need digits and dots, so this accepts any dotted string of ASCII digits
    of 1-64 chars. (Not :meth:`str.isdigit`, which also holds for ``'²'``, ``'٣'`` and
    other Unicode digits that no UID may contain.)
    """
    return len(uid) <= 64 and _UID.fullmatch(uid) is not None


def write_atomic(path: Path, chunks: Sequence[Buffer] | bytes, *, mode: int = 0o600) -> int:
    """Write ``chunks`` to ``path`` via a temp file, fsync, rename, fsync of the folder.

    Returns the number of bytes written.
    """
    tmp, size = write_synced(path, chunks, mode=mode)
    os.replace(tmp, path)
    fsync_folder(path.parent)
    return size


def write_synced(
    path: Path, chunks: Sequence[Buffer] | bytes, *, mode: int = 0o600
) -> tuple[Path, int]:
    """The first half of :func:`write_atomic`: ``chunks`` written and fsynced to a temp file
    next to ``path``; returns it and the bytes written. The caller renames it to ``path``
    (``os.replace``) and fsyncs the folder, or unlinks it. A folder created for ``path`` is
    durable when this returns (:func:`~segnode.storage.durable.ensure_folder`)."""
    if isinstance(chunks, bytes):
        chunks = [chunks]
    ensure_folder(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(chunks)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        size = _write_all(fd, chunks)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return tmp, size


INCOMING = ".incoming"
_counter = itertools.count()
#: Size of a recycled staging file: the pixel data of a 512x512 16-bit slice. An instance
#: of such a slice (its header on top) extends the file by a block or so, which its
#: ``O_DSYNC`` write commits; a smaller instance cuts it (see :meth:`Spool.sync_folder`).
POOL_FILE_BYTES = 512 << 10
POOL_SUFFIX = ".pool"


@dataclass(frozen=True)
class Staged:
    """A written, fsynced file under ``.incoming/`` awaiting its instance path.

    ``recycled``: it was a staging-pool file cut to ``size`` after the write (the instance
    was smaller); that cut is made durable by :meth:`Spool.sync_folder` together with the
    rename (one journal commit).
    """

    path: Path
    size: int
    recycled: bool = False


def _write_all(fd: int, chunks: Sequence[Buffer]) -> int:
    size = 0
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            n = os.write(fd, view)
            view = view[n:]
            size += n
    return size


class StagingFile:
    """A staged file opened with ``O_DSYNC``: :meth:`write_synced` writes and syncs it in one
    ``writev`` system call (the C-STORE handler holds no GIL for all of it).

    A file from the staging pool (``pool`` set) already has ``capacity`` written bytes: the
    write overwrites allocated blocks (no block allocation, hence no journal commit and no
    fresh page-cache pages) and the file is then cut to the instance's size.
    """

    def __init__(
        self, path: Path, fd: int, capacity: int = 0, pool: StagingPool | None = None
    ) -> None:
        self.path = path
        self._fd = fd
        self.capacity = capacity
        self._pool = pool

    def write_synced(self, chunks: Sequence[Buffer]) -> Staged:
        """Write ``chunks``; durable when this returns (the file is closed either way).

        Raises
        ------
        SpoolError
            On any OS error (the file is then removed).
        """
        views = [memoryview(c).cast("B") for c in chunks]
        size = sum(len(v) for v in views)
        try:
            try:
                done = os.writev(self._fd, views)
                if done < size:  # a short write (rare, or over 2 GiB): write the rest
                    _write_all(self._fd, _after(views, done))
                if not getattr(os, "O_DSYNC", 0):
                    os.fsync(self._fd)
                if size < self.capacity:
                    os.ftruncate(self._fd, size)
            finally:
                os.close(self._fd)
        except OSError as exc:
            self.path.unlink(missing_ok=True)
            raise SpoolError(f"cannot write to the spool: {exc.strerror or exc}") from exc
        return Staged(self.path, size, recycled=size < self.capacity)

    def abandon(self) -> None:
        """Close a staged file that will not be written: a pool file goes back to the pool,
        a new one is removed."""
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if self._pool is not None:
            self._pool.put_back(self.path)
        else:
            self.path.unlink(missing_ok=True)


class StagingPool:
    """Pre-written staging files for reuse, like a database's recycled log segments.

    A new file's durable write costs a block allocation and its journal commit, and fresh
    page-cache pages; writing over a file whose blocks are already written costs neither.
    Measured on ext4 (2-vCPU VM, 530 KB instances): 2.7 ms per instance for a new file
    (``O_DSYNC`` write, rename, folder fsync) and 1.1 ms for a pool file (``O_DSYNC``
    overwrite, cut to size, rename, one fsync of file and folder).

    Files are ``<n>.pool`` under ``.incoming/``, :data:`POOL_FILE_BYTES` long, zero-filled;
    their content never matters (every byte kept is overwritten, the rest is cut off).
    """

    def __init__(self, folder: Path, target: int, file_bytes: int = POOL_FILE_BYTES) -> None:
        self.folder = folder
        self.target = max(0, target)
        self.file_bytes = file_bytes
        self._lock = threading.Lock()
        self._free: list[Path] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._free)

    def adopt(self) -> int:
        """Take back pool files left by an earlier run, whole ones up to the target; remove
        the rest. Returns how many removed files had been written to (cut to another size:
        in flight at a crash). Call at start-up, before the SCP listens."""
        kept: list[Path] = []
        cut = 0
        if self.folder.is_dir():
            for entry in os.scandir(self.folder):
                if not entry.name.endswith(POOL_SUFFIX):
                    continue
                path = Path(entry.path)
                try:
                    whole = entry.stat(follow_symlinks=False).st_size == self.file_bytes
                except OSError:
                    whole = False
                if whole and len(kept) < self.target:
                    kept.append(path)
                else:
                    cut += not whole
                    path.unlink(missing_ok=True)
        with self._lock:
            self._free = kept
        return cut

    def take(self) -> StagingFile | None:
        """An idle pool file opened for writing (``O_DSYNC``), or None when none is left."""
        while True:
            with self._lock:
                if not self._free:
                    return None
                path = self._free.pop()
            try:
                fd = os.open(path, os.O_WRONLY | getattr(os, "O_DSYNC", 0))
            except OSError:
                continue  # gone (removed by hand): try the next one
            return StagingFile(path, fd, capacity=self.file_bytes, pool=self)

    def put_back(self, path: Path) -> None:
        """Return an untouched pool file."""
        with self._lock:
            self._free.append(path)

    def fill(self, should_stop: Callable[[], bool] = lambda: False) -> int:
        """Write new pool files up to the target, checking ``should_stop`` before each;
        return how many were written. OS errors (a full disk) end the fill quietly."""
        made = 0
        zeros = bytes(self.file_bytes)
        while len(self) < self.target and not should_stop():
            path = self.folder / f"{os.getpid()}-{next(_counter)}{POOL_SUFFIX}"
            try:
                ensure_folder(self.folder)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    _write_all(fd, [zeros])
                    os.fsync(fd)  # written blocks, not delayed allocations
                finally:
                    os.close(fd)
            except OSError:
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
                break
            self.put_back(path)
            made += 1
        return made


def _after(views: Sequence[memoryview], skip: int) -> list[memoryview]:
    """``views`` without their first ``skip`` bytes."""
    out = []
    for v in views:
        if skip >= len(v):
            skip -= len(v)
            continue
        out.append(v[skip:])
        skip = 0
    return out


class Spool:
    """Instance files under ``root``."""

    def __init__(self, root: Path, pool_files: int = 0) -> None:
        self.root = root
        ensure_folder(root)  # and its new parents, their names durable
        #: Recycled staging files (:class:`StagingPool`); ``pool_files`` 0 turns it off.
        self.pool = StagingPool(root / INCOMING, pool_files)

    def path_for(self, study_uid: str, series_uid: str, sop_uid: str) -> Path:
        """The file path of an instance; every UID must be valid."""
        for uid in (study_uid, series_uid, sop_uid):
            if not valid_uid(uid):
                raise ValueError(f"invalid UID {uid[:80]!r}")
        return self.root / study_uid / series_uid / f"{sop_uid}.dcm"

    @property
    def incoming_dir(self) -> Path:
        """Where :meth:`stage` writes files whose UIDs are not checked yet."""
        return self.root / INCOMING

    def instance_files(self) -> list[Path]:
        """Every instance file in the spool (``<study>/<series>/<sop>.dcm``), staged files
        excluded."""
        files: list[Path] = []
        for study in os.scandir(self.root):
            if study.name == INCOMING or not study.is_dir(follow_symlinks=False):
                continue
            for series in os.scandir(study.path):
                if series.is_dir(follow_symlinks=False):
                    files.extend(
                        Path(e.path)
                        for e in os.scandir(series.path)
                        if e.name.endswith(".dcm") and e.is_file(follow_symlinks=False)
                    )
        return files

    def clear_incoming(self) -> int:
        """Delete staged files left by a crash (none was acknowledged); return how many.
        Whole staging-pool files are kept for reuse (:meth:`StagingPool.adopt`).

        Call once at start-up, before the SCP listens.
        """
        n = 0
        if self.incoming_dir.is_dir():
            for entry in self.incoming_dir.iterdir():
                if not entry.name.endswith(POOL_SUFFIX):
                    entry.unlink(missing_ok=True)
                    n += 1
        return n + self.pool.adopt()

    def open_staged(self) -> StagingFile:
        """A file under ``.incoming/`` opened with ``O_DSYNC`` (see
        :meth:`StagingFile.write_synced`): a recycled one from the staging pool when there
        is one, else a new, empty one. Raises :class:`SpoolError` on OS errors."""
        recycled = self.pool.take()
        if recycled is not None:
            return recycled
        path = self.incoming_dir / f"{os.getpid()}-{next(_counter)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_DSYNC", 0)
        try:
            ensure_folder(self.incoming_dir)
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise SpoolError(f"cannot write to the spool: {exc.strerror or exc}") from exc
        return StagingFile(path, fd)

    def stage(self, chunks: Sequence[Buffer]) -> Staged:
        """Write ``chunks`` to a new file under ``.incoming/``, synced when this returns; its
        durable name comes with :meth:`place`. Raises :class:`SpoolError` on OS errors."""
        return self.open_staged().write_synced(chunks)

    def place(self, staged: Staged, study_uid: str, series_uid: str, sop_uid: str) -> Path:
        """Rename a staged file to the instance's path; durable after :meth:`sync_folder`.

        A new study or series folder is made durable here, before the rename (its parent's
        fsync, once per folder: :func:`~segnode.storage.durable.ensure_folder`)."""
        try:
            path = self.path_for(study_uid, series_uid, sop_uid)
        except ValueError:
            self.discard(staged)
            raise
        try:
            ensure_folder(path.parent)
            os.replace(staged.path, path)
        except OSError as exc:
            self.discard(staged)
            raise SpoolError(f"cannot write {path.name}: {exc.strerror or exc}") from exc
        return path

    @staticmethod
    def sync_folder(path: Path, staged: Staged | None = None) -> None:
        """fsync the folder holding ``path`` (makes its rename durable). For a recycled
        staged file the file is synced first (its cut to size): on a journalling file
        system that one commit carries the rename too, and the folder's fsync finds
        nothing left to commit."""
        try:
            if staged is not None and staged.recycled:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_folder(path.parent)
        except OSError as exc:
            raise SpoolError(f"cannot sync {path.parent.name}: {exc.strerror or exc}") from exc

    @staticmethod
    def discard(staged: Staged) -> None:
        """Delete a staged file that will not be kept."""
        staged.path.unlink(missing_ok=True)

    def store(
        self, study_uid: str, series_uid: str, sop_uid: str, chunks: Sequence[Buffer]
    ) -> tuple[Path, int]:
        """Write an instance durably (:meth:`stage`, :meth:`place`, :meth:`sync_folder`) and
        return its path and size.

        Raises
        ------
        SpoolError
            On any OS error (disk full, permissions).
        """
        self.path_for(study_uid, series_uid, sop_uid)  # refuse bad UIDs before writing
        staged = self.stage(chunks)
        path = self.place(staged, study_uid, series_uid, sop_uid)
        self.sync_folder(path, staged)
        return path, staged.size
