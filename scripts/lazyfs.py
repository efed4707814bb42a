"""A lazy filesystem for power-cut tests, in the spirit of Jepsen's LazyFS (FUSE 3, mfusepy).

Run::

    .venv/bin/python -m scripts.lazyfs BACKING MOUNTPOINT --control SOCKET [--torn] [--seed N]

Every operation on MOUNTPOINT is applied to BACKING at once, so reads see the live state.
Beside it the filesystem keeps the state that POSIX promises to survive a power cut (strict
mode):

- a file's data (content and size) becomes durable at fsync/fdatasync of that file, and
  after each write through a handle opened with O_SYNC or O_DSYNC;
- a name (create, mkdir, rename, unlink, rmdir, link, symlink) becomes durable when its
  folder is fsynced (FUSE's fsyncdir); a new folder's entries need that folder fsynced, its
  name needs its parent fsynced;
- what BACKING holds at mount is durable.

The control socket takes one command a line: ``cut`` (the power cut; answers ``ok``),
``stats`` (a JSON line of counters) and ``ping``. At ``cut`` the mount is taken down, BACKING
is rebuilt to exactly the durable state - each folder's names from its last durable listing,
each file's content from its last durable data (a durable name whose data was never synced
comes back empty; a folder never fsynced comes back empty; an unlink or rename that was not
followed by an fsync of the folder is undone, folder by folder) - and mounted again; then
everything present is durable. Kill the processes that use the mount (SIGKILL) before a cut.
With ``--torn`` each file's last unsynced write comes back as a random prefix (seeded).

Files are known by an id of our own (backing inode numbers come back after an unlink). A file
unchanged since mount is durable as it is in BACKING (it is linked aside before its last name
goes); its first change copies it once into the state folder, and each sync then copies only
the byte ranges written since the last one. :class:`LazyFS` runs it in a subprocess for tests
and harnesses.

What the kernel (6.x, libfuse 3.14) gives us: open and create see O_DSYNC/O_SYNC and an
atomic O_TRUNC; after each O_DSYNC write it also sends an fdatasync; fsync() of a folder fd
(os.open(folder, os.O_RDONLY)) arrives as fsyncdir; ftruncate and mmap writeback arrive as
truncate with the handle and as writes.

Not modelled: metadata (mode, owner, times; passed through, a rebuilt file has the mode it had
when first seen), xattrs, files other than regular files, folders and symlinks, fallocate,
renameat2 flags (EINVAL). Strict mode loses every unsynced change; the other crash states a
real disk may show (some unsynced writes or names kept, reordered) are not produced, except
``--torn``'s prefix. BACKING itself is never fsynced: the model, not the host disk, is durable.
"""

from __future__ import annotations

import argparse
import bisect
import ctypes.util
import errno
import json
import logging
import os
import random
import shutil
import signal
import socket
import socketserver
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)

_END = sys.maxsize  # "to the end of the file" in a dirty range
# Flags kept off the backing file: the kernel gives each write's offset (O_APPEND), the
# model, not the backing disk, is what must be durable (O_SYNC/O_DSYNC), and O_DIRECT
# would need aligned buffers.
_NOT_BACKING = os.O_APPEND | os.O_SYNC | os.O_DSYNC | os.O_DIRECT | os.O_CREAT | os.O_EXCL
# what stats counts: writes, syncs seen, copies of files unchanged since mount, bytes copied
# at syncs, power cuts
_COUNTERS: tuple[str, ...] = ("writes", "fsync", "fdatasync", "fsyncdir", "dsync_writes", "copies")
_COUNTERS += ("synced_bytes", "cuts")


