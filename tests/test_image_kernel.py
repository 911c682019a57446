"""Python contexts on a template image's own interpreter (runtime/kernel_image_python.py).

Real processes, driven the way the agent drives them: a ContextManager given the image's interpreter
(``python=``, what the agent's config carries) starts image_kernel/kernel.py on it with the spec's
launcher, and runs go through Context.run to the E2B lines a client would get. The "images" are the
interpreters of this machine that are not the runtime's: Debian's /usr/bin/python3 (3.11, no numpy)
and pyenv's 3.12 and 3.8 builds, in throwaway venvs where a test installs packages.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from agentcell.runtime import kernel_image_python
from agentcell.runtime.kernel import Context, ContextManager
from agentcell.runtime.reaper import Reaper

DEBIAN = "/usr/bin/python3"
PYENV = Path("/root/.pyenv/versions")
RUNTIME_SITE = sysconfig.get_paths()["purelib"]
# what matplotlib and pandas need, linked from the runtime's venv into an "image" venv of the same ABI
_DATA_SCIENCE = ("numpy", "numpy.libs", "matplotlib", "mpl_toolkits", "pyparsing", "cycler", "kiwisolver",
                 "fontTools", "PIL", "pillow.libs", "dateutil", "packaging", "contourpy", "six.py", "pandas",
                 "pytz", "tzdata")  # fmt: skip


def _pyenv(prefix: str) -> str | None:
    for d in sorted(PYENV.glob(prefix + ".*")) if PYENV.is_dir() else []:
        exe = d / "bin" / "python3"
        if exe.exists():
            return str(exe)
    return None


PY312 = _pyenv("3.12")
PY38 = _pyenv("3.8")


class Lines:
    """A run's sink (agent.Call's part that kernel.Context.run uses): the E2B lines, in order."""

    cancelled = False

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def can_emit_line(self) -> bool:
        return True

    async def wait_line_slot(self) -> None:
        pass

    def emit_line(self, line: bytes) -> None:
        self.lines.append(json.loads(line))

    async def send_line(self, line: bytes) -> None:
        self.lines.append(json.loads(line))

    def hold_line(self, line: bytes) -> bool:
        self.lines.append(json.loads(line))
        return True

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [line for line in self.lines if line["type"] == kind]

    @property
    def stdout(self) -> str:
        return "".join(line["text"] for line in self.of("stdout"))

    @property
    def stderr(self) -> str:
        return "".join(line["text"] for line in self.of("stderr"))

    @property
    def count(self) -> int:
        """The run's execution count (its line may come after output the agent drained first)."""
        (line,) = self.of("number_of_executions")
        return int(line["execution_count"])

    @property
    def main(self) -> dict[str, Any] | None:
        found = [r for r in self.of("result") if r["is_main_result"]]
        return found[0] if found else None

    @property
    def error(self) -> dict[str, Any] | None:
        errors = self.of("error")
        return errors[0] if errors else None


class Image:
    """Contexts of one "image": a ContextManager whose Python is `python`."""

    def __init__(self, python: str, home: str, envs: dict[str, str] | None = None) -> None:
        self.reaper = Reaper()
        self.reaper.install(asyncio.get_running_loop())
        base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8",
                "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INDEX": "1"}  # fmt: skip
        self.manager = ContextManager(self.reaper, {**base, **(envs or {})}, home, python=python)

    def context(self) -> Context:
        return self.manager.create("python")

    async def run(self, ctx: Context, code: str, env_vars: dict[str, str] | None = None, timeout_ms: int = 60_000,
                  on_interrupt: Callable[[Callable[[], None]], None] = lambda f: None) -> Lines:  # fmt: skip
        sink = Lines()
        await ctx.run(code, env_vars, timeout_ms, sink, on_interrupt)
        return sink

    def close(self) -> None:
        self.manager.close()
        asyncio.get_running_loop().remove_signal_handler(signal.SIGCHLD)


@contextlib.asynccontextmanager
async def image(python: str, home: str, envs: dict[str, str] | None = None) -> AsyncIterator[Image]:
    img = Image(python, home, envs)
    try:
        yield img
    finally:
        img.close()


