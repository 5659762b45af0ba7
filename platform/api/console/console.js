// The tinkerflow console (docs/console.md). Plain browser JavaScript, no build step. Every number on the page comes
// from /api/v1 with the tab's API key as X-API-Key; text from the server goes into the page as text (textContent),
// never as markup.
"use strict";

const KEY = "tinkerflow.apiKey"; // sessionStorage: this tab only, gone when it closes
const PAGE = 25;
const METRICS_PAGE = 5000; // the metrics route's largest page
const POLL_MS = 5000;

const $ = (id) => document.getElementById(id);

class HttpError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

async function api(path) {
  const key = sessionStorage.getItem(KEY) || "";
  const res = await fetch(path, { headers: { "X-API-Key": key }, cache: "no-store", credentials: "omit" });
  if (!res.ok) {
    let detail = res.statusText;
    try {
      detail = (await res.json()).detail || detail;
    } catch (_) {
      /* a body that is not JSON: keep the status text */
    }
    throw new HttpError(res.status, detail);
  }
  return res.json();
}

function setStatus(text, bad) {
  const el = $("status");
  el.textContent = text || "";
  el.classList.toggle("error", !!bad);
}

// A failed call: a wrong key sends the person back to the form; anything else (the API restarting, Temporal down)
// is shown and retried by the next poll.
function failed(err) {
  if (err instanceof HttpError && err.status === 401) {
    sessionStorage.removeItem(KEY);
    showLogin("The server did not accept this key: " + err.message);
    return;
  }
  const what = err instanceof HttpError ? `HTTP ${err.status}: ${err.message}` : `API unreachable (${err.message})`;
  setStatus(what + " · retrying", true);
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  if (text instanceof Node) td.appendChild(text);
  else td.textContent = text === null || text === undefined ? "—" : String(text);
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function link(href, text) {
  const a = document.createElement("a");
  a.href = href;
  a.textContent = text;
  return a;
}

function fmtTime(iso) {
  if (!iso) return null;
  const d = new Date(iso);
  return isNaN(d) ? iso : d.toLocaleString();
}

function fmtBytes(n) {
  if (n === null || n === undefined) return null;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i++;
  }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fmtNum(x) {
  return x === null || x === undefined ? null : Number(x).toPrecision(5);
}

function fill(tbody, rows, emptyText, columns) {
  tbody.replaceChildren();
  if (!rows.length) {
    const tr = tbody.insertRow();
    const td = cell(tr, emptyText, "muted");
    td.colSpan = columns;
    return;
  }
  for (const r of rows) tbody.appendChild(r);
}

// --- sign-in -------------------------------------------------------------------------------------------------

function showLogin(message) {
  $("app").hidden = true;
  $("logout").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("key").focus();
}

function showApp() {
  $("login").hidden = true;
  $("app").hidden = false;
  $("logout").hidden = false;
}

function setUpLogin(start) {
  $("login").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, $("key").value.trim());
    $("key").value = "";
    try {
      await api("/api/v1/console/service"); // any keyed route: does the server take this key?
    } catch (err) {
      if (err instanceof HttpError && err.status === 401) {
        sessionStorage.removeItem(KEY);
        showLogin("The server did not accept this key: " + err.message);
        return;
      }
    }
    showApp();
    start();
  });
  $("logout").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    location.reload();
  });
  if (sessionStorage.getItem(KEY) === null) showLogin();
  else {
    showApp();
    start();
  }
}

// --- the runs page ---------------------------------------------------------------------------------------------

function pagedTable(name, url, render, columns, emptyText) {
  const state = { offset: 0, q: "" };
  const load = async () => {
    const params = new URLSearchParams({ offset: state.offset, limit: PAGE, q: state.q });
    const data = await api(`${url}?${params}`);
    const rows = data[name].map(render);
    fill($(`${name === "training_runs" ? "runs" : name}-table`).tBodies[0], rows, emptyText, columns);
    const id = name === "training_runs" ? "runs" : name;
    const last = Math.min(data.offset + data[name].length, data.total);
    $(`${id}-page`).textContent = data.total ? `${data.offset + 1}–${last} of ${data.total}` : "none";
    $(`${id}-prev`).disabled = data.offset === 0;
    $(`${id}-next`).disabled = last >= data.total;
  };
  const id = name === "training_runs" ? "runs" : name;
  $(`${id}-search`).addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.q = $(`${id}-q`).value;
    state.offset = 0;
    load().catch(failed);
  });
  $(`${id}-prev`).addEventListener("click", () => {
    state.offset = Math.max(0, state.offset - PAGE);
    load().catch(failed);
  });
  $(`${id}-next`).addEventListener("click", () => {
    state.offset += PAGE;
    load().catch(failed);
  });
  return load;
}

