"""A sandbox's behaviour record, summed up for a security reviewer (issue 10): the process tree, the
files touched, the hosts contacted, what was refused, the limits hit, and flags for behaviour worth a
look, each citing the events (their `seq`) it rests on.

Built from the stored events (record/store.py), so it works as well after the sandbox is gone; its
flags (record/flags.py) are those of a pass over the stored events merged with those the store raised
on every event it was handed, stored or not (the summary's `flags_seen`): events dropped by a bound
still raise their flags, and `not_stored` says how many of a flag's events are not in the record.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from agentcell.record import flags as flag_rules
from agentcell.text_escape import escape

MAX_LISTED = 50  # entries per list in the report
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
    not_recorded: dict[str, str] = {}  # a collector that did not run on the host -> why (record.dropped)
    flags = flag_rules.FlagSet()
    first = last = None

    for e in events:
        seq = e.get("seq")
        flags.see(e, seq if isinstance(seq, int) else None)
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
        elif kind in ("net.connect", "net.deny", "dns.query", "secret.refused"):
            dst = str(e.get("domain") or e.get("dst") or "")
            if dst not in hosts and len(hosts) >= MAX_TRACKED:
                dst = "(more hosts)"
            h = hosts.setdefault(dst, {"host": dst, "addresses": set(), "ports": set(), "allowed": 0, "denied": 0,
                                       "bytes_out": 0, "bytes_in": 0})
            if e.get("dst"):
                h["addresses"].add(str(e["dst"]))
            if isinstance(e.get("dport"), int) and len(h["ports"]) < MAX_TRACKED:
                h["ports"].add(e["dport"])
            denied = kind in ("net.deny", "secret.refused") or e.get("verdict") == "denied"
            h["denied" if denied else "allowed"] += 1
            h["bytes_out"] += int(e.get("bytes_out") or 0)
            h["bytes_in"] += int(e.get("bytes_in") or 0)
            if denied and len(denials) < MAX_LISTED * 2:
                denials.append(_brief(e))
        elif kind.startswith("deny."):
            if len(denials) < MAX_LISTED * 2:
                denials.append(_brief(e))
        elif kind.startswith("limit."):
            if len(limits) < MAX_LISTED:
                limits.append(_brief(e))
        elif kind == "api.call":
            api[str(e.get("action"))] += 1
        elif kind == "record.dropped" and e.get("collector"):
            not_recorded.setdefault(str(e["collector"]), str(e.get("why") or e.get("reason") or "unknown"))
    summary = dict(summary or {})
    seen = summary.pop("flags_seen", None) or []  # the store's, raised on every event (stored or not)
    end = summary.get("ended") or last
    return {
        **summary,
        "first_event": first, "last_event": last,
        "counts": dict(sorted(kinds.items())),
        "flags": flag_rules.merge(seen, flags.snapshot(end)),
        "processes": tree[:MAX_LISTED * 4],
        "files": [{"path": f["path"], "ops": dict(f["ops"]), "size": f["size"]}
                  for f in list(files.values())[:MAX_LISTED * 4]],
        "hosts": [{**h, "addresses": sorted(h["addresses"])[:10], "ports": sorted(h["ports"])[:20]}
                  for h in list(hosts.values())[:MAX_LISTED]],
        "denials": denials[:MAX_LISTED * 2],
        "limits": limits[:MAX_LISTED],
        "api_calls": dict(api),
        "not_recorded": not_recorded,
    }


def _brief(e: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in e.items() if k not in ("sandbox_id", "source") and v is not None}


def render(report: dict[str, Any]) -> str:
    """The report as text a reviewer reads in a minute. Every value from the record goes through
    `escape` (text_escape.py): an argv, a path or a host cannot write to the reviewer's terminal."""
    out = [f"sandbox {escape(report.get('sandbox_id'))}: {sum(report['counts'].values())} events"
           f" ({escape(report.get('dropped') or 0)} dropped)"]
    if report["flags"]:
        out.append("\nFLAGS")
        for f in report["flags"]:
            cited = ", ".join(escape(s) for s in f["events"][:8])
            unstored = f"; {f['not_stored']} not stored" if f.get("not_stored") and f["flag"] != "record-incomplete" \
                else ""
            out.append(f"  ! {escape(f['flag'])}: {escape(f['why'])} (events {cited or '-'}{unstored})")
    else:
        out.append("\nno flags")
    missing = report.get("not_recorded") or {}
    out.append(_heading("PROCESSES", missing.get("processes")))
    for p in report["processes"][:MAX_LISTED]:
        argv = " ".join(escape(a) for a in (p.get("argv") or [p.get("path")]))
        status = "running" if p["end"] is None else "exec'd a new program" if p["exit"] == "exec" \
            else f"exit {escape(p['exit'])}"
        out.append(f"  [{escape(p.get('pid'))}<-{escape(p.get('ppid'))}] {argv[:120]}  ({status})")
    out.append(_heading("FILES", missing.get("files")))
    for f in report["files"][:MAX_LISTED]:
        ops = ", ".join(f"{escape(k)}x{escape(v)}" for k, v in f["ops"].items())
        out.append(f"  {escape(f['path'])}  {ops}")
    out.append("\nHOSTS")
    for h in report["hosts"]:
        out.append(f"  {escape(h['host'])} ports {escape(h['ports'])} allowed {h['allowed']} denied {h['denied']} "
                   f"out {h['bytes_out']} B in {h['bytes_in']} B")
    out.append("\nDENIED")
    for d in report["denials"][:MAX_LISTED]:
        if d.get("kind") == "deny.syscall":
            what = escape(d.get("syscall"))
        else:
            what = escape(d.get("path") or d.get("dst") or d.get("domain"))
            if d.get("syscall"):
                what = f"{what} ({escape(d['syscall'])})"
        why = d.get("rule") or d.get("reason") or (f"errno {d['errno']}" if d.get("errno") else "")
        out.append(f"  {escape(d.get('kind'))} {what} {escape(why)}".rstrip())
    out.append(_heading("LIMITS", missing.get("limits")))
    for x in report["limits"]:
        out.append(f"  {escape(x.get('kind'))} {escape({k: v for k, v in x.items() if k not in ('kind', 'time', 'seq')})}")
    if report["api_calls"]:
        out.append("\nAPI CALLS  " + ", ".join(f"{escape(k)} x{v}" for k, v in sorted(report["api_calls"].items())))
    return "\n".join(out) + "\n"


def _heading(section: str, not_recorded: str | None) -> str:
    """A section's heading; for a part the host did not record, saying so (an empty list would say
    that nothing happened)."""
    return f"\n{section}" if not_recorded is None else f"\n{section}: not recorded ({escape(not_recorded)})"
