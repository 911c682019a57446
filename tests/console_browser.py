"""A real headless browser on the web console, for tests/test_console_browser.py, scripts/console-screenshots
and benchmarks/console_browser.py: Debian's chromium driven by Playwright (from PyPI; `playwright install`
is never needed: the system browser is named by path).

Chromium's own sandbox needs user namespaces it may not have as root in a container; Playwright passes
--no-sandbox unless asked otherwise (`chromium_sandbox=False`, its default). It is a test browser on
loopback, showing the console's own pages.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tests.servers import SERVE, ServerProcess

CHROMIUM = os.environ.get("AGENTCELL_TEST_CHROMIUM", "/usr/bin/chromium")
STATIC = Path(__file__).resolve().parent.parent / "agentcell" / "console" / "static"
ADMIN_KEY = "console-admin-" + os.urandom(6).hex()
VIEWER_KEY = "console-viewer-" + os.urandom(6).hex()


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not Path(CHROMIUM).is_file() and not shutil.which(CHROMIUM):
        return f"no chromium at {CHROMIUM} (apt install chromium; scripts/setup does)"
    if not (STATIC / "index.html").is_file():
        return "the console is not built (bash scripts/build-console; scripts/setup does)"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    return None


@contextmanager
def routeless_uplink() -> Iterator[str]:
    """A network namespace with no route anywhere, as the egress router's uplink: the sandboxes' connections
    reach the router (so the record has them, with its decisions) and go no further."""
    name = f"acweb{os.getpid() % 100000}-inet"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield f"netns:/run/netns/{name}"
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


@contextmanager
def console_server(*args: str, log: Path | None = None, routed: bool = False) -> Iterator[ServerProcess]:
    """`agentcell serve` with an API key and a read-only console key, on loopback; its egress uplink is
    none, or with `routed` a namespace that routes nowhere (routeless_uplink)."""
    log = log or Path(tempfile.gettempdir()) / f"agentcell-console-browser-{os.getpid()}.log"
    with ExitStack() as stack:
        uplink = stack.enter_context(routeless_uplink()) if routed else "none"
        dns = ("--egress-dns", "198.51.100.53") if routed else ()  # a documentation address: never asked
        srv = stack.enter_context(ServerProcess(log, "--api-key", ADMIN_KEY, "--console-viewer-key", VIEWER_KEY,
                                                "--egress-uplink", uplink, *dns, *args, command=SERVE))
        yield srv


@contextmanager
def chromium() -> Iterator[object]:
    """A headless Debian chromium under Playwright; yields the Browser."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield browser
        finally:
            browser.close()


def sign_in(page, base_url: str, key: str = ADMIN_KEY) -> None:  # noqa: ANN001 - a playwright Page
    """The sign-in page, the key typed into it, and the sandboxes page once signed in."""
    page.goto(base_url + "/ui/#/signin")
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("heading", name="Sandboxes").wait_for()


def wait_until(page, function: str, arg: object = None, timeout: float = 10) -> object:  # noqa: ANN001
    """Polls `function` (JS source of a function) in the page until it returns something truthy.

    Not Playwright's wait_for_function: that one evals its predicate in the page, which the console's
    CSP (no 'unsafe-eval') refuses, as it should; page.evaluate calls a function without an eval.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = page.evaluate(function, arg)
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {timeout:g} s in the page: {function}")
        time.sleep(0.05)


def terminal_text(page) -> str:  # noqa: ANN001
    """What xterm.js shows: its DOM renderer's rows (not a canvas), as text."""
    return page.locator(".xterm-rows").inner_text()
