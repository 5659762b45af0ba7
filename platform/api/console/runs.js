// The console's runs page (/console/): the service, the caller's runs and sessions, paged and searched on the server.
// Needs common.js.
"use strict";

// One server-paged, searchable table: `id` names its elements (#<id>-table, -q, -search, -prev, -next, -page), `key`
// the list in the route's answer.
function pagedTable(id, key, url, render, columns, emptyText) {
  const state = { offset: 0, q: "" };
  const load = async () => {
    const params = new URLSearchParams({ offset: state.offset, limit: PAGE, q: state.q });
    const data = await api(`${url}?${params}`);
    fill($(`${id}-table`).tBodies[0], data[key].map(render), emptyText, columns);
    const last = Math.min(data.offset + data[key].length, data.total);
    $(`${id}-page`).textContent = data.total ? `${data.offset + 1}–${last} of ${data.total}` : "none";
    $(`${id}-prev`).disabled = data.offset === 0;
    $(`${id}-next`).disabled = last >= data.total;
  };
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

// "ended" with why (the client went away, the session finished it), "failed" with its error; the reason is the
// cell's tooltip and shows beside the word.
function statusCell(tr, row) {
  const td = cell(tr, row.status, `st-${row.status}`);
  if (row.reason) {
    td.title = row.reason;
    const why = document.createElement("span");
    why.className = "reason";
    why.textContent = ` · ${row.reason}`;
    td.appendChild(why);
  }
  return td;
}

function runRow(r) {
  const tr = document.createElement("tr");
  tr.dataset.runId = r.training_run_id;
  cell(tr, link(`/console/runs/${encodeURIComponent(r.training_run_id)}`, r.training_run_id));
  cell(tr, r.session_id);
  cell(tr, r.base_model);
  statusCell(tr, r);
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
  statusCell(tr, s);
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
    cell(tr, "not answering (busy or restarting)").colSpan = 8;
    return tr;
  }
  cell(tr, m.base_model);
  cell(tr, m.pool);
  cell(tr, m.workers.map((w) => `${w.worker_id}${w.busy ? " (busy)" : ""}`).join(", ") || "none", "workers");
  cell(tr, `${m.slots_used} / ${m.slots_total}`, "num");
  cell(tr, `${m.runs_live ?? m.slots_used} (${m.runs_paged ?? 0} paged out)`, "num");
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

function memoryPlan(tokens, bytes) {
  if (!tokens) return null;
  const n = (v) => (v === undefined ? "?" : Math.round(v).toLocaleString());
  const work = bytes && bytes.work !== undefined ? ` · ${fmtBytes(bytes.work)} for work` : "";
  return `${n(tokens.forward_backward)} / ${n(tokens.sample)} tokens${work}`;
}

function engineRow(e, i) {
  const tr = document.createElement("tr");
  cell(tr, `worker ${i + 1}`);
  if (!e.answered) {
    cell(tr, "its /metrics did not answer (restarting?)").colSpan = 8;
    return tr;
  }
  cell(tr, byKind(e.tokens_per_second, (v) => Math.round(v).toLocaleString()), "tps");
  cell(tr, byKind(e.mfu, (v) => `${(100 * v).toFixed(2)} %`));
  cell(tr, fmtBytes(e.device_memory_in_use_bytes), "num");
  cell(tr, fmtBytes(e.device_memory_peak_bytes), "num");
  cell(tr, fmtBytes(e.device_memory_limit_bytes), "num");
  cell(tr, memoryPlan(e.memory_plan_max_tokens, e.memory_plan_bytes));
  cell(tr, e.page_ins_per_second == null ? null : e.page_ins_per_second.toFixed(1), "num");
  cell(tr, e.page_in_seconds_recent ? `${(1000 * e.page_in_seconds_recent).toFixed(1)} ms` : null, "num");
  return tr;
}

async function loadService() {
  const data = await api("/api/v1/console/service");
  fill($("service-table").tBodies[0], data.models.map(serviceRow), "no base model is served", 9);
  fill(
    $("engines-table").tBodies[0],
    data.engines.map(engineRow),
    "tokens/s: the API reads no JAX worker /metrics (start the worker with --metrics-port, or give " +
      "--worker-metrics-urls)",
    9,
  );
}

function runsPage() {
  const loadRuns = pagedTable("runs", "training_runs", "/api/v1/console/runs", runRow, 7, "no training runs");
  const loadSessions = pagedTable("sessions", "sessions", "/api/v1/console/sessions", sessionRow, 6, "no sessions");
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

document.addEventListener("DOMContentLoaded", () => setUpLogin(runsPage));
