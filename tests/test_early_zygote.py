"""A warm start launches the "base" zygote from the last start's runtime parts before the store check
(runtime_prefetch, zygote_process), so it imports while the server does. The check decides: the same
parts, and that zygote serves; other parts (a venv or checkout changed since), and it is discarded, so
sandboxes never run what the check did not find. Real servers on a runtime store of the test's own."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell import Sandbox
from tests.servers import SERVE, ServerProcess

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the server needs root")
KEPT = "launched early from the last start's runtime: kept"
DISCARDED = "launched early from the last start's runtime: discarded"


@pytest.fixture(scope="module")
def store() -> Iterator[Path]:
    """A runtime store of this module's own (on /var/lib: the store hard-links the venv's files)."""
    base = Path(f"/var/lib/agentcell-test-early-{os.getpid()}")
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o700)
    try:
        yield base / "runtime"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _serve(store: Path, tmp: Path, n: int) -> ServerProcess:
    return ServerProcess(tmp / f"serve-{n}.log", "--egress-uplink", "none", "--standbys", "1", "--log-level", "debug",
                         command=SERVE, env={"AGENTCELL_RUNTIME_STORE": str(store), "PYTHONPATH": str(REPO)},
                         start_timeout=300).started()  # the first start builds the store


def _run(url: str, code: str) -> tuple[str, str | None]:
    with Sandbox.create(api_url=url, timeout=120) as sbx:
        ex = sbx.run_code(code)
        return "".join(ex.logs.stdout), ex.error.name if ex.error else None


def test_the_early_zygote_serves_when_the_runtime_is_unchanged_and_goes_when_it_changed(
        store: Path, tmp_path: Path) -> None:
    srv = _serve(store, tmp_path, 1)  # the first start: builds the store, notes its parts
    srv.stop()
    first = srv.log()
    assert KEPT not in first and DISCARDED not in first, first[-3000:]  # nothing to launch early from
    notes = list(store.glob(".last-*"))
    assert len(notes) == 1, notes

    with _serve(store, tmp_path, 2) as srv:  # a warm start
        assert KEPT in srv.log(), srv.log()[-3000:]
        assert _run(srv.url, "import agentcell.runtime.agent\nprint('ok')") == ("ok\n", None)

    # The note now names a part whose content differs from what the check finds (as after an edit of
    # the checkout): a copy of the package part with one module more.
    parts = json.loads(notes[0].read_text())
    real = next(name for name, target in parts if target == "/opt/agentcell/lib/agentcell")
    stale = "agentcell-" + "f" * 16
    shutil.copytree(store / real, store / stale, symlinks=True)
    (store / stale / "early_zygote_marker.py").write_text("MARK = 1\n")
    (store / f"{stale}.lock").touch(mode=0o600)
    notes[0].write_text(json.dumps([[stale if name == real else name, target] for name, target in parts]))

    with _serve(store, tmp_path, 3) as srv:
        out, error = _run(srv.url, "import agentcell\ntry:\n    import agentcell.early_zygote_marker\n"
                          "    print('stale')\nexcept ImportError:\n    print('checked')")
        assert (out, error) == ("checked\n", None)
        assert DISCARDED in srv.log(), srv.log()[-3000:]
    assert json.loads(notes[0].read_text()) == parts  # the note names what the check found again
