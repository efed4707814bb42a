"""DICOMweb STOW-RS delivery of result objects (PS3.18 §10.5, Store Transaction).

One object is sent per request, ``POST {base}/studies`` with a ``multipart/related;
type="application/dicom"`` body (PS3.18 §8.6.1.2) holding the PS3.10 file, and
``Accept: application/dicom+json``. The standard library's :mod:`http.client` is enough for
this; no DICOMweb client library is needed, and no proxy is taken from the environment. The
server is not trusted:

* **One deadline per request.** ``timeout`` bounds the whole exchange: connecting, the TLS
  handshake, sending, the response's head and its body (the name lookup has the resolver's own
  timeouts). A socket timeout bounds each read, not the response, so a watchdog shuts the
  connection down at the deadline.
* **No redirects.** Any 3xx fails the delivery with its Location in the reason: a redirected
  POST goes to another URL, for 301-303 as a GET that stores nothing, and the credentials would
  go with it. Configure the final URL.
* **Bounded reading.** At most :data:`BODY_CAP` bytes of a success body are read (a longer one
  fails the delivery) and :data:`ERROR_BODY_CAP` of an error body (the rest is dropped with the
  connection); JSON nested deeper than :data:`JSON_DEPTH` is refused before it is parsed.

The response is read as PS3.18 §10.5.3 says:

* **200** - every instance stored. A body must be DICOM JSON (``application/dicom+json`` or
  ``application/json``, PS3.18 Annex F); when it has a Referenced SOP Sequence (0008,1199) or a
  Failed SOP Sequence (0008,1198), the Referenced SOP Sequence must name our SOP Instance UID.
  An empty body, or one with neither sequence, is accepted: some servers send none.
* **202** - some instances stored, others failed or stored with warnings: the Failed SOP
  Sequence (0008,1198) with a Failure Reason (0008,1197) for each failed instance, and Warning
  Reason (0008,1196) in the Referenced SOP Sequence. Its body is checked as a 200's; an empty
  202 is accepted with a warning.
* **400, 409, 415 and other 4xx/5xx** - nothing stored; the Failure Reason is taken from the
  body when it has one.

Failures are classified like the C-STORE outbox does, by whether the request was sent whole:
:class:`StowUnreachable` (the request did not reach the server: DNS failure, connection
refused, TLS handshake failure or timeout, the connection lost or the deadline passed while
sending; or the server is overloaded or in maintenance: HTTP 429, 502, 503, 504) says nothing
about the object, while :class:`StowFailed` (any other HTTP status, a redirect, a Failed SOP
entry, a 2xx that is not a STOW-RS response naming our instance, no complete response to a
request sent whole) counts as an attempt for that object. Reasons never hold the credentials;
the server's text in them (status phrase, Location, Failure Reason) is cut to one printable
line.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

#: Destination names of STOW-RS targets start with this prefix (``stow:http://host/dicom-web``).
STOW_PREFIX = "stow:"
#: HTTP statuses that mean "the server is not available now", not "this object is bad".
UNAVAILABLE = frozenset({429, 502, 503, 504})
#: The most of a success response's body that is read; a STOW-RS response about one instance
#: is a few KiB, and a longer body fails the delivery.
BODY_CAP = 4 << 20
#: The most of an error response's body that is read (for its Failure Reason).
ERROR_BODY_CAP = 64 << 10
#: The deepest nesting of arrays and objects read in a response (a STOW-RS response has 6, 7
#: when wrapped in an array); the check costs one pass over the body per level.
JSON_DEPTH = 16
#: Media types of a DICOM JSON response body (PS3.18 Annex F).
JSON_TYPES = frozenset({"application/dicom+json", "application/json"})

_FAILED_SOP_SEQUENCE = "00081198"
_REFERENCED_SOP_SEQUENCE = "00081199"
_REFERENCED_SOP_INSTANCE_UID = "00081155"
_FAILURE_REASON = "00081197"
_WARNING_REASON = "00081196"

_READ_SIZE = 64 << 10  # bytes asked for by one read of a response body
_PEER_TEXT = 200  # characters of the server's text (a Location, a reason) put in a reason
# A string, or an unterminated one up to the end: it matches at every quote, so a search never
# scans the same text twice (possessive: a body of backslash-quote pairs made the backtracking
# form quadratic).
_JSON_STRING = re.compile(r'"(?:[^"\\]++|\\.?)*+(?:"|\Z)', re.DOTALL)
_JSON_INNERMOST = re.compile(r"\[[^\[\]{}]*+\]|\{[^\[\]{}]*+\}")
#: Each stage of a request: the reason when the deadline passed in it, and when it failed.
_STAGES = {
    "connect": ("no connection within {} s", "cannot connect: {}"),
    "TLS handshake": ("TLS handshake not done within {} s", "TLS handshake failed: {}"),
    "send": ("request not sent within {} s", "connection lost while sending: {}"),
    "response": ("no response within {} s", "no complete response: {}"),
}


class StowError(Exception):
    """A STOW-RS request did not store the object."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class StowUnreachable(StowError):
    """The server cannot be reached or is unavailable now; the object is not at fault."""


