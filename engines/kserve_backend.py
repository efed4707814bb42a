"""The remote backend: inference on a server speaking the KServe v2 (Open Inference) protocol.

Registered as ``"kserve"`` in :mod:`segnode.engines.base`. NVIDIA Triton, KServe's Python
model server and MLServer all answer the protocol, over HTTP (binary tensor extension) or
gRPC. The node keeps everything but the network: the volume, the preprocessing
(``clip(HU) * scale + offset``) and the sliding window
(:func:`segnode.engines.sliding_window.segment_with_manifest`) stay here, and each batch of
patches goes to the server as one binary FP32 tensor (FP16 with ``precision = "fp16"`` on a
model whose manifest allows it and whose remote input is FP16). The label maps are those of
the local ONNX Runtime engine run on the same ONNX file (``tests/test_kserve.py``).

:meth:`KServeEngine.load` checks that the server is live and ready, that every remote model is
ready, and that its metadata (input and output names, data types, shapes) fits the manifest:
the output of a ``"labels"`` model is an integer or floating-point type, that of a
``"logits"`` or ``"probabilities"`` model FP16, FP32 or FP64. An
:class:`~segnode.engines.base.EngineError` names what is wrong. Requests that fail for a
transient reason (connection refused, reset or closed before a reply, no reply within
``timeout_s``, HTTP 502/503/504, gRPC UNAVAILABLE or DEADLINE_EXCEEDED) are retried
``retries`` times with a short exponential backoff; after that the error ends the job as
failed with the reason, and a retried job runs again once the server is back.

A reply is a peer's claim and is checked before a value of it is used: the output's data
type must be the one the metadata declared, its shape exactly ``(N, C, patch)`` for the N
patches sent, its byte count that of the shape, floating-point values finite; labels outside
``0 .. classes - 1`` are refused by the sliding window before any cast narrows them. A
refused reply fails the job at once. Over HTTP the node speaks the protocol itself
(:mod:`segnode.engines.kserve_http`, on :mod:`http.client`, one connection per request):
every request has one deadline, ``timeout_s`` from its start, after which a watchdog shuts
the socket down however slowly the server trickles. An inference reply's JSON header (at
most :data:`~segnode.engines.kserve_http.HEADER_MARGIN` bytes) is read and checked first,
then exactly the bytes of the output it announces: a ``Content-Length`` that says otherwise
is refused before the body is read, a chunked reply that goes on is refused there. Metadata
is read up to :data:`~segnode.engines.kserve_http.JSON_CAP` bytes, an error's reason from
its first 64 KiB. gRPC goes through ``tritonclient``, whose ``client_timeout``
is a deadline and whose channel refuses messages larger than the largest reply expected.

A version-2 (trained) manifest runs one remote model per fold file, named ``<model>_fold<i>``
with ``i`` the file's index in
:meth:`~segnode.engines.manifest.ModelManifest.model_files` (``segnode engine export-triton``
writes the repository under these names); :meth:`KServeEngine.fold_predictors` hands them to
:func:`segnode.engines.trained.segment_trained`.

The engine keeps one gRPC client per thread (the node loads on one thread and segments on
another); HTTP requests share nothing but the engine's settings.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from segnode.engines.base import (
    EngineError,
    HostArrays,
    PatchPredictor,
    checked_precision,
    host_volume,
)
from segnode.engines.kserve_http import (
    DATATYPES,
    HEADER_MARGIN,
    JSON_CAP,
    Http,
    ReplyError,
    check_finite,
    check_output,
    describe,
    is_transient,
)
from segnode.engines.manifest import ModelManifest
from segnode.engines.ort_backend import preprocess
from segnode.engines.sliding_window import OUTPUT_KINDS, segment_with_manifest

logger = logging.getLogger(__name__)

PROTOCOLS = ("http", "grpc")
"""The transports :class:`KServeEngine` speaks."""

DEFAULT_BATCH_CAP = 8
"""Default patches per request: the manifest's ``batch.max``, at most this many."""

SCORE_TYPES = ("FP16", "FP32", "FP64")
"""Data types a ``"logits"`` or ``"probabilities"`` output may have."""

INTEGER_TYPES = ("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64")
"""The protocol's integer data types."""

LABEL_TYPES = INTEGER_TYPES + SCORE_TYPES
"""Data types a ``"labels"`` output may have."""

T = TypeVar("T")


