"""backends/linux/host_settings.py with real processes: holders that start and stop at once, holders that
are killed, and the original put back exactly once, by the last one.

The setting here is a file of a temporary directory standing in for a sysctl, and the registry is a
temporary directory too: nothing of the host changes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from agentcell.backends.linux import host_settings

HOLDER = r'''
import os, sys, time
from agentcell.backends.linux import host_settings
registry, value_file, mode = sys.argv[1], sys.argv[2], sys.argv[3]

def read():
    with open(value_file) as f:
        return f.read()

def restore(original, pids):
    with open(value_file, "a") as f:  # appended: a second restore would show
        f.write("|restored:" + original)

setting = host_settings.Setting("test.value", read, restore)

def change(original, holders):
    with open(value_file, "w") as f:
        f.write("changed")

holder = host_settings.Holder("t", registry)
print(holder.hold(setting, change), flush=True)
if mode == "wait":
    sys.stdin.readline()  # until the test says
holder.close()
'''


def _holder(registry: Path, value: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(registry), str(value), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)


def test_the_last_holder_restores_once_whatever_the_order(tmp_path: Path) -> None:
    registry, value = tmp_path / "registry", tmp_path / "value"
    value.write_text("original")
    holders = [_holder(registry, value, "wait") for _ in range(6)]
    for h in holders:
        assert h.stdout is not None and h.stdout.readline().strip() == "original"  # every one sees the original
    assert value.read_text() == "changed"
    record = json.loads((registry / "test.value.json").read_text())
    assert record["original"] == "original" and len(record["holders"]) == 6
    for h in holders:  # all stop at once
        assert h.stdin is not None
        h.stdin.write("\n")
        h.stdin.flush()
    for h in holders:
        assert h.wait(30) == 0
    assert value.read_text() == "changed|restored:original"  # exactly one restore
    assert not (registry / "test.value.json").exists()
    assert os.listdir(registry / "holders") == []


def test_killed_holders_are_dropped_and_a_sweep_restores(tmp_path: Path) -> None:
    registry, value = tmp_path / "registry", tmp_path / "value"
    value.write_text("original")
    first, second = _holder(registry, value, "wait"), _holder(registry, value, "wait")
    for h in (first, second):
        assert h.stdout is not None and h.stdout.readline().strip() == "original"
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert len(host_settings.holders("test.value", str(registry))) == 1  # the dead one is gone
    second.send_signal(signal.SIGKILL)  # the last one dies too: nobody restores on the way out ...
    second.wait()
    assert value.read_text() == "changed"
    # ... and a newcomer finds the original the dead ones saved, not what they left in the kernel
    late = _holder(registry, value, "wait")
    assert late.stdout is not None and late.stdout.readline().strip() == "original"
    late.send_signal(signal.SIGKILL)
    late.wait()
    setting = host_settings.Setting("test.value", lambda: value.read_text(),
                                    lambda original, pids: value.write_text(original))
    assert host_settings.sweep(setting, str(registry)) is True  # what a server does at its start
    assert value.read_text() == "original" and not (registry / "test.value.json").exists()
    assert host_settings.sweep(setting, str(registry)) is False


def test_a_failed_change_undoes_its_hold(tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    restored: list[str] = []
    setting = host_settings.Setting("test.fail", lambda: "before", lambda original, pids: restored.append(original))
    holder = host_settings.Holder("t", str(registry))

    def fail(original: str, holders: host_settings.Holders) -> None:
        raise OSError("no")

    try:
        holder.hold(setting, fail)
    except OSError:
        pass
    else:
        raise AssertionError("the change's error was swallowed")
    assert restored == ["before"] and host_settings.holders("test.fail", str(registry)) == {}
    holder.close()


def test_netns_keys_tell_namespaces_apart() -> None:
    here = host_settings.netns_key("net.ipv4.ip_forward")
    other = subprocess.run(["unshare", "--net", sys.executable, "-c",
                            "from agentcell.backends.linux import host_settings as h; "
                            "print(h.netns_key('net.ipv4.ip_forward'))"],
                           capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    assert here.startswith("net.ipv4.ip_forward@netns-") and other.startswith("net.ipv4.ip_forward@netns-")
    assert here != other
