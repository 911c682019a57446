"""The secrets vault (E2B's Secret API, docs/secrets.md) through the official `e2b` SDK and ours, on
real servers whose only uplink is the tests' internet (tests/egress_internet.py: nothing leaves the
machine): CRUD, versions and metadata; values write-only (absent from every answer, the state dir, the
server's log, the record and a snapshot) and sealed at rest; a referencing sandbox's request carries
the value host-side while the sandbox sees a placeholder; the version used is the one current at
create; another tenant neither sees nor uses a secret; a key rotation, a crash in the middle of one,
and a restart keep every value usable; a gateway keeps the vault on one cell.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets as pysecrets
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentcell import AsyncSecret, Sandbox, Secret, SecretNotFoundException
from agentcell.errors import InvalidArgumentException, SecretException
from agentcell.vault import keyring
from agentcell.vault.store import Vault
from tests.egress_internet import INTERNET_LOG, ask, internet_server, probed
from tests.helpers import e2b_pointed_at
from tests.servers import SERVER, GatewayProcess, ServerProcess, free_port

pytestmark = pytest.mark.skipif(bool(os.environ.get("AGENTCELL_TEST_SERVER_URL")),
                                reason="these tests start and restart servers of their own")


def _value(tag: str) -> str:
    return f"sk-{tag}-" + pysecrets.token_hex(12)


@pytest.fixture(scope="module")
def state_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="agentcell-vault-state-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, state_dir: Path) -> Iterator[dict[str, ServerProcess]]:
    """A server on the tests' internet; `restart()` replaces it with one on the same state dir."""
    with internet_server(tmp_path_factory, "--state-dir", str(state_dir)) as server:
        holder = {"server": server}
        try:
            yield holder
        finally:
            if holder["server"] is not server:
                holder["server"].stop()


def _restart(world: dict[str, ServerProcess]) -> ServerProcess:
    old = world["server"]
    argv = list(old.proc.args)
    old.stop()
    new = ServerProcess(old.log_path.with_name("restarted.log"), *argv[len(SERVER):], port=old.port,
                        address_args=False)
    new.started()
    world["server"] = new
    return new


@pytest.fixture
def url(world: dict[str, ServerProcess]) -> Iterator[str]:
    with e2b_pointed_at(world["server"].url):
        yield world["server"].url


def _grep_tree(root: Path, needle: bytes) -> list[str]:
    hits = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath, name)
            try:
                if needle in p.read_bytes():
                    hits.append(str(p))
            except OSError:
                pass
    return hits


def _internet_saw(text: str) -> bool:
    return text.encode() in INTERNET_LOG.read_bytes()


def _head_of(path: str, value: str) -> bool:
    """Whether a request for `path` that got out carried `value` (INTERNET_LOG: heads split by ----)."""
    heads = INTERNET_LOG.read_text(errors="replace").split("\n----\n")
    return any(h.split(" ")[1:2] == [path] and value in h for h in heads)


# --- CRUD ------------------------------------------------------------------------------------------------


