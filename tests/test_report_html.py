"""The HTML behaviour report (record/report_html.py): one self-contained page, every value from the
record inert; bounded whatever the record holds. Then served for real: a sandbox writes hostile file
names and argv, and its report comes back as HTML from the server (CSP, nosniff), through a gateway,
from the SDK (sync and async) and from `agentcell report ID --html [-o FILE]`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentcell import AsyncSandbox, Sandbox
from agentcell.errors import InvalidArgumentException
from agentcell.record import report, report_html
from tests.helpers import wait_for_events, wait_until
from tests.html_checks import assert_self_contained, page_tags
from tests.servers import GatewayProcess, ServerProcess

HOSTILE_NAME = "<script>alert(1)</script>"
CONTROL = "\x1b[2J\x1b]0;owned\x07"  # clear the screen, retitle the window
BIDI = "\u202eexe.txt"  # right-to-left override: reads as "txt.exe"
RAW_SPECIALS = ("\x1b", "\x07", "\u202e", "\u2066", "\u2028", "\x9b")


def _events(*specs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"time": 1000.0 + i, "source": "host", "pid": None, "ppid": None, "seq": i + 1, **s}
            for i, s in enumerate(specs)]


def _page(events: list[dict[str, Any]], summary: dict[str, Any] | None = None) -> str:
    return report_html.render(report.build(events, summary))


def _hostile_record() -> list[dict[str, Any]]:
    return _events(
        {"kind": "sandbox.created", "source": "api", "template": 'base"><img src=x onerror=alert(1)>'},
        {"kind": "process.exec", "pid": 5, "ppid": 1, "uid": 1000, "path": "/usr/bin/printf",
         "argv": ["printf", CONTROL, BIDI, "a\u2066b\u2069\u2028c", "\x9b31m", "</style><script>x()</script>"]},
        {"kind": "file.write", "path": f"/home/user/{HOSTILE_NAME}", "count": 1, "size": 3},
        {"kind": "file.create", "path": f"/home/user/{BIDI}"},
        {"kind": "dns.query", "domain": "<b>evil</b>.example", "type": "A", "answers": ["javascript:alert(1)"],
         "verdict": "denied"},
        {"kind": "net.connect", "dst": "198.51.100.4", "dport": 443, "domain": "https://evil.example/x.js",
         "rule": "secret", "secrets": ["<i>KEY</i>"], "state": "request"},
        {"kind": "self.report", "source": "self", "what": "note", "data": {"html": "<iframe src=https://x.example>"}},
        {"kind": "file.write", "path": "/home/user/.bashrc", "count": 1},
    )


def test_every_value_is_inert() -> None:
    page = _page(_hostile_record(), {"sandbox_id": "sbx<1>"})
    assert_self_contained(page)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and HOSTILE_NAME not in page
    assert "&lt;/style&gt;&lt;script&gt;x()&lt;/script&gt;" in page
    assert "onerror=alert(1)&gt;" in page and "<img" not in page
    for raw in RAW_SPECIALS:
        assert raw not in page, repr(raw)
    assert "\\x1b[2J\\x1b]0;owned\\x07" in page and "\\u202eexe.txt" in page and "\\x9b31m" in page
    # the only tags are the page's own (no value opened one)
    assert {t for t, _ in page_tags(page)} <= {
        "html", "head", "meta", "title", "style", "body", "header", "h1", "h2", "h3", "nav", "a", "dl", "dt", "dd", "p",
        "code", "span", "section", "div", "ul", "li", "details", "summary", "table", "thead", "tbody", "tr", "th",
        "td", "footer"}
    assert page.count("<script") == 0 and page.count("<style>") == 1


def test_signatures_come_first_and_link_their_events() -> None:
    page = _page(_hostile_record())
    assert page.index('id="signatures"') < page.index('id="processes"') < page.index('id="timeline"')
    ids = {v for _, attrs in page_tags(page) for k, v in attrs if k == "id"}
    links = {v[1:] for _, attrs in page_tags(page) for k, v in attrs if k == "href" and v}
    assert links - ids == set()  # every link lands on something in the page
    assert 'href="#e8"' in page and 'class="badge sev-medium">medium</span><span class="t">Persistence' in page
    assert "Secrets used" in page and "&lt;i&gt;KEY&lt;/i&gt;" in page


def test_the_process_tree_nests_and_folds() -> None:
    events = _events(
        {"kind": "process.exec", "pid": 10, "ppid": 1, "argv": ["bash", "-l"], "uid": 1000},
        {"kind": "process.exec", "pid": 11, "ppid": 10, "argv": ["make", "all"], "uid": 1000},
        {"kind": "process.exec", "pid": 12, "ppid": 11, "argv": ["cc", "-c", "x.c"], "uid": 1000},
        {"kind": "process.exit", "pid": 12, "code": 0, "duration_s": 0.5},
        {"kind": "process.exec", "pid": 11, "ppid": 10, "argv": ["ld", "x.o"], "uid": 1000},  # exec without fork
        {"kind": "process.exit", "pid": 11, "code": 2},
    )
    rep = report.build(events)
    (bash,) = rep["process_tree"]
    (make,) = bash["children"]
    assert [c["argv"][0] for c in make["children"]] == ["cc", "ld"] and make["exit"] == "exec"
    assert make["children"][0]["duration_s"] == 0.5 and make["children"][1]["exit"] == 2
    page = report_html.render(rep)
    assert page.count("<details open>") == 2  # bash and make have children
    assert "(exit 2, 1.0 s)" in page and "(running)" in page  # ld's; bash never exited


def test_a_deep_chain_and_a_huge_record_stay_bounded() -> None:
    chain = _events(*({"kind": "process.exec", "pid": 100 + i, "ppid": 99 + i, "argv": ["sh", str(i)]}
                      for i in range(400)))
    rep = report.build(chain)
    json.dumps(rep)  # no recursion limit hit
    depth, node = 0, rep["process_tree"][0]
    while node["children"]:
        node, depth = node["children"][0], depth + 1
    assert depth < report.MAX_DEPTH and sum(1 for r in rep["process_tree"] if r.get("deeper")) > 1
    report_html.render(rep)
    writes = [{"kind": "file.write", "path": f"/tmp/f{i}", "count": 1} for i in range(20000)]
    writes[10000] = {"kind": "process.exec", "pid": 8, "ppid": 1, "argv": ["sleep", "1000"]}  # left running
    many = _events(*writes, {"kind": "process.exec", "pid": 9, "ppid": 1, "argv": ["xmrig"]})
    page = _page(many)
    assert page.count('<tr id="e') == report.MAX_TIMELINE + 1  # the first 5,000 and the miner past them
    assert f"{20001 - report.MAX_TIMELINE} later events not shown" in page and 'id="e20001"' in page
    assert 'href="#e20001"' in page
    tags = page_tags(page)
    ids = {v for _, attrs in tags for k, v in attrs if k == "id"}
    assert {v[1:] for _, attrs in tags for k, v in attrs if k == "href" and v} <= ids  # no link goes nowhere
    assert "Left running" in page and "#10001" in page and 'href="#e10001"' not in page  # cited, not in the page


def test_a_name_that_is_not_utf8_still_encodes() -> None:
    page = _page(_events({"kind": "file.write", "path": "/tmp/\udcff\udc80", "count": 1}))
    data = report_html.encode(page)
    assert b"\\udcff\\udc80" in data and data.decode("utf-8")


def test_a_report_from_an_older_server_renders() -> None:
    rep = report.build(_hostile_record())
    for key in ("signatures", "process_tree", "timeline", "connections", "dns", "timeline_total"):
        rep.pop(key)
    page = report_html.render(rep)
    assert_self_contained(page)
    assert "printf" in page


# -- served for real ---------------------------------------------------------------------------------------

CELL = "cellrprt"


@pytest.fixture(scope="module")
def cell_and_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    logs = tmp_path_factory.mktemp("report-html")
    with ServerProcess(logs / "cell.log", "--cell-id", CELL, "--standbys", "0",
                       env={"AGENTCELL_EGRESS_UPLINK": "none"}) as cell:
        cell.wait_ready(300)
        gw = GatewayProcess(logs / "gw.log", [cell.url])
        try:
            gw.wait_ready()
            wait_until("the cell up at the gateway", lambda: all(c["up"] for c in gw.cells().values()) and gw.cells())
            yield cell.url, gw.url
        finally:
            gw.stop()


HOSTILE_SCRIPT = f"""
import os, subprocess
hostile = '/home/user/' + {HOSTILE_NAME!r}  # a directory "<script>alert(1)<", a file "script>" in it
os.makedirs(os.path.dirname(hostile))
open(hostile, 'w').write('x')
open('/home/user/' + {BIDI!r}, 'w').write('x')
subprocess.run(['/bin/echo', {CONTROL!r}, {BIDI!r}, '</td></tr></table><script>alert(2)</script>'])
"""


def test_served_by_the_server_the_gateway_the_sdk_and_the_cli(cell_and_gateway: tuple[str, str],
                                                            tmp_path: Path) -> None:
    url, gw = cell_and_gateway
    with Sandbox.create(api_url=url, timeout=120) as sbx:
        sid = sbx.sandbox_id
        assert sbx.run_code(HOSTILE_SCRIPT).error is None
    wait_for_events(lambda: Sandbox.events(sid, api_url=url),
                    lambda got: any(e["kind"] == "sandbox.killed" for e in got)
                    and any(e["kind"] == "file.write" and HOSTILE_NAME in e.get("path", "") for e in got)
                    and any(e["kind"] == "process.exec" and BIDI in (e.get("argv") or []) for e in got), timeout=15)
    deadline = time.monotonic() + 10
    while Sandbox.report(sid, api_url=url)["ended"] is None:  # closed a moment after the kill
        assert time.monotonic() < deadline
        time.sleep(0.2)
    pages = []
    for base in (url, gw):
        r = httpx.get(f"{base}/sandboxes/{sid}/report?format=html", timeout=60)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "text/html; charset=utf-8"
        assert r.headers["content-security-policy"] == report_html.CSP
        assert r.headers["x-content-type-options"] == "nosniff"
        pages.append(r.text)
    page = pages[0]
    assert pages[1] == page  # the gateway passes it through as it is
    assert_self_contained(page)
    assert "/home/user/&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script" not in page
    assert "&lt;/td&gt;&lt;/tr&gt;&lt;/table&gt;&lt;script&gt;alert(2)&lt;/script&gt;" in page
    assert "\\x1b[2J" in page and "\\u202eexe.txt" in page
    assert all(raw not in page for raw in RAW_SPECIALS)
    assert f"Behaviour report: {sid}" in page
    assert httpx.get(f"{url}/sandboxes/{sid}/report?format=pdf").status_code == 400
    # the SDK, sync and async
    assert Sandbox.report(sid, format="html", api_url=url) == page
    assert asyncio.run(AsyncSandbox.report(sid, format="html", api_url=url)) == page
    with pytest.raises(InvalidArgumentException):
        Sandbox.report(sid, format="pdf", api_url=url)
    # the CLI: to a file, and to stdout
    env = {**os.environ, "AGENTCELL_URL": url}
    out_file = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "agentcell.cli", "report", sid, "--html", "-o", str(out_file)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert out_file.read_text(encoding="utf-8") == page
    done = subprocess.run([sys.executable, "-m", "agentcell.cli", "report", sid, "--html"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == page, done.stderr
