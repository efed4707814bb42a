"""A helper process of the node, and the node's end of its socket.

The node is one Python process; work that holds the interpreter lock for long, or in many
short stretches, slows every other thread of it (receiving, sending, driving the GPU). Such
work runs in a child started as ``python -m MODULE FD``, connected to the node by a
socketpair (pickled messages, :mod:`multiprocessing.connection` framing). Two use it: a
model's engine (:mod:`segnode.engines.model_process`) and the SEG encoders
(:mod:`segnode.node.results.encode_process`).

The node's end, :class:`ChildProcess`:

* starts the child, and again on the next request after the child died (:attr:`restarts`);
* sends requests and waits for their answers; a request's error in the child is raised
  again in the node with its type and message;
* when the child dies, fails every request in flight with the reason ("was killed by
  SIGKILL while it ran this job");
* writes the child's log records to the node's log, as ``PROCESS PID: message``.

The child's end, :class:`ChildServer`: reads requests, runs each (on a thread of its own
where the handler says so) and answers; forwards its log records; ignores SIGINT and
SIGTERM (the node decides when it stops) and exits when the node closes the socket, or dies.

Data too large for the socket (volumes, label maps) travels through files in ``/dev/shm``
that both processes map and keep between requests (:class:`SharedPool` on the node's side,
:class:`SharedMaps` on the child's); their names start with :data:`SHARED_PREFIX` and the
node's process id, so that :func:`sweep_stale` can remove those of a node that was killed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)

#: Seconds a closing child may take before it is killed.
CLOSE_TIMEOUT_S = 10.0
#: Files shared with a child start with this, then the node's process id.
SHARED_PREFIX = "segnode-model-"


class ChildError(Exception):
    """The child could not be started, or died, or did not answer (see the message)."""


def shared_dir() -> Path:
    """Where the shared files live: ``/dev/shm`` where it is a writable folder, else the
    temporary folder (``SEGNODE_SHARED_DIR`` overrides both)."""
    configured = os.environ.get("SEGNODE_SHARED_DIR", "").strip()
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def shared_name(suffix: str) -> Path:
    """A new shared file's path (not created): :data:`SHARED_PREFIX`, this process' id,
    a random token and ``suffix``."""
    return shared_dir() / f"{SHARED_PREFIX}{os.getpid()}-{uuid.uuid4().hex}{suffix}"


def shared_file(path: Path, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` allocated (``posix_fallocate``: a full ``/dev/shm``
    fails here with ENOSPC rather than with SIGBUS when the mapping is written)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(1, nbytes))
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)


def sweep_stale(folder: Path | None = None) -> list[Path]:
    """Remove the shared files that a node which no longer runs left behind (killed in the
    middle of a job: ``/dev/shm`` is memory, and nothing else would free it). Files of a
    running process are kept. Returns those removed."""
    folder = shared_dir() if folder is None else folder
    removed: list[Path] = []
    try:
        entries = list(folder.glob(f"{SHARED_PREFIX}*"))
    except OSError:
        return removed
    for path in entries:
        owner = path.name[len(SHARED_PREFIX) :].split("-", 1)[0]
        if not owner.isdigit():
            continue
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
        except OSError:  # another user's process, still running
            continue
    if removed:
        log.info("removed %d shared file(s) of a node that no longer runs", len(removed))
    return removed


class SharedBuffer:
    """One shared file of a :class:`SharedPool`, mapped in this process (``capacity`` bytes
    at ``path``)."""

    __slots__ = ("capacity", "path", "_map")

    def __init__(self, path: Path, capacity: int) -> None:
        self.path = path
        self.capacity = capacity
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, max(1, capacity))
        finally:
            os.close(fd)

    def array(self, shape: tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        """A new array over the first bytes of the file (its own object, so that a
        ``weakref.finalize`` on it is this use's alone)."""
        return np.ndarray(shape, dtype=dtype, buffer=self._map)


class SharedPool:
    """Shared files kept between jobs, each mapped once here and (:class:`SharedMaps`) in
    the child.

    A new file costs a page fault per page on both sides when it is first written and read;
    one used before costs the copy alone (a 300 x 512 x 512 float32 volume on a 2-core AMD
    EPYC: 0.24-0.35 s into a new file against 0.025 s into a used one; the child's first
    read 0.07-0.09 s against 0.027 s; docs/performance.md). At most ``keep`` files wait
    unused (the oldest beyond that are removed); a file is reused for any request it holds
    that needs at least half of it.
    """

    def __init__(self, suffix: str, keep: int = 2) -> None:
        self.suffix = suffix
        self.keep = keep
        self._idle: list[SharedBuffer] = []
        self._files: set[Path] = set()  # idle and in use
        self._lock = threading.Lock()
        self._closed = False

    def take(self, nbytes: int) -> SharedBuffer:
        """A file of at least ``nbytes``: an idle one, else a new one.

        Raises
        ------
        OSError
            No room for a new file (ENOSPC), or it cannot be created or mapped.
        """
        with self._lock:
            fits = [b for b in self._idle if nbytes <= b.capacity <= 2 * max(nbytes, 1)]
            if fits:
                best = min(fits, key=lambda b: b.capacity)
                self._idle.remove(best)
                return best
            if self._closed:
                raise OSError(f"the shared files {self.suffix} are closed")
        path = shared_name(self.suffix)
        shared_file(path, nbytes)
        try:
            buffer = SharedBuffer(path, nbytes)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        with self._lock:
            self._files.add(path)
        return buffer

    def give(self, buffer: SharedBuffer) -> None:
        """Back to the idle files (or removed, once closed or beyond ``keep``)."""
        with self._lock:
            if not self._closed and self.keep > 0:
                self._idle.append(buffer)
                drop = self._idle[: -self.keep]
                self._idle = self._idle[-self.keep :]
            else:
                drop = [buffer]
            self._files.difference_update(old.path for old in drop)
        for old in drop:  # the mapping goes when the last array over it does
            old.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Remove every file, idle or in use (a mapping stays valid without its file: a
        label map still held keeps its memory until it is let go)."""
        with self._lock:
            self._closed = True
            files, self._files, self._idle = self._files, set(), []
        for path in files:
            path.unlink(missing_ok=True)


class SharedMaps:
    """The child's mappings of the node's shared files, kept between jobs: a file of a
    :class:`SharedPool` is mapped once (its pages faulted in once), not once per job. A
    mapping is dropped when its file is gone or replaced (another inode at that path)."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}
        self._lock = threading.Lock()

    def array(self, path: str, shape: tuple[int, ...], dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        """A writable array of ``shape`` and ``dtype`` over the start of the file at
        ``path`` (shared: what is written there, the node sees)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        with self._lock:
            for other in [p for p in self._maps if p != path and not os.path.exists(p)]:
                del self._maps[other]  # freed when the last array over it goes
            fd = os.open(path, os.O_RDWR)
            try:
                inode = os.fstat(fd).st_ino
                entry = self._maps.get(path)
                if entry is None or entry[0] != inode or len(entry[1]) < nbytes:
                    entry = (inode, mmap.mmap(fd, 0))
                    self._maps[path] = entry
            finally:
                os.close(fd)
            return np.ndarray(shape, dtype=dtype, buffer=entry[1])


class ChildProcess:
    """The node's end of a child ``python -m module FD``.

    Parameters
    ----------
    module
        The child's module; its ``main`` runs a :class:`ChildServer`.
    what
        How messages name the child, e.g. ``"the model process (torch)"``.
    error
        The exception type raised for a child that is not running, died or did not answer.
    python
        The interpreter of the child (default: this one).
    """

    def __init__(
        self,
        module: str,
        what: str,
        *,
        error: type[Exception] = ChildError,
        python: str | None = None,
    ) -> None:
        self.module = module
        self.what = what
        self.error = error
        self.python = python or sys.executable
        self._lock = threading.Lock()  # start, stop, the pending table
        self._send_lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._pending: dict[int, Future[Any]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        #: Times the child was started again after it died.
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def _spawn(self) -> bool:
        """Start the child unless it runs; True where it was started now."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return False
            sweep_stale()
            ours, theirs = socket.socketpair()
            env = dict(os.environ)
            env.setdefault("PYTHONUNBUFFERED", "1")
            try:
                proc = subprocess.Popen(
                    [self.python, "-m", self.module, str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
            except OSError as exc:
                ours.close()
                theirs.close()
                raise self.error(f"cannot start {self.what}: {exc}") from exc
            theirs.close()
            conn = Connection(ours.detach())
            self._proc, self._conn, self._pending = proc, conn, {}
            self._closed = False
            reader = threading.Thread(
                target=self._read, args=(proc, conn), name="segnode-child-reader", daemon=True
            )
            self._reader = reader
            reader.start()
        return True

    def close(self) -> None:
        """Ask the child to exit; kill it when it does not in time."""
        with self._lock:
            self._closed = True
            proc, conn = self._proc, self._conn
        if proc is None or conn is None:
            return
        with contextlib.suppress(OSError, ValueError), self._send_lock:
            conn.send(("close",))
        try:
            proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("%s (%d) did not exit in time: killed", self.what, proc.pid)
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            conn.close()
        if self._reader is not None:
            self._reader.join(5.0)

    def _read(self, proc: subprocess.Popen[bytes], conn: Connection) -> None:
        """The reader thread: answers to their requests, log records to the node's log; when
        the socket ends, every request still in flight fails with the child's exit."""
        try:
            while True:
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    break
                except Exception as exc:  # an answer that does not unpickle: whose is unknown
                    log.error(
                        "%s (%d) sent what cannot be read (%s): ended", self.what, proc.pid, exc
                    )
                    proc.kill()
                    break
                kind = message[0]
                if kind == "log":
                    _, level, name, text = message
                    logging.getLogger(name).log(level, "%s %d: %s", self.what, proc.pid, text)
                    continue
                _, request, ok, value = message
                with self._lock:
                    future = self._pending.pop(request, None)
                if future is None:
                    continue
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)
        finally:
            code = proc.wait()
            why = exit_reason(code)
            with self._lock:
                pending, self._pending = self._pending, {}
                closing = self._closed
            for future in pending.values():
                future.set_exception(
                    self.error(
                        f"{self.what} {why} while it ran this job; the next job starts it again"
                    )
                )
            if not closing:
                log.error("%s (%d) %s", self.what, proc.pid, why)

    def request(self, message: tuple[Any, ...]) -> Future[Any]:
        """Send ``(kind, *args)``; the future holds the child's answer (or its error, or
        the child's end)."""
        future: Future[Any] = Future()
        with self._lock:
            conn, proc = self._conn, self._proc
            if conn is None or proc is None or proc.poll() is not None:
                raise self.error(f"{self.what} is not running")
            request = next(self._ids)
            self._pending[request] = future
        try:
            with self._send_lock:
                conn.send((message[0], request, *message[1:]))
        except (OSError, ValueError, pickle.PicklingError) as exc:
            with self._lock:
                self._pending.pop(request, None)
            raise self.error(f"{self.what}: cannot send: {exc}") from exc
        return future

    def call(self, message: tuple[Any, ...], timeout: float | None = None) -> Any:
        """:meth:`request`, and wait for the answer (at most ``timeout`` seconds)."""
        future = self.request(message)
        try:
            return future.result(timeout)
        except TimeoutError as exc:
            raise self.error(f"{self.what} did not answer in {timeout:.0f} s") from exc

    def ensure_running(self, start: Callable[[], None]) -> None:
        """Call ``start`` (which starts the child) where the child is not running (a
        restart where it ran and died); raise where the child was closed."""
        if self._closed:
            raise self.error(f"{self.what} is closed")
        if self.pid is not None:
            return
        if self._proc is not None:  # it ran and died
            self.restarts += 1
            log.warning("starting %s again", self.what)
        start()


def exit_reason(code: int) -> str:
    """How a child with exit status ``code`` ended, in words."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


# -- the child -------------------------------------------------------------------------------


class _Forward(logging.Handler):
    """Log records of the child, sent to the node."""

    def __init__(self, send: Callable[[tuple[Any, ...]], None]) -> None:
        super().__init__(logging.DEBUG)
        self._send = send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            self._send(("log", record.levelno, record.name, text))
        except Exception:  # the socket is gone: nothing to log to
            pass


def portable(exc: BaseException, error: type[Exception] = ChildError) -> BaseException:
    """``exc`` itself where it survives pickling, else an ``error`` with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return error(f"{type(exc).__name__}: {exc}")
    return exc


class ChildServer:
    """The child's end: requests ``(kind, request, *args)`` go to ``handlers[kind]``.

    Parameters
    ----------
    conn
        The socket to the node.
    handlers
        ``{kind: (handler, threaded)}``; a handler takes ``(request, *args)`` and answers
        with :meth:`answer`. A threaded handler runs on the pool (several at once).
    threads
        The pool's threads.
    error
        The type an error that does not pickle is sent back as.
    """

    def __init__(
        self,
        conn: Connection,
        handlers: dict[str, tuple[Callable[..., None], bool]],
        *,
        threads: int = 4,
        error: type[Exception] = ChildError,
    ) -> None:
        self.conn = conn
        self.handlers = handlers
        self.error = error
        self.send_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="segnode-child-job")
        #: Called once after the node asked the child to close and its jobs ended.
        self.on_close: Callable[[], None] | None = None

    def send(self, message: tuple[Any, ...]) -> None:
        """Send ``message`` to the node (from any thread)."""
        with self.send_lock:
            self.conn.send(message)

    def answer(self, request: int, ok: bool, value: Any) -> None:
        """Send request ``request``'s result (``ok``) or its error."""
        try:
            self.send(("answer", request, ok, value if ok else portable(value, self.error)))
        except (OSError, ValueError):
            os._exit(0)  # the node is gone

    def serve(self) -> None:
        """Answer requests until the node says close (or closes the socket: exit at once)."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the node is gone (or closed the socket): leave at once
            kind = message[0]
            if kind == "close":
                break
            handler, threaded = self.handlers[kind]
            if threaded:
                self.pool.submit(self._guarded, handler, message[1], message[2:])
            else:
                self._guarded(handler, message[1], message[2:])
        self.pool.shutdown(wait=True)
        if self.on_close is not None:
            with contextlib.suppress(Exception):
                self.on_close()

    def _guarded(self, handler: Callable[..., None], request: int, args: tuple[Any, ...]) -> None:
        try:
            handler(request, *args)
        except BaseException as exc:  # a handler that did not answer its own error
            self.answer(request, False, exc)


def child_main(argv: list[str] | None, build: Callable[[Connection], ChildServer]) -> None:
    """A child's ``main``: ``python -m MODULE FD`` (FD: its socket); ``build`` makes its
    server."""
    args = sys.argv[1:] if argv is None else argv
    conn = Connection(int(args[0]))
    server = build(conn)
    root = logging.getLogger()
    root.handlers[:] = [_Forward(server.send)]
    root.setLevel(logging.INFO)
    # The node decides when its children stop (Ctrl-C reaches the whole process group;
    # systemd's KillMode=mixed sends SIGTERM to the node alone): it closes the socket, or
    # dies, and the child leaves at once. SIGKILL still ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server.serve()


__all__ = [
    "SHARED_PREFIX",
    "ChildError",
    "ChildProcess",
    "ChildServer",
    "SharedBuffer",
    "SharedMaps",
    "SharedPool",
    "child_main",
    "exit_reason",
    "portable",
    "shared_dir",
    "shared_file",
    "shared_name",
    "sweep_stale",
]
