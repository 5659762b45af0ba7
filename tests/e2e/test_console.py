"""The web console at /console (docs/console.md) in a real headless Chromium (Debian's `chromium`, driven by
Playwright through its executable path) against the real stack: after N training steps through the SDK the run's
chart plots N points; a second tenant's console shows none of the first tenant's runs; the page keeps working after
the API process is killed and `up` restarts it; the usage page shows a scripted workload's exact token counts, to its
own tenant only (the operator's key sees every tenant's, and picks one).

TINKERFLOW_SCREENSHOTS=docs writes docs/console-runs.png, docs/console-run.png and docs/console-usage.png (the
README's and docs/console.md's pictures).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import ADMIN_API_KEY, OTHER_API_KEY

pytestmark = pytest.mark.e2e
CHROMIUM = "/usr/bin/chromium"
# Flags for a browser that must reach nothing but the API under test: no network chatter of its own.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",  # tests run as root in containers, where Chromium's sandbox cannot start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
STEPS = 3
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([10, 20, 30, 40]),
    loss_fn_inputs=dict(target_tokens=[20, 30, 40, 50], weights=[1.0, 1.0, 1.0, 1.0]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
)
WAIT_MS = 120_000  # a bound on a hang on a busy 2-core machine, not a timing assertion
# Page functions are passed as functions, never as expression strings: Playwright polls an expression with eval(),
# which the console's Content-Security-Policy (rightly) refuses.
PLOTTED = "() => { const c = document.getElementById('chart'); return c && c.data ? c.data[0].x.length : -1; }"


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is absent: apt-get install chromium (scripts/test.sh does, as root)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    with sync_api.sync_playwright() as p:
        # launch() runs the browser on a fresh temporary profile (user-data dir) that Playwright deletes at close.
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


# A session name with markup in it: the console shows it as text and runs none of it.
HOSTILE_NAME = '<img src=x onerror="window.__pwned=1">Console & <b>co</b>'


@pytest.fixture(scope="module")
def trained(stack, base_model):
    """A run of STEPS steps (one forward_backward and one optim_step each) and one saved state with a TTL, in a
    session named HOSTILE_NAME."""
    client = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key, display_name=HOSTILE_NAME)
    training = client.create_lora_training_client(base_model=base_model, rank=4).result()
    for _ in range(STEPS):
        training.forward_backward([DATUM], "cross_entropy").result(timeout=300)
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=300)
    training.save_state("console-ckpt", ttl_seconds=7200).result(timeout=300)
    return training.model_id


def _signed_in(browser, base_url: str, key: str, path: str = "/console/"):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.goto(base_url + path)
    page.fill("#key", key)
    page.click("#login button[type=submit]")
    page.wait_for_selector("body[data-loaded='1']", timeout=WAIT_MS)
    return context, page


def _screenshot(page, name: str) -> None:
    where = os.environ.get("TINKERFLOW_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(Path(where) / name), full_page=True)


def _chart_points(page, n: int) -> dict:
    page.wait_for_function(f"n => ({PLOTTED})() === n", arg=n, timeout=WAIT_MS)
    return page.evaluate("() => { const t = document.getElementById('chart').data[0]; return {x: t.x, y: t.y}; }")


def test_sign_in_says_what_a_key_means_on_this_server(stack, browser):
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(stack.base_url + "/console/")
        page.wait_for_function("() => document.getElementById('tenancy').textContent !== ''", timeout=WAIT_MS)
        # The shared stack has API keys: only those work, each its own tenant (`up` prints the same sentence).
        assert "each key is its own tenant" in page.inner_text("#tenancy")
    finally:
        context.close()


def test_run_chart_plots_one_point_per_step_and_lists_the_run(stack, browser, trained):
    context, page = _signed_in(browser, stack.base_url, stack.api_key)
    try:
        row = page.locator(f"#runs-table tr[data-run-id='{trained}']")
        row.wait_for(timeout=WAIT_MS)
        assert row.locator("td").nth(3).inner_text() == "ready"
        assert row.locator("td").nth(4).inner_text() == str(STEPS)
        # The session's row links the run too, and shows its name as text.
        session_row = page.locator(f"#sessions-table tr[data-session-id='{trained.split(':')[0]}']")
        assert session_row.count() == 1
        assert session_row.locator("td").nth(1).inner_text() == HOSTILE_NAME
        assert page.locator("#sessions-table img").count() == 0 and page.evaluate("() => window.__pwned") is None
        # Search by the session's name finds the run (any case).
        page.fill("#runs-q", "console & <B>")
        page.click("#runs-search button")
        page.wait_for_function(
            "() => document.getElementById('runs-page').textContent.endsWith(' of 1')", timeout=WAIT_MS
        )
        assert row.count() == 1
        # The service: one served model, its worker and the slot this run holds.
        service = page.locator("#service-table tbody tr").first.locator("td")
        used, total = (int(v) for v in service.nth(3).inner_text().split(" / "))
        assert 1 <= used <= total
        # tokens/s from the JAX worker's own /metrics (the shared stack serves it on --metrics-port).
        tps = page.locator("#engines-table tbody tr td.tps").first.inner_text()
        trained_tps = [part for part in tps.split(" · ") if part.startswith("forward_backward: ")]
        assert trained_tps and float(trained_tps[0].split(": ")[1].replace(",", "")) > 0, tps
        _screenshot(page, "console-runs.png")

        row.locator("a").click()
        page.wait_for_url("**/console/runs/**", timeout=WAIT_MS)
        plotted = _chart_points(page, STEPS)
        assert page.locator("#metric").input_value() == "loss:sum"
        assert plotted["x"] == list(range(STEPS))  # the i-th forward_backward ran after i optimizer steps
        assert all(isinstance(y, (int, float)) and y > 0 for y in plotted["y"])  # cross-entropy sums are positive
        checkpoints = page.locator("#checkpoints-table tbody tr")
        checkpoints.first.wait_for(timeout=WAIT_MS)
        assert checkpoints.count() == 1
        assert f"tinker://{trained}/weights/console-ckpt" in checkpoints.first.inner_text()
        assert checkpoints.first.locator("td").nth(4).inner_text() != "never"  # it has a TTL
        link = page.get_attribute("#temporal-link", "href") or ""
        assert link.endswith("/namespaces/default/workflows/" + f"training-run%2F{trained}".replace(":", "%3A"))
        _screenshot(page, "console-run.png")
    finally:
        context.close()


def test_second_tenant_sees_none_of_the_first_tenants_runs(stack, browser, trained):
    context, page = _signed_in(browser, stack.base_url, OTHER_API_KEY)
    try:
        shown = page.locator("#runs-table tbody tr[data-run-id]").evaluate_all("rows => rows.map(r => r.dataset.runId)")
        theirs = httpx.get(
            f"{stack.base_url}/api/v1/console/runs",
            params={"limit": 200},
            headers={"X-API-Key": OTHER_API_KEY},
            timeout=60,
        ).json()["training_runs"]
        assert trained not in shown
        # Its run's console data: the same 404 as a run that never existed (only the id in the message differs).
        bob = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": OTHER_API_KEY}, timeout=60)
        theirs_run = bob.get(f"/api/v1/console/runs/{trained}")
        unknown = "sess-000000000000:train:0"
        none_run = bob.get(f"/api/v1/console/runs/{unknown}")
        assert theirs_run.status_code == none_run.status_code == 404
        assert theirs_run.json()["detail"].replace(trained, unknown) == none_run.json()["detail"]
        assert set(shown) <= {r["training_run_id"] for r in theirs}
        # Searching for the run by its id finds nothing; opening its page by URL shows nothing of it.
        page.fill("#runs-q", trained)
        page.click("#runs-search button")
        page.wait_for_function("() => document.getElementById('runs-page').textContent === 'none'", timeout=WAIT_MS)
        page.goto(f"{stack.base_url}/console/runs/{trained}")
        page.wait_for_function(
            "() => document.getElementById('status').textContent.includes('does not exist')", timeout=WAIT_MS
        )
        assert page.evaluate(PLOTTED) <= 0
        assert page.locator("#checkpoints-table tbody tr").count() == 0
    finally:
        context.close()


def test_console_keeps_working_after_the_api_restarts(stack, browser, trained):
    context, page = _signed_in(browser, stack.base_url, stack.api_key, f"/console/runs/{trained}")
    try:
        _chart_points(page, STEPS)
        old = stack.kill_part("api")
        stack.wait_restarted("api", old)
        deadline = time.monotonic() + WAIT_MS / 1000  # the new API answers once it has connected to Temporal
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{stack.base_url}/api/v1/healthz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        # The open page recovers by itself on its next poll (the key is in the tab, not in the dead process)...
        page.wait_for_function(
            "() => !document.getElementById('status').classList.contains('error') && "
            "document.getElementById('status').textContent.startsWith('updated')",
            timeout=WAIT_MS,
        )
        # ...and a reload (a fresh page load from the new process) signs in from the tab's storage and plots again.
        page.reload()
        page.wait_for_selector("body[data-loaded='1']", timeout=WAIT_MS)
        assert page.locator("#login").is_hidden()
        assert _chart_points(page, STEPS)["x"] == list(range(STEPS))
        page.goto(f"{stack.base_url}/console/")
        page.locator(f"#runs-table tr[data-run-id='{trained}']").wait_for(timeout=WAIT_MS)
    finally:
        context.close()


# Under 16 tokens: no whole prefix-cache block, so no call of it is served from the cache.
SHORT_PROMPT = [5, 17, 42, 99, 3]
KINDS = (
    "training_tokens",
    "prefill_uncached_tokens",
    "prefill_cached_tokens",
    "sampled_tokens",
    "checkpoints",
    "checkpoint_bytes",
)


@pytest.fixture(scope="module")
def metered(stack, base_model, trained):
    """The usage each row of the usage page must show, by tenant: the first's trained run (STEPS forward_backward
    calls of 4 tokens, one named checkpoint) and a sampler (one call); the second tenant's run (one call)."""
    client = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
    sampler = client.create_sampling_client(base_model=base_model).result()
    params = types.SamplingParams(max_tokens=3, seed=1)
    sampled = sampler.sample(types.ModelInput.from_ints(SHORT_PROMPT), 2, params).result(timeout=300)
    run = httpx.get(
        f"{stack.base_url}/api/v1/console/runs/{trained}", headers={"X-API-Key": stack.api_key}, timeout=60
    ).json()
    other = tinker.ServiceClient(base_url=stack.base_url, api_key=OTHER_API_KEY)
    theirs = other.create_lora_training_client(base_model=base_model, rank=4).result()
    theirs.forward_backward([DATUM], "cross_entropy").result(timeout=300)
    cached = sampled.prompt_cache_hit_tokens or 0
    zero = dict.fromkeys(KINDS, 0)
    mine = {
        trained: {
            **zero,
            "training_tokens": STEPS * 4,
            "checkpoints": 1,
            "checkpoint_bytes": run["checkpoints"][0]["size_bytes"],
        },
        sampler._sampling_session_id: {  # the SDK keeps the sampler id private
            **zero,
            "prefill_uncached_tokens": len(SHORT_PROMPT) - cached,
            "prefill_cached_tokens": cached,
            "sampled_tokens": sum(len(s.tokens) for s in sampled.sequences),
        },
    }
    return {"mine": mine, "theirs": {theirs.model_id: {**zero, "training_tokens": 4}}}


