"""The vault's encryption key: AES-256-GCM (`cryptography`), one key file per vault directory.

`<vault dir>/key` holds one line, `agentcell-vault-key v1 <key id> <base64 key>`, mode 0600, made on
first use. A rotation (store.rotate_key) writes the next key to `key.next` first, re-encrypts every
value under it, then renames `key.next` over `key`: while both files exist both keys are loaded, and
every stored value names the key it was sealed with, so a crash at any step leaves every value readable
(the next open finishes or forgets the unfinished rotation: `settle`).

Each value is sealed with a fresh 96-bit nonce and, as associated data, where it belongs (tenant,
secret id, version): a ciphertext copied to another secret's place does not open.
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from agentcell import durable

KEY_FILE = "key"
NEXT_KEY_FILE = "key.next"
_MAGIC = "agentcell-vault-key"
_FORMAT = "v1"


class VaultKeyError(RuntimeError):
    """The vault's key file is missing, unreadable or does not open a stored value; the message says which."""


@dataclass(frozen=True)
class Key:
    key_id: str
    material: bytes = field(repr=False)

    def seal(self, plaintext: bytes, where: bytes) -> dict[str, str]:
        nonce = secrets.token_bytes(12)
        sealed = AESGCM(self.material).encrypt(nonce, plaintext, where)
        return {"key": self.key_id, "nonce": _b64(nonce), "sealed": _b64(sealed)}

    def open(self, box: dict[str, str], where: bytes) -> bytes:
        try:
            return AESGCM(self.material).decrypt(base64.b64decode(box["nonce"]), base64.b64decode(box["sealed"]), where)
        except (InvalidTag, KeyError, ValueError):
            raise VaultKeyError(f"a stored value does not open with key {self.key_id}: the vault file was altered "
                                "or copied from another secret's place") from None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def new_key() -> Key:
    return Key("k" + secrets.token_hex(6), AESGCM.generate_key(bit_length=256))


def write_key(path: str, key: Key) -> None:
    """Write `key` to `path` (0600, created exclusively, fsynced with its directory)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, f"{_MAGIC} {_FORMAT} {key.key_id} {_b64(key.material)}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    durable.fsync_dir(Path(os.path.dirname(path)))


def read_key(path: str) -> Key:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as e:
        raise VaultKeyError(f"cannot read the vault key {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_mode & 0o077:
            raise VaultKeyError(f"the vault key {path} is readable by others than its owner: chmod 600 it")
        parts = f.read(4096).decode("ascii", "replace").split()
    if len(parts) != 4 or parts[0] != _MAGIC or parts[1] != _FORMAT:
        raise VaultKeyError(f"{path} is not an agentcell vault key (expected '{_MAGIC} {_FORMAT} ID KEY')")
    try:
        material = base64.b64decode(parts[3], validate=True)
    except ValueError:
        raise VaultKeyError(f"{path}: the key is not Base64") from None
    if len(material) != 32:
        raise VaultKeyError(f"{path}: the key is {len(material)} bytes, not 32")
    return Key(parts[2], material)


@dataclass
class Keyring:
    """The current key (what new values are sealed with) and every key a stored value may name."""

    current: Key
    keys: dict[str, Key]

    def open(self, box: dict[str, str], where: bytes) -> bytes:
        key = self.keys.get(box.get("key", ""))
        if key is None:
            raise VaultKeyError(f"a stored value names key {box.get('key')!r}, which no key file holds: was the "
                                "vault's key file replaced?")
        return key.open(box, where)


def load(directory: str, create: bool) -> Keyring | None:
    """The keyring of the vault in `directory`; a new key when it has none and `create` (else None)."""
    path = os.path.join(directory, KEY_FILE)
    if not os.path.exists(path):
        if not create:
            return None
        with contextlib.suppress(FileExistsError):
            write_key(path, new_key())
    current = read_key(path)
    keys = {current.key_id: current}
    nxt = os.path.join(directory, NEXT_KEY_FILE)
    if os.path.exists(nxt):  # a rotation under way or cut short: its values may be sealed with either
        pending = read_key(nxt)
        keys[pending.key_id] = pending
    return Keyring(current, keys)
