"""The web console's server side (agentcell/console): terminal keystroke echo latency through its
WebSocket, and the sandboxes page's one call (`GET /ui/api/overview`) with many sandboxes.

    .venv/bin/python benchmarks/console_api.py [--sandboxes 1000] [--keys 100] [--paused 0.5]

Starts a server (no egress uplink), signs in to the console, creates --sandboxes sandboxes (8 at a
time) and pauses a share of them, waits until the manager has sampled each one's metrics, then times
20 overview calls (p50/p90, and the answer's size) and --keys single-key round trips in a terminal
(the key sent as a WebSocket frame until its echo comes back; p50/p90/p99). The browser's figures
(first paint) are benchmarks/console_browser.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from bench import start_server
from websockets.asyncio.client import connect


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


def create_many(url: str, n: int) -> list[str]:
    def one(_: int) -> str | None:
        for _attempt in range(3):
            try:
                r = httpx.post(f"{url}/sandboxes", json={"templateID": "base", "timeout": 3600}, timeout=120)
            except httpx.HTTPError:
                continue
            if r.status_code == 201:
                return str(r.json()["sandboxID"])
            if r.status_code not in (429, 503):
                print(f"create: {r.status_code} {r.text[:200]}", file=sys.stderr)
                return None
            time.sleep(1)
        return None

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        ids = [i for i in pool.map(one, range(n)) if i]
    print(f"created {len(ids)} of {n} sandboxes in {time.monotonic() - started:.0f} s")
    return ids


async def keystrokes(url: str, cookie: str, sandbox_id: str, n: int) -> list[float]:
    ws_url = url.replace("http://", "ws://") + f"/ui/api/sandboxes/{sandbox_id}/terminal?cols=120&rows=40"
    async with connect(ws_url, additional_headers={"Cookie": cookie}, origin=url) as ws:  # type: ignore[arg-type]
        await ws.send("echo rea''dy\r")
        seen = b""
        while b"ready" not in seen:
            seen += await asyncio.wait_for(ws.recv(), 30)  # type: ignore[operator]
        await asyncio.sleep(0.5)
        while True:  # the prompt and anything else in flight
            try:
                await asyncio.wait_for(ws.recv(), 0.3)
            except TimeoutError:
                break
        times = []
        for i in range(n):
            key = "abcdefghij"[i % 10]
            started = time.perf_counter()
            await ws.send(key.encode())
            echoed = b""
            while key.encode() not in echoed:
                echoed += await asyncio.wait_for(ws.recv(), 10)  # type: ignore[operator]
            times.append((time.perf_counter() - started) * 1000)
        await ws.send(b"\x15exit\r")
        return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sandboxes", type=int, default=1000)
    parser.add_argument("--paused", type=float, default=0.5, help="share of them paused")
    parser.add_argument("--keys", type=int, default=100)
    args = parser.parse_args()
    proc, url = start_server(max(args.sandboxes + 10, 20))
    try:
        client = httpx.Client(base_url=url, timeout=120)
        client.headers["X-CSRF-Token"] = client.post("/ui/api/session", json={"apiKey": ""}).json()["csrf"]
        cookie = "; ".join(f"{c.name}={c.value}" for c in client.cookies.jar)
        ids = create_many(url, args.sandboxes)
        to_pause = ids[: int(len(ids) * args.paused)]
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: client.post(f"/ui/api/v/sandboxes/{i}/pause", json={}), to_pause))
        print(f"paused {len(to_pause)} in {time.monotonic() - started:.0f} s (through the console's pass-through)")
        time.sleep(12)  # two sampling rounds (5 s) of the running ones
        times, size, sparks = [], 0, 0
        for _ in range(20):
            t = time.perf_counter()
            r = client.get("/ui/api/overview")
            times.append((time.perf_counter() - t) * 1000)
            size = len(r.content)
            sparks = sum(1 for s in r.json()["sandboxes"] if s["cpu"])
        print(f"overview, {len(ids)} sandboxes ({sparks} with samples), {size / 1024:.0f} KiB: "
              f"p50 {pct(times, 0.5):.1f} ms, p90 {pct(times, 0.9):.1f} ms")
        running = [i for i in ids if i not in set(to_pause)] or ids
        keys = asyncio.run(keystrokes(url, cookie, running[0], args.keys))
        print(f"terminal keystroke echo, {len(keys)} single keys: p50 {pct(keys, 0.5):.2f} ms, "
              f"p90 {pct(keys, 0.9):.2f} ms, p99 {pct(keys, 0.99):.2f} ms, mean {statistics.mean(keys):.2f} ms")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except Exception:
            proc.kill()


if __name__ == "__main__":
    main()
