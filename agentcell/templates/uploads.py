"""The files of a template's COPY steps, uploaded by the SDK under their hash, and the upload links.

E2B's flow: GET /templates/{id}/files/{hash} answers {"present", "url"}; the SDK PUTs a tar(.gz) of
the files to `url` unless they are present (or the step forces the upload). The URL here is the
server's own: /template-files/<token>, where the token (32 random bytes, base64url) is the only
credential (the SDK sends no API key to an upload URL, as to S3's), names one template's one hash,
and expires after `ttl_s`. An upload is bounded (`max_bytes`: the Content-Length first, then the
bytes as they come), written to a temporary file and renamed into place when whole.

    <root>/<template id>/<hash>      one upload (the executor unpacks it for a COPY step)
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass

from agentcell.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError

PATH_PREFIX = "/template-files/"
DEFAULT_TTL_S = 3600.0
_HASH = re.compile(r"[0-9a-f]{16,128}")
_TEMPLATE = re.compile(r"[a-z0-9]{1,64}")
MAX_TOKENS = 10_000


@dataclass(frozen=True)
class _Grant:
    template_id: str
    files_hash: str
    expires: float


class UploadStore:
    def __init__(self, root: str, max_bytes: int, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._grants: dict[str, _Grant] = {}
        os.makedirs(root, mode=0o700, exist_ok=True)
        os.chmod(root, 0o700)

    def _path(self, template_id: str, files_hash: str) -> str:
        if not _TEMPLATE.fullmatch(template_id):
            raise InvalidArgumentError(f"template id {template_id!r} is not one of this server's")
        if not _HASH.fullmatch(files_hash):
            raise InvalidArgumentError(f"files hash {files_hash!r}: 16-128 hex digits")
        return os.path.join(self.root, template_id, files_hash)

    def present(self, template_id: str, files_hash: str) -> bool:
        return os.path.isfile(self._path(template_id, files_hash.lower()))

    def path(self, template_id: str, files_hash: str) -> str | None:
        p = self._path(template_id, files_hash.lower())
        return p if os.path.isfile(p) else None

    def grant(self, template_id: str, files_hash: str) -> str:
        """A new upload token for the template's files of this hash."""
        self._path(template_id, files_hash.lower())
        now = time.monotonic()
        if len(self._grants) >= MAX_TOKENS:
            self._grants = {k: g for k, g in self._grants.items() if g.expires > now}
            if len(self._grants) >= MAX_TOKENS:
                raise ResourceExhaustedError("too many upload links are open on this server: try again later")
        token = secrets.token_urlsafe(32)
        self._grants[token] = _Grant(template_id, files_hash.lower(), now + self.ttl_s)
        return token

    def claim(self, token: str) -> _Grant:
        grant = self._grants.get(token)
        if grant is None or grant.expires < time.monotonic():
            self._grants.pop(token, None)
            raise NotFoundError("this upload link is not valid (unknown or expired): ask for a new one")
        return grant

    def spent(self, token: str) -> None:
        self._grants.pop(token, None)

    def begin(self, grant: _Grant) -> str:
        """A temporary file for an upload (renamed by finish())."""
        d = os.path.join(self.root, grant.template_id)
        os.makedirs(d, mode=0o700, exist_ok=True)
        return os.path.join(d, f".{grant.files_hash}.{secrets.token_hex(8)}.part")

    def finish(self, grant: _Grant, part: str) -> None:
        os.replace(part, self._path(grant.template_id, grant.files_hash))

    def forget(self, template_id: str) -> None:
        """The template's uploads, with it."""
        with contextlib.suppress(InvalidArgumentError):
            self._path(template_id, "0" * 16)
            shutil.rmtree(os.path.join(self.root, template_id), ignore_errors=True)
        self._grants = {k: g for k, g in self._grants.items() if g.template_id != template_id}
