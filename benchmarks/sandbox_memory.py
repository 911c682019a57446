"""What one idle sandbox costs in memory, measured page by page (needs root, like the server).

    .venv/bin/python benchmarks/sandbox_memory.py [-n 10] [--code 1]

Starts a server, creates N sandboxes, runs `--code` once in each (agent + default context), then
reads /proc/PID/pagemap of the zygote and of every sandbox process. A sandbox's *own* pages are
those of its processes that no longer share a physical page with the zygote: copies of pages it (or
the zygote, after the fork) wrote, and new ones. That is what each further sandbox adds, so it
predicts PSS per sandbox at scale; benchmarks/bench.py's PSS with 20 sandboxes also charges each
one ~1/40 of the ~100 MiB the zygote shares, and private dirty misses the pages the agent wrote
before it forked the context (shared by the two).
"""

from __future__ import annotations

import argparse
import collections
import os
import struct
import sys
import time

from bench import start_server

from agentcell import Sandbox

PAGE = 4096
SANDBOX_UID_MIN = 1_000_000


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def anon_pages(pid: int) -> dict[int, tuple[int, str]]:
    """Physical page -> (virtual address, mapping kind) of the process's private anonymous pages
    (heap, pymalloc arenas, stacks, libraries' written .data)."""
    out: dict[int, tuple[int, str]] = {}
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split(maxsplit=5)
            name = fields[5].strip() if len(fields) > 5 else ""
            if name == "[vsyscall]":
                continue
            kind = name if name.startswith("[") else os.path.basename(name) if name else "[anon]"
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            pagemap.seek(lo // PAGE * 8)
            for i, (entry,) in enumerate(struct.iter_unpack("<Q", pagemap.read((hi - lo) // PAGE * 8))):
                if entry >> 63 & 1 and not entry >> 61 & 1:  # present, anonymous (or a private copy)
                    out[entry & ((1 << 55) - 1)] = (lo + i * PAGE, kind)
    return out


def hostname(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/root/etc/hostname") as f:
            return f.read().strip()
    except OSError:
        return ""


def rollup(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=10, help="sandboxes")
    ap.add_argument("--code", default="1", help="run once in each sandbox ('' for none)")
    args = ap.parse_args()
    proc, url = start_server(args.n + 10)
    try:
        sandboxes = [Sandbox.create(api_url=url, timeout=600) for _ in range(args.n)]
        for sbx in sandboxes:
            if args.code:
                sbx.run_code(args.code)
        time.sleep(1)
        zygote = next(p for p in children(proc.pid) if os.stat(f"/proc/{p}").st_uid == 0)
        shared = set(anon_pages(zygote))
        ids = {sbx.sandbox_id for sbx in sandboxes}  # not the standbys a server may keep prepared
        agents = [p for p in children(zygote) if os.stat(f"/proc/{p}").st_uid >= SANDBOX_UID_MIN
                  and hostname(p) in ids]
        own: collections.Counter[str] = collections.Counter()
        kinds: collections.Counter[str] = collections.Counter()
        pss: collections.Counter[str] = collections.Counter()
        for agent in agents:
            holders: dict[int, set[str]] = collections.defaultdict(set)
            for role, pid in [("agent", agent)] + [("context", k) for k in children(agent)]:
                pss[role] += rollup(pid, "Pss")
                pss[role + " private dirty"] += rollup(pid, "Private_Dirty")
                for frame, (_addr, kind) in anon_pages(pid).items():
                    if frame not in shared:
                        holders[frame].add(role)
                        if len(holders[frame]) == 1:
                            kinds[kind] += 1
            for roles in holders.values():
                own["both (written before the context's fork)" if len(roles) == 2 else next(iter(roles)) + " only"] += 1
        n = len(agents)

        def mib(pages: float) -> str:
            return f"{pages * PAGE / n / (1 << 20):.2f} MiB"

        print(f"own memory per idle sandbox ({n} sandboxes, ran {args.code!r}): {mib(sum(own.values()))}")
        for what, pages in own.most_common():
            print(f"  {what}: {mib(pages)}")
        print("  by mapping: " + ", ".join(f"{k} {mib(v)}" for k, v in kinds.most_common(6)))
        for role in ("agent", "context"):
            print(f"{role}: PSS {pss[role] / n / 1024:.2f} MiB, private dirty {pss[role + ' private dirty'] / n / 1024:.2f} MiB")
        for sbx in sandboxes:
            sbx.kill()
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
