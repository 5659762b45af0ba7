// The tinkerflow console (docs/console.md): what both pages share (the key, fetch, sign-in, table cells). Plain
// browser JavaScript, no build step; each page adds its own script after this one. Every number on the page comes
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
  showTenancy();
}

// What a key means on this server (any key and one tenant, or one tenant per configured key), asked without a key.
async function showTenancy() {
  try {
    const res = await fetch("/api/v1/console/sign_in");
    if (res.ok) $("tenancy").textContent = `This server: ${(await res.json()).tenant_mode}.`;
  } catch (err) {
    /* the sign-in works without the sentence */
  }
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
