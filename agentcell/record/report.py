"""A sandbox's behaviour record, summed up for a security reviewer (issue 10): the process tree, the
files touched, the hosts contacted, what was refused, the limits hit, and flags for behaviour worth a
look, each citing the events (their `seq`) it rests on; the flags again as `signatures`, with a
severity and a title (record/signatures.py), the most severe first; and what the HTML report
(record/report_html.py) shows besides: the process tree nested, the connections and DNS names, the
timeline (its first MAX_TIMELINE events, and every event a signature cites).

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
from agentcell.record import signatures
from agentcell.text_escape import escape

MAX_LISTED = 50  # entries per list in the report
MAX_TRACKED = 5000  # files, hosts and live processes a report keeps track of (its memory stays bounded)
MAX_TREE = 10 * MAX_LISTED  # processes in the tree
MAX_TIMELINE = 5000  # events in the timeline (the first ones), ...
MAX_FLAGGING = 1000  # ... and those past it that raised a signature
MAX_DEPTH = 48  # the tree's depth: a deeper process is shown at the top, marked (a chain of execs stays readable)


def build(events: Iterable[dict[str, Any]], summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report of one sandbox from its events (oldest first)."""
    procs: dict[int, dict[str, Any]] = {}  # pid -> its latest exec (pids are reused: latest wins)
    tree: list[dict[str, Any]] = []
    parents: list[int | None] = []  # tree[i]'s parent: an index in tree (its parent's latest exec then)
    index: dict[int, int] = {}  # id(node) -> its index in tree
    timeline: list[dict[str, Any]] = []
    flagging: list[dict[str, Any]] = []  # events past the timeline that raised a flag
    conns: dict[tuple[str, Any, Any], dict[str, Any]] = {}
    dns: dict[str, dict[str, Any]] = {}
    total = 0
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
        flags.dirty = False
        flags.see(e, seq if isinstance(seq, int) else None)
        total += 1
        if total <= MAX_TIMELINE:
            timeline.append(_row(e))
        elif flags.dirty and len(flagging) < MAX_FLAGGING:
            flagging.append(_row(e))
        kind = str(e.get("kind"))
        kinds[kind] += 1
        t = e.get("time")
        first = t if first is None else first
        last = t
        if kind == "process.exec":
            node = {"pid": e.get("pid"), "ppid": e.get("ppid"), "path": e.get("path"), "argv": e.get("argv"),
                    "uid": e.get("uid"), "start": t, "end": None, "exit": None, "seq": e.get("seq")}
            before = procs.get(e["pid"]) if isinstance(e.get("pid"), int) else None
            parent = before if before is not None else procs.get(e["ppid"]) if isinstance(e.get("ppid"), int) else None
            if isinstance(e.get("pid"), int) and (e["pid"] in procs or len(procs) < MAX_TRACKED):
                if before is not None:  # the same process ran a new program (exec without fork)
                    before["end"], before["exit"] = t, "exec"
                procs[e["pid"]] = node
            if len(tree) < MAX_TREE:
                index[id(node)] = len(tree)
                parents.append(index.get(id(parent)) if parent is not None else None)
                tree.append(node)
        elif kind == "process.exit":
            node = procs.pop(e.get("pid"), None) if isinstance(e.get("pid"), int) else None
            if node is not None:
                node["end"] = t
                node["exit"] = e.get("signal") or e.get("code")
                if isinstance(e.get("duration_s"), int | float):
                    node["duration_s"] = e["duration_s"]
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
            if kind == "dns.query":
                _dns(dns, e)
            else:
                _connection(conns, e, kind, denied)
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
    merged = flag_rules.merge(seen, flags.snapshot(end))
    return {
        **summary,
        "first_event": first, "last_event": last,
        "template": next((e.get("template") for e in timeline[:5] if e.get("kind") == "sandbox.created"), None),
        "counts": dict(sorted(kinds.items())),
        "signatures": signatures.from_flags(merged),
        "flags": merged,
        "processes": tree[:MAX_LISTED * 4],
        "process_tree": _nest(tree, parents),
        "processes_total": kinds["process.exec"],
        "connections": list(conns.values())[:MAX_LISTED * 4],
        "dns": list(dns.values())[:MAX_LISTED * 4],
        "timeline": timeline,
        "timeline_flagged": flagging,
        "timeline_total": total,
        "files": [{"path": f["path"], "ops": dict(f["ops"]), "size": f["size"]}
                  for f in list(files.values())[:MAX_LISTED * 4]],
        "hosts": [{**h, "addresses": sorted(h["addresses"])[:10], "ports": sorted(h["ports"])[:20]}
                  for h in list(hosts.values())[:MAX_LISTED]],
        "denials": denials[:MAX_LISTED * 2],
        "limits": limits[:MAX_LISTED],
        "api_calls": dict(api),
        "not_recorded": not_recorded,
    }


