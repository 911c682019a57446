"""Standbys: sandboxes prepared before any request, claimed by creates (backends/pool.py, backend.py).

A create without an id of its own takes a prepared standby and claims it: the tenant's env vars reach
that sandbox only, memory and CPU limits are changed on its cgroups, anything else (disk size, pids,
rlimits) gets a sandbox prepared for it. A standby that died while it waited is never handed out.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator

import pytest
from helpers import ProbeBox, probe_backend

from agentcell import Sandbox
from agentcell.backends.base import Limits, SandboxSpec
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox
from agentcell.runtime.protocol import AgentChannel

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the linux backend needs root")


@pytest.fixture(scope="module")
async def backend() -> AsyncIterator[LinuxBackend]:
    async with probe_backend(max_sandboxes=100, standbys=2, prepare_parallel=2) as be:
        yield be


async def claim(backend: LinuxBackend, **spec: object) -> ProbeBox:
    sb = await backend.create(SandboxSpec(**spec))  # type: ignore[arg-type]
    assert isinstance(sb, LinuxSandbox)
    return ProbeBox(sb, await AgentChannel.open(sb.sock))


async def drop(backend: LinuxBackend, box: ProbeBox) -> None:
    await box.channel.close()
    await backend.kill(box.sandbox)


async def ready_standbys(backend: LinuxBackend, count: int) -> list[LinuxSandbox]:
    pool = backend._pool("base")
    for _ in range(500):
        if pool.ready >= count:
            return list(pool._ready)
        await asyncio.sleep(0.02)
    raise AssertionError(f"the pool never had {count} standbys ready")


async def test_a_claim_brings_the_env_vars_and_the_standby_is_refilled(backend: LinuxBackend) -> None:
    prepared = {sb.sandbox_id for sb in await ready_standbys(backend, 2)}
    box = await claim(backend, envs={"TENANT_KEY": "k-123"})
    try:
        assert box.sandbox.sandbox_id in prepared  # a prepared one, not made on the request's path
        cfg = (await box.channel.call("config")).header["config"]
        assert cfg["envs"]["TENANT_KEY"] == "k-123"
        assert (await box.run("hostname"))[1].strip() == box.sandbox.sandbox_id
        others = {sb.sandbox_id for sb in await ready_standbys(backend, 2)}
        assert box.sandbox.sandbox_id not in others and len(others) == 2
        for sb in backend._pool("base")._ready:  # the other standbys got nothing of this tenant
            assert sb.sandbox_id != box.sandbox.sandbox_id
    finally:
        await drop(backend, box)


async def test_a_burst_past_the_pool_gets_distinct_live_sandboxes(backend: LinuxBackend) -> None:
    boxes = await asyncio.gather(*(claim(backend, envs={"N": str(i)}) for i in range(12)))
    try:
        ids = {b.sandbox.sandbox_id for b in boxes}
        uids = {b.sandbox.slot for b in boxes}
        assert len(ids) == len(uids) == 12
        for i, b in enumerate(boxes):
            assert (await b.channel.call("config")).header["config"]["envs"]["N"] == str(i)
            assert (await b.run("hostname"))[1].strip() == b.sandbox.sandbox_id
    finally:
        for b in boxes:
            await drop(backend, b)


async def test_a_standby_that_died_is_not_handed_out(backend: LinuxBackend) -> None:
    dead = await ready_standbys(backend, 2)
    for sb in dead:
        os.kill(sb.host_pid, signal.SIGKILL)
    for sb in dead:
        for _ in range(200):
            if not sb.alive():
                break
            await asyncio.sleep(0.01)
    box = await claim(backend)
    try:
        assert box.sandbox.sandbox_id not in {sb.sandbox_id for sb in dead}
        assert (await box.run("true"))[0] == 0
    finally:
        await drop(backend, box)


async def cgroup_value(box: ProbeBox, controller: str, name: str) -> int:
    with open(f"{box.sandbox.cgroups.dirs[controller]}/{name}") as f:
        return int(f.read())


@pytest.mark.skipif(not os.path.isdir("/sys/fs/cgroup/cpu"), reason="reads cgroup v1 files")
async def test_memory_and_cpu_are_changed_on_the_claimed_standby(backend: LinuxBackend) -> None:
    prepared = {sb.sandbox_id for sb in await ready_standbys(backend, 2)}
    box = await claim(backend, limits=Limits(memory_mb=768, cpu_count=0.5, disk_mb=384))
    try:
        assert box.sandbox.sandbox_id in prepared
        assert await cgroup_value(box, "memory", "memory.limit_in_bytes") == 768 << 20
        assert await cgroup_value(box, "cpu", "cpu.cfs_quota_us") == 50_000
        # the hog check: the new limit is the one the kernel enforces
        code, out, _ = await box.run("python3", "-c", "b = bytearray(700 << 20); print('fits')")
        assert code == 0 and "fits" in out
    finally:
        await drop(backend, box)


async def test_other_limits_get_a_sandbox_prepared_for_them(backend: LinuxBackend) -> None:
    prepared = {sb.sandbox_id for sb in await ready_standbys(backend, 2)}
    box = await claim(backend, limits=Limits(memory_mb=1024, open_files=256))  # disk 896 MiB: not a standby's
    try:
        assert box.sandbox.sandbox_id not in prepared
        out = (await box.run("sh", "-c", "df -m /tmp | tail -1; ulimit -n"))[1].split()
        assert out[1] == "896" and out[-1] == "256"
    finally:
        await drop(backend, box)


async def test_an_explicit_id_is_prepared_for_it(backend: LinuxBackend) -> None:
    sandbox_id = "x" + uuid.uuid4().hex[:12]
    box = await claim(backend, sandbox_id=sandbox_id)
    try:
        assert box.sandbox.sandbox_id == sandbox_id
        assert (await box.run("hostname"))[1].strip() == sandbox_id
    finally:
        await drop(backend, box)


async def test_standbys_outlive_their_zygote(backend: LinuxBackend) -> None:
    prepared = {sb.sandbox_id for sb in await ready_standbys(backend, 2)}
    backend._zygotes["base"].proc.kill()
    backend._zygotes["base"].proc.wait()
    box = await claim(backend)
    try:
        assert box.sandbox.sandbox_id in prepared
        assert (await box.run("true"))[0] == 0
    finally:
        await drop(backend, box)
    await ready_standbys(backend, 2)  # refilled by a new zygote


def test_env_vars_reach_the_context_started_before_the_claim(server_url: str) -> None:
    with Sandbox.create(api_url=server_url, envs={"TENANT_VAR": "t-42"}) as sbx:
        assert sbx.run_code("import os; os.environ['TENANT_VAR']").text == "t-42"
        assert sbx.commands.run("echo $TENANT_VAR").stdout.strip() == "t-42"
        ctx = sbx.create_code_context()
        assert sbx.run_code("import os; os.environ.get('TENANT_VAR')", context=ctx).text == "t-42"
        assert sbx.run_code("import socket; socket.gethostname()").text == sbx.sandbox_id
