"""Operations (issue 26 item 5): GET /metrics parsed by prometheus_client's own parser, the JSON and text
logs, the startup banner, the TOML config file, keys from a file, TLS, and the container recipe.

Real servers (`--egress-uplink none`, a temporary state dir), real sandboxes; the refusal summary is
fed real record events through the server's own tap (ObservedRecorder) into a real EventStore.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import logging
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from agentcell import Sandbox
from agentcell.record.store import EventStore
from agentcell.server import observer as observer_module
from agentcell.server.observer import ObservedRecorder, Observer
from agentcell.server.prometheus import ServerMetrics
from tests.conftest import REPO
from tests.servers import GATEWAY, ServerProcess, free_port

KEY = "ops-key-" + os.urandom(12).hex()
ARGV_KEY = "argv-key-" + os.urandom(12).hex()
CONFIG_MAX_SANDBOXES = 2
INTERNET_ARGS = tuple(os.environ.get("OPS_INTERNET_ARGS", "--log-format json").split())


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by (name, sorted labels), through prometheus_client's parser."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(found: dict[Any, float], name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def json_lines(text: str) -> list[dict[str, Any]]:
    """The log's lines, each of which must be one JSON object."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def json_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with its key from a file, its max-sandboxes from a config file, JSON logs."""
    d = tmp_path_factory.mktemp("ops")
    key_file = d / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    config = d / "agentcell.toml"
    config.write_text(f'max-sandboxes = {CONFIG_MAX_SANDBOXES}\nstandbys = 1\nlog_format = "json"\n'
                      f'api-key-file = "{key_file}"\negress-uplink = "none"\n')
    with ServerProcess(d / "server.log", "--config", str(config), "--state-dir", str(d / "state")) as srv:
        yield srv


def client(srv: ServerProcess, key: str | None = KEY) -> httpx.Client:
    return httpx.Client(base_url=srv.url, headers={"X-API-KEY": key} if key else {}, timeout=60)


def scrape(srv: ServerProcess) -> dict[Any, float]:
    with client(srv) as http:
        r = http.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=")
    return samples(r.text)


def test_metrics_need_the_api_key(json_server: ServerProcess) -> None:
    with client(json_server, None) as http:
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers={"X-API-KEY": "wrong"}).status_code == 401
        assert http.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert http.get("/metrics", headers={"X-API-KEY": KEY}).status_code == 200
        assert http.get("/sandboxes").status_code == 401  # the control plane: the file's key too


def test_metrics_follow_creates_states_and_kills(json_server: ServerProcess) -> None:
    before = scrape(json_server)
    assert [v for (name, _), v in before.items() if name == "agentcell_build_info"] == [1]
    assert value(before, "agentcell_sandboxes_max") == CONFIG_MAX_SANDBOXES  # from the config file
    assert value(before, "process_resident_memory_bytes") > 10 << 20
    assert value(before, "agentcell_standbys_target", backend="linux", template="base") == 1
    with client(json_server) as http:
        ids = []
        for _ in range(CONFIG_MAX_SANDBOXES):
            r = http.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120})
            assert r.status_code == 201, r.text
            ids.append(r.json()["sandboxID"])
        # the config file's max-sandboxes, in behaviour: a third create is refused
        full = http.post("/v2/sandboxes", json={"templateID": "base"})
        assert full.status_code == 429, full.text
        assert http.post(f"/sandboxes/{ids[0]}/pause").status_code == 204
        during = scrape(json_server)
        for sid in ids:
            assert http.delete(f"/sandboxes/{sid}").status_code == 204
    after = scrape(json_server)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("agentcell_sandbox_creates_total", outcome="ok") == CONFIG_MAX_SANDBOXES
    assert moved("agentcell_sandbox_creates_total", outcome="capacity") == 1
    assert moved("agentcell_sandbox_create_seconds_count") == CONFIG_MAX_SANDBOXES
    assert 0 < moved("agentcell_sandbox_create_seconds_sum") < 30
    assert moved("agentcell_sandbox_create_seconds_bucket", le="+Inf") == CONFIG_MAX_SANDBOXES
    assert value(during, "agentcell_sandboxes", state="running") == CONFIG_MAX_SANDBOXES - 1
    assert value(during, "agentcell_sandboxes", state="paused") == 1
    assert value(after, "agentcell_sandboxes", state="running") == 0
    assert value(after, "agentcell_sandboxes", state="paused") == 0
    assert moved("agentcell_sandbox_ends_total", cause="kill") == CONFIG_MAX_SANDBOXES
    assert moved("agentcell_sandbox_lifecycle_events_total", event="pause") == 1
    assert moved("agentcell_http_responses_total", plane="control", status_class="4xx") >= 1  # the 429
    assert moved("agentcell_http_responses_total", plane="control", status_class="2xx") >= 5
    assert value(after, "agentcell_record_events_stored_total") > value(before, "agentcell_record_events_stored_total")
    assert ("agentcell_record_events_dropped_total", ()) in after


