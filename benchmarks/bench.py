"""agentcell's speed and density figures, measured against a real server started here.

    .venv/bin/python benchmarks/bench.py [--runs 50] [--max-sandboxes 1000]

Prints one line per figure. Targets on a 2-core machine (SPECIFICATION.md): create -> first
run_code result p50 < 50 ms, trivial run_code < 5 ms, >= 200 concurrent idle sandboxes.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from agentcell import Sandbox

SANDBOX_UID_MIN = 1_000_000  # the linux backend maps sandbox users to host ids from here up


def percentiles(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return f"p50 {statistics.median(ms):7.2f} ms   p95 {p95:7.2f} ms   (n={len(ms)})"


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def start_server(max_sandboxes: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        # no egress uplink: these figures are a sandbox's own; benchmarks/egress.py measures what internet adds
        [sys.executable, "-m", "agentcell", "serve", "--port", str(port), "--max-sandboxes", str(max_sandboxes),
         "--egress-uplink", "none", "--state-dir", tempfile.mkdtemp(prefix="agentcell-bench-")],
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code < 500:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not start within 60 s")


def sandbox_memory_kib() -> tuple[int, int, int]:
    """(PSS KiB, private dirty KiB, process count) of every process running as a sandbox user.

    PSS charges each sandbox its share of the zygote pages it still shares; private dirty is what
    the sandbox alone costs.
    """
    pss = private = count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid < SANDBOX_UID_MIN:
                continue
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1])
                    count += 1
                elif line.startswith("Private_Dirty:"):
                    private += int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pss, private, count


def bench_create_to_first_result(url: str, runs: int) -> None:
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        sbx = Sandbox.create(api_url=url)
        assert sbx.run_code("1 + 1").text == "2"
        samples.append(time.perf_counter() - t)
        sbx.kill()
    print(f"create -> first run_code result (agentcell SDK): {percentiles(samples)}")


def bench_round_trips(url: str, runs: int) -> None:
    with Sandbox.create(api_url=url) as sbx:
        sbx.run_code("x = 1")
        print(f"trivial run_code round trip:                   {percentiles(timed(lambda: sbx.run_code('x'), runs * 4))}")
        sbx.commands.run("true")
        print(f"commands.run('true'):                          {percentiles(timed(lambda: sbx.commands.run('true'), runs))}")
        sbx.files.write("/home/user/f", "x")
        print(f"files.read (small):                            {percentiles(timed(lambda: sbx.files.read('/home/user/f'), runs))}")


def bench_e2b_sdk(url: str, runs: int) -> None:
    try:
        from e2b_code_interpreter import Sandbox as E2BSandbox
    except ImportError:
        print("official e2b SDK: not installed (pip install e2b-code-interpreter)")
        return
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY="e2b_bench", E2B_DOMAIN="localhost")
    samples = []
    for _ in range(runs):
        t = time.perf_counter()
        sbx = E2BSandbox.create()
        assert sbx.run_code("1 + 1").text == "2"
        samples.append(time.perf_counter() - t)
        sbx.kill()
    print(f"create -> first run_code result (official e2b SDK): {percentiles(samples)}")


def bench_density(url: str, idle_sample: int, max_sandboxes: int) -> None:
    base_pss, base_private, _ = sandbox_memory_kib()
    sandboxes = [Sandbox.create(api_url=url, timeout=900) for _ in range(idle_sample)]
    for s in sandboxes:
        s.run_code("1")  # an idle sandbox that has run code once: agent + default context
    time.sleep(1)
    pss, private, procs = sandbox_memory_kib()
    print(f"memory per idle sandbox ({idle_sample} sandboxes, {procs} processes): "
          f"PSS {(pss - base_pss) / idle_sample / 1024:.2f} MiB, "
          f"private dirty {(private - base_private) / idle_sample / 1024:.2f} MiB")

    reason = f"reached the benchmark's cap of {max_sandboxes}"
    t = time.perf_counter()
    try:
        while len(sandboxes) < max_sandboxes:
            sandboxes.append(Sandbox.create(api_url=url, timeout=900))
    except Exception as e:  # the first limit we hit is the figure
        reason = f"stopped by: {type(e).__name__}: {str(e)[:120]}"
    elapsed = time.perf_counter() - t
    alive = sandboxes[-1].run_code("21 * 2").text if sandboxes else None
    print(f"concurrent idle sandboxes: {len(sandboxes)} ({reason}); last one answers run_code: {alive == '42'}")
    print(f"  created {len(sandboxes) - idle_sample} more in {elapsed:.1f} s; "
          f"free memory now {int(Path('/proc/meminfo').read_text().split()[4]) // 1024} MiB")
    kill_t = time.perf_counter()
    for s in sandboxes:
        s.kill()
    print(f"  killed {len(sandboxes)} in {time.perf_counter() - kill_t:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--idle-sample", type=int, default=50)
    ap.add_argument("--max-sandboxes", type=int, default=1000)
    ap.add_argument("--url", help="use a running server instead of starting one")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.max_sandboxes)
    try:
        Sandbox.create(api_url=url).kill()  # warm up
        bench_create_to_first_result(url, args.runs)
        bench_round_trips(url, args.runs)
        bench_e2b_sdk(url, args.runs)
        bench_density(url, args.idle_sample, args.max_sandboxes)
    finally:
        if proc:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
