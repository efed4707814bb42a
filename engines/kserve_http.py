"""The KServe v2 (Open Inference) protocol over HTTP, and the checks every reply passes.

:class:`Http` speaks the protocol on :mod:`http.client` (one connection per request):
health, readiness, model metadata and binary-tensor inference. Every request has one
deadline, ``timeout`` from its start, after which a watchdog shuts the socket down however
slowly the server trickles. An inference reply's JSON header (at most :data:`HEADER_MARGIN`
bytes) is read and checked first, then exactly the bytes of the output it announces
(:func:`check_output`); metadata is read up to :data:`JSON_CAP` bytes, an error's reason
from its first 64 KiB. :func:`check_output` and :func:`check_finite` check a gRPC reply
the same way, and :func:`describe` and :func:`is_transient` read a failed request of either
transport (a ``tritonclient`` error is read by duck typing, so this module does not import
``tritonclient``).

This module knows no manifest and no engine, and retries nothing: what to send, which
remote model to ask, the gRPC client and the retries belong to
:class:`segnode.engines.kserve_backend.KServeEngine`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import socket
import ssl
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import numpy as np
import numpy.typing as npt

DATATYPES: dict[str, type[np.generic]] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
"""The protocol's tensor data types (KServe v2, "Tensor Data Types") and their NumPy types."""

JSON_CAP = 1 << 20
"""The largest JSON reply (health, readiness, metadata) read from a server, bytes."""

HEADER_MARGIN = 1 << 16
"""Room for the JSON header of an inference reply beside its binary output, bytes."""

_ERROR_CAP = 1 << 16
_TRANSIENT_STATUS = frozenset(
    {
        "502",
        "503",
        "504",
        "StatusCode.UNAVAILABLE",
        "StatusCode.DEADLINE_EXCEEDED",
    }
)

T = TypeVar("T")


class ReplyError(Exception):
    """A reply the engine refuses (malformed, or not the output the model declared)."""


class _StatusError(Exception):
    """An HTTP reply with an error status; ``code`` is the status."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(text)
        self.code = code


def describe(exc: BaseException) -> str:
    """A one-line reason from a refused reply, an HTTP status, a ``tritonclient`` or socket
    error."""
    if isinstance(exc, ReplyError | _StatusError):
        return str(exc)
    message = getattr(exc, "message", None)
    if callable(message):
        status = exc.status() if callable(getattr(exc, "status", None)) else None  # type: ignore[attr-defined]
        text = str(message() or "").strip()
        return f"{text} ({status})" if status else text or type(exc).__name__
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def is_transient(exc: BaseException) -> bool:
    """Whether a failed request may succeed when sent again (server restarting, overloaded,
    network hiccup)."""
    if isinstance(exc, _StatusError):
        return str(exc.code) in _TRANSIENT_STATUS
    if isinstance(exc, ssl.SSLCertVerificationError):
        return False
    if isinstance(exc, OSError):
        return True
    status = getattr(exc, "status", None)
    return callable(status) and str(status()) in _TRANSIENT_STATUS


def check_output(
    name: str, datatype: str, shape: Sequence[int], want_type: str, want_shape: Sequence[int]
) -> None:
    """Refuse an output whose data type or shape is not the one asked for."""
    if datatype != want_type:
        raise ReplyError(
            f"output {name!r} is {datatype}, the model's metadata declares {want_type}"
        )
    if list(shape) != list(want_shape):
        raise ReplyError(f"output {name!r} has shape {list(shape)}, expected {list(want_shape)}")


def check_finite(name: str, out: npt.NDArray[Any]) -> None:
    """Refuse a floating-point output holding NaN or an infinity (its minimum or maximum is
    then not finite: two reductions, no temporary array)."""
    if out.dtype.kind == "f" and out.size and not np.isfinite([out.min(), out.max()]).all():
        raise ReplyError(f"output {name!r} holds non-finite values (NaN or infinity)")


def _read_exactly(response: http.client.HTTPResponse, size: int) -> bytearray:
    """The next ``size`` bytes of a reply's body (a writable buffer)."""
    out = bytearray(size)
    view, got = memoryview(out), 0
    while got < size:
        n = response.readinto(view[got:])
        if not n:
            raise http.client.IncompleteRead(bytes(out[:got]), size - got)
        got += n
    return out


