// The verst dashboard: the job list, a job's live curves and events, the cluster, and the job
// buttons. Plain ES modules over the api's REST routes; the token (when the api has one) is asked
// once, kept in localStorage and sent as `Authorization: Bearer`. The event stream is read with
// fetch() rather than EventSource, which cannot send that header.
import { LineChart, format } from "./chart.js";
import { parseSpec } from "./yaml.js";

const TOKEN_KEY = "verst-token";
const LIST_EVERY_MS = 2000;
const RECONNECT_MS = 2000; // wait before resuming a dropped event stream
const MAX_EVENTS = 300; // events kept on the page
const TERMINAL = new Set(["JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED"]);
const $ = (id) => document.getElementById(id);

// Which metrics each chart plots ("source/name", as the job reports them).
const CHARTS = [
  ["reward", ["trainer/reward_mean", "trainer/verifier_reward_mean", "eval/reward_mean"]],
  ["held-out accuracy and pass@k", ["eval/accuracy", /^eval\/pass@\d+$/, /^eval\/mean@\d+$/]],
  ["KL and train/rollout mismatch", ["trainer/kl", "trainer/approx_kl", "trainer/mismatch_kl"]],
  ["entropy", ["trainer/entropy"]],
  ["response tokens per step", ["trainer/response_tokens"]],
  ["step time (s) by stage", ["trainer/step_seconds", "trainer/wait_seconds", "trainer/optimise_seconds",
    "trainer/publish_seconds", "trainer/checkpoint_seconds", "trainer/stage_generate_s",
    "trainer/stage_score_s"]],
  ["weight sync (s)", ["rollout/weight_load_s", "rollout/weight_sync_latency_s"]],
];

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  const token = localStorage.getItem(TOKEN_KEY);
  if (token) headers.set("Authorization", `Bearer ${token}`);
  const response = await fetch(path, { ...options, headers });
  if (response.status === 401) askToken();
  return response;
}

async function apiJson(path, options) {
  const response = await api(path, options);
  const body = response.headers.get("content-type")?.includes("json") ? await response.json() : null;
  if (!response.ok) throw new Error(`${response.status}: ${detail(body) || response.statusText}`);
  return body;
}

function detail(body) {
  if (!body || body.detail === undefined) return "";
  if (typeof body.detail === "string") return body.detail;
  return body.detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("\n");
}

function askToken() {
  $("token-form").hidden = false;
  $("token-input").focus();
}

function setStatus(text) { $("status").textContent = text; }

// ---- the job list ----

async function refreshList() {
  try {
    const { jobs } = await apiJson("/v1/jobs?limit=100");
    const rows = jobs.map((job) => {
      const row = document.createElement("tr");
      row.dataset.job = job.job_id;
      row.dataset.state = job.state;
      const link = `<a href="#/job/${encodeURIComponent(job.job_id)}">${escape(job.job_id)}</a>`;
      row.innerHTML = `<td>${link}</td><td><span class="state ${job.state}">${stateName(job.state)}</span></td>`
        + `<td class="num">${job.policy_version}</td><td class="num">${job.step}</td>`
        + `<td class="num">${format(job.metrics["trainer/reward_mean"])}</td>`
        + `<td class="num">${format(job.metrics["eval/accuracy"])}</td>`;
      return row;
    });
    $("jobs").tBodies[0].replaceChildren(...rows);
    setStatus(`${jobs.length} jobs`);
  } catch (err) {
    setStatus(String(err));
  }
}

async function refreshCluster() {
  try {
    const { engines, trainers } = await apiJson("/v1/cluster");
    const engineRows = engines.map((e) => `<tr data-kind="engine"><td>${escape(e.engine_id)}</td><td>${escape(e.backend)}</td>`
      + `<td>${escape(e.job_id) || "–"}</td><td class="num">v${e.policy_version}</td><td>${stateName(e.state)}</td>`
      + `<td class="num">${e.running_requests} running, ${e.queued_requests} queued</td></tr>`);
    const trainerRows = trainers.map((t) => `<tr data-kind="trainer" data-job="${escape(t.job_id)}"><td>${escape(t.trainer_id)}</td><td>trainer</td>`
      + `<td>${escape(t.job_id) || "idle"}</td><td class="num">${t.job_id ? `v${t.policy_version}` : ""}</td>`
      + `<td>${t.job_id ? `step ${t.step}` : ""}</td><td class="num">heard ${t.idle_s.toFixed(1)}s ago</td></tr>`);
    $("cluster").innerHTML = `<table><thead><tr><th>engine / trainer</th><th>kind</th><th>job</th>`
      + `<th>version</th><th>state</th><th>load</th></tr></thead><tbody>`
      + `${engineRows.join("")}${trainerRows.join("")}</tbody></table>`;
  } catch (err) {
    $("cluster").textContent = String(err);
  }
}