def test_crud_through_the_official_sdk(url: str) -> None:
    import e2b

    info = e2b.Secret.create("OpenAI-Key", _value("crud"), metadata={"env": "test"})
    assert info.secret_id.startswith("sec_") and info.name == "openai-key" and info.version == 1
    assert info.metadata == {"env": "test"} and info.created_at == info.updated_at
    assert not hasattr(info, "value")
    assert e2b.Secret.get_info(info.secret_id).name == "openai-key"
    assert e2b.Secret.get_info("OPENAI-KEY").secret_id == info.secret_id  # by name, any case
    kept = e2b.Secret.update(info.secret_id, _value("crud2"))  # metadata left out: kept
    assert (kept.version, kept.metadata, kept.secret_id) == (2, {"env": "test"}, info.secret_id)
    assert kept.updated_at > info.updated_at and kept.created_at == info.created_at
    replaced = e2b.Secret.update("openai-key", _value("crud3"), metadata={"env": "prod"})
    assert (replaced.version, replaced.metadata) == (3, {"env": "prod"})
    with pytest.raises(e2b.SecretNotFoundException):
        e2b.Secret.update("missing", "value")
    with pytest.raises(e2b.SecretNotFoundException):
        e2b.Secret.get_info("missing")
    with pytest.raises(e2b.SecretException, match="exists already"):
        e2b.Secret.create("openai-key", "another")
    for bad in ("sec_taken", "a/b", "x{y}"):
        with pytest.raises(e2b.SecretException, match="name"):
            e2b.Secret.create(bad, "v")
    with pytest.raises(e2b.SecretException, match="CR, LF or NUL"):
        e2b.Secret.create("multiline", "a\nb")
    for n in "abc":
        e2b.Secret.create(f"page-{n}", "v")
    names: list[str] = []
    paginator = e2b.Secret.list(limit=2)
    pages = 0
    while paginator.has_next:
        names += [s.name for s in paginator.next_items()]
        pages += 1
    assert names[-3:] == ["page-a", "page-b", "page-c"] and pages >= 2 and "openai-key" in names
    assert e2b.Secret.exists("page-a") is True and e2b.Secret.exists("absent") is False
    assert e2b.Secret.destroy("page-a") is True and e2b.Secret.destroy("page-a") is False
    assert e2b.Secret.exists("page-a") is False
    for n in ("openai-key", "page-b", "page-c"):
        assert e2b.Secret.destroy(n)


def test_crud_through_our_sdk_sync_and_async(world: dict[str, ServerProcess]) -> None:
    api = world["server"].url
    info = Secret.create("ours", _value("ours"), metadata={"k": "v"}, api_url=api)
    assert (info.name, info.version, info.metadata) == ("ours", 1, {"k": "v"})
    assert Secret.update("ours", _value("ours2"), api_url=api).version == 2
    assert Secret.get_info(info.secret_id, api_url=api).version == 2
    assert [s.name for s in Secret.list(api_url=api)] == ["ours"]
    assert Secret.exists("ours", api_url=api) and not Secret.exists("nope", api_url=api)
    with pytest.raises(SecretNotFoundException):
        Secret.update("nope", "x", api_url=api)
    with pytest.raises(SecretException):
        Secret.create("ours", "again", api_url=api)
    with pytest.raises(InvalidArgumentException):
        Secret.fill("a{b")
    assert Secret.fill("ours") == AsyncSecret.fill("ours") == "${e2b.secrets.ours}"

    async def run() -> None:
        made = await AsyncSecret.create("ours-async", "v", api_url=api)
        assert (await AsyncSecret.update(made.secret_id, "w", metadata={"a": "b"}, api_url=api)).metadata == {"a": "b"}
        assert (await AsyncSecret.get_info("ours-async", api_url=api)).version == 2
        listed = [s.name async for s in AsyncSecret.list(limit=1, api_url=api)]
        assert listed == ["ours", "ours-async"]
        assert await AsyncSecret.exists("ours-async", api_url=api)
        assert await AsyncSecret.destroy("ours-async", api_url=api)
        assert not await AsyncSecret.destroy("ours-async", api_url=api)

    asyncio.run(run())
    assert Secret.destroy("ours", api_url=api)


# --- use by reference ------------------------------------------------------------------------------------


def test_a_rule_header_carries_the_value_host_side_and_the_version_current_at_create(url: str) -> None:
    import e2b

    v1, v2 = _value("rule1"), _value("rule2")
    e2b.Secret.create("rule-key", v1)
    rules = {"secret.test": [{"transform": {"headers": {"Authorization": f"Bearer {e2b.Secret.fill('rule-key')}"}}}]}
    first = e2b.Sandbox.create(network={"rules": rules}, timeout=300)
    try:
        first.commands.run("curl -sS --max-time 10 -o /dev/null https://secret.test/first")
        assert _internet_saw(f"Bearer {v1}")  # the host got the value ...
        env = first.commands.run("env").stdout
        assert v1 not in env and "e2b.secrets" not in env  # ... the sandbox has nothing of it
        info = httpx.get(f"{url}/sandboxes/{first.sandbox_id}", headers={"X-API-KEY": "e2b_test_key"}).text
        assert v1 not in info and "[redacted]" in info
        e2b.Secret.update("rule-key", v2)  # a sandbox keeps the version current at its create
        first.commands.run("curl -sS --max-time 10 -o /dev/null https://secret.test/first-again")
        second = e2b.Sandbox.create(network={"rules": rules}, timeout=300)
        try:
            second.commands.run("curl -sS --max-time 10 -o /dev/null https://secret.test/second")
            assert _head_of("/first-again", v1) and _head_of("/second", v2)
            assert e2b.Secret.destroy("rule-key")  # a running sandbox keeps it; a new create is refused
            first.commands.run("curl -sS --max-time 10 -o /dev/null https://secret.test/after-destroy")
            assert _head_of("/after-destroy", v1)
            with pytest.raises(e2b.SandboxException, match="secret 'rule-key' not found"):
                e2b.Sandbox.create(network={"rules": rules})
        finally:
            second.kill()
    finally:
        first.kill()