def _read_output(
    response: http.client.HTTPResponse, name: str, want_type: str, want_shape: Sequence[int]
) -> npt.NDArray[Any]:
    """Output ``name`` of an inference reply in the binary tensor extension's layout (a JSON
    header of ``Inference-Header-Content-Length`` bytes, then the outputs' bytes).

    The header is read first (at most :data:`HEADER_MARGIN` bytes) and checked: the output is
    there once, binary, of ``want_type`` and ``want_shape``, and no other output has bytes.
    Only then are exactly the bytes of that shape and type read, and a reply whose
    ``Content-Length`` says more or less, or a chunked one that goes on, is refused.
    """
    total = response.length  # None: chunked, or until the connection closes
    try:
        length = int(response.getheader("Inference-Header-Content-Length") or "")
    except ValueError:
        raise ReplyError(
            "the reply has no binary tensor (no Inference-Header-Content-Length)"
        ) from None
    if not 0 < length <= min(HEADER_MARGIN, HEADER_MARGIN if total is None else total):
        within = f"the {total}-byte reply" if total is not None else "the reply"
        raise ReplyError(
            f"Inference-Header-Content-Length {length} is not within {within} "
            f"(a JSON header has at most {HEADER_MARGIN} bytes)"
        )
    try:
        header = json.loads(bytes(_read_exactly(response, length)))
        outputs = {o["name"]: o for o in header["outputs"]}
        sizes = {
            o["name"]: int((o.get("parameters") or {}).get("binary_data_size", -1))
            for o in header["outputs"]
        }
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as exc:
        raise ReplyError(f"the reply's JSON header is malformed ({exc!r:.200})") from None
    if len(outputs) != len(header["outputs"]):
        raise ReplyError("the reply names an output twice")
    if name not in outputs:
        raise ReplyError(f"no {name!r} in reply")
    output = outputs[name]
    check_output(name, output.get("datatype"), output.get("shape") or [], want_type, want_shape)
    dtype = np.dtype(DATATYPES[want_type])
    size = math.prod(want_shape) * dtype.itemsize
    if sizes[name] != size:
        raise ReplyError(
            f"output {name!r} has binary_data_size {sizes[name]}, its shape and type make "
            f"{size} bytes"
        )
    if any(n > 0 for other, n in sizes.items() if other != name):
        raise ReplyError(f"the reply holds binary outputs besides {name!r}")
    if total is not None and total != length + size:
        raise ReplyError(
            f"reply of {total} bytes; its JSON header ({length} bytes) and {name!r} "
            f"({size} bytes) make {length + size}"
        )
    body = _read_exactly(response, size)
    if total is None and response.read(1):
        raise ReplyError(
            f"reply goes on past its JSON header ({length} bytes) and {name!r} ({size} bytes)"
        )
    return np.frombuffer(body, dtype).reshape(want_shape)