def make_venv(python: str, path: Path, with_pip: bool = False) -> str:
    """A venv of `python` without network: pip, if asked, linked from the interpreter's own install."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(path)], check=True)
    exe = str(path / "bin" / "python")
    if with_pip:
        pip_of = subprocess.run([python, "-c", "import pip, os; print(os.path.dirname(pip.__file__))"],
                                check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
        site_dir = subprocess.run([exe, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
        os.symlink(pip_of, os.path.join(site_dir, "pip"))
    return exe


def make_wheel(directory: Path, name: str, version: str, source: str) -> Path:
    """A pure-Python wheel of one module, made here (pip installs it with no index, no build)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": source,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: agentcell-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


@pytest.fixture
def home(tmp_path: Path) -> str:
    h = tmp_path / "home"
    h.mkdir()
    return str(h)


needs_312 = pytest.mark.skipif(PY312 is None, reason="needs pyenv's Python 3.12")


# --------------------------------------------------------------------------------------------------


@needs_312
async def test_runs_on_the_images_interpreter_with_state_prints_and_results(home: str) -> None:
    assert PY312 is not None
    async with image(PY312, home) as img:
        ctx = img.context()
        first = await img.run(ctx, "import sys\nx = 41\nprint('hi', sys.version_info[:2])\nx + 1")
        assert first.of("number_of_executions") == [{"type": "number_of_executions", "execution_count": 1}]
        assert first.stdout == "hi (3, 12)\n"
        assert first.main == {"type": "result", "text": "42", "extra": {}, "is_main_result": True}
        second = await img.run(ctx, "x, sys.executable")
        assert second.count == 2
        assert second.main is not None and second.main["text"] == f"(41, '{PY312}')"
        # a string's repr without its quotes, lists and dicts as JSON too, as E2B's kernels
        assert (await img.run(ctx, "'str'")).main["text"] == "str"  # type: ignore[index]
        res = (await img.run(ctx, "{'a': [1, 2], 3: None}")).main
        assert res is not None and res["text"] == "{'a': [1, 2], 3: None}" and res["json"] == {"a": [1, 2], "3": None}
        html = (await img.run(ctx, "class T:\n    def _repr_html_(self): return '<b>t</b>'\nT()")).main
        assert html is not None and html["html"] == "<b>t</b>" and html["text"].startswith("<__main__.T at 0x")
        assert (await img.run(ctx, "x = 5;")).main is None
        assert (await img.run(ctx, "7;")).main is None  # a trailing ';' shows nothing, as IPython
        shown = await img.run(ctx, "display('a'); display([1])")
        assert [(r["text"], r["is_main_result"]) for r in shown.of("result")] == [("a", False), ("[1]", False)]
        awaited = await img.run(ctx, "import asyncio\nasync def f():\n    await asyncio.sleep(0)\n    return 3\nawait f()")
        assert awaited.main is not None and awaited.main["text"] == "3"


