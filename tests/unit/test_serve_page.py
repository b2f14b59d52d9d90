"""The progress page (`GET /`, issue 17 part 4): rendering, and its sign-in rules."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from producer.serve.auth import load_keyring
from producer.serve.page import COOKIE, duration, progress_of, register_page, render_page
from producer.serve.sessions import Sessions
from schemas import RedisKeys

NOW = 1_800_000_000.0
KEY = "sk-page-test-0123456789"


def batch(status: str, total: int, completed: int, failed: int = 0, **times: int) -> dict[str, Any]:
    return {
        "id": f"batch_{status}",
        "status": status,
        "request_counts": {"total": total, "completed": completed, "failed": failed},
        "in_progress_at": times.get("started"),
        "completed_at": times.get("ended"),
        "metadata": None,
    }


def test_rate_and_eta_come_from_the_finished_lines_since_in_progress() -> None:
    p = progress_of(batch("in_progress", 1000, 180, 20, started=int(NOW) - 100), NOW)
    assert p.percent == pytest.approx(20.0)
    assert p.rate == pytest.approx(2.0) and p.eta_s == pytest.approx(400.0)
    done = progress_of(batch("completed", 10, 10, started=int(NOW) - 100, ended=int(NOW) - 90), NOW)
    assert done.rate == pytest.approx(1.0) and done.eta_s is None
    fresh = progress_of(batch("validating", 0, 0), NOW)
    assert (fresh.percent, fresh.rate, fresh.eta_s) == (0.0, None, None)
    assert [duration(x) for x in (None, 5, 125, 7260)] == ["-", "5s", "2m 05s", "2h 01m"]


def test_the_page_lists_batches_with_bars_and_escapes_everything() -> None:
    rows = [
        batch("in_progress", 1000, 180, 20, started=int(NOW) - 100),
        batch("completed", 10, 10, started=int(NOW) - 100, ended=int(NOW) - 90),
    ]
    rows[1]["id"] = "<script>x</script>"
    text = render_page("team-<a>", rows, NOW, refresh_s=7)
    assert '<meta http-equiv="refresh" content="7">' in text
    assert "team-&lt;a&gt;" in text and "<script>" not in text and "&lt;script&gt;" in text
    assert 'class="ok" style="width:18.00%"' in text and 'class="bad" style="width:2.00%"' in text
    assert "2.0/s" in text and "6m 40s" in text and "1 active" in text
    assert "No batches yet" in render_page("t", [], NOW)


@pytest.fixture
def client() -> TestClient:
    keyring = load_keyring(f"{KEY}:team-a", None)
    app = FastAPI()

    def tenant_of(request: Request) -> str:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        tenant = keyring.tenant_for(key) if scheme.lower() == "bearer" else None
        if tenant is None:
            from fastapi import HTTPException

            raise HTTPException(401, "bad key")
        return tenant

    register_page(app, tenant_of, keyring, lambda t: [batch("in_progress", 4, 1)], MemorySessions())
    return TestClient(app, base_url="http://testserver")


class MemorySessions(Sessions):
    """`producer.serve.sessions.Sessions` on a dict (the unit tests have no Redis)."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        super().__init__(self, RedisKeys("qbt"))

    def set(self, key: str, value: str, ex: int) -> None:
        self.data[key] = value

    def get(self, key: str) -> str | None:
        return self.data.get(key)

    def delete(self, key: str) -> None:
        self.data.pop(key, None)


def test_the_page_takes_the_bearer_header_or_the_sign_in_cookie(client: TestClient) -> None:
    anonymous = client.get("/")
    assert anonymous.status_code == 401 and 'action="/login"' in anonymous.text
    header = client.get("/", headers={"Authorization": f"Bearer {KEY}"})
    assert header.status_code == 200 and "Batches of team-a" in header.text
    assert client.get("/", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert client.get("/", params={"key": KEY}).status_code == 401  # never from a URL
    bad = client.post("/login", data={"key": "nope"}, follow_redirects=False)
    assert bad.status_code == 401 and COOKIE not in bad.cookies
    good = client.post("/login", data={"key": KEY}, follow_redirects=False)
    assert good.status_code == 303 and good.headers["location"] == "/"
    cookie = good.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie
    assert KEY not in good.headers["set-cookie"]  # a session token, never the key
    assert good.headers["content-security-policy"] == "frame-ancestors 'none'"
    page = client.get("/")  # the client keeps the cookie
    assert page.status_code == 200 and "batch_in_progress" in page.text
    assert page.headers["x-frame-options"] == "DENY"
    token = client.cookies[COOKIE]
    client.post("/logout", follow_redirects=False)
    client.cookies.clear()
    assert client.get("/").status_code == 401
    client.cookies[COOKIE] = token  # the session ended with the logout
    assert client.get("/").status_code == 401


def test_a_cross_site_sign_in_is_refused(client: TestClient) -> None:
    """Login CSRF: another site's form posting a key (the attacker's) would sign the
    victim's browser in as the attacker."""
    for headers in (
        {"origin": "https://evil.example"},
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site", "origin": "http://testserver"},
    ):
        refused = client.post("/login", data={"key": KEY}, headers=headers, follow_redirects=False)
        assert refused.status_code == 403 and COOKIE not in refused.cookies
    ok = client.post(
        "/login",
        data={"key": KEY},
        headers={"origin": "http://testserver", "sec-fetch-site": "same-origin"},
        follow_redirects=False,
    )
    assert ok.status_code == 303
