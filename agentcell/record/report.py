"""A sandbox's behaviour record, summed up for a security reviewer (issue 10): the process tree, the
files touched, the hosts contacted, what was refused, the limits hit, and flags for behaviour worth a
look, each citing the events (their `seq`) it rests on.

Built from the events alone (record/store.py), so it works as well after the sandbox is gone.
"""

from __future__ import annotations

import ipaddress
import posixpath
from collections import Counter
from collections.abc import Iterable
from typing import Any

METADATA_ADDRESSES = frozenset({"169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254",
                                "169.254.169.123", "metadata.google.internal"})
# syscalls whose refusal says the code reached for privileges or for another namespace
PRIVILEGE_SYSCALLS = frozenset({
    "mount", "umount2", "unshare", "setns", "pivot_root", "chroot", "ptrace", "bpf", "init_module",
    "finit_module", "delete_module", "kexec_load", "kexec_file_load", "keyctl", "add_key", "request_key",
    "perf_event_open", "open_by_handle_at", "name_to_handle_at", "userfaultfd", "fsopen", "fsmount",
    "move_mount", "open_tree", "clone3", "reboot", "swapon", "swapoff", "setdomainname", "sethostname",
    "iopl", "ioperm", "syslog", "acct", "quotactl", "lookup_dcookie", "kcmp", "process_vm_writev",
    "process_vm_readv", "mknod", "mknodat",
})
# shell start-up files and the like: writing them is how code outlives the session
PERSISTENCE_NAMES = frozenset({".bashrc", ".bash_profile", ".profile", ".zshrc", ".bash_login", ".bash_logout",
                               ".pythonrc", ".inputrc", "authorized_keys", "crontab", ".xinitrc"})
PERSISTENCE_DIRS = ("/etc/profile.d/", "/etc/cron", "/var/spool/cron", "/etc/init.d/", "/etc/systemd/",
                    "/home/user/.ssh/", "/root/.ssh/", "/home/user/.config/autostart/")
MINER_WORDS = ("xmrig", "minerd", "cpuminer", "stratum+tcp", "cryptonight", "ethminer", "nicehash")
SCAN_PORTS = 20  # distinct ports on one host, or ...
SCAN_HOSTS = 20  # ... distinct hosts, that look like a scan
LONG_RUNNING_S = 60.0  # a process alive this long at the end, started by the code, is "left behind"
MAX_LISTED = 50  # entries per list in the report
MAX_CITED = 20  # events cited per flag
MAX_TRACKED = 5000  # files, hosts and live processes a report keeps track of (its memory stays bounded)