def _usage_rows(page) -> dict[str, dict]:
    """The by-run table as {run or sampler id: {"owner", kind: count}}, read off the cells' data attributes."""
    return page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll('#usage-runs-table tr[data-run-id]')].map(tr => [
            tr.dataset.runId,
            Object.fromEntries([['owner', tr.dataset.owner],
              ...[...tr.querySelectorAll('td[data-kind]')].map(td => [td.dataset.kind, Number(td.dataset.value)])]),
        ]))"""
    )


def _shown_usage(page, wanted: set[str]) -> dict[str, dict]:
    """The usage page's rows once every id in `wanted` is shown (the page reloads every 10 s; a sample batch reaches
    Temporal's visibility within moments)."""
    deadline = time.monotonic() + WAIT_MS / 1000
    while True:
        rows = _usage_rows(page)
        if wanted <= set(rows) or time.monotonic() > deadline:
            return rows
        page.reload()
        page.wait_for_selector("body[data-loaded='1']", timeout=WAIT_MS)


def test_usage_page_shows_a_workloads_exact_tokens_to_its_own_tenant(stack, browser, trained, metered):
    context, page = _signed_in(browser, stack.base_url, stack.api_key)
    try:
        page.click("header nav a[href='/console/usage']")  # linked from every page's nav
        page.wait_for_url("**/console/usage", timeout=WAIT_MS)
        page.wait_for_selector("body[data-loaded='1']", timeout=WAIT_MS)
        rows = _shown_usage(page, set(metered["mine"]))
        for source, want in metered["mine"].items():
            assert {k: rows[source][k] for k in KINDS} == want, source
        # Never another tenant's rows, and no tenant column or filter for a tenant's key.
        assert not set(metered["theirs"]) & set(rows) and len({r["owner"] for r in rows.values()}) == 1
        assert page.locator("#usage-tenant-label").is_hidden() and page.locator("th.tenant-col").first.is_hidden()
        # Today's row is the sum of the rows by run and sampler (the same ledgers, summed another way).
        today = page.locator("#usage-days-table tbody tr").first
        day = {k: int(today.locator(f"td[data-kind='{k}']").get_attribute("data-value") or -1) for k in KINDS}
        assert day == {k: sum(r[k] for r in rows.values()) for k in KINDS}
        assert (
            page.locator(f"#usage-runs-table tr[data-run-id='{trained}'] td").nth(1).inner_text()
            == trained.split(":")[0]
        )
        _screenshot(page, "console-usage.png")
    finally:
        context.close()