def test_json_log_lines_carry_the_sandbox_id(json_server: ServerProcess) -> None:
    with client(json_server) as http:
        r = http.post("/v2/sandboxes", json={"templateID": "base"})
        assert r.status_code == 201, r.text
        sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
        got = http.get("/files", params={"path": "/etc/hostname"},
                       headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token})
        assert got.status_code == 200, got.text
        assert http.delete(f"/sandboxes/{sid}").status_code == 204
    time.sleep(0.3)
    lines = json_lines(json_server.log())  # every line of the log is JSON (uvicorn's own too)
    for line in lines:
        assert {"time", "level", "logger", "message"} <= set(line), line
    created = [x for x in lines if x["logger"] == "agentcell.lifecycle" and x.get("sandbox_id") == sid
               and x["message"] == "sandbox created"]
    assert len(created) == 1, created
    assert created[0]["template"] == "base" and created[0]["memory_mb"] > 0 and created[0]["key_id"].startswith("key:")
    gone = [x for x in lines if x["logger"] == "agentcell.lifecycle" and x.get("sandbox_id") == sid
            and x.get("cause") == "kill"]
    assert len(gone) == 1, gone
    data_plane = [x for x in lines if x["logger"] == "agentcell.access" and x.get("path") == "/files"]
    assert data_plane and data_plane[-1]["sandbox_id"] == sid and data_plane[-1]["port"] == 49983
    assert data_plane[-1]["status"] == 200 and data_plane[-1]["method"] == "GET"
    killed = [x for x in lines if x["logger"] == "agentcell.access" and x.get("method") == "DELETE"]
    assert killed[-1]["sandbox_id"] == sid  # a control-plane call on one sandbox names it too
    made = [x for x in lines if x["logger"] == "agentcell.access" and x.get("path") == "/v2/sandboxes"
            and x.get("method") == "POST" and x.get("sandbox_id") == sid]
    assert len(made) == 1 and made[0]["status"] == 201  # a create's line names the sandbox it made
    banner = [x for x in lines if x["logger"] == "agentcell.server" and "serving on" in x["message"]]
    assert len(banner) == 1, banner
    assert banner[0]["auth"].startswith("API key required") and banner[0]["egress_uplink"] == "none"
    assert banner[0]["max_sandboxes"] == CONFIG_MAX_SANDBOXES and banner[0]["listen"] == json_server.url
    assert banner[0]["state_dir"] and banner[0]["backends"] == ["linux"] and banner[0]["tls"] == "off"
    assert KEY not in json_server.log()


def test_key_from_a_file_is_not_in_argv(json_server: ServerProcess) -> None:
    cmdline = Path(f"/proc/{json_server.pid}/cmdline").read_bytes()
    assert b"--config" in cmdline and KEY.encode() not in cmdline
    assert "was given on the command line" not in json_server.log()