def remote_model_names(manifest: ModelManifest, name: str | None = None) -> list[str]:
    """The remote models that serve ``manifest``: ``[name]`` for a version-1 model, one
    ``<name>_fold<i>`` per fold file of a version-2 model (``name`` defaults to the
    manifest's)."""
    base = name or manifest.name
    if not manifest.is_trained:
        return [base]
    return [f"{base}_fold{i}" for i in range(len(manifest.model_files()))]


def _grpc_module() -> Any:
    """``tritonclient.grpc``, imported here so that the node imports it only when this engine
    speaks gRPC."""
    try:
        import tritonclient.grpc as module
    except ImportError as exc:
        raise EngineError(
            f"engine 'kserve' needs tritonclient for gRPC ({exc}); pip install 'segnode[kserve]'"
        ) from exc
    return module


def _split_url(url: str, protocol: str) -> tuple[str, bool]:
    """``host:port`` and whether to use TLS, from ``http://``, ``https://``, ``grpc://``,
    ``grpcs://`` or a bare ``host:port``."""
    for scheme, tls in (("https://", True), ("grpcs://", True), ("http://", False)):
        if url.startswith(scheme):
            return url[len(scheme) :].rstrip("/"), tls
    if url.startswith("grpc://"):
        return url[len("grpc://") :].rstrip("/"), False
    if "://" in url:
        raise EngineError(f"kserve: url {url!r} must be http(s)://, grpc(s):// or host:port")
    return url.rstrip("/"), False


def _tensors(where: str, meta: Any, key: str) -> dict[str, dict[str, Any]]:
    """The ``inputs`` or ``outputs`` of a model's metadata by name.

    Raises
    ------
    EngineError
        If the metadata is not an object with a list of named tensors there.
    """
    items = meta.get(key, []) if isinstance(meta, dict) else None
    if not isinstance(items, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) for t in items
    ):
        raise EngineError(f"{where}: the metadata's {key!r} are not a list of named tensors")
    return {t["name"]: t for t in items}


