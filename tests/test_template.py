"""The default template: what code in a sandbox finds without installing anything."""

from __future__ import annotations

import sys

from agentcell import Sandbox


def test_shell_commands_get_the_template_python(server_url: str) -> None:
    # `bash -l` runs every command; the sandbox's /etc/profile must not reset PATH to the system Python.
    with Sandbox.create(api_url=server_url) as sbx:
        out = sbx.commands.run(
            "command -v python3; python3 -c 'import numpy, pandas, matplotlib, IPython; print(\"imports ok\")'"
        ).stdout.split("\n")
        # the template's Python, at its neutral path inside the sandbox (not the host's sys.prefix)
        prefix = sbx.run_code("import sys; sys.prefix").text.strip("'")
        assert out[0].startswith(prefix + "/bin/") and out[1] == "imports ok"
        assert prefix != sys.prefix or prefix.startswith("/usr")
        assert sbx.run_code("import os; os.environ['HOME'], os.getcwd()").text == "('/home/user', '/home/user')"
