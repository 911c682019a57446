"""The behaviour report (record/report.py) as one self-contained HTML file, for a person to read.

One file, no scripts, no request of its own: the styles are inline (report.html, package data), the
process tree folds with `<details>`, links only go to anchors in the page (`#e{seq}`: a signature's
events in the timeline). It renders offline, saved to disk, and inside the console's
`<iframe sandbox>` under `Content-Security-Policy: default-src 'none'; style-src 'unsafe-inline';
img-src data:` (CSP below, what the server sends with it).

Every value from the record is escaped twice over by `_e`: first as the text report does
(text_escape.py: control characters, bidi overrides and isolates, line separators become visible
`\\xNN` / `\\uNNNN`, so nothing reorders or hides what the reviewer reads), then by `html.escape`
(quotes included: no value can open a tag or leave an attribute). Every section is bounded by the
report's own bounds (the timeline at report.MAX_TIMELINE rows), so a record of 100,000 events
renders in well under a second.
"""

from __future__ import annotations

import html
import json
from contextvars import ContextVar
from datetime import UTC, datetime
from importlib import resources
from string import Template
from typing import Any

from agentcell.record import report as report_module
from agentcell.text_escape import escape, escape_text

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}
MAX_VALUE = 400  # characters of one value shown (an argv word, a path, an event's field)
MAX_ROW = 1200  # characters of a timeline row's details
_NET_KINDS = ("net.connect", "net.deny", "dns.query", "secret.refused")


def _template() -> Template:
    return Template(resources.files("agentcell.record").joinpath("report.html").read_text(encoding="utf-8"))


def _e(value: Any, limit: int = MAX_VALUE) -> str:
    """One value from the record as inert HTML text (module doc), cut at `limit` characters."""
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    if len(text) > limit:
        text = text[:limit] + f"… ({len(text) - limit} more)"
    return html.escape(escape(text), quote=True)


def _time(t: Any, date: bool = True) -> str:
    if not isinstance(t, int | float):
        return "-"
    stamp = datetime.fromtimestamp(t, UTC)
    return stamp.strftime("%Y-%m-%d %H:%M:%S UTC" if date else "%H:%M:%S.%f")[: None if date else -3]


# the seqs with a row in this page's timeline (set by `render`): a link to any other would go nowhere
_rows: ContextVar[frozenset[Any]] = ContextVar("rows", default=frozenset())


def _seq_link(seq: Any) -> str:
    if not isinstance(seq, int) or isinstance(seq, bool):
        return ""
    return f'<a href="#e{seq}">#{seq}</a>' if seq in _rows.get() else f"#{seq}"


def _section(anchor: str, title: str, count: int | None, body: str, not_recorded: str | None = None) -> str:
    n = f' <span class="n">({count})</span>' if count is not None else ""
    missing = f'<p class="note">Not recorded on this host: {_e(not_recorded)}</p>' if not_recorded else ""
    return f'<section id="{anchor}"><h2>{title}{n}</h2>{missing}{body}</section>'


def _table(head: tuple[str, ...], rows: list[str], empty: str = "none") -> str:
    if not rows:
        return f'<p class="muted">{empty}</p>'
    th = "".join(f"<th>{h}</th>" for h in head)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


# -- the sections -----------------------------------------------------------------------------------------


def _header(rep: dict[str, Any]) -> str:
    counts = rep.get("counts") or {}
    total = sum(counts.values())
    rows = [("sandbox", _e(rep.get("sandbox_id"))), ("template", _e(rep.get("template") or "-")),
            ("started", _time(rep.get("started") or rep.get("first_event"))),
            ("ended", _time(rep.get("ended")) if rep.get("ended") else "still running"),
            ("first event", _time(rep.get("first_event"))), ("last event", _time(rep.get("last_event"))),
            ("events", f"{total} stored, {_e(rep.get('dropped') or 0)} dropped"),
            ("signatures", str(len(rep.get("signatures") or [])))]
    meta = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    kinds = "".join(f"<span><code>{_e(k)}</code> {_e(v)}</span>" for k, v in counts.items())
    missing = "".join(f'<p class="note">{_e(part)}: not recorded ({_e(why)})</p>'
                      for part, why in (rep.get("not_recorded") or {}).items())
    nav = "".join(f'<a href="#{a}">{t}</a>' for a, t in (
        ("signatures", "Signatures"), ("processes", "Processes"), ("files", "Files"), ("network", "Network"),
        ("refusals", "Refusals"), ("limits", "Limits"), ("api", "API calls"), ("timeline", "Timeline")))
    return (f"<header><h1>Behaviour report: {_e(rep.get('sandbox_id'))}</h1><nav>{nav}</nav>"
            f'<dl class="meta">{meta}</dl>{missing}<p class="counts muted">{kinds}</p></header>')