class KServeEngine(HostArrays):
    """Segment CT volumes on a remote KServe v2 / Triton inference server.

    Parameters
    ----------
    url
        The server: ``http://host:port`` (HTTP; ``https://`` for TLS) or ``grpc://host:port``,
        or a bare ``host:port``.
    protocol
        ``"http"`` or ``"grpc"``.
    model_name
        The remote model's name (default: the manifest's ``name``); a version-2 model's folds
        are ``<model_name>_fold<i>``.
    timeout_s
        Deadline of each request, seconds from its start to the last byte of its reply (a
        retry has a deadline of its own).
    retries
        How many times a request that failed for a transient reason is sent again.
    batch_size
        Patches per request (default: the manifest's ``batch.max``, at most
        :data:`DEFAULT_BATCH_CAP`; a remote model with a fixed batch axis: that batch).
    precision
        ``"fp32"`` or ``"fp16"`` (FP16 tensors, when the manifest allows it).
    backoff_s
        First wait before a retry; doubled at each retry, at most 5 s.
    """

    name = "kserve"

    def __init__(
        self,
        *,
        url: str = "http://127.0.0.1:8000",
        protocol: str = "http",
        model_name: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 3,
        batch_size: int | None = None,
        precision: str = "fp32",
        backoff_s: float = 0.5,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise EngineError(f"kserve: protocol must be one of {PROTOCOLS}, got {protocol!r}")
        checked_precision(precision, "kserve")
        if timeout_s <= 0 or retries < 0 or (batch_size is not None and batch_size < 1):
            raise EngineError("kserve: timeout_s must be > 0, retries >= 0 and batch_size >= 1")
        self.url = url
        self.protocol = protocol
        self._address, self._ssl = _split_url(url, protocol)
        self._model_name = model_name
        self._timeout = float(timeout_s)
        self._retries = int(retries)
        self._batch_option = batch_size
        self._precision = precision
        self._backoff = float(backoff_s)
        self._module: Any = None
        self._http = Http(self._address, self._ssl, self._timeout)
        self._reply_cap = JSON_CAP
        self._local = threading.local()
        self._clients: list[Any] = []
        self._clients_lock = threading.Lock()
        self._manifest: ModelManifest | None = None
        self._remote: list[str] = []
        self._wire = "FP32"
        self._batch = 1
        self._fixed_batch: int | None = None
        self._outputs: dict[str, str] = {}

    @property
    def manifest(self) -> ModelManifest | None:
        """The loaded model's manifest, or ``None`` before :meth:`load`."""
        return self._manifest

    @property
    def remote_models(self) -> list[str]:
        """The remote model names in use (one per fold file for a version-2 model)."""
        return list(self._remote)

    # -- clients -----------------------------------------------------------------------------

    def _client(self) -> Any:
        """The HTTP protocol, or this thread's gRPC client, whose channel refuses a message
        larger than the largest reply expected (:attr:`_reply_cap`)."""
        if self.protocol == "http":
            return self._http
        client = getattr(self._local, "client", None)
        if client is None:
            module = self._module
            keepalive = module.KeepAliveOptions()
            channel = [
                ("grpc.max_send_message_length", 2**31 - 1),
                ("grpc.max_receive_message_length", self._reply_cap),
                ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
                ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
                (
                    "grpc.keepalive_permit_without_calls",
                    keepalive.keepalive_permit_without_calls,
                ),
                ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            ]
            try:
                client = module.InferenceServerClient(
                    self._address, ssl=self._ssl, channel_args=channel
                )
            except Exception as exc:
                raise EngineError(f"kserve: cannot create a client for {self.url}: {exc}") from exc
            self._local.client = client
            with self._clients_lock:
                self._clients.append(client)
        return client

    def _timeout_kw(self) -> dict[str, Any]:
        return {"client_timeout": self._timeout} if self.protocol == "grpc" else {}

    def _call(self, what: str, fn: Callable[[Any], T]) -> T:
        """``fn(client)``, sent again after transient failures; an :class:`EngineError` with
        ``what`` and the last reason once the retries are spent or the failure is not
        transient."""
        attempt = 0
        while True:
            try:
                return fn(self._client())
            except EngineError:
                raise
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt | SystemExit):
                    raise
                transient = is_transient(exc)
                if not transient or attempt >= self._retries:
                    tries = f" after {attempt + 1} attempts" if attempt else ""
                    raise EngineError(f"{what}{tries}: {describe(exc)}") from exc
                delay = min(self._backoff * 2**attempt, 5.0)
                logger.warning(
                    "%s: %s; retry %d of %d in %.1f s",
                    what,
                    describe(exc),
                    attempt + 1,
                    self._retries,
                    delay,
                )
                time.sleep(delay)
                attempt += 1

    # -- load --------------------------------------------------------------------------------

    def load(self, manifest: ModelManifest) -> None:
        """Check the server and the remote model(s) against ``manifest``.

        Raises
        ------
        EngineError
            If ``tritonclient`` is missing (gRPC), the server is not reachable, not live or
            not ready, a remote model is not ready, or its metadata disagrees with the
            manifest (input or output name, data types, shapes).
        """
        if manifest.output_kind not in OUTPUT_KINDS:
            raise EngineError(
                f"model {manifest.name!r}: output_kind must be one of {OUTPUT_KINDS}, "
                f"got {manifest.output_kind!r}"
            )
        self.close()
        self._reply_cap = JSON_CAP
        if self.protocol == "grpc":
            self._module = _grpc_module()
        where = f"kserve server at {self.url}"
        kw = self._timeout_kw()
        live = self._call(f"{where} is not reachable", lambda c: c.is_server_live(**kw))
        if not live:
            raise EngineError(f"{where} is not live")
        if not self._call(f"{where} is not reachable", lambda c: c.is_server_ready(**kw)):
            raise EngineError(f"{where} is not ready")
        want_fp16 = self._precision == "fp16" and manifest.fp16
        self._wire = "FP16" if want_fp16 else "FP32"
        units = manifest.model_files() if manifest.is_trained else (manifest,)
        names = remote_model_names(manifest, self._model_name)
        batches: list[int | None] = []
        largest = 0
        for unit, remote in zip(units, names, strict=True):
            batches.append(self._check_model(unit, remote))
            itemsize = np.dtype(DATATYPES[self._outputs[remote]]).itemsize
            largest = max(largest, unit.output_channels * math.prod(unit.patch_size) * itemsize)
        fixed = {b for b in batches if b is not None}
        if len(fixed) > 1:
            raise EngineError(f"kserve: the fold models have different fixed batches {fixed}")
        self._fixed_batch = fixed.pop() if fixed else None
        if self._fixed_batch is not None:
            self._batch = self._fixed_batch
        elif self._batch_option is not None:
            self._batch = self._batch_option
        else:
            self._batch = max(1, min(manifest.batch_max, DEFAULT_BATCH_CAP))
        self._reply_cap = max(JSON_CAP, self._batch * largest + HEADER_MARGIN)
        self._drop_clients()  # gRPC channels made from now on take the largest reply
        self._manifest = manifest
        self._remote = names
        logger.info(
            "model %s %s on %s (%s): remote %s, patch %s, %s, %d patch(es) per request",
            manifest.name,
            manifest.version,
            self.url,
            self.protocol,
            ", ".join(names),
            "x".join(map(str, manifest.patch_size)),
            self._wire,
            self._batch,
        )

    def _check_model(self, unit: ModelManifest, remote: str) -> int | None:
        """Check one remote model's readiness and metadata and note its output's data type;
        return its fixed batch size, or ``None`` when its batch axis is dynamic."""
        on = f"on {self.url}"
        kw = self._timeout_kw()
        ready = self._call(
            f"model {remote} not ready {on}",
            lambda c: c.is_model_ready(remote, **kw),
        )
        if not ready:
            raise EngineError(f"model {remote} not ready {on}")
        if self.protocol == "grpc":
            meta = self._call(
                f"model {remote} {on}: metadata",
                lambda c: c.get_model_metadata(remote, as_json=True, **kw),
            )
        else:
            meta = self._call(
                f"model {remote} {on}: metadata", lambda c: c.get_model_metadata(remote)
            )
        inputs = _tensors(f"model {remote} {on}", meta, "inputs")
        outputs = _tensors(f"model {remote} {on}", meta, "outputs")
        unit.check_tensors(f"model {remote} {on}", inputs, outputs)
        datatype = inputs[unit.input_name].get("datatype")
        if datatype != self._wire:
            raise EngineError(
                f"model {remote} {on} takes {datatype} input, the engine sends {self._wire} "
                "(precision fp16 needs an FP16 model and a manifest with fp16: true)"
            )
        declared = outputs[unit.output_name].get("datatype")
        allowed = LABEL_TYPES if unit.output_kind == "labels" else SCORE_TYPES
        if declared not in allowed:
            raise EngineError(
                f"model {remote} {on}: output {unit.output_name!r} is {declared}; the output "
                f"of a {unit.output_kind!r} model is one of {', '.join(allowed)}"
            )
        self._outputs[remote] = str(declared)
        patch = list(unit.patch_size)
        checks = (
            ("input", inputs[unit.input_name], [1, *patch]),
            ("output", outputs[unit.output_name], [unit.output_channels, *patch]),
        )
        for label, tensor, want in checks:
            try:
                shape = [int(d) for d in tensor.get("shape", [])]
            except (TypeError, ValueError):
                shape = []
            if len(shape) != 5 or any(
                got >= 0 and got != w for got, w in zip(shape[1:], want, strict=True)
            ):
                raise EngineError(
                    f"model {remote} {on}: {label} shape {shape} does not match the manifest "
                    f"(N, {', '.join(map(str, want))})"
                )
        first = int(inputs[unit.input_name]["shape"][0])
        return first if first > 0 else None

    # -- inference ---------------------------------------------------------------------------

    def _infer(self, remote: str, unit: ModelManifest, feed: npt.NDArray[Any]) -> Any:
        """One request: ``feed`` (already in the wire type) to ``remote``, its output back,
        checked: the declared data type, the shape ``(N, C, patch)``, finite if floating."""
        n, name = len(feed), unit.output_name
        if self._fixed_batch is not None and n < self._fixed_batch:
            pad = np.zeros((self._fixed_batch - n, *feed.shape[1:]), feed.dtype)
            feed = np.concatenate([feed, pad])
        want_type = self._outputs[remote]
        want_shape = [len(feed), unit.output_channels, *unit.patch_size]

        def send(client: Any) -> Any:
            if self.protocol == "http":
                out = client.infer(
                    remote, unit.input_name, feed, self._wire, name, want_type, want_shape
                )
            else:
                out = self._grpc_infer(client, remote, unit, feed, want_type, want_shape)
            check_finite(name, out)
            return out

        return self._call(f"model {remote} on {self.url}: inference failed", send)[:n]

    def _grpc_infer(
        self,
        client: Any,
        remote: str,
        unit: ModelManifest,
        feed: npt.NDArray[Any],
        want_type: str,
        want_shape: list[int],
    ) -> npt.NDArray[Any]:
        """One gRPC request; its output checked as
        :func:`segnode.engines.kserve_http._read_output` checks HTTP's, copied if read-only
        (the sliding window may overwrite it)."""
        module, name = self._module, unit.output_name
        tensor = module.InferInput(unit.input_name, list(feed.shape), self._wire)
        tensor.set_data_from_numpy(feed)
        wanted = module.InferRequestedOutput(name)
        result = client.infer(remote, [tensor], outputs=[wanted], **self._timeout_kw())
        output = result.get_output(name)
        if output is None:
            raise ReplyError(f"no {name!r} in reply")
        check_output(name, output.datatype, list(output.shape), want_type, want_shape)
        try:
            out = np.asarray(result.as_numpy(name))
        except ValueError as exc:
            raise ReplyError(f"output {name!r} does not match its shape ({exc})") from None
        if list(out.shape) != want_shape or out.dtype != np.dtype(DATATYPES[want_type]):
            raise ReplyError(f"output {name!r} does not match its shape and type")
        return out if out.flags.writeable else out.copy()

    def _run_batches(
        self, batch: npt.NDArray[Any], run: Callable[[npt.NDArray[Any]], Any]
    ) -> npt.NDArray[Any]:
        size = self._batch
        if len(batch) <= size:
            return np.asarray(run(batch))
        chunks: Sequence[npt.NDArray[Any]] = [
            batch[i : i + size] for i in range(0, len(batch), size)
        ]
        return np.concatenate([run(c) for c in chunks])

    def _wire_array(self, x: npt.NDArray[Any]) -> npt.NDArray[Any]:
        dtype = np.float16 if self._wire == "FP16" else np.float32
        return np.ascontiguousarray(x, dtype=dtype)

    def segment(self, hu: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """Return the uint8 label map of a ``(z, y, x)`` volume in Hounsfield units.

        Raises
        ------
        EngineError
            If no model is loaded, the model is a version-2 one, the volume is not 3-D, or a
            request fails (after the retries, for a transient failure).
        """
        manifest = self._manifest
        if manifest is None:
            raise EngineError("kserve: segment() called before load()")
        volume = host_volume(manifest, hu)
        remote = self._remote[0]

        def run(chunk: npt.NDArray[Any]) -> Any:
            out = self._infer(remote, manifest, self._wire_array(preprocess(chunk, manifest)))
            return out.astype(np.float32) if out.dtype == np.float16 else out

        def predict(batch: npt.NDArray[np.float32]) -> Any:
            return self._run_batches(batch, run)

        try:
            labels = segment_with_manifest(volume, predict, manifest, batch_size=self._batch)
        except ValueError as exc:
            raise EngineError(f"model {manifest.name!r}: {exc}") from exc
        return np.asarray(labels, dtype=np.uint8)

    # -- version-2 models (segnode.engines.base.TrainedEngine) ---------------------------------

    def fold_predictors(self) -> list[PatchPredictor]:
        """One predictor per fold file, each sending its patches to ``<model>_fold<i>``
        (NumPy float32 in and out).

        Raises
        ------
        EngineError
            Before :meth:`load`.
        """
        manifest = self._manifest
        if manifest is None:
            raise EngineError("kserve: fold_predictors() called before load()")
        units = manifest.model_files() if manifest.is_trained else (manifest,)
        return [self._fold(unit, remote) for unit, remote in zip(units, self._remote, strict=True)]

    def _fold(self, unit: ModelManifest, remote: str) -> PatchPredictor:
        def run(chunk: npt.NDArray[Any]) -> Any:
            return np.asarray(self._infer(remote, unit, self._wire_array(chunk)), np.float32)

        def predict(batch: Any) -> Any:
            return self._run_batches(np.asarray(batch), run)

        return predict

    def window_batch(self) -> int:
        """Tiles per predictor call: one request."""
        return self._batch

    def close(self) -> None:
        """Close the gRPC clients (their connections) and forget the model."""
        self._drop_clients()
        self._manifest = None
        self._remote = []
        self._outputs = {}

    def _drop_clients(self) -> None:
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            try:
                client.close()
            except Exception:  # a channel already closed; nothing to keep
                logger.debug("closing a kserve client failed", exc_info=True)
        self._local = threading.local()
