"""A model's engine in a process of its own (``[engine] model_process = true``).

The node is one Python process: the threads that receive instances, encode results and send
them share one interpreter lock with the thread that drives the model. On a fast GPU the
model's thread spends much of a burst waiting for that lock while the GPU idles
(docs/performance.md, "A burst on the GPU"). :class:`ProcessEngine` runs any backend
(:func:`segnode.engines.base.create_engine`) in a child process started with
``python -m segnode.engines.model_process``, which has its own interpreter lock:

* The volume goes to the child, and the label map comes back, through files in
  ``/dev/shm`` (shared memory) that both processes map; only the request, the geometry and
  the per-label sums travel through the socket between them (pickled,
  :mod:`multiprocessing.connection` framing).
* Several jobs may run in the child at once (the gate's model slots), each on a thread of its
  own; the child says whether a job ran beside another, so that a backend's memory peak of a
  job alone (:class:`~segnode.engines.base.SlotEngine`) stays that of a job alone.
* A job's error in the child (a geometry the model cannot take, out of GPU memory) is raised
  again in the node with its type and message. A child that dies (killed, out of memory,
  a crash in native code) fails only the jobs it was running, with that reason; the next job
  starts a new child, which loads the model again. The node keeps serving either way.
* The child logs through the node (its records travel back over the socket) and exits when
  the node closes the socket, also when the node dies.

Every call that :mod:`segnode.node.pipeline.worker` makes on an engine has its counterpart
here: :meth:`ProcessEngine.segment_job` runs one job's model (version-1 or trained, the same
dispatch as in the node's own process, :func:`segment_volume`), :meth:`has_room` and
:meth:`job_scope` serve the model slots, :meth:`window_batch` and ``precision_used`` are the
child's answers after loading.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from segnode.engines.base import EngineError, LabelSums, SlotEngine, SumsEngine, create_engine

if TYPE_CHECKING:
    from segnode.engines.manifest import ModelManifest
    from segnode.engines.preprocess.orientation import Geometry

log = logging.getLogger(__name__)

#: Seconds the node waits for a child to load its model before it gives up.
LOAD_TIMEOUT_S = 1800.0
#: Seconds a closing child may take before it is killed.
CLOSE_TIMEOUT_S = 10.0
#: Files of the shared volumes and label maps start with this.
SHARED_PREFIX = "segnode-model-"


def segment_volume(
    engine: Any,
    manifest: ModelManifest,
    hu: npt.NDArray[np.float32],
    geometry: Geometry | None,
) -> tuple[npt.NDArray[np.uint8], LabelSums | None]:
    """One job's label map, and its per-label HU sums where the engine computes them.

    A version-2 (trained) model runs through
    :func:`segnode.engines.trained.segment_trained_with_sums` with ``geometry``; a version-1
    model through the engine's ``segment_with_sums`` (:class:`SumsEngine`) or ``segment``.
    A :class:`ProcessEngine` runs the same in its child.
    """
    if isinstance(engine, ProcessEngine):
        return engine.segment_job(hu, geometry)
    if manifest.is_trained:
        from segnode.engines.trained import segment_trained_with_sums

        if geometry is None:
            raise EngineError(f"model {manifest.name}: a trained model needs the geometry")
        return segment_trained_with_sums(engine, manifest, hu, geometry)
    if isinstance(engine, SumsEngine):
        return engine.segment_with_sums(hu)
    return engine.segment(hu), None


def shared_dir() -> Path:
    """Where the shared volumes live: ``/dev/shm`` where it is a writable folder, else the
    temporary folder (``SEGNODE_SHARED_DIR`` overrides both)."""
    configured = os.environ.get("SEGNODE_SHARED_DIR", "").strip()
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


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


def _shared_file(path: Path, nbytes: int) -> None:
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


@dataclass
class _Job:
    """One request in flight: its future, and the shared files it owns."""

    future: Future[Any]
    files: tuple[Path, ...] = ()


class ProcessEngine:
    """The engine of backend ``backend`` (constructed with ``options``) in a child process.

    Parameters
    ----------
    backend
        A name :func:`segnode.engines.base.create_engine` accepts.
    options
        The backend's constructor options (picklable).
    python
        The interpreter of the child (default: this one).
    """

    def __init__(
        self, backend: str, options: dict[str, Any] | None = None, *, python: str | None = None
    ) -> None:
        self.name = backend
        self.backend = backend
        self.options = dict(options or {})
        self.python = python or sys.executable
        self.precision_used = ""
        self.manifest: ModelManifest | None = None
        self._facts: dict[str, Any] = {}
        self._lock = threading.Lock()  # start, stop, the pending table
        self._send_lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._reader: threading.Thread | None = None
        self._pending: dict[int, _Job] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self.restarts = 0

    # -- the child's life ----------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The child's process id while it runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def load(self, manifest: ModelManifest) -> None:
        """Start the child and load ``manifest`` there; its load error is raised here."""
        self.manifest = manifest
        self._closed = False
        self._start()

    def _start(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                return
            if self.manifest is None:
                raise EngineError(f"{self.name}: no model loaded")
            sweep_stale()
            ours, theirs = socket.socketpair()
            env = dict(os.environ)
            env.setdefault("PYTHONUNBUFFERED", "1")
            try:
                proc = subprocess.Popen(
                    [self.python, "-m", "segnode.engines.model_process", str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),),
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
            except OSError as exc:
                ours.close()
                theirs.close()
                raise EngineError(f"{self.name}: cannot start the model process: {exc}") from exc
            theirs.close()
            conn = Connection(ours.detach())
            self._proc, self._conn, self._pending = proc, conn, {}
            reader = threading.Thread(
                target=self._read, args=(proc, conn), name="segnode-model-reader", daemon=True
            )
            self._reader = reader
            reader.start()
        started = time.monotonic()
        try:
            facts = self._call(("load", self.backend, self.options, self.manifest), LOAD_TIMEOUT_S)
        except BaseException:
            self.close()  # a child without its model serves nothing: it leaves now
            raise
        self._facts = dict(facts)
        self.precision_used = str(self._facts.get("precision_used", ""))
        log.info(
            "model process %d: %s loaded %s in %.1f s",
            proc.pid,
            self.backend,
            self.manifest.name,
            time.monotonic() - started,
        )

    def close(self) -> None:
        """Ask the child to close its engine and exit; kill it when it does not in time."""
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
            log.warning("model process %d did not exit in time: killed", proc.pid)
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
                kind = message[0]
                if kind == "log":
                    _, level, name, text = message
                    logging.getLogger(name).log(level, "model process %d: %s", proc.pid, text)
                    continue
                _, request, ok, value = message
                with self._lock:
                    job = self._pending.pop(request, None)
                if job is None:
                    continue
                for path in job.files[:1]:  # the volume; the label map is the caller's
                    path.unlink(missing_ok=True)
                if ok:
                    job.future.set_result(value)
                else:
                    job.future.set_exception(value)
        finally:
            code = proc.wait()
            why = _exit_reason(code)
            with self._lock:
                pending, self._pending = self._pending, {}
                closing = self._closed
            for job in pending.values():
                for path in job.files:
                    path.unlink(missing_ok=True)
                job.future.set_exception(
                    EngineError(
                        f"the model process ({self.backend}) {why} while it ran this job; "
                        "the next job starts it again"
                    )
                )
            if not closing:
                log.error("model process %d (%s) %s", proc.pid, self.backend, why)

    def _call(
        self, message: tuple[Any, ...], timeout: float | None = None, files: tuple[Path, ...] = ()
    ) -> Any:
        future: Future[Any] = Future()
        with self._lock:
            conn, proc = self._conn, self._proc
            if conn is None or proc is None or proc.poll() is not None:
                for path in files:
                    path.unlink(missing_ok=True)
                raise EngineError(f"the model process ({self.backend}) is not running")
            request = next(self._ids)
            self._pending[request] = _Job(future, files)
        try:
            with self._send_lock:
                conn.send((message[0], request, *message[1:]))
        except (OSError, ValueError, pickle.PicklingError) as exc:
            with self._lock:
                self._pending.pop(request, None)
            for path in files:
                path.unlink(missing_ok=True)
            raise EngineError(f"the model process ({self.backend}): cannot send: {exc}") from exc
        try:
            return future.result(timeout)
        except TimeoutError as exc:
            raise EngineError(
                f"the model process ({self.backend}) did not answer in {timeout:.0f} s"
            ) from exc

    def _ensure_running(self) -> None:
        if self._closed:
            raise EngineError(f"the model process ({self.backend}) is closed")
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return
        self.restarts += 1
        log.warning("starting the model process (%s) again", self.backend)
        self._start()

    # -- what the worker calls -----------------------------------------------------------

    def segment_job(
        self, hu: npt.NDArray[np.float32], geometry: Geometry | None = None
    ) -> tuple[npt.NDArray[np.uint8], LabelSums | None]:
        """One job's label map (and the sums, where the backend computes them), run in the
        child: :func:`segment_volume` there."""
        volume = np.ascontiguousarray(hu, dtype=np.float32)
        if volume.ndim != 3 or volume.size == 0:
            raise EngineError(f"expected a non-empty (z, y, x) volume, got shape {volume.shape}")
        self._ensure_running()
        folder = shared_dir()
        token = f"{SHARED_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        src, dst = folder / f"{token}.hu", folder / f"{token}.labels"
        try:
            _shared_file(src, volume.nbytes)
            _shared_file(dst, volume.size)
        except OSError as exc:
            src.unlink(missing_ok=True)
            raise EngineError(
                f"no room in {folder} for a {volume.nbytes / 2**20:.0f} MiB volume and its "
                f"label map for the model process: {exc}"
            ) from exc
        try:
            shared = np.memmap(src, dtype=np.float32, mode="r+", shape=volume.shape)
            np.copyto(shared, volume)
            del shared
            sums = self._call(("job", str(src), str(dst), volume.shape, geometry), files=(src, dst))
            labels = np.asarray(np.memmap(dst, dtype=np.uint8, mode="r+", shape=volume.shape))
        finally:
            src.unlink(missing_ok=True)
            dst.unlink(missing_ok=True)  # the mapping stays until the labels are freed
        return labels, sums

    def segment(self, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """The label map of a version-1 model (:meth:`segment_job`)."""
        return self.segment_job(hu)[0]

    def segment_with_sums(
        self, hu: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.uint8], LabelSums | None]:
        """The label map and the sums where the backend computes them (else None)."""
        return self.segment_job(hu)

    def has_room(self) -> bool:
        """The child's backend's answer (:meth:`SlotEngine.has_room`); False where it has no
        slots or is not running."""
        if not self._facts.get("slots") or self.pid is None:
            return False
        try:
            return bool(self._call(("room",), 30.0))
        except EngineError:
            return False

    def job_scope(self, shared: Callable[[], bool]) -> AbstractContextManager[None]:
        """Nothing in the node: the child runs each job in its backend's scope and itself
        tells whether another job ran beside it."""
        return contextlib.nullcontext()

    def window_batch(self) -> int:
        """The child's backend's tiles per call (1 where it has none)."""
        return int(self._facts.get("window_batch") or 1)


def _exit_reason(code: int) -> str:
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


def _portable(exc: BaseException) -> BaseException:
    """``exc`` itself where it survives pickling, else an EngineError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return EngineError(f"{type(exc).__name__}: {exc}")
    return exc