def test_an_agentcell_secret_from_the_vault_is_a_placeholder_in_the_sandbox(world: dict[str, ServerProcess]) -> None:
    api = world["server"].url
    value = _value("own")
    Secret.create("own-key", value, api_url=api)
    sbx = probed(Sandbox.create(api_url=api, timeout=300,
                                secrets={"API_KEY": {"value": Secret.fill("own-key"), "hosts": ["secret.test"]}}))
    try:
        placeholder = ask(sbx, "__import__('os').environ['API_KEY']")
        assert placeholder.startswith("agentcell-secret-api_key-") and value not in placeholder
        got = ask(sbx, "get_with('https://secret.test/v1/own', 'Bearer ' + __import__('os').environ['API_KEY'])")
        assert _internet_saw(f"Bearer {value}")
        assert value not in got and got.split("|")[0] == f"Bearer {placeholder}"  # the echo comes back redacted
        files = sbx.commands.run(f"grep -rlF '{value}' /etc /tmp /home /root /proc/self/environ 2>/dev/null; true")
        assert files.stdout.strip() == ""
    finally:
        sbx.kill()
        Secret.destroy("own-key", api_url=api)


def test_references_the_server_cannot_honour_are_refused_at_create(url: str) -> None:
    import e2b

    e2b.Secret.create("placed", _value("placed"))
    try:
        with pytest.raises(e2b.SandboxException, match="not found"):
            e2b.Sandbox.create(network={"rules": {"secret.test": [{"transform": {"headers": {
                "X-Key": e2b.Secret.fill("never-made")}}}]}})
        with pytest.raises(e2b.SandboxException, match="envVars"):  # the sandbox would see the placeholder
            e2b.Sandbox.create(envs={"KEY": e2b.Secret.fill("placed")})
        with pytest.raises(e2b.SandboxException, match="metadata"):
            e2b.Sandbox.create(metadata={"k": e2b.Secret.fill("placed")})
        r = httpx.post(f"{url}/sandboxes", json={"templateID": "base", "network": {"rules": {"secret.test": [
            {"transform": {"headers": {"X-Key": "${e2b.secrets.placed"}}}]}}}, headers={"X-API-KEY": "k"})
        assert r.status_code == 400 and "malformed" in r.json()["message"]
        assert e2b.Sandbox.list().next_items() == []  # none of them made a sandbox
    finally:
        e2b.Secret.destroy("placed")


# --- write-only, sealed, rotation, restart -----------------------------------------------------------------


