"""The web console's figures, measured in a real headless Chromium (Debian's, driven by Playwright):

* the sandboxes page with N sandboxes (default 1,000): first contentful paint, and the time until every
  row is in the page and painted (navigation start → the frame after the last row), over --runs loads;
  and the /ui/api/overview answer it polls (time, size);
* terminal keystroke echo: keydown in the page → the echoed character in xterm.js's rows (its DOM
  renderer: what a person sees), p50/p90 over --keys keys typed one at a time into a sandbox's shell.

    .venv/bin/python benchmarks/console_browser.py [--sandboxes 1000] [--runs 5] [--keys 50]

It starts its own `agentcell serve` (loopback, no egress uplink) and kills every sandbox it made.
The sandboxes are the smallest the server makes (created, never run code in: the agent alone).
"""

from __future__ import annotations

import argparse
import statistics
import string
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.console_browser import ADMIN_KEY, chromium, console_server, missing, sign_in, wait_until  # noqa: E402


def pcts(samples: list[float]) -> str:
    s = sorted(samples)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return f"p50 {statistics.median(s):.1f} ms, p90 {q(0.9):.1f} ms, min {s[0]:.1f}, max {s[-1]:.1f} (n={len(s)})"


def available_mib() -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    return int(line.split()[1]) // 1024


def create_many(url: str, n: int) -> tuple[list[str], str]:
    """n sandboxes created 8 at a time through the API; their ids, and why fewer if so."""
    ids: list[str] = []
    why = ""
    with httpx.Client(base_url=url, headers={"X-API-Key": ADMIN_KEY}, timeout=120) as client:
        def one(i: int) -> str:
            r = client.post("/sandboxes", json={"templateID": "base", "timeout": 1800, "metadata": {"n": str(i)}})
            r.raise_for_status()
            return r.json()["sandboxID"]

        with ThreadPoolExecutor(8) as pool:
            for future in [pool.submit(one, i) for i in range(n)]:
                try:
                    ids.append(future.result())
                except Exception as e:  # the first limit hit is part of the figure
                    why = why or f"{type(e).__name__}: {str(e)[:160]}"
    return ids, why


def kill_all(url: str, ids: list[str]) -> None:
    with httpx.Client(base_url=url, headers={"X-API-Key": ADMIN_KEY}, timeout=60) as client, ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.delete(f"/sandboxes/{i}"), ids))


LIST_LOAD = """async (n) => {
    const rows = () => document.querySelectorAll('tbody tr[data-sandbox-id]').length;
    while (rows() < n) await new Promise((r) => requestAnimationFrame(r));
    await new Promise((r) => requestAnimationFrame(() => setTimeout(r, 0)));  // that frame painted
    const fcp = performance.getEntriesByName('first-contentful-paint')[0];
    return { fcp: fcp ? fcp.startTime : null, rendered: performance.now(), rows: rows() };
}"""


def load_list(page, url: str, n: int, runs: int) -> list[dict]:  # noqa: ANN001
    timings = []
    for _ in range(runs):
        page.goto("about:blank")
        page.goto(url + "/ui/#/sandboxes")
        timings.append(page.evaluate(LIST_LOAD, n))
    return timings


def bench_list(browser, url: str, n: int, runs: int) -> None:  # noqa: ANN001
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    sign_in(page, url)
    timings = load_list(page, url, n, runs)  # the assets in the browser's cache (they are immutable)
    cdp = context.new_cdp_session(page)
    cdp.send("Network.setCacheDisabled", {"cacheDisabled": True})
    cold = load_list(page, url, n, runs)  # every load fetches the ~440 KB script and the stylesheet again
    cdp.send("Network.setCacheDisabled", {"cacheDisabled": False})
    overview = []
    size = 0
    for _ in range(runs):
        t = time.perf_counter()
        r = page.request.get(url + "/ui/api/overview")
        overview.append((time.perf_counter() - t) * 1000)
        size = len(r.body())
    context.close()
    print(f"sandboxes page, {n} sandboxes ({timings[-1]['rows']} rows):")
    for name, got in (("cached assets", timings), ("no cache", cold)):
        print(f"  {name}: first contentful paint   {pcts([t['fcp'] for t in got if t['fcp'] is not None])}")
        print(f"  {name}: every row rendered+painted {pcts([t['rendered'] for t in got])}")
    print(f"  GET /ui/api/overview:           {pcts(overview)}, {size / 1024:.0f} KiB")


