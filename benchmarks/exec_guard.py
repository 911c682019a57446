"""What the exec guard costs an exec (agentcell/policy/linux/exec_guard.py; needs root).

    .venv/bin/python benchmarks/exec_guard.py [--execs 1000] [--rounds 5]

One real sandbox (the light probe agent) runs `for i in $(seq N); do /usr/bin/true; done` in bash,
timed inside the sandbox, under three settings, rounds interleaved (the machine is shared: drift
falls on all three alike): the guard not loaded, loaded with the sandbox unguarded (what every other
process of the host pays: one hash lookup per exec), and the sandbox guarded. Also the program's own
run time per exec, from the kernel's BPF statistics (BPF_ENABLE_STATS, on only while this runs).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import statistics
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentcell.backends.base import SandboxSpec  # noqa: E402
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox  # noqa: E402
from agentcell.policy.linux.exec_guard import ExecGuard  # noqa: E402
from agentcell.runtime.protocol import AgentChannel  # noqa: E402

PROBE = "agentcell.backends.linux.probe:serve"
SYS_BPF, BPF_ENABLE_STATS, BPF_STATS_RUN_TIME = 321, 32, 0


async def per_exec_us(channel: AgentChannel, execs: int) -> float:
    """The loop's wall time inside the sandbox, per exec, in µs."""
    script = (f"s=$(date +%s%N); for i in $(seq {execs}); do /usr/bin/true; done; "
              "e=$(date +%s%N); echo $((e - s))")
    h = (await channel.call("exec", argv=["bash", "-c", script], timeout=600)).header
    if h["exit_code"] != 0:
        raise RuntimeError(f"the loop failed: {h['stderr'][-500:]}")
    return int(h["stdout"].strip()) / execs / 1000


def enable_stats() -> int:
    """An fd keeping the kernel's BPF run-time statistics on (off again once closed)."""
    libc = ctypes.CDLL(None, use_errno=True)
    attr = (ctypes.c_uint32 * 30)(BPF_STATS_RUN_TIME)
    fd = libc.syscall(SYS_BPF, BPF_ENABLE_STATS, attr, ctypes.sizeof(attr))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "BPF_ENABLE_STATS")
    return fd


def program_stats(guard: ExecGuard) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of the guard's program, from its fd's fdinfo."""
    lib = guard._bpf.lib  # noqa: SLF001 - a benchmark reads the program's fd
    lib.bpf_program__fd.restype, lib.bpf_program__fd.argtypes = ctypes.c_int, (ctypes.c_void_p,)
    prog = lib.bpf_object__find_program_by_name(guard._bpf._obj, b"on_exec")  # noqa: SLF001
    info = dict(line.split(":\t", 1) for line in open(f"/proc/self/fdinfo/{lib.bpf_program__fd(prog)}").read().splitlines()
                if ":\t" in line)
    return int(info.get("run_time_ns", 0)), int(info.get("run_cnt", 0))


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--execs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    be = LinuxBackend(entry_point=PROBE, max_sandboxes=10, standbys=0, preload=False)
    await be.start()
    stats = enable_stats()
    try:
        sb = await be.create(SandboxSpec("bench" + uuid.uuid4().hex[:8]))
        assert isinstance(sb, LinuxSandbox)
        channel = await AgentChannel.open(sb.sock)
        await per_exec_us(channel, args.execs // 10)  # warm
        times: dict[str, list[float]] = {"none": [], "unguarded": [], "guarded": []}
        run: dict[str, tuple[int, int]] = {"unguarded": (0, 0), "guarded": (0, 0)}
        for _ in range(args.rounds):
            times["none"].append(await per_exec_us(channel, args.execs))
            guard = ExecGuard()
            try:
                for setting in ("unguarded", "guarded"):
                    if setting == "guarded":
                        guard.guard(sb.host_uids)
                    before = program_stats(guard)
                    times[setting].append(await per_exec_us(channel, args.execs))
                    after = program_stats(guard)
                    ns, cnt = run[setting]
                    run[setting] = (ns + after[0] - before[0], cnt + after[1] - before[1])
            finally:
                guard.close()
        none = statistics.median(times["none"])
        print(f"{'exec of /usr/bin/true in a sandbox (median per exec)':<56}{'µs':>8}{'vs none':>10}"
              f"{'program ns/run':>16}")
        for name, key in (("guard not loaded", "none"), ("guard loaded, sandbox unguarded", "unguarded"),
                          ("sandbox guarded", "guarded")):
            us = statistics.median(times[key])
            ns, cnt = run.get(key, (0, 0))
            per_run = f"{ns / cnt:.0f}" if cnt else "-"
            print(f"{name:<56}{us:>8.1f}{us - none:>+10.1f}{per_run:>16}")
        print("(program ns/run: every exec of the host while the loop ran, the sandbox's and others')")
        await channel.close()
        await be.kill(sb)
    finally:
        os.close(stats)
        await be.close()


if __name__ == "__main__":
    asyncio.run(main())