def _signatures(rep: dict[str, Any]) -> str:
    out = []
    known = {e.get("seq"): e for e in (*(rep.get("timeline") or ()), *(rep.get("timeline_flagged") or ()))}
    for s in rep.get("signatures") or ():
        sev = str(s.get("severity"))
        sev = sev if sev in ("critical", "high", "medium", "low", "info") else "medium"
        cited = " ".join(_seq_link(q) for q in s.get("events") or ())
        unstored = f"; {_e(s.get('not_stored'))} of them not stored" \
            if s.get("not_stored") and s.get("signature") != "record-incomplete" else ""
        out.append(f'<div class="sig {sev}"><span class="badge sev-{sev}">{sev}</span>'
                   f'<span class="t">{_e(s.get("title"))}</span> <code class="muted">{_e(s.get("signature"))}</code>'
                   f'<div>{_e(s.get("why"))}</div>'
                   f'<div class="ev muted">{_e(s.get("count"))} event(s){unstored}: {cited or "none stored"}</div>'
                   f'{_cited(s.get("events") or (), known)}</div>')
    body = "".join(out) or '<p class="muted">No signature: nothing in the record matched a rule.</p>'
    return _section("signatures", "Signatures", len(out), body)


def _cited(seqs: Any, known: dict[Any, dict[str, Any]], shown: int = 5) -> str:
    """The first few events a signature cites, in brief (the rest are a link away)."""
    rows = [f"<li>{_seq_link(q)} {_e(known[q].get('kind'))} <code>{_details(known[q], _BRIEF_SKIP, 240)}</code></li>"
            for q in list(seqs)[:shown] if q in known]
    return f'<ul class="cited">{"".join(rows)}</ul>' if rows else ""


def _process_line(p: dict[str, Any]) -> str:
    argv = p.get("argv") if isinstance(p.get("argv"), list) and p.get("argv") else [p.get("path")]
    words = " ".join(_e(a, 200) for a in argv[:64]) + (f" … ({len(argv) - 64} more)" if len(argv) > 64 else "")
    exit_ = p.get("exit")
    if p.get("end") is None:
        status, bad = "running", False
    elif exit_ == "exec":
        status, bad = "exec'd a new program", False
    else:
        status, bad = f"exit {_e(exit_)}", exit_ not in (0, None)
    dur = f", {_e(p['duration_s'])} s" if isinstance(p.get("duration_s"), int | float) else ""
    path = f' <span class="muted mono">{_e(p.get("path"))}</span>' if p.get("path") and p.get("path") != argv[0] else ""
    deeper = ' <span class="muted">(nested deeper)</span>' if p.get("deeper") else ""
    return (f'<span class="proc">{_seq_link(p.get("seq"))} <span class="muted">pid {_e(p.get("pid"))} '
            f'uid {_e(p.get("uid"))}</span> <span class="argv">{words}</span>{path}'
            f'<span class="st{" bad" if bad else ""}">({status}{dur})</span>{deeper}</span>')


def _tree(nodes: list[dict[str, Any]]) -> str:
    items = []
    for p in nodes:
        kids = p.get("children") or []
        if kids:
            items.append(f"<li><details open><summary>{_process_line(p)}</summary>{_tree(kids)}</details></li>")
        else:
            items.append(f'<li class="leaf">{_process_line(p)}</li>')
    return f"<ul>{''.join(items)}</ul>"