@needs_312
async def test_errors_have_ipython_tracebacks_and_the_context_lives_on(home: str) -> None:
    assert PY312 is not None
    async with image(PY312, home) as img:
        ctx = img.context()
        await img.run(ctx, "def f(a):\n    return a / 0")
        err = (await img.run(ctx, "y = 1\nf(3)")).error
        assert err is not None
        assert err["name"] == "ZeroDivisionError" and err["value"] == "division by zero"
        assert err["traceback"] == (
            "-" * 75 + "\n"
            "ZeroDivisionError                         Traceback (most recent call last)\n"
            "Cell In[2], line 2\n"
            "      1 y = 1\n"
            "----> 2 f(3)\n\n"
            "Cell In[1], line 2, in f(a)\n"
            "      1 def f(a):\n"
            "----> 2     return a / 0\n\n"
            "ZeroDivisionError: division by zero")
        chained = (await img.run(ctx, "try:\n    {}['k']\nexcept KeyError as e:\n    raise ValueError('bad') from e")).error
        assert chained is not None and chained["name"] == "ValueError" and chained["value"] == "bad"
        assert "The above exception was the direct cause of the following exception" in chained["traceback"]
        syntax = (await img.run(ctx, "syntax error here")).error
        assert syntax is not None and syntax["name"] == "SyntaxError"
        assert syntax["traceback"].startswith("  Cell In[4], line 1\n    syntax error here\n")
        assert syntax["value"] == "invalid syntax (<ipython-input-4-868e5575f360>, line 1)"  # IPython's cell name
        exited = (await img.run(ctx, "import sys; sys.exit(3)")).error
        assert exited is not None and exited["name"] == "SystemExit" and exited["value"] == "3"
        after = await img.run(ctx, "y")
        assert after.error is None and after.main is not None and after.main["text"] == "1"
        assert after.count == 6
        deep = (await img.run(ctx, "def r(n):\n    return r(n + 1)\nr(0)")).error
        assert deep is not None and deep["name"] == "RecursionError"
        assert "\n    [... skipping similar frames: r at line 2 (" in deep["traceback"]  # as IPython folds them
        assert len(deep["traceback"]) < 2000
        awaited = (await img.run(ctx, "import asyncio\nawait asyncio.sleep('x')")).error
        assert awaited is not None and awaited["traceback"].split("\n")[2] == "Cell In[8], line 2"  # no loop frames
        bad_repr = await img.run(ctx, "class B:\n    def _repr_html_(self): raise ValueError('no html')\nB()")
        assert bad_repr.error is not None and bad_repr.error["traceback"].endswith(
            "Cell In[9], line 2, in B._repr_html_(self)\n----> 2 def _repr_html_(self): raise ValueError('no html')\n\n"
            "ValueError: no html")
        assert bad_repr.main is not None and "html" not in bad_repr.main  # the result still comes, without it


@needs_312
async def test_env_vars_per_run_set_env_and_the_working_dir(home: str, tmp_path: Path) -> None:
    assert PY312 is not None
    work = tmp_path / "work"
    work.mkdir()
    (work / "localmod.py").write_text("VALUE = 'from the cwd'\n")
    async with image(PY312, home, {"GLOBAL": "g"}) as img:
        ctx = img.manager.create("python", cwd=str(work))
        run = await img.run(ctx, "import os\n'|'.join([os.environ.get('ONE'), os.environ['GLOBAL'], os.getcwd()])",
                            {"ONE": "1"})  # fmt: skip
        assert run.main is not None and run.main["text"] == f"1|g|{work}"
        run = await img.run(ctx, "os.environ.get('ONE')")
        assert run.main is None  # the run's env var is gone after the run
        img.manager.update_envs({"GLOBAL": "changed"})  # the claim's env vars (a set_env frame)
        assert (await img.run(ctx, "os.environ['GLOBAL']")).main["text"] == "changed"  # type: ignore[index]
        assert (await img.run(ctx, "import localmod; localmod.VALUE")).main["text"] == "from the cwd"  # type: ignore[index]


@needs_312
async def test_interrupt_and_deadline_stop_a_busy_loop_and_keep_the_state(home: str) -> None:
    assert PY312 is not None
    async with image(PY312, home) as img:
        ctx = img.context()
        await img.run(ctx, "kept = 'yes'")
        interrupts: list[Callable[[], None]] = []
        task = asyncio.create_task(img.run(ctx, "print('spinning', flush=True)\nwhile True: pass",
                                           on_interrupt=interrupts.append))  # fmt: skip
        await asyncio.sleep(0.5)
        assert not task.done() and interrupts
        interrupts[0]()
        run = await asyncio.wait_for(task, 10)
        assert run.stdout == "spinning\n"
        assert run.error is not None and run.error["name"] == "KeyboardInterrupt"
        assert "----> 2 while True: pass" in run.error["traceback"]
        timed = await img.run(ctx, "import time\ntime.sleep(30)", timeout_ms=500)
        assert "Execution timed out" in timed.stderr
        assert timed.error is not None and timed.error["name"] == "KeyboardInterrupt"
        # a shell command it runs is stopped with it
        shell = await img.run(ctx, "!sleep 30", timeout_ms=500)
        assert shell.error is not None and shell.error["name"] == "KeyboardInterrupt"
        assert (await img.run(ctx, "kept")).main["text"] == "yes"  # type: ignore[index]


