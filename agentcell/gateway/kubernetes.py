"""Kubernetes discovery: the EndpointSlices of the cells' headless Service, listed then watched.

Each endpoint (one cell pod) becomes `http://{address}:{port}` with its conditions: `ready` (a create
may go there) and `serving` (its sandboxes may still be reached: a terminating, draining pod is serving
but not ready, so its sandboxes stay reachable until it is gone). A nil condition means what the API
says it means: ready nil is true, serving nil is ready. Needs the `kubernetes` extra
(kubernetes_asyncio) and RBAC get/list/watch on endpointslices in the namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from agentcell.gateway.discovery import Discovery, Endpoint, OnChange

log = logging.getLogger("agentcell.gateway")

_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
WATCH_SECONDS = 300  # each watch ends after this, then a fresh list (and any missed event) follows
RETRY_SECONDS = 1.0


def slice_endpoints(obj: Any, port_name: str | None) -> list[Endpoint]:
    """The cells of one V1EndpointSlice (the client's model)."""
    ports = [p for p in (obj.ports or []) if p.port is not None and (port_name is None or p.name == port_name)]
    if not ports:
        return []
    port = ports[0].port
    out = []
    for ep in obj.endpoints or []:
        cond = ep.conditions
        ready = True if cond is None or cond.ready is None else bool(cond.ready)
        serving = ready if cond is None or cond.serving is None else bool(cond.serving)
        for address in ep.addresses or []:
            host = f"[{address}]" if ":" in address else address
            out.append(Endpoint(f"http://{host}:{port}", ready=ready, serving=serving))
    return out


class KubernetesDiscovery(Discovery):
    def __init__(self, service: str, namespace: str | None = None, port_name: str | None = None,
                 api_client: Any = None) -> None:
        self.service = service
        self.namespace = namespace or (_SA_NAMESPACE.read_text().strip() if _SA_NAMESPACE.exists() else "default")
        self.port_name = port_name
        self._api_client = api_client  # tests pass one pointed at a local fake API server
        self._own_client = api_client is None
        self._slices: dict[str, Any] = {}
        self._task: asyncio.Task[None] | None = None
        self._on_change: OnChange | None = None

    async def _client(self) -> Any:
        from kubernetes_asyncio import client, config

        if self._api_client is None:
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config()
            else:
                await config.load_kube_config()
            self._api_client = client.ApiClient()
        return client.DiscoveryV1Api(self._api_client)

    def _report(self) -> None:
        eps: dict[str, Endpoint] = {}
        for obj in self._slices.values():
            for ep in slice_endpoints(obj, self.port_name):
                # one address in two slices (during a move): the more available word counts
                old = eps.get(ep.url)
                eps[ep.url] = ep if old is None else Endpoint(ep.url, old.ready or ep.ready, old.serving or ep.serving)
        assert self._on_change is not None
        self._on_change(sorted(eps.values(), key=lambda e: e.url))

    async def _list(self, api: Any) -> str:
        selector = f"kubernetes.io/service-name={self.service}"
        got = await api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
        self._slices = {s.metadata.name: s for s in got.items}
        self._report()
        return got.metadata.resource_version

    async def start(self, on_change: OnChange) -> None:
        self._on_change = on_change
        api = await self._client()
        version = await self._list(api)  # the first list must work: a wrong namespace or RBAC fails loudly
        self._task = asyncio.get_running_loop().create_task(self._watch_loop(api, version))

    async def _watch_loop(self, api: Any, version: str | None) -> None:
        from kubernetes_asyncio import watch

        selector = f"kubernetes.io/service-name={self.service}"
        while True:
            try:
                if version is None:
                    version = await self._list(api)
                w = watch.Watch()
                async with w:
                    async for event in w.stream(api.list_namespaced_endpoint_slice, self.namespace,
                                                label_selector=selector, resource_version=version,
                                                timeout_seconds=WATCH_SECONDS):
                        kind, obj = event["type"], event["object"]
                        if kind in ("ADDED", "MODIFIED"):
                            self._slices[obj.metadata.name] = obj
                        elif kind == "DELETED":
                            self._slices.pop(obj.metadata.name, None)
                        else:
                            continue  # BOOKMARK
                        self._report()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a broken watch (410 Gone, the API away): list again
                log.warning("endpointslice watch of %s/%s failed (%s): listing again", self.namespace,
                            self.service, e)
                await asyncio.sleep(RETRY_SECONDS)
            version = None  # after a watch ends, list again: nothing missed, endpoints exact

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._own_client and self._api_client is not None:
            await self._api_client.close()
