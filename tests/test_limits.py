"""Per-sandbox limits that the attack tests do not already exercise: CPU quota and open files."""

from __future__ import annotations

from agentcell import Sandbox

BURN = """
import time
t0, c0 = time.monotonic(), time.process_time()
while time.monotonic() - t0 < 2.0:
    pass
round((time.process_time() - c0) / (time.monotonic() - t0), 2)
"""


def test_cpu_quota_caps_a_busy_loop(server_url: str) -> None:
    with Sandbox.create(api_url=server_url, limits={"cpuCount": 0.25}) as slow:
        share = float(slow.run_code(BURN).text)
    assert share < 0.4, share  # a quarter of a core, with scheduler slack
    with Sandbox.create(api_url=server_url, limits={"cpuCount": 1}) as fast:
        assert float(fast.run_code(BURN).text) > 0.6


def test_open_files_limit(server_url: str) -> None:
    with Sandbox.create(api_url=server_url, limits={"openFiles": 128}) as sbx:
        r = sbx.run_code(
            "import errno, resource\n"
            "fs, err = [], None\n"
            "try:\n"
            "    for _ in range(1000): fs.append(open('/dev/null'))\n"
            "except OSError as e:\n"
            "    err = e.errno\n"
            "n = len(fs)\n"
            "[f.close() for f in fs]\n"
            "(resource.getrlimit(resource.RLIMIT_NOFILE)[1], n < 128, err == errno.EMFILE)"
        )
        assert r.text == "(128, True, True)", r
        # The limit binds the sandbox, not the agent's ability to keep serving it.
        assert sbx.commands.run("echo fine").stdout == "fine\n"