@needs_312
async def test_shell_escapes_and_magics(home: str, tmp_path: Path) -> None:
    assert PY312 is not None
    async with image(PY312, home) as img:
        ctx = img.context()
        name = "world"
        run = await img.run(ctx, f"name = '{name}'\n!echo hello $name {{1 + 1}}; echo oops >&2")
        assert run.stdout == "hello world 2\n" and run.stderr == "oops\n"
        captured = await img.run(ctx, "lines = !printf 'a\\nb\\n'\nlines")
        assert captured.main is not None and captured.main["json"] == ["a", "b"]
        cd = await img.run(ctx, f"%cd {tmp_path}")
        assert cd.stdout == f"{tmp_path}\n"
        assert (await img.run(ctx, "%pwd")).main["text"] == str(tmp_path)  # type: ignore[index]
        env = await img.run(ctx, "%env COLOUR=blue\nimport os; os.environ['COLOUR']")
        assert env.stdout == "env: COLOUR=blue\n" and env.main["text"] == "blue"  # type: ignore[index]
        wrote = await img.run(ctx, "%%writefile notes.txt\nline one\n")
        assert wrote.stdout == "Writing notes.txt\n"
        assert (tmp_path / "notes.txt").read_text() == "line one\n"
        bash = await img.run(ctx, "%%bash\necho from bash $((6 * 7))")
        assert bash.stdout == "from bash 42\n"
        via_shell = await img.run(ctx, "get_ipython().run_line_magic('env', 'SHADE=red')\nget_ipython().getoutput('echo $SHADE')")
        assert via_shell.stdout == "env: SHADE=red\n" and via_shell.main["json"] == ["red"]  # type: ignore[index]
        captured = await img.run(ctx, "%%capture out\nprint('quiet')\ndisplay(5)")
        assert captured.stdout == "" and captured.of("result") == []
        shown = await img.run(ctx, "out.stdout, len(out.outputs)")
        assert shown.main is not None and shown.main["text"] == "('quiet\\n', 1)"
        timed = await img.run(ctx, "%time sum(range(10))")
        assert timed.main["text"] == "45" and timed.stdout.startswith("CPU times: user ")  # type: ignore[index]
        assert "\nWall time: " in timed.stdout
        unknown = await img.run(ctx, "%nosuchmagic")
        assert unknown.stderr == "UsageError: Line magic function `%nosuchmagic` not found.\n" and unknown.error is None
        # valid Python is never rewritten, even where a line starts like a magic would
        assert (await img.run(ctx, "a = 10\nb = 3\n(a\n% b)")).main["text"] == "1"  # type: ignore[index]


@needs_312
async def test_pip_install_at_run_time_is_importable_in_the_next_run(home: str, tmp_path: Path) -> None:
    assert PY312 is not None
    python = make_venv(PY312, tmp_path / "venv", with_pip=True)
    wheel = make_wheel(tmp_path, "agentcell_probe_pkg", "1.0", "def answer():\n    return 42\n")
    other = make_wheel(tmp_path, "agentcell_probe_two", "2.0", "NAME = 'two'\n")
    async with image(python, home) as img:
        ctx = img.context()
        missing = await img.run(ctx, "import agentcell_probe_pkg")
        assert missing.error is not None and missing.error["name"] == "ModuleNotFoundError"
        pip = await img.run(ctx, f"%pip install --no-index {wheel}")
        assert "Successfully installed agentcell-probe-pkg-1.0" in pip.stdout.replace("_", "-"), pip.lines
        assert "Note: you may need to restart the kernel to use updated packages." in pip.stdout
        ok = await img.run(ctx, "import agentcell_probe_pkg\nagentcell_probe_pkg.answer()")
        assert ok.error is None and ok.main is not None and ok.main["text"] == "42"
        # installed by another process (commands.run's `pip install`), between two runs
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", str(other)], check=True,
                       env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})  # fmt: skip
        two = await img.run(ctx, "import agentcell_probe_two; agentcell_probe_two.NAME")
        assert two.error is None and two.main is not None and two.main["text"] == "two"


