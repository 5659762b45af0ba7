"""The web console's pages and assets at /console (docs/console.md); its data comes from /api/v1 (console_data).

The pages are static files shipped in the package (platform/api/console/): they hold no data, so they are served
without a key. A browser cannot add `X-API-Key` to a navigation, so the page asks for the key once, keeps it in the
tab's sessionStorage (gone when the tab closes, never in a URL or a cookie) and sends it as `X-API-Key` on its own
fetch calls, which pass the same key check and tenancy as the SDK's. No cookie means no ambient authority, so no
cross-site request can act with it; a strict Content-Security-Policy (scripts from this origin only, nothing
inline) keeps injected markup from reading the key.

The chart library is plotly.js from the installed `plotly` wheel (its `package_data/plotly.min.js`), served from
the package on disk: nothing is copied into this repository and nothing is fetched from the internet.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from tinkerflow.api.http_errors import http_error

router = APIRouter(prefix="/console", include_in_schema=False)
ASSETS = Path(__file__).parent / "console"
# What the pages may load: this origin's scripts, styles and fetches only. plotly.js sets element styles at run time,
# hence 'unsafe-inline' for styles (not scripts).
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; font-src 'self' data:; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# The page's own files: a fixed list, so a path from the URL never reaches the file system.
STATIC = {
    "console.css": "text/css; charset=utf-8",
    "common.js": "text/javascript; charset=utf-8",  # the key, fetch, sign-in: both pages
    "runs.js": "text/javascript; charset=utf-8",
    "run.js": "text/javascript; charset=utf-8",
    "usage.js": "text/javascript; charset=utf-8",
}


def _page(name: str) -> FileResponse:
    return FileResponse(ASSETS / name, media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)


@cache
def plotly_js() -> Path | None:
    """plotly.min.js inside the installed plotly package, found without importing plotly (its import is heavy)."""
    spec = importlib.util.find_spec("plotly")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


@router.get("")
async def console_root() -> RedirectResponse:
    return RedirectResponse("/console/", status_code=307)


@router.get("/")
async def runs_page() -> FileResponse:
    return _page("index.html")


@router.get("/runs/{run_id}")
async def run_page(run_id: str) -> FileResponse:
    # The run is looked up (and its owner checked) by the page's fetch, which carries the key; the page is the same
    # for every id.
    return _page("run.html")


@router.get("/usage")
async def usage_page() -> FileResponse:
    return _page("usage.html")


@router.get("/static/plotly.min.js")
async def plotly() -> FileResponse:
    path = plotly_js()
    if path is None:
        raise http_error(404, "plotly is not installed: pip install plotly (the console's charts need its bundle)")
    return FileResponse(path, media_type="text/javascript; charset=utf-8", headers=SECURITY_HEADERS)


@router.get("/static/{name}")
async def static(name: str) -> FileResponse:
    media_type = STATIC.get(name)
    if media_type is None:
        raise http_error(404, f"no console file {name!r}")
    return FileResponse(ASSETS / name, media_type=media_type, headers=SECURITY_HEADERS)
