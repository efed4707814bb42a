"""The web console's HTTP API on a real node (``segnode serve`` with ``[web]``), real ledger,
real server on loopback; the preview renderer; ``[web]`` config; the node without the extra."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from io import BytesIO
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scripts.harness import CountingSCP, send_files
from segnode.node.config import TLSConfig, from_dict
from segnode.node.errors import ConfigError
from tests.conftest import LOOPBACK, ROOT, NodeProcess, free_port, require_tool, wait_for
from tests.fixtures.synthetic import PhantomGeometry, write_synthetic_series

TOKEN = "s3cret-token-for-the-web-tests-0123456789"
PATIENT_ID = "PID-WEB-7731"
SERIES = PhantomGeometry(rows=64, columns=64, slices=8)


@dataclass
class Http:
    """A small client for the console on loopback."""

    base: str
    context: ssl.SSLContext | None = None

    def request(
        self, path: str, method: str = "GET", token: str | None = None
    ) -> tuple[int, bytes, Any]:
        """``(status, body, headers)``; HTTP errors are answers too."""
        req = urllib.request.Request(
            self.base + path, method=method, data=b"" if method == "POST" else None
        )
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=10, context=self.context) as r:
                return r.status, r.read(), r.headers
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), exc.headers

    def json(self, path: str, method: str = "GET", token: str | None = None) -> Any:
        """The JSON body of a 2xx answer."""
        status, body, _ = self.request(path, method, token)
        assert 200 <= status < 300, (status, body)
        return json.loads(body)


def web_node(
    make_node: Any, tmp_path: Path, **sections: dict[str, Any]
) -> tuple[NodeProcess, Http]:
    """A node with ``[web]`` on a free loopback port and a token file."""
    token = tmp_path / "web-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    port = free_port()
    web = {"enabled": True, "listen": f"{LOOPBACK}:{port}", "token_file": str(token)}
    node = make_node(web=web, **sections)
    return node, Http(f"http://{LOOPBACK}:{port}")


def web_node_pacs_down(make_node: Any, tmp_path: Path) -> tuple[CountingSCP, NodeProcess, Http]:
    """A :func:`web_node` whose one destination is a PACS that is down (not yet started): a
    job fails after 2 s (``dispatch.max_age_s``); retries are fast."""
    scp = CountingSCP(free_port())
    dispatch = {
        "destinations": [scp.peer],
        "max_age_s": 2,
        "retry_initial_s": 0.1,
        "retry_max_s": 0.5,
        "breaker_failures": 100,
    }
    node, http = web_node(make_node, tmp_path, dispatch=dispatch)
    return scp, node, http


def send_series(port: int, base: Path, seed: int, **geometry: Any) -> str:
    """Send a synthetic series (``geometry`` overrides fields of :data:`SERIES`); return its
    Series Instance UID."""
    files = write_synthetic_series(
        base / f"series-{seed}", replace(SERIES, **geometry), seed=seed, patient_id=PATIENT_ID
    )
    result = send_files(files, port)
    assert result.complete, result
    from pydicom import dcmread

    return str(dcmread(files[0], stop_before_pixels=True).SeriesInstanceUID)


def job_states(http: Http) -> dict[int, str]:
    return {j["id"]: j["state"] for j in http.json("/api/v1/jobs?limit=500")["jobs"]}


# -- the API against `segnode jobs --json` ---------------------------------------------------


def test_api_jobs_equal_cli_jobs_json(make_node: Any, tmp_path: Path) -> None:
    node, http = web_node(make_node, tmp_path)
    uids = [send_series(node.port, tmp_path, seed) for seed in (41, 42)]
    wait_for(lambda: sorted(job_states(http).values()) == ["done", "done"], 60, "two jobs done")
    api = http.json("/api/v1/jobs?limit=100")
    cli = node.jobs()
    assert api["jobs"] == cli["jobs"]  # the same builder, the same facts
    assert api["ignored"] == cli["ignored"] and api["waiting"] == cli["waiting"]
    assert {j["series"] for j in api["jobs"]} == set(uids)
    assert api["total"] == 2
    for job in cli["jobs"]:
        detail = http.json(f"/api/v1/jobs/{job['id']}")
        assert {k: v for k, v in detail.items() if k not in ("calling_ae", "preview")} == job
        assert detail["calling_ae"] == "MODALITY"
    # filter and paging
    done = http.json("/api/v1/jobs?state=done")
    assert done["total"] == 2 and [j["state"] for j in done["jobs"]] == ["done", "done"]
    failed = http.json("/api/v1/jobs?state=failed")
    assert (failed["jobs"], failed["total"], failed["state"]) == ([], 0, "failed")
    second = http.json("/api/v1/jobs?limit=1&offset=1")
    assert [j["id"] for j in second["jobs"]] == [1] and second["total"] == 2
    for bad in ("state=nonsense", "limit=0", "limit=x", "offset=-1"):
        status, body, _ = http.request(f"/api/v1/jobs?{bad}")
        assert status == 400 and json.loads(body)["error"].split(":")[0] in bad
    assert http.request("/api/v1/jobs/999")[0] == 404
    # no patient names or IDs anywhere in what the console serves
    texts = [
        http.request(p)[1].decode()
        for p in ("/", "/api/v1/status", "/api/v1/jobs", "/api/v1/jobs/1", "/api/v1/jobs/2")
    ]
    for text in texts:
        for secret in (PATIENT_ID, "SYNTHETIC", "PHANTOM"):
            assert secret not in text


def test_status_probes_and_preview(make_node: Any, tmp_path: Path) -> None:
    node, http = web_node(make_node, tmp_path)
    assert http.json("/healthz") == {"ok": True}
    wait_for(lambda: http.request("/readyz")[0] == 200, 30, "readyz 200 once the engine loaded")
    send_series(node.port, tmp_path, 43, rows=96, columns=96, slices=12)
    wait_for(lambda: job_states(http) == {1: "done"}, 60, "the job done")
    status = http.json("/api/v1/status")
    assert status["listening"] == {
        "ae_title": "SEGNODE",
        "host": LOOPBACK,
        "port": node.port,
        "tls_port": None,
    }
    assert status["engine"]["name"] == "onnxruntime" and status["engine"]["loading"] is False
    assert status["queue"]["depth"] == 0 and status["ledger"]["jobs"] == {"done": 1}
    queue = status["queue"]  # the lanes' figures (issue 36)
    assert queue["lanes"] == 2 and queue["in_progress"] == {} and queue["waiting_for_model"] == {}
    assert queue["model_slots"] == 1 and queue["in_model"] == []  # onnxruntime: one at a time
    assert 0 < queue["model_busy_pct"] <= 100 and queue["model_mean_s"] > 0
    assert queue["expected_wait_s"] == 0.0 and queue["queued_by_priority"] == {}
    assert queue["gpu_busy_pct"] is None or 0 <= queue["gpu_busy_pct"] <= 100
    assert status["ledger"]["encoded_last_10_min"] == 1
    assert status["ledger"]["expected_wait_s"] == 0.0
    assert status["disk"]["free_bytes"] > 0 and status["healthy"] is True
    # the ledger part is what `segnode status` prints
    cli = json.loads(node.cli("status").stdout)
    assert cli.pop("audit") == {"enabled": False}  # the audit queue, read from its file
    busy = cli.pop("gpu_busy_pct")  # NVML's utilisation now (none without an NVIDIA GPU)
    assert (busy is None) == (queue["gpu_busy_pct"] is None) and (busy is None or busy <= 100)
    assert {k: v for k, v in cli.items() if k != "data_dir"} == status["ledger"]

    detail = wait_for(
        lambda: (d := http.json("/api/v1/jobs/1"))["preview"] and d, 60, "the preview"
    )
    code, png, headers = http.request(detail["preview"])
    assert code == 200 and headers["content-type"] == "image/png"
    from PIL import Image

    image = np.asarray(Image.open(BytesIO(png)).convert("RGB")).astype(int)
    assert image.shape[1] > 3 * 200  # three views side by side
    # segments drawn in colour over the grey CT: many pixels far from grey
    views = image[: 256 + 16]  # above the legend (its colour swatches do not count)
    chroma = views.max(axis=2) - views.min(axis=2)
    assert (chroma > 60).sum() > 1000
    assert (node.data_dir / "results" / "1" / "preview.png").is_file()
    assert "preview written" in node.log()


# -- actions and access ----------------------------------------------------------------------


def test_actions_need_the_token_and_retry_requeues(make_node: Any, tmp_path: Path) -> None:
    scp, node, http = web_node_pacs_down(make_node, tmp_path)  # PACS down until the retry
    send_series(node.port, tmp_path, 44)
    wait_for(lambda: job_states(http) == {1: "failed"}, 60, "the job failed (PACS down)")
    job = http.json("/api/v1/jobs/1")
    assert "not delivered within dispatch.max_age_s" in job["reason"]
    assert http.json("/api/v1/status")["destinations"][0]["name"] == scp.peer

    for token in (None, "wrong-token-of-the-same-kind-0123456789", ""):
        code, body, headers = http.request("/api/v1/jobs/1/retry", "POST", token)
        assert code == 401, body
        assert headers["www-authenticate"].startswith("Bearer")
    assert http.request("/api/v1/jobs/1/cancel", "POST")[0] == 401
    assert job_states(http) == {1: "failed"}  # nothing changed
    assert http.request("/api/v1/jobs/1/retry", "GET", TOKEN)[0] == 405
    assert http.request("/api/v1/jobs/999/retry", "POST", TOKEN)[0] == 404
    code, body, _ = http.request("/api/v1/jobs/1/cancel", "POST", TOKEN)
    assert code == 409 and json.loads(body)["state"] == "failed"

    scp.start()
    try:
        answer = http.json("/api/v1/jobs/1/retry", "POST", TOKEN)
        assert answer == {"id": 1, "action": "retry", "ok": True, "state": "encoded"}
        wait_for(lambda: job_states(http) == {1: "sent"}, 60, "the retried job sent")
        assert len(scp.counts()) == 2  # SEG and SR
    finally:
        scp.stop()
    assert "web: job 1: retry (now encoded)" in node.log()


def test_server_answers_while_a_job_runs(make_node: Any, tmp_path: Path) -> None:
    """The API is answered from its own thread and loop while the worker computes: replies
    that say the job is running prove they did not wait for it."""
    node, http = web_node(make_node, tmp_path)
    wait_for(lambda: http.request("/readyz")[0] == 200, 30, "readyz")
    files = write_synthetic_series(
        tmp_path / "big",
        PhantomGeometry(rows=512, columns=512, slices=48),
        seed=45,
        patient_id=PATIENT_ID,
    )
    sender = threading.Thread(target=send_files, args=(files, node.port))
    sender.start()
    while_running: list[float] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        status = http.json("/api/v1/status")
        jobs = http.json("/api/v1/jobs")
        took = time.monotonic() - t0
        if status["queue"]["current_job"] == 1 and jobs["jobs"][0]["state"] == "running":
            while_running.append(took)
        elif jobs["jobs"] and jobs["jobs"][0]["state"] == "done":
            break
    sender.join(60)
    assert job_states(http) == {1: "done"}
    slowest = max(while_running, default=0.0)
    print(f"{len(while_running)} answers while the job ran, the slowest in {slowest:.3f} s")
    assert len(while_running) >= 3, f"only {len(while_running)} answer(s) while the job ran"
    assert max(while_running) < 2.0, while_running


def _in_process_server(tmp_path: Path, token: str | None, reads_need_token: bool) -> Any:
    from segnode.node.web.app import Access, Console, create_app
    from segnode.node.web.server import WebServer
    from segnode.storage.ledger import Ledger

    ledger = Ledger(tmp_path / "ledger.sqlite")
    app = create_app(
        Console(
            ledger=ledger,
            data_dir=tmp_path,
            access=Access(token, reads_need_token),
            status=lambda: {"ok": True},
            ready=lambda: (False, "engine loading"),
        )
    )
    server = WebServer(app, LOOPBACK, 0)
    server.start()
    return server, ledger


def test_reads_need_the_token_when_not_on_loopback(tmp_path: Path) -> None:
    """What a non-loopback listener does (the test itself stays on loopback)."""
    server, ledger = _in_process_server(tmp_path, TOKEN, reads_need_token=True)
    try:
        http = Http(server.url.rstrip("/"))
        for path in ("/api/v1/status", "/api/v1/jobs", "/api/v1/jobs/1"):
            assert http.request(path)[0] == 401
            assert http.request(path, token=TOKEN[:-1] + "x")[0] == 401
        assert http.json("/api/v1/status", token=TOKEN) == {"ok": True}
        assert http.json("/api/v1/jobs", token=TOKEN)["jobs"] == []
        # the probes and the page carry no data and need no token
        assert http.request("/healthz")[0] == 200
        code, body, _ = http.request("/readyz")
        assert code == 503 and json.loads(body)["reason"] == "engine loading"
        code, page, headers = http.request("/")
        assert code == 200 and b"segnode" in page
        assert "frame-ancestors 'none'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff"
        assert http.request("/static/app.js")[0] == 200
        assert http.request("/static/../app.py")[0] == 404
    finally:
        server.stop()
        ledger.close()
    with pytest.raises(OSError):  # stopped: nothing listens any more
        urllib.request.urlopen(server.url + "healthz", timeout=2)


def test_loopback_console_refuses_other_host_names(tmp_path: Path) -> None:
    """DNS rebinding: a page of another site whose name now points at 127.0.0.1 sends its
    own name in ``Host``; the loopback console refuses it."""
    from segnode.node.web.app import LOOPBACK_HOSTS, Access, Console, create_app, host_name
    from segnode.node.web.server import WebServer
    from segnode.storage.ledger import Ledger

    assert [host_name(h) for h in ("127.0.0.1:8080", "[::1]:8080", "LocalHost", "a.b:1")] == [
        "127.0.0.1",
        "[::1]",
        "localhost",
        "a.b",
    ]
    ledger = Ledger(tmp_path / "ledger.sqlite")
    console = Console(
        ledger, tmp_path, Access(None), lambda: {}, lambda: (True, "ready"), hosts=LOOPBACK_HOSTS
    )
    server = WebServer(create_app(console), LOOPBACK, 0)
    server.start()
    try:
        url = f"http://{LOOPBACK}:{server.port}/api/v1/jobs"
        for host, expected in (
            ("attacker.example", 400),
            (f"attacker.example:{server.port}", 400),
            ("", 400),
            (f"localhost:{server.port}", 200),
            (f"127.0.0.1:{server.port}", 200),
        ):
            req = urllib.request.Request(url, headers={"Host": host})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    code = r.status
            except urllib.error.HTTPError as exc:
                code = exc.code
            assert code == expected, host
    finally:
        server.stop()
        ledger.close()


def test_actions_refused_without_a_token_file(tmp_path: Path) -> None:
    server, ledger = _in_process_server(tmp_path, None, reads_need_token=False)
    try:
        http = Http(server.url.rstrip("/"))
        assert http.json("/api/v1/jobs")["total"] == 0  # loopback reads: open
        code, body, _ = http.request("/api/v1/jobs/1/retry", "POST", "anything-at-all")
        assert code == 401 and "web.token_file" in json.loads(body)["error"]
    finally:
        server.stop()
        ledger.close()


def web_certificate(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key, made with openssl."""
    openssl = require_tool("openssl")
    cert, key = tmp_path / "web.pem", tmp_path / "web.key"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