def test_oom_is_logged_and_counted(json_server: ServerProcess) -> None:
    before = scrape(json_server)
    sbx = Sandbox.create(api_url=json_server.url, api_key=KEY, limits={"memoryMB": 256}, timeout=120)
    try:
        execution = sbx.run_code("open('/proc/self/oom_score_adj', 'w').write('1000'); bytearray(400 << 20)")
        assert execution.error is not None  # the kernel killed it
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            lines = json_lines(json_server.log())
            oom = [x for x in lines if x["logger"] == "agentcell.limits" and x.get("sandbox_id") == sbx.sandbox_id]
            if oom:
                break
            time.sleep(0.2)
        assert oom and oom[0]["kind"] == "limit.oom" and oom[0]["level"] == "warning", oom
    finally:
        sbx.kill()
    after = scrape(json_server)
    assert value(after, "agentcell_limit_events_total", limit="oom") > value(before, "agentcell_limit_events_total",
                                                                           limit="oom")


@pytest.fixture(scope="module")
def internet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose uplink leads into the tests' own internet (tests/egress_internet.py), JSON logs."""
    from tests.egress_internet import internet_server

    with internet_server(tmp_path_factory, *INTERNET_ARGS) as server:
        yield server


def test_egress_bytes_and_refusals_are_counted_and_logged(internet: ServerProcess) -> None:
    from tests.egress_internet import FORBIDDEN, WEB

    before = scrape(internet)
    sbx = Sandbox.create(api_url=internet.url, allow_internet_access=True, timeout=120)
    try:
        out = sbx.run_code(
            "import socket\n"
            "def tcp(host):\n"
            "    try:\n"
            "        s = socket.create_connection((host, 80), timeout=1)\n"
            "        s.sendall(b'GET / HTTP/1.0\\r\\nHost: ' + host.encode() + b'\\r\\n\\r\\n')\n"
            "        data = s.recv(200); s.close(); return data[:12].decode()\n"
            "    except OSError as e:\n"
            "        return type(e).__name__\n"
            f"print(tcp({WEB!r}), [tcp({FORBIDDEN[0]!r}) for _ in range(4)])")
        assert out.logs.stdout and out.logs.stdout[0].startswith("HTTP/1."), out
        assert "HTTP" not in out.logs.stdout[0].split(" ", 1)[1], out  # the forbidden address was never reached
        deadline = time.monotonic() + 40  # a closed connection is counted after its TIME_WAIT (10 s)
        while True:
            now = scrape(internet)
            sent = value(now, "agentcell_egress_bytes_total", direction="out") - value(
                before, "agentcell_egress_bytes_total", direction="out")
            if sent > 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert sent > 0
        assert value(now, "agentcell_egress_bytes_total", direction="in") > value(
            before, "agentcell_egress_bytes_total", direction="in")
        assert value(now, "agentcell_egress_connections_total") > value(before, "agentcell_egress_connections_total")
        refused = sum(v for (name, labels), v in now.items() if name == "agentcell_egress_refusals_total"
                      and ("kind", "net.deny") in labels) - sum(
            v for (name, labels), v in before.items() if name == "agentcell_egress_refusals_total"
            and ("kind", "net.deny") in labels)
        assert refused >= 4, now
    finally:
        sbx.kill()
    lines = [x for x in json_lines(internet.log()) if x["logger"] == "agentcell.policy"
             and x.get("sandbox_id") == sbx.sandbox_id]
    assert 1 <= len(lines) <= 2, lines  # the first refusal, then (at most) one sum for the rest
    assert lines[0]["kind"] == "net.deny" and lines[0]["target"] == f"{FORBIDDEN[0]}:80", lines
    assert sum(x.get("count", 1) for x in lines) >= 4, lines


