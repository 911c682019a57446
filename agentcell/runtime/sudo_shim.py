#!/opt/agentcell/venv/bin/python3 -IS
"""agentcell's `sudo` (installed as /usr/bin/sudo in every sandbox; see runtime/sudo.py).

Runs a command as the sandbox's root through the agent: passwordless, as E2B's sandboxes have it.
Understands the options scripts use: -u root|0|user, -E, -H, -i, -s, -n, -S, -k, -K, -v, -l, --.
Standard library only, and nothing imported from the sandbox's writable paths (-I -S).
"""

import array
import json
import os
import shutil
import signal
import socket
import sys

SOCKET_NAME = "\0agentcell-sudo"
SECURE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KEPT = ("TERM", "COLORTERM", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "TZ", "DISPLAY", "COLUMNS", "LINES")
USAGE = "usage: sudo [-EHinSs] [-u user] [--] command [arg ...]"


def fail(message, code=1):
    sys.stderr.write(f"sudo: {message}\n")
    sys.exit(code)


def parse(args):
    opts = {"user": "root", "preserve": False, "login": False, "shell": False}
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        arg = args[i]
        i += 1
        if arg == "--":
            break
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            if name == "user":
                opts["user"] = value or (args[i] if i < len(args) else fail(USAGE))
                i += 0 if value else 1
            elif name in ("preserve-env",):
                opts["preserve"] = True
            elif name in ("login",):
                opts["login"] = True
            elif name in ("shell",):
                opts["shell"] = True
            elif name in ("non-interactive", "stdin", "set-home", "reset-timestamp", "remove-timestamp", "validate"):
                opts.setdefault("only", name in ("reset-timestamp", "remove-timestamp", "validate"))
            elif name == "help":
                print(USAGE)
                sys.exit(0)
            else:
                fail(f"option --{name} is not supported by agentcell's sudo\n{USAGE}")
            continue
        for j, flag in enumerate(arg[1:]):
            if flag == "u":
                rest = arg[j + 2:]
                opts["user"] = rest or (args[i] if i < len(args) else fail(USAGE))
                i += 0 if rest else 1
                break
            if flag == "E":
                opts["preserve"] = True
            elif flag == "i":
                opts["login"] = True
            elif flag == "s":
                opts["shell"] = True
            elif flag in "nSHA":
                pass  # no password is ever asked; HOME is root's anyway
            elif flag in "kKv":
                opts["only"] = True
            elif flag == "l":
                print("User may run the following commands on this sandbox:\n    (ALL : ALL) NOPASSWD: ALL")
                sys.exit(0)
            elif flag in "hV":
                print(USAGE if flag == "h" else "agentcell sudo (runs commands as the sandbox's root)")
                sys.exit(0)
            else:
                fail(f"option -{flag} is not supported by agentcell's sudo\n{USAGE}")
    return opts, args[i:]


def main():
    opts, command = parse(sys.argv[1:])
    if opts.get("only") and not command:
        sys.exit(0)  # -k/-K/-v: no credentials are cached, nothing to do
    user = opts["user"]
    if user in ("user", "1000") and not opts["login"] and not opts["shell"]:
        if not command:
            fail(USAGE)
        if os.getuid() == 0:  # root asking for the user: root may switch down itself
            os.setgid(1000)
            os.setuid(1000)
        os.execvp(command[0], command)  # the user already: no hop through the agent
    if user not in ("root", "0", "user"):
        fail(f"unknown user {user}: a sandbox has the users 'user' and 'root'")
    if opts["login"] or opts["shell"]:
        shell = "/bin/bash"
        if command:
            command = [shell, "-l" if opts["login"] else "", "-c", " ".join(command)]
            command = [a for a in command if a]
        else:
            command = [shell, "-l"] if opts["login"] else [shell]
    if not command:
        fail(USAGE)
    if os.getuid() == 0:
        os.execvp(command[0], command)
    exe = command[0] if "/" in command[0] else shutil.which(command[0], path=SECURE_PATH)
    if exe is None:
        fail(f"{command[0]}: command not found")
    me = os.environ.get("USER", "user")
    if opts["preserve"]:
        env = dict(os.environ)
    else:
        env = {k: os.environ[k] for k in KEPT if k in os.environ}
    env.update({"PATH": SECURE_PATH if not opts["preserve"] else os.environ.get("PATH", SECURE_PATH),
                "HOME": "/root", "USER": "root", "LOGNAME": "root", "SHELL": "/bin/bash",
                "SUDO_USER": me, "SUDO_UID": str(os.getuid()), "SUDO_GID": str(os.getgid()),
                "SUDO_COMMAND": " ".join(command)[:4096]})
    request = json.dumps({"exe": exe, "argv": command, "env": env, "cwd": os.getcwd()}).encode() + b"\n"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(SOCKET_NAME)
    except OSError:
        fail("root is not available in this sandbox")
    sock.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])

    def forward(sig, _frame):
        try:
            sock.send(f"{sig}\n".encode())
        except OSError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, forward)
    answer = b""
    while not answer.endswith(b"\n"):
        try:
            chunk = sock.recv(4096)
        except InterruptedError:
            continue
        if not chunk:
            fail("the sandbox's agent went away")
        answer += chunk
    reply = json.loads(answer)
    if "error" in reply:
        fail(reply["error"])
    sys.exit(int(reply["exit"]))


if __name__ == "__main__":
    main()