async function submitSpec() {
  const out = $("submit-result");
  let spec;
  try {
    spec = parseSpec($("spec").value);
  } catch (err) {
    out.textContent = `not a spec: ${err.message}`;
    return;
  }
  try {
    const job = await apiJson("/v1/jobs", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(spec),
    });
    out.textContent = `submitted ${job.job_id}`;
    location.hash = `#/job/${encodeURIComponent(job.job_id)}`;
  } catch (err) {
    out.textContent = String(err.message);
  }
}

// ---- a job's page ----

let current = null; // { id, abort, charts }

function openJob(jobId) {
  closeJob();
  const charts = $("charts");
  charts.replaceChildren();
  current = { id: jobId, abort: new AbortController(), charts: CHARTS.map(([t, n]) => new LineChart(charts, t, n)) };
  $("job-title").textContent = jobId;
  $("events").replaceChildren();
  $("export-result").textContent = "";
  refreshJob(jobId);
  loadCheckpoints(jobId);
  loadLogs(jobId);
  follow(current);
}

function closeJob() {
  if (current) current.abort.abort();
  current = null;
}

async function refreshJob(jobId) {
  try {
    showState(await apiJson(`/v1/jobs/${encodeURIComponent(jobId)}`));
  } catch (err) {
    $("job-reason").textContent = String(err.message);
  }
}

function showState(job) {
  const state = $("job-state");
  state.textContent = stateName(job.state);
  state.className = `state ${job.state}`;
  state.dataset.state = job.state;
  if (job.policy_version !== undefined) $("job-version").textContent = `version ${job.policy_version}, step ${job.step}`;
  $("job-reason").textContent = job.reason || "";
  $("cancel").disabled = TERMINAL.has(job.state);
}

/** Read the job's events until its stream ends, resuming after a drop with Last-Event-ID. */
async function follow(view) {
  let lastId = null;
  while (!view.abort.signal.aborted) {
    try {
      const headers = { Accept: "text/event-stream" };
      if (lastId) headers["Last-Event-ID"] = lastId;
      const response = await api(`/v1/jobs/${encodeURIComponent(view.id)}/events`, { headers, signal: view.abort.signal });
      if (!response.ok) throw new Error(`events: ${response.status}`);
      let ended = false;
      for await (const event of sseEvents(response.body)) {
        lastId = event.id || lastId;
        ended = handle(view, event.type, JSON.parse(event.data)) || ended;
      }
      if (ended) return; // the stream of a finished job ends after its terminal state
    } catch (err) {
      if (view.abort.signal.aborted) return;
      setStatus(`event stream: ${err.message}; reconnecting`);
    }
    await new Promise((resolve) => setTimeout(resolve, RECONNECT_MS));
  }
}

/** Server-Sent Events from a response body: { id, type, data } per event (comments skipped). */
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = { id: "", type: "message", data: [] };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const lines = buffer.split(/\r\n|\r|\n/);
    buffer = lines.pop();
    for (const line of lines) {
      if (line === "") {
        if (event.data.length) yield { ...event, data: event.data.join("\n") };
        event = { id: "", type: "message", data: [] };
        continue;
      }
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "data") event.data.push(text);
      else if (field === "id") event.id = text;
      else if (field === "event") event.type = text;
    }
  }
}

/** Apply one event to the page; true for the job's terminal state event. */
function handle(view, kind, data) {
  if (kind === "metrics" || kind === "evaluation") {
    for (const [name, value] of Object.entries(data.values)) {
      const key = `${data.source}/${name}`;
      for (const chart of view.charts) if (chart.wants(key)) chart.add(key, data.step, value);
    }
    if (kind === "evaluation" || data.source === "trainer") refreshJob(view.id);
  }
  if (kind === "state") showState({ state: data.state, reason: data.reason });
  if (kind !== "metrics") addEvent(data, kind);
  return kind === "state" && TERMINAL.has(data.state);
}

