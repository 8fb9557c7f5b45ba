"""A real headless Chromium (Debian's) driven by Playwright, and the pages it opens.

`make test-browser` installs Debian's chromium when it is missing and Playwright from PyPI; Playwright is
pointed at that binary and never downloads a browser. A missing browser fails the run: a skip here would
count as a pass.
"""

import shutil
import time

import pytest

from tests.helpers import ROOT, run_cli

TOOL_CALLS = ROOT / "sample_data" / "tool_calls.parquet"
TINY_GEMMA = ROOT / "sample_data" / "tiny-gemma4"


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("no chromium on PATH: `make test-browser` installs Debian's (apt-get install chromium)")
    return path


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path())
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def tool_calls(tmp_path_factory):
    """The tool-calling sample through both stages and klpipe inspect, as `make demo` runs them."""
    tmp = tmp_path_factory.mktemp("tool_calls")
    cached, scored, page = tmp / "cached.parquet", tmp / "scored.parquet", tmp / "kl.html"
    for args in (["precompute", "--model", str(TINY_GEMMA), str(TOOL_CALLS), "--column", "response_ids=completion_ids",
                  "--output", str(cached)],
                 ["score", str(cached), "--output", str(scored)],
                 ["inspect", str(scored), "--output", str(page)]):
        result = run_cli(*args)
        assert result.returncode == 0, result.stderr
    return scored, page


class Opened:
    """A page opened from a file: URL, with every request and every script error it made."""

    def __init__(self, browser, path, viewport=(1280, 900)):
        self.context = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
        self.page = self.context.new_page()
        self.url = path.resolve().as_uri()
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type in ("error", "warning") else None)
        started = time.perf_counter()
        self.page.goto(self.url, wait_until="load")
        self.load_seconds = time.perf_counter() - started

    def close(self):
        self.context.close()


@pytest.fixture
def open_page(browser):
    opened = []

    def open_(path, **kwargs) -> Opened:
        page = Opened(browser, path, **kwargs)
        opened.append(page)
        return page

    yield open_
    for page in opened:
        # Every page a test opened fetched nothing but itself and raised no script error.
        assert page.requests == [page.url], page.requests
        assert page.errors == [], page.errors
        page.close()