# before the page's own script: each WebSocket message's arrival time, to split the echo's latency into
# the wire (keydown -> the PTY's echo arrives) and the terminal (-> parsed and painted by xterm.js)
WS_TAP = """(() => {
    const Native = window.WebSocket;
    window.WebSocket = function (...args) {
        const ws = new Native(...args);
        ws.addEventListener('message', () => {
            const e = window.__echo;
            if (e && e.expect !== null && e.wire === null) e.wire = performance.now() - e.t0;
        });
        return ws;
    };
    window.WebSocket.prototype = Native.prototype;
    Object.assign(window.WebSocket, { OPEN: 1, CLOSED: 3, CONNECTING: 0, CLOSING: 2 });
})();"""

ECHO_SETUP = """() => {
    window.__echo = { expect: null, t0: 0, wire: null, samples: [], wires: [] };
    const rows = document.querySelector('.xterm-rows');
    window.addEventListener('keydown', () => { window.__echo.t0 = performance.now(); window.__echo.wire = null; }, true);
    new MutationObserver(() => {
        const e = window.__echo;
        if (e.expect !== null && rows.textContent.includes(e.expect)) {
            e.samples.push(performance.now() - e.t0);
            e.wires.push(e.wire);
            e.expect = null;
        }
    }).observe(rows, { childList: true, subtree: true, characterData: true });
}"""


def bench_echo(browser, url: str, keys: int) -> None:  # noqa: ANN001
    with httpx.Client(base_url=url, headers={"X-API-Key": ADMIN_KEY}, timeout=60) as client:
        sandbox_id = client.post("/sandboxes", json={"templateID": "base", "timeout": 600}).json()["sandboxID"]
    try:
        context = browser.new_context(viewport={"width": 1280, "height": 860})
        context.add_init_script(WS_TAP)
        page = context.new_page()
        sign_in(page, url)
        page.goto(f"{url}/ui/#/sandboxes/{sandbox_id}")
        page.get_by_role("tab", name="Terminal").click()
        page.get_by_text("Terminal: connected").wait_for(timeout=20_000)
        page.locator(".xterm").click()
        page.keyboard.type("echo warm\n")
        wait_until(page, "() => document.querySelector('.xterm-rows').textContent.includes('warm')")
        page.evaluate(ECHO_SETUP)
        typed = "#lat-"
        page.keyboard.type(typed)
        wait_until(page, "(t) => document.querySelector('.xterm-rows').textContent.includes(t)", typed)
        alphabet = string.ascii_lowercase + string.digits
        for i in range(keys):
            ch = alphabet[i % len(alphabet)]
            typed += ch
            page.evaluate("(t) => { window.__echo.expect = t; }", typed)
            page.keyboard.press(ch)
            wait_until(page, "(n) => window.__echo.samples.length >= n", i + 1)
        samples = page.evaluate("() => window.__echo.samples")
        wires = [w for w in page.evaluate("() => window.__echo.wires") if w is not None]
        page.keyboard.press("Control+C")
        context.close()
        print(f"terminal keystroke echo (keydown -> char in xterm's rows): {pcts(samples)}")
        print(f"  of which keydown -> the echo's bytes arrive on the WebSocket: {pcts(wires)}")
    finally:
        with httpx.Client(base_url=url, headers={"X-API-Key": ADMIN_KEY}, timeout=60) as client:
            client.delete(f"/sandboxes/{sandbox_id}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--keys", type=int, default=50)
    args = ap.parse_args()
    if missing():
        raise SystemExit(f"cannot run: {missing()}")
    with console_server("--max-sandboxes", str(args.sandboxes + 10)) as srv, chromium() as browser:
        bench_echo(browser, srv.url, args.keys)
        t = time.perf_counter()
        ids, why = create_many(srv.url, args.sandboxes)
        print(f"created {len(ids)} sandboxes in {time.perf_counter() - t:.1f} s{f' (then: {why})' if why else ''}; "
              f"memory available then {available_mib()} MiB")
        try:
            time.sleep(3)  # the server's metrics sampler has a round of them for the sparklines
            bench_list(browser, srv.url, len(ids), args.runs)
        finally:
            t = time.perf_counter()
            kill_all(srv.url, ids)
            print(f"killed {len(ids)} in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
