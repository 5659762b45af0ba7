// The console's run page (/console/runs/<id>): the run's facts, checkpoints and a plotly chart of any recorded metric
// against the step, read incrementally from the per-run metrics route. Needs common.js and plotly.min.js.
"use strict";

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
    add("status", run.status + (run.reason ? ` · ${run.reason}` : ""));
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
      // Steps are whole numbers: a tick per step while they fit, plotly's own ticks beyond.
      xaxis: {
        title: { text: "step (optimizer steps completed)" },
        rangemode: "tozero",
        dtick: shown.length && shown[shown.length - 1].step <= 12 ? 1 : undefined,
      },
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

document.addEventListener("DOMContentLoaded", () => setUpLogin(runPage));
