"""`AsyncSandbox`: the asyncio SDK entry point, mirroring e2b / e2b-code-interpreter's AsyncSandbox."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import datetime
from typing import Any

from agentcell.errors import SandboxException
from agentcell.sdk import api, fast_async_http
from agentcell.sdk.approvals import AsyncApprovals
from agentcell.sdk.code_async import AsyncCodeInterpreter
from agentcell.sdk.commands_async import AsyncCommands
from agentcell.sdk.config import ConnectionConfig, SandboxConnection, aresolve
from agentcell.sdk.files_async import AsyncFilesystem
from agentcell.sdk.methods import hybrid
from agentcell.sdk.models import Context, Execution, SandboxInfo, SandboxMetrics, SandboxQuery, SnapshotInfo
from agentcell.sdk.pty import AsyncPty
from agentcell.sdk.sandbox_base import ConnectedSandbox
from agentcell.sdk.transport import error_from_http
from agentcell.sdk.volume import mounts_body


class AsyncSandboxPaginator:
    """Pages of AsyncSandbox.list(): `while p.has_next: await p.next_items()`; `async for` walks every page."""

    def __init__(self, resolve_args: tuple[str | None, str | None, float | None], query: SandboxQuery | None,
                 limit: int | None, next_token: str | None, order: str | None = None) -> None:
        self._order = order
        self._resolve_args = resolve_args
        self._config: ConnectionConfig | None = None
        self._query = query or SandboxQuery()
        self._limit = limit
        self.next_token = next_token
        self.has_next = True

    async def next_items(self) -> list[SandboxInfo]:
        if not self.has_next:
            raise StopIteration("no more sandboxes to list")
        if self._config is None:
            self._config = await aresolve(*self._resolve_args)
        params = api.list_params(self._query.metadata, self._query.state, self._limit, self.next_token,
                                 self._order)
        r = await api.acall(self._config, "GET", "/v2/sandboxes", params=params)
        self.next_token = r.headers.get("x-next-token") or None
        self.has_next = self.next_token is not None
        return [SandboxInfo.from_json(d) for d in r.json()]

    async def __aiter__(self) -> AsyncIterator[SandboxInfo]:
        while self.has_next:
            for item in await self.next_items():
                yield item


class AsyncSnapshotPaginator:
    """Pages of list_snapshots(): `while p.has_next: await p.next_items()`; `async for` walks every page."""

    def __init__(self, config: ConnectionConfig | tuple[str | None, str | None, float | None],
                 params: dict[str, str]) -> None:
        self._config = config
        self._params = params
        self.next_token: str | None = params.get("nextToken")
        self.has_next = True

    async def next_items(self) -> list[SnapshotInfo]:
        if not self.has_next:
            raise StopIteration("no more snapshots to list")
        if isinstance(self._config, tuple):
            self._config = await aresolve(*self._config)
        params = {**self._params, **({"nextToken": self.next_token} if self.next_token else {})}
        r = await api.acall(self._config, "GET", "/snapshots", params=params)
        self.next_token = r.headers.get("x-next-token") or None
        self.has_next = self.next_token is not None
        return [SnapshotInfo.from_json(d) for d in r.json()]

    async def __aiter__(self) -> AsyncIterator[SnapshotInfo]:
        while self.has_next:
            for item in await self.next_items():
                yield item


class AsyncSandbox(ConnectedSandbox):
    """A sandbox: run_code, commands, files. Create with `await AsyncSandbox.create()`; `async with` kills it."""

    def __init__(self, conn: SandboxConnection) -> None:
        self._conn = conn
        self._files = AsyncFilesystem(conn)
        self._commands = AsyncCommands(conn)
        self._pty = AsyncPty(self._commands)
        self._code = AsyncCodeInterpreter(conn)
        self._approvals = AsyncApprovals(conn)

    @property
    def approvals(self) -> AsyncApprovals:
        """agentcell extension: operations the sandbox's "ask" policy holds (list, allow, deny, on_approval)."""
        return self._approvals

    @property
    def files(self) -> AsyncFilesystem:
        return self._files

    @property
    def commands(self) -> AsyncCommands:
        return self._commands

    @property
    def pty(self) -> AsyncPty:
        return self._pty

    # --- lifecycle --------------------------------------------------------------------------------

    @classmethod
    async def create(cls, template: str = "base", timeout: int | None = 300, metadata: dict[str, str] | None = None,
               envs: dict[str, str] | None = None, api_key: str | None = None, api_url: str | None = None,
               request_timeout: float | None = None, limits: dict[str, Any] | None = None,
               allow_internet_access: bool | None = None, network: Mapping[str, Any] | None = None,
               secrets: Mapping[str, Mapping[str, Any]] | None = None, secure: bool | None = None,
               idempotency_key: str | None = None, lifecycle: Mapping[str, Any] | None = None,
               policy: Mapping[str, Any] | None = None,
               volume_mounts: Mapping[str, Any] | None = None) -> AsyncSandbox:
        """Create a sandbox living `timeout` seconds (extend with set_timeout). Without api_url or
        AGENTCELL_URL an embedded local server is started for this process.

        `allow_internet_access` (default: the server's, ``--internet-default``) and `network` (e2b's
        ``allow_out``/``deny_out``: CIDRs, IPs, domains, ``*.`` wildcards; ``allow_public_traffic``) set
        what the sandbox may reach: only the public internet ever, and within it what the lists allow.

        `policy` (agentcell extension): what its code may run, touch and reach, and what waits for a
        decision (Sandbox.create says more); ``set_policy()`` changes it, ``approvals`` answers "ask"."""
        config = await aresolve(api_url, api_key, request_timeout)
        body = api.create_body(template, timeout, metadata, envs, limits, allow_internet_access, network, secrets,
                               secure)
        body.update(api.lifecycle_body(lifecycle))  # e2b's lifecycle: on_timeout "pause", auto_resume
        if policy is not None:
            body["policy"] = dict(policy)
        if volume_mounts:  # {path: AsyncVolume or name}; agentcell: {"volume": ..., "read_only": True}
            body["volumeMounts"] = mounts_body(volume_mounts)
        r = await api.acall(config, "POST", "/v2/sandboxes", json=body, ok=(201, 200),
                     headers=api.create_headers(idempotency_key))
        sandbox_id, token = api.sandbox_fields(r.json())
        return cls(SandboxConnection(config, sandbox_id, token, **api.sandbox_extras(r.json())))

    @classmethod
    async def _cls_connect(cls, sandbox_id: str, timeout: int | None = None, api_key: str | None = None,
                     api_url: str | None = None, request_timeout: float | None = None,
                     on_resume: str = "restore") -> AsyncSandbox:
        config = await aresolve(api_url, api_key, request_timeout)
        body = api.connect_body(timeout, on_resume)
        r = await api.acall(config, "POST", f"/v2/sandboxes/{sandbox_id}/connect", json=body, ok=(200, 201),
                     sandbox_id=sandbox_id)
        sid, token = api.sandbox_fields(r.json())
        return cls(SandboxConnection(config, sid, token, **api.sandbox_extras(r.json())))

    @hybrid("_cls_connect")
    async def connect(self, timeout: int | None = None, request_timeout: float | None = None,
                on_resume: str = "restore") -> AsyncSandbox:
        """AsyncSandbox.connect(sandbox_id) attaches to a sandbox, resuming it if paused (on_resume="reboot": a
        cold start from its files); sbx.connect() does the same for this one, or refreshes its timeout."""
        body = api.connect_body(timeout, on_resume)
        await api.acall(self._conn.config, "POST", f"/v2/sandboxes/{self.sandbox_id}/connect", json=body, ok=(200, 201),
                 sandbox_id=self.sandbox_id, request_timeout=request_timeout)
        return self

    @staticmethod
    def list(query: SandboxQuery | None = None, limit: int | None = None, next_token: str | None = None,
             api_key: str | None = None, api_url: str | None = None,
             request_timeout: float | None = None, order: str | None = None) -> AsyncSandboxPaginator:
        """Running sandboxes matching `query`, newest first (`order="asc"`: oldest first), in pages."""
        return AsyncSandboxPaginator((api_url, api_key, request_timeout), query, limit, next_token, order)

    @staticmethod
    async def _cls_kill(sandbox_id: str, api_key: str | None = None, api_url: str | None = None,
                  request_timeout: float | None = None) -> bool:
        r = await api.acall(await aresolve(api_url, api_key, request_timeout), "DELETE", f"/sandboxes/{sandbox_id}", ok=(204, 200, 404))
        return r.status_code != 404

    @hybrid("_cls_kill")
    async def kill(self, request_timeout: float | None = None) -> bool:
        """Kill the sandbox; False if it was already gone. Also AsyncSandbox.kill(sandbox_id)."""
        r = await api.acall(self._conn.config, "DELETE", f"/sandboxes/{self.sandbox_id}", ok=(204, 200, 404),
                     request_timeout=request_timeout)
        return r.status_code != 404

    @staticmethod
    async def _cls_set_timeout(sandbox_id: str, timeout: int, api_key: str | None = None, api_url: str | None = None,
                         request_timeout: float | None = None) -> None:
        await api.acall(await aresolve(api_url, api_key, request_timeout), "POST", f"/sandboxes/{sandbox_id}/timeout",
                 json={"timeout": int(timeout)}, ok=(204, 200), sandbox_id=sandbox_id)

    @hybrid("_cls_set_timeout")
    async def set_timeout(self, timeout: int, request_timeout: float | None = None) -> None:
        """The sandbox now ends `timeout` seconds from now (may shorten its life)."""
        await api.acall(self._conn.config, "POST", f"/sandboxes/{self.sandbox_id}/timeout", json={"timeout": int(timeout)},
                 ok=(204, 200), sandbox_id=self.sandbox_id, request_timeout=request_timeout)

    @staticmethod
    async def _cls_get_info(sandbox_id: str, api_key: str | None = None, api_url: str | None = None,
                      request_timeout: float | None = None) -> SandboxInfo:
        r = await api.acall(await aresolve(api_url, api_key, request_timeout), "GET", f"/sandboxes/{sandbox_id}", sandbox_id=sandbox_id)
        return SandboxInfo.from_json(r.json())

    @staticmethod
    def _cls_events(sandbox_id: str, kinds: str | list[str] | None = None, since: float | datetime | None = None,
                    until: float | datetime | None = None, follow: bool = False, api_key: str | None = None,
                    api_url: str | None = None, request_timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
        async def config() -> ConnectionConfig:
            return await aresolve(api_url, api_key, request_timeout)

        return _events(config, sandbox_id, kinds, since, until, follow, request_timeout)

    @hybrid("_cls_events")
    def events(self, kinds: str | list[str] | None = None, since: float | datetime | None = None,
               until: float | datetime | None = None, follow: bool = False,
               request_timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """agentcell extension: the sandbox's behaviour record, oldest first (see Sandbox.events);
        ``async for event in sbx.events(kinds="process.")``. Also ``AsyncSandbox.events(sandbox_id)``."""
        conn = self._conn.config

        async def config() -> ConnectionConfig:
            return conn

        return _events(config, self.sandbox_id, kinds, since, until, follow, request_timeout)

    @staticmethod
    async def _cls_report(sandbox_id: str, format: str = "json", api_key: str | None = None,
                          api_url: str | None = None, request_timeout: float | None = None) -> dict[str, Any] | str:
        return await _report(await aresolve(api_url, api_key, request_timeout), sandbox_id, format, request_timeout)

    @hybrid("_cls_report")
    async def report(self, format: str = "json", request_timeout: float | None = None) -> dict[str, Any] | str:
        """agentcell extension: the behaviour record summed up for a reviewer (see Sandbox.report)."""
        return await _report(self._conn.config, self.sandbox_id, format, request_timeout)
    async def get_policy(self, request_timeout: float | None = None) -> dict[str, Any]:
        """agentcell extension: the sandbox's policy as the server holds it (every part, defaults included)."""
        r = await api.acall(self._conn.config, "GET", f"/sandboxes/{self.sandbox_id}/policy",
                            sandbox_id=self.sandbox_id, request_timeout=request_timeout)
        return dict(r.json())

    async def set_policy(self, policy: Mapping[str, Any], request_timeout: float | None = None) -> dict[str, Any]:
        """agentcell extension: replace the sandbox's policy (Sandbox.set_policy says how it applies)."""
        r = await api.acall(self._conn.config, "PUT", f"/sandboxes/{self.sandbox_id}/policy", json=dict(policy),
                            sandbox_id=self.sandbox_id, request_timeout=request_timeout)
        return dict(r.json())

    async def update_network(self, network: Mapping[str, Any], request_timeout: float | None = None) -> None:
        """Replace the sandbox's egress rules (e2b's update_network: ``allow_out``, ``deny_out``,
        ``allow_internet_access``; what is left out is cleared). New connections follow within
        milliseconds; connections already open keep going."""
        await api.acall(self._conn.config, "PUT", f"/sandboxes/{self.sandbox_id}/network",
                 json=api.network_update_body(network), ok=(204, 200), sandbox_id=self.sandbox_id,
                 request_timeout=request_timeout)

    @staticmethod
    async def _cls_get_metrics(sandbox_id: str, start: datetime | None = None, end: datetime | None = None,
                         api_key: str | None = None, api_url: str | None = None,
                         request_timeout: float | None = None) -> list[SandboxMetrics]:
        config = await aresolve(api_url, api_key, request_timeout)
        r = await api.acall(config, "GET", f"/sandboxes/{sandbox_id}/metrics", params=api.metrics_params(start, end),
                     sandbox_id=sandbox_id)
        return [SandboxMetrics.from_json(m) for m in r.json()]

    @hybrid("_cls_get_metrics")
    async def get_metrics(self, start: datetime | None = None, end: datetime | None = None,
                    request_timeout: float | None = None) -> list[SandboxMetrics]:
        """The sandbox's metrics samples (every 5 s, kept for an hour) between `start` and `end`, as
        e2b's get_metrics; the newest is taken now."""
        r = await api.acall(self._conn.config, "GET", f"/sandboxes/{self.sandbox_id}/metrics",
                     params=api.metrics_params(start, end), sandbox_id=self.sandbox_id, request_timeout=request_timeout)
        return [SandboxMetrics.from_json(m) for m in r.json()]

    @hybrid("_cls_get_info")
    async def get_info(self, request_timeout: float | None = None) -> SandboxInfo:
        r = await api.acall(self._conn.config, "GET", f"/sandboxes/{self.sandbox_id}", sandbox_id=self.sandbox_id,
                     request_timeout=request_timeout)
        return SandboxInfo.from_json(r.json())

    async def is_running(self, request_timeout: float | None = None) -> bool:
        """True while the sandbox answers; False once it was killed or timed out."""
        rt = request_timeout or self._conn.config.request_timeout or None
        try:
            r = await fast_async_http.client(self._conn.config.endpoint).request(
                "GET", "/health", headers=self._conn.envd_headers, connect=rt, read=rt)
        except fast_async_http.HTTPError as e:
            raise fast_async_http.transport_error(e, "is_running") from None
        if r.status_code == 502:
            return False
        if r.status_code >= 300:
            raise error_from_http(r.status_code, r.content, self.sandbox_id, "is_running")
        return True

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()

    # --- pause, resume, snapshots, fork (e2b's API) --------------------------------------------------

    @staticmethod
    async def _cls_pause(sandbox_id: str, keep_memory: bool | None = None, mode: str | None = None,
                   api_key: str | None = None, api_url: str | None = None,
                   request_timeout: float | None = None) -> bool:
        r = await api.acall(await aresolve(api_url, api_key, request_timeout), "POST", f"/sandboxes/{sandbox_id}/pause",
                     json=api.pause_body(keep_memory, mode), ok=(204, 200, 409), sandbox_id=sandbox_id)
        return r.status_code != 409

    @hybrid("_cls_pause")
    async def pause(self, keep_memory: bool | None = None, mode: str | None = None,
              request_timeout: float | None = None) -> bool:
        """Pause the sandbox; False if it was paused already. mode "full" (the default) keeps its memory:
        it is frozen where it is and resumed in milliseconds by connect(); "filesystem" keeps only its
        files (a resume cold-starts it). A sandbox created with lifecycle auto_resume is resumed by its
        next request."""
        r = await api.acall(self._conn.config, "POST", f"/sandboxes/{self.sandbox_id}/pause",
                     json=api.pause_body(keep_memory, mode), ok=(204, 200, 409), sandbox_id=self.sandbox_id,
                     request_timeout=request_timeout)
        return r.status_code != 409

    beta_pause = pause

    @staticmethod
    async def _cls_create_snapshot(sandbox_id: str, name: str | None = None, mode: str | None = None,
                             api_key: str | None = None, api_url: str | None = None,
                             request_timeout: float | None = None) -> SnapshotInfo:
        r = await api.acall(await aresolve(api_url, api_key, request_timeout), "POST", f"/sandboxes/{sandbox_id}/snapshots",
                     json=api.snapshot_body(name, mode), ok=(201, 200), sandbox_id=sandbox_id)
        return SnapshotInfo.from_json(r.json())

    @hybrid("_cls_create_snapshot")
    async def create_snapshot(self, name: str | None = None, mode: str | None = None,
                        request_timeout: float | None = None) -> SnapshotInfo:
        """A snapshot of the sandbox (it is paused for the moment it takes); create sandboxes from it
        with `create(snapshot.snapshot_id)`. mode "filesystem": its files; "full": memory too (the gvisor
        backend); None: the most the server's backend can keep."""
        r = await api.acall(self._conn.config, "POST", f"/sandboxes/{self.sandbox_id}/snapshots",
                     json=api.snapshot_body(name, mode), ok=(201, 200), sandbox_id=self.sandbox_id,
                     request_timeout=request_timeout)
        return SnapshotInfo.from_json(r.json())

    @staticmethod
    def _cls_list_snapshots(sandbox_id: str | None = None, limit: int | None = None, next_token: str | None = None,
                            name: str | None = None, api_key: str | None = None, api_url: str | None = None,
                            request_timeout: float | None = None) -> AsyncSnapshotPaginator:
        return AsyncSnapshotPaginator((api_url, api_key, request_timeout), api.snapshot_params(sandbox_id, name, limit, next_token))

    @hybrid("_cls_list_snapshots")
    def list_snapshots(self, limit: int | None = None, next_token: str | None = None, name: str | None = None,
                       request_timeout: float | None = None) -> AsyncSnapshotPaginator:
        """This sandbox's snapshots (Sandbox.list_snapshots(): all of them), newest first, in pages."""
        return AsyncSnapshotPaginator(self._conn.config, api.snapshot_params(self.sandbox_id, name, limit, next_token))

    @staticmethod
    async def delete_snapshot(snapshot_id: str, api_key: str | None = None, api_url: str | None = None,
                        request_timeout: float | None = None) -> bool:
        """Delete a snapshot; False if there is none of that id."""
        r = await api.acall(await aresolve(api_url, api_key, request_timeout), "DELETE", f"/templates/{urllib.parse.quote(snapshot_id, safe='')}",
                     ok=(204, 200, 404))
        return r.status_code != 404

    @staticmethod
    async def _cls_fork(sandbox_id: str, timeout: int | None = None, count: int | None = None,
                  api_key: str | None = None, api_url: str | None = None,
                  request_timeout: float | None = None) -> list[AsyncSandbox | Exception]:
        config = await aresolve(api_url, api_key, request_timeout)
        r = await api.acall(config, "POST", f"/sandboxes/{sandbox_id}/fork", json=api.fork_body(timeout, count),
                     ok=(201, 200), sandbox_id=sandbox_id)
        return [AsyncSandbox(SandboxConnection(config, *api.sandbox_fields(d), **api.sandbox_extras(d))) if d is not None
                else err or SandboxException("the fork failed") for d, err in api.fork_results(r.json())]

    @hybrid("_cls_fork")
    async def fork(self, timeout: int | None = None, count: int | None = None,
             request_timeout: float | None = None) -> list[AsyncSandbox | Exception]:
        """`count` (default 1) new sandboxes, each an independent copy of this one: its memory, processes and
        files on the gvisor backend; its files alone, processes started afresh, on the linux backend (the
        server's info says which: forkMode). An entry is the exception when that one could not start."""
        config = self._conn.config
        r = await api.acall(config, "POST", f"/sandboxes/{self.sandbox_id}/fork", json=api.fork_body(timeout, count),
                     ok=(201, 200), sandbox_id=self.sandbox_id, request_timeout=request_timeout)
        return [AsyncSandbox(SandboxConnection(config, *api.sandbox_fields(d), **api.sandbox_extras(d))) if d is not None
                else err or SandboxException("the fork failed") for d, err in api.fork_results(r.json())]

    # --- code interpreter -------------------------------------------------------------------------

    async def run_code(self, code: str, language: str | None = None, context: Context | None = None,
                 on_stdout: Callable | None = None, on_stderr: Callable | None = None,
                 on_result: Callable | None = None, on_error: Callable | None = None,
                 envs: dict[str, str] | None = None, timeout: float | None = None,
                 request_timeout: float | None = None) -> Execution:
        """Run code in a stateful context (default: the sandbox's Python). An error in the code is returned
        in Execution.error, not raised. `timeout` seconds (default 300, 0 = none) interrupts the run."""
        return await self._code.run_code(code, language, context, on_stdout, on_stderr, on_result, on_error, envs,
                                   timeout, request_timeout)

    async def create_code_context(self, cwd: str | None = None, language: str | None = None,
                            request_timeout: float | None = None) -> Context:
        return await self._code.create_code_context(cwd, language, request_timeout)

    async def list_code_contexts(self, request_timeout: float | None = None) -> list[Context]:
        return await self._code.list_code_contexts(request_timeout)

    async def remove_code_context(self, context: Context | str, request_timeout: float | None = None) -> None:
        await self._code.remove_code_context(context, request_timeout)

    async def restart_code_context(self, context: Context | str, request_timeout: float | None = None) -> None:
        await self._code.restart_code_context(context, request_timeout)


async def _events(config: Callable[[], Any], sandbox_id: str, kinds: str | list[str] | None,
                  since: float | datetime | None, until: float | datetime | None, follow: bool,
                  request_timeout: float | None) -> AsyncIterator[dict[str, Any]]:
    conf: ConnectionConfig = await config()
    rt = request_timeout or conf.request_timeout or None
    query = urllib.parse.urlencode(api.events_query(kinds, since, until, follow), doseq=True)
    path = f"/sandboxes/{sandbox_id}/events" + (f"?{query}" if query else "")
    try:
        r = await fast_async_http.client(conf.endpoint).request(
            "GET", path, headers=conf.control_headers(), connect=rt, read=None if follow else rt, stream=True)
    except fast_async_http.HTTPError as e:
        raise fast_async_http.transport_error(e, "events") from None
    try:
        if r.status_code != 200:
            raise error_from_http(r.status_code, await r.read(), sandbox_id, "events")
        async for line in r.aiter_lines():
            if line.strip():
                yield json.loads(line)
    finally:
        await r.aclose()


async def _report(config: ConnectionConfig, sandbox_id: str, format: str,
                  request_timeout: float | None) -> dict[str, Any] | str:
    r = await api.acall(config, "GET", f"/sandboxes/{sandbox_id}/report", params=api.report_query(format),
                        sandbox_id=sandbox_id, request_timeout=request_timeout)
    return r.json() if format == "json" else r.text