function runRow(r) {
  const tr = document.createElement("tr");
  tr.dataset.runId = r.training_run_id;
  cell(tr, link(`/console/runs/${encodeURIComponent(r.training_run_id)}`, r.training_run_id));
  cell(tr, r.session_id);
  cell(tr, r.base_model);
  cell(tr, r.status, `st-${r.status}`);
  cell(tr, r.step, "num");
  cell(tr, fmtNum(r.last_loss), "num");
  cell(tr, fmtTime(r.started));
  return tr;
}

function sessionRow(s) {
  const tr = document.createElement("tr");
  tr.dataset.sessionId = s.session_id;
  cell(tr, s.session_id);
  cell(tr, s.display_name);
  cell(tr, s.status, `st-${s.status}`);
  const runs = document.createElement("span");
  s.training_run_ids.forEach((id, i) => {
    if (i) runs.append(", ");
    runs.appendChild(link(`/console/runs/${encodeURIComponent(id)}`, id.split(":").slice(1).join(":")));
  });
  cell(tr, s.training_run_ids.length ? runs : null);
  cell(tr, s.samplers, "num");
  cell(tr, fmtTime(s.started));
  return tr;
}

function serviceRow(m) {
  const tr = document.createElement("tr");
  if (!m.answered) {
    cell(tr, m.coordinator);
    cell(tr, "not answering (busy or restarting)").colSpan = 7;
    return tr;
  }
  cell(tr, m.base_model);
  cell(tr, m.pool);
  cell(tr, m.workers.map((w) => `${w.worker_id}${w.busy ? " (busy)" : ""}`).join(", ") || "none", "workers");
  cell(tr, `${m.slots_used} / ${m.slots_total}`, "num");
  cell(tr, m.queued_samples, "num");
  cell(tr, m.queued_sample_tokens, "num");
  cell(tr, m.dispatched_batches, "num");
  const ui = link(m.temporal_ui_url, "Temporal UI");
  ui.target = "_blank";
  ui.rel = "noopener noreferrer";
  cell(tr, ui);
  return tr;
}

function byKind(values, fmt) {
  const entries = Object.entries(values || {});
  return entries.length ? entries.map(([k, v]) => `${k || "all"}: ${fmt(v)}`).join(" · ") : null;
}

function engineRow(e, i) {
  const tr = document.createElement("tr");
  cell(tr, `worker ${i + 1}`);
  if (!e.answered) {
    cell(tr, "its /metrics did not answer (restarting?)").colSpan = 5;
    return tr;
  }
  cell(tr, byKind(e.tokens_per_second, (v) => Math.round(v).toLocaleString()), "tps");
  cell(tr, byKind(e.mfu, (v) => `${(100 * v).toFixed(2)} %`));
  cell(tr, fmtBytes(e.device_memory_in_use_bytes), "num");
  cell(tr, fmtBytes(e.device_memory_peak_bytes), "num");
  cell(tr, fmtBytes(e.device_memory_limit_bytes), "num");
  return tr;
}

async function loadService() {
  const data = await api("/api/v1/console/service");
  fill($("service-table").tBodies[0], data.models.map(serviceRow), "no base model is served", 8);
  fill(
    $("engines-table").tBodies[0],
    data.engines.map(engineRow),
    "tokens/s: the API reads no JAX worker /metrics (start the worker with --metrics-port, or give " +
      "--worker-metrics-urls)",
    6,
  );
}

function runsPage() {
  const loadRuns = pagedTable("training_runs", "/api/v1/console/runs", runRow, 7, "no training runs");
  const loadSessions = pagedTable("sessions", "/api/v1/console/sessions", sessionRow, 6, "no sessions");
  const refresh = async () => {
    try {
      await Promise.all([loadService(), loadRuns(), loadSessions()]);
      setStatus(`updated ${new Date().toLocaleTimeString()}`);
      document.body.dataset.loaded = "1";
    } catch (err) {
      failed(err);
    }
  };
  refresh();
  setInterval(refresh, POLL_MS * 2);
}

// --- one run ---------------------------------------------------------------------------------------------------

