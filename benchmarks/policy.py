"""What a sandbox policy costs (issue 28), side by side with no policy, in one run of one server:

* create -> first result (a command's output) without a policy, with exec rules (an allow list), with
  file rules, and with the README's whole policy (goal: within +10 % of no policy);
* the cost of an exec of an allowed program under an allow list (1,000 `/bin/true` from one shell),
  against the same loop without rules; and under "ask" (every exec an event the server judges);
* an approval's round trip: a held exec's request visible to a client polling the API -> decided ->
  the process goes on (its command returns).

    .venv/bin/python benchmarks/policy.py [--runs 20]           # root
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentcell import Sandbox  # noqa: E402
from tests.servers import ServerProcess  # noqa: E402

POLICIES = {
    "none": None,
    "exec allow list": {"exec": {"default": "deny", "allow": ["python3", "git", "pip*"]}},
    "file rules": {"files": [{"path": "/home/user/repo", "access": "read"},
                             {"path": "/home/user/repo/out", "access": "write"},
                             {"path": "/home/user/.ssh", "access": "none"}]},
    "README's policy": {"exec": {"default": "ask", "allow": ["python3", "git"]},
                        "files": [{"path": "/home/user/repo", "access": "read"},
                                  {"path": "/home/user/repo/out", "access": "write"},
                                  {"path": "/home/user/.ssh", "access": "none"}],
                        "syscalls": "strict", "processes": {"max": 64}},
}
LOOP = "for i in $(seq {n}); do /bin/true; done"


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def create_to_first_result(url: str, runs: int) -> None:
    print("create -> first result (commands.run('echo hi')), ms:")
    times: dict[str, list[float]] = {name: [] for name in POLICIES}
    for _ in range(runs):  # interleaved: the machine's load hits every kind alike
        for name, policy in POLICIES.items():
            t0 = time.perf_counter()
            sbx = Sandbox.create(api_url=url, policy=policy)
            sbx.commands.run("echo hi")
            times[name].append((time.perf_counter() - t0) * 1000)
            sbx.kill()
    base = statistics.median(times["none"])
    for name, got in times.items():
        p50 = statistics.median(got)
        print(f"  {name:18s} p50 {p50:6.1f}  p90 {_pct(got, 0.9):6.1f}  x{p50 / base:.2f}")


def exec_cost(url: str, n: int = 1000, rounds: int = 5) -> None:
    print(f"an exec of an allowed program ({n} x /bin/true from one shell), µs each, best of {rounds}:")
    kinds = {"no rules": None,
             "allow list": {"exec": {"default": "deny", "allow": ["true", "seq"]}},
             "ask (all allowed)": {"exec": {"default": "ask", "allow": ["true", "seq"]}}}
    sandboxes = {k: Sandbox.create(api_url=url, policy=p, timeout=600) for k, p in kinds.items()}
    best: dict[str, float] = {k: float("inf") for k in kinds}
    try:
        for _ in range(rounds):
            for k, sbx in sandboxes.items():
                t0 = time.perf_counter()
                sbx.commands.run(LOOP.format(n=n), timeout=300)
                best[k] = min(best[k], (time.perf_counter() - t0) / n * 1e6)
    finally:
        for sbx in sandboxes.values():
            sbx.kill()
    for k, v in best.items():
        print(f"  {k:18s} {v:7.1f}  (+{v - best['no rules']:.1f})")


def approval_round_trip(url: str, runs: int) -> None:
    print("approval round trip, ms (request visible to a client polling every 1 ms -> allow -> command done):")
    sbx = Sandbox.create(api_url=url, policy={"exec": {"default": "ask"}}, timeout=600)
    seen, done = [], []
    try:
        for _ in range(runs):
            finished = threading.Event()

            def run(finished: threading.Event = finished) -> None:
                sbx.commands.run("/bin/true")
                finished.set()

            threading.Thread(target=run, daemon=True).start()
            while not (pending := sbx.approvals.list()):
                time.sleep(0.001)
            t0 = time.perf_counter()
            sbx.approvals.allow(pending[0]["id"])
            finished.wait(30)
            done.append((time.perf_counter() - t0) * 1000)
            seen.append(time.time() - pending[0]["created"])
    finally:
        sbx.kill()
    print(f"  exec held -> request listed p50 {statistics.median(seen) * 1000:.1f}")
    print(f"  allow -> command returned   p50 {statistics.median(done):.1f}  p90 {_pct(done, 0.9):.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    with ServerProcess(Path("/tmp/agentcell-bench-policy.log"), "--egress-uplink", "none") as srv:
        create_to_first_result(srv.url, args.runs)
        exec_cost(srv.url)
        approval_round_trip(srv.url, args.runs)


if __name__ == "__main__":
    main()