def fuse_usable() -> str | None:
    """Why FUSE cannot be used here (no /dev/fuse, fusermount3, libfuse3 or mfusepy), or None."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable"
    if shutil.which("fusermount3") is None:
        return "fusermount3 not installed (apt-get install fuse3)"
    if ctypes.util.find_library("fuse3") is None:
        return "libfuse3 not installed (apt-get install libfuse3-3)"
    try:
        import mfusepy  # noqa: F401
    except Exception as exc:  # mfusepy raises EnvironmentError when it cannot load libfuse
        return f"mfusepy not importable: {exc}"
    return None


def _add_range(ranges: list[tuple[int, int]], start: int, end: int) -> None:
    """Add [start, end) to a sorted list of disjoint ranges, merging what touches it."""
    i = bisect.bisect_right(ranges, (start, _END))
    if i and ranges[i - 1][1] >= start:
        i -= 1
        start = ranges[i][0]
    j = i
    while j < len(ranges) and ranges[j][0] <= end:
        end = max(end, ranges[j][1])
        j += 1
    ranges[i:j] = [(start, end)]


def _copy_range(src: int, dst: int, start: int, end: int) -> None:
    """Copy bytes [start, end) of src to the same offsets of dst."""
    pos = start
    try:
        while pos < end:
            n = os.copy_file_range(src, dst, end - pos, pos, pos)
            if n == 0:
                return
            pos += n
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        while pos < end:
            chunk = os.pread(src, min(end - pos, 1 << 20), pos)
            if not chunk:
                return
            os.pwrite(dst, chunk, pos)
            pos += len(chunk)


@dataclass(eq=False)
class _Node:
    """One file, folder or symlink, known by our id from mount (or the last cut) on."""

    id: int
    kind: str  # "file", "dir", "link" or "other"
    mode: int
    target: str = ""  # a symlink's target
    # files: the durable content is the backing inode as it was at mount (live), a copy in
    # the state folder (data), or empty (neither: created since and never synced)
    live: bool = False
    data: str | None = None
    aside: str | None = None  # a link in the state folder to a live inode whose names went
    dirty: list[tuple[int, int]] = field(default_factory=list)  # written since the last sync
    last_write: tuple[int, bytes] | None = None  # for --torn
    lock: threading.Lock = field(default_factory=threading.Lock)
    # folders: the durable listing once the folder changed (None: as it is in BACKING) and
    # the name changes since its last fsync (None: the name went)
    base: dict[str, int] | None = None
    pending: dict[str, int | None] = field(default_factory=dict)


@dataclass(eq=False)
class _Handle:
    node: _Node
    sync: bool  # opened with O_SYNC or O_DSYNC


class LazyOps:
    """The FUSE operations: passthrough to the backing folder, plus the durable state."""

    use_ns = True

    def __init__(self, backing: Path, state: Path, torn: bool, seed: int) -> None:
        self._root = str(backing)
        self._state = state
        self._rng = random.Random(seed) if torn else None
        self._names = threading.RLock()  # name operations and the id tables
        self._nodes: dict[int, _Node] = {}
        self._ino: dict[tuple[int, int], int] = {}
        self._handles: dict[int, _Handle] = {}
        self._next_id = 0
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._counting = threading.Lock()
        self.on_mount: Callable[[], None] | None = None
        self.reset()

    # -- the model ----------------------------------------------------------------------

    def reset(self) -> None:
        """Forget the history: what BACKING holds now is the durable state."""
        with self._names:
            for fd in self._handles:
                os.close(fd)
            self._handles.clear()
            self._nodes.clear()
            self._ino.clear()
            shutil.rmtree(self._state, ignore_errors=True)
            self._state.mkdir(parents=True)
            self._root_id = self._node_of(os.lstat(self._root), self._root).id

    def _p(self, path: str) -> str:
        return self._root + path if path != "/" else self._root

    def _new_node(self, kind: str, mode: int, key: tuple[int, int] | None) -> _Node:
        self._next_id += 1
        node = _Node(self._next_id, kind, stat.S_IMODE(mode))
        self._nodes[node.id] = node
        if key is not None:
            self._ino[key] = node.id
        return node

    def _node_of(self, st: os.stat_result, path: str | None) -> _Node:
        """The node of a backing inode; one not seen before is unchanged since mount."""
        key = (st.st_dev, st.st_ino)
        known = self._ino.get(key)
        if known is not None:
            return self._nodes[known]
        if stat.S_ISREG(st.st_mode):
            node = self._new_node("file", st.st_mode, key)
            node.live = True
        elif stat.S_ISDIR(st.st_mode):
            node = self._new_node("dir", st.st_mode, key)
        elif stat.S_ISLNK(st.st_mode) and path is not None:
            node = self._new_node("link", st.st_mode, key)
            node.target = os.readlink(path)
        else:
            node = self._new_node("other", st.st_mode, key)
        return node

    def _forget(self, st: os.stat_result) -> None:
        """The inode's last name went: its number may come back for a new file."""
        if stat.S_ISDIR(st.st_mode) or st.st_nlink <= 1:
            self._ino.pop((st.st_dev, st.st_ino), None)

    def _folder(self, path: str) -> tuple[_Node, str]:
        """The parent folder of a mount path, its durable listing recorded, and the name."""
        parent, name = os.path.split(path)
        node = self._node_of(os.lstat(self._p(parent)), None)
        self._track(node, self._p(parent))
        return node, name

    def _track(self, folder: _Node, real: str) -> None:
        """Record a folder's durable listing before its first change since mount."""
        if folder.base is None:
            folder.base = {
                name: self._node_of(os.lstat(os.path.join(real, name)), os.path.join(real, name)).id
                for name in os.listdir(real)
            }

    def _set_aside(self, node: _Node, st: os.stat_result, real: str) -> None:
        """Keep a live inode reachable before its last name goes (it is durable content)."""
        if node.kind == "file" and node.live and node.aside is None and st.st_nlink <= 1:
            node.aside = str(self._state / f"aside-{node.id}")
            os.link(real, node.aside)

    def _copy_live(self, node: _Node, fd: int) -> None:
        """Before the first change to a file unchanged since mount: copy it, once."""
        with self._names:
            if not node.live:
                return
            data = str(self._state / f"data-{node.id}")
            out = os.open(data, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, node.mode | 0o600)
            try:
                _copy_range(fd, out, 0, os.fstat(fd).st_size)
            finally:
                os.close(out)
            node.live, node.data = False, data
            if node.aside is not None:
                os.unlink(node.aside)
                node.aside = None
            self._count("copies")

    def _sync(self, node: _Node, fd: int) -> None:
        """Make a file's data durable (node.lock held): copy the dirty ranges."""
        if not node.dirty:
            return
        size = os.fstat(fd).st_size
        if node.data is None:
            node.data = str(self._state / f"data-{node.id}")
        out = os.open(node.data, os.O_WRONLY | os.O_CREAT, node.mode | 0o600)
        try:
            os.ftruncate(out, size)
            for start, end in node.dirty:
                if start < min(end, size):
                    _copy_range(fd, out, start, min(end, size))
                    self._count("synced_bytes", min(end, size) - start)
        finally:
            os.close(out)
        node.dirty.clear()
        node.last_write = None

    def _count(self, name: str, n: int = 1) -> None:
        with self._counting:
            self.counters[name] += n

    def stats(self) -> dict[str, Any]:
        with self._names:
            nodes = list(self._nodes.values())
            return {
                **self.counters,
                "pending_files": sum(1 for n in nodes if n.dirty),
                "pending_names": sum(len(n.pending) for n in nodes),
                "durable_copies": sum(1 for n in nodes if n.data is not None),
                "open_handles": len(self._handles),
            }

    # -- the power cut ------------------------------------------------------------------

    def rebuild(self) -> None:
        """Replace BACKING by the durable state (nothing mounted, no handle in use)."""
        listings, paths = self._walk_live()
        out = self._state / "rebuild"
        out.mkdir()
        placed: dict[int, str] = {}
        seen = {self._root_id}
        todo = [(self._nodes[self._root_id], str(out))]
        while todo:
            folder, dest = todo.pop()
            listing = folder.base if folder.base is not None else listings.get(folder.id, {})
            for name, child_id in listing.items():
                node, target = self._nodes[child_id], os.path.join(dest, name)
                if node.kind == "dir" and node.id not in seen:  # a folder has one name
                    seen.add(node.id)
                    os.mkdir(target, node.mode)
                    todo.append((node, target))
                elif node.kind == "link":
                    os.symlink(node.target, target)
                elif node.kind == "file":
                    self._place(node, target, paths, placed)
        for entry in os.scandir(self._root):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        for entry in os.scandir(out):
            os.rename(entry.path, os.path.join(self._root, entry.name))
        self._count("cuts")
        self.reset()

    def _walk_live(self) -> tuple[dict[int, dict[str, int]], dict[int, str]]:
        """Each backing folder's listing by id, and one backing path of each id."""
        listings: dict[int, dict[str, int]] = {}
        paths: dict[int, str] = {}
        todo = [(self._root_id, self._root)]
        while todo:
            folder_id, real = todo.pop()
            listing = listings[folder_id] = {}
            for entry in os.scandir(real):
                node = self._node_of(entry.stat(follow_symlinks=False), entry.path)
                listing[entry.name] = node.id
                paths.setdefault(node.id, entry.path)
                if node.kind == "dir":
                    todo.append((node.id, entry.path))
        return listings, paths

    def _place(
        self, node: _Node, target: str, paths: dict[int, str], placed: dict[int, str]
    ) -> None:
        """Put a file's durable content at target (a second name of it becomes a link)."""
        if node.id in placed:
            os.link(placed[node.id], target)
            return
        source = (node.aside or paths.get(node.id)) if node.live else node.data
        if source is not None:
            os.rename(source, target)
        else:
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, node.mode))
        if self._rng is not None and node.last_write is not None:
            offset, data = node.last_write
            keep = self._rng.randint(0, len(data))
            fd = os.open(target, os.O_WRONLY)
            try:
                os.pwrite(fd, data[:keep], offset)
            finally:
                os.close(fd)
        placed[node.id] = target

    # -- FUSE operations: metadata --------------------------------------------------------

    def init(self, path: str) -> None:
        if self.on_mount is not None:
            self.on_mount()

    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        if fh is not None and fh in self._handles:
            st = os.fstat(fh)
        elif path is None:
            raise OSError(errno.ENOENT, "unlinked")
        else:
            st = os.lstat(self._p(path))
        attrs = {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size")}
        attrs.update(st_rdev=st.st_rdev, st_blocks=st.st_blocks, st_blksize=st.st_blksize)
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return attrs

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._p(path))]

    def opendir(self, path: str) -> int:
        return 0

    def releasedir(self, path: str | None, fh: int) -> int:
        return 0

    def readlink(self, path: str) -> str:
        return os.readlink(self._p(path))

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._root)
        keys = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree")
        return {k: getattr(sv, k) for k in (*keys, "f_favail", "f_flag", "f_namemax")}

    def chmod(self, path: str | None, mode: int) -> int:
        os.chmod(self._p(self._named(path)), mode)
        return 0

    def chown(self, path: str | None, uid: int, gid: int) -> int:
        os.chown(self._p(self._named(path)), uid, gid, follow_symlinks=False)
        return 0

    def utimens(self, path: str | None, times: tuple[int, int] | None = None) -> int:
        real = self._p(self._named(path))
        if times is None:
            os.utime(real, follow_symlinks=False)
        else:
            os.utime(real, ns=times, follow_symlinks=False)
        return 0

    @staticmethod
    def _named(path: str | None) -> str:
        if path is None:  # an open file whose last name went
            raise OSError(errno.ENOENT, "unlinked")
        return path

    # -- FUSE operations: names -------------------------------------------------------------

    def create(self, path: str, mode: int, flags: int) -> int:
        with self._names:
            folder, name = self._folder(path)
            real = self._p(path)
            existed = os.path.lexists(real)
            fd = os.open(real, os.O_RDWR | os.O_CREAT | (flags & os.O_EXCL), mode)
            st = os.fstat(fd)
            if existed:
                node = self._node_of(st, real)
            else:
                node = self._new_node("file", st.st_mode, (st.st_dev, st.st_ino))
                folder.pending[name] = node.id
            self._handles[fd] = _Handle(node, bool(flags & os.O_DSYNC))
        if existed and flags & os.O_TRUNC:
            self.truncate(path, 0, fd)
        return fd

    def mknod(self, path: str, mode: int, dev: int) -> int:
        if not stat.S_ISREG(mode):
            raise OSError(errno.EOPNOTSUPP, "only regular files")
        self.release(path, self.create(path, stat.S_IMODE(mode), os.O_EXCL))
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        with self._names:
            folder, name = self._folder(path)
            os.mkdir(self._p(path), mode)
            st = os.lstat(self._p(path))
            node = self._new_node("dir", st.st_mode, (st.st_dev, st.st_ino))
            node.base = {}
            folder.pending[name] = node.id
        return 0

    def symlink(self, path: str, target: str) -> int:
        with self._names:
            folder, name = self._folder(path)
            os.symlink(target, self._p(path))
            st = os.lstat(self._p(path))
            node = self._new_node("link", st.st_mode, (st.st_dev, st.st_ino))
            node.target = target
            folder.pending[name] = node.id
        return 0

    def link(self, path: str, existing: str) -> int:
        with self._names:
            folder, name = self._folder(path)
            node = self._node_of(os.lstat(self._p(existing)), self._p(existing))
            os.link(self._p(existing), self._p(path))
            folder.pending[name] = node.id
        return 0

    def unlink(self, path: str) -> int:
        with self._names:
            folder, name = self._folder(path)
            real = self._p(path)
            st = os.lstat(real)
            self._set_aside(self._node_of(st, real), st, real)
            os.unlink(real)
            self._forget(st)
            folder.pending[name] = None
        return 0

    def rmdir(self, path: str) -> int:
        with self._names:
            folder, name = self._folder(path)
            real = self._p(path)
            st = os.lstat(real)
            self._track(self._node_of(st, real), real)
            os.rmdir(real)
            self._forget(st)
            folder.pending[name] = None
        return 0

    def rename(self, old: str, new: str, flags: int = 0) -> int:
        if flags:  # RENAME_NOREPLACE / RENAME_EXCHANGE are not modelled
            raise OSError(errno.EINVAL, "rename flags not supported")
        with self._names:
            src_folder, src_name = self._folder(old)
            dst_folder, dst_name = self._folder(new)
            real_old, real_new = self._p(old), self._p(new)
            st = os.lstat(real_old)
            node = self._node_of(st, real_old)
            try:
                replaced: os.stat_result | None = os.lstat(real_new)
            except FileNotFoundError:
                replaced = None
            if replaced is not None and os.path.samestat(replaced, st):
                os.rename(real_old, real_new)  # two names of one file: nothing happens
                return 0
            if replaced is not None:
                gone = self._node_of(replaced, real_new)
                if gone.kind == "dir":
                    self._track(gone, real_new)
                self._set_aside(gone, replaced, real_new)
            os.rename(real_old, real_new)
            if replaced is not None:
                self._forget(replaced)
            src_folder.pending[src_name] = None
            dst_folder.pending[dst_name] = node.id
        return 0

    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        self._count("fsyncdir")
        if path is None:
            return 0
        with self._names:
            folder = self._node_of(os.lstat(self._p(path)), None)
            if folder.base is not None:
                for name, child in folder.pending.items():
                    if child is None:
                        folder.base.pop(name, None)
                    else:
                        folder.base[name] = child
            folder.pending.clear()
        return 0

    # -- FUSE operations: data --------------------------------------------------------------

    def open(self, path: str, flags: int) -> int:
        backing = flags & ~(_NOT_BACKING | os.O_TRUNC)
        if flags & os.O_ACCMODE == os.O_WRONLY:  # a sync reads back what was written
            backing = backing & ~os.O_ACCMODE | os.O_RDWR
        with self._names:
            fd = os.open(self._p(path), backing)
            node = self._node_of(os.fstat(fd), None)
            self._handles[fd] = _Handle(node, bool(flags & os.O_DSYNC))
        if flags & os.O_TRUNC:
            self.truncate(path, 0, fd)
        return fd

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        handle = self._handles[fh]
        node = handle.node
        with node.lock:
            if node.live:
                self._copy_live(node, fh)
            n = os.pwrite(fh, data, offset)
            _add_range(node.dirty, offset, offset + n)
            if self._rng is not None:
                node.last_write = (offset, data[:n])
            self._count("writes")
            if handle.sync:
                self._count("dsync_writes")
                self._sync(node, fh)
        return n

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        if fh is None or fh not in self._handles:
            fh = self.open(self._named(path), os.O_WRONLY)
            try:
                return self.truncate(path, length, fh)
            finally:
                self.release(path, fh)
        node = self._handles[fh].node
        with node.lock:
            if node.live:
                self._copy_live(node, fh)
            size = os.fstat(fh).st_size
            os.ftruncate(fh, length)
            _add_range(node.dirty, min(size, length), _END)
        return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        self._count("fdatasync" if datasync else "fsync")
        node = self._handles[fh].node
        with node.lock:
            self._sync(node, fh)
        return 0

    def release(self, path: str | None, fh: int) -> int:
        with self._names:
            if self._handles.pop(fh, None) is not None:
                os.close(fh)
        return 0


