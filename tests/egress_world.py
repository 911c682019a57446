"""A router with two stand-in sandboxes and a test "internet", in namespaces a test builds (for the
egress tests that drive the router directly, without a server).

The internet answers on the addresses given, documentation ones and forbidden ones alike; the
router's only route leads there, so nothing can leave the machine, and a refusal proves a rule, not
a missing route. On the way out the host's links, addresses, routes and ruleset must be unchanged.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agentcell.network.router import Router


def host_state() -> tuple[str, ...]:
    def run(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    links = "\n".join(line.split(" qlen")[0] for line in run("ip", "-o", "link").splitlines())
    return (links, run("ip", "-o", "addr"), run("ip", "-o", "route"), run("ip", "-o", "-6", "route"),
            run("nft", "list", "ruleset"))


@contextlib.contextmanager
def netns_service(netns: str, script: Path, *args: str,
                  env: Mapping[str, str] | None = None) -> Iterator[subprocess.Popen[str]]:
    """`python script args...` inside namespace `netns` (the tests' internet services), yielded once it
    printed "ready"; killed on the way out."""
    proc = subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, str(script), *args],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()


@dataclass
class World:
    router: Router
    inet: str
    sandboxes: tuple[str, ...]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, netns: str, *args: str) -> None:
        """A Python process (`python args...`) inside namespace `netns`, killed with the world."""
        self.processes.append(subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, *args],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


@contextlib.contextmanager
def router_world(tag: str, addresses: Sequence[str]) -> Iterator[World]:
    """Router `<tag>-router`, internet `<tag>-inet` (203.0.113.2 on its link, `addresses` on its lo),
    sandboxes `<tag>-s1` and `<tag>-s2` linked as slots 1 and 2 (closed)."""
    before = host_state()
    inet, sandboxes = f"{tag}-inet", (f"{tag}-s1", f"{tag}-s2")
    router = Router.create(f"{tag}-router")
    world = World(router, inet, sandboxes)
    try:
        for name in (inet, *sandboxes):
            subprocess.run(["ip", "netns", "add", name], check=True)
            subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        router.attach_uplink(f"/run/netns/{inet}", "inet0", "203.0.113.1/24", "203.0.113.2")
        ip = ["ip", "-n", inet]
        subprocess.run([*ip, "addr", "add", "203.0.113.2/24", "dev", "inet0"], check=True)
        subprocess.run([*ip, "link", "set", "inet0", "up"], check=True)
        for addr in addresses:  # all reachable by route from the router
            subprocess.run([*ip, "addr", "add", f"{addr}/32", "dev", "lo"], check=True)
        for slot, name in enumerate(sandboxes, start=1):
            router.connect(slot, f"/run/netns/{name}")
        yield world
    finally:
        for p in world.processes:
            p.kill()
            p.wait()
        router.destroy()
        for name in (inet, *sandboxes):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        assert host_state() == before, "the host's network changed"