def _self_signed(d: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "agentcell test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = d / "cert.pem", d / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """HTTPS with a self-signed certificate, text logs, the key on the command line (to be warned of)."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(d)
    with ServerProcess(d / "server.log", "--egress-uplink", "none", "--standbys", "0", "--tls-cert", str(cert),
                       "--tls-key", str(key), "--api-key", ARGV_KEY, "--log-format", "text",
                       tls=ssl.create_default_context(cafile=str(cert))) as srv:
        yield srv, cert


def test_tls_round_trip(tls_server: tuple[ServerProcess, Path]) -> None:
    srv, cert = tls_server
    trust = ssl.create_default_context(cafile=str(cert))
    with httpx.Client(base_url=srv.url, verify=trust, headers={"X-API-KEY": ARGV_KEY}, timeout=60) as http:
        r = http.post("/v2/sandboxes", json={"templateID": "base"})
        assert r.status_code == 201, r.text
        sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
        up = http.post("/files", params={"path": "/home/user/tls.txt"}, files={"file": b"over tls"},
                       headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token})
        assert up.status_code == 200, up.text
        down = http.get("/files", params={"path": "/home/user/tls.txt"},
                        headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token})
        assert down.content == b"over tls"
        assert http.delete(f"/sandboxes/{sid}").status_code == 204
    with pytest.raises(httpx.ConnectError):  # a client that does not trust it refuses it
        httpx.get(f"{srv.url}/health", timeout=5)
    with pytest.raises(httpx.TransportError):  # and plain HTTP gets no answer
        httpx.get(srv.url.replace("https://", "http://") + "/health", timeout=5)


def test_text_log_banner_and_argv_key_warning(tls_server: tuple[ServerProcess, Path]) -> None:
    srv, _ = tls_server
    text = srv.log()
    assert ARGV_KEY not in text  # the key itself is never logged
    banner = text[text.index("serving on"):].splitlines()
    assert banner[0].endswith(srv.url)
    said = dict(re.match(r"\s+(\w+):\s+(.*)", line).groups() for line in banner[1:8])  # type: ignore[union-attr]
    assert said["tls"] == "on" and said["auth"].startswith("API key required") and said["egress_uplink"] == "none"
    assert re.search(r"WARNING\s+agentcell\.server: --api-key was given on the command line", text)


def test_text_log_escapes_what_clients_send(tls_server: tuple[ServerProcess, Path]) -> None:
    srv, cert = tls_server
    context = ssl.create_default_context(cafile=str(cert))
    with socket.create_connection(("127.0.0.1", srv.port)) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        tls.sendall(b"GET /%1b%5b2J%1b%5b31mred HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        while tls.recv(65536):
            pass
    time.sleep(0.3)
    raw_log = srv.log_path.read_bytes()
    assert b"\x1b" not in raw_log
    assert b"\\u001b[2J\\u001b[31mred" in raw_log


def test_gateway_takes_a_config_file_key_files_and_tls(tls_server: tuple[ServerProcess, Path],
                                                       tmp_path: Path) -> None:
    """`agentcell gateway` from a TOML file alone: its keys from files, HTTPS, JSON logs, its banner."""
    _, cert = tls_server
    (tmp_path / "client-key").write_text(KEY)
    (tmp_path / "cell-key").write_text(ARGV_KEY + "\n")
    port = free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(f'port = {port}\ncell = ["http://127.0.0.1:9"]\napi-key-file = "{tmp_path / "client-key"}"\n'
                      f'cell_api_key_file = "{tmp_path / "cell-key"}"\ntls-cert = "{cert}"\n'
                      f'tls-key = "{cert.parent / "key.pem"}"\nlog-format = "json"\n')
    log_path = tmp_path / "gateway.log"
    trust = ssl.create_default_context(cafile=str(cert))
    gateway = ServerProcess(log_path, command=GATEWAY, port=port, address_args=False, own_state_dir=False,
                            env={"AGENTCELL_CONFIG": str(config)}, tls=trust, start_timeout=30, what="the gateway")
    url = gateway.url
    try:
        gateway.wait_ready()
        assert httpx.get(f"{url}/v1/cells", verify=trust).status_code == 401
        assert httpx.get(f"{url}/v1/cells", verify=trust, headers={"X-API-KEY": KEY}).status_code == 200
        cmdline = Path(f"/proc/{gateway.pid}/cmdline").read_bytes()
        assert KEY.encode() not in cmdline and ARGV_KEY.encode() not in cmdline
    finally:
        gateway.stop(20, or_kill=False)
    lines = json_lines(log_path.read_text())
    [banner] = [x for x in lines if "gateway" in x["message"] and "serving on" in x["message"]]
    assert banner["listen"] == url and banner["tls"] == "on" and banner["auth"].startswith("API key required")
    assert KEY not in log_path.read_text() and ARGV_KEY not in log_path.read_text()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None or not os.path.exists("/usr/bin/python3"),
                    reason="needs root, useradd and /usr/bin/python3")