def build(events: Iterable[dict[str, Any]], summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of one sandbox from its events (oldest first)."""
    procs: dict[int, dict[str, Any]] = {}  # pid -> its latest exec (pids are reused: latest wins)
    tree: list[dict[str, Any]] = []
    files: dict[str, dict[str, Any]] = {}
    hosts: dict[str, dict[str, Any]] = {}
    denials: list[dict[str, Any]] = []
    limits: list[dict[str, Any]] = []
    api: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    flags: dict[str, dict[str, Any]] = {}
    ports_by_host: dict[str, set[int]] = {}
    probe_seqs: list[Any] = []  # the first event of each new (address, port): what a scan cites
    first = last = None

    def flag(name: str, why: str, e: dict[str, Any]) -> None:
        f = flags.setdefault(name, {"flag": name, "why": why, "events": []})
        if len(f["events"]) < MAX_CITED:
            f["events"].append(e.get("seq"))

    for e in events:
        kind = str(e.get("kind"))
        kinds[kind] += 1
        t = e.get("time")
        first = t if first is None else first
        last = t
        if kind == "process.exec":
            node = {"pid": e.get("pid"), "ppid": e.get("ppid"), "path": e.get("path"), "argv": e.get("argv"),
                    "uid": e.get("uid"), "start": t, "end": None, "exit": None, "seq": e.get("seq")}
            if isinstance(e.get("pid"), int) and (e["pid"] in procs or len(procs) < MAX_TRACKED):
                before = procs.get(e["pid"])
                if before is not None:  # the same process ran a new program (exec without fork)
                    before["end"], before["exit"] = t, "exec"
                procs[e["pid"]] = node
            if len(tree) < 10 * MAX_LISTED:
                tree.append(node)
            line = " ".join(str(a) for a in (e.get("argv") or [e.get("path") or ""])).lower()
            if any(w in line for w in MINER_WORDS):
                flag("crypto-mining", "a process whose command line names a miner or a mining pool", e)
        elif kind == "process.exit":
            node = procs.pop(e.get("pid"), None) if isinstance(e.get("pid"), int) else None
            if node is not None:
                node["end"] = t
                node["exit"] = e.get("signal") or e.get("code")
        elif kind.startswith("file."):
            path = str(e.get("path"))
            if path not in files and len(files) >= MAX_TRACKED:
                path = "(more files)"
            f = files.setdefault(path, {"path": path, "ops": Counter(), "size": None})
            f["ops"][kind[5:]] += int(e.get("count") or 1)
            if e.get("size") is not None:
                f["size"] = e.get("size")
            for p in (path, str(e.get("to") or "")):
                if _persistence(p) and kind != "file.delete":
                    flag("persistence", "wrote a shell start-up file, ssh keys, cron or init files", e)
        elif kind in ("net.connect", "net.deny", "dns.query"):
            dst = str(e.get("domain") or e.get("dst") or "")
            if dst not in hosts and len(hosts) >= MAX_TRACKED:
                dst = "(more hosts)"
            h = hosts.setdefault(dst, {"host": dst, "addresses": set(), "ports": set(), "allowed": 0, "denied": 0,
                                       "bytes_out": 0, "bytes_in": 0})
            if e.get("dst"):
                h["addresses"].add(str(e["dst"]))
            if isinstance(e.get("dport"), int):
                h["ports"].add(e["dport"])
                seen = ports_by_host.setdefault(str(e.get("dst")), set()) \
                    if len(ports_by_host) < MAX_TRACKED else set()
                if e["dport"] not in seen and len(probe_seqs) < MAX_CITED:
                    probe_seqs.append(e.get("seq"))
                seen.add(e["dport"])
            h["denied" if kind == "net.deny" or e.get("verdict") == "denied" else "allowed"] += 1
            h["bytes_out"] += int(e.get("bytes_out") or 0)
            h["bytes_in"] += int(e.get("bytes_in") or 0)
            if _metadata(e):
                flag("cloud-metadata", "reached for a cloud metadata address", e)
            elif _host_or_lan(e):
                flag("host-or-lan", "reached for the host, the LAN or another sandbox", e)
            if kind == "net.deny" or e.get("verdict") == "denied":
                denials.append(_brief(e))
        elif kind.startswith("deny."):
            denials.append(_brief(e))
            if kind == "deny.syscall" and str(e.get("syscall")) in PRIVILEGE_SYSCALLS:
                flag("privilege-syscalls", "tried privilege or namespace syscalls", e)
            if kind in ("deny.access", "deny.write"):
                flag("sensitive-paths", "was refused access to protected paths", e)
        elif kind.startswith("limit."):
            limits.append(_brief(e))
            if kind == "limit.cpu":
                flag("cpu-bound", "ran against its CPU limit for long stretches (mining-like)", e)
        elif kind == "api.call":
            api[str(e.get("action"))] += 1
    end = (summary or {}).get("ended") or last
    for node in procs.values():  # no exit seen: still running at the end
        if node["start"] is not None and end is not None and end - node["start"] >= LONG_RUNNING_S \
                and node.get("pid") != 1:
            flag("left-running", "a process started by the code ran on for a long time in the background",
                 {"seq": node["seq"]})
    scanned = [h for h, ports in ports_by_host.items() if len(ports) >= SCAN_PORTS]
    if scanned or len(ports_by_host) >= SCAN_HOSTS:
        flags["scanning"] = {"flag": "scanning", "why": f"tried {len(ports_by_host)} addresses, "
                             f"{len(scanned)} of them on {SCAN_PORTS} ports or more", "events": probe_seqs}
    return {
        **(summary or {}),
        "first_event": first, "last_event": last,
        "counts": dict(sorted(kinds.items())),
        "flags": sorted(flags.values(), key=lambda f: f["flag"]),
        "processes": tree[:MAX_LISTED * 4],
        "files": [{"path": f["path"], "ops": dict(f["ops"]), "size": f["size"]}
                  for f in list(files.values())[:MAX_LISTED * 4]],
        "hosts": [{**h, "addresses": sorted(h["addresses"])[:10], "ports": sorted(h["ports"])[:20]}
                  for h in list(hosts.values())[:MAX_LISTED]],
        "denials": denials[:MAX_LISTED * 2],
        "limits": limits[:MAX_LISTED],
        "api_calls": dict(api),
    }


def _brief(e: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in e.items() if k not in ("sandbox_id", "source") and v is not None}


def _persistence(path: str) -> bool:
    if not path or path == "None":
        return False
    return posixpath.basename(path) in PERSISTENCE_NAMES or path.startswith(PERSISTENCE_DIRS)


def _metadata(e: dict[str, Any]) -> bool:
    return str(e.get("dst")) in METADATA_ADDRESSES or str(e.get("domain")) in METADATA_ADDRESSES


def _host_or_lan(e: dict[str, Any]) -> bool:
    try:
        ip = ipaddress.ip_address(str(e.get("dst")))
    except ValueError:
        return False
    return ip.is_private or ip.is_loopback or ip.is_link_local


def render(report: dict[str, Any]) -> str:
    """The report as text a reviewer reads in a minute."""
    out = [f"sandbox {report.get('sandbox_id')}: {sum(report['counts'].values())} events"
           f" ({report.get('dropped') or 0} dropped)"]
    if report["flags"]:
        out.append("\nFLAGS")
        for f in report["flags"]:
            out.append(f"  ! {f['flag']}: {f['why']} (events {', '.join(str(s) for s in f['events'][:8])})")
    else:
        out.append("\nno flags")
    out.append("\nPROCESSES")
    for p in report["processes"][:MAX_LISTED]:
        argv = " ".join(str(a) for a in (p.get("argv") or [p.get("path")]))
        status = "running" if p["end"] is None else "exec'd a new program" if p["exit"] == "exec" \
            else f"exit {p['exit']}"
        out.append(f"  [{p.get('pid')}<-{p.get('ppid')}] {argv[:120]}  ({status})")
    out.append("\nFILES")
    for f in report["files"][:MAX_LISTED]:
        out.append(f"  {f['path']}  {', '.join(f'{k}x{v}' for k, v in f['ops'].items())}")
    out.append("\nHOSTS")
    for h in report["hosts"]:
        out.append(f"  {h['host']} ports {h['ports']} allowed {h['allowed']} denied {h['denied']} "
                   f"out {h['bytes_out']} B in {h['bytes_in']} B")
    out.append("\nDENIED")
    for d in report["denials"][:MAX_LISTED]:
        if d.get("kind") == "deny.syscall":
            what = d.get("syscall")
        else:
            what = d.get("path") or d.get("dst") or d.get("domain")
            if d.get("syscall"):
                what = f"{what} ({d['syscall']})"
        why = d.get("rule") or d.get("reason") or (f"errno {d['errno']}" if d.get("errno") else "")
        out.append(f"  {d.get('kind')} {what} {why}".rstrip())
    out.append("\nLIMITS")
    for x in report["limits"]:
        out.append(f"  {x.get('kind')} {({k: v for k, v in x.items() if k not in ('kind', 'time', 'seq')})}")
    if report["api_calls"]:
        out.append("\nAPI CALLS  " + ", ".join(f"{k} x{v}" for k, v in sorted(report["api_calls"].items())))
    return "\n".join(out) + "\n"
