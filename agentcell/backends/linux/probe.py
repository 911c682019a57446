"""A tiny stand-in agent for backend tests: ``serve(sock, config)`` runs commands on request.

Frames: ``{"id", "op": "exec", "argv": [...], "timeout": s}`` -> ``{"id", "done": true, "exit_code",
"stdout", "stderr"}``; ``{"id", "op": "ping"}`` -> ``{"id", "done": true}``; ``{"id", "op": "config"}`` -> the config it got. Blocking and sequential on
purpose: it only has to prove what a sandbox can and cannot do.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from typing import Any

from agentcell.runtime.protocol import encode_frame, recv_frame


def _child_setup(score: int) -> None:
    # the agent keeps a lower score than its processes so the OOM killer picks the hog, not pid 1
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write(str(score))


def _reap_orphans() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _exec(req: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    try:
        proc = subprocess.Popen(
            req["argv"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=config["envs"], cwd=config["home"], preexec_fn=lambda: _child_setup(int(config.get("child_oom_score_adj", 0))), start_new_session=True,
        )
    except OSError as e:
        return {"exit_code": 127, "stdout": "", "stderr": str(e)}
    try:
        out, err = proc.communicate(timeout=float(req.get("timeout", 30)))
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate()
    return {"exit_code": proc.returncode, "stdout": out.decode(errors="replace"),
            "stderr": err.decode(errors="replace")}


def serve(sock: socket.socket, config: dict[str, Any]) -> None:
    sock.setblocking(True)
    sock.sendall(encode_frame({"id": 0, "event": "ready"}))
    while True:
        frame = recv_frame(sock)
        if frame is None:
            return
        req = frame.header
        if req.get("op") == "claim":  # the server's claim of this standby: the tenant's env vars, no answer
            config["envs"] = {**config["envs"], **(req.get("envs") or {})}
            continue
        answer: dict[str, Any] = {}
        if req.get("op") == "exec":
            answer = _exec(req, config)
        elif req.get("op") == "config":
            answer = {"config": {k: v for k, v in config.items() if k != "strict_seccomp"}}  # (a program)
        elif req.get("op") != "ping":
            answer = {"error": {"code": "unimplemented", "message": f"probe has no op {req.get('op')!r}"}}
        sock.sendall(encode_frame({"id": req.get("id"), "done": True, **answer}))
        _reap_orphans()