function runPage() {
  const runId = decodeURIComponent(location.pathname.split("/").pop());
  $("run-id").textContent = runId;
  document.title = `${runId} · tinkerflow console`;
  const points = []; // every metrics point read so far, in index order
  let after = -1;
  let chosen = null;

  const facts = (run) => {
    const dl = $("run-facts");
    dl.replaceChildren();
    const add = (k, v) => {
      const dt = document.createElement("dt");
      dt.textContent = k;
      const dd = document.createElement("dd");
      dd.textContent = v === null || v === undefined ? "—" : String(v);
      dl.append(dt, dd);
    };
    add("status", run.status + (run.error ? ` (${run.error})` : ""));
    add("step", run.step);
    add("forward_backward calls", run.forward_backward_count);
    add("tokens seen", run.tokens_seen);
    add("last loss", fmtNum(run.last_loss));
    add("session", run.session_id);
    add("base model", `${run.base_model} (LoRA rank ${run.lora_rank})`);
    add("last request", fmtTime(run.last_request_time));
    if (run.recoveries) add("recoveries", run.recoveries);
    $("temporal-link").href = run.temporal_ui_url;
  };

  const checkpointRow = (c) => {
    const tr = document.createElement("tr");
    const code = document.createElement("code");
    code.textContent = c.tinker_path;
    cell(tr, code);
    cell(tr, c.checkpoint_type);
    cell(tr, fmtTime(c.time));
    cell(tr, fmtBytes(c.size_bytes), "num");
    cell(tr, c.expires_at ? fmtTime(c.expires_at) : "never");
    cell(tr, c.public ? "yes" : "no");
    return tr;
  };

  // Metric names seen, the chosen one kept across refreshes; "loss:sum" first when the run has it.
  const names = () => {
    const seen = new Set();
    for (const p of points) for (const [k, v] of Object.entries(p.metrics)) if (v !== null) seen.add(k);
    return [...seen].sort((a, b) => (a === "loss:sum" ? -1 : b === "loss:sum" ? 1 : a.localeCompare(b)));
  };

  const draw = () => {
    const select = $("metric");
    const all = names();
    if (chosen === null || !all.includes(chosen)) chosen = all[0] || null;
    if ([...select.options].map((o) => o.value).join("\n") !== all.join("\n")) {
      select.replaceChildren(...all.map((n) => new Option(n, n)));
    }
    select.value = chosen || "";
    const shown = chosen === null ? [] : points.filter((p) => p.metrics[chosen] !== null && p.metrics[chosen] !== undefined);
    const trace = {
      x: shown.map((p) => p.step),
      y: shown.map((p) => p.metrics[chosen]),
      text: shown.map((p) => `${p.op}${p.seq_id === null ? "" : " #" + p.seq_id}`),
      mode: "lines+markers",
      type: "scatter",
      name: chosen || "",
    };
    const layout = {
      margin: { l: 60, r: 20, t: 20, b: 45 },
      xaxis: { title: { text: "step (optimizer steps completed)" }, rangemode: "tozero" },
      yaxis: { title: { text: chosen || "" } },
      showlegend: false,
    };
    $("points").textContent = chosen ? `${shown.length} points` : "no metrics recorded yet";
    if (window.Plotly) window.Plotly.react($("chart"), [trace], layout, { displaylogo: false, responsive: true });
  };

  $("metric").addEventListener("change", () => {
    chosen = $("metric").value;
    draw();
  });

  const loadMetrics = async (url) => {
    let grew = false;
    for (;;) {
      const page = await api(`${url}?after=${after}&limit=${METRICS_PAGE}`);
      for (const p of page.points) {
        if (p.index > after) {
          points.push(p);
          after = p.index;
          grew = true;
        }
      }
      if (page.next_after === null || page.next_after === undefined || !page.points.length) break;
    }
    return grew;
  };

  let first = true;
  const refresh = async () => {
    try {
      const run = await api(`/api/v1/console/runs/${encodeURIComponent(runId)}`);
      facts(run);
      fill($("checkpoints-table").tBodies[0], run.checkpoints.map(checkpointRow), "no checkpoints saved", 6);
      let note = "";
      try {
        if ((await loadMetrics(run.metrics_url)) || first) draw();
      } catch (err) {
        if (!(err instanceof HttpError && err.status === 404)) throw err;
        note = " · this server records no per-step metrics";
        if (first) draw();
      }
      first = false;
      setStatus(`updated ${new Date().toLocaleTimeString()}${note}`);
      document.body.dataset.loaded = "1";
    } catch (err) {
      if (err instanceof HttpError && err.status === 404) {
        setStatus(`training run ${runId} does not exist, or belongs to another key`, true);
        return;
      }
      failed(err);
    }
  };
  refresh();
  setInterval(refresh, POLL_MS);
}

document.addEventListener("DOMContentLoaded", () => {
  const page = document.body.dataset.page;
  setUpLogin(page === "run" ? runPage : runsPage);
});