async def test_a_user_site_made_after_the_start_is_importable(home: str) -> None:
    """pip falls back to `--user` when site-packages is not writable (the sandbox user in
    python:3.12-slim); the user site did not exist when the kernel started."""
    async with image(DEBIAN, home) as img:
        ctx = img.context()
        assert (await img.run(ctx, "import usersitemod")).error is not None
        version = subprocess.run([DEBIAN, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
        user_site = Path(home) / ".local" / "lib" / f"python{version}" / "site-packages"
        user_site.mkdir(parents=True)
        (user_site / "usersitemod.py").write_text("WHERE = 'user site'\n")
        run = await img.run(ctx, "import usersitemod, sys; usersitemod.WHERE, sys.path.index(usersitemod.__file__.rsplit('/', 1)[0]) < sys.path.index('/usr/lib/python3/dist-packages')")
        assert run.error is None and run.main is not None and run.main["text"] == "('user site', True)"


async def test_the_runtimes_packages_are_not_importable(home: str) -> None:
    """Debian's python3 is 3.11 like the runtime: were the runtime's paths visible, its IPython,
    numpy and agentcell would import. Not even a PYTHONPATH naming them makes them visible."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(kernel_image_python.__file__)))
    repo = os.path.dirname(repo)
    envs = {"PYTHONPATH": os.pathsep.join([repo, RUNTIME_SITE, "/srv/image-own"]),
            "PATH": f"{sys.prefix}/bin:/usr/bin:/bin"}  # fmt: skip
    async with image(DEBIAN, home, envs) as img:
        ctx = img.context()
        for module in ("agentcell", "IPython", "numpy", "kernel"):
            run = await img.run(ctx, f"import {module}")
            assert run.error is not None and run.error["name"] == "ModuleNotFoundError", (module, run.lines)
        run = await img.run(ctx, "import os, sys; os.environ.get('PYTHONPATH'), sys.executable, '/srv/image-own' in sys.path")
        assert run.main is not None and run.main["text"] == f"('/srv/image-own', '{DEBIAN}', True)"
        path = await img.run(ctx, "os.environ['PATH']")
        assert path.main is not None and path.main["text"] == "/usr/bin:/bin"  # no runtime bin dir for !pip
        img.manager.update_envs({"PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin", "PYTHONPATH": repo})  # a claim's
        path = await img.run(ctx, "os.environ['PATH'], os.environ.get('PYTHONPATH')")
        assert path.main is not None and path.main["text"] == "('/usr/local/bin:/usr/bin', None)"
        # the control socket is not inherited by what the code starts
        fds = await img.run(ctx, "!ls /proc/self/fd")
        assert sorted(int(x) for x in fds.stdout.split()) == [0, 1, 2, 3]  # 3: ls's own directory fd


async def test_no_matplotlib_in_the_image_is_no_crash(home: str) -> None:
    async with image(DEBIAN, home) as img:
        ctx = img.context()
        run = await img.run(ctx, "import matplotlib.pyplot as plt")
        assert run.error is not None and run.error["name"] == "ModuleNotFoundError"
        assert (await img.run(ctx, "1 + 1")).main["text"] == "2"  # type: ignore[index]


@pytest.mark.skipif(not os.path.isdir(os.path.join(RUNTIME_SITE, "matplotlib")), reason="needs the runtime's matplotlib")
async def test_an_image_with_pandas_and_matplotlib_gets_html_data_and_png(home: str, tmp_path: Path) -> None:
    """An "image" whose Python has the data-science packages (a venv of Debian's 3.11 with the
    runtime's copies linked in: same ABI): DataFrames as HTML and E2B data, figures as PNGs."""
    python = make_venv(DEBIAN, tmp_path / "ds")
    site_dir = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    for name in _DATA_SCIENCE:
        if os.path.exists(os.path.join(RUNTIME_SITE, name)):
            os.symlink(os.path.join(RUNTIME_SITE, name), os.path.join(site_dir, name))
    async with image(python, home, {"MPLBACKEND": "TkAgg"}) as img:  # the kernel uses Agg whatever the env says
        ctx = img.context()
        df = (await img.run(ctx, "import pandas as pd\npd.DataFrame({'a': [1, 2]})")).main
        assert df is not None and df["html"].startswith("<div>") and "<table" in df["html"]
        assert df["data"] == {"a": [1, 2]} and df["text"] == "   a\n0  1\n1  2"
        shown = await img.run(ctx, "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nprint('after')")
        assert shown.stdout == "after\n" and shown.error is None, shown.lines
        figures = shown.of("result")
        assert len(figures) == 1 and not figures[0]["is_main_result"]
        assert figures[0]["text"] == "<Figure size 640x480 with 1 Axes>"
        assert base64.b64decode(figures[0]["png"])[:8] == b"\x89PNG\r\n\x1a\n"
        show = await img.run(ctx, "import time\nplt.figure(); plt.plot([3]); plt.show(); time.sleep(0.3); print('x')")
        assert [line["type"] for line in show.lines if line["type"] != "number_of_executions"] == ["result", "stdout"]
        assert (await img.run(ctx, "plt.get_fignums()")).main["text"] == "[]"  # type: ignore[index]
        assert (await img.run(ctx, "import numpy as np\nnp.arange(3)")).main["text"] == "array([0, 1, 2])"  # type: ignore[index]


@pytest.mark.skipif(PY38 is None, reason="needs pyenv's Python 3.8")
async def test_the_oldest_supported_python(home: str) -> None:
    assert PY38 is not None
    async with image(PY38, home) as img:
        ctx = img.context()
        run = await img.run(ctx, "import sys\nprint(sys.version_info[:2])\n[i * i for i in range(3)]")
        assert run.stdout == "(3, 8)\n" and run.main is not None and run.main["json"] == [0, 1, 4]
        err = (await img.run(ctx, "def g():\n    raise RuntimeError('x')\ng()")).error
        assert err is not None and "Cell In[2], line 2, in g()" in err["traceback"]


async def test_which_interpreter_is_used(home: str, tmp_path: Path) -> None:
    """No usable image Python (none, not executable, older than 3.8): the runtime's forked context."""
    assert not kernel_image_python.usable(None)
    assert not kernel_image_python.usable(str(tmp_path / "nope"))
    old = tmp_path / "python3.7"
    old.write_text("#!/bin/sh\n")
    old.chmod(0o755)
    assert not kernel_image_python.usable(str(old))
    assert kernel_image_python.usable(DEBIAN)
    async with image(str(old), home) as img:  # a python3.7: the runtime's IPython context instead
        ctx = img.context()
        run = await img.run(ctx, "import sys, IPython; sys.version_info[:2] == (3, 11)")
        assert run.error is None and run.main is not None and run.main["text"] == "True"


def test_the_script_stays_standard_library_only() -> None:
    """The script imports nothing but the standard library, and compiles for 3.8's grammar."""
    source = Path(kernel_image_python.SCRIPT).read_text()
    assert "agentcell" not in [line.split()[1].split(".")[0] for line in source.splitlines()
                               if line.startswith(("import ", "from "))]  # fmt: skip
    if PY38 is not None:
        subprocess.run([PY38, "-c", f"import ast; ast.parse(open({kernel_image_python.SCRIPT!r}).read())"], check=True)
    assert shutil.which("python3") is not None


def test_finding_the_images_python_in_its_tree(tmp_path: Path) -> None:
    """Inside the image's unpacked tree only: links resolved against it, never against the host."""
    root = tmp_path / "rootfs"
    for d in ("usr/local/bin", "usr/bin", "bin", "etc/alternatives", "opt/venv/bin"):
        (root / d).mkdir(parents=True)

    def exe(rel: str) -> None:
        (root / rel).write_text("#!/bin/sh\n")
        (root / rel).chmod(0o755)

    assert kernel_image_python.find_in_image(str(root)) is None  # no Python: the runtime's contexts
    exe("usr/bin/python3.11")
    (root / "etc/alternatives/python3").symlink_to("/usr/bin/python3.11")  # absolute: inside the image
    (root / "usr/bin/python3").symlink_to("/etc/alternatives/python3")
    assert kernel_image_python.find_in_image(str(root)) == "/usr/bin/python3"
    exe("usr/local/bin/python3.12")
    (root / "usr/local/bin/python3").symlink_to("python3.12")
    assert kernel_image_python.find_in_image(str(root)) == "/usr/local/bin/python3"
    # the image config's PATH first: a venv's interpreter, by its own path (so it finds pyvenv.cfg)
    (root / "opt/venv/bin/python3").symlink_to("/usr/local/bin/python3.12")
    assert kernel_image_python.find_in_image(str(root), "/opt/venv/bin:/usr/bin") == "/opt/venv/bin/python3"
    # a link out of the tree resolves inside it (as in the sandbox), to nothing here
    (root / "opt/venv/bin/python3").unlink()
    (root / "opt/venv/bin/python3").symlink_to("../../../../../../../../usr/bin/python3.11-host")
    assert kernel_image_python.find_in_image(str(root), "/opt/venv/bin") == "/usr/local/bin/python3"
    # too old, or not executable: skipped
    (root / "usr/local/bin/python3").unlink()
    exe("usr/local/bin/python3.7")
    (root / "usr/local/bin/python3").symlink_to("python3.7")
    (root / "usr/bin/python3.11").chmod(0o644)
    assert kernel_image_python.find_in_image(str(root)) is None


_IN_SANDBOX_DRIVER = """
import asyncio, json, os
from agentcell.runtime.kernel import ContextManager
from agentcell.runtime.reaper import Reaper

class Sink:
    cancelled = False
    def __init__(self): self.lines = []
    def can_emit_line(self): return True
    async def wait_line_slot(self): pass
    def emit_line(self, line): self.lines.append(json.loads(line))
    async def send_line(self, line): self.lines.append(json.loads(line))
    def hold_line(self, line): self.lines.append(json.loads(line)); return True

async def main():
    reaper = Reaper()
    reaper.install(asyncio.get_running_loop())
    contexts = ContextManager(reaper, dict(os.environ), os.environ["HOME"], python="/usr/bin/python3")
    ctx = contexts.create("python")
    out = []
    for code, timeout_ms in json.loads(os.environ["CELLS"]):
        sink = Sink()
        await ctx.run(code, {}, timeout_ms, sink, lambda f: None)
        out.append([line for line in sink.lines if line["type"] in ("result", "error", "stdout")])
    contexts.close()
    print(json.dumps(out))

asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for sandboxes")
async def test_in_a_sandbox_the_kernel_runs_from_the_runtime_on_the_systems_python() -> None:
    """In a real sandbox (the probe backend), as the sandbox user: the script is read from the
    runtime's read-only tree, the sandbox's /usr/bin/python3 runs it, the image's own packages
    (Debian's dist-packages: yaml) import, the runtime's (agentcell) do not, and an interrupt stops it."""
    from helpers import ProbeBox, probe_backend

    cells = [
        ["import sys, os, yaml\nprint(sys.executable, os.getuid())\nyaml.safe_load('a: 1')", 30_000],
        ["import agentcell", 30_000],
        ["while True: pass", 700],
        ["!echo from the shell", 30_000],
    ]
    async with probe_backend() as backend:
        box = await ProbeBox.create(backend, "ik")
        try:
            code, out, err = await box.run("env", f"CELLS={json.dumps(cells)}", "python3", "-c", _IN_SANDBOX_DRIVER)
        finally:
            await backend.kill(box.sandbox)
    assert code == 0, err
    first, runtime, loop, shell = json.loads(out)
    assert (first[0]["type"], first[0]["text"]) == ("stdout", "/usr/bin/python3 1000\n")
    assert first[1]["type"] == "result" and first[1]["json"] == {"a": 1}
    assert runtime[0]["type"] == "error" and runtime[0]["name"] == "ModuleNotFoundError"
    assert loop[-1]["type"] == "error" and loop[-1]["name"] == "KeyboardInterrupt"
    assert shell[0]["text"] == "from the shell\n"