def _processes(rep: dict[str, Any]) -> str:
    roots = rep.get("process_tree")
    if roots is None:  # a report from an older server: its flat list
        roots = [{**p, "children": []} for p in rep.get("processes") or ()]
    total = rep.get("processes_total", len(rep.get("processes") or ()))
    shown = _count(roots)
    more = f'<p class="muted">{total - shown} more not shown (the events have them).</p>' if total > shown else ""
    body = f'<div class="tree">{_tree(roots)}</div>{more}' if roots else '<p class="muted">none</p>'
    return _section("processes", "Process tree", total, body, (rep.get("not_recorded") or {}).get("processes"))


def _count(nodes: list[dict[str, Any]]) -> int:
    return sum(1 + _count(n.get("children") or []) for n in nodes)


def _files(rep: dict[str, Any]) -> str:
    rows = [f"<tr><td class=\"m\">{_e(f.get('path'))}</td>"
            f"<td>{', '.join(f'{_e(k)} ×{_e(v)}' for k, v in (f.get('ops') or {}).items())}</td>"
            f"<td>{_e(f.get('size')) if f.get('size') is not None else ''}</td></tr>" for f in rep.get("files") or ()]
    return _section("files", "Files written, changed, deleted", len(rows),
                    _table(("path", "operations", "size"), rows), (rep.get("not_recorded") or {}).get("files"))


def _network(rep: dict[str, Any]) -> str:
    conns = []
    for c in rep.get("connections") or ():
        verdict = (f'<span class="denied">denied ×{_e(c.get("denied"))}</span> ' if c.get("denied") else "") + \
                  (f'<span class="allowed">allowed ×{_e(c.get("allowed"))}</span>' if c.get("allowed") else "")
        conns.append(f"<tr><td>{_seq_link(c.get('seq'))}</td><td class=\"m\">{_e(c.get('dst'))}</td>"
                     f"<td>{_e(c.get('dport') if c.get('dport') is not None else '')}</td><td>{_e(c.get('proto') or '')}</td>"
                     f"<td class=\"m\">{_e(c.get('domain') or '')}</td><td>{verdict}</td>"
                     f"<td>{_e(', '.join(c.get('rules') or []))}</td><td>{_e(', '.join(c.get('secrets') or []))}</td>"
                     f"<td>{_e(c.get('bytes_out') or 0)} / {_e(c.get('bytes_in') or 0)}</td></tr>")
    dns = [f"<tr><td>{_seq_link(d.get('seq'))}</td><td class=\"m\">{_e(d.get('domain'))}</td>"
           f"<td>{_e(', '.join(d.get('types') or []))}</td><td class=\"m\">{_e(', '.join(d.get('answers') or []))}</td>"
           f"<td>{', '.join(f'{_e(k)} ×{_e(v)}' for k, v in (d.get('verdicts') or {}).items())}</td></tr>"
           for d in rep.get("dns") or ()]
    body = ("<h3>Connections</h3>" + _table(("first", "address", "port", "proto", "name", "policy", "rules",
                                             "secrets", "bytes out / in"), conns)
            + "<h3>DNS</h3>" + _table(("first", "name", "types", "answers", "verdicts"), dns))
    return _section("network", "Network", len(conns), body)


def _refusals(rep: dict[str, Any]) -> str:
    rows = []
    for d in rep.get("denials") or ():
        if d.get("kind") in _NET_KINDS:
            continue  # shown under Network
        what = d.get("syscall") if d.get("kind") == "deny.syscall" else d.get("path") or d.get("argv")
        why = d.get("reason") or d.get("action") or d.get("rule") or (f"errno {d['errno']}" if d.get("errno") else "")
        rows.append(f"<tr><td>{_seq_link(d.get('seq'))}</td><td>{_e(d.get('kind'))}</td>"
                    f"<td class=\"m\">{_e(what if what is not None else '')}</td><td>{_e(why)}</td>"
                    f"<td>{_e(d.get('pid') if d.get('pid') is not None else '')}</td></tr>")
    return _section("refusals", "Refused operations (seccomp, Landlock, permissions, mounts, exec policy)", len(rows),
                    _table(("event", "kind", "what", "why", "pid"), rows))


