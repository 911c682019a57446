"""Soak: hours of mixed traffic against one server (or a gateway with two cells), then a check that
everything it made on the host is gone again.

    .venv/bin/python benchmarks/soak.py                                   # 60 min, linux backend, one server
    .venv/bin/python benchmarks/soak.py --minutes 60 --gateway            # a gateway in front of two cells
    .venv/bin/python benchmarks/soak.py --backend gvisor --minutes 30
    .venv/bin/python benchmarks/soak.py --minutes 3 --window 60 --out /tmp/soak   # a short look (CI's)

The workload, `--rate` sessions a minute (spread evenly) plus a burst of `--burst` every `--burst-every`
seconds, at most `--concurrency` at once (a session that would go past it is counted as skipped). A
session creates a sandbox, does one kind of work, checks the answer and kills it:
code (state kept across cells, a matplotlib chart), commands (output of a few MB, a background command
killed), files (1 MiB up and down, a directory of small files), pty, pause/resume (memory kept, or files
only), snapshot → new sandbox → delete, network (rules set and changed; probes that must fail: there is
no uplink), timeout (left to expire). Every answer is checked; a wrong one is a failed session. Each
`--window` runs the same sessions (kinds dealt in proportion to their weights from a deck shuffled by
`--seed`, the same deal every window), so that its first and last windows differ by time alone.

Measured every `--sample` seconds (benchmarks/census.py): the server's RSS and fds, kernel objects
(cgroups, namespaces, mounts, nft objects, conntrack entries, sandbox uids, loop devices), disk under
the state dir and the runtime store; create latency p50/p99 per `--window`. Printed as a table and, with
`--out`, written as soak.json and soak.png.

The goals (exit 1 when one fails): no failed session; once the traffic stops and the sandboxes are
gone, every object count back at its baseline (taken after `--warmup` seconds of
traffic, 10 minutes by default, bursts among them: bounded caches full, the allocators' peak seen); with
`--strict` also server RSS growth < 5 % and p99 create latency of the last window <= 1.2x the first.
Nothing leaves the machine: the egress uplink is a namespace with no route anywhere (linux), or none (gvisor).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import census
import httpx

from agentcell import Sandbox
from agentcell.errors import CommandExitException
from agentcell.sdk.models import PtySize

# --- the servers ----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    state_dir: str | None
    log: Path

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode}; its log: {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"{self.name} did not answer within {timeout} s; its log: {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextlib.contextmanager
def routeless_uplink(backend: str) -> Iterator[list[str]]:
    """The egress router's uplink: a network namespace with no route anywhere, so that sandboxes may have
    internet access and rules (the router, its nft sets and conntrack work) and nothing leaves the
    machine. The gvisor backend has no network: no uplink."""
    if backend != "linux":
        yield ["--egress-uplink", "none"]
        return
    name = f"acsoak{os.getpid() % 100000}-inet"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield ["--egress-uplink", f"netns:/run/netns/{name}", "--egress-dns", "198.51.100.53"]
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def start_server(name: str, work: Path, backend: str, standbys: int, max_sandboxes: int,
                 extra: list[str] | None = None, state_dir: Path | None = None, port: int | None = None,
                 prefix: list[str] | None = None) -> Server:
    """`agentcell serve` on loopback; `prefix` runs it through a wrapper (e.g. into a cgroup)."""
    port = port or free_port()
    state = state_dir or work / f"{name}-state"
    state.mkdir(exist_ok=True)
    log = work / f"{name}.log"
    command = [*(prefix or []), sys.executable, "-m", "agentcell", "serve", "--port", str(port), "--backend", backend,
               "--standbys", str(standbys), "--max-sandboxes", str(max_sandboxes),
               "--state-dir", str(state), *(extra or [])]
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return Server(name, proc, f"http://127.0.0.1:{port}", str(state), log)


def start_gateway(work: Path, cells: list[Server]) -> Server:
    port = free_port()
    log = work / "gateway.log"
    command = [sys.executable, "-m", "agentcell", "gateway", "--port", str(port), "--poll-interval", "1",
               *[a for c in cells for a in ("--cell", c.url)]]
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return Server("gateway", proc, f"http://127.0.0.1:{port}", None, log)


# --- the sessions -----------------------------------------------------------------------------------------


class WrongAnswer(AssertionError):
    pass


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise WrongAnswer(what)


Latency = tuple[float, float, str]  # (when, seconds, what the sandbox was made from: template or snapshot)


@dataclass
class Ctx:
    url: str
    backend: str
    rng: random.Random
    create_latencies: list[Latency]  # shared by the sessions' threads
    lock: threading.Lock = field(default_factory=threading.Lock)

    def create(self, **kwargs: Any) -> Sandbox:
        source = "snapshot" if "template" in kwargs else "template"  # the sessions pass one only for a snapshot
        t0 = time.monotonic()
        sbx = Sandbox.create(api_url=self.url, timeout=kwargs.pop("timeout", 300), request_timeout=120, **kwargs)
        with self.lock:
            self.create_latencies.append((t0, time.monotonic() - t0, source))
        return sbx


CHART = """
import matplotlib.pyplot as plt
plt.plot([1, 2, 3], [x * x for x in range(3)])
plt.title("soak")
plt.show()
"""


def session_code(ctx: Ctx) -> None:
    with ctx.create() as sbx:
        n = ctx.rng.randrange(1000)
        sbx.run_code(f"state = {n}")
        expect(sbx.run_code("state + 1").text == str(n + 1), "state kept across cells")
        chart = sbx.run_code(CHART)
        expect(chart.error is None, f"the chart cell failed: {chart.error}")
        expect(any(r.png for r in chart.results), "a chart came back as PNG")
        expect(sbx.run_code("1/0").error is not None, "an error is reported")


def session_commands(ctx: Ctx) -> None:
    with ctx.create() as sbx:
        size = ctx.rng.choice((10_000, 1_000_000, 3_000_000))
        out = sbx.commands.run(f"head -c {size} /dev/zero | tr '\\0' a")
        expect(len(out.stdout) == size, f"{size} bytes of output, got {len(out.stdout)}")
        expect(sbx.commands.run("seq 1 5000 | tail -1").stdout.strip() == "5000", "seq's last line")
        bg = sbx.commands.run("sleep 600", background=True)
        expect(sbx.commands.kill(bg.pid), "a background command is killed")
        try:
            sbx.commands.run("echo bye >&2; exit 3")
            raise WrongAnswer("a failing command raised nothing")
        except CommandExitException as e:
            expect(e.exit_code == 3 and "bye" in e.stderr, f"exit 3 and its stderr: {e}")


def session_files(ctx: Ctx) -> None:
    with ctx.create() as sbx:
        blob = ctx.rng.randbytes(1 << 20)
        sbx.files.write("/home/user/blob.bin", blob)
        expect(sbx.files.read("/home/user/blob.bin", format="bytes") == blob, "1 MiB read back equal")
        for i in range(20):
            sbx.files.write(f"/home/user/d/f{i}.txt", f"file {i}")
        names = {e.name for e in sbx.files.list("/home/user/d")}
        expect(names == {f"f{i}.txt" for i in range(20)}, f"the directory lists its 20 files: {sorted(names)}")
        sbx.files.remove("/home/user/d")
        expect(not sbx.files.exists("/home/user/d"), "a removed directory is gone")


def session_pty(ctx: Ctx) -> None:
    with ctx.create() as sbx:
        term = sbx.pty.create(PtySize(rows=24, cols=80))
        sbx.pty.send_stdin(term.pid, b"echo soak-$((6*7))\n")
        out = bytearray()
        deadline = time.monotonic() + 30
        for _, _, chunk in term:
            out += chunk or b""
            if b"soak-42" in out or time.monotonic() > deadline:
                break
        expect(b"soak-42" in out, f"the terminal echoed: {bytes(out[-200:])!r}")
        sbx.pty.kill(term.pid)


def session_pause(ctx: Ctx) -> None:
    mode = ctx.rng.choice(("full", "filesystem"))
    sbx = ctx.create()
    try:
        sbx.run_code("kept = 41")
        sbx.files.write("/home/user/kept.txt", "kept")
        expect(sbx.pause(mode=mode), "the pause took")
        sbx = Sandbox.connect(sbx.sandbox_id, api_url=ctx.url, request_timeout=120)
        if mode == "full":
            expect(sbx.run_code("kept + 1").text == "42", "memory kept across a pause")
        expect(sbx.files.read("/home/user/kept.txt") == "kept", f"files kept across a {mode} pause")
    finally:
        sbx.kill()


def session_snapshot(ctx: Ctx) -> None:
    with ctx.create() as sbx:
        sbx.files.write("/home/user/snap.txt", "from the snapshot")
        snap = sbx.create_snapshot(mode="filesystem")
    try:
        with ctx.create(template=snap.snapshot_id) as child:
            expect(child.files.read("/home/user/snap.txt") == "from the snapshot", "a snapshot's file in its child")
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id, api_url=ctx.url)


PROBE = ("python3 -c \"import socket,sys; s=socket.socket(); s.settimeout(2)\n"
         "try: s.connect(('{ip}', 80)); print('reached')\nexcept OSError as e: print('refused', e)\"")


def session_network(ctx: Ctx) -> None:
    if ctx.backend == "gvisor":  # the gvisor backend has no network: a sandbox with none
        with ctx.create(allow_internet_access=False) as sbx:
            expect("refused" in sbx.commands.run(PROBE.format(ip="192.0.2.1")).stdout, "no network on gvisor")
        return
    with ctx.create(allow_internet_access=True,
                    network={"allow_out": ["198.51.100.7"], "deny_out": ["0.0.0.0/0"]}) as sbx:
        # there is no uplink (--egress-uplink none): even the allowed address is not reached
        for ip in ("198.51.100.7", "203.0.113.9", "10.0.0.1"):
            expect("refused" in sbx.commands.run(PROBE.format(ip=ip)).stdout, f"{ip} unreachable")
        sbx.update_network({"allow_out": ["203.0.113.0/24"], "deny_out": ["0.0.0.0/0"]})
        expect("refused" in sbx.commands.run(PROBE.format(ip="203.0.113.9")).stdout, "still no uplink")


def session_timeout(ctx: Ctx) -> None:
    sbx = ctx.create(timeout=3)
    expect(sbx.run_code("1 + 1").text == "2", "it ran before its end")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            sbx.get_info()
        except Exception:  # noqa: BLE001 - gone (404), as it should be
            return
        time.sleep(1)
    raise WrongAnswer("a sandbox past its timeout is still listed")


SESSIONS: dict[str, tuple[Callable[[Ctx], None], int]] = {  # kind -> (session, weight)
    "code": (session_code, 4), "commands": (session_commands, 3), "files": (session_files, 3),
    "pty": (session_pty, 2), "pause": (session_pause, 2), "snapshot": (session_snapshot, 1),
    "network": (session_network, 2), "timeout": (session_timeout, 1),
}


FD_SLACK = 16  # a server's fds at the end may exceed the baseline's by its clients' idle connections

# --- the run ----------------------------------------------------------------------------------------------


@dataclass
class Tally:
    done: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_session(kind: str, ctx: Ctx, tally: Tally) -> None:
    try:
        SESSIONS[kind][0](ctx)
        with tally.lock:
            tally.done[kind] += 1
    except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the soak
        with tally.lock:
            tally.failed[kind] += 1
            if len(tally.errors) < 50:
                tally.errors.append(f"{time.strftime('%H:%M:%S')} {kind}: {type(e).__name__}: {e}\n"
                                    + "".join(traceback.format_exception(e)[-3:]))
    finally:
        with tally.lock:
            tally.in_flight -= 1


def drive(urls: list[str], backend: str, seconds: float, rate: float, burst: int, burst_every: float,
          concurrency: int, seed: int, latencies: list[Latency], tally: Tally,
          first_burst: float | None = None, period: float | None = None) -> None:
    """Start sessions for `seconds`: `rate` a minute evenly, plus `burst` every `burst_every` s (the first
    after `first_burst` s, by default half of `burst_every`).

    The sessions' kinds are dealt from a deck that holds each kind as often as its weight, shuffled once
    by `seed` (the bursts from a deck of their own), and each session's own draws (sizes, values) are
    seeded by its place in the deal; every `period` seconds the deal starts over. So each period runs the same sessions in the same order: with
    a period that is a multiple of `burst_every` and of 60 / `rate`, the same work at the same moments
    (which sessions a burst holds, above all), and a window compared with another differs by time alone."""
    decks = [[k for k, (_, w) in SESSIONS.items() for _ in range(w)] for _ in range(2)]  # steady, burst
    for n, deck in enumerate(decks):
        random.Random(seed * 2 + n).shuffle(deck)
    with ThreadPoolExecutor(max_workers=concurrency + burst) as pool:
        start = time.monotonic()
        # the first burst half-way into the first window: with --window = --burst-every each window has one
        next_steady, next_burst = start, start + (burst_every / 2 if first_burst is None else first_burst)
        i = 0
        dealt = [0, 0]  # places dealt in this period: steady, burst
        current = 0  # the period being dealt
        while time.monotonic() - start < seconds:
            now = time.monotonic()
            if period and int((now - start) // period) != current:
                current, dealt = int((now - start) // period), [0, 0]
            due = []
            if now >= next_steady:
                due, next_steady = [0], next_steady + 60.0 / rate
            if burst and now >= next_burst:
                due, next_burst = due + [1] * burst, next_burst + burst_every
            for which in due:
                place = dealt[which]
                dealt[which] += 1  # a skipped session keeps its place: the others keep theirs
                with tally.lock:
                    if tally.in_flight >= concurrency + burst:
                        tally.skipped += 1
                        continue
                    tally.in_flight += 1
                i += 1
                rng = random.Random(seed * 1_000_003 + which * 100_003 + place)
                pool.submit(run_session, decks[which][place % len(decks[which])],
                            Ctx(urls[i % len(urls)], backend, rng, latencies), tally)
            time.sleep(0.05)


class Sampler(threading.Thread):
    def __init__(self, servers: list[Server], every: float) -> None:
        super().__init__(daemon=True)
        self.servers, self.every = servers, every
        self.samples: list[dict[str, Any]] = []
        self.stopping = threading.Event()

    def take(self, runtime_store: bool = False) -> dict[str, Any]:
        counts: dict[str, Any] = {"t": time.monotonic()}
        counts.update(census.census(runtime_store=runtime_store))
        for s in self.servers:
            counts[f"{s.name}_rss_kib"] = census.status_field(s.proc.pid, "VmRSS")
            counts[f"{s.name}_fds"] = census.fd_count(s.proc.pid)
            if s.state_dir:
                counts[f"{s.name}_state_bytes"] = census.tree_bytes(s.state_dir)
        return counts

    def run(self) -> None:
        while not self.stopping.wait(self.every):
            self.samples.append(self.take())


def sandboxes_left(url: str) -> list[str]:
    r = httpx.get(url + "/v2/sandboxes", params={"state": "running,paused"}, timeout=30)
    r.raise_for_status()
    return [s["sandboxID"] for s in r.json()]


def kill_all(url: str) -> int:
    ids = sandboxes_left(url)
    for sid in ids:
        httpx.delete(f"{url}/sandboxes/{sid}", timeout=60)
    return len(ids)


def settle(sampler: Sampler, baseline: dict[str, Any], ignore: set[str], timeout: float) -> dict[str, Any]:
    """Census until the object counts are back at baseline (standbys refill, reapers run) or `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        now = sampler.take(runtime_store=True)
        if not census.differences(baseline, now, ignore) or time.monotonic() > deadline:
            return now
        time.sleep(2)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def windows(latencies: list[Latency], start: float, window: float) -> list[tuple[int, float, float]]:
    """(creates, p50, p99) per window."""
    out = []
    for group in _by_window(latencies, start, window):
        dts = [dt for _, dt, _ in group]
        out.append((len(dts), statistics.median(dts), pct(dts, 0.99)))
    return out


def slowest(latencies: list[Latency], start: float, window: float, n: int = 3) -> list[str]:
    """Per window, the n slowest creates and what each was made from (the p99 is one of them)."""
    return [" ".join(f"{dt * 1000:.0f}{src[0]}" for _, dt, src in sorted(group, key=lambda x: -x[1])[:n])
            for group in _by_window(latencies, start, window)]


def _by_window(latencies: list[Latency], start: float, window: float) -> list[list[Latency]]:
    by_window: dict[int, list[Latency]] = {}
    for lat in latencies:
        by_window.setdefault(int((lat[0] - start) // window), []).append(lat)
    return [by_window[k] for k in sorted(by_window)]


def trend(values: list[float]) -> tuple[float, float]:
    """Least-squares slope of `values` per step, and its standard error. A window's p99 is about its second
    slowest create: a drift shows as a slope many standard errors from 0, where two single windows differ
    by chance alone."""
    n = len(values)
    xs = range(n)
    slope, intercept = statistics.linear_regression(xs, values)
    residual = sum((v - intercept - slope * x) ** 2 for x, v in zip(xs, values, strict=True)) / (n - 2)
    return slope, (residual / sum((x - (n - 1) / 2) ** 2 for x in xs)) ** 0.5


def plot(path: Path, samples: list[dict[str, Any]], lat: list[Latency], start: float,
         servers: list[Server], window: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [(s["t"] - start) / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    ax = axes[0][0]
    for s in servers:
        ax.plot(minutes, [x.get(f"{s.name}_rss_kib", 0) / 1024 for x in samples], label=f"{s.name} RSS (MiB)")
    ax.set_title("server memory")
    ax.legend()
    ax = axes[0][1]
    for key in ("cgroups", "ns_net", "ns_mnt", "host_mounts", "nft_elements_all", "sandbox_uids", "conntrack",
                *[f"{s.name}_fds" for s in servers]):
        ax.plot(minutes, [x.get(key, 0) for x in samples], label=key)
    ax.set_title("kernel objects and fds")
    ax.legend(fontsize=7)
    ax = axes[1][0]
    wins = windows(lat, start, window)
    xs = [(k + 0.5) * window / 60 for k in range(len(wins))]
    ax.plot(xs, [w[1] * 1000 for w in wins], "o-", label="create p50 (ms)")
    ax.plot(xs, [w[2] * 1000 for w in wins], "o-", label="create p99 (ms)")
    ax.set_title(f"create latency per {window / 60:g}-minute window")
    ax.legend()
    ax = axes[1][1]
    for key in [f"{s.name}_state_bytes" for s in servers if s.state_dir]:
        ax.plot(minutes, [x.get(key, 0) / 2**20 for x in samples], label=key.replace("_bytes", " (MiB)"))
    ax.set_title("disk under the state dirs")
    ax.legend()
    for a in axes.flat:
        a.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60)
    # 10 minutes: long enough for every bounded structure to fill (each network slot keeps its last 4 tenancies:
    # about 280 claims at the default rate) and for the allocators to see the workload's peak (two bursts)
    ap.add_argument("--warmup", type=float, default=600, help="seconds of traffic before the baseline")
    ap.add_argument("--backend", default="linux", choices=("linux", "gvisor"))
    ap.add_argument("--gateway", action="store_true", help="a gateway in front of two cells")
    ap.add_argument("--rate", type=float, default=20, help="sessions a minute, evenly")
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--burst-every", type=float, default=300)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--standbys", type=int, default=2)
    ap.add_argument("--sample", type=float, default=30)
    ap.add_argument("--window", type=float, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--strict", action="store_true", help="also fail on RSS growth and p99 drift")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("soak.py starts servers with the root backends: run it as root")
    work = Path(tempfile.mkdtemp(prefix="agentcell-soak-"))
    stack = contextlib.ExitStack()
    servers: list[Server] = []
    try:
        uplink = stack.enter_context(routeless_uplink(a.backend))
        if a.gateway:
            cells = [start_server(f"cell{n}", work, a.backend, a.standbys, 60,
                                  [*uplink, "--cell-id", f"soakcel{n}"]) for n in (1, 2)]
            servers += cells
            for s in cells:
                s.wait_ready()
            servers.append(start_gateway(work, cells))
            servers[-1].wait_ready()
            time.sleep(3)  # the gateway's first polls mark the cells up
            urls = [servers[-1].url]
        else:
            servers.append(start_server("server", work, a.backend, a.standbys, 60, uplink))
            servers[0].wait_ready()
            urls = [servers[0].url]
        control = [s.url for s in servers if s.state_dir]  # the cells: where sandboxes are listed and killed
        sampler = Sampler(servers, a.sample)
        latencies: list[Latency] = []
        tally = Tally()
        print(f"soak: {a.minutes:g} min, {a.backend}, {'gateway + 2 cells' if a.gateway else 'one server'}, "
              f"{a.rate:g}/min + {a.burst} every {a.burst_every:g} s, <= {a.concurrency} at once; logs in {work}",
              flush=True)
        # warm-up: traffic until the lazily made things exist (templates, runtime store, pools), with one
        # burst: the baseline has seen the workload's peak once (the allocators keep the high-water of their
        # arenas: measured without it, RSS stepped up at the bursts of the first minutes), then quiet
        drive(urls, a.backend, a.warmup, a.rate, a.burst, a.burst_every, a.concurrency, a.seed + 1, [], Tally(),
              first_burst=a.warmup / 3)
        for url in control:
            kill_all(url)
        time.sleep(10)
        baseline = sampler.take(runtime_store=True)
        ignore = {f"{s.name}_rss_kib" for s in servers} | {f"{s.name}_state_bytes" for s in servers}
        ignore |= {"t", "host_procs"}  # the machine's own processes come and go
        ignore |= {f"{s.name}_fds" for s in servers}  # clients' keep-alive connections come and go: a bound below
        start = time.monotonic()
        sampler.samples.append(baseline)
        sampler.start()
        drive(urls, a.backend, a.minutes * 60, a.rate, a.burst, a.burst_every, a.concurrency, a.seed, latencies,
              tally, period=a.window)
        sampler.stopping.set()
        sampler.join()
        left = sum(kill_all(url) for url in control)
        end = settle(sampler, baseline, ignore, timeout=120)
        sampler.samples.append(end)
        return report(a, servers, baseline, end, sampler.samples, latencies, start, tally, left, ignore)
    finally:
        for s in reversed(servers):
            s.stop()
        stack.close()
        if a.out is None:
            shutil.rmtree(work, ignore_errors=True)


def report(a: argparse.Namespace, servers: list[Server], baseline: dict[str, Any], end: dict[str, Any],
           samples: list[dict[str, Any]], latencies: list[Latency], start: float, tally: Tally,
           left: int, ignore: set[str]) -> int:
    ok = True
    total = sum(tally.done.values()) + sum(tally.failed.values())
    print(f"\nsessions: {total} ({sum(tally.failed.values())} failed, {tally.skipped} skipped at the cap), "
          f"{len(latencies)} creates; left running at the end and killed: {left}")
    for kind in SESSIONS:
        print(f"  {kind:<10} {tally.done[kind]:6} ok {tally.failed[kind]:4} failed")
    for err in tally.errors[:10]:
        print("  " + err.replace("\n", "\n    "))
    if tally.failed:
        ok = False
    print(f"\n{'window':>8} {'creates':>8} {'p50 ms':>8} {'p99 ms':>8}   slowest (ms; t: from the template, s: a snapshot)")
    wins = windows(latencies, start, a.window)
    for k, ((n, p50, p99), slow) in enumerate(zip(wins, slowest(latencies, start, a.window), strict=True)):
        print(f"{k * a.window / 60:>6.0f}m {n:>8} {p50 * 1000:>8.0f} {p99 * 1000:>8.0f}   {slow}")
    print(f"\n{'count':<26} {'baseline':>14} {'peak':>14} {'end':>14}")
    for key in sorted(k for k in baseline if k != "t"):
        peak = max(s.get(key, 0) for s in samples)
        mark = "" if key in ignore or key in census.USE_COUNTS or end.get(key) == baseline[key] else "  <- not back"
        print(f"{key:<26} {baseline[key]:>14} {peak:>14} {end.get(key, 0):>14}{mark}")
    diffs = census.differences(baseline, end, ignore)
    for s in servers:  # a server's fds: its clients' idle connections vary; a leak grows past them
        key = f"{s.name}_fds"
        if end.get(key, 0) > baseline.get(key, 0) + FD_SLACK:
            diffs[key] = (baseline.get(key, 0), end.get(key, 0))
    if diffs:
        ok = False
        print(f"\nNOT back to baseline: {diffs}")
    goals = []
    for s in servers:
        b, e = baseline.get(f"{s.name}_rss_kib", 0), end.get(f"{s.name}_rss_kib", 0)
        growth = (e - b) / b * 100 if b else 0.0
        goals.append((f"{s.name} RSS growth {growth:+.1f} % ({b // 1024} -> {e // 1024} MiB)", growth < 5))
    if len(wins) >= 2:
        ratio = wins[-1][2] / wins[0][2]
        goals.append((f"p99 create, last window / first: {ratio:.2f}", ratio <= 1.2))
    if len(wins) >= 3:
        slope, se = trend([w[2] for w in wins])
        print(f"p99 create over the windows: fitted slope {slope * 1000:+.0f} +- {se * 1000:.0f} ms a window "
              f"(mean {statistics.mean(w[2] for w in wins) * 1000:.0f} ms; a second figure, not a goal)")
    for text, met in goals:
        print(f"{'met ' if met else 'MISSED'} {text}")
        if a.strict and not met:
            ok = False
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "soak.json").write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(a).items()}, "samples": samples, "latencies": latencies,
            "done": tally.done, "failed": tally.failed, "errors": tally.errors, "start": start}, indent=1))
        plot(a.out / "soak.png", samples, latencies, start, servers, a.window)
        print(f"wrote {a.out / 'soak.json'} and {a.out / 'soak.png'}")
    print("soak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