class _Child:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.send_lock = threading.Lock()
        self.engine: Any = None
        self.manifest: Any = None
        self.running: dict[int, bool] = {}  # request -> ran beside another
        self.running_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="segnode-model-job")

    def send(self, message: tuple[Any, ...]) -> None:
        with self.send_lock:
            self.conn.send(message)

    def answer(self, request: int, ok: bool, value: Any) -> None:
        try:
            self.send(("answer", request, ok, value if ok else _portable(value)))
        except (OSError, ValueError):
            os._exit(0)  # the node is gone

    def load(self, request: int, backend: str, options: dict[str, Any], manifest: Any) -> None:
        try:
            engine = create_engine(backend, **options)
            engine.load(manifest)
        except BaseException as exc:
            self.answer(request, False, exc)
            return
        self.engine, self.manifest = engine, manifest
        batch = getattr(engine, "window_batch", None)
        self.answer(
            request,
            True,
            {
                "precision_used": str(getattr(engine, "precision_used", "") or ""),
                "window_batch": int(batch()) if callable(batch) else 1,
                "slots": isinstance(engine, SlotEngine),
            },
        )

    def job(self, request: int, src: str, dst: str, shape: tuple[int, ...], geometry: Any) -> None:
        if self.engine is None:
            self.answer(request, False, EngineError("the model process has no model loaded"))
            return
        with self.running_lock:
            beside = bool(self.running)
            for other in self.running:
                self.running[other] = True
            self.running[request] = beside
        try:
            hu = np.memmap(src, dtype=np.float32, mode="c", shape=shape)
            scope = (
                self.engine.job_scope(lambda: self.running[request])
                if isinstance(self.engine, SlotEngine)
                else contextlib.nullcontext()
            )
            with scope:
                labels, sums = segment_volume(self.engine, self.manifest, hu, geometry)
            labels = np.asarray(labels)
            if labels.shape != tuple(shape):
                raise EngineError(
                    f"the model gave a label map of shape {labels.shape} for a volume of "
                    f"shape {tuple(shape)}"
                )
            out = np.memmap(dst, dtype=np.uint8, mode="r+", shape=shape)
            np.copyto(out, labels, casting="unsafe")
            del out, hu
        except BaseException as exc:
            self.answer(request, False, exc)
        else:
            self.answer(request, True, sums)
        finally:
            with self.running_lock:
                self.running.pop(request, None)

    def room(self, request: int) -> None:
        try:
            value = bool(self.engine is not None and self.engine.has_room())
        except Exception:
            value = False
        self.answer(request, True, value)

    def serve(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                os._exit(0)  # the node is gone (or closed the socket): leave at once
            kind = message[0]
            if kind == "close":
                break
            if kind == "load":
                self.load(*message[1:])
            elif kind == "job":
                self.pool.submit(self.job, *message[1:])
            elif kind == "room":
                self.room(message[1])
        self.pool.shutdown(wait=True)
        if self.engine is not None:
            with contextlib.suppress(Exception):
                self.engine.close()


def main(argv: list[str] | None = None) -> None:
    """The child: ``python -m segnode.engines.model_process FD`` (FD: its socket)."""
    args = sys.argv[1:] if argv is None else argv
    conn = Connection(int(args[0]))
    child = _Child(conn)
    root = logging.getLogger()
    root.handlers[:] = [_Forward(child.send)]
    root.setLevel(logging.INFO)
    # The node decides when its model process stops (Ctrl-C reaches the whole process group;
    # systemd's KillMode=mixed sends SIGTERM to the node alone): it closes the socket, or
    # dies, and this process leaves at once. SIGKILL still ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child.serve()


__all__ = ["ProcessEngine", "segment_volume", "shared_dir", "sweep_stale"]

if __name__ == "__main__":
    main()
