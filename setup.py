"""The wheel's build step (the configuration is pyproject.toml's): build_py also puts in the package what
a host would otherwise need build tools for at run time.

* The eBPF programs, compiled (bpf_build.SOURCES: the kernel tracer, the exec policy's LSM programs and guard):
  e.g. agentcell/record/linux/bpf/kernel_trace-<source hash>-<machine>.bpf.o next to its source
  (agentcell/record/linux/bpf_build.py). Needs clang and libbpf's headers here, not on the hosts.
  Without clang the build fails, unless AGENTCELL_WHEEL_WITHOUT_TRACER=1 allows a wheel whose servers
  must compile them themselves (or record processes with audit rules, at a cost to every syscall, and
  refuse exec policies).
* The JS/TS contexts' parser and transpiler: of agentcell/runtime/js/node_modules (`npm ci`, run here
  if it is missing), only the files runner.js and transform.js load, their package.json and licenses.
* The web console's pages (console/), built by scripts/build-console (npm ci + esbuild) into
  agentcell/console/static/: the wheel ships the built files, so a host needs no Node.js for /ui.

An editable install (`pip install -e`, scripts/setup) gets none of them here: a checkout compiles the tracer at a
server's start and has its node_modules and the console's built pages from scripts/setup.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
JS_DIR = Path("agentcell/runtime/js")
# per npm package: what `require` reads (package.json resolves its entry point) and its license texts
JS_FILES = {
    "acorn": ("package.json", "LICENSE", "dist/acorn.js"),
    "acorn-walk": ("package.json", "LICENSE", "dist/walk.js"),
    "typescript": ("package.json", "LICENSE.txt", "ThirdPartyNoticeText.txt", "lib/typescript.js"),
}
WITHOUT_TRACER = "AGENTCELL_WHEEL_WITHOUT_TRACER"
CONSOLE_STATIC = Path("agentcell/console/static")


class WheelBuildError(RuntimeError):
    """Something the wheel must ship cannot be made here; the message says what to install."""


def _bpf_build():  # noqa: ANN202 - the module, loaded by path: agentcell's dependencies are not installed here
    spec = importlib.util.spec_from_file_location("_agentcell_bpf_build", ROOT / "agentcell/record/linux/bpf_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _say(message: str) -> None:
    print(f"\n*** agentcell wheel: {message}\n", file=sys.stderr, flush=True)


def compile_bpf(build_lib: Path) -> None:
    bpf = _bpf_build()
    for name in bpf.SOURCES:
        compile_one(bpf, ROOT / name, build_lib / Path(name).parent)


def compile_one(bpf, source: Path, out_dir: Path) -> None:  # noqa: ANN001 - bpf: the module loaded by path
    stem = bpf.stem_of(source.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(f"{stem}-*.bpf.o"):  # an earlier build's, of another source
        stale.unlink()
    try:
        bpf.compile_object(source, out_dir / bpf.object_name(source.read_bytes(), stem=stem))
    except bpf.BpfBuildError as e:
        if os.environ.get(WITHOUT_TRACER) == "1":
            _say(f"WITHOUT {bpf.what(source)} compiled ({WITHOUT_TRACER}=1): {e}. Servers installed from this "
                 "wheel need clang and libbpf-dev to compile it (or record processes with audit rules, and "
                 "refuse exec policies).")
            return
        raise WheelBuildError(f"{e}: the wheel ships it compiled (set {WITHOUT_TRACER}=1 to build a wheel "
                              "without it, whose servers then need clang or record processes with audit rules)") from None


def vendor_js(build_lib: Path) -> None:
    modules = ROOT / JS_DIR / "node_modules"
    missing = [f"{pkg}/{f}" for pkg, files in JS_FILES.items() for f in files if not (modules / pkg / f).is_file()]
    if missing:
        npm = shutil.which("npm")
        if npm is None:
            raise WheelBuildError(f"{modules} lacks {', '.join(missing)} and there is no npm to install them: "
                                  "install npm (apt install npm), or run `npm ci` there")
        _say(f"npm ci in {JS_DIR} (the JS contexts' parser and transpiler, pinned by its package-lock.json)")
        done = subprocess.run([npm, "ci", "--prefix", str(ROOT / JS_DIR), "--no-audit", "--no-fund", "--ignore-scripts",
                               "--loglevel=error"], capture_output=True, text=True)
        if done.returncode != 0:
            raise WheelBuildError(f"npm ci in {JS_DIR} failed: {done.stderr.strip()[-2000:]}")
    target = build_lib / JS_DIR / "node_modules"
    shutil.rmtree(target, ignore_errors=True)  # an earlier build's, whatever it held
    for pkg, files in JS_FILES.items():
        for f in files:
            (target / pkg / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(modules / pkg / f, target / pkg / f)


def build_console(build_lib: Path) -> None:
    """The console's pages built from console/ (its package-lock.json pins them) and copied into the wheel.
    Without Node.js here, the pages the tree has built already (scripts/build-console) go in, as they are."""
    built = ROOT / CONSOLE_STATIC / "index.html"
    has_node = shutil.which("npm") is not None and shutil.which("node") is not None and shutil.which("bash") is not None
    if (ROOT / "console" / "package.json").is_file() and has_node:  # a checkout (an sdist may ship them built)
        _say("building the web console (scripts/build-console: npm ci + esbuild in console/)")
        done = subprocess.run(["bash", str(ROOT / "scripts" / "build-console")], capture_output=True, text=True)
        if done.returncode != 0:
            raise WheelBuildError(f"scripts/build-console failed: {(done.stderr or done.stdout).strip()[-2000:]}")
    elif built.is_file():
        _say(f"no Node.js here: the web console as built before in {CONSOLE_STATIC} goes into the wheel")
    if not built.is_file():
        raise WheelBuildError(f"{CONSOLE_STATIC} has no built console and there is no Node.js to build it: install "
                              "nodejs and npm (apt install nodejs npm), or run `bash scripts/build-console` first")
    target = build_lib / CONSOLE_STATIC
    shutil.rmtree(target, ignore_errors=True)  # an earlier build's, with other hashed names
    shutil.copytree(ROOT / CONSOLE_STATIC, target)


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        build_lib = Path(self.build_lib)
        vendor_js(build_lib)
        build_console(build_lib)
        compile_bpf(build_lib)


setup(cmdclass={"build_py": BuildPy})