def _limits(rep: dict[str, Any]) -> str:
    rows = [f"<tr><td>{_seq_link(x.get('seq'))}</td><td>{_e(x.get('kind'))}</td>"
            f"<td class=\"m\">{_details(x, ('kind', 'seq', 'time'))}</td></tr>" for x in rep.get("limits") or ()]
    return _section("limits", "Limits hit (memory, disk, pids, CPU, timeout)", len(rows),
                    _table(("event", "kind", "details"), rows), (rep.get("not_recorded") or {}).get("limits"))


def _api(rep: dict[str, Any]) -> str:
    rows = [f"<tr><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for k, v in sorted((rep.get("api_calls") or {}).items())]
    return _section("api", "API calls", sum((rep.get("api_calls") or {}).values()), _table(("action", "calls"), rows))


_COMMON = frozenset({"time", "kind", "source", "seq", "pid", "sandbox_id"})


_BRIEF_SKIP = _COMMON | {"ppid", "cwd", "comm", "host_pid", "nr"}


def _details(e: dict[str, Any], skip: frozenset[str] | tuple[str, ...] = _COMMON, limit: int = MAX_ROW) -> str:
    """An event's fields as `key=value` text, escaped (a string as the text report does; anything else as
    JSON, whose own escapes are kept as they are), cut at `limit` characters."""
    parts = []
    used = 0
    for k, v in e.items():
        if k in skip or v is None:
            continue
        shown = escape(v) if isinstance(v, str) else escape_text(json.dumps(v, default=str, ensure_ascii=False))
        text = f"{escape(k)}={shown}"
        parts.append(text)
        used += len(text)
        if used > limit:
            break
    text = "  ".join(parts)
    if len(text) > limit:
        text = text[:limit] + f"… ({len(text) - limit} more)"
    return html.escape(text, quote=True)


def _timeline(rep: dict[str, Any]) -> str:
    events = rep.get("timeline") or []
    total = rep.get("timeline_total", len(events))
    rows = [_event_row(e) for e in events]
    more = ""
    if total > len(events):
        more = (f'<p class="note">{total - len(events)} later events not shown here (the timeline shows the first '
                f"{len(events)}); the record has them: <code>GET /sandboxes/{{id}}/events?after={_e(events[-1].get('seq') if events else 0)}</code>.</p>")
        flagged = rep.get("timeline_flagged") or []
        if flagged:
            more += "<h3>Later events that raised a signature</h3>" + _table(
                ("seq", "time", "kind", "source", "pid", "details"), [_event_row(e) for e in flagged])
    return _section("timeline", "Timeline", total,
                    _table(("seq", "time", "kind", "source", "pid", "details"), rows) + more)


def _event_row(e: dict[str, Any]) -> str:
    seq = e.get("seq")
    anchor = f' id="e{seq}"' if isinstance(seq, int) and not isinstance(seq, bool) else ""
    return (f"<tr{anchor}><td class=\"n\">{_e(seq)}</td><td class=\"m n\">{_time(e.get('time'), date=False)}</td>"
            f"<td class=\"n\">{_e(e.get('kind'))}</td><td class=\"n\">{_e(e.get('source') or '')}</td>"
            f"<td class=\"n\">{_e(e.get('pid') if e.get('pid') is not None else '')}</td>"
            f"<td class=\"m\">{_details(e)}</td></tr>")


SECTIONS = (_header, _signatures, _processes, _files, _network, _refusals, _limits, _api, _timeline)


def render(rep: dict[str, Any]) -> str:
    """The report (report.build's dict, or its JSON from a server) as one self-contained HTML page."""
    token = _rows.set(frozenset(e.get("seq") for e in (*(rep.get("timeline") or ()), *(rep.get("timeline_flagged") or ()))))
    try:
        body = "\n".join(section(rep) for section in SECTIONS)
    finally:
        _rows.reset(token)
    body += (f'<footer><p class="muted">agentcell behaviour report; timeline bounded at '
             f"{report_module.MAX_TIMELINE} events. Every value from the record is shown escaped.</p></footer>")
    return _template().substitute(title=_e(rep.get("sandbox_id")), body=body)


def encode(page: str) -> bytes:
    """The page as UTF-8; a lone surrogate (a file name that was not UTF-8) as a visible escape."""
    return page.encode("utf-8", "backslashreplace")
