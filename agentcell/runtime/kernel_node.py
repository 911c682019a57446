"""JavaScript and TypeScript contexts: one Node.js process each (js/runner.js), the host's ``node``.

The runner, its parser (acorn) and TypeScript's transpiler ship in the agentcell package
(runtime/js/node_modules: in a checkout installed by scripts/setup from its package-lock.json, in a
wheel the files of them that run, put there when it was built: setup.py), so a sandbox reads them at
/opt/agentcell/lib/agentcell/runtime/js like the rest of the package. A context costs one node
process (~40 MiB resident, ~0.1 s to start; TypeScript's ~0.4 s), charged to the sandbox's cgroup.
"""

from __future__ import annotations

import os

from agentcell.runtime.kernel_exec import KernelSpec, exec_kernel, find_program

JS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "js")
RUNNER = os.path.join(JS_DIR, "runner.js")
_NODE = ("node", "nodejs")


def _missing(language: str) -> str | None:
    if find_program(_NODE) is None:
        return f"{language} contexts need Node.js (`node`), which this host does not have: apt-get install nodejs"
    needs = ["acorn", "acorn-walk"] + (["typescript"] if language == "typescript" else [])
    for pkg in needs:
        if not os.path.isfile(os.path.join(JS_DIR, "node_modules", pkg, "package.json")):
            return (f"{language} contexts need the npm package {pkg!r} in agentcell/runtime/js/node_modules, "
                    "which is not installed: run scripts/setup (npm ci there), or install a wheel (it has them)")
    return None


def _launcher(language: str):  # noqa: ANN202
    def launch(ctrl_fd: int, out_w: int, err_w: int, cwd: str, env: dict[str, str], oom: int) -> int:
        node = find_program(_NODE, env) or "/usr/bin/node"
        return exec_kernel([node, RUNNER, language], ctrl_fd, out_w, err_w, cwd, env, oom)

    return launch


JAVASCRIPT = KernelSpec("javascript", _launcher("javascript"), lambda: _missing("javascript"), interrupt_group=True)
TYPESCRIPT = KernelSpec("typescript", _launcher("typescript"), lambda: _missing("typescript"), interrupt_group=True)