class _Deadline:
    """Shut an HTTP connection's socket down ``seconds`` after a request started: what blocks
    on it then fails at once, however slowly the peer trickles (its timeout is per read)."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._ended = False
        self.expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        with self._lock:  # end() waits, so the socket is not closed under us
            if self._ended:
                return
            self.expired = True
            sock = self._conn.sock
            if sock is not None:
                with contextlib.suppress(OSError):  # the TCP socket, under TLS if any
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)

    def end(self) -> None:
        """Stop the watchdog (before the connection is closed)."""
        with self._lock:
            self._ended = True
        self._timer.cancel()


class Http:
    """The KServe v2 HTTP protocol on :mod:`http.client`: one connection per request, one
    deadline per request, a cap on every reply.

    Parameters
    ----------
    address
        ``host:port``, optionally followed by a path prefix.
    tls
        Whether to speak HTTPS (the system's trusted certificates, host name checked).
    timeout
        Seconds from a request's start to its last byte.
    """

    def __init__(self, address: str, tls: bool, timeout: float) -> None:
        parts = urlsplit(f"{'https' if tls else 'http'}://{address}")
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if tls else 80)
        self._base = parts.path.rstrip("/")
        self._context = ssl.create_default_context() if tls else None
        self._timeout = timeout

    def _connection(self) -> http.client.HTTPConnection:
        if self._context is not None:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self._timeout, context=self._context
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self._timeout)

    def request(
        self,
        method: str,
        path: str,
        read: Callable[[http.client.HTTPResponse], T],
        body: Sequence[bytes | memoryview] = (),
        headers: Mapping[str, str] | None = None,
    ) -> T:
        """Send a request and ``read`` its reply (status 200), all within the deadline.

        Raises
        ------
        TimeoutError
            No whole reply within the timeout.
        _StatusError
            Any status but 200; the text is the server's ``error``.
        ReplyError
            A reply that ``read`` refuses.
        OSError, http.client.HTTPException
            The connection failed, or the reply is not HTTP.
        """
        conn = self._connection()
        deadline = _Deadline(conn, self._timeout)
        try:
            conn.connect()
            if deadline.expired:  # it fired before the socket existed
                raise TimeoutError
            conn.putrequest(method, self._base + path, skip_accept_encoding=True)
            for key, value in (headers or {}).items():
                conn.putheader(key, value)
            conn.putheader("Content-Length", str(sum(memoryview(b).nbytes for b in body)))
            conn.endheaders()
            for part in body:
                conn.send(part)
            response = conn.getresponse()
            if response.status != 200:
                raise _StatusError(response.status, _error_text(response))
            return read(response)
        except (_StatusError, ReplyError):
            raise
        except Exception as exc:
            if deadline.expired or isinstance(exc, TimeoutError):
                raise TimeoutError(f"no reply within {self._timeout:g} s") from exc
            raise
        finally:
            deadline.end()
            conn.close()

    def ok(self, path: str) -> bool:
        """Whether ``GET path`` answers 200 (its body is not read)."""
        try:
            self.request("GET", path, lambda response: None)
        except _StatusError:
            return False
        return True

    def is_server_live(self) -> bool:
        """``GET /v2/health/live`` answers 200."""
        return self.ok("/v2/health/live")

    def is_server_ready(self) -> bool:
        """``GET /v2/health/ready`` answers 200."""
        return self.ok("/v2/health/ready")

    def is_model_ready(self, model: str) -> bool:
        """``GET /v2/models/<model>/ready`` answers 200."""
        return self.ok(f"/v2/models/{quote(model, safe='')}/ready")

    def get_model_metadata(self, model: str) -> Any:
        """The model's metadata, a JSON object of at most :data:`JSON_CAP` bytes."""
        path = f"/v2/models/{quote(model, safe='')}"
        body = self.request("GET", path, lambda response: _read_capped(response, JSON_CAP))
        try:
            return json.loads(bytes(body))
        except (ValueError, RecursionError) as exc:
            raise ReplyError(f"the metadata is not JSON ({exc!r:.200})") from None

    def infer(
        self,
        model: str,
        tensor: str,
        feed: npt.NDArray[Any],
        wire: str,
        output: str,
        want_type: str,
        want_shape: Sequence[int],
    ) -> npt.NDArray[Any]:
        """Send ``feed`` as input ``tensor`` of ``model`` (binary, data type ``wire``); return
        output ``output``, checked to be ``want_type`` of ``want_shape``."""
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": tensor,
                        "shape": list(feed.shape),
                        "datatype": wire,
                        "parameters": {"binary_data_size": feed.nbytes},
                    }
                ],
                "outputs": [{"name": output, "parameters": {"binary_data": True}}],
            }
        ).encode()
        return self.request(
            "POST",
            f"/v2/models/{quote(model, safe='')}/infer",
            lambda response: _read_output(response, output, want_type, want_shape),
            (header, feed.data.cast("B")),
            {
                "Content-Type": "application/octet-stream",
                "Inference-Header-Content-Length": str(len(header)),
            },
        )


def _read_capped(response: http.client.HTTPResponse, cap: int) -> bytearray:
    """The body of ``response``: refused unread when its ``Content-Length`` exceeds ``cap``,
    refused at ``cap`` bytes when it has none (chunked, or until the connection closes)."""
    length = response.length
    if length is not None:
        if length > cap:
            raise ReplyError(f"reply of {length} bytes is larger than the {cap} expected")
        return _read_exactly(response, length)
    body = bytearray()
    while chunk := response.read(min(1 << 20, cap + 1 - len(body))):
        body += chunk
        if len(body) > cap:
            raise ReplyError(f"reply is larger than the {cap} bytes expected")
    return body


def _error_text(response: http.client.HTTPResponse) -> str:
    """The reason of an error reply: the server's ``error`` (the protocol's error object),
    else the start of its body, else the status line; at most :data:`_ERROR_CAP` bytes read."""
    status = f"HTTP {response.status} {response.reason}".strip()
    try:
        raw = response.read(min(response.length or _ERROR_CAP, _ERROR_CAP))
    except (OSError, http.client.HTTPException):
        return status
    try:
        text = str(json.loads(raw).get("error", ""))
    except (ValueError, RecursionError, AttributeError):
        text = raw.decode("utf-8", "replace")
    text = "".join(c for c in text[:200] if c.isprintable()).strip()
    return f"{text} ({status})" if text else status