def _fuse_class() -> type:
    """mfusepy's FUSE, passing what its libfuse 3 wrappers drop: ftruncate's handle and
    rename's flags (a RENAME_NOREPLACE must not replace silently)."""
    import mfusepy

    class _FUSE(mfusepy.FUSE):  # type: ignore[misc]
        def truncate_fuse_3(self, path: bytes | None, length: int, fip: Any) -> int:
            fh = fip.contents.fh if fip else None
            name = None if path is None else path.decode(self.encoding, self.errors)
            return int(self.operations.truncate(name, length, fh))

        def rename_fuse_3(self, old: bytes, new: bytes, flags: int) -> int:
            decode = self.encoding, self.errors
            return int(self.operations.rename(old.decode(*decode), new.decode(*decode), flags))

    return _FUSE


class _Daemon:
    """Mounts the operations in the main thread; a power cut unmounts, rebuilds, remounts."""

    def __init__(self, ops: LazyOps, mountpoint: str, allow_other: bool) -> None:
        self._ops = ops
        self._mountpoint = mountpoint
        self._allow_other = allow_other
        self.mounted = threading.Event()
        self._cut_lock = threading.Lock()
        self._cut_done = threading.Event()
        self._want_cut = False
        self._error: str | None = None
        ops.on_mount = self._on_mount

    def _on_mount(self) -> None:
        self.mounted.set()
        if self._want_cut:
            self._want_cut = False
            self._cut_done.set()

    def run(self) -> None:
        fuse = _fuse_class()
        # multithreaded (no -s); hard_remove: an unlink is an unlink, not a rename to
        # .fuse_hidden; no direct_io, so shared writable mmap (SQLite's -shm) works;
        # max_idle_threads quiets libfuse 3.14's "invalid max threads" line
        options: dict[str, Any] = {"foreground": True, "hard_remove": True, "max_idle_threads": 8}
        if self._allow_other:
            options["allow_other"] = True
        while True:
            try:
                try:
                    fuse(self._ops, self._mountpoint, fsname="lazyfs", **options)
                except RuntimeError:  # libfuse's 8: the loop ended on a signal (SIGTERM)
                    if not self.mounted.is_set():  # it never mounted
                        raise
                self.mounted.clear()
                if not self._want_cut:
                    return
                self._ops.rebuild()
            except BaseException as exc:
                self._error = f"{type(exc).__name__}: {exc}"
                self._cut_done.set()
                raise

    def cut(self) -> str:
        with self._cut_lock:
            if not self.mounted.is_set():
                return "error: not mounted"
            self._cut_done.clear()
            self._want_cut = True
            done = subprocess.run(["fusermount3", "-u", self._mountpoint], capture_output=True)
            if done.returncode != 0:  # still in use: end the loop, libfuse detaches the mount
                log.warning("fusermount3 -u: %s", done.stderr.decode(errors="replace").strip())
                main = threading.main_thread().ident
                assert main is not None
                signal.pthread_kill(main, signal.SIGTERM)
            if not self._cut_done.wait(300):
                return "error: the cut timed out"
            return "ok" if self._error is None else f"error: {self._error}"

    def command(self, line: str) -> str:
        if line == "cut":
            return self.cut()
        if line == "stats":
            return json.dumps({"mounted": self.mounted.is_set(), **self._ops.stats()})
        if line == "ping":
            return "ok"
        return f"error: unknown command {line!r}"