def test_usage_page_of_the_second_tenant_shows_none_of_the_firsts(stack, browser, trained, metered):
    context, page = _signed_in(browser, stack.base_url, OTHER_API_KEY, "/console/usage")
    try:
        (theirs,) = metered["theirs"]
        rows = _shown_usage(page, {theirs})
        assert {k: rows[theirs][k] for k in KINDS} == metered["theirs"][theirs]
        assert not set(rows) & set(metered["mine"]) and len({r["owner"] for r in rows.values()}) == 1
        # Asking for the first tenant's usage by its owner id: refused, not answered with an empty page.
        alice = next(iter(_usage_rows_as(stack, ADMIN_API_KEY, trained)))
        r = httpx.get(
            f"{stack.base_url}/api/v1/console/usage",
            params={"tenant": alice},
            headers={"X-API-Key": OTHER_API_KEY},
            timeout=60,
        )
        assert r.status_code == 403 and "tenant" in r.json()["detail"]
    finally:
        context.close()


def _usage_rows_as(stack, key: str, source: str) -> set[str]:
    """The owner ids of `source`'s rows in the usage data `key` reads."""
    data = httpx.get(f"{stack.base_url}/api/v1/console/usage", headers={"X-API-Key": key}, timeout=60).json()
    return {r["owner"] for r in data["runs"] if r["id"] == source}


def test_usage_page_of_the_operator_shows_every_tenant_and_filters_to_one(stack, browser, trained, metered):
    context, page = _signed_in(browser, stack.base_url, ADMIN_API_KEY, "/console/usage")
    try:
        every = {**metered["mine"], **metered["theirs"]}
        rows = _shown_usage(page, set(every))
        for source, want in every.items():
            assert {k: rows[source][k] for k in KINDS} == want, source
        owners = {source: rows[source]["owner"] for source in every}
        alice = owners[trained]
        assert {owners[s] for s in metered["mine"]} == {alice} != {owners[s] for s in metered["theirs"]}
        assert page.locator("#usage-tenant-label").is_visible() and page.locator("th.tenant-col").first.is_visible()
        page.select_option("#usage-tenant", alice)
        page.wait_for_function(
            "a => [...document.querySelectorAll('#usage-runs-table tr[data-run-id]')]"
            ".every(r => r.dataset.owner === a)",
            arg=alice,
            timeout=WAIT_MS,
        )
        shown = _usage_rows(page)
        assert trained in shown and not {s for s, o in owners.items() if o != alice} & set(shown)
    finally:
        context.close()
