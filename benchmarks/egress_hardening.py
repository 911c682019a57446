"""Issue 25's figures for the egress proxy: a bystander's `commands.run("true")` while another sandbox
floods the proxy with TLS handshakes (goal: p50 at most 1.5x its quiet p50), and what the hardening
costs elsewhere: egress throughput (the kernel's path, the proxy's plain HTTP, the proxy's TLS) and
create -> first result, against a server started from another checkout (`--baseline DIR`, e.g. a
worktree of the commit before), the two servers interleaved run by run. Needs root.

    .venv/bin/python benchmarks/egress_hardening.py [--baseline DIR] [--runs 30] [--megabytes 300] [--flood-s 8]

Nothing leaves this machine: the servers' uplinks lead into a network namespace built here (the tests'
internet, tests/internet_services.py, on documentation addresses), which has no route anywhere else.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agentcell import Sandbox  # noqa: E402
from agentcell.network.ca import EgressCA  # noqa: E402
from tests.sandbox_code import FLOOD  # noqa: E402

INET = f"achard{os.getpid() % 100000}-inet"
WEB, DNS = "203.0.113.10", "198.51.100.53"


def pct(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    return f"p50 {statistics.median(ms):7.2f} ms  p95 {ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]:7.2f} ms"


def ns(*args: str) -> None:
    subprocess.run(["ip", "-n", INET, *args], check=True)


def start_internet(tmp: Path) -> subprocess.Popen[str]:
    subprocess.run(["ip", "netns", "add", INET], check=True)
    ca = EgressCA.load_or_create(str(tmp / "ca"))
    (tmp / "upstream.pem").write_bytes(ca.issue("allowed.test", "secret.test", "other.test"))
    (tmp / "ca.pem").write_bytes(ca.cert_pem)
    ns("link", "set", "lo", "up")
    for addr in (WEB, DNS):
        ns("addr", "add", f"{addr}/32", "dev", "lo")
    services = subprocess.Popen(["ip", "netns", "exec", INET, sys.executable,
                                 str(REPO / "tests" / "internet_services.py"), WEB, DNS],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "INET_TLS_CERT": str(tmp / "upstream.pem")})
    assert services.stdout is not None and services.stdout.readline().strip() == "ready"
    return services


class Server:
    def __init__(self, name: str, tree: Path, tmp: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log = tmp / f"{name}.log"
        state = tempfile.mkdtemp(prefix=f"agentcell-bench-{name}-")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentcell", "serve", "--port", str(port), "--state-dir", state,
             "--egress-uplink", f"netns:/run/netns/{INET}", "--egress-dns", DNS, "--egress-ca-bundle",
             str(tmp / "ca.pem")], cwd=tree, stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(tree)})
        deadline = time.monotonic() + 180
        while True:
            try:
                httpx.get(f"{self.url}/health", timeout=1)
                break
            except httpx.TransportError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"server {name} did not start; log: {self.log}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def create_to_first_result(server: Server) -> float:
    t = time.perf_counter()
    sbx = Sandbox.create(api_url=server.url)
    sbx.run_code("1 + 1")
    took = time.perf_counter() - t
    sbx.kill()
    time.sleep(0.05)  # the pool prepares the next standby off the clock, as between real requests
    return took


def throughput(sbx: Sandbox, url: str, megabytes: int) -> float:
    r = sbx.commands.run(f"curl -s -o /dev/null -w '%{{size_download}} %{{time_total}}' {url}/big/{megabytes << 20}",
                         timeout=300)
    size, seconds = r.stdout.split()
    assert int(size) == megabytes << 20, r.stdout
    return int(size) / float(seconds) / 1e6


def flood_figures(server: Server, runs: int, flood_s: float) -> tuple[list[float], list[float], int]:
    bystander = Sandbox.create(api_url=server.url, timeout=600)
    # a sandbox with a secret: every TLS connection of its is terminated by the proxy (on 256c5b0, by the
    # server's own loop), which is what the flood makes it do as often as it can
    attacker = Sandbox.create(api_url=server.url, timeout=600,
                              secrets={"KEY": {"value": "sk-" + "0" * 24, "hosts": ["secret.test"]}})
    try:
        assert attacker.run_code(FLOOD).error is None
        quiet = [_timed(bystander) for _ in range(runs)]  # (and as many after the flood, below)
        tried: list[int] = []
        done = threading.Event()

        def attack() -> None:
            ex = attacker.run_code(f"print(flood({flood_s}))", timeout=flood_s + 60)
            tried.append(int("".join(ex.logs.stdout).strip() or 0))
            done.set()

        t = threading.Thread(target=attack)
        t.start()
        time.sleep(1.0)
        loud = []
        while not done.is_set():
            loud.append(_timed(bystander))
        t.join()
        quiet += [_timed(bystander) for _ in range(runs)]
        return quiet, loud, tried[0] if tried else 0
    finally:
        bystander.kill()
        attacker.kill()


def _timed(sbx: Sandbox) -> float:
    t = time.perf_counter()
    sbx.commands.run("true")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path, help="another agentcell checkout to compare with (interleaved)")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--megabytes", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds per path and server")
    ap.add_argument("--flood-s", type=float, default=8.0)
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (network namespaces, like the server)")
    tmp = Path(tempfile.mkdtemp(prefix="agentcell-bench-hardening-"))
    services = start_internet(tmp)
    servers: list[Server] = []
    try:
        servers.append(Server("this", REPO, tmp))
        if args.baseline:
            servers.append(Server("baseline", args.baseline.resolve(), tmp))
        print(f"servers: {', '.join(f'{s.name} ({s.url})' for s in servers)}; logs in {tmp}\n")
        creates: dict[str, list[float]] = {s.name: [] for s in servers}
        for _ in range(args.runs):  # interleaved: this machine's drift hits every server alike
            for s in servers:
                creates[s.name].append(create_to_first_result(s))
        print("create -> first result (internet on)")
        for name, samples in creates.items():
            print(f"  {name:9} {pct(samples)}")
        print(f"\nthroughput, {args.megabytes} MB downloads (MB/s, best of {args.rounds}, interleaved)")
        boxes = {s.name: (Sandbox.create(api_url=s.url, timeout=900),
                          Sandbox.create(api_url=s.url, timeout=900, network={"allow_out": ["allowed.test"]}),
                          Sandbox.create(api_url=s.url, timeout=900,
                                         secrets={"KEY": {"value": "sk-" + "1" * 24, "hosts": ["secret.test"]}}))
                 for s in servers}
        paths = (("kernel (no interception)", 0, f"http://{WEB}"), ("proxy, plain HTTP", 1, "http://allowed.test"),
                 ("proxy, HTTPS", 1, "https://allowed.test"),
                 # terminated on both: the like-for-like comparison of the proxy's TLS path
                 ("proxy, HTTPS with a secret", 2, "https://secret.test"))
        for label, which, url in paths:
            best = {s.name: 0.0 for s in servers}
            for _ in range(args.rounds):
                for s in servers:
                    box = boxes[s.name][which]
                    insecure = which == 1 and url.startswith("https") and s.name == "baseline"  # passed through
                    best[s.name] = max(best[s.name], throughput(box, url.replace("https://", "-k https://")
                                                                if insecure else url, args.megabytes))
            print(f"  {label:26} " + "   ".join(f"{n} {v:8.1f}" for n, v in best.items()))
        for pair in boxes.values():
            for box in pair:
                box.kill()
        print(f"\nbystander commands.run('true') while another sandbox floods the proxy with TLS handshakes "
              f"({args.flood_s:.0f} s, 24 threads); goal: p50 <= 1.5x quiet")
        for s in servers:
            quiet, loud, tried = flood_figures(s, args.runs, args.flood_s)
            ratio = statistics.median(loud) / statistics.median(quiet)
            print(f"  {s.name:9} quiet {pct(quiet)}   flood {pct(loud)}   x{ratio:.2f}   "
                  f"({tried} connections tried, {tried / args.flood_s:.0f}/s)")
    finally:
        for s in servers:
            s.stop()
        services.kill()
        subprocess.run(["ip", "netns", "del", INET], check=False)


if __name__ == "__main__":
    main()
