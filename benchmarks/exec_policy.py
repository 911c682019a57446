"""What an exec rule costs an exec (agentcell/policy/linux/exec_lsm.py; needs root and a kernel that
loads BPF LSM programs).

    .venv/bin/python benchmarks/exec_policy.py [--execs 1000] [--rounds 5]

One real sandbox (the light probe agent) runs `for i in $(seq N); do /usr/bin/true; done` in bash,
timed inside the sandbox, under three settings side by side: no exec policy (the programs not
loaded at all), the programs loaded but the sandbox without a slot (what every other process of the
host pays: one hash lookup per exec and per executable mapping), and an allow-list under default deny
(bash, sh, true allowed; its loaders marked). Prints the median per exec of each and the differences.
Also times resolving ["python3", "git", "pip*"] in the sandbox (exec_targets.resolve) and marking
them. Where the kernel refuses BPF LSM programs it says so and times only the resolution.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentcell.backends.base import SandboxSpec  # noqa: E402
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox  # noqa: E402
from agentcell.policy.linux import exec_targets  # noqa: E402
from agentcell.policy.linux.exec_lsm import ExecLsm, ExecPolicyUnavailable  # noqa: E402
from agentcell.runtime.protocol import AgentChannel  # noqa: E402

PROBE = "agentcell.backends.linux.probe:serve"


async def per_exec_us(channel: AgentChannel, execs: int, rounds: int) -> float:
    """Median over `rounds` of the loop's wall time inside the sandbox, per exec, in µs."""
    script = (f"s=$(date +%s%N); for i in $(seq {execs}); do /usr/bin/true; done; "
              "e=$(date +%s%N); echo $((e - s))")
    times = []
    for _ in range(rounds):
        h = (await channel.call("exec", argv=["bash", "-c", script], timeout=600)).header
        if h["exit_code"] != 0:
            raise RuntimeError(f"the loop failed: {h['stderr'][-500:]}")
        times.append(int(h["stdout"].strip()) / execs / 1000)
    return statistics.median(times)


def resolve_ms(pid: int, reps: int = 50) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for t in exec_targets.resolve(pid, ["python3", "git", "pip*"]):
            os.close(t.fd)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--execs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    be = LinuxBackend(entry_point=PROBE, max_sandboxes=10, standbys=0, preload=False)
    await be.start()
    try:
        sb = await be.create(SandboxSpec("bench" + uuid.uuid4().hex[:8]))
        assert isinstance(sb, LinuxSandbox)
        channel = await AgentChannel.open(sb.sock)
        print(f"resolve(python3, git, pip*) in the sandbox: median {resolve_ms(sb.host_pid):.2f} ms")
        none = await per_exec_us(channel, args.execs, args.rounds)
        try:
            lsm = ExecLsm()
        except ExecPolicyUnavailable as e:
            print(f"exec of /usr/bin/true, no policy: {none:.1f} µs")
            print(f"no comparison: {e}")
            return
        try:
            loaded = await per_exec_us(channel, args.execs, args.rounds)
            slot = lsm.add_sandbox(sb.host_uids)
            t0 = time.perf_counter()
            targets = exec_targets.resolve(sb.host_pid, ["bash", "sh", "true"])
            loaders = exec_targets.loaders(sb.host_pid)
            for t in targets:
                lsm.mark(slot, t.fd, "allow")
            for t in loaders:
                lsm.mark_loader(slot, t.fd)
            lsm.set_mode(slot, "deny")
            applied_ms = (time.perf_counter() - t0) * 1000
            for t in (*targets, *loaders):
                os.close(t.fd)
            policed = await per_exec_us(channel, args.execs, args.rounds)
            lsm.remove_sandbox(slot)
        finally:
            lsm.close()
        print(f"allow-list applied (resolve + mark {len(targets)} files + {len(loaders)} loaders): {applied_ms:.2f} ms")
        print(f"{'exec of /usr/bin/true (median per exec)':<48}{'µs':>8}{'vs none':>10}")
        for name, us in (("no policy (programs not loaded)", none), ("programs loaded, sandbox without a slot", loaded),
                         ("allow-list, default deny", policed)):
            print(f"{name:<48}{us:>8.1f}{us - none:>+10.1f}")
        await channel.close()
        await be.kill(sb)
    finally:
        await be.close()


if __name__ == "__main__":
    asyncio.run(main())