function addEvent(data, kind) {
  const item = document.createElement("li");
  const time = new Date(data.time * 1000).toLocaleTimeString();
  const what = {
    state: () => `${stateName(data.state)} ${data.reason || ""}`,
    evaluation: () => `evaluation at step ${data.step}: ${Object.entries(data.values)
      .map(([k, v]) => `${k} ${format(v)}`).join(", ")}`,
    warning: () => `warning: ${data.message}`,
    dead_letter: () => `dead letter from ${data.source_stream}: ${data.reason}`,
  }[kind];
  item.textContent = `${time} ${what ? what() : kind}`;
  item.dataset.kind = kind;
  const list = $("events");
  list.prepend(item);
  while (list.children.length > MAX_EVENTS) list.lastChild.remove();
}

async function cancelJob() {
  if (!current) return;
  try {
    showState(await apiJson(`/v1/jobs/${encodeURIComponent(current.id)}/cancel`, { method: "POST" }));
  } catch (err) {
    $("job-reason").textContent = String(err.message);
  }
}

async function exportJob() {
  if (!current) return;
  const version = $("export-version").value.trim();
  const body = { out_dir: $("export-dir").value.trim(), version: version ? Number(version) : null };
  try {
    const done = await apiJson(`/v1/jobs/${encodeURIComponent(current.id)}/export`, {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    $("export-result").textContent = `wrote version ${done.version} (${done.kind}) to ${done.out_dir}`;
  } catch (err) {
    $("export-result").textContent = String(err.message);
  }
}

// The checkpoint and log routes may be absent from an older api: a 404 says so, quietly.
async function loadCheckpoints(jobId) {
  const box = $("checkpoints");
  const response = await api(`/v1/jobs/${encodeURIComponent(jobId)}/checkpoints`).catch(() => null);
  if (!response || !response.ok) {
    box.textContent = response?.status === 404 ? "no checkpoints listed" : "checkpoints unavailable";
    return;
  }
  const body = await response.json();
  const items = Array.isArray(body) ? body : body.checkpoints || body.versions || [];
  box.replaceChildren(...items.map((item) => {
    const version = typeof item === "object" ? item.version : item;
    const button = document.createElement("button");
    button.textContent = `download v${version}`;
    button.onclick = () => download(`/v1/jobs/${encodeURIComponent(jobId)}/checkpoints/${version}/archive`,
      `${jobId}-v${version}.tar.gz`);
    return button;
  }));
}

async function download(path, name) {
  const response = await api(path);
  if (!response.ok) { setStatus(`download: ${response.status}`); return; }
  const url = URL.createObjectURL(await response.blob());
  const link = Object.assign(document.createElement("a"), { href: url, download: name });
  link.click();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}

async function loadLogs(jobId) {
  const response = await api(`/v1/jobs/${encodeURIComponent(jobId)}/logs?lines=50`).catch(() => null);
  const box = $("logs");
  if (!response || !response.ok) { box.textContent = "no logs served"; return; }
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    box.textContent = (Array.isArray(body) ? body : body.lines || []).join("\n");
  } catch {
    box.textContent = text;
  }
}

// ---- wiring ----

function stateName(state) { return String(state || "").replace("JOB_STATE_", "").replace("ENGINE_STATE_", ""); }

function escape(text) {
  return String(text ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function route() {
  const match = location.hash.match(/^#\/job\/(.+)$/);
  $("list-page").hidden = Boolean(match);
  $("job-page").hidden = !match;
  if (match) openJob(decodeURIComponent(match[1]));
  else { closeJob(); refreshList(); refreshCluster(); }
}

$("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  localStorage.setItem(TOKEN_KEY, $("token-input").value.trim());
  $("token-form").hidden = true;
  route();
});
$("token-button").onclick = askToken;
$("submit").onclick = submitSpec;
$("cancel").onclick = cancelJob;
$("export").onclick = exportJob;
window.addEventListener("hashchange", route);
setInterval(() => {
  if (!current && !document.hidden) { refreshList(); refreshCluster(); }
}, LIST_EVERY_MS);
route();
