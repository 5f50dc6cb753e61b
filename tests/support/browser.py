"""Headless Chromium for the browser tests: Debian's ``chromium`` driven by playwright (its own download unused).

Where chromium or playwright is missing the tests skip with the reason; with ``LOCALINFER_REQUIRE_BROWSER=1``
(CI, after ``./install.sh test`` installed both) they fail instead, so CI never skips them quietly.
"""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing(playwright: bool = True) -> str | None:
    """Why the browser tests cannot run here, or None (``playwright``: they drive it through playwright)."""
    if chromium_path() is None:
        return "chromium is not installed (./install.sh test installs Debian's package as root)"
    if not playwright:
        return None
    try:
        import playwright.sync_api
    except ImportError:
        return "playwright is not installed (pip install 'localinfer[test]')"
    return None


def require(playwright: bool = True) -> None:
    """Skip (or, under LOCALINFER_REQUIRE_BROWSER=1, fail) when the browser tests cannot run."""
    why = missing(playwright)
    if why is None:
        return
    if os.environ.get("LOCALINFER_REQUIRE_BROWSER") == "1":
        pytest.fail(f"browser tests required but {why}")
    pytest.skip(why)


@contextlib.contextmanager
def chromium():
    """A launched headless Chromium (playwright Browser), closed afterwards."""
    require()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=ARGS, timeout=60_000)
        try:
            yield browser
        finally:
            browser.close()


def wait_for(page, js: str, timeout: float = 10.0, every: float = 0.05):
    """Poll ``page.evaluate(js)`` until it is truthy (its value), failing after ``timeout`` seconds.  Not
    playwright's ``wait_for_function``: that evaluates a string, which the pages' CSP refuses (no unsafe-eval)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        value = page.evaluate(js)
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {js}"
        time.sleep(every)
