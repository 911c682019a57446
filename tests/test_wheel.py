"""`pip install agentcell` is the install (issue 26): a wheel built from this tree, installed with its
dependencies from the package registry into a fresh venv of the system's Python (no extras, no checkout),
serves sandboxes with the default template's runtime, charts, JS/TS contexts and a behaviour record with
the processes, the kernel tracer loaded from the object the wheel ships (setup.py).

SLOW: the first test that needs `installed` builds the wheel and the venv, once for the module (about
a minute with pip's cache; the servers then build the venv's runtime store, ~15 s each start). The
tests before those run from the tree and take seconds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell import Sandbox
from agentcell.backends.linux import runtime_store
from agentcell.policy.linux import exec_guard
from agentcell.record import report
from agentcell.record.events import event, not_recorded
from agentcell.record.linux import bpf_build, kernel_trace
from tests.conftest import REPO
from tests.helpers import wait_until
from tests.servers import ServerProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="sandboxes and the kernel tracer need root")

SYSTEM_PYTHON = "/usr/bin/python3"
FIRST, LAST = 3_500_100, 3_500_109  # a uid range no server of these tests uses (as test_kernel_trace's)
# what the wheel holds of node_modules: the files runner.js and transform.js load, and the licenses
JS_VENDORED = {
    "acorn/package.json", "acorn/LICENSE", "acorn/dist/acorn.js",
    "acorn-walk/package.json", "acorn-walk/LICENSE", "acorn-walk/dist/walk.js",
    "typescript/package.json", "typescript/LICENSE.txt", "typescript/ThirdPartyNoticeText.txt",
    "typescript/lib/typescript.js",
}
FALLBACK = "instead of the kernel tracer"  # audit_events' line when the tracer cannot run

# Run by the venv's python, outside the tree: the wheel's SDK against the wheel's server (argv[1]: its
# URL; empty: the embedded server). Prints what it saw as JSON.
SMOKE = r"""
import base64, json, shutil, sys, time
import agentcell
from agentcell import Sandbox

out = {"package": agentcell.__file__}
sbx = Sandbox.create(api_url=sys.argv[1] or None, timeout=300)
try:
    sbx.run_code("x = 41")
    out["state"] = sbx.run_code("x + 1").text
    ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()")
    out["chart_error"] = ex.error and ex.error.value
    out["charts"] = [{"png": base64.b64decode(r.png)[:8].hex() if r.png else None,
                      "chart": (r.chart or {}).get("type") if isinstance(r.chart, dict) else None} for r in ex.results]
    r_context = (("r", "sum(1:3)"),) if shutil.which("Rscript") else ()  # a host with R: its runner is in the wheel
    for language, code in (("javascript", "const a = [1, 2, 3]; a.map((v) => v * 2)"),
                           ("typescript", "const n: number = 40; n + 2"), *r_context):
        ex = sbx.run_code(code, context=sbx.create_code_context(language=language))
        out[language] = [ex.text, ex.error and f"{ex.error.name}: {ex.error.value}"]
    run = sbx.commands.run("ls /")
    out["ls"] = [run.exit_code, run.stdout.split()]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        out["execs"] = [e.get("argv") for e in sbx.events(kinds="process.exec")]
        if ["ls", "/"] in out["execs"]:
            break
        time.sleep(0.2)
    out["report"] = sbx.report(format="text")
finally:
    sbx.kill()
print(json.dumps(out))
"""


# -- from the tree (fast) ------------------------------------------------------------------------------


def test_the_shipped_tracer_object_is_loaded_and_only_for_its_own_source(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A compiled object next to the source (as setup.py puts it in a wheel) is loaded without a
    compile; once the source differs from the one it was compiled from, it is not."""
    source = tmp_path / bpf_build.SOURCE_NAME
    shutil.copy(kernel_trace.SOURCE, source)
    shipped = tmp_path / bpf_build.object_name(source.read_bytes())
    bpf_build.compile_object(source, shipped)
    cache = tmp_path / "cache"
    monkeypatch.setattr(kernel_trace, "CACHE", cache)
    assert kernel_trace.build(source) == shipped
    trace = kernel_trace.KernelTrace(FIRST, LAST, source=source)  # libbpf loads it (CO-RE, this kernel's BTF)
    trace.close()
    assert not cache.exists()  # nothing compiled
    source.write_bytes(source.read_bytes() + b"\n// edited\n")
    built = kernel_trace.build(source)
    assert built.parent == cache and built.name == bpf_build.object_name(source.read_bytes())


def test_the_report_says_which_part_the_host_did_not_record() -> None:
    why = "cannot reach the kernel's audit subsystem (ECONNREFUSED)"
    events = [{**not_recorded("processes", why), "seq": 1},
              {**event("api.call", action="process.Start"), "seq": 2}]
    built = report.build(events)
    assert built["not_recorded"] == {"processes": why} and built["processes"] == []
    text = report.render(built)
    assert f"\nPROCESSES: not recorded ({why})\n" in text
    assert "\nFILES\n" in text and "\nLIMITS\n" in text  # those were recorded (and nothing happened)
    assert "not recorded" not in report.render(report.build(events[1:]))


