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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: Anything os.write accepts.
Buffer = bytes | bytearray | memoryview

_UID = re.compile(r"^(0|[1-9][0-9]*)(\.(0|[1-9][0-9]*))*$")


class SpoolError(Exception):
    """Writing to the spool failed (disk full, permissions): the sender gets 0xA700."""


def valid_uid(uid: str) -> bool:
    """Whether ``uid`` is a syntactically valid DICOM UID (PS3.5 §9.1).

    Leading zeros in components are tolerated when reading real data elsewhere; for file
    names we only need digits and dots, so this accepts any dotted digit string of 1-64 chars.
    """
    return (
        0 < len(uid) <= 64 and all(part.isdigit() for part in uid.split(".")) and (".." not in uid)
    )


def strict_uid(uid: str) -> bool:
    """Whether ``uid`` also has no leading zeros in its components (strict PS3.5 §9.1)."""
    return 0 < len(uid) <= 64 and _UID.match(uid) is not None


def write_atomic(path: Path, chunks: Sequence[Buffer] | bytes, *, mode: int = 0o600) -> int:
    """Write ``chunks`` to ``path`` via a temp file, fsync, rename, fsync of the folder.

    Returns the number of bytes written.
    """
    if isinstance(chunks, bytes):
        chunks = [chunks]
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{id(chunks)}.tmp")
    size = 0
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        size = _write_all(fd, chunks)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return size


INCOMING = ".incoming"
_counter = itertools.count()


@dataclass(frozen=True)
class Staged:
    """A written, fsynced file under ``.incoming/`` awaiting its instance path."""

    path: Path
    size: int


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
    ``writev`` system call (the C-STORE handler holds no GIL for all of it)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd = fd

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
            finally:
                os.close(self._fd)
        except OSError as exc:
            self.path.unlink(missing_ok=True)
            raise SpoolError(f"cannot write to the spool: {exc.strerror or exc}") from exc
        return Staged(self.path, size)

    def abandon(self) -> None:
        """Close and remove a staged file that will not be written."""
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self.path.unlink(missing_ok=True)


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


def _fsync_dir(folder: Path) -> None:
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


class Spool:
    """Instance files under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True, mode=0o700)

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

        Call once at start-up, before the SCP listens.
        """
        n = 0
        if self.incoming_dir.is_dir():
            for entry in self.incoming_dir.iterdir():
                entry.unlink(missing_ok=True)
                n += 1
        return n

    def open_staged(self) -> StagingFile:
        """A new, empty file under ``.incoming/``, opened with ``O_DSYNC`` (see
        :meth:`StagingFile.write_synced`). Raises :class:`SpoolError` on OS errors."""
        path = self.incoming_dir / f"{os.getpid()}-{next(_counter)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_DSYNC", 0)
        try:
            self.incoming_dir.mkdir(exist_ok=True, mode=0o700)
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise SpoolError(f"cannot write to the spool: {exc.strerror or exc}") from exc
        return StagingFile(path, fd)

    def stage(self, chunks: Sequence[Buffer]) -> Staged:
        """Write ``chunks`` to a new file under ``.incoming/``, synced when this returns; its
        durable name comes with :meth:`place`. Raises :class:`SpoolError` on OS errors."""
        return self.open_staged().write_synced(chunks)

    def place(self, staged: Staged, study_uid: str, series_uid: str, sop_uid: str) -> Path:
        """Rename a staged file to the instance's path; durable after :meth:`sync_folder`."""
        try:
            path = self.path_for(study_uid, series_uid, sop_uid)
        except ValueError:
            self.discard(staged)
            raise
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.replace(staged.path, path)
        except OSError as exc:
            self.discard(staged)
            raise SpoolError(f"cannot write {path.name}: {exc.strerror or exc}") from exc
        return path

    @staticmethod
    def sync_folder(path: Path) -> None:
        """fsync the folder holding ``path`` (makes its rename durable)."""
        try:
            _fsync_dir(path.parent)
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
        self.sync_folder(path)
        return path, staged.size
