"""Java contexts: one JVM per context running JShell in-process (java/Runner.java), the host's JDK.

Started as a single-file source program (`java Runner.java`: compiled in memory at start, no build
step), so a host with a JDK (`java` and the jdk.jshell module) has Java contexts and one without gets
a 400 saying so. Env vars are system properties, as in E2B's Java kernel (IJava). A context costs one
JVM (~100 MiB resident, heap ≤ half the sandbox's memory; ~2 s to start), charged to the sandbox.
"""

from __future__ import annotations

import base64
import os

from agentcell.runtime.kernel_exec import KernelSpec, exec_kernel, find_program

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "java", "Runner.java")
_JAVA = ("java",)
_JVM_OPTIONS = [
    "--add-opens=java.base/java.io=ALL-UNNAMED",  # the runner's fd 3 (FileDescriptor has no public int constructor)
    "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:MaxRAMPercentage=50", "-Xss2m",
    "-Djava.awt.headless=true",
]


def _b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8", "surrogatepass")).decode()


def _pairs(env: dict[str, str]) -> str:
    return "".join(f" {_b64(k)}={_b64(v)}" for k, v in env.items())


def encode_run(code: str, env_vars: dict[str, str]) -> bytes:
    return f"R {_b64(code)}{_pairs(env_vars)}\n".encode()


def encode_env(envs: dict[str, str]) -> bytes:
    return f"E{_pairs(envs)}\n".encode()


def _missing() -> str | None:
    java = find_program(_JAVA)
    if java is None:
        return "java contexts need a JDK (`java` with jshell), which this host does not have: apt-get install default-jdk-headless"
    home = os.path.dirname(os.path.dirname(os.path.realpath(java)))
    if not os.path.exists(os.path.join(home, "jmods", "jdk.jshell.jmod")) and \
            not os.path.exists(os.path.join(home, "bin", "jshell")):
        return "java contexts need a JDK with jshell; this host has only a JRE: apt-get install default-jdk-headless"
    return None


def _launch(ctrl_fd: int, out_w: int, err_w: int, cwd: str, env: dict[str, str], oom: int) -> int:
    java = find_program(_JAVA, env) or "/usr/bin/java"
    return exec_kernel([java, *_JVM_OPTIONS, RUNNER], ctrl_fd, out_w, err_w, cwd, env, oom)


JAVA = KernelSpec("java", _launch, _missing, encode_run, encode_env)
