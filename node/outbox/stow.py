"""DICOMweb STOW-RS delivery of result objects (PS3.18 §10.5, Store Transaction).

One object is sent per request, ``POST {base}/studies`` with a ``multipart/related;
type="application/dicom"`` body (PS3.18 §8.6.1.2) holding the PS3.10 file, and
``Accept: application/dicom+json``. The standard library's :mod:`urllib` is enough for this;
no DICOMweb client library is needed.

The response is read as PS3.18 §10.5.3 says:

* **200** - every instance stored. The response's Referenced SOP Sequence (0008,1199) is checked
  to name our SOP Instance UID when it is present.
* **202** - some instances stored, others failed or stored with warnings: the Failed SOP
  Sequence (0008,1198) with a Failure Reason (0008,1197) for each failed instance, and Warning
  Reason (0008,1196) in the Referenced SOP Sequence.
* **400, 409, 415 and other 4xx/5xx** - nothing stored; the Failure Reason is taken from the
  body when it has one.

Failures are classified like the C-STORE outbox does: :class:`StowUnreachable` (the server
cannot be reached, or is overloaded or in maintenance: connection refused or reset before a
request was sent, DNS failure, TLS handshake failure, HTTP 429, 502, 503, 504) says nothing about
the object, while :class:`StowFailed` (any other HTTP error, a Failed SOP entry, no response to a
sent request) counts as an attempt for that object.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Destination names of STOW-RS targets start with this prefix (``stow:http://host/dicom-web``).
STOW_PREFIX = "stow:"
#: HTTP statuses that mean "the server is not available now", not "this object is bad".
UNAVAILABLE = frozenset({429, 502, 503, 504})

_FAILED_SOP_SEQUENCE = "00081198"
_REFERENCED_SOP_SEQUENCE = "00081199"
_REFERENCED_SOP_INSTANCE_UID = "00081155"
_FAILURE_REASON = "00081197"
_WARNING_REASON = "00081196"


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
            return "Bearer " + target.token_file.read_text().strip()
        if target.username is not None:
            password = target.password_file.read_text().strip() if target.password_file else ""
            raw = f"{target.username}:{password}".encode()
            return "Basic " + base64.b64encode(raw).decode("ascii")
    except OSError as exc:
        raise StowUnreachable(f"cannot read the credentials file: {exc.strerror or exc}") from exc
    return None


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
    return f"0x{code:04X}" if isinstance(code, int) else str(code)


def parse_response(body: bytes, sop_instance_uid: str) -> tuple[str | None, str | None]:
    """Read a STOW-RS response body (``application/dicom+json``).

    Returns
    -------
    tuple
        ``(failure, warning)``: the Failure Reason of ``sop_instance_uid`` in the Failed SOP
        Sequence, and its Warning Reason in the Referenced SOP Sequence (each None if absent).
        An empty or non-JSON body gives ``(None, None)``.
    """
    try:
        doc = json.loads(body) if body.strip() else None
    except ValueError:
        return None, None
    if isinstance(doc, list):  # some servers wrap the dataset in an array
        doc = doc[0] if doc else None
    if not isinstance(doc, Mapping):
        return None, None
    failure = warning = None
    for item in _sequence_items(doc, _FAILED_SOP_SEQUENCE):
        uid = _value(item, _REFERENCED_SOP_INSTANCE_UID)
        if uid in (None, sop_instance_uid):
            failure = f"Failure Reason {_reason(_value(item, _FAILURE_REASON))}"
    for item in _sequence_items(doc, _REFERENCED_SOP_SEQUENCE):
        if _value(item, _REFERENCED_SOP_INSTANCE_UID) == sop_instance_uid:
            code = _value(item, _WARNING_REASON)
            if code is not None:
                warning = f"Warning Reason {_reason(code)}"
    return failure, warning


def _unreachable_cause(exc: BaseException) -> bool:
    """Whether a transport error happened before the request reached the server."""
    return isinstance(
        exc,
        ConnectionRefusedError | socket.gaierror | ssl.SSLError | ConnectionResetError,
    ) or (isinstance(exc, TimeoutError | socket.timeout) and "connect" in str(exc).lower())


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
        Seconds for connecting and for the response.

    Raises
    ------
    StowUnreachable
        The server could not be reached or said it is unavailable (429, 502, 503, 504).
    StowFailed
        The server did not store the object, or did not answer.
    """
    boundary = "segnode-" + os.urandom(12).hex()
    request = urllib.request.Request(
        target.url.rstrip("/") + "/studies",
        data=multipart_related([dicom_file], boundary),
        method="POST",
        headers={"Content-Type": _content_type(boundary), "Accept": "application/dicom+json"},
    )
    auth = _auth_header(target)
    if auth is not None:
        request.add_header("Authorization", auth)
    try:
        with urllib.request.urlopen(
            request, timeout=timeout, context=_ssl_context(target)
        ) as response:
            status = int(response.status)
            body = response.read()
    except urllib.error.HTTPError as exc:
        body = exc.read() if exc.fp is not None else b""
        failure, _ = parse_response(body, sop_instance_uid)
        detail = f"HTTP {exc.code} {exc.reason}" + (f", {failure}" if failure else "")
        if exc.code in UNAVAILABLE:
            raise StowUnreachable(detail, exc.code) from exc
        raise StowFailed(detail, exc.code) from exc
    except urllib.error.URLError as exc:
        cause = exc.reason if isinstance(exc.reason, BaseException) else exc
        if _unreachable_cause(cause):
            raise StowUnreachable(f"cannot connect: {cause}") from exc
        raise StowFailed(f"no response: {cause}") from exc
    except (http.client.HTTPException, OSError) as exc:
        if _unreachable_cause(exc):
            raise StowUnreachable(f"cannot connect: {exc}") from exc
        raise StowFailed(f"no response (connection lost or timeout): {exc}") from exc
    failure, warning = parse_response(body, sop_instance_uid)
    if failure is not None:
        raise StowFailed(f"HTTP {status}, {failure}", status)
    if status not in (200, 202):
        raise StowFailed(f"unexpected HTTP {status}", status)
    return StowResult(status, warning)


__all__ = [
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
