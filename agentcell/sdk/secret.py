"""The secrets vault (E2B's `Secret` / `AsyncSecret`): create, update (a new version), get_info, list,
exists, destroy, and `fill`, the `${e2b.secrets.<name>}` placeholder a create may use in a header of
`network.rules` or as an agentcell secret's value (docs/secrets.md). Values are write-only: no call
returns one."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from agentcell.errors import (
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
    SecretException,
    SecretNotFoundException,
)
from agentcell.sdk import api
from agentcell.sdk.config import ConnectionConfig, aresolve, resolve

_INVALID_NAME = re.compile(r"[{}\x00-\x1f\x7f-\x9f]")  # as e2b's _validate_secret_name


@dataclass(frozen=True)
class SecretInfo:
    """A secret's metadata (e2b.SecretInfo); never its value."""

    secret_id: str
    name: str
    version: int
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: datetime | None = None
    updated_at: datetime | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SecretInfo:
        def when(key: str) -> datetime | None:
            raw = d.get(key)
            return datetime.fromisoformat(raw.replace("Z", "+00:00")) if isinstance(raw, str) else None

        return cls(d["secretID"], d["name"], int(d["currentVersion"]), dict(d.get("metadata") or {}),
                   when("createdAt"), when("updatedAt"))


def _path(secret: str) -> str:
    return "/secrets/" + urllib.parse.quote(secret, safe="")


def _body(value: str, metadata: dict[str, str] | None, name: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"name": name} if name is not None else {}
    body["value"] = value
    if metadata is not None:
        body["metadata"] = dict(metadata)
    return body


def _secret_error(e: SandboxException, secret: str | None = None) -> SandboxException:
    if isinstance(e, NotFoundException) and secret is not None:
        return SecretNotFoundException(f"secret {secret} not found")
    if isinstance(e, InvalidArgumentException):
        return e
    return SecretException(str(e))


class _SecretBase:
    @staticmethod
    def fill(secret: str) -> str:
        """`${e2b.secrets.<secret>}`: the placeholder the server puts the secret's value in for (no call
        is made; a missing secret is a 400 at the create that uses it)."""
        if not isinstance(secret, str) or not secret or _INVALID_NAME.search(secret):
            raise InvalidArgumentException(
                f"secret name {secret!r} is not usable: a secret name must be a non-empty string and cannot contain "
                "'{', '}' or control characters, because it is interpolated into the '${e2b.secrets.<name>}' "
                "placeholder")
        return f"${{e2b.secrets.{secret}}}"


class SecretPaginator:
    """Pages of Secret.list(): `while p.has_next: p.next_items()`; iterating it walks every page."""

    def __init__(self, config: ConnectionConfig, limit: int | None, next_token: str | None) -> None:
        self._config = config
        self.limit = limit
        self.next_token = next_token
        self.has_next = True

    def next_items(self) -> list[SecretInfo]:
        if not self.has_next:
            raise StopIteration("no more secrets to list")
        params = {k: v for k, v in (("limit", str(self.limit) if self.limit else None),
                                    ("nextToken", self.next_token)) if v}
        try:
            r = api.call(self._config, "GET", "/secrets", params=params)
        except SandboxException as e:
            raise _secret_error(e) from None
        self.next_token = r.headers.get("x-next-token") or None
        self.has_next = self.next_token is not None
        return [SecretInfo.from_json(d) for d in r.json()]

    def __iter__(self) -> Iterator[SecretInfo]:
        while self.has_next:
            yield from self.next_items()


class Secret(_SecretBase):
    """The caller's secrets on the server (e2b.Secret). Values go in, never come out."""

    @staticmethod
    def create(name: str, value: str, metadata: dict[str, str] | None = None, api_key: str | None = None,
               api_url: str | None = None, request_timeout: float | None = None) -> SecretInfo:
        """A new secret (version 1). Names are stored lower-cased."""
        try:
            r = api.call(resolve(api_url, api_key, request_timeout), "POST", "/secrets",
                         json=_body(value, metadata, name), ok=(201, 200))
        except SandboxException as e:
            raise _secret_error(e) from None
        return SecretInfo.from_json(r.json())

    @staticmethod
    def update(secret: str, value: str, metadata: dict[str, str] | None = None, api_key: str | None = None,
               api_url: str | None = None, request_timeout: float | None = None) -> SecretInfo:
        """Store `value` as the secret's next version (`metadata`, when given, replaces the stored one)."""
        try:
            r = api.call(resolve(api_url, api_key, request_timeout), "POST", _path(secret), json=_body(value, metadata))
        except SandboxException as e:
            raise _secret_error(e, secret) from None
        return SecretInfo.from_json(r.json())

    @staticmethod
    def get_info(secret: str, api_key: str | None = None, api_url: str | None = None,
                 request_timeout: float | None = None) -> SecretInfo:
        """The secret's id, name, version, metadata and times (by id or name)."""
        try:
            r = api.call(resolve(api_url, api_key, request_timeout), "GET", _path(secret))
        except SandboxException as e:
            raise _secret_error(e, secret) from None
        return SecretInfo.from_json(r.json())

    @staticmethod
    def list(limit: int | None = None, next_token: str | None = None, api_key: str | None = None,
             api_url: str | None = None, request_timeout: float | None = None) -> SecretPaginator:
        """The caller's secrets, oldest first, in pages."""
        return SecretPaginator(resolve(api_url, api_key, request_timeout), limit, next_token)

    @staticmethod
    def exists(secret: str, api_key: str | None = None, api_url: str | None = None,
               request_timeout: float | None = None) -> bool:
        try:
            Secret.get_info(secret, api_key, api_url, request_timeout)
        except SecretNotFoundException:
            return False
        return True

    @staticmethod
    def destroy(secret: str, api_key: str | None = None, api_url: str | None = None,
                request_timeout: float | None = None) -> bool:
        """Remove the secret; False if there was none. Running sandboxes keep the value they were created with."""
        try:
            r = api.call(resolve(api_url, api_key, request_timeout), "DELETE", _path(secret), ok=(204, 200, 404))
        except SandboxException as e:
            raise _secret_error(e, secret) from None
        return r.status_code != 404


