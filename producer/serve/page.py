"""`GET /` of `qbatch serve`: a progress page of the key's tenant's batches (status,
counts, a progress bar, rate and ETA), server-rendered HTML that refreshes itself
(`<meta http-equiv=refresh>`; no JavaScript at all).

Auth: the same keys as the API. A browser cannot send `Authorization: Bearer`, so the
page's own sign-in form (`POST /login`, a form body: a key never appears in a URL, so
never in an access log or the browser history) trades a key for a *session*: a random
token in the cookie `qbatch_session` (HttpOnly, SameSite=Strict, Secure on https), its
tenant in Redis for 12 hours under the token's SHA-256 (`producer.serve.sessions`); the
cookie never holds the key. `POST /login` refuses a cross-site post (`Origin` or
`Sec-Fetch-Site` naming another site: no login CSRF), and the page may not be framed
(`frame-ancestors 'none'`). The API routes take the header only, so the cookie cannot
drive them (no CSRF on `/v1`). A key in a query string is not accepted, on purpose.
Nothing here logs a key or a token.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from producer.serve.bodies import read_body
from producer.serve.sessions import SESSION_S

COOKIE = "qbatch_session"
NO_FRAMES = {"Content-Security-Policy": "frame-ancestors 'none'", "X-Frame-Options": "DENY"}
REFRESH_S = 5
MAX_FORM_BYTES = 4_096
PAGE_BATCHES = 100
FINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1d2430;background:#f6f7f9}
h1{font-size:20px;margin:0 0 4px}p.sub{color:#5b6576;margin:0 0 16px}
table{border-collapse:collapse;width:100%;background:#fff;box-shadow:0 1px 2px #0002}
th,td{padding:8px 10px;border-bottom:1px solid #e3e6eb;text-align:left;white-space:nowrap}
th{background:#eef1f5;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
.bar{width:220px;height:14px;background:#e3e6eb;border-radius:7px;overflow:hidden;display:flex}
.ok{background:#2e9d58}.bad{background:#d64545}
.st{padding:2px 8px;border-radius:10px;font-size:12px;background:#e3e6eb}
.st-in_progress,.st-validating,.st-finalizing{background:#dbe8ff;color:#1b4fb8}
.st-completed{background:#dcf3e4;color:#1d7a44}.st-failed,.st-expired{background:#fbe0e0;color:#a32626}
.st-cancelled,.st-cancelling{background:#eee;color:#555}
form{background:#fff;padding:16px;max-width:420px;box-shadow:0 1px 2px #0002}
input{font:inherit;padding:6px;width:100%;box-sizing:border-box;margin:8px 0}
"""


@dataclass(frozen=True, slots=True)
class Progress:
    """One batch's line on the page, computed from its Batch object. Pure."""

    id: str
    status: str
    total: int
    completed: int
    failed: int
    rate: float | None
    """Finished lines per second since the batch went in_progress (None: unknown)."""
    eta_s: float | None

    @property
    def done(self) -> int:
        return self.completed + self.failed

    @property
    def percent(self) -> float:
        return 100.0 * self.done / self.total if self.total else 0.0


def progress_of(batch: Mapping[str, Any], now: float) -> Progress:
    counts = batch.get("request_counts") or {}
    total, completed, failed = (int(counts.get(k) or 0) for k in ("total", "completed", "failed"))
    status = str(batch.get("status", ""))
    started = batch.get("in_progress_at")
    ended = next(
        (batch[k] for k in ("finalizing_at", "completed_at", "cancelled_at") if batch.get(k)),
        None,
    )
    rate = eta = None
    done = completed + failed
    if started:
        elapsed = (ended or now) - started
        if elapsed > 0 and done:
            rate = done / elapsed
            if status not in FINAL_STATUSES and total > done:
                eta = (total - done) / rate
    return Progress(str(batch.get("id", "")), status, total, completed, failed, rate, eta)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def _row(p: Progress) -> str:
    ok = 100.0 * p.completed / p.total if p.total else 0.0
    bad = 100.0 * p.failed / p.total if p.total else 0.0
    rate = f"{p.rate:,.1f}/s" if p.rate is not None else "-"
    e = html.escape
    return (
        f"<tr><td><code>{e(p.id)}</code></td>"
        f'<td><span class="st st-{e(p.status)}">{e(p.status)}</span></td>'
        f'<td class="num">{p.completed:,}</td><td class="num">{p.failed:,}</td>'
        f'<td class="num">{p.total:,}</td>'
        f'<td><div class="bar" title="{p.percent:.1f}%">'
        f'<div class="ok" style="width:{ok:.2f}%"></div>'
        f'<div class="bad" style="width:{bad:.2f}%"></div></div></td>'
        f'<td class="num">{p.percent:.1f}%</td><td class="num">{rate}</td>'
        f'<td class="num">{duration(p.eta_s)}</td></tr>'
    )