def _connection(conns: dict[tuple[str, Any, Any], dict[str, Any]], e: dict[str, Any], kind: str,
                denied: bool) -> None:
    """A connection's events summed per (address, port, protocol): the policy's verdicts and rules."""
    key = (str(e.get("dst") or e.get("domain") or ""), e.get("dport"), e.get("proto"))
    c = conns.get(key)
    if c is None:
        if len(conns) >= MAX_TRACKED:
            return
        c = conns[key] = {"dst": key[0], "dport": key[1], "proto": key[2], "domain": e.get("domain"),
                          "allowed": 0, "denied": 0, "rules": [], "secrets": [], "bytes_out": 0, "bytes_in": 0,
                          "seq": e.get("seq")}
    c["denied" if denied else "allowed"] += 1
    c["domain"] = c["domain"] or e.get("domain")
    rule = e.get("rule")
    if rule and rule not in c["rules"] and len(c["rules"]) < 8:
        c["rules"].append(str(rule))
    if kind == "secret.refused" or isinstance(e.get("secrets"), list):
        for name in ([e.get("secret")] if kind == "secret.refused" else e["secrets"]):
            if name and name not in c["secrets"] and len(c["secrets"]) < 8:
                c["secrets"].append(str(name))
    c["bytes_out"] += int(e.get("bytes_out") or 0)
    c["bytes_in"] += int(e.get("bytes_in") or 0)


def _dns(dns: dict[str, dict[str, Any]], e: dict[str, Any]) -> None:
    """DNS queries summed per name: the types asked, the answers, the resolver's verdicts."""
    name = str(e.get("domain") or "")
    d = dns.get(name)
    if d is None:
        if len(dns) >= MAX_TRACKED:
            return
        d = dns[name] = {"domain": name, "types": [], "answers": [], "verdicts": {}, "count": 0, "seq": e.get("seq")}
    d["count"] += 1
    if e.get("type") and e["type"] not in d["types"] and len(d["types"]) < 8:
        d["types"].append(str(e["type"]))
    for a in e.get("answers") or () if isinstance(e.get("answers"), list) else ():
        if a not in d["answers"] and len(d["answers"]) < 10:
            d["answers"].append(str(a))
    verdict = str(e.get("verdict") or e.get("rcode") or "?")
    if verdict in d["verdicts"] or len(d["verdicts"]) < 8:
        d["verdicts"][verdict] = d["verdicts"].get(verdict, 0) + 1


def _nest(tree: list[dict[str, Any]], parents: list[int | None]) -> list[dict[str, Any]]:
    """The processes as a tree: each with its `children` (a program exec'd without a fork is a child of
    the one it replaced), the roots in order; `duration_s` from its exit, else from the times seen."""
    nodes = []
    for p in tree:
        n = {**p, "children": []}
        if n.get("duration_s") is None and isinstance(p.get("end"), int | float) and isinstance(p.get("start"), int | float):
            n["duration_s"] = round(p["end"] - p["start"], 3)
        nodes.append(n)
    roots = []
    depth = [0] * len(nodes)
    for i, n in enumerate(nodes):
        parent = parents[i]  # (always an earlier node)
        if parent is not None and depth[parent] + 1 >= MAX_DEPTH:
            n["deeper"] = True  # its parent is in the tree, too deep to nest under
            parent = None
        if parent is None:
            roots.append(n)
        else:
            depth[i] = depth[parent] + 1
            nodes[parent]["children"].append(n)
    return roots


def _row(e: dict[str, Any]) -> dict[str, Any]:
    """An event as the timeline shows it: all but its sandbox_id (the report's own)."""
    return {k: v for k, v in e.items() if k != "sandbox_id" and v is not None}


def _brief(e: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in e.items() if k not in ("sandbox_id", "source") and v is not None}


def render(report: dict[str, Any]) -> str:
    """The report as text a reviewer reads in a minute. Every value from the record goes through
    `escape` (text_escape.py): an argv, a path or a host cannot write to the reviewer's terminal."""
    out = [f"sandbox {escape(report.get('sandbox_id'))}: {sum(report['counts'].values())} events"
           f" ({escape(report.get('dropped') or 0)} dropped)"]
    if report["flags"]:
        out.append("\nFLAGS")
        for f in report.get("signatures") or report["flags"]:  # the most severe first
            cited = ", ".join(escape(s) for s in f["events"][:8])
            unstored = f"; {f['not_stored']} not stored" if f.get("not_stored") and f["flag"] != "record-incomplete" \
                else ""
            sev = f" [{escape(f['severity'])}]" if f.get("severity") else ""
            out.append(f"  !{sev} {escape(f['flag'])}: {escape(f['why'])} (events {cited or '-'}{unstored})")
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
