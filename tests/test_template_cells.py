"""Templates behind a gateway (docs/gateway.md): two cells sharing one template store, an image
imported through the gateway from a loopback registry, sandboxes of it started on both cells.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from tests.oci_images import Registry, musl_root, root_image
from tests.servers import GatewayProcess, ServerProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="image templates need servers running as root")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, list[ServerProcess]]]:
    tmp = tmp_path_factory.mktemp("cells")
    layout = tmp / "layout"
    root_image(layout, "musl", root=musl_root(tmp / "musl"))
    registry = Registry(tmp / "registry")
    registry.push(f"oci:{layout}:musl", "test/musl:1")
    store = tmp / "shared-templates"
    cells = [ServerProcess(tmp / f"{cid}.log", "--cell-id", cid, "--standbys", "1", "--egress-uplink", "none",
                           "--template-store-dir", str(store), "--insecure-registry", registry.address)
             for cid in ("cella001", "cellb002")]
    try:
        for c in cells:
            c.wait_ready()
        gateway = GatewayProcess(tmp / "gw.log", [c.url for c in cells])
        gateway.wait_ready()
        gateway.registry = registry  # type: ignore[attr-defined]
        yield gateway, cells
        gateway.stop()
    finally:
        for c in cells:
            c.stop()
        registry.stop()


def test_a_template_imported_through_the_gateway_runs_on_every_cell(setup: tuple[GatewayProcess, list[ServerProcess]]) -> None:
    gateway, cells = setup
    with httpx.Client(base_url=gateway.url, timeout=300) as http:
        imported = http.post("/templates/imports", json={
            "name": "shared-musl", "fromImage": f"docker://{gateway.registry.address}/test/musl:1"})  # type: ignore[attr-defined]
        assert imported.status_code == 201, imported.text
    seen: dict[str, Sandbox] = {}
    try:
        for _ in range(24):  # creates go to the less loaded of two cells: until each cell has one
            sb = Sandbox.create(template="shared-musl", api_key="e2b_x", api_url=gateway.url, sandbox_url=gateway.url)
            cell = sb.sandbox_id[:8]
            if cell in seen:
                sb.kill()
                continue
            seen[cell] = sb
            if len(seen) == 2:
                break
        assert sorted(seen) == ["cella001", "cellb002"]
        for sb in seen.values():
            assert "ID=alpine" in sb.commands.run("cat /etc/os-release").stdout
    finally:
        for sb in seen.values():
            sb.kill()