class AsyncSecretPaginator:
    """Pages of AsyncSecret.list(): `while p.has_next: await p.next_items()`; `async for` walks every page."""

    def __init__(self, config: tuple[str | None, str | None, float | None], limit: int | None,
                 next_token: str | None) -> None:
        self._config: ConnectionConfig | tuple[str | None, str | None, float | None] = config
        self.limit = limit
        self.next_token = next_token
        self.has_next = True

    async def next_items(self) -> list[SecretInfo]:
        if not self.has_next:
            raise StopIteration("no more secrets to list")
        if isinstance(self._config, tuple):
            self._config = await aresolve(*self._config)
        params = {k: v for k, v in (("limit", str(self.limit) if self.limit else None),
                                    ("nextToken", self.next_token)) if v}
        try:
            r = await api.acall(self._config, "GET", "/secrets", params=params)
        except SandboxException as e:
            raise _secret_error(e) from None
        self.next_token = r.headers.get("x-next-token") or None
        self.has_next = self.next_token is not None
        return [SecretInfo.from_json(d) for d in r.json()]

    async def __aiter__(self) -> AsyncIterator[SecretInfo]:
        while self.has_next:
            for item in await self.next_items():
                yield item


class AsyncSecret(_SecretBase):
    """Secret for async code (e2b.AsyncSecret)."""

    @staticmethod
    async def create(name: str, value: str, metadata: dict[str, str] | None = None, api_key: str | None = None,
                     api_url: str | None = None, request_timeout: float | None = None) -> SecretInfo:
        try:
            r = await api.acall(await aresolve(api_url, api_key, request_timeout), "POST", "/secrets",
                                json=_body(value, metadata, name), ok=(201, 200))
        except SandboxException as e:
            raise _secret_error(e) from None
        return SecretInfo.from_json(r.json())

    @staticmethod
    async def update(secret: str, value: str, metadata: dict[str, str] | None = None, api_key: str | None = None,
                     api_url: str | None = None, request_timeout: float | None = None) -> SecretInfo:
        try:
            r = await api.acall(await aresolve(api_url, api_key, request_timeout), "POST", _path(secret),
                                json=_body(value, metadata))
        except SandboxException as e:
            raise _secret_error(e, secret) from None
        return SecretInfo.from_json(r.json())

    @staticmethod
    async def get_info(secret: str, api_key: str | None = None, api_url: str | None = None,
                       request_timeout: float | None = None) -> SecretInfo:
        try:
            r = await api.acall(await aresolve(api_url, api_key, request_timeout), "GET", _path(secret))
        except SandboxException as e:
            raise _secret_error(e, secret) from None
        return SecretInfo.from_json(r.json())

    @staticmethod
    def list(limit: int | None = None, next_token: str | None = None, api_key: str | None = None,
             api_url: str | None = None, request_timeout: float | None = None) -> AsyncSecretPaginator:
        return AsyncSecretPaginator((api_url, api_key, request_timeout), limit, next_token)

    @staticmethod
    async def exists(secret: str, api_key: str | None = None, api_url: str | None = None,
                     request_timeout: float | None = None) -> bool:
        try:
            await AsyncSecret.get_info(secret, api_key, api_url, request_timeout)
        except SecretNotFoundException:
            return False
        return True

    @staticmethod
    async def destroy(secret: str, api_key: str | None = None, api_url: str | None = None,
                      request_timeout: float | None = None) -> bool:
        try:
            r = await api.acall(await aresolve(api_url, api_key, request_timeout), "DELETE", _path(secret),
                                ok=(204, 200, 404))
        except SandboxException as e:
            raise _secret_error(e, secret) from None
        return r.status_code != 404
