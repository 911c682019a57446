"""What a sandbox's internet costs: create -> first result with and without it, the egress path's
throughput, and the kernel memory each linked sandbox holds. Needs root.

    .venv/bin/python benchmarks/egress.py [--runs 40] [--megabytes 1000] [--sandboxes 100]

Nothing leaves this machine: the server's uplink leads into a network namespace built here (a web
server on 203.0.113.10 and a DNS server on 198.51.100.53, as in tests/test_egress.py), which has no
route anywhere else. Targets (issue 7): internet on adds <= 5 ms p50 to create -> first result;
>= 1 Gbit/s through the egress path; ~2 MB per sandbox at most, no per-sandbox daemon.
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
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agentcell import Sandbox  # noqa: E402

INET = f"acbench{os.getpid() % 100000}-inet"
WEB, DNS = "203.0.113.10", "198.51.100.53"
PAUSE = float(os.environ.get("PAUSE", "0.05"))


def percentiles(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return f"p50 {statistics.median(ms):7.2f} ms   p95 {p95:7.2f} ms   (n={len(ms)})"


def start_server(uplink: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # a state dir of its own: two servers run at once here, and a state dir serves one server
    proc = subprocess.Popen([sys.executable, "-m", "agentcell", "serve", "--port", str(port), "--egress-uplink", uplink,
                             "--egress-dns", DNS, "--max-sandboxes", "1100",
                             "--state-dir", tempfile.mkdtemp(prefix="agentcell-bench-")],
                            cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1)
            return proc, url
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start; log: {log}") from None
            time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def create_to_first_result(url: str, runs: int, **kwargs: object) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        sbx = Sandbox.create(api_url=url, **kwargs)  # type: ignore[arg-type]
        sbx.run_code("1 + 1")
        out.append(time.perf_counter() - t)
        sbx.kill()
        time.sleep(PAUSE)  # let the pool prepare the next standby off the clock, as between real requests
    return out


def burst(url: str, n: int) -> float:
    """Seconds for `n` creates at once (async SDK), each to its first result; all killed after."""
    import asyncio

    from agentcell import AsyncSandbox

    async def one() -> AsyncSandbox:
        sbx = await AsyncSandbox.create(api_url=url, timeout=120)
        await sbx.run_code("1 + 1")
        return sbx

    async def run() -> float:
        t = time.perf_counter()
        made = await asyncio.gather(*(one() for _ in range(n)))
        took = time.perf_counter() - t
        await asyncio.gather(*(s.kill() for s in made))
        return took

    took = asyncio.run(run())
    time.sleep(3)  # the pool refills before the next round
    return took


def meminfo() -> tuple[int, int]:
    """(KiB used by everything, KiB of kernel objects: slab, per-cpu, stacks, page tables)."""
    info = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}
    return (info["MemTotal"] - info["MemAvailable"],
            info["Slab"] + info["Percpu"] + info["KernelStack"] + info["PageTables"])


def memory_per_sandbox(url: str, n: int) -> tuple[float, float]:
    """KiB per idle sandbox: all of it (MemAvailable; noisy), and the kernel's objects alone."""
    time.sleep(2)
    before = meminfo()
    made = [Sandbox.create(api_url=url, timeout=600) for _ in range(n)]
    for sbx in made:
        sbx.run_code("1")
    time.sleep(2)
    after = meminfo()
    for sbx in made:
        sbx.kill()
    return (after[0] - before[0]) / n, (after[1] - before[1]) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--megabytes", type=int, default=1000)
    ap.add_argument("--sandboxes", type=int, default=100)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces, and the server itself)")
    addresses = [WEB, DNS]
    subprocess.run(["ip", "netns", "add", INET], check=True)
    services = None
    logdir = Path(f"/tmp/agentcell-bench-egress-{os.getpid()}")
    logdir.mkdir(exist_ok=True)
    try:
        subprocess.run(["ip", "-n", INET, "link", "set", "lo", "up"], check=True)
        for a in addresses:
            subprocess.run(["ip", "-n", INET, "addr", "add", f"{a}/32", "dev", "lo"], check=True)
        services = subprocess.Popen(["ip", "netns", "exec", INET, sys.executable,
                                     str(REPO / "tests" / "internet_services.py"), *addresses],
                                    stdout=subprocess.PIPE, text=True)
        assert services.stdout is not None and services.stdout.readline().strip() == "ready"

        figures: dict[str, list[float]] = {}
        mem: dict[str, tuple[float, float]] = {}
        throughput: dict[str, float] = {}
        # create -> first result, the two servers interleaved run by run (this machine's speed drifts)
        off, off_url = start_server("none", logdir / "none.log")
        on, on_url = start_server(f"netns:/run/netns/{INET}", logdir / "netns.log")
        try:
            for url in (off_url, on_url):
                create_to_first_result(url, 5)  # warm up
            for label in ("internet off (no uplink)", "internet on", "internet on, allow list of 3 domains"):
                figures[label] = []
            bursts: dict[str, list[float]] = {"off": [], "on": []}
            for _ in range(3):  # bursts of 50, interleaved
                bursts["off"].append(burst(off_url, 50))
                bursts["on"].append(burst(on_url, 50))
            for _ in range(args.runs):
                figures["internet off (no uplink)"] += create_to_first_result(off_url, 1)
                figures["internet on"] += create_to_first_result(on_url, 1)
                figures["internet on, allow list of 3 domains"] += create_to_first_result(
                    on_url, 1, network={"allow_out": ["allowed.test", "*.wild.test", "other.test"]})
        finally:
            stop(off)
            stop(on)
        for label, uplink in (("internet off (no uplink)", "none"), ("internet on", f"netns:/run/netns/{INET}")):
            proc, url = start_server(uplink, logdir / f"{uplink.split(':')[0]}.log")
            try:
                if uplink != "none":
                    code = (f"import socket, time\ns = socket.create_connection(('{{host}}', 80))\n"
                            f"s.sendall(b'GET /big/{args.megabytes << 20} HTTP/1.0\\r\\nHost: {{host}}\\r\\n\\r\\n')\n"
                            "t = time.perf_counter(); got = 0\n"
                            "while True:\n    b = s.recv(1 << 20)\n    if not b: break\n    got += len(b)\n"
                            "print(got, time.perf_counter() - t)")
                    # the kernel path (no domain rules), then the proxy's relay (a domain allow list)
                    for key, network in (("kernel", None), ("proxy", {"allow_out": ["allowed.test"]})):
                        with Sandbox.create(api_url=url, timeout=600, network=network) as sbx:
                            host = WEB if network is None else "allowed.test"
                            ex = sbx.run_code(code.replace("{host}", host), timeout=600)
                            got, secs = ex.logs.stdout[0].split()
                            throughput[key] = int(got) / float(secs)
                mem[label] = memory_per_sandbox(url, args.sandboxes)
            finally:
                stop(proc)
        print("create -> first run_code result (sync SDK over TCP, one at a time):")
        for label, samples in figures.items():
            print(f"  {label:40s} {percentiles(samples)}")
        off = statistics.median(figures["internet off (no uplink)"])
        on = statistics.median(figures["internet on"])
        print(f"  internet adds {1000 * (on - off):+.2f} ms at p50 (target <= 5 ms)")
        print("burst of 50 creates at once, each to its first result (3 rounds, interleaved): internet off "
              f"{', '.join(f'{b:.2f}' for b in bursts['off'])} s; on {', '.join(f'{b:.2f}' for b in bursts['on'])} s")
        for key, label in (("kernel", "through the router (kernel path)"),
                           ("proxy", "through the egress proxy (domain rules, port 80)")):
            print(f"egress throughput, one sandbox, one TCP stream {label}: {throughput[key] / 1e6:.0f} MB/s "
                  f"= {throughput[key] * 8 / 1e9:.2f} Gbit/s (target >= 1 Gbit/s for the kernel path)")
        print(f"host memory per idle sandbox ({args.sandboxes} sandboxes): all (MemAvailable), kernel objects")
        for label, (everything, kernel) in mem.items():
            print(f"  {label:40s} {everything / 1024:6.2f} MiB   {kernel / 1024:6.2f} MiB")
        d_all = (mem["internet on"][0] - mem["internet off (no uplink)"][0]) / 1024
        d_kernel = (mem["internet on"][1] - mem["internet off (no uplink)"][1]) / 1024
        print(f"  internet adds {d_all:+.2f} MiB per sandbox in all (noisy: the page cache moves too), "
              f"{d_kernel:+.2f} MiB of kernel objects")
    finally:
        if services is not None:
            services.kill()
        subprocess.run(["ip", "netns", "del", INET], check=False)


if __name__ == "__main__":
    main()