def test_values_are_write_only_and_sealed_at_rest(world: dict[str, ServerProcess], state_dir: Path) -> None:
    server = world["server"]
    api = server.url
    value = _value("sealed")
    made = Secret.create("sealed-key", value, api_url=api)
    sbx = Sandbox.create(api_url=api, timeout=300, network={"rules": {"secret.test": [
        {"transform": {"headers": {"Authorization": f"Bearer {Secret.fill('sealed-key')}"}}}]}})
    try:
        sbx.commands.run("curl -sS --max-time 10 -o /dev/null https://secret.test/sealed; echo done")
        assert _internet_saw(value)
        client = server.http_client()
        answers = [client.get("/secrets").text, client.get(f"/secrets/{made.secret_id}").text,
                   client.get(f"/sandboxes/{sbx.sandbox_id}").text, client.get("/v2/sandboxes").text,
                   client.get(f"/sandboxes/{sbx.sandbox_id}/events").text,
                   client.get(f"/sandboxes/{sbx.sandbox_id}/report").text]
        snap = client.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={})
        assert snap.status_code == 201, snap.text
        answers.append(snap.text)
        for text in answers:
            assert value not in text
        assert _grep_tree(state_dir, value.encode()) == []  # the record, the snapshot, the vault file
        assert value not in server.log()  # the server's log and its access log
        vault = state_dir / "vault"
        assert stat.S_IMODE(vault.stat().st_mode) == 0o700
        for name in ("key", "secrets.json"):
            assert stat.S_IMODE((vault / name).stat().st_mode) == 0o600
        stored = json.loads((vault / "secrets.json").read_text())
        entry = next(e for e in stored["tenants"][""] if e["id"] == made.secret_id)
        assert set(entry["value"]) == {"key", "nonce", "sealed"} and value not in json.dumps(entry)
        client.delete(f"/templates/{snap.json()['snapshotID']}")
    finally:
        sbx.kill()
        Secret.destroy("sealed-key", api_url=api)


def test_rotation_and_restart_keep_every_value_usable(world: dict[str, ServerProcess], state_dir: Path) -> None:
    api = world["server"].url
    value = _value("rotated")
    Secret.create("rotated-key", value, api_url=api)
    vault = state_dir / "vault"
    before_key, before_file = (vault / "key").read_bytes(), (vault / "secrets.json").read_bytes()
    rotated = subprocess.run([sys.executable, "-m", "agentcell", "secrets", "rotate-key", "--state-dir",
                              str(state_dir)], capture_output=True, text=True, timeout=60)
    assert rotated.returncode == 0 and "1 value(s) sealed again" in rotated.stdout, rotated.stderr
    assert (vault / "key").read_bytes() != before_key and not (vault / "key.next").exists()
    assert (vault / "secrets.json").read_bytes() != before_file
    assert stat.S_IMODE((vault / "key").stat().st_mode) == 0o600
    server = _restart(world)  # the running server, then a new one on the same state dir, use the new key
    assert Secret.get_info("rotated-key", api_url=server.url).version == 1
    with Sandbox.create(api_url=server.url, timeout=300, network={"rules": {"secret.test": [
            {"transform": {"headers": {"X-Rotated": Secret.fill("rotated-key")}}}]}}) as sbx:
        sbx.commands.run("curl -sS --max-time 10 -o /dev/null https://secret.test/rotated")
    assert _internet_saw(value)
    assert Secret.destroy("rotated-key", api_url=server.url)


def test_a_rotation_cut_short_at_any_step_loses_nothing(tmp_path: Path) -> None:
    """The two crash points of a rotation (vault/keyring.py), made by hand on a real vault directory."""
    vault = Vault(str(tmp_path))
    made = vault.create("t", "name", "the-value-1", None)
    old = keyring.read_key(str(tmp_path / "key"))
    # 1. the next key written, the file not yet rewritten: the next open forgets the rotation
    keyring.write_key(str(tmp_path / "key.next"), keyring.new_key())
    assert vault.resolve("t", {"name"})["name"].value == "the-value-1"
    assert not (tmp_path / "key.next").exists() and keyring.read_key(str(tmp_path / "key")) == old
    # 2. the file rewritten under the next key, the key not yet renamed: the next open finishes it
    nxt = keyring.new_key()
    data = json.loads((tmp_path / "secrets.json").read_text())
    where = f"t\0{made.secret_id}\0{made.version}".encode()
    data["tenants"]["t"][0]["value"] = nxt.seal(old.open(data["tenants"]["t"][0]["value"], where), where)
    keyring.write_key(str(tmp_path / "key.next"), nxt)
    (tmp_path / "secrets.json").write_text(json.dumps(data))
    assert vault.resolve("t", {"name"})["name"].value == "the-value-1"
    assert keyring.read_key(str(tmp_path / "key")) == nxt and not (tmp_path / "key.next").exists()
    # a ciphertext moved to another secret's place does not open
    other = vault.create("t", "other", "the-value-2", None)
    data = json.loads((tmp_path / "secrets.json").read_text())
    data["tenants"]["t"][1]["value"] = data["tenants"]["t"][0]["value"]
    (tmp_path / "secrets.json").write_text(json.dumps(data))
    with pytest.raises(keyring.VaultKeyError, match="does not open"):
        vault.resolve("t", {other.name})
    # a key file others can read is refused
    os.chmod(tmp_path / "key", 0o644)
    with pytest.raises(keyring.VaultKeyError, match="chmod 600"):
        vault.resolve("t", {"name"})


