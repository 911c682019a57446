"""A census of what a server holds on its host: the counts a soak or a fault must bring back to baseline.

    .venv/bin/python benchmarks/census.py [--server-pid PID] [--state-dir DIR] [--json]

Each count is read from the kernel, not from the server: a leak the server forgot about is still counted.

* `server_rss_kib`, `server_fds`: the server process (and `tree_rss_kib`, `tree_procs`: it and every
  descendant: zygote, record process, egress service, sandboxes);
* `cgroups`: directories under every cgroup hierarchy's `agentcell*` subtrees (v1 controllers and v2);
* `ns_<type>`: distinct namespaces of each type, held by a process or by a bind mount (nsfs);
* `host_mounts`, `overlay_mounts`, `nsfs_mounts`: the host mount namespace's table (pid 1's view);
* `loop_devices`: loop devices with a backing file;
* `nft_tables`, `nft_chains`, `nft_rules`, `nft_elements`: the host netns's ruleset (`nft -j`), and
  `nft_tables_all` etc. summed over every network namespace a process holds;
* `conntrack`: connection-tracking entries summed over every network namespace a process holds;
* `audit_rules`: the kernel's audit rules (the behaviour record adds its own at a server's start and removes
  them at its stop; a dead server's are removed by the next one on its uids);
* `sandbox_uid_procs`, `sandbox_uids`: processes running as a uid at or above the automatic ranges'
  start (where servers reserve sandbox ids), and how many distinct such uids; `uid_locks`: reserved ranges;
* `host_procs`: every process on the host;
* `state_dir_bytes`, `runtime_store_bytes`: disk under the server's state dir and the runtime store.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

NS_TYPES = ("mnt", "pid", "net", "user", "ipc", "uts", "cgroup")
SANDBOX_UID_START = 1 << 20  # agentcell/backends/linux/uids.py AUTO_START
UID_LOCK_DIRS = ("/run/agentcell/uids",)
RUNTIME_STORE = "/var/lib/agentcell/runtime"


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def zombie(pid: int) -> bool:
    return _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()[:1] == ["Z"]


def _pids() -> list[int]:
    """Every process that holds anything: a zombie holds only its pid until its parent reaps it (a
    harness that is a subreaper, e.g. a pytest process that ran a backend in-process, may never)."""
    return [pid for pid in _all_pids() if not zombie(pid)]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def status_field(pid: int, name: str) -> int:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _uid(pid: int) -> int | None:
    for line in _read(f"/proc/{pid}/status").splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


def _ppid(pid: int) -> int:
    return status_field(pid, "PPid")


def descendants(root: int, pids: Iterable[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in pids:
        children.setdefault(_ppid(pid), []).append(pid)
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _cgroup_roots() -> list[Path]:
    """Every cgroup hierarchy once (v1's cpu and cpuacct are one hierarchy mounted twice)."""
    roots: dict[str, Path] = {}
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] in ("cgroup", "cgroup2"):
            fields = left.split()
            roots.setdefault(fields[2], Path(fields[4]))  # keyed by the hierarchy's device
    return list(roots.values())


def count_cgroups() -> int:
    total = 0
    for root in _cgroup_roots():
        with contextlib.suppress(OSError):
            for top in root.iterdir():
                if top.name.startswith("agentcell") and top.is_dir():
                    total += sum(1 for _ in os.walk(top))
    return total


def _namespaces(pids: Iterable[int]) -> dict[str, set[str]]:
    held: dict[str, set[str]] = {kind: set() for kind in NS_TYPES}
    for pid in pids:
        for kind in NS_TYPES:
            with contextlib.suppress(OSError):
                held[kind].add(os.readlink(f"/proc/{pid}/ns/{kind}"))
    # namespaces kept alive by a bind mount alone (ip netns, a backend's saved namespace)
    for line in _read("/proc/1/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        if right.startswith("nsfs "):
            root = left.split()[3]  # e.g. "net:[4026532001]"
            kind = root.split(":", 1)[0]
            if kind in held:
                held[kind].add(root)
    return held


def _mounts() -> dict[str, int]:
    lines = _read("/proc/1/mountinfo").splitlines()
    kinds = [line.partition(" - ")[2].split(" ", 1)[0] for line in lines]
    return {"host_mounts": len(lines), "overlay_mounts": kinds.count("overlay"), "nsfs_mounts": kinds.count("nsfs")}


def count_loop_devices() -> int:
    return sum(1 for dev in Path("/sys/block").glob("loop*") if (dev / "loop" / "backing_file").exists())


def _nft_counts(net_pid: int | None = None) -> dict[str, int]:
    command = ["nft", "-j", "list", "ruleset"]
    if net_pid is not None:
        command = ["nsenter", f"--net=/proc/{net_pid}/ns/net", *command]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30).stdout
        items = json.loads(out).get("nftables", []) if out.strip() else []
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return {}
    counts = {"nft_tables": 0, "nft_chains": 0, "nft_rules": 0, "nft_elements": 0}
    for item in items:
        if "table" in item:
            counts["nft_tables"] += 1
        elif "chain" in item:
            counts["nft_chains"] += 1
        elif "rule" in item:
            counts["nft_rules"] += 1
        elif "set" in item or "map" in item:
            counts["nft_elements"] += len((item.get("set") or item.get("map") or {}).get("elem", []))
    return counts