def test_https_with_the_node_certificate(tmp_path: Path) -> None:
    cert, key = web_certificate(tmp_path)
    from segnode.node.web.app import Access, Console, create_app
    from segnode.node.web.server import WebServer, https_context
    from segnode.storage.ledger import Ledger

    ledger = Ledger(tmp_path / "ledger.sqlite")
    tls = TLSConfig(cert_file=cert, key_file=key, min_version="1.2")
    app = create_app(Console(ledger, tmp_path, Access(TOKEN), lambda: {}, lambda: (True, "ready")))
    server = WebServer(app, LOOPBACK, 0, https_context(tls))
    server.start()
    try:
        assert server.url.startswith("https://")
        http = Http(server.url.rstrip("/"), ssl.create_default_context(cafile=str(cert)))
        assert http.json("/healthz") == {"ok": True}
        with pytest.raises(OSError):  # plain HTTP gets no answer
            urllib.request.urlopen(f"http://{LOOPBACK}:{server.port}/healthz", timeout=5)
    finally:
        server.stop()
        ledger.close()
    with pytest.raises(ConfigError, match="tls.cert_file"):
        https_context(TLSConfig(cert_file=key, key_file=key))


# -- config ----------------------------------------------------------------------------------


def test_web_config_defaults_and_listen() -> None:
    web = from_dict({}).web
    assert (web.enabled, web.host, web.port, web.token_file, web.tls) == (
        False,
        "127.0.0.1",
        8080,
        None,
        False,
    )
    cfg = from_dict({"web": {"enabled": True, "listen": "[::1]:9000"}}).web
    assert (cfg.host, cfg.port, cfg.loopback) == ("::1", 9000, True)
    assert from_dict({"web": {"enabled": True, "listen": "localhost:1"}}).web.loopback


