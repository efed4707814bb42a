"""Durable folders: a folder the node creates survives a power cut before anything in it is
acknowledged.

POSIX makes a new name durable only by an fsync of the folder that holds it: a file's rename
by its folder's fsync, a new folder by its parent's fsync, and that parent's own name, if it
is new too, by the grandparent's. ext4 with a journal happens to commit a ``mkdir`` with the
next fsync of anything in the folder; XFS, btrfs, NFS and a hypervisor's write cache promise
nothing of the kind, so a new series folder with every acknowledged instance in it could
vanish at a power cut. :func:`ensure_folder` creates a folder and fsyncs each parent it was
created in, once per folder and process: the per-instance cost stays one ``mkdir`` that
fails with ``EEXIST`` and a set lookup.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

__all__ = ["ensure_folder", "fsync_folder"]

#: Folders whose names this process has made durable (or found and synced once).
_known: set[str] = set()
_lock = threading.Lock()


def fsync_folder(folder: Path | str) -> None:
    """fsync ``folder``: the names created, renamed or removed in it become durable."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def ensure_folder(path: Path, mode: int = 0o700) -> None:
    """Create ``path`` and its missing parents, and make each name durable before returning.

    A folder this process created, or sees for the first time (a process killed between its
    ``mkdir`` and the parent's fsync leaves a folder whose name no disk holds yet), has its
    parent fsynced, and the parent's name in turn, up to a folder already made durable by
    this process or the root of the file system. A folder found again is not synced again.

    Raises
    ------
    OSError
        The folder cannot be created or synced (``FileExistsError``: a file is in its place).
    """
    path = Path(os.path.abspath(path))
    key = os.fspath(path)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        if key in _known:
            return
        if not path.is_dir():
            raise
    except FileNotFoundError:
        ensure_folder(path.parent, mode)
        try:
            os.mkdir(path, mode)
        except FileExistsError:
            if not path.is_dir():
                raise
    # New (also after a removal: mkdir succeeded) or first seen: its name goes to the disk.
    fsync_folder(path.parent)
    _settle(path.parent)
    with _lock:
        _known.add(key)


def _settle(path: Path) -> None:
    """Make the name of ``path`` durable unless this process already did: fsync its parent,
    and the parent's name in turn, up to a known folder or the root."""
    chain: list[Path] = []
    here = path
    while os.fspath(here) not in _known and here.parent != here:
        chain.append(here)
        here = here.parent
    for folder in chain:
        try:
            fsync_folder(folder.parent)
        except PermissionError:
            break  # a system folder the service user cannot open: the operator's to keep
    with _lock:
        _known.update(os.fspath(folder) for folder in chain)
