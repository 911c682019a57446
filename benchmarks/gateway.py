"""What `agentcell gateway` costs and how fast it reacts: three cells and one gateway, all on loopback.

    .venv/bin/python benchmarks/gateway.py [--runs 20] [--burst 100] [--standbys 4]
    .venv/bin/python benchmarks/gateway.py --runs 2 --burst 6 --standbys 1      # a smoke run

Rows (p50 / p95 over --runs, direct to a cell vs through the gateway, interleaved, and the ratio of p50s):
* create -> first result (agentcell SDK: Sandbox.create + run_code("1")); direct: the three cells in turn;
* run_code("1") on one sandbox, reached directly and through the gateway;
* a burst of --burst concurrent creates through the gateway over three cells (wall time, per-create
  p50/p95, how they spread);
* time for the gateway to notice a dead cell: SIGSTOP (its poll times out) and SIGKILL (refused).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from agentcell import Sandbox

CELL_IDS = ("bencha01", "benchb02", "benchc03")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited with {proc.returncode}")
        try:
            httpx.get(url + "/health", timeout=1)
            return
        except httpx.TransportError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not start")


def start_cell(cell_id: str, standbys: int) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "agentcell", "serve", "--port", str(port), "--cell-id", cell_id,
                             "--egress-uplink", "none", "--standbys", str(standbys),
                             "--state-dir", tempfile.mkdtemp(prefix="agentcell-bench-")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def start_gateway(cells: list[str], poll: float) -> tuple[subprocess.Popen[bytes], str]:
    port = _port()
    args = [a for c in cells for a in ("--cell", c)]
    proc = subprocess.Popen([sys.executable, "-m", "agentcell", "gateway", "--port", str(port), "--poll-interval",
                             str(poll), "--log-level", "warning", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def row(name: str, direct: list[float], via: list[float]) -> None:
    d, g = statistics.median(direct), statistics.median(via)
    print(f"{name:<34} direct {d * 1000:8.2f} / {pct(direct, .95) * 1000:8.2f} ms   gateway "
          f"{g * 1000:8.2f} / {pct(via, .95) * 1000:8.2f} ms   ratio {g / d:5.2f}  (+{(g - d) * 1000:.2f} ms)")


def create_and_run(url: str) -> None:
    sbx = Sandbox.create(api_url=url, timeout=120)
    try:
        assert sbx.run_code("1").text == "1"
    finally:
        sbx.kill()


def notice(gateway: str, cell_id: str, up: bool, timeout: float = 30) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        cells = {c["cellId"]: c for c in httpx.get(gateway + "/v1/cells", timeout=5).json()}
        if cells.get(cell_id, {}).get("up") is up:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise SystemExit(f"the gateway did not mark {cell_id} {'up' if up else 'down'} within {timeout} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--burst", type=int, default=100)
    ap.add_argument("--standbys", type=int, default=4)
    ap.add_argument("--poll-interval", type=float, default=1.0)
    a = ap.parse_args()
    os.environ["AGENTCELL_EGRESS_UPLINK"] = "none"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        cells = [start_cell(cid, a.standbys) for cid in CELL_IDS]
        procs += [p for p, _ in cells]
        for p, url in cells:
            _wait_http(url, p)
        gw_proc, gw = start_gateway([u for _, u in cells], a.poll_interval)
        procs.append(gw_proc)
        _wait_http(gw, gw_proc)
        notice(gw, CELL_IDS[0], True)
        direct_url = cells[0][1]
        print(f"3 cells, 1 gateway (poll {a.poll_interval:g} s), {a.runs} runs, p50 / p95")

        create_direct: list[float] = []
        create_via: list[float] = []
        for i in range(a.runs):  # direct: the cells in turn, so both sides draw on three cells' standbys
            url = cells[i % len(cells)][1]
            create_direct.append(timed(lambda u=url: create_and_run(u)))  # type: ignore[misc]
            create_via.append(timed(lambda: create_and_run(gw)))
        row("create -> first result", create_direct, create_via)

        sbx = Sandbox.create(api_url=direct_url, timeout=300)
        try:
            near = Sandbox.connect(sbx.sandbox_id, api_url=direct_url)
            far = Sandbox.connect(sbx.sandbox_id, api_url=gw)
            near.run_code("1")
            far.run_code("1")
            run_direct, run_via = [], []
            for _ in range(max(a.runs, 5) * 5):
                run_direct.append(timed(lambda: near.run_code("1")))
                run_via.append(timed(lambda: far.run_code("1")))
            row('run_code("1")', run_direct, run_via)
        finally:
            sbx.kill()

        each: list[float] = []

        def one() -> str:
            t = time.perf_counter()
            r = httpx.post(gw + "/v2/sandboxes", json={"templateID": "base", "timeout": 120}, timeout=120)
            each.append(time.perf_counter() - t)
            if r.status_code != 201:
                raise SystemExit(f"a create of the burst failed: {r.status_code} {r.text[:300]}")
            return str(r.json()["sandboxID"])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(a.burst, 32)) as pool:
            ids = list(pool.map(lambda _: one(), range(a.burst)))
        wall = time.perf_counter() - t0
        spread = Counter(sid[:8] for sid in ids)
        print(f"burst of {a.burst} creates via gateway  wall {wall:.2f} s ({a.burst / wall:.1f}/s)   each "
              f"{statistics.median(each) * 1000:.0f} / {pct(each, .95) * 1000:.0f} ms   spread "
              + " ".join(f"{c}:{spread.get(c, 0)}" for c in CELL_IDS))
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(lambda sid: httpx.delete(f"{gw}/sandboxes/{sid}", timeout=60), ids))

        victim = cells[2][0]
        os.kill(victim.pid, signal.SIGSTOP)
        stopped = notice(gw, CELL_IDS[2], False)
        os.kill(victim.pid, signal.SIGCONT)
        back = notice(gw, CELL_IDS[2], True)
        victim.kill()
        killed = notice(gw, CELL_IDS[2], False)
        print(f"dead cell noticed                  SIGSTOP {stopped * 1000:.0f} ms   SIGKILL {killed * 1000:.0f} ms"
              f"   back after SIGCONT {back * 1000:.0f} ms")
    finally:
        for p in procs:
            if p.poll() is None:
                with_cont = p.pid
                os.kill(with_cont, signal.SIGCONT)
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
