"""`sudo` inside a sandbox: root through the agent (runtime/sudo.py), no setuid, no_new_privs kept."""

from __future__ import annotations

import time

import pytest
from e2b import CommandExitException
from e2b import Sandbox as E2BSandbox

from agentcell import Sandbox
from tests.helpers import sh


@pytest.fixture(scope="module")
def sbx(server_url: str):  # type: ignore[no-untyped-def]
    s = Sandbox.create(api_url=server_url, timeout=300)
    yield s
    s.kill()


def test_sudo_runs_as_the_sandboxs_root(sbx: Sandbox) -> None:
    assert sh(sbx, "whoami") == (0, "user\n", "")
    code, out, _ = sh(sbx, "sudo id -u; sudo whoami; sudo sh -c 'echo $HOME $USER $SUDO_USER'; sudo -n true && echo ok")
    assert (code, out) == (0, "0\nroot\n/root root user\nok\n")
    # what root gets is the sandbox's root: no_new_privs still set, capabilities bounded
    _, out, _ = sh(sbx, "sudo grep -E 'NoNewPrivs|CapEff' /proc/self/status")
    assert "NoNewPrivs:\t1" in out
    assert "CapEff:\t0000000000000000" not in out  # root does have its (namespaced) capabilities


def test_sudo_writes_the_system_and_keeps_the_status(sbx: Sandbox) -> None:
    code, out, _ = sh(sbx, "sudo sh -c 'echo hi > /etc/agentcell-sudo-test' && cat /etc/agentcell-sudo-test; "
                           "echo x > /etc/nope 2>/dev/null; echo user-write=$?")
    assert out == "hi\nuser-write=1\n"
    assert sh(sbx, "sudo sh -c 'exit 7'; echo $?")[1] == "7\n"
    assert sh(sbx, "sudo false; echo $?")[1] == "1\n"
    code, _, err = sh(sbx, "sudo no-such-command")
    assert code != 0 and "command not found" in err
    assert sh(sbx, "echo piped | sudo cat")[1] == "piped\n"  # stdio is the caller's
    assert sh(sbx, "cd /tmp && sudo pwd")[1] == "/tmp\n"
    assert sh(sbx, "FOO=bar sudo -E sh -c 'echo $FOO'; FOO=bar sudo sh -c 'echo [$FOO]'")[1] == "bar\n[]\n"
    assert sh(sbx, "sudo -u user whoami; sudo -i whoami; sudo -s id -u")[1] == "user\nroot\n0\n"


def test_sudo_command_dies_with_its_caller(sbx: Sandbox) -> None:
    def sleepers() -> list[str]:  # the users of the `sleep 300` processes (not of sudo's own)
        return [line.split()[0] for line in sh(sbx, "ps -eo user,args")[1].splitlines()
                if line.split()[1:3] == ["sleep", "300"]]

    h = sbx.commands.run("sudo sleep 300", background=True)
    deadline = time.monotonic() + 10
    while not sleepers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sleepers() == ["root"]
    h.kill()
    deadline = time.monotonic() + 10
    while sleepers():
        assert time.monotonic() < deadline, "the root command outlived its sudo"
        time.sleep(0.1)


def test_sudo_cannot_reach_outside(sbx: Sandbox) -> None:
    """Root through sudo is the same bounded root as user='root': the attack suite covers it; here,
    a few of the things root-in-a-namespace must still not do."""
    code, out, _ = sh(sbx, "sudo mount -t tmpfs x /mnt 2>&1; echo mount=$?; "
                           "sudo cat /proc/1/environ >/dev/null 2>&1; echo environ=$?; sudo kill -9 1")
    assert "\nmount=0\n" not in "\n" + out and "environ=0" not in out, out
    assert sh(sbx, "echo alive")[1] == "alive\n"  # pid 1 (the agent) ignores its namespace's signals


def test_e2b_scoped_env_vars_with_sudo(e2b_env: str) -> None:
    """E2B's own test_bash_command_scoped_env_vars: sudo exists and sees none of the caller's env."""
    sbx = E2BSandbox.create()
    try:
        assert sbx.commands.run("echo $FOO", envs={"FOO": "bar"}).stdout.strip() == "bar"
        assert sbx.commands.run('sudo echo "$FOO"').stdout.strip() == ""
        with pytest.raises(CommandExitException):
            sbx.commands.run("sudo sh -c 'exit 3'")
    finally:
        sbx.kill()
