"""The HTTP API and the console page, as a Starlette application.

====  =================================  ============================================
GET   ``/``                              the console page (static HTML, CSS, JS)
GET   ``/healthz``                       the web server answers (always 200)
GET   ``/readyz``                        200 when the node can take and finish jobs
GET   ``/api/v1/status``                 listening, engine, queue, disk, destinations
GET   ``/api/v1/jobs``                   jobs (``state``, ``limit``, ``offset``)
GET   ``/api/v1/jobs/{id}``              one job, with its preview's address
GET   ``/api/v1/jobs/{id}/preview.png``  the preview of its result
POST  ``/api/v1/jobs/{id}/retry``        requeue a failed or cancelled job
POST  ``/api/v1/jobs/{id}/cancel``       cancel an unfinished job
====  =================================  ============================================

Every ledger call runs in Starlette's thread pool, never on the event loop. The actions
need the bearer token (:class:`Access`); when the console listens on a non-loopback
address, every ``/api`` request does. The page, its static files and the probes carry no
data and need none. The jobs in ``/api/v1/jobs`` are built by
:func:`segnode.node.web.facts.job_facts`, the builder of ``segnode jobs --json``.
"""

from __future__ import annotations

import hmac
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from segnode.node.audit.trail import AuditTrail
from segnode.node.web.facts import JOB_STATES, ignored_facts, job_facts, job_page, waiting_facts
from segnode.node.web.preview import preview_path
from segnode.storage.ledger import Ledger

log = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
MAX_PAGE = 500

#: Headers on every response: no framing, no sniffing, scripts and images from the node only.
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (
        b"content-security-policy",
        b"default-src 'self'; img-src 'self' blob:; object-src 'none'; frame-ancestors 'none'",
    ),
]


@dataclass(frozen=True)
class Access:
    """Who may do what.

    Parameters
    ----------
    token
        The bearer token (None: no token file; the actions are then refused).
    reads_need_token
        Whether the ``/api`` reads need the token too (a non-loopback listen address).
    """

    token: str | None
    reads_need_token: bool = False

    def allows(self, request: Request) -> bool:
        """Whether ``request`` carries the token (compared in constant time)."""
        if self.token is None:
            return False
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.strip().encode(), self.token.encode())


@dataclass(frozen=True)
class Console:
    """What the application needs of the running node.

    Parameters
    ----------
    ledger
        The node's ledger (read and changed through its own methods).
    data_dir
        The node's data directory (previews lie under ``results/<job id>/``).
    access
        The token rules.
    status
        Live facts of the node (:func:`segnode.node.web.status.node_status`); called in a thread.
    ready
        ``(ready, reason)`` for ``/readyz``; called in a thread.
    requeued
        Called after a successful retry (wakes the worker and the outbox).
    audit
        The audit trail: a refused token (User Authentication, failed) and each action done
        (Security Alert, Use of Restricted Function); off when None.
    hosts
        The ``Host`` header values accepted (lower case, without the port); None accepts
        any. A console on loopback accepts only loopback names, so that a web page that
        rebinds its own domain name to 127.0.0.1 (DNS rebinding) cannot read it.
    """

    ledger: Ledger
    data_dir: Path
    access: Access
    status: Callable[[], dict[str, Any]]
    ready: Callable[[], tuple[bool, str]]
    requeued: Callable[[], None] = lambda: None
    hosts: frozenset[str] | None = None
    audit: AuditTrail | None = None


#: The ``Host`` names of a console on loopback.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})


#: A ``Host`` header (RFC 9110 7.2, RFC 3986 3.2.2): an IP literal in brackets, or a name or
#: IPv4 address (RFC 3986's unreserved characters: ``_`` occurs in real host names), then an
#: optional port. Nothing else may follow the host.
_HOST = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9._~-]+)(:[0-9]{0,5})?")

#: Bytes of a request head (request line and header fields) that the console answers; a
#: larger one is refused with 431. The server (h11) also stops buffering an incomplete head
#: at this size (:mod:`segnode.node.web.server`).
MAX_HEAD_BYTES = 32 * 1024