class StowFailed(StowError):
    """The server answered that the object was not stored (or did not answer a request sent)."""


@dataclass(frozen=True)
class StowTarget:
    """A DICOMweb service that result objects are stored to.

    Parameters
    ----------
    url
        Base URL of the DICOMweb service (the "service root"), e.g.
        ``http://pacs:8042/dicom-web``; the node posts to ``{url}/studies``.
    ca_file
        CA bundle that verifies an ``https`` server (system CAs when None).
    verify
        False skips certificate verification (test setups only).
    username, password_file
        HTTP Basic authentication (RFC 7617); the password is read from the file when sending,
        so it is never part of the configuration object or the logs.
    token_file
        A bearer token (RFC 6750) read from the file when sending.
    """

    url: str
    ca_file: Path | None = None
    verify: bool = True
    username: str | None = None
    password_file: Path | None = None
    token_file: Path | None = None

    @property
    def name(self) -> str:
        """``stow:<url>``: the destination's name in the ledger."""
        return f"{STOW_PREFIX}{self.url}"


@dataclass(frozen=True)
class StowResult:
    """A successful store: the HTTP status and any warning the server gave."""

    http_status: int
    warning: str | None = None


def multipart_related(parts: list[bytes], boundary: str) -> bytes:
    """Encode ``parts`` as a ``multipart/related`` body (RFC 2387) of ``application/dicom``."""
    out = bytearray()
    for part in parts:
        out += f"--{boundary}\r\nContent-Type: application/dicom\r\n\r\n".encode("ascii")
        out += part
        out += b"\r\n"
    out += f"--{boundary}--\r\n".encode("ascii")
    return bytes(out)


def _content_type(boundary: str) -> str:
    return f'multipart/related; type="application/dicom"; boundary={boundary}'


