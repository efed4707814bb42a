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
  :mod:`multiprocessing.connection` framing). The files are kept, mapped on both sides,
  for the next jobs (:class:`~segnode.engines.child_process.SharedPool`): a volume costs a
  memory copy, not a page fault per page; a label map's file goes back when the worker lets
  go of it.
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
import logging
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from segnode.engines.base import EngineError, LabelSums, SlotEngine, SumsEngine, create_engine
from segnode.engines.child_process import (
    SHARED_PREFIX,
    ChildProcess,
    ChildServer,
    SharedMaps,
    SharedPool,
    child_main,
    shared_dir,
    sweep_stale,
)

if TYPE_CHECKING:
    from segnode.engines.manifest import ModelManifest
    from segnode.engines.preprocess.orientation import Geometry

log = logging.getLogger(__name__)

#: Seconds the node waits for a child to load its model before it gives up.
LOAD_TIMEOUT_S = 1800.0


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


class ProcessEngine(ChildProcess):
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
        super().__init__(
            "segnode.engines.model_process",
            f"the model process ({backend})",
            error=EngineError,
            python=python,
        )
        self.name = backend
        self.backend = backend
        self.options = dict(options or {})
        self.precision_used = ""
        self.manifest: ModelManifest | None = None
        self._facts: dict[str, Any] = {}
        self._volumes = SharedPool(".hu")
        self._labels = SharedPool(".labels")

    def load(self, manifest: ModelManifest) -> None:
        """Start the child and load ``manifest`` there; its load error is raised here."""
        self.manifest = manifest
        if self._closed:  # loaded again after close(): new pools
            self._volumes, self._labels = SharedPool(".hu"), SharedPool(".labels")
        self._closed = False
        self._start()

    def close(self) -> None:
        """End the child and remove the shared files (a label map still held stays
        readable: its mapping outlives its file)."""
        super().close()
        self._volumes.close()
        self._labels.close()

    @staticmethod
    def _no_room(volume: npt.NDArray[np.float32], exc: OSError) -> EngineError:
        return EngineError(
            f"no room in {shared_dir()} for a {volume.nbytes / 2**20:.0f} MiB volume and its "
            f"label map for the model process: {exc}"
        )

    def _start(self) -> None:
        if self.manifest is None:
            raise EngineError(f"{self.name}: no model loaded")
        if not self._spawn():
            return
        started = time.monotonic()
        try:
            facts = self.call(("load", self.backend, self.options, self.manifest), LOAD_TIMEOUT_S)
        except BaseException:
            self.close()  # a child without its model serves nothing: it leaves now
            raise
        self._facts = dict(facts)
        self.precision_used = str(self._facts.get("precision_used", ""))
        log.info(
            "model process %s: %s loaded %s in %.1f s",
            self.pid,
            self.backend,
            self.manifest.name,
            time.monotonic() - started,
        )

    # -- what the worker calls -----------------------------------------------------------

    def segment_job(
        self, hu: npt.NDArray[np.float32], geometry: Geometry | None = None
    ) -> tuple[npt.NDArray[np.uint8], LabelSums | None]:
        """One job's label map (and the sums, where the backend computes them), run in the
        child: :func:`segment_volume` there."""
        volume = np.ascontiguousarray(hu, dtype=np.float32)
        if volume.ndim != 3 or volume.size == 0:
            raise EngineError(f"expected a non-empty (z, y, x) volume, got shape {volume.shape}")
        self.ensure_running(self._start)
        try:
            src = self._volumes.take(volume.nbytes)
        except OSError as exc:
            raise self._no_room(volume, exc) from exc
        try:
            try:
                dst = self._labels.take(volume.size)
            except OSError as exc:
                raise self._no_room(volume, exc) from exc
            try:
                np.copyto(src.array(volume.shape, np.float32), volume)
                sums = self.call(("job", str(src.path), str(dst.path), volume.shape, geometry))
            except BaseException:
                self._labels.give(dst)
                raise
        finally:
            self._volumes.give(src)  # answered (or the child is dead): no one writes it now
        labels = dst.array(volume.shape, np.uint8)
        # the file goes back to the pool when the worker lets go of the label map
        weakref.finalize(labels, self._labels.give, dst)
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
            return bool(self.call(("room",), 30.0))
        except EngineError:
            return False

    def job_scope(self, shared: Callable[[], bool]) -> AbstractContextManager[None]:
        """Nothing in the node: the child runs each job in its backend's scope and itself
        tells whether another job ran beside it."""
        return contextlib.nullcontext()

    def window_batch(self) -> int:
        """The child's backend's tiles per call (1 where it has none)."""
        return int(self._facts.get("window_batch") or 1)


# -- the child -------------------------------------------------------------------------------


class _Child:
    def __init__(self, conn: Connection) -> None:
        self.server = ChildServer(
            conn,
            {"load": (self.load, False), "job": (self.job, True), "room": (self.room, False)},
            error=EngineError,
        )
        self.server.on_close = self.close
        self.answer = self.server.answer
        self.engine: Any = None
        self.manifest: Any = None
        self.running: dict[int, bool] = {}  # request -> ran beside another
        self.running_lock = threading.Lock()
        self.maps = SharedMaps()

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
            hu = self.maps.array(src, shape, np.float32)
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
            out = self.maps.array(dst, shape, np.uint8)
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

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def main(argv: list[str] | None = None) -> None:
    """The child: ``python -m segnode.engines.model_process FD`` (FD: its socket)."""
    child_main(argv, lambda conn: _Child(conn).server)


__all__ = ["SHARED_PREFIX", "ProcessEngine", "segment_volume", "shared_dir", "sweep_stale"]

if __name__ == "__main__":
    main()