def count_audit_rules() -> int | None:
    """Every loaded audit rule; None where the audit netlink cannot be asked (not root, no audit)."""
    from agentcell.record.linux import audit_netlink

    try:
        ctl = audit_netlink.AuditSocket()
    except OSError:
        return None
    try:
        return len(ctl.rules())
    except OSError:
        return None
    finally:
        ctl.close()


def _conntrack(pid: int) -> int:
    # /proc/PID/net is that process's network namespace: the per-netns table, one line per entry
    with contextlib.suppress(OSError), open(f"/proc/{pid}/net/nf_conntrack") as f:
        return sum(1 for _ in f)
    return 0


def _one_pid_per_netns(pids: Iterable[int]) -> dict[str, int]:
    seen: dict[str, int] = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            seen.setdefault(os.readlink(f"/proc/{pid}/ns/net"), pid)
    return seen


def tree_bytes(path: str | Path) -> int:
    """Disk used under `path`, each hard-linked file once (the runtime store links its objects)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirs, files in os.walk(path):
        for name in files + dirs:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def census(server_pid: int | None = None, state_dir: str | None = None, *, every_netns: bool = True,
           runtime_store: bool = True) -> dict[str, int]:
    """Every count; `runtime_store` False skips the store's walk (seconds on a big store)."""
    pids = _pids()
    counts: dict[str, int] = {"host_procs": len(pids), "cgroups": count_cgroups(),
                              "loop_devices": count_loop_devices()}
    if server_pid is not None:
        counts["server_rss_kib"] = status_field(server_pid, "VmRSS")
        counts["server_fds"] = fd_count(server_pid)
        tree = descendants(server_pid, pids)
        counts["tree_procs"] = len(tree)
        counts["tree_rss_kib"] = sum(status_field(pid, "VmRSS") for pid in tree)
    for kind, held in _namespaces(pids).items():
        counts[f"ns_{kind}"] = len(held)
    counts.update(_mounts())
    counts.update(_nft_counts())
    nets = _one_pid_per_netns(pids)
    counts["conntrack"] = sum(_conntrack(pid) for pid in nets.values())
    if (rules := count_audit_rules()) is not None:
        counts["audit_rules"] = rules
    if every_netns:
        for pid in nets.values():
            for key, value in _nft_counts(pid).items():
                counts[key + "_all"] = counts.get(key + "_all", 0) + value
    uids = [uid for uid in (_uid(pid) for pid in pids) if uid is not None and uid >= SANDBOX_UID_START]
    counts["sandbox_uid_procs"] = len(uids)
    counts["sandbox_uids"] = len(set(uids))
    counts["uid_locks"] = sum(len(os.listdir(d)) for d in UID_LOCK_DIRS if os.path.isdir(d))
    if state_dir:
        counts["state_dir_bytes"] = tree_bytes(state_dir)
    if runtime_store and os.path.isdir(RUNTIME_STORE):
        counts["runtime_store_bytes"] = tree_bytes(RUNTIME_STORE)
    return counts


def _cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace("\0", " ").strip()[:120]


def items() -> dict[str, set[str]]:
    """What the object counts count, by name: to tell which objects a difference is (and who holds them)."""
    found: dict[str, set[str]] = {}
    held: dict[str, str] = {}
    for pid in _pids():
        for kind in NS_TYPES:
            with contextlib.suppress(OSError):
                ns = os.readlink(f"/proc/{pid}/ns/{kind}")
                held.setdefault(ns, f"{ns} (pid {pid}: {_cmdline(pid)})")
    found["namespaces"] = set(held.values())
    cgroups = set()
    for root in _cgroup_roots():
        with contextlib.suppress(OSError):
            for top in root.iterdir():
                if top.name.startswith("agentcell") and top.is_dir():
                    cgroups |= {d for d, _, _ in os.walk(top)}
    found["cgroups"] = cgroups
    found["mounts"] = {line.split(" - ")[0].split(" ", 4)[4].split()[0]
                       for line in _read("/proc/1/mountinfo").splitlines()}
    return found


def new_items(before: dict[str, set[str]], after: dict[str, set[str]], limit: int = 8) -> dict[str, list[str]]:
    """The objects `after` has that `before` had not (namespaces matched by their id alone)."""
    out = {}
    for key in after:
        if key == "namespaces":
            old = {x.split(" ", 1)[0] for x in before.get(key, set())}
            extra = sorted(x for x in after[key] if x.split(" ", 1)[0] not in old)
        else:
            extra = sorted(after[key] - before.get(key, set()))
        if extra:
            out[key] = extra[:limit]
    return out


# Counts that measure use rather than objects: they may differ from the baseline without a leak.
USE_COUNTS = {"server_rss_kib", "tree_rss_kib", "state_dir_bytes", "runtime_store_bytes", "conntrack"}


def differences(baseline: dict[str, int], now: dict[str, int], ignore: Iterable[str] = ()) -> dict[str, tuple[int, int]]:
    """The object counts that are not back to baseline: {name: (baseline, now)}."""
    skip = USE_COUNTS | set(ignore)
    return {key: (baseline[key], now.get(key, 0)) for key in baseline
            if key not in skip and now.get(key, 0) != baseline[key]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--server-pid", type=int)
    parser.add_argument("--state-dir")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    counts = census(args.server_pid, args.state_dir)
    if args.json:
        print(json.dumps(counts, indent=1, sort_keys=True))
    else:
        for key in sorted(counts):
            print(f"{key:24} {counts[key]}")


if __name__ == "__main__":
    main()
