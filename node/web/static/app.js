// segnode console: reads /api/v1, refreshes itself; no framework, no CDN.
// Every value from the node is put on the page as text (textContent), never as HTML.
"use strict";

const REFRESH_MS = Number(new URLSearchParams(location.search).get("refresh") || 3000);
const PAGE = 25;
const STAGES = [
  // [css name, label, from stage, to stage]
  ["received", "received", "first_instance", "last_instance"],
  ["complete", "complete", "last_instance", "queued"],
  ["queue", "queue", "queued", "started"],
  ["volume", "volume", "started", "volume"],
  ["inference", "inference", "volume", "inference"],
  ["encoded", "encoded", "inference", "encoded"],
];
const ACTIVE = new Set(["queued", "running", "encoded"]);
const NEEDS_TOKEN = "this console needs the bearer token";

let offset = 0;
let selected = null;          // job id shown in the detail panel
let previewFor = null;        // job id whose preview is loaded
let timer = null;

function token() { return sessionStorage.getItem("segnode-token") || ""; }

function headers() {
  const t = token();
  return t ? { Authorization: "Bearer " + t } : {};
}

async function api(path, options = {}) {
  const r = await fetch(path, { ...options, headers: { ...headers(), ...(options.headers || {}) } });
  let body = null;
  const type = r.headers.get("content-type") || "";
  if (type.includes("json")) body = await r.json();
  return { status: r.status, ok: r.ok, body, response: r };
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function time(iso) { return iso ? Date.parse(iso + (iso.endsWith("Z") ? "" : "Z")) : null; }

function seconds(ms) { return (ms / 1000).toFixed(ms < 10000 ? 2 : 1) + " s"; }

function shortUid(uid) { return uid && uid.length > 24 ? "\u2026" + uid.slice(-22) : uid || ""; }

function message(text, kind) {
  const m = document.getElementById("message");
  m.textContent = text;
  m.className = kind || "";
}

function timeline(job) {
  const st = job.stages;
  const start = time(st.first_instance) ?? time(st.last_instance) ?? time(st.queued);
  const bar = el("div", { class: "timeline", "data-job": job.id });
  if (start === null) return bar;
  const ends = Object.values(st).map(time).filter((t) => t !== null);
  for (const d of job.deliveries) if (d.acked_at) ends.push(time(d.acked_at));
  if (ACTIVE.has(job.state)) ends.push(Date.now());
  const span = Math.max(1, Math.max(...ends) - start);
  const place = (a, b, cls, title, stage) => {
    const left = ((a - start) / span) * 100;
    const width = Math.max(0.4, ((b - a) / span) * 100);
    const seg = el("div", { class: "seg " + cls, "data-stage": stage, title });
    seg.style.left = left.toFixed(2) + "%";  // CSSOM, not a style attribute (the CSP has no unsafe-inline)
    seg.style.width = width.toFixed(2) + "%";
    bar.append(seg);
  };
  for (const [cls, label, from, to] of STAGES) {
    const a = time(st[from]);
    const b = time(st[to]);
    if (a !== null && b !== null && b >= a) place(a, b, "st-" + cls, `${label} ${seconds(b - a)}`, cls);
  }
  const encoded = time(st.encoded);
  for (const d of job.deliveries) {
    const a = time(d.sending_at) ?? encoded;
    const b = time(d.acked_at) ?? (d.status === "failed" ? time(st.finished) : null);
    if (a === null || b === null || b < a) continue;
    const failed = d.status !== "sent";
    const what = `${d.kind} \u2192 ${d.destination}: ${d.status}` + (failed ? "" : ` ${seconds(b - a)}`);
    place(a, b, "delivery " + (failed ? "st-delivery-failed" : "st-delivery"), what, "delivery");
  }
  const total = time(st.finished) ?? (ACTIVE.has(job.state) ? Date.now() : null);
  if (total !== null) bar.title = `${seconds(total - start)} from the first instance`;
  return bar;
}

function actionButtons(job) {
  const cell = el("td", { class: "actions" });
  if (job.state === "failed" || job.state === "cancelled") {
    cell.append(el("button", { type: "button", class: "retry", "data-job": job.id, onclick: (ev) => act(ev, job.id, "retry") }, "Retry"));
  }
  if (ACTIVE.has(job.state)) {
    cell.append(el("button", { type: "button", class: "cancel danger", "data-job": job.id, onclick: (ev) => act(ev, job.id, "cancel") }, "Cancel"));
  }
  return cell;
}

async function act(ev, id, what) {
  ev.stopPropagation();
  const r = await api(`/api/v1/jobs/${id}/${what}`, { method: "POST" });
  if (r.ok) message(`job ${id}: ${what} done, now ${r.body.state}`, "ok");
  else if (r.status === 401) message(`job ${id}: ${what} needs the bearer token (${r.body?.error || "401"})`, "error");
  else message(`job ${id}: ${r.body?.error || r.status}`, "error");
  refresh();
}

let lastPage = "";

function renderJobs(page) {
  // Rows are rebuilt only when something changed (or a job is active: its bar grows), so
  // that a click does not land on a row that is being replaced.
  const key = JSON.stringify(page) + selected;
  if (key === lastPage && !page.jobs.some((j) => ACTIVE.has(j.state))) return;
  lastPage = key;
  const body = document.querySelector("#jobs tbody");
  body.replaceChildren();
  for (const job of page.jobs) {
    const row = el("tr", { id: `job-${job.id}`, class: "job" + (job.id === selected ? " selected" : ""), "data-state": job.state, onclick: () => select(job.id) },
      el("td", { text: String(job.id) }),
      el("td", {}, el("span", { class: `state state-${job.state}`, text: job.state })),
      el("td", { class: "uid", title: job.series, text: shortUid(job.series) }),
      el("td", { text: job.model_name === "default" ? job.model : `${job.model_name}: ${job.model}` }),
      el("td", { text: job.trigger }),
      el("td", { text: String(job.instances) }),
      el("td", {}, timeline(job)),
      el("td", { class: "reason", text: job.reason || "" }),
      actionButtons(job));
    body.append(row);
  }
  const last = Math.min(page.total, page.offset + page.jobs.length);
  document.getElementById("page").textContent = page.total ? `${page.offset + 1}\u2013${last} of ${page.total}` : "no jobs";
  document.getElementById("prev").disabled = page.offset === 0;
  document.getElementById("next").disabled = last >= page.total;
  const ignored = document.querySelector("#ignored tbody");
  ignored.replaceChildren(...page.ignored.map((s) => el("tr", {},
    el("td", { class: "uid", title: s.series, text: s.series }), el("td", { text: s.calling_ae }), el("td", { class: "reason", text: s.reason }))));
  const waiting = document.querySelector("#waiting tbody");
  waiting.replaceChildren(...page.waiting.map((s) => el("tr", {},
    el("td", { class: "uid", title: s.series, text: s.series }), el("td", { text: String(s.instances) }),
    el("td", { text: new Date(time(s.pending_since)).toLocaleTimeString() }), el("td", { text: s.held || "" }))));
}

function renderStatus(s) {
  const e = s.engine;
  const engine = e.failure ? `failed: ${e.failure}` : e.loading ? `${e.name} (loading)` : e.name;
  const gib = (b) => (b / 2 ** 30).toFixed(1) + " GiB";
  const facts = [
    ["listening", `${s.listening.ae_title} @ ${s.listening.host}:${s.listening.port ?? "-"}` + (s.listening.tls_port ? ` (TLS ${s.listening.tls_port})` : "")],
    ["engine", engine],
    ["model", `${e.model.name} ${e.model.version}`],
    ["queue", `${s.queue.depth} (running: ${s.queue.current_job ?? "none"})`],
    ["by priority", Object.entries(s.queue.queued_by_priority || {}).map(([p, n]) => `${n} at ${p}`).join(", ") || "none queued"],
    ["models", `busy ${s.queue.model_busy_pct} % of the last minute` + (s.queue.gpu_busy_pct != null ? `, GPU ${s.queue.gpu_busy_pct} %` : "") + `, ${s.queue.lanes} lane(s), ${s.queue.model_slots} model slot(s)` + (s.queue.in_model && s.queue.in_model.length ? `, in the models: job ${s.queue.in_model.join(", ")}` : "")],
    ["expected wait", s.queue.expected_wait_s != null ? `${s.queue.expected_wait_s} s` : "unknown yet"],
    ["last result", s.queue.last_result],
    ["outbox", `${s.outbox.pending} pending, ${s.outbox.failed} failed`],
    ["disk free", s.disk.free_bytes !== undefined ? `${gib(s.disk.free_bytes)} of ${gib(s.disk.total_bytes)}` : s.disk.error],
    ["healthy", s.healthy ? "yes" : "no"],
  ];
  document.getElementById("status").replaceChildren(...facts.map(([k, v]) => el("div", { "data-fact": k }, el("b", { text: k }), String(v))));
  const dests = document.getElementById("destinations");
  dests.replaceChildren(...(s.destinations.length ? [el("b", { text: "destinations: " })] : []),
    ...s.destinations.map((d) => el("span", { class: `breaker-${d.breaker}`, title: `breaker ${d.breaker}` }, `${d.name} (${d.breaker}) `)));
  // A shared ledger: every node on it, alive or gone, and what it runs.
  const nodes = s.ledger.nodes || [];
  document.getElementById("nodes").replaceChildren(...(nodes.length > 1 ? [el("b", { text: "nodes: " })] : []),
    ...(nodes.length > 1 ? nodes : []).map((n) => el("span", { class: n.alive ? "node-alive" : "node-gone", title: `${n.address}, heartbeat ${n.heartbeat_at}` },
      `${n.name}${n.name === s.node_name ? " (this)" : ""} (${n.alive ? `alive, ${n.running_jobs} running` : "gone"}) `)));
  document.getElementById("summary").textContent =
    `${s.listening.ae_title} \u00b7 ${engine} \u00b7 queue ${s.queue.depth} \u00b7 outbox ${s.outbox.pending}`;
}

async function loadPreview(id, facts) {
  const img = document.getElementById("preview");
  const none = document.getElementById("preview-none");
  if (!facts.preview) {
    img.hidden = true;
    none.textContent = ACTIVE.has(facts.state) || facts.state === "sent" || facts.state === "done" ? "no preview yet" : "no preview";
    previewFor = null;
    return;
  }
  if (previewFor === id) return;
  const r = await fetch(facts.preview, { headers: headers() });
  if (!r.ok) return;
  const url = URL.createObjectURL(await r.blob());
  if (img.src.startsWith("blob:")) URL.revokeObjectURL(img.src);
  img.src = url;
  img.hidden = false;
  img.dataset.job = String(id);
  none.textContent = "";
  previewFor = id;
}

async function renderDetail() {
  const section = document.getElementById("detail");
  if (selected === null) { section.hidden = true; return; }
  const r = await api(`/api/v1/jobs/${selected}`);
  if (!r.ok) { section.hidden = true; return; }
  const j = r.body;
  section.hidden = false;
  document.getElementById("detail-id").textContent = String(j.id);
  const facts = [
    ["state", j.state], ["reason", j.reason || ""], ["series", j.series], ["version", j.version],
    ["calling AE", j.calling_ae], ["rule", j.rule], ["model", `${j.model_name}: ${j.model}`],
    ["trigger", j.trigger], ["attempts", j.attempts], ["node", j.node || ""], ["SEG", j.seg_sop_uid], ["SR", j.sr_sop_uid],
  ];
  for (const [k, v] of Object.entries(j.stages)) if (v) facts.push([k, new Date(time(v)).toISOString()]);
  document.getElementById("detail-facts").replaceChildren(...facts.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: String(v) })]));
  document.querySelector("#detail-deliveries tbody").replaceChildren(...j.deliveries.map((d) => el("tr", {},
    el("td", { text: d.kind }), el("td", { text: d.destination }), el("td", { text: d.status }),
    el("td", { text: String(d.attempts) }), el("td", { text: d.send_s === null ? "" : d.send_s.toFixed(3) + " s" }),
    el("td", { class: "reason", text: d.last_error || "" }))));
  await loadPreview(j.id, j);
}