def test_system_socket_metrics_are_roots_only() -> None:
    """Under the system service's tenancy a group member reaches the socket without a key, but /metrics counts
    every user's sandboxes: the member gets 403, root gets them."""
    import pwd
    import uuid

    from tests.test_system_service import Service

    tag = uuid.uuid4().hex[:6]
    group, member = f"acopsg{tag}", f"acopsm{tag}"
    subprocess.run(["groupadd", "--system", group], check=True)
    service = None
    try:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "-G", group,
                        member], check=True)
        service = Service(group)
        assert service.client.get("/metrics").status_code == 200  # root on the socket, no key
        code = ("import socket, sys\n"
                "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
                "s.sendall(b'GET /metrics HTTP/1.1\\r\\nHost: localhost\\r\\nConnection: close\\r\\n\\r\\n')\n"
                "print(s.recv(200).split(b'\\r\\n')[0].decode())\n")
        seen = subprocess.run(["runuser", "-u", member, "--", "/usr/bin/python3", "-c", code, service.socket],
                              capture_output=True, text=True, timeout=60)
        assert seen.stdout.strip() == "HTTP/1.1 403 Forbidden", (seen.stdout, seen.stderr)
        assert pwd.getpwnam(member).pw_uid != 0
    finally:
        if service is not None:
            service.stop()
        subprocess.run(["userdel", member], check=False)
        subprocess.run(["groupdel", group], check=False)