def test_a_server_that_cannot_build_its_tracer_says_so_in_one_line_and_records_with_audit(tmp_path: Path) -> None:
    """The tree ships no compiled tracer; with a cache it cannot write, the server cannot have one: it
    says why and how to fix it in one line, and audit's rules record the processes."""
    with ServerProcess(tmp_path / "server.log", env={"AGENTCELL_BPF_CACHE": "/dev/null/bpf"}) as srv:
        sbx = Sandbox.create(api_url=srv.url)
        try:
            assert sbx.commands.run("ls /").exit_code == 0
            wait_until("the record's exec of ls /", lambda: ["ls", "/"] in [
                e.get("argv") for e in sbx.events(kinds="process.exec")], timeout=10, interval=0.2)
            assert "not recorded" not in sbx.report(format="text")
        finally:
            sbx.kill()
    lines = [line for line in srv.log().splitlines() if FALLBACK in line]
    assert len(lines) == 1 and "AGENTCELL_BPF_CACHE" in lines[0] and "/dev/null/bpf" in lines[0], srv.log()[-3000:]


# -- the wheel (slow: built and installed once for the module) --------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(REPO)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    (built,) = out.glob("agentcell-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv of the system's Python with the wheel and its dependencies (from the registry) only:
    its bin directory."""
    if not Path(SYSTEM_PYTHON).exists():
        pytest.skip(f"no {SYSTEM_PYTHON}")
    venv = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
    done = subprocess.run([str(venv / "bin/pip"), "install", "-q", str(wheel)], capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stderr[-4000:]
    yield venv / "bin"
    _remove_store_parts_of(venv)


def _remove_store_parts_of(venv: Path) -> None:
    """The runtime store's parts built from this test's venv (~400 MB each; the servers are stopped):
    those holding hard links to its files. Left alone, the store would keep them for a day."""
    probes = [p for p in (venv / "lib").rglob("*.so") if p.is_file()][:20]
    store = Path(runtime_store.STORE_DIR)
    for part in store.glob("venv-*") if store.is_dir() else ():
        ours = False
        for probe in probes:
            linked = part / probe.relative_to(venv)
            with contextlib.suppress(OSError):
                ours = os.path.samestat(os.stat(linked), os.stat(probe))
            if ours:
                break
        if not ours:
            continue
        fd = os.open(f"{part}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (the store's own collector's test: no server holds it)
            shutil.rmtree(part, ignore_errors=True)
            os.unlink(f"{part}.lock")
        except BlockingIOError:
            pass
        finally:
            os.close(fd)


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything pointing at the tree or at a server."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "AGENTCELL_URL", "AGENTCELL_API_KEY", "E2B_API_KEY")}
    return {**env, "AGENTCELL_EGRESS_UPLINK": "none", "PYTHONUNBUFFERED": "1", **extra}


def _smoke(bin_dir: Path, url: str, cwd: Path, env: dict[str, str]) -> dict:
    done = subprocess.run([str(bin_dir / "python"), "-c", SMOKE, url], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_smoke(out: dict, bin_dir: Path) -> None:
    assert out["package"].startswith(str(bin_dir.parent) + "/")  # the wheel's agentcell, not the tree's
    assert out["state"] == "42"
    assert out["chart_error"] is None
    assert {"png": "89504e470d0a1a0a", "chart": "line"} in out["charts"]  # a PNG, and E2B's chart of it
    assert out["javascript"] == ["[ 2, 4, 6 ]", None]
    assert out["typescript"] == ["42", None]
    assert out.get("r", ["[1] 6", None]) == ["[1] 6", None]
    assert out["ls"][0] == 0 and "usr" in out["ls"][1]
    assert ["ls", "/"] in out["execs"], out["execs"]
    assert "ls /" in out["report"] and "not recorded" not in out["report"]


def test_the_wheel_holds_the_compiled_tracer_and_only_the_js_files_that_run(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    listing = subprocess.run(["unzip", "-l", str(wheel)], capture_output=True, text=True, check=True).stdout
    source = kernel_trace.SOURCE.read_bytes()
    bpf = "agentcell/record/linux/bpf/"
    assert {n for n in names if n.startswith(bpf)} == {bpf + bpf_build.SOURCE_NAME, bpf + bpf_build.object_name(source)}
    bpf = "agentcell/policy/linux/bpf/"
    guard = exec_guard.SOURCE.read_bytes()  # the exec policy's guard, shipped alike
    assert {n for n in names if n.startswith(bpf)} == {bpf + exec_guard.SOURCE.name,
                                                       bpf + bpf_build.object_name(guard, stem="exec_guard")}
    modules = "agentcell/runtime/js/node_modules/"
    assert {n[len(modules):] for n in names if n.startswith(modules)} == JS_VENDORED
    assert not re.search(r"\.d\.ts|diagnosticMessages|\.bin/|tsserver|/bin/|\.map\b", listing)
    assert {"agentcell/runtime/js/runner.js", "agentcell/runtime/js/transform.js"} <= names
    # the web console's pages, built (scripts/build-console): the index and the assets it names
    index = zipfile.ZipFile(wheel).read("agentcell/console/static/index.html").decode()
    assets = re.findall(r'"/ui/assets/([^"]+)"', index)
    assert len(assets) == 2 and {f"agentcell/console/static/assets/{a}" for a in assets} <= names
    size = wheel.stat().st_size
    print(f"\nwheel: {wheel.name} {size / 1e6:.2f} MB, {len(names)} files")
    assert size < 4_000_000  # (typescript.js is 9 MB of it unpacked, ~2 MB compressed)


def test_without_clang_the_build_fails_unless_a_wheel_without_the_tracer_is_asked_for(
        wheel: Path, tmp_path: Path) -> None:
    """A machine without clang builds no wheel, unless AGENTCELL_WHEEL_WITHOUT_TRACER=1 asks for one
    without the compiled tracer. (After `wheel`: its build made the tree's node_modules if needed.)"""
    empty = tmp_path / "bin"  # a PATH with no clang (pip runs its build with this very interpreter)
    empty.mkdir()
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"), str(REPO)]
    refused = subprocess.run(build, capture_output=True, text=True, timeout=900, env={**os.environ, "PATH": str(empty)})
    assert refused.returncode != 0 and "no clang to build the kernel tracer" in refused.stderr
    assert "AGENTCELL_WHEEL_WITHOUT_TRACER=1" in refused.stderr and not list(tmp_path.glob("dist/*.whl"))
    allowed = subprocess.run(build, capture_output=True, text=True, timeout=900,
                             env={**os.environ, "PATH": str(empty), "AGENTCELL_WHEEL_WITHOUT_TRACER": "1"})
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    (without,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(without).namelist()
    assert "agentcell/record/linux/bpf/kernel_trace.bpf.c" in names and not [n for n in names if n.endswith(".bpf.o")]


def test_agentcell_serve_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    """`agentcell serve` from the venv, on a loopback port, no uplink; the tracer from the wheel's
    object (its compile cache stays empty)."""
    cache = tmp_path / "bpf-cache"
    env = _clean_env(AGENTCELL_BPF_CACHE=str(cache))
    with ServerProcess(tmp_path / "server.log", "--egress-uplink", "none", "--state-dir", str(tmp_path / "state"),
                       command=[str(installed / "agentcell"), "serve"], base_env=env, cwd=tmp_path,
                       start_timeout=300, stop_timeout=30) as srv:
        out = _smoke(installed, srv.url, tmp_path, env)
    server_log = srv.log()
    _check_smoke(out, installed)
    assert FALLBACK not in server_log and "has no processes" not in server_log, server_log[-3000:]
    assert not cache.exists() or not any(cache.iterdir())  # the shipped object: nothing compiled


MICROVM_SMOKE = r"""
import json, sys
import agentcell
from agentcell import Sandbox

sbx = Sandbox.create(api_url=sys.argv[1], timeout=600, request_timeout=600)
try:
    sbx.run_code("x = 41")
    print(json.dumps({"package": agentcell.__file__, "state": sbx.run_code("x + 1").text,
                      "uid": sbx.commands.run("id -u").stdout.strip(),
                      "guest_package": sbx.run_code("import agentcell; agentcell.__file__").text}))
finally:
    sbx.kill()
"""


@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None
                    or not os.path.isdir(os.path.join("/var/lib/agentcell/microvm-kernel", "current")),
                    reason="the microvm backend needs QEMU and the guest kernel (scripts/setup installs both)")
def test_agentcell_serve_microvm_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    """`agentcell serve --backend microvm` from the venv: the guest's root image is built from the
    installed package (never the tree), and a sandbox of it answers."""
    env = _clean_env()
    with ServerProcess(tmp_path / "server.log", "--backend", "microvm", "--accel", "tcg", "--standbys", "1",
                       "--egress-uplink", "none", "--state-dir", str(tmp_path / "state"),
                       command=[str(installed / "agentcell"), "serve"], base_env=env, cwd=tmp_path,
                       start_timeout=900, stop_timeout=60) as srv:
        done = subprocess.run([str(installed / "python"), "-c", MICROVM_SMOKE, srv.url], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:] + srv.log()[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["package"].startswith(str(installed.parent) + "/")
    assert (out["state"], out["uid"]) == ("42", "1000")
    # the guest's agentcell: the runtime store's copy of the installed package, at its neutral path
    assert out["guest_package"].strip("'").startswith(runtime_store.NEUTRAL_ROOT + "/"), out


def test_embedded_sandbox_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    """`Sandbox.create()` with no URL: the SDK starts the venv's own server."""
    cache = tmp_path / "bpf-cache"
    out = _smoke(installed, "", tmp_path, _clean_env(AGENTCELL_BPF_CACHE=str(cache)))
    _check_smoke(out, installed)
    assert not cache.exists() or not any(cache.iterdir())
