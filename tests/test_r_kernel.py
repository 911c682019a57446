"""R code contexts in real sandboxes (runtime/kernel_r.py, r/runner.R), through agentcell's SDK and the
unchanged e2b_code_interpreter package: state, streamed output, IRkernel's error shape, PNG plots,
env vars and cwd, interrupts and deadlines, limits."""

from __future__ import annotations

import base64
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator

import pytest
from e2b_code_interpreter import Sandbox as CodeSandbox

from agentcell import Sandbox
from tests.conftest import GVISOR
from tests.helpers import execute_raw

pytestmark = pytest.mark.skipif(shutil.which("Rscript") is None,
                                reason="the host has no R (scripts/setup installs r-base-core)")


def _has_ggplot2() -> bool:
    done = subprocess.run(["Rscript", "-e", "quit(status = !requireNamespace('ggplot2', quietly = TRUE))"],
                          capture_output=True)  # fmt: skip
    return done.returncode == 0


@pytest.fixture(scope="module")
def sbx(server_url: str) -> Iterator[Sandbox]:
    s = Sandbox.create(api_url=server_url, timeout=600, envs={"GREETING": "hello"})
    yield s
    s.kill()



def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", data[:16]
    return struct.unpack(">II", data[16:24])


def test_r_state_values_and_streamed_output(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context(language="r")
    assert ctx.language == "r"
    r = sbx.run_code("x <- 41\nsq <- function(n) n * n", context=ctx)
    assert r.error is None and r.results == []  # assignments are invisible
    r = sbx.run_code("x <- x + 1\nx\nsq(x)", context=ctx)
    # each visible top-level value is a result, as IRkernel's; the cell's last one is the main result
    assert [(res.text, res.is_main_result) for res in r.results] == [("[1] 42", False), ("[1] 1764", True)]
    assert r.text == "[1] 1764"
    r = sbx.run_code("data.frame(a = 1:2, b = c('u', 'v'))", context=ctx)
    assert r.text == "  a b\n1 1 u\n2 2 v"
    # print() is stdout, one message per line (R writes "[1]" and the rest in pieces); message() stderr
    r = sbx.run_code('print("Hello, World!")\nmessage("to stderr")\ninvisible(7)', context=ctx)
    assert r.logs.stdout == ['[1] "Hello, World!"\n'] and r.logs.stderr == ["to stderr\n"] and r.results == []
    r = sbx.run_code("log(-1)", context=ctx)
    assert r.text == "[1] NaN" and r.logs.stderr == ["Warning message:\nIn log(-1): NaNs produced\n"]
    # stdout streams as it is written, not at the run's end
    seen: list[float] = []
    start = time.monotonic()
    r = sbx.run_code('cat("first\\n"); Sys.sleep(1.5); cat("second\\n")', context=ctx,
                     on_stdout=lambda m: seen.append(time.monotonic() - start))  # fmt: skip
    assert r.logs.stdout == ["first\n", "second\n"]
    assert seen[0] < 1.0 <= seen[1], seen
    # the default R context is another one: x is not there
    r = sbx.run_code("exists('x')", language="r")
    assert r.text == "[1] FALSE"
    assert sbx.run_code("x", context=ctx).text == "[1] 42"
    assert sbx.run_code('"é ü 日本"', context=ctx).text == '[1] "é ü 日本"'  # UTF-8, not <U+00E9>


def test_r_errors_have_irkernels_shape(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context(language="r")
    r = sbx.run_code('f <- function() stop("boom")\ng <- function() f()\ncat("before\\n")\ng()\ncat("never\\n")',
                     context=ctx)  # fmt: skip
    assert r.error is not None
    assert (r.error.name, r.error.value) == ("ERROR", "Error in f(): boom")
    assert r.error.traceback.startswith("Error in f(): boom\nTraceback:\n")
    assert "1. g()\n2. f()\n3. stop(\"boom\")" in r.error.traceback and "runner" not in r.error.traceback
    assert r.logs.stdout == ["before\n"]  # the cell stops at the error
    r = sbx.run_code("undefined_thing + 1", context=ctx)
    assert (r.error.name, r.error.value) == ("ERROR", "Error: object 'undefined_thing' not found")
    r = sbx.run_code("sum(1,", context=ctx)
    assert r.error.name == "ERROR" and "unexpected end of input" in r.error.value
    # the context lives on
    assert sbx.run_code("1 + 1", context=ctx).text == "[1] 2"
    # quit() ends the context's process: said so, and the next run has a fresh one
    r = sbx.run_code("keep <- 1; quit()", context=ctx)
    assert r.error is not None and r.error.name == "UnexpectedEndOfExecution"
    assert sbx.run_code("exists('keep')", context=ctx).text == "[1] FALSE"


def test_r_plots_are_png_results(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context(language="r", cwd="/tmp")
    r = sbx.run_code("plot(1:10, main = 'one')\nhist(rnorm(100))\n'after'", context=ctx)
    assert r.error is None, r.error
    plots = [res for res in r.results if res.png]
    assert len(plots) == 2 and all(p.text == "plot without title" for p in plots)
    for p in plots:
        data = base64.b64decode(p.png)
        assert _png_size(data) == (840, 840)  # IRkernel's default: 7 x 7 in at 120 dpi
        assert len(data) > 3000  # drawn, not blank
    assert r.text == '[1] "after"'
    # IRkernel's size options; no Rplots.pdf left in the working directory
    r = sbx.run_code("options(repr.plot.width = 4, repr.plot.height = 3, repr.plot.res = 100)\nplot(1:3)\n"
                     "file.exists('Rplots.pdf')", context=ctx)  # fmt: skip
    assert _png_size(base64.b64decode(r.results[-1].png)) == (400, 300)
    assert r.results[0].text == "[1] FALSE"
    # a plot of the user's own file device is the user's
    r = sbx.run_code("png('mine.png'); plot(1); invisible(dev.off()); file.size('mine.png') > 0", context=ctx)
    assert [res.png for res in r.results] == [None] and r.text == "[1] TRUE"
    if _has_ggplot2():
        r = sbx.run_code("library(ggplot2)\nggplot(mtcars, aes(wt, mpg)) + geom_point()", context=ctx)
        assert r.error is None, r.error
        assert len(r.results) == 1 and r.results[0].png
        assert _png_size(base64.b64decode(r.results[0].png)) == (400, 300)


def test_r_deadline_and_interrupt_keep_the_context(sbx: Sandbox, server_url: str) -> None:
    ctx = sbx.create_code_context(language="r")
    sbx.run_code("kept <- 'yes'", context=ctx)
    # (the SIGINT goes to the context's process group: a command of system() ends, and system()
    # returns its status, as in R's console)
    for code, interrupted in (("Sys.sleep(30)", True), ("while (TRUE) {}", True), ("system('sleep 30')", False)):
        start = time.monotonic()
        lines = execute_raw(sbx, server_url, code=code, context_id=ctx.id, timeout=1)
        took = time.monotonic() - start
        assert took < 5, (code, took)
        errors = [line for line in lines if line["type"] == "error"]
        assert [e["name"] for e in errors] == (["KeyboardInterrupt"] if interrupted else []), (code, lines)
        assert sbx.run_code("kept", context=ctx).text == '[1] "yes"', code
    # an interrupt that came between runs does not stop the next one
    assert sbx.run_code("Sys.sleep(0.2); 5", context=ctx).text == "[1] 5"


def test_r_env_vars_and_cwd_through_e2b_code_interpreter(e2b_env: str) -> None:
    s = CodeSandbox.create(envs={"TEST_ENV_VAR": "supertest"})
    try:
        # E2B's own suites' R tests, as they are
        assert s.run_code('print("Hello, World!")', language="r").logs.stdout == ['[1] "Hello, World!"\n']
        assert s.run_code("Sys.getenv('TEST_ENV_VAR')", language="r").results[0].text == '[1] "supertest"'
        r = s.run_code("Sys.getenv('TEST_ENV_VAR')", language="r", envs={"TEST_ENV_VAR": "overwrite"})
        assert r.results[0].text == '[1] "overwrite"'
        assert s.run_code("Sys.getenv('TEST_ENV_VAR')", language="r").results[0].text == '[1] "supertest"'
        assert s.run_code("Sys.getenv('FOO')", envs={"FOO": "bar"}, language="r").results[0].text == '[1] "bar"'
        r = s.run_code("Sys.getenv('FOO', unset = 'default')", language="r")
        assert r.results[0].text == '[1] "default"'
        assert s.run_code("getwd()", language="r").results[0].text == '[1] "/home/user"'
        # a context of its own, in its own directory
        s.files.make_dir("/home/user/proj")
        ctx = s.create_code_context(language="r", cwd="/home/user/proj")
        assert ctx.language == "r" and ctx.cwd == "/home/user/proj"
        assert s.run_code("getwd()", context=ctx).text == '[1] "/home/user/proj"'
        s.run_code("writeLines('from R', 'out.txt')", context=ctx)
        assert s.files.read("/home/user/proj/out.txt") == "from R\n"
        # errors as the SDK's ExecutionError
        r = s.run_code("stop('bad')", context=ctx)
        assert r.error is not None and (r.error.name, r.error.value) == ("ERROR", "Error: bad")
        assert any(c.id == ctx.id and c.language == "r" for c in s.list_code_contexts())
    finally:
        s.kill()


def test_r_fork_bomb_and_memory_hog_stay_in_their_context(server_url: str, neighbour: Sandbox) -> None:
    s = Sandbox.create(api_url=server_url, timeout=300, limits={"memoryMB": 384, "pids": 64})
    try:
        s.run_code("canary = 'alive'")  # a neighbour context (Python) in the same sandbox
        ctx = s.create_code_context(language="r")
        s.run_code("kept <- 1", context=ctx)
        try:
            # forks until the pids limit refuses: an R error, the context and its neighbour live on
            r = s.run_code("pids <- c(); repeat pids <- c(pids, parallel::mcparallel(Sys.sleep(60))$pid)",
                           context=ctx, timeout=60)  # fmt: skip
            assert r.error is not None and r.error.name == "ERROR" and "fork" in r.error.value, r.error
            s.run_code("tools::pskill(pids); invisible(parallel::mccollect(wait = FALSE))", context=ctx)
            assert s.run_code("kept", context=ctx).text == "[1] 1"
            # touches more memory than the sandbox has: R's allocation fails or the OOM killer takes R
            r = s.run_code("big <- list(); for (i in 1:100) big[[i]] <- runif(1e7)", context=ctx, timeout=60)
            assert r.error is not None and r.error.name in ("ERROR", "UnexpectedEndOfExecution"), r.error
            assert s.run_code("canary").text.strip("'") == "alive"
            assert s.run_code("1 + 1", context=ctx).text == "[1] 2"
        except Exception:
            # gvisor has no OOM killer of its own: forked R processes copy far more on write there, and
            # a sandbox past its memory limit is killed whole by the host (as in test_attacks.py)
            if not (GVISOR and not s.is_running()):
                raise
    finally:
        s.kill()
    assert neighbour.run_code("canary").text.strip("'") == "alive"  # another sandbox: untouched


def test_missing_r_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # imported here: a checkout without R contexts fails this test, not the module's collection
    from agentcell.runtime import kernel_r

    monkeypatch.setenv("PATH", "/nonexistent")
    message = kernel_r.R.missing()
    assert message is not None and "apt install r-base-core" in message