def test_config_file_unknown_key_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("max-sandboxs = 3\n")
    r = subprocess.run([sys.executable, "-m", "agentcell", "serve", "--config", str(config)], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [
        f"Error: config file {config}: unknown key 'max-sandboxs' (did you mean 'max-sandboxes'?)"]
    config.write_text("max-sandboxes = 'many'\n")  # a value is checked as the flag's is
    r = subprocess.run([sys.executable, "-m", "agentcell", "serve", "--config", str(config)], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0 and "max-sandboxes" in r.stderr and "many" in r.stderr, r.stderr
    config.write_text("max-sandboxes = [\n")
    r = subprocess.run([sys.executable, "-m", "agentcell", "gateway"], capture_output=True, text=True, timeout=60,
                       cwd=REPO, env={**os.environ, "AGENTCELL_CONFIG": str(config)})
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "not TOML" in r.stderr, r.stderr


def test_config_file_is_every_flag_and_the_command_line_wins(tmp_path: Path) -> None:
    import click

    from agentcell.cli import config_file
    from agentcell.cli.serve import gateway, serve

    for command in (serve, gateway):
        keys = config_file._keys(command)
        flags = {o[2:] for p in command.params if isinstance(p, click.Option) and not p.is_eager and p.name != "config"
                 for o in p.opts if o.startswith("--")}
        assert set(keys) == flags - {"help"}, set(keys) ^ flags
    config = tmp_path / "c.toml"
    config.write_text('max_sandboxes = 7\nallowed-host = "a.example"\nrecord = false\nlog-level = "debug"\n')
    ctx = serve.make_context("serve", ["--config", str(config), "--max-sandboxes", "9"])
    assert ctx.params["max_sandboxes"] == 9  # the command line over the file
    assert ctx.params["allowed_hosts"] == ("a.example",) and ctx.params["record"] is False
    assert ctx.params["log_level"] == "debug"


def test_api_key_file_and_flag_together_are_refused(tmp_path: Path) -> None:
    key_file = tmp_path / "k"
    key_file.write_text("x")
    r = subprocess.run([sys.executable, "-m", "agentcell", "gateway", "--api-key-file", str(key_file), "--api-key",
                        "y"], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0 and "--api-key and --api-key-file both given" in r.stderr, r.stderr
    key_file.write_text("\n")
    r = subprocess.run([sys.executable, "-m", "agentcell", "serve", "--api-key-file", str(key_file)],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0 and "the file is empty" in r.stderr, r.stderr


def test_refusals_are_counted_each_and_logged_summed_up(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A flood of refused connections: every one counted, two log lines (the first, then the sum)."""
    monkeypatch.setattr(observer_module, "SUMMARY_S", 0.3)
    metrics = ServerMetrics("test")
    store = EventStore(None)
    recorder = ObservedRecorder(store, Observer(metrics))

    async def flood() -> None:
        await store.start()
        try:
            recorder.begin("sbx1")
            for i in range(1000):
                recorder.add("sbx1", {"time": time.time(), "kind": "net.deny", "source": "host", "pid": None,
                                      "ppid": None, "dst": f"192.0.2.{i % 7}", "dport": 443, "rule": "policy",
                                      "verdict": "denied", "state": "denied"})
            recorder.add("sbx1", {"time": time.time(), "kind": "net.deny", "source": "host", "pid": None, "ppid": None,
                                  "rule": "proxy-budget", "count": 50, "verdict": "denied"})
            recorder.add("sbx1", {"time": time.time(), "kind": "net.connect", "source": "host", "pid": None,
                                  "ppid": None, "state": "closed", "bytes_out": 1200, "bytes_in": 34000})
            await asyncio.sleep(0.5)
        finally:
            await store.close()

    with caplog.at_level(logging.WARNING, logger="agentcell.policy"):
        asyncio.run(flood())
    found = samples(metrics.render().decode())
    assert value(found, "agentcell_egress_refusals_total", kind="net.deny", rule="policy") == 1000
    assert value(found, "agentcell_egress_refusals_total", kind="net.deny", rule="proxy-budget") == 50
    assert value(found, "agentcell_egress_bytes_total", direction="out") == 1200
    assert value(found, "agentcell_egress_bytes_total", direction="in") == 34000
    lines = [r for r in caplog.records if r.name == "agentcell.policy"]
    assert len(lines) == 2, [r.getMessage() for r in lines]
    summary = lines[1].agentcell_fields  # type: ignore[attr-defined]
    assert summary["sandbox_id"] == "sbx1" and summary["count"] == 999 + 50
    assert summary["rules"] == {"policy": 999, "proxy-budget": 50} and len(summary["targets"]) == 3


def test_compose_file_parses_and_matches_the_dockerfile() -> None:
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
    service = compose["services"]["agentcell"]
    assert service["build"]["dockerfile"] == "deploy/Dockerfile"
    assert service["privileged"] is True
    exposed = set(re.findall(r"^EXPOSE\s+(\d+)", (REPO / "deploy" / "Dockerfile").read_text(), re.M))
    published = {str(p).rsplit(":", 1)[-1] for p in service["ports"]}
    assert exposed and exposed <= published, (exposed, published)
    assert all(str(p).startswith("127.0.0.1:") for p in service["ports"])  # the example publishes on loopback
    assert any("api-key" in str(s) for s in service.get("secrets", [])), service


def _docker_unusable() -> str | None:
    if shutil.which("docker") is None:
        return "no docker command on this machine"
    r = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    return None if r.returncode == 0 else f"docker info fails: {(r.stderr or r.stdout).strip()[:200]}"


@pytest.mark.skipif(bool(_docker_unusable()), reason=_docker_unusable() or "")
def test_container_image_builds() -> None:
    tag = f"agentcell-test:{os.getpid()}"
    build = subprocess.run(["docker", "build", "-f", "deploy/Dockerfile", "-t", tag, "."], cwd=REPO,
                           capture_output=True, text=True, timeout=3600)
    assert build.returncode == 0, build.stderr[-4000:]
    try:
        run = subprocess.run(["docker", "run", "--rm", tag, "serve", "--help"], capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0 and "--api-key-file" in run.stdout, run.stderr
    finally:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True, timeout=300)

