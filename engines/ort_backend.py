"""The ONNX Runtime backend: runs any manifest's model on the CPU (or another ORT provider).

Registered as ``"onnxruntime"`` in :mod:`segnode.engines.base`. Preprocessing follows the manifest
(``clip(HU) * scale + offset``), inference goes through
:func:`segnode.engines.sliding_window.sliding_window_segment` with NumPy arrays.

On the CPU the threads share the work by patch, not by operator: each thread runs whole
patches through the session with a single intra-op thread, and the sliding window hands over
one batch per thread at a time. A small, memory-bound graph such as the default "tissue"
model then keeps each core on its own patch, in its own cache, with no hand-over between
threads at every operator (see docs/performance.md). A model whose tile output is large
(:data:`PATCH_THREADS_MAX_TILE_BYTES`, a many-label 3-D U-Net) runs the other way: one tile
per run on ONNX Runtime's intra-op threads, without its CPU arena, each run writing into the
window's output array (issue 37: memory in proportion to one tile, not threads x batch).

A version-2 (trained) manifest loads one session per fold file
(:meth:`~segnode.engines.manifest.ModelManifest.model_files`); :meth:`OrtEngine.fold_predictors`
hands them to :func:`segnode.engines.trained.segment_trained` (NumPy in and out, patches split into
runs of the session's batch shared out over the same patch threads).
"""

from __future__ import annotations

import logging
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as _ort_state

from segnode.engines.base import (
    EngineError,
    HostArrays,
    PatchPredictor,
    host_volume,
    precision_of,
    usable_cores,
)
from segnode.engines.manifest import ModelManifest
from segnode.engines.sliding_window import OUTPUT_KINDS, segment_with_manifest

logger = logging.getLogger(__name__)

# ONNX Runtime raises pybind11 exception classes (Fail, NoSuchFile, InvalidProtobuf ...) that
# share no base class but Exception; collect them, plus the Python-side errors of its wrapper.
_ORT_ERRORS: tuple[type[Exception], ...] = tuple(
    obj for obj in vars(_ort_state).values() if isinstance(obj, type) and issubclass(obj, Exception)
) + (RuntimeError, ValueError, OSError)


_IR_VERSION = re.compile(r"Unsupported model IR version: (\d+), max supported IR version: (\d+)")


def load_problem(exc: BaseException) -> str:
    """ONNX Runtime's reason for refusing a model file; for an IR version newer than it reads
    (the file written by a newer onnx), that fact and the ways out, not its C++ trace."""
    found = _IR_VERSION.search(str(exc))
    if found is None:
        return str(exc)
    return (
        f"the file has ONNX IR version {found[1]}, and ONNX Runtime {ort.__version__} reads up "
        f"to {found[2]}: upgrade onnxruntime, or export the model again with an onnx release "
        f"that writes IR version {found[2]} or lower"
    )