def render_page(
    tenant: str, batches: Sequence[Mapping[str, Any]], now: float, refresh_s: int = REFRESH_S
) -> str:
    """The whole page (every value escaped). Pure."""
    rows = [progress_of(b, now) for b in batches]
    active = sum(1 for p in rows if p.status not in FINAL_STATUSES)
    body = "".join(_row(p) for p in rows) or (
        '<tr><td colspan="9">No batches yet: create one with the Batches API.</td></tr>'
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now))
    return (
        "<!doctype html><html><head><meta charset=utf-8>"
        f'<meta http-equiv="refresh" content="{int(refresh_s)}">'
        f"<title>qbatch: {html.escape(tenant)}</title><style>{STYLE}</style></head><body>"
        f"<h1>Batches of {html.escape(tenant)}</h1>"
        f'<p class="sub">{len(rows)} shown, {active} active; updated {stamp}, '
        f"refreshes every {int(refresh_s)} s</p>"
        "<table><thead><tr><th>batch</th><th>status</th><th>completed</th><th>failed</th>"
        "<th>total</th><th>progress</th><th>%</th><th>rate</th><th>ETA</th></tr></thead>"
        f"<tbody>{body}</tbody></table></body></html>"
    )


def render_login(message: str = "") -> str:
    note = f'<p class="sub">{html.escape(message)}</p>' if message else ""
    return (
        "<!doctype html><html><head><meta charset=utf-8><title>qbatch: sign in</title>"
        f"<style>{STYLE}</style></head><body><h1>qbatch serve</h1>{note}"
        '<form method="post" action="/login"><label>API key'
        '<input type="password" name="key" autocomplete="current-password" required></label>'
        '<input type="submit" value="Show my batches"></form></body></html>'
    )


def same_site(request: Request) -> bool:
    """Whether a form post comes from this site: `Sec-Fetch-Site` (browsers send it) is
    `same-origin` or `none` (typed, a bookmark), and `Origin`, when sent, is this
    server's own. A request without either (curl, an old browser) passes."""
    fetch_site = request.headers.get("sec-fetch-site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        return False
    origin = request.headers.get("origin")
    if origin is None or (origin == "null" and fetch_site in ("same-origin", "none")):
        return True
    own = f"{request.url.scheme}://{request.headers.get('host', request.url.netloc)}"
    return origin == own


def register_page(
    app: FastAPI,
    tenant_of: Callable[[Request], str],
    keyring: Any,
    batches: Callable[[str], list[dict[str, Any]]],
    sessions: Any,
) -> None:
    """Add `GET /`, `POST /login` and `POST /logout` to the app. `tenant_of`: the API's
    header auth; `batches(tenant)`: the tenant's newest Batch objects; `sessions`: a
    `producer.serve.sessions.Sessions`."""

    def page_tenant(request: Request) -> str | None:
        if request.headers.get("authorization"):
            return tenant_of(request)  # a bad header is the API's 401, not a form
        token = request.cookies.get(COOKIE)
        return sessions.tenant(token) if token else None

    @app.get("/", response_class=HTMLResponse)
    def progress_page(request: Request) -> Response:
        tenant = page_tenant(request)
        if tenant is None:
            return HTMLResponse(render_login(), status_code=401, headers=NO_FRAMES)
        return HTMLResponse(render_page(tenant, batches(tenant), time.time()), headers=NO_FRAMES)

    @app.post("/login")
    async def login(request: Request) -> Response:
        if not same_site(request):
            return HTMLResponse(
                render_login("Sign in from this page."), status_code=403, headers=NO_FRAMES
            )
        raw = await read_body(request, MAX_FORM_BYTES)
        key = (parse_qs(raw.decode("utf-8", "replace")).get("key") or [""])[0].strip()
        tenant = keyring.tenant_for(key) if key else None
        if tenant is None:
            return HTMLResponse(
                render_login("That key is not valid."), status_code=401, headers=NO_FRAMES
            )
        response = RedirectResponse("/", status_code=303, headers=NO_FRAMES)
        response.set_cookie(
            COOKIE,
            sessions.open(tenant),
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
            max_age=SESSION_S,
        )
        return response

    @app.post("/logout")
    def logout(request: Request) -> Response:
        token = request.cookies.get(COOKIE)
        if token:
            sessions.close(token)
        response = RedirectResponse("/", status_code=303, headers=NO_FRAMES)
        response.delete_cookie(COOKIE)
        return response


__all__ = ["COOKIE", "Progress", "progress_of", "register_page", "render_login", "render_page"]