def _ssl_context(target: StowTarget) -> ssl.SSLContext | None:
    if not target.url.lower().startswith("https:"):
        return None
    ctx = ssl.create_default_context(
        cafile=str(target.ca_file) if target.ca_file is not None else None
    )
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if not target.verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _auth_header(target: StowTarget) -> str | None:
    try:
        if target.token_file is not None:
            value = "Bearer " + target.token_file.read_text().strip()
        elif target.username is not None:
            password = target.password_file.read_text().strip() if target.password_file else ""
            raw = f"{target.username}:{password}".encode()
            value = "Basic " + base64.b64encode(raw).decode("ascii")
        else:
            return None
    except OSError as exc:
        raise StowUnreachable(f"cannot read the credentials file: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise StowUnreachable("the credentials file is not UTF-8 text") from None
    if not (value.isascii() and value.isprintable()):  # http.client would quote it in an error
        raise StowUnreachable("the credentials file holds characters not allowed in HTTP")
    return value


def _text(value: object, limit: int = _PEER_TEXT) -> str:
    """``value`` as one printable line of at most ``limit`` characters (the server's text in a
    reason)."""
    text = "".join(c if c.isprintable() else "?" for c in str(value).strip()[: limit + 1])
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _sequence_items(body: Mapping[str, Any], tag: str) -> list[Mapping[str, Any]]:
    element = body.get(tag)
    if not isinstance(element, Mapping):
        return []
    items = element.get("Value", [])
    return [i for i in items if isinstance(i, Mapping)] if isinstance(items, list) else []


def _value(item: Mapping[str, Any], tag: str) -> Any:
    element = item.get(tag)
    if isinstance(element, Mapping):
        values = element.get("Value")
        if isinstance(values, list) and values:
            return values[0]
    return None


def _reason(code: Any) -> str:
    return _text(f"0x{code:04X}" if isinstance(code, int) else code, 64)


def _nesting_within(text: str, depth: int) -> bool:
    """Whether the arrays and objects of the JSON ``text`` nest at most ``depth`` deep (and
    balance).

    Strings are blanked, then each pass replaces the innermost arrays and objects by a scalar:
    at most ``depth`` linear passes of :mod:`re`, where :func:`json.loads` would recurse once per
    level (``"[" * 200000`` raised RecursionError).
    """
    rest = _JSON_STRING.sub('""', text)
    for _ in range(depth):
        shallower = _JSON_INNERMOST.sub("0", rest)
        if shallower == rest:
            break
        rest = shallower
    return not any(bracket in rest for bracket in "[]{}")


def _dataset(body: bytes) -> Mapping[str, Any] | None:
    """The DICOM JSON dataset of a response body (PS3.18 Annex F); None for an empty body.

    Raises
    ------
    ValueError
        The body is not UTF-8 JSON holding one dataset, or nests deeper than
        :data:`JSON_DEPTH`.
    """
    text = body.decode("utf-8-sig")
    if not text.strip():
        return None
    if not _nesting_within(text, JSON_DEPTH):
        raise ValueError(f"unbalanced, or nested deeper than {JSON_DEPTH}")
    try:
        doc = json.loads(text)
    except RecursionError:  # not reached within JSON_DEPTH; kept as the last guard
        raise ValueError("nested too deeply") from None
    if isinstance(doc, list):  # some servers wrap the dataset in an array
        doc = doc[0] if doc else None
    if doc is not None and not isinstance(doc, Mapping):
        raise ValueError("not a DICOM JSON dataset")
    return doc


def _reasons(doc: Mapping[str, Any], sop_instance_uid: str) -> tuple[str | None, str | None]:
    """``(failure, warning)`` of ``sop_instance_uid`` in a response dataset."""
    failure = warning = None
    failed = _sequence_items(doc, _FAILED_SOP_SEQUENCE)
    for item in failed:
        if _value(item, _REFERENCED_SOP_INSTANCE_UID) in (None, sop_instance_uid):
            failure = f"Failure Reason {_reason(_value(item, _FAILURE_REASON))}"
    referenced = _sequence_items(doc, _REFERENCED_SOP_SEQUENCE)
    ours = [i for i in referenced if _value(i, _REFERENCED_SOP_INSTANCE_UID) == sop_instance_uid]
    for item in ours:
        code = _value(item, _WARNING_REASON)
        if code is not None:
            warning = f"Warning Reason {_reason(code)}"
    listed = _FAILED_SOP_SEQUENCE in doc or _REFERENCED_SOP_SEQUENCE in doc
    if failure is None and not ours and listed:
        named = (_value(i, _REFERENCED_SOP_INSTANCE_UID) for i in (*referenced, *failed))
        other = next((uid for uid in named if uid is not None), None)
        failure = (
            f"the response names instance {_text(other, 80)}, not this one"
            if other is not None
            else "the response's Referenced SOP Sequence does not name this instance"
        )
    return failure, warning


def parse_response(body: bytes, sop_instance_uid: str) -> tuple[str | None, str | None]:
    """Read a STOW-RS response body (``application/dicom+json``).

    Returns
    -------
    tuple
        ``(failure, warning)``: the Failure Reason of ``sop_instance_uid`` in the Failed SOP
        Sequence (or, when the response lists instances but the Referenced SOP Sequence does not
        name this one, a sentence saying so), and its Warning Reason in the Referenced SOP
        Sequence (each None if absent). An empty body, or one that is not a DICOM JSON dataset,
        gives ``(None, None)``.
    """
    try:
        doc = _dataset(body)
    except ValueError:  # UnicodeDecodeError and json's JSONDecodeError included
        return None, None
    return _reasons(doc, sop_instance_uid) if doc is not None else (None, None)


@dataclass(frozen=True)
class _Endpoint:
    host: str
    port: int
    path: str
    tls: bool


def _endpoint(url: str) -> _Endpoint:
    """Where ``POST {url}/studies`` goes; StowUnreachable for a URL that cannot be used."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise StowUnreachable(f"the service URL cannot be used: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise StowUnreachable("the service URL is not an http:// or https:// URL")
    tls = scheme == "https"
    path = parts.path.rstrip("/") + "/studies"
    return _Endpoint(parts.hostname, port or (443 if tls else 80), path, tls)


class _Deadline:
    """The end of one request's time."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left, for a socket timeout (never 0, which would mean non-blocking)."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        return left

    @property
    def passed(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self.end


class _Watchdog:
    """Shuts a connection down at its deadline, which ends any read or write waiting on it.

    A socket timeout bounds one read: a server trickling a byte a second is within it for ever.
    The watchdog shuts down a duplicate of the socket (shutting down, not closing: a descriptor
    closed under a reading thread could be reused before the read returns), which ends the
    connection for the TLS layer and :mod:`http.client` above it alike.
    """

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self.fired = False
        self._twin = sock.dup()
        self._timer = threading.Timer(max(deadline.end - time.monotonic(), 0.0), self._fire)
        self._timer.name = "segnode-stow-deadline"
        self._timer.daemon = True
        try:
            self._timer.start()
        except RuntimeError:
            self._twin.close()
            raise

    def _fire(self) -> None:
        self.fired = True
        with contextlib.suppress(OSError):
            self._twin.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        """Stop the timer (waiting for a shutdown in progress) and close the duplicate."""
        self._timer.cancel()
        self._timer.join()
        self._twin.close()


def _connect(host: str, port: int, deadline: _Deadline) -> socket.socket:
    """A TCP connection to ``host``: each of its addresses in turn, within the deadline."""
    error = OSError(f"no address for {host}")
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(deadline.left())
            sock.connect(address)
        except OSError as exc:
            sock.close()
            error = exc
        else:
            return sock
    raise error


@dataclass(frozen=True)
class _Reply:
    """An HTTP response: its status line, the headers read, at most a cap of its body."""

    status: int
    reason: str
    content_type: str
    location: str
    body: bytes
    cut: bool  # the body went on past the cap


def _read_body(
    response: http.client.HTTPResponse, sock: socket.socket, deadline: _Deadline, cap: int
) -> tuple[bytes, bool]:
    """At most ``cap`` bytes of the response's body, and whether more followed."""
    body = bytearray()
    while len(body) <= cap and not response.isclosed():  # it closes its socket at the end
        sock.settimeout(deadline.left())
        data = response.read(min(_READ_SIZE, cap + 1 - len(body)))
        if not data:
            break
        body += data
    if len(body) <= cap and response.length:  # read(amt) ends at an early close, no error
        raise http.client.IncompleteRead(bytes(body), response.length)
    return bytes(body[:cap]), len(body) > cap


def _read_reply(
    response: http.client.HTTPResponse, sock: socket.socket, deadline: _Deadline
) -> _Reply:
    """The reply of ``response``: no body read for a redirect, a capped one otherwise."""
    body, cut = b"", False
    if 200 <= response.status < 300:
        body, cut = _read_body(response, sock, deadline, BODY_CAP)
    elif not 300 <= response.status < 400:
        with contextlib.suppress(OSError, http.client.HTTPException):  # the status is the answer
            body, cut = _read_body(response, sock, deadline, ERROR_BODY_CAP)
    return _Reply(
        response.status,
        response.reason,
        response.getheader("Content-Type") or "",
        response.getheader("Location") or "",
        body,
        cut,
    )


def _exchange(
    target: StowTarget, headers: dict[str, str], payload: bytes, timeout: float
) -> _Reply:
    """POST ``payload`` to ``{target.url}/studies``, all within ``timeout`` seconds.

    Raises StowUnreachable when the request was not sent whole, StowFailed when it was but no
    complete response came (see the module docstring).
    """
    end = _endpoint(target.url)
    try:
        context = _ssl_context(target)
    except OSError as exc:  # ssl.SSLError included: a ca_file that is not a CA bundle
        raise StowUnreachable(f"cannot set up TLS: {_text(exc)}") from exc
    deadline = _Deadline(timeout)
    try:
        sock = _connect(end.host, end.port, deadline)
    except (OSError, ValueError) as exc:  # ValueError: UnicodeError of a name IDNA refuses
        raise _transport_error("connect", exc, timeout, deadline.passed) from exc
    try:
        watchdog = _Watchdog(sock, deadline)
    except (OSError, RuntimeError) as exc:  # no descriptor or thread left for it
        sock.close()
        raise StowUnreachable(f"cannot watch the connection: {_text(exc)}") from exc
    conn: http.client.HTTPConnection
    if context is not None:
        conn = http.client.HTTPSConnection(end.host, end.port, context=context)
    else:
        conn = http.client.HTTPConnection(end.host, end.port)
    response: http.client.HTTPResponse | None = None
    stage = "TLS handshake" if context is not None else "send"
    try:
        if context is not None:
            sock.settimeout(deadline.left())
            sock = context.wrap_socket(sock, server_hostname=end.host)
            stage = "send"
        conn.sock = sock
        sock.settimeout(deadline.left())
        conn.request("POST", end.path, body=payload, headers=headers)
        stage = "response"
        sock.settimeout(deadline.left())
        response = conn.getresponse()
        reply = _read_reply(response, sock, deadline)
        if watchdog.fired and 200 <= reply.status < 300:
            raise TimeoutError("deadline passed")  # the body may have ended at the shutdown
    except (OSError, http.client.HTTPException, ValueError) as exc:
        late = watchdog.fired or deadline.passed
        raise _transport_error(stage, exc, timeout, late) from exc
    finally:
        watchdog.stop()
        if response is not None:
            response.close()
        conn.close()
        sock.close()
    return reply


def _transport_error(stage: str, exc: BaseException, timeout: float, late: bool) -> StowError:
    """The error for a request that failed at ``stage``: unreachable until it was sent."""
    late_reason, lost_reason = _STAGES[stage]
    if late or isinstance(exc, TimeoutError):
        reason = late_reason.format(f"{timeout:g}")
    else:
        reason = lost_reason.format(_text(exc) or type(exc).__name__)
    return StowFailed(reason) if stage == "response" else StowUnreachable(reason)


def _outcome(reply: _Reply, sop_instance_uid: str) -> StowResult:
    """Judge a reply as the module docstring says."""
    status = reply.status
    if 300 <= status < 400:
        where = _text(reply.location) or "nowhere (no Location)"
        raise StowFailed(
            f"HTTP {status} redirect to {where}: STOW-RS redirects are not followed; "
            "configure the final URL",
            status,
        )
    if not 200 <= status < 300:
        failure, _ = parse_response(reply.body, sop_instance_uid)
        detail = f"HTTP {status} {_text(reply.reason, 80)}" + (f", {failure}" if failure else "")
        if status in UNAVAILABLE:
            raise StowUnreachable(detail, status)
        raise StowFailed(detail, status)
    if status not in (200, 202):
        raise StowFailed(f"unexpected HTTP {status}", status)
    if reply.cut:
        raise StowFailed(f"HTTP {status}, response body over {BODY_CAP >> 20} MiB", status)
    if not reply.body.strip():
        return StowResult(status, None if status == 200 else "HTTP 202 without a body")
    media = reply.content_type.split(";")[0].strip().lower()
    if media not in JSON_TYPES:
        kind = _text(media, 80) or "no Content-Type"
        raise StowFailed(f"HTTP {status}, not a STOW-RS response: {kind}", status)
    try:
        doc = _dataset(reply.body)
    except ValueError as exc:
        raise StowFailed(
            f"HTTP {status}, the response is not DICOM JSON: {_text(exc)}", status
        ) from exc
    failure, warning = _reasons(doc, sop_instance_uid) if doc is not None else (None, None)
    if failure is not None:
        raise StowFailed(f"HTTP {status}, {failure}", status)
    return StowResult(status, warning)


def store(
    target: StowTarget, dicom_file: bytes, sop_instance_uid: str, timeout: float
) -> StowResult:
    """Store one PS3.10 file with STOW-RS.

    Parameters
    ----------
    target
        The DICOMweb service.
    dicom_file
        The object in the DICOM File Format (preamble, file meta, dataset).
    sop_instance_uid
        Its SOP Instance UID, to find it in the response.
    timeout
        Seconds for the whole request: connecting, the TLS handshake, sending the object and
        reading the response.

    Raises
    ------
    StowUnreachable
        The request did not reach the server whole, or the server said it is unavailable
        (429, 502, 503, 504); no attempt is used.
    StowFailed
        The server did not store the object, did not answer the request within ``timeout``,
        or answered something that is not a STOW-RS response naming it (a redirect included).
    """
    boundary = "segnode-" + os.urandom(12).hex()
    headers = {
        "Content-Type": _content_type(boundary),
        "Accept": "application/dicom+json",
        "Connection": "close",
    }
    auth = _auth_header(target)
    if auth is not None:
        headers["Authorization"] = auth
    payload = multipart_related([dicom_file], boundary)
    return _outcome(_exchange(target, headers, payload, timeout), sop_instance_uid)


__all__ = [
    "BODY_CAP",
    "ERROR_BODY_CAP",
    "JSON_DEPTH",
    "JSON_TYPES",
    "STOW_PREFIX",
    "StowError",
    "StowFailed",
    "StowResult",
    "StowTarget",
    "StowUnreachable",
    "multipart_related",
    "parse_response",
    "store",
]