class OrtEngine(HostArrays):
    """Segment CT volumes with ONNX Runtime.

    Parameters
    ----------
    threads
        CPU threads (default: one per core this process may use). With the CPU provider
        alone, each thread runs whole patches; with other providers they are ONNX Runtime's
        intra-op threads (default: its choice).
    providers
        Execution providers in order of preference (default ``["CPUExecutionProvider"]``).
    """

    name = "onnxruntime"

    def __init__(self, *, threads: int | None = None, providers: list[str] | None = None) -> None:
        if threads is not None and threads < 1:
            raise EngineError(f"onnxruntime: threads must be at least 1, got {threads}")
        self._threads = threads
        self._providers = list(providers) if providers else ["CPUExecutionProvider"]
        self._session: ort.InferenceSession | None = None
        self._manifest: ModelManifest | None = None
        self._run_batch = 1
        self._workers = 1
        self._pool: ThreadPoolExecutor | None = None
        self._folds: list[PatchPredictor] = []
        #: What the loaded model runs in: ``"int8"`` (its INT8 QDQ files, on the CPU) or
        #: ``"fp32"`` (:func:`segnode.engines.base.run_precision`).
        self.precision_used = ""

    @property
    def manifest(self) -> ModelManifest | None:
        """The loaded model's manifest, or ``None`` before :meth:`load`."""
        return self._manifest

    def load(self, manifest: ModelManifest) -> None:
        """Create the inference session for ``manifest``'s model and check its signature.

        Raises
        ------
        EngineError
            If the model file is missing or not a valid ONNX model, a provider is not
            available, or the model's inputs and outputs disagree with the manifest.
        """
        on_cpu = self._providers == ["CPUExecutionProvider"]
        # A model calibrated to INT8 runs its QDQ files on the CPU provider.
        units = manifest.model_files(int8=on_cpu) if manifest.is_trained else (manifest,)
        for unit in units:
            if not Path(unit.onnx_path).is_file():
                raise EngineError(f"model {manifest.name!r}: ONNX file {unit.onnx_path} not found")
        if manifest.output_kind not in OUTPUT_KINDS:
            raise EngineError(
                f"model {manifest.name!r}: output_kind must be one of {OUTPUT_KINDS}, "
                f"got {manifest.output_kind!r}"
            )
        available = ort.get_available_providers()
        missing = [p for p in self._providers if p not in available]
        if missing:
            raise EngineError(
                f"onnxruntime providers {missing} not available here; have {available}"
            )
        workers = 1
        large = tile_bytes(manifest) > PATCH_THREADS_MAX_TILE_BYTES
        if on_cpu and not large:
            workers = self._threads or usable_cores()
        options = ort.SessionOptions()
        # Idle pool threads (with one worker) sleep instead of spinning: on a small node the
        # spinning costs as much CPU as the model and slows the DICOM side.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if large:
            # No CPU arena (it keeps its peak reserved for the life of the session, and
            # grows with every concurrent run) and no memory pattern (one block sized for
            # every intermediate at once): each tensor is freed when its last reader has
            # run. docs/performance.md: not slower for a large model, a third of the peak;
            # a small one's many short runs are slower without them, and small.
            options.enable_cpu_mem_arena = False
            options.enable_mem_pattern = False
        if workers > 1:
            options.intra_op_num_threads = 1
            options.inter_op_num_threads = 1
        elif self._threads is not None or large:
            options.intra_op_num_threads = self._threads or usable_cores()
            options.inter_op_num_threads = 1
        sessions: list[tuple[ort.InferenceSession, ModelManifest, int, bool]] = []
        for unit in units:
            path = Path(unit.onnx_path)
            try:
                session = ort.InferenceSession(
                    str(path), sess_options=options, providers=self._providers
                )
            except _ORT_ERRORS as exc:
                raise EngineError(
                    f"model {manifest.name!r}: cannot load {path}: {load_problem(exc)}"
                ) from exc
            batch, fixed = _check_signature(session, unit)
            sessions.append((session, unit, batch, fixed))
        self.close()
        run_batch = min(batch for _, _, batch, _ in sessions)
        if large and not any(fixed for _, _, _, fixed in sessions):
            run_batch = 1  # a tile at a time: its output alone is large
        self._run_batch, self._workers = run_batch, workers
        if workers > 1:
            self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ort-patch")
        self._session = sessions[0][0]
        self._manifest = manifest
        self.precision_used = precision_of(units, "fp32")
        self._folds = [
            self._fold_predictor(session, unit, batch if fixed else None)
            for session, unit, batch, fixed in sessions
        ]
        logger.info(
            "loaded model %s %s (%s) on %s, patch %s, batch %d, %d patch thread(s)",
            manifest.name,
            manifest.version,
            ", ".join(Path(unit.onnx_path).name for unit in units),
            ",".join(sessions[0][0].get_providers()),
            "x".join(map(str, manifest.patch_size)),
            run_batch,
            workers,
        )

    def _fold_predictor(
        self, session: ort.InferenceSession, unit: ModelManifest, fixed_batch: int | None
    ) -> PatchPredictor:
        """The raw network of one fold file: float32 patches in, float32 scores out, split
        into runs of the engine's batch (in parallel on the patch threads); a model with a
        fixed batch axis gets its last run padded."""
        input_name, output_name = unit.input_name, unit.output_name
        run_batch, pool = self._run_batch, self._pool
        channels_and_patch = (unit.output_channels, *unit.patch_size)
        bind = self._providers == ["CPUExecutionProvider"] and all(
            o.type == "tensor(float)" for o in session.get_outputs() if o.name == output_name
        )

        def run(batch: npt.NDArray[np.float32], out: npt.NDArray[np.float32]) -> None:
            n = len(batch)
            feed = np.ascontiguousarray(batch, dtype=np.float32)
            try:
                if fixed_batch is not None and n < fixed_batch:
                    feed = np.concatenate(
                        [feed, np.zeros((fixed_batch - n, *feed.shape[1:]), feed.dtype)]
                    )
                    out[...] = session.run([output_name], {input_name: feed})[0][:n]
                elif bind:
                    # the session writes its output where the window reads it: no copy
                    binding = session.io_binding()
                    binding.bind_cpu_input(input_name, feed)
                    binding.bind_output(
                        output_name, "cpu", 0, np.float32, list(out.shape), out.ctypes.data
                    )
                    session.run_with_iobinding(binding)
                else:
                    out[...] = session.run([output_name], {input_name: feed})[0]
            except _ORT_ERRORS as exc:
                raise EngineError(f"model {unit.name!r}: inference failed: {exc}") from exc

        def predict(batch: Any) -> Any:
            # one output array, each run writing its part (no concatenation of run outputs)
            out = np.empty((len(batch), *channels_and_patch), dtype=np.float32)
            spans = [(i, min(len(batch), i + run_batch)) for i in range(0, len(batch), run_batch)]
            if pool is None or len(spans) == 1:
                for first, last in spans:
                    run(batch[first:last], out[first:last])
            else:
                for done in [pool.submit(run, batch[a:b], out[a:b]) for a, b in spans]:
                    done.result()
            return out

        return predict

    def fold_predictors(self) -> list[PatchPredictor]:
        """The loaded fold networks (:class:`segnode.engines.base.TrainedEngine`), NumPy in and out.

        Raises
        ------
        EngineError
            Before :meth:`load`.
        """
        if self._manifest is None:
            raise EngineError("onnxruntime: fold_predictors() called before load()")
        return list(self._folds)

    def window_batch(self) -> int:
        """Tiles per predictor call: one run of the session per patch thread."""
        return self._run_batch * self._workers

    def segment(self, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """Return the uint8 label map of a ``(z, y, x)`` volume in Hounsfield units.

        Raises
        ------
        EngineError
            If no model is loaded, the volume is not 3-D, or inference fails.
        """
        session, manifest = self._session, self._manifest
        if session is None or manifest is None:
            raise EngineError("onnxruntime: segment() called before load()")
        volume = host_volume(manifest, hu)
        input_name, output_name = manifest.input_name, manifest.output_name
        run_batch, pool = self._run_batch, self._pool

        def run(batch: npt.NDArray[np.float32]) -> Any:
            # Preprocessed per batch, on the thread that runs it (edge padding and clipping
            # commute): in parallel, and still in cache when the session reads it.
            feed = {input_name: preprocess(batch, manifest)}
            try:
                return session.run([output_name], feed)[0]
            except _ORT_ERRORS as exc:
                raise EngineError(f"model {manifest.name!r}: inference failed: {exc}") from exc

        def predict(batch: npt.NDArray[np.float32]) -> Any:
            if pool is None or len(batch) <= run_batch:
                return run(batch)
            chunks = [batch[i : i + run_batch] for i in range(0, len(batch), run_batch)]
            return np.concatenate(list(pool.map(run, chunks)))

        try:
            batch_size = run_batch * self._workers
            labels = segment_with_manifest(volume, predict, manifest, batch_size=batch_size)
        except ValueError as exc:
            raise EngineError(f"model {manifest.name!r}: {exc}") from exc
        result: npt.NDArray[np.uint8] = np.asarray(labels, dtype=np.uint8)
        return result

    def close(self) -> None:
        """Drop the session (ONNX Runtime frees its memory with it) and the patch threads."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._session = None
        self._manifest = None
        self._folds = []

    def __enter__(self) -> OrtEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


PATCH_THREADS_MAX_TILE_BYTES = 64 * 1024 * 1024
"""Output of one tile above which the CPU threads share each run by operator (ONNX
Runtime's intra-op threads, one tile per run) instead of running a patch each: a patch per
thread suits a small memory-bound model, but with a large output (a model of many labels and
a large patch: 0.74 GiB a tile for 118 labels and 112 x 128 x 112) it multiplies the memory
by the threads and the batch, and a large network parallelises well by operator
(docs/performance.md)."""


def tile_bytes(manifest: ModelManifest) -> int:
    """Bytes of one tile's float32 output (every part of a composite: the largest)."""
    units = [part.manifest for part in manifest.parts] if manifest.parts else [manifest]
    largest = 0
    for unit in units:
        voxels = 1
        for n in unit.patch_size:
            voxels *= int(n)
        largest = max(largest, 4 * voxels * unit.output_channels)
    return largest


def preprocess(hu: npt.NDArray[Any], manifest: ModelManifest) -> npt.NDArray[np.float32]:
    """Apply the manifest's preprocessing: ``clip(hu) * scale + offset`` as float32."""
    x = np.empty(np.shape(hu), dtype=np.float32)
    if manifest.clip is not None:
        np.clip(hu, manifest.clip[0], manifest.clip[1], out=x, casting="unsafe")
    else:
        x[...] = hu
    if manifest.scale != 1.0:
        x *= np.float32(manifest.scale)
    if manifest.offset != 0.0:
        x += np.float32(manifest.offset)
    return x


def _check_signature(session: ort.InferenceSession, manifest: ModelManifest) -> tuple[int, bool]:
    """Check the model's input and output against the manifest; return the batch size and
    whether the model's batch axis is fixed."""
    where = f"model {manifest.name!r}"
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    manifest.check_tensors(where, inputs, outputs)
    in_shape = list(inputs[manifest.input_name].shape)
    out_shape = list(outputs[manifest.output_name].shape)
    want_in = [None, 1, *manifest.patch_size]
    want_out = [None, manifest.output_channels]
    want_out += manifest.patch_size
    for label, shape, want in (("input", in_shape, want_in), ("output", out_shape, want_out)):
        if len(shape) != 5 or any(
            isinstance(got, int) and w is not None and got != w
            for got, w in zip(shape, want, strict=True)
        ):
            raise EngineError(
                f"{where}: {label} shape {shape} does not match the manifest "
                f"(N, {want[1]}, {', '.join(map(str, manifest.patch_size))})"
            )
    batch = in_shape[0]
    if isinstance(batch, int):
        return batch, True
    return max(1, manifest.batch_opt), False
