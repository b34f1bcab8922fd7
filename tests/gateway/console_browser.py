"""Helpers for the console's tests: Debian's Chromium driven by Playwright, and a signed-in httpx client."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from .served import Served

Page = Any  # playwright.sync_api.Page, which is imported only where Chromium is there to drive

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def require_chromium() -> None:
    """Skip unless Playwright and Debian's Chromium are both installed (never downloads a browser)."""
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install -y chromium; `make test` does it as root)")


@contextmanager
def browser_page(downloads: Path) -> Iterator[Any]:
    """A page of a fresh headless Chromium that accepts the test server's private CA's certificate."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(ignore_https_errors=True, accept_downloads=True,
                                          viewport={"width": 1200, "height": 900})
            context.grant_permissions(["clipboard-read", "clipboard-write"])
            page = context.new_page()
            page.set_default_timeout(15_000)
            yield page
        finally:
            browser.close()


def csrf_of(html: str) -> str:
    match = _CSRF.search(html)
    assert match, html[:2000]
    return match.group(1)


def signed_in(served: Served, token: str) -> tuple[httpx.Client, str]:
    """An httpx client holding a console session for ``token``, and the session's CSRF token."""
    client = httpx.Client(base_url=served.base, verify=str(served.ca), timeout=30)
    form = client.get("/admin/login")
    r = client.post("/admin/login", data={"token": token, "csrf_token": csrf_of(form.text)})
    assert r.status_code == 303 and r.headers["location"] == "/admin/tenants", r.text
    return client, csrf_of(client.get("/admin/tenants").text)