# --- tenants and the gateway -----------------------------------------------------------------------------


def test_another_tenant_neither_sees_nor_uses_a_secret(tmp_path: Path) -> None:
    """A system service with its TCP listener: root on the socket and the API key's holders are two tenants."""
    key, port = "e2b_" + pysecrets.token_hex(16), free_port()
    sock = str(tmp_path / "agentcell.sock")
    server = ServerProcess(tmp_path / "system.log", "serve", "--system", "--socket-group", "root", "--uds", sock,
                           "--system-tcp", "--host", "127.0.0.1", "--port", str(port), "--api-key", key,
                           "--egress-uplink", "none", "--standbys", "0", "--state-dir", str(tmp_path / "state"),
                           command=(sys.executable, "-m", "agentcell"), uds=sock, address_args=False,
                           ready_status=200)
    with server:
        keyed = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"X-API-KEY": key}, timeout=30)
        root = server.http_client()
        value = _value("tenant")
        made = keyed.post("/secrets", json={"name": "mine", "value": value}).json()
        assert root.get("/secrets").json() == []  # root (the administrator) has a vault of its own
        assert root.get(f"/secrets/{made['secretID']}").status_code == 404
        assert root.get("/secrets/mine").status_code == 404
        assert root.post("/secrets/mine", json={"value": "x"}).status_code == 404
        assert root.delete(f"/secrets/{made['secretID']}").status_code == 404
        body = {"templateID": "base", "network": {"rules": {"api.test": [
            {"transform": {"headers": {"X-Key": "${e2b.secrets.mine}"}}}]}}}
        refused = root.post("/sandboxes", json=body)
        assert refused.status_code == 400 and "secret 'mine' not found" in refused.json()["message"]
        # its owner's reference resolves (and then meets this server's lack of an uplink)
        own = keyed.post("/sandboxes", json=body)
        assert own.status_code == 400 and "egress proxy" in own.json()["message"]
        assert root.post("/secrets", json={"name": "mine", "value": "roots"}).status_code == 201  # names are per tenant
        assert keyed.get("/secrets/mine").json()["secretID"] == made["secretID"]
        assert value not in server.log()


def test_a_gateway_keeps_the_vault_on_one_cell(tmp_path: Path) -> None:
    cells = [ServerProcess(tmp_path / f"cell{i}.log", "--cell-id", cid, "--egress-uplink", "none", "--standbys", "0",
                           "--state-dir", str(tmp_path / f"state{i}")) for i, cid in enumerate(("cellvlta", "cellvltb"))]
    for cell in cells:
        cell.started()
    try:
        with GatewayProcess(tmp_path / "gateway.log", [c.url for c in cells]) as gateway:
            made = Secret.create("gw", _value("gw"), api_url=gateway.url)
            for _ in range(4):
                assert Secret.get_info("gw", api_url=gateway.url).secret_id == made.secret_id
            holders = [i for i in range(2) if (tmp_path / f"state{i}" / "vault" / "secrets.json").exists()]
            assert holders == [0]  # the cell of the lowest id
            body = {"templateID": "base", "network": {"rules": {"api.test": [
                {"transform": {"headers": {"X-Key": Secret.fill("gw")}}}]}}}
            for _ in range(4):  # always the vault's cell: it resolves (then has no uplink)
                r = httpx.post(f"{gateway.url}/sandboxes", json=body, timeout=30)
                assert r.status_code == 400 and "egress proxy" in r.json()["message"], r.text
            assert Secret.destroy("gw", api_url=gateway.url)
    finally:
        for cell in cells:
            cell.stop()