function select(id) {
  selected = id;
  previewFor = null;
  refresh();
}

async function refresh() {
  clearTimeout(timer);
  try {
    const state = document.getElementById("state-filter").value;
    const q = new URLSearchParams({ limit: PAGE, offset });
    if (state) q.set("state", state);
    const [status, jobs] = await Promise.all([api("/api/v1/status"), api(`/api/v1/jobs?${q}`)]);
    if (status.status === 401 || jobs.status === 401) {
      message(NEEDS_TOKEN, "error");
    } else {
      if (document.getElementById("message").textContent === NEEDS_TOKEN) message("");
      if (status.ok) renderStatus(status.body);
      if (jobs.ok) renderJobs(jobs.body);
      await renderDetail();
      document.getElementById("refreshed").textContent = "updated " + new Date().toLocaleTimeString();
    }
  } catch (err) {
    document.getElementById("refreshed").textContent = "node not answering: " + err;
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

function init() {
  const legend = document.getElementById("timeline-legend");
  for (const [cls, label] of [...STAGES, ["delivery", "delivery"], ["delivery-failed", "delivery failed"]]) {
    legend.append(el("span", {}, el("i", { class: "st-" + cls }), label));
  }
  document.getElementById("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem("segnode-token", document.getElementById("token").value.trim());
    document.getElementById("token").value = "";
    document.getElementById("token-state").textContent = token() ? "token set" : "";
    refresh();
  });
  document.getElementById("token-state").textContent = token() ? "token set" : "";
  document.getElementById("state-filter").addEventListener("change", () => { offset = 0; refresh(); });
  document.getElementById("prev").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); refresh(); });
  document.getElementById("next").addEventListener("click", () => { offset += PAGE; refresh(); });
  document.getElementById("detail-close").addEventListener("click", () => { selected = null; refresh(); });
  refresh();
}

init();