class _ControlHandler(socketserver.StreamRequestHandler):
    """The control socket: one command a line, one answer a line."""

    def handle(self) -> None:
        daemon: _Daemon = self.server.lazyfs  # type: ignore[attr-defined]
        for line in self.rfile:
            try:
                reply = daemon.command(line.decode().strip())
            except Exception as exc:
                log.exception("control command failed")
                reply = f"error: {type(exc).__name__}: {exc}"
            self.wfile.write(reply.encode() + b"\n")


def _serve_control(server: socketserver.BaseServer) -> None:
    # signals go to the main thread, where libfuse's handler ends the FUSE loop
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    server.serve_forever()


_REPO = Path(__file__).resolve().parent.parent


class LazyFS:
    """The lazy filesystem in a subprocess, for tests and harnesses.

    Parameters
    ----------
    backing
        The folder that holds the files (its content at mount is the durable state).
    mount
        An empty folder to mount on.
    torn
        At a cut, each file's last unsynced write comes back as a random prefix.
    seed
        Seed of the ``torn`` prefixes.

    Examples
    --------
    >>> with LazyFS(backing, mount) as fs:  # doctest: +SKIP
    ...     ...  # use mount, SIGKILL whatever uses it, then
    ...     fs.cut()
    """

    def __init__(self, backing: Path, mount: Path, *, torn: bool = False, seed: int = 0) -> None:
        self.backing = Path(backing).resolve()
        self.mount = Path(mount).resolve()
        self._torn = torn
        self._seed = seed
        self._work: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def control(self) -> Path:
        """The control socket's path (in a private temporary folder)."""
        if self._work is None:
            raise RuntimeError("LazyFS not started")
        return self._work / "control"

    def start(self, timeout: float = 20.0) -> LazyFS:
        """Mount in a subprocess and return once the mount answers (BACKING and MOUNTPOINT
        are created when missing)."""
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mount.mkdir(parents=True, exist_ok=True)
        self._work = Path(tempfile.mkdtemp(prefix="lazyfs-"))
        cmd = [sys.executable, "-m", "scripts.lazyfs", str(self.backing), str(self.mount)]
        cmd += ["--control", str(self.control), "--seed", str(self._seed)]
        cmd += ["--torn"] if self._torn else []
        with open(self._work / "log", "wb") as log_file:
            self._proc = subprocess.Popen(
                cmd, cwd=_REPO, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                if self.stats()["mounted"]:
                    return self
            except OSError:
                pass
            time.sleep(0.02)
        text = self.log()
        self.stop()
        raise RuntimeError(f"lazyfs did not mount {self.mount}:\n{text}")

    def log(self) -> str:
        """What the subprocess wrote to stdout and stderr."""
        if self._work is None or not (self._work / "log").exists():
            return ""
        return (self._work / "log").read_text(errors="replace")

    def _request(self, command: str, timeout: float) -> str:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(self.control))
            sock.sendall(command.encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError(f"lazyfs closed the control socket after {command!r}")
                reply += chunk
        return reply.decode().strip()

    def cut(self, timeout: float = 300.0) -> None:
        """The power cut: BACKING becomes the durable state; the mount works again after."""
        reply = self._request("cut", timeout)
        if reply != "ok":
            raise RuntimeError(f"lazyfs cut: {reply}\n{self.log()}")

    def stats(self) -> dict[str, Any]:
        """The counters: syncs seen, pending unsynced files and names, cuts, mounted."""
        result: dict[str, Any] = json.loads(self._request("stats", 10.0))
        return result

    def stop(self) -> None:
        """Unmount (lazily) and end the subprocess."""
        if self._proc is not None:
            subprocess.run(["fusermount3", "-u", "-z", str(self.mount)], capture_output=True)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
                subprocess.run(["fusermount3", "-u", "-z", str(self.mount)], capture_output=True)
            self._proc = None
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    def __enter__(self) -> LazyFS:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("backing", type=Path, help="the folder that holds the files")
    parser.add_argument("mountpoint", type=Path)
    parser.add_argument("--control", required=True, help="path of the control Unix socket")
    parser.add_argument("--torn", action="store_true", help="keep a prefix of the last write")
    parser.add_argument("--seed", type=int, default=0, help="seed of the torn prefixes")
    parser.add_argument("--state", type=Path, help="folder for durable copies (default: new)")
    parser.add_argument("--allow-other", action="store_true", help="let other users in")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="lazyfs %(levelname)s %(message)s")
    backing = args.backing.resolve()
    # beside BACKING by default: the cut moves copies into it with rename
    state = args.state or Path(tempfile.mkdtemp(prefix=".lazyfs-state-", dir=backing.parent))
    ops = LazyOps(backing, state.resolve(), args.torn, args.seed)
    daemon = _Daemon(ops, str(args.mountpoint.resolve()), args.allow_other)
    Path(args.control).unlink(missing_ok=True)
    control = socketserver.ThreadingUnixStreamServer(args.control, _ControlHandler)
    control.daemon_threads = True
    control.lazyfs = daemon  # type: ignore[attr-defined]
    threading.Thread(target=_serve_control, args=(control,), daemon=True).start()
    try:
        daemon.run()
    finally:
        control.server_close()
        Path(args.control).unlink(missing_ok=True)
        shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
