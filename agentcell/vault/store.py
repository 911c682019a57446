"""The secrets vault: E2B's Secret API's secrets, per tenant, their values sealed at rest (keyring.py).

Layout of `<state dir>/vault/` (0700): `key` (0600, keyring.py), `secrets.json` (0600: names, ids,
metadata, versions, times, and each value sealed), `lock` (flock). Every operation takes the lock,
reads the file, and writes it back whole (a temporary file, fsynced, renamed over it), so the server
and `agentcell secrets rotate-key` can run at once and a crash leaves the old file or the new one.

Values are write-only: nothing here returns one but `resolve`, which only the create path calls (to
hand the egress proxy the values a sandbox's references name). A secret keeps its current value only:
an update seals the new one in place of the old (the version counts updates).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agentcell import durable
from agentcell.vault import keyring
from agentcell.vault.keyring import Keyring, VaultKeyError

STORE_FILE = "secrets.json"
LOCK_FILE = "lock"
MAX_SECRETS = 1000  # per tenant
MAX_NAME = 128
MAX_VALUE = 8 << 10
MAX_METADATA_ENTRIES, MAX_METADATA_KEY, MAX_METADATA_VALUE, MAX_METADATA = 32, 128, 1024, 8192
ID_PREFIX = "sec_"
# E2B's rule for names (the SDK's _validate_secret_name), and '/' (a name is a path segment of the API)
_BAD_NAME = re.compile(r"[{}/\x00-\x1f\x7f-\x9f]")
_ID = re.compile(r"^sec_[0-9a-f]{32}$")


class VaultError(ValueError):
    """A request the vault refuses (400); the message says why and never holds a value."""


class SecretNotFound(LookupError):
    def __init__(self, ref: str) -> None:
        super().__init__(f"secret '{ref[:MAX_NAME]}' not found")


class SecretExists(VaultError):
    pass


@dataclass(frozen=True)
class SecretInfo:
    """What a read may show of a secret: never its value."""

    secret_id: str
    name: str
    version: int
    metadata: dict[str, str]
    created_at: str
    updated_at: str

    def to_json(self) -> dict[str, Any]:
        return {"secretID": self.secret_id, "name": self.name, "currentVersion": self.version,
                "metadata": dict(self.metadata), "createdAt": self.created_at, "updatedAt": self.updated_at}


@dataclass(frozen=True)
class Resolved:
    name: str
    version: int
    value: str


def canonical_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME or _BAD_NAME.search(name) \
            or name != name.strip():
        raise VaultError(f"'name' must be a string of 1 to {MAX_NAME} characters without '{{', '}}', '/', control "
                         "characters or surrounding spaces (it goes in the '${e2b.secrets.<name>}' placeholder)")
    name = name.lower()
    if name.startswith(ID_PREFIX):
        raise VaultError(f"a secret name cannot start with '{ID_PREFIX}' (that prefix is secret ids')")
    return name


def checked_value(value: Any) -> str:
    """A value the egress proxy can put in a header. The message never quotes it."""
    if not isinstance(value, str) or not 1 <= len(value.encode()) <= MAX_VALUE:
        raise VaultError(f"'value' must be a string of 1 to {MAX_VALUE} bytes")
    if any(c in value for c in "\r\n\0"):
        raise VaultError("'value' must not contain CR, LF or NUL (the egress proxy puts it in a header)")
    return value


def checked_metadata(metadata: Any) -> dict[str, str]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise VaultError("'metadata' must be an object of string values")
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise VaultError(f"'metadata' has {len(metadata)} entries, at most {MAX_METADATA_ENTRIES}")
    for k, v in metadata.items():
        if not k or len(k.encode()) > MAX_METADATA_KEY or len(v.encode()) > MAX_METADATA_VALUE:
            raise VaultError(f"'metadata' keys are 1 to {MAX_METADATA_KEY} bytes, values at most {MAX_METADATA_VALUE}")
    if sum(len(k.encode()) + len(v.encode()) for k, v in metadata.items()) > MAX_METADATA:
        raise VaultError(f"'metadata' is larger than {MAX_METADATA} bytes in all")
    return dict(metadata)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _where(tenant: str, secret_id: str, version: int) -> bytes:
    return f"{tenant}\0{secret_id}\0{version}".encode()


def _info(entry: dict[str, Any]) -> SecretInfo:
    return SecretInfo(entry["id"], entry["name"], entry["version"], dict(entry["metadata"]), entry["created"],
                      entry["updated"])


class Vault:
    def __init__(self, directory: str) -> None:
        self.directory = directory

    # --- the file, under the lock ----------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self, create: bool = True) -> Iterator[tuple[dict[str, Any], Keyring | None]]:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(self.directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = self._read()
            ring = keyring.load(self.directory, create)
            if ring is not None:
                ring = self._settle(data, ring)
            yield data, ring
        finally:
            os.close(fd)

    def _read(self) -> dict[str, Any]:
        path = os.path.join(self.directory, STORE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {"format": 1, "tenants": {}}
        if not isinstance(data, dict) or data.get("format") != 1:
            raise VaultKeyError(f"{path} is not an agentcell vault file (format 1)")
        return data

    def _write(self, data: dict[str, Any]) -> None:
        path = os.path.join(self.directory, STORE_FILE)
        tmp = f"{path}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, separators=(",", ":"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        durable.fsync_dir(Path(self.directory))

    def _settle(self, data: dict[str, Any], ring: Keyring) -> Keyring:
        """Finish or forget a rotation a crash cut short (keyring.py): the file decides which."""
        nxt = os.path.join(self.directory, keyring.NEXT_KEY_FILE)
        pending = [k for k in ring.keys.values() if k.key_id != ring.current.key_id]
        if not pending:
            return ring
        used = {e["value"]["key"] for entries in data["tenants"].values() for e in entries}
        if pending[0].key_id in used:  # the file was rewritten under the next key: make it the key
            os.replace(nxt, os.path.join(self.directory, keyring.KEY_FILE))
            durable.fsync_dir(Path(self.directory))
            return Keyring(pending[0], {pending[0].key_id: pending[0]})
        os.unlink(nxt)  # the file still uses the old key: the rotation never happened
        durable.fsync_dir(Path(self.directory))
        return Keyring(ring.current, {ring.current.key_id: ring.current})

    @staticmethod
    def _find(entries: list[dict[str, Any]], ref: str) -> dict[str, Any]:
        wanted = ref.lower()
        for e in entries:
            if e["id"] == ref or e["name"] == wanted:
                return e
        raise SecretNotFound(ref)

    # --- E2B's operations ---------------------------------------------------------------------------

    def create(self, tenant: str, name: Any, value: Any, metadata: Any) -> SecretInfo:
        name, value, metadata = canonical_name(name), checked_value(value), checked_metadata(metadata)
        with self._locked() as (data, ring):
            assert ring is not None
            entries = data["tenants"].setdefault(tenant, [])
            if any(e["name"] == name for e in entries):
                raise SecretExists(f"a secret named '{name}' exists already: update it (Secret.update) or pick "
                                   "another name")
            if len(entries) >= MAX_SECRETS:
                raise VaultError(f"you have {MAX_SECRETS} secrets, the most this server keeps per tenant: destroy one")
            secret_id, now = ID_PREFIX + secrets.token_hex(16), _now()
            entry = {"id": secret_id, "name": name, "metadata": metadata, "created": now, "updated": now,
                     "version": 1, "value": ring.current.seal(value.encode(), _where(tenant, secret_id, 1))}
            entries.append(entry)
            self._write(data)
            return _info(entry)

    def update(self, tenant: str, ref: str, value: Any, metadata: Any) -> SecretInfo:
        value = checked_value(value)
        kept = metadata is None
        metadata = checked_metadata(metadata)
        with self._locked() as (data, ring):
            assert ring is not None
            entry = self._find(data["tenants"].get(tenant, []), ref)
            version = entry["version"] + 1
            entry.update(version=version, updated=_now(),
                         value=ring.current.seal(value.encode(), _where(tenant, entry["id"], version)))
            if not kept:
                entry["metadata"] = metadata
            self._write(data)
            return _info(entry)

    def info(self, tenant: str, ref: str) -> SecretInfo:
        with self._locked(create=False) as (data, _):
            return _info(self._find(data["tenants"].get(tenant, []), ref))

    def list(self, tenant: str) -> list[SecretInfo]:
        with self._locked(create=False) as (data, _):
            return [_info(e) for e in data["tenants"].get(tenant, [])]

    def destroy(self, tenant: str, ref: str) -> bool:
        with self._locked(create=False) as (data, _):
            entries = data["tenants"].get(tenant, [])
            try:
                entry = self._find(entries, ref)
            except SecretNotFound:
                return False
            entries.remove(entry)
            if not entries:
                del data["tenants"][tenant]
            self._write(data)
            return True

    # --- use and upkeep -----------------------------------------------------------------------------

    def resolve(self, tenant: str, refs: set[str]) -> dict[str, Resolved]:
        """The current values of the secrets `refs` name (ids or names), keyed by ref; SecretNotFound
        for the first missing one. The only way a value leaves the vault: to the egress proxy."""
        if not refs:
            return {}
        with self._locked(create=False) as (data, ring):
            entries = data["tenants"].get(tenant, [])
            out = {}
            for ref in sorted(refs):
                entry = self._find(entries, ref)
                if ring is None:
                    raise VaultKeyError("the vault's key file is missing while it holds secrets")
                value = ring.open(entry["value"], _where(tenant, entry["id"], entry["version"])).decode()
                out[ref] = Resolved(entry["name"], entry["version"], value)
            return out

    def rotate_key(self) -> int:
        """Seal every value under a new key (keyring.py's order, safe against a crash at any step); how
        many values were sealed again."""
        with self._locked() as (data, ring):
            assert ring is not None
            nxt = keyring.new_key()
            keyring.write_key(os.path.join(self.directory, keyring.NEXT_KEY_FILE), nxt)
            count = 0
            for tenant, entries in data["tenants"].items():
                for e in entries:
                    where = _where(tenant, e["id"], e["version"])
                    e["value"] = nxt.seal(ring.open(e["value"], where), where)
                    count += 1
            if count:
                self._write(data)
            os.replace(os.path.join(self.directory, keyring.NEXT_KEY_FILE),
                       os.path.join(self.directory, keyring.KEY_FILE))
            durable.fsync_dir(Path(self.directory))
            return count

    def key_id(self) -> str | None:
        with self._locked(create=False) as (_, ring):
            return None if ring is None else ring.current.key_id
