// The console's usage page (/console/usage): metered tokens by kind, by UTC day and per training run or sampler, from
// /api/v1/console/usage (the ledgers tinker's AdminClient reads). The operator's key sees a tenant column and may pick
// one tenant. Needs common.js.
"use strict";

// Each count cell carries its kind (data-kind), so a reader (or a test) finds "sampled tokens" without counting columns.
function countCells(tr, row, kinds) {
  for (const kind of kinds) {
    const value = row[kind];
    const td = cell(tr, kind === "checkpoint_bytes" ? fmtBytes(value) : Number(value).toLocaleString("en-US"), "num");
    td.dataset.kind = kind;
    td.dataset.value = String(value);
  }
}

function usagePage() {
  const tenants = new Set(); // every owner id the operator has been shown, for the filter
  const dayRow = (operator, kinds) => (d) => {
    const tr = document.createElement("tr");
    tr.dataset.day = d.day;
    tr.dataset.owner = d.owner;
    cell(tr, d.day);
    if (operator) cell(tr, d.owner);
    countCells(tr, d, kinds);
    return tr;
  };
  const runRow = (operator, kinds) => (r) => {
    const tr = document.createElement("tr");
    tr.dataset.runId = r.id;
    tr.dataset.owner = r.owner;
    const name = r.kind === "training run" ? link(`/console/runs/${encodeURIComponent(r.id)}`, r.id) : r.id;
    cell(tr, name);
    cell(tr, r.session_id);
    if (operator) cell(tr, r.owner);
    cell(tr, r.base_model);
    countCells(tr, r, kinds);
    return tr;
  };
  const load = async () => {
    const params = new URLSearchParams({ days: $("usage-days").value, tenant: $("usage-tenant").value });
    const data = await api(`/api/v1/console/usage?${params}`);
    const op = data.operator;
    document.querySelectorAll(".tenant-col").forEach((th) => (th.hidden = !op));
    $("usage-tenant-label").hidden = !op;
    for (const t of data.tenants) {
      if (tenants.has(t)) continue;
      tenants.add(t);
      const option = document.createElement("option");
      option.value = option.textContent = t;
      $("usage-tenant").appendChild(option);
    }
    const who = op ? ($("usage-tenant").value ? `Tenant ${$("usage-tenant").value}` : "Every tenant") : "Your key";
    $("usage-scope").textContent = `${who}: usage since ${data.start.slice(0, 10)} 00:00 UTC`;
    const columns = data.kinds.length;
    fill($("usage-days-table").tBodies[0], data.days.map(dayRow(op, data.kinds)), "no usage", columns + (op ? 2 : 1));
    fill($("usage-runs-table").tBodies[0], data.runs.map(runRow(op, data.kinds)), "no usage", columns + (op ? 4 : 3));
  };
  const refresh = async () => {
    try {
      await load();
      setStatus(`updated ${new Date().toLocaleTimeString()}`);
      document.body.dataset.loaded = "1";
    } catch (err) {
      failed(err);
    }
  };
  $("usage-days").addEventListener("change", refresh);
  $("usage-tenant").addEventListener("change", refresh);
  $("usage-filter").addEventListener("submit", (ev) => ev.preventDefault());
  refresh();
  setInterval(refresh, POLL_MS * 2);
}

document.addEventListener("DOMContentLoaded", () => setUpLogin(usagePage));