#: Job ids are SQLite integers (1 to 2**63 - 1); any other number names no job.
MAX_JOB_ID = 2**63 - 1
_JOB_ID = re.compile(r"[0-9]{1,19}")


def head_size(scope: Scope) -> int:
    """The size of a request's head as sent, near enough: its request line and fields."""
    line = len(scope["method"]) + len(scope.get("raw_path", b"")) + len(scope["query_string"])
    return line + 12 + sum(len(k) + len(v) + 4 for k, v in scope["headers"])


def host_name(header: str) -> str | None:
    """The host of a ``Host`` header, lower case, without the port (``[::1]`` kept whole);
    None when the header is not a host and optional port."""
    m = _HOST.fullmatch(header.strip().lower())
    return m.group(1) if m else None


class SecurityHeaders:
    """ASGI middleware adding :data:`SECURITY_HEADERS` (and ``no-store`` on the API),
    refusing (431) a head over :data:`MAX_HEAD_BYTES`, and refusing (400) a ``Host`` header
    outside ``hosts`` (None: any), a malformed one, or more than one."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str] | None = None) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on; add the headers to its response."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if head_size(scope) > MAX_HEAD_BYTES:
            too_large = _error(431, f"request head over {MAX_HEAD_BYTES // 1024} KiB")
            await too_large(scope, receive, send)
            return
        refusal = self._host_refusal([v for k, v in scope["headers"] if k == b"host"])
        if refusal is not None:
            await _error(400, refusal)(scope, receive, send)
            return
        api = str(scope.get("path", "")).startswith("/api/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.extend(SECURITY_HEADERS)
                if api:
                    headers.append((b"cache-control", b"no-store"))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def _host_refusal(self, hosts: list[bytes]) -> str | None:
        """Why the ``Host`` headers ``hosts`` are refused, or None. More than one, or one
        that is not a host (``[::1]evil.com``), is always refused (RFC 9112 3.2); none (or an
        empty one) only when ``hosts`` is set."""
        if len(hosts) > 1:
            return "more than one Host header"
        raw = hosts[0].decode("latin-1").strip() if hosts else ""
        name = host_name(raw) if raw else None
        if raw and name is None:
            return "malformed Host header"
        if self.hosts is not None and name not in self.hosts:
            return "unexpected Host header (this console is for loopback)"
        return None


def _error(status: int, message: str) -> JSONResponse:
    headers = {"WWW-Authenticate": 'Bearer realm="segnode"'} if status == 401 else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _int_param(request: Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _BadRequest(f"{name}: must be an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise _BadRequest(f"{name}: must be in [{lo}, {hi}], got {value}")
    return value


class _BadRequest(Exception):
    """A query parameter is invalid (answered with 400 and the message)."""


class _NotFound(Exception):
    """The path names nothing (answered with 404 and the message)."""


Endpoint = Callable[[Request], Awaitable[Response]]


def create_app(console: Console) -> Starlette:
    """The Starlette application of the console.

    Parameters
    ----------
    console
        The node's side: ledger, access rules, live status.
    """
    access, ledger = console.access, console.ledger
    audit = console.audit or AuditTrail.off()

    def client(request: Request) -> str:
        return request.client.host if request.client is not None else "(unknown)"

    def guarded(fn: Endpoint, *, action: bool = False) -> Endpoint:
        """``fn`` behind the token rules; a bad query parameter answers 400, a path that
        names nothing 404."""

        async def endpoint(request: Request) -> Response:
            if (action or access.reads_need_token) and not access.allows(request):
                if access.token is None:
                    why = "actions need a bearer token: set web.token_file"
                elif request.headers.get("authorization") is None:
                    why = "missing bearer token"
                else:
                    why = "wrong bearer token"
                what = f"{request.method} {request.url.path[:200]}: {why}"
                await run_in_threadpool(audit.auth_failure, client(request), what)
                return _error(401, why if access.token is None else "missing or wrong bearer token")
            try:
                return await fn(request)
            except _BadRequest as exc:
                return _error(400, str(exc))
            except _NotFound as exc:
                return _error(404, str(exc))

        return endpoint

    def job_id(request: Request) -> int:
        """The path's job id. Anything no job can have (not 1 to 2**63 - 1, the SQLite
        integers) names an unknown job; the path is parsed here, not by Starlette's ``int``
        convertor, which raises on 4,300 digits and more."""
        raw = request.path_params["job_id"]
        jid = int(raw) if _JOB_ID.fullmatch(raw) else 0
        if not 1 <= jid <= MAX_JOB_ID:
            raise _NotFound(f"job {raw[:32]} does not exist")
        return jid

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def readyz(_request: Request) -> Response:
        ok, reason = await run_in_threadpool(console.ready)
        return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)

    async def status(_request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(console.status))

    async def jobs(request: Request) -> Response:
        state = request.query_params.get("state") or None
        if state is not None and state not in JOB_STATES:
            raise _BadRequest(f"state: must be one of {', '.join(JOB_STATES)}, got {state!r}")
        limit = _int_param(request, "limit", 50, 1, MAX_PAGE)
        offset = _int_param(request, "offset", 0, 0, 2**31)

        def read() -> dict[str, Any]:
            page = job_page(ledger, limit=limit, offset=offset, state=state)
            page["previews"] = [
                j["id"] for j in page["jobs"] if preview_path(console.data_dir, j["id"]).is_file()
            ]
            page["ignored"] = ignored_facts(ledger, limit)
            page["waiting"] = waiting_facts(ledger, limit)
            return page

        return JSONResponse(await run_in_threadpool(read))

    async def job(request: Request) -> Response:
        jid = job_id(request)

        def read() -> dict[str, Any] | None:
            view = ledger.job(jid)
            if view is None:
                return None
            has_preview = preview_path(console.data_dir, jid).is_file()
            return {
                **job_facts(view),
                "calling_ae": ledger.series_calling_ae(view.series_instance_uid),
                "preview": f"/api/v1/jobs/{jid}/preview.png" if has_preview else None,
            }

        facts = await run_in_threadpool(read)
        if facts is None:
            return _error(404, f"job {jid} does not exist")
        return JSONResponse(facts)

    async def preview(request: Request) -> Response:
        jid = job_id(request)
        path = preview_path(console.data_dir, jid)
        if not await run_in_threadpool(path.is_file):
            return _error(404, f"job {jid} has no preview (yet)")
        return FileResponse(path, media_type="image/png")

    def action(name: str, change: Callable[[int], bool], refusal: str) -> Endpoint:
        async def run(request: Request) -> Response:
            jid = job_id(request)

            def apply() -> tuple[bool, str | None]:
                ok = change(jid)
                return ok, ledger.job_state(jid)

            ok, state = await run_in_threadpool(apply)
            if state is None:
                return _error(404, f"job {jid} does not exist")
            if not ok:
                await run_in_threadpool(
                    audit.console_action, name, jid, client(request), f"refused: job is {state}"
                )
                return JSONResponse(
                    {"error": f"job {jid} {refusal}", "id": jid, "state": state},
                    status_code=409,
                )
            log.info("web: job %d: %s (now %s)", jid, name, state)
            await run_in_threadpool(
                audit.console_action, name, jid, client(request), f"done, now {state}"
            )
            if name == "retry":
                await run_in_threadpool(console.requeued)
            return JSONResponse({"id": jid, "action": name, "ok": True, "state": state})

        return run

    async def index(_request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    routes = [
        Route("/", index),
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/api/v1/status", guarded(status)),
        Route("/api/v1/jobs", guarded(jobs)),
        Route("/api/v1/jobs/{job_id}", guarded(job)),
        Route("/api/v1/jobs/{job_id}/preview.png", guarded(preview)),
        Route(
            "/api/v1/jobs/{job_id}/retry",
            guarded(action("retry", ledger.retry_job, "is not failed or cancelled"), action=True),
            methods=["POST"],
        ),
        Route(
            "/api/v1/jobs/{job_id}/cancel",
            guarded(action("cancel", ledger.cancel_job, "is not active"), action=True),
            methods=["POST"],
        ),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes)
    app.add_middleware(SecurityHeaders, hosts=console.hosts)
    return app