@pytest.mark.parametrize(
    ("web", "message"),
    [
        ({"enabled": True, "listen": "0.0.0.0:8080"}, "web.token_file: required"),
        ({"enabled": True, "listen": "console.example:8080"}, "web.token_file: required"),
        ({"listen": "8080"}, "web.listen"),
        ({"listen": "127.0.0.1:99999"}, "web.listen"),
        ({"enabled": True, "token_file": "/nonexistent/token"}, "web.token_file: file not found"),
        ({"enabled": True, "tls": True}, "tls.cert_file: required when web.tls"),
        ({"enabled": "yes"}, "web.enabled"),
        ({"port": 8080}, r"\[web\] unknown key"),
    ],
)
def test_web_config_errors_name_the_key(web: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict({"web": web})


def test_short_token_refused(tmp_path: Path) -> None:
    from segnode.node.web.server import read_token

    f = tmp_path / "token"
    f.write_text("short\n")
    cfg = from_dict({"web": {"enabled": True, "token_file": str(f)}}).web
    with pytest.raises(ConfigError, match="16"):
        read_token(cfg)
    f.write_text(TOKEN + "\nignored second line\n")
    assert read_token(cfg) == TOKEN


def test_web_address_in_use_stops_the_start(tmp_path: Path) -> None:
    """``segnode serve`` exits 1 naming web.listen; nothing was started."""
    import socket

    from scripts.harness import write_config

    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen(1)
        listen = f"{LOOPBACK}:{busy.getsockname()[1]}"
        cfg = write_config(
            tmp_path / "config.toml",
            tmp_path / "data",
            free_port(),
            web={"enabled": True, "listen": listen},
        )
        out = subprocess.run(
            [sys.executable, "-m", "segnode.node.ops.cli", "serve", "--config", str(cfg)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 1, out.stdout[-2000:]
    assert f"segnode: web.listen {listen}: cannot listen: Address already in use" in out.stderr
    assert "listening as" not in out.stdout


def test_node_runs_without_the_web_extra(tmp_path: Path) -> None:
    """With ``[web]`` off the node imports nothing of Starlette or uvicorn; with it on and
    the extra missing, the error says what to install."""
    script = f"""
import sys
for name in ("starlette", "uvicorn"):
    sys.modules[name] = None  # import fails as if not installed
from pathlib import Path
from segnode.node.config import from_dict
from segnode.node.errors import ConfigError
from segnode.node.ops.service import Node
node = Node(from_dict({{"data_dir": {str(tmp_path / "data")!r}}}))
node.shutdown()
try:
    Node(from_dict({{"data_dir": {str(tmp_path / "data2")!r}, "web": {{"enabled": True}}}}))
except ConfigError as exc:
    print("refused:", exc)
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert "refused: web.enabled = true needs the web extra" in out.stdout


def test_static_files_ship_in_the_wheel() -> None:
    """Every file of the page matches the package-data patterns of pyproject.toml."""
    import fnmatch
    import tomllib

    from segnode.node.web.app import STATIC

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setup["package-data"]["segnode.node.web"]
    files = [p.relative_to(STATIC.parent).as_posix() for p in STATIC.rglob("*") if p.is_file()]
    assert {"static/index.html", "static/app.js", "static/style.css"} <= set(files)
    for f in files:
        assert any(fnmatch.fnmatch(f, pat) for pat in patterns), f


def test_grafana_dashboard_uses_the_node_metrics(tmp_path: Path) -> None:
    """Every series the dashboard queries is one the node exports (names and stages)."""
    from segnode.node.ops.metrics import STAGES, Metrics
    from segnode.storage.ledger import Ledger

    ledger = Ledger(tmp_path / "ledger.sqlite")
    gauges = {"segnode_streaming_bytes": lambda: 0, "segnode_streaming_series": lambda: 0}
    exported: set[str] = set()
    for family in Metrics(ledger, gauges).registry.collect():
        if family.type == "counter":
            exported.add(family.name + "_total")
        elif family.type == "histogram":
            exported |= {family.name + s for s in ("_bucket", "_sum", "_count")}
        else:
            exported.add(family.name)
    ledger.close()
    dash = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {name for e in exprs for name in re.findall(r"segnode_[a-z_]+", e)}
    assert used <= exported, used - exported
    assert {"segnode_stage_seconds_bucket", "segnode_jobs_finished_total"} <= used
    stages = set(re.findall(r'stage="(\w+)"', " ".join(exprs)))
    assert stages and stages <= {s for s, *_ in STAGES} | {"delivery"}


def test_a_job_finishing_again_after_a_retry_adds_only_what_it_ran_again(
    tmp_path: Path,
) -> None:
    """Failed in delivery, retried, sent: its receive, inference and encode intervals are
    observed once; the new delivery and both finishes (failed, sent) are counted."""
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from segnode.node.ops.metrics import Metrics
    from segnode.storage.ledger import Ledger

    ledger = Ledger(tmp_path / "ledger.sqlite")
    metrics = Metrics(ledger)
    t = datetime(2026, 12, 5, 4, 0, tzinfo=UTC)
    stages = {
        key: t + timedelta(seconds=i)
        for i, key in enumerate(
            ("first_instance", "last_instance", "queued", "started", "volume", "inference")
        )
    }
    stages |= {"encoded": t + timedelta(seconds=7), "finished": t + timedelta(seconds=60)}
    failed = SimpleNamespace(id=7, state="failed", stages=stages, delivery_acks=[None])
    sent_at = t + timedelta(seconds=90)
    again = {**stages, "finished": sent_at}
    sent = SimpleNamespace(id=7, state="sent", stages=again, delivery_acks=[sent_at])

    def count(stage: str) -> float:
        value = metrics.registry.get_sample_value("segnode_stage_seconds_count", {"stage": stage})
        return value or 0.0

    metrics.observe_job(failed)  # type: ignore[arg-type]
    before = {s: count(s) for s in ("receive", "inference", "encode", "total", "delivery")}
    metrics.observe_job(sent)  # type: ignore[arg-type]
    assert count("inference") == before["inference"] == 1
    assert count("receive") == count("encode") == 1
    assert count("total") == before["total"] + 1  # last instance -> finished: a new interval
    assert count("delivery") == before["delivery"] + 1 == 1
    finished = "segnode_jobs_finished_total"
    assert metrics.registry.get_sample_value(finished, {"state": "failed"}) == 1
    assert metrics.registry.get_sample_value(finished, {"state": "sent"}) == 1
    ledger.close()


# -- the preview -----------------------------------------------------------------------------


def test_preview_draws_segments_in_their_colours(tmp_path: Path) -> None:
    from segnode.node.ingest.volume import assemble_volume
    from segnode.node.web.preview import SegmentInfo, render

    files = write_synthetic_series(
        tmp_path / "ct", PhantomGeometry(rows=48, columns=64, slices=10), seed=46
    )
    volume = assemble_volume(files)
    labels = np.zeros(volume.hu.shape, dtype=np.uint8)
    labels[3:7, 20:28, 40:50] = 2  # off-centre: the views pass through it
    image = render(volume, labels, [SegmentInfo(2, "lesion", (255, 0, 0), 1.25)])
    rgb = np.asarray(image.convert("RGB")).astype(int)
    red = (rgb[..., 0] - rgb[..., 1] > 60) & (rgb[..., 0] - rgb[..., 2] > 60)
    third = rgb.shape[1] // 3
    for view in range(3):  # the segment shows in the axial, coronal and sagittal view
        assert red[: 256 + 8, view * third : (view + 1) * third].sum() > 20, view
    empty = render(volume, np.zeros_like(labels), [])
    assert not (np.asarray(empty.convert("RGB"))[..., 0].astype(int) > 200).sum() > 10_000
    with pytest.raises(ValueError, match="does not match"):
        render(volume, labels[:-1], [])


@pytest.mark.parametrize("kind", ["BINARY", "LABELMAP"])
def test_sr_volumes_read_back(tmp_path: Path, kind: str) -> None:
    """The legend's volumes are the SR's: the worker's measurement groups, by segment; the
    preview reads both kinds of SEG."""
    import pydicom

    from segnode.engines.manifest_parse import load_manifest
    from segnode.engines.ort_backend import OrtEngine
    from segnode.node.config import DEFAULT_MODEL
    from segnode.node.pipeline.engine_pool import EnginePool
    from segnode.node.pipeline.worker import Worker, result_paths
    from segnode.node.web.preview import Previewer, segment_infos, sr_volumes
    from segnode.storage.ledger import Ledger
    from segnode.storage.spool import Spool
    from tests.test_worker import ingest

    engine = OrtEngine()
    engine.load(load_manifest(DEFAULT_MODEL))
    ledger = Ledger(tmp_path / "ledger.sqlite")
    cfg = from_dict({"results": {"segmentation_type": kind}})
    cfg = replace(cfg, data_dir=tmp_path)
    worker = Worker(cfg, ledger, EnginePool.of_config(cfg, engine, load_manifest(DEFAULT_MODEL)))
    files = write_synthetic_series(
        tmp_path / "in", PhantomGeometry(rows=64, columns=64, slices=8), seed=47
    )
    uid = ingest(ledger, Spool(tmp_path / "spool"), files)
    jid = ledger.create_job(uid, trigger="test", model="tissue", engine="onnxruntime")
    assert jid is not None and worker.run_once()
    seg_path, sr_path = result_paths(tmp_path, jid)
    seg, sr = pydicom.dcmread(seg_path), pydicom.dcmread(sr_path)
    volumes = sr_volumes(sr)
    numbers = {int(s.SegmentNumber) for s in seg.SegmentSequence} - {0}  # LABELMAP background
    assert set(volumes) == numbers and all(v > 0 for v in volumes.values())
    infos = segment_infos(seg, sr)
    assert [i.volume_ml for i in infos] == [volumes[i.number] for i in infos]
    assert all(max(i.rgb) > 0 for i in infos)
    assert Previewer(tmp_path, ledger).missing() == [jid]  # drawn at the next start
    path = Previewer(tmp_path, ledger).render_job(jid)
    assert Previewer(tmp_path, ledger).missing() == []
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    rgb = np.asarray(Image.open(path).convert("RGB")).astype(int)
    views = rgb[: 256 + 16]  # above the legend (its colour swatches do not count)
    assert ((views.max(axis=2) - views.min(axis=2)) > 60).sum() > 1000
    assert Previewer(tmp_path, ledger).render_job(999) is None
    ledger.close()
    engine.close()
