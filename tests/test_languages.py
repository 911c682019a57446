"""Code contexts in JavaScript, TypeScript and bash, in real sandboxes (runtime/kernel_node.py,
kernel_bash.py), through agentcell's SDK and the unchanged e2b_code_interpreter package."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b_code_interpreter import Sandbox as CodeSandbox

from agentcell import Sandbox
from agentcell.runtime import kernel_java, kernel_r
from tests.helpers import execute_raw

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="the host has no node (scripts/setup installs it)")


@pytest.fixture(scope="module")
def sbx(server_url: str) -> Iterator[Sandbox]:
    s = Sandbox.create(api_url=server_url, timeout=600, envs={"GREETING": "hello"})
    yield s
    s.kill()


def _stdout(execution) -> str:  # noqa: ANN001
    return "".join(execution.logs.stdout)



def _error(lines: list[dict]) -> dict:
    return next(line for line in lines if line["type"] == "error")


# -- JavaScript ----------------------------------------------------------------------------------------

def test_js_state_survives_between_runs(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context(language="javascript")
    assert ctx.language == "javascript"
    assert sbx.run_code("x = 1", context=ctx).text == "1"
    assert sbx.run_code("x += 1; x", context=ctx).text == "2"
    sbx.run_code("const a = 5, {b, c: [d]} = {b: 2, c: [3]}; let e; var f = 'str'", context=ctx)
    sbx.run_code("function g(n) { return n * a }\nclass C { m() { return g(b + d) } }", context=ctx)
    r = sbx.run_code("[a, b, d, e, f, new C().m()]", context=ctx)
    assert r.error is None and r.text == "[ 5, 2, 3, undefined, 'str', 25 ]"
    # declarations run again replace the old ones instead of failing as redeclarations
    assert sbx.run_code("const a = 7; a", context=ctx).text == "7"
    # imports (ESM syntax and require) stay too
    sbx.run_code("import { join } from 'path'\nimport * as os from 'os'", context=ctx)
    r = sbx.run_code("[join('a', 'b'), typeof os.platform, require('fs').existsSync('/home/user')]", context=ctx)
    assert r.text == "[ 'a/b', 'function', true ]"


def test_js_top_level_await_and_results(sbx: Sandbox) -> None:
    r = sbx.run_code("await Promise.resolve('Hello World!')", language="js")
    assert r.error is None and r.text == "Hello World!"  # a string without its quotes, as E2B's
    r = sbx.run_code("const m = await import('node:path'); m.basename('/a/b.txt')", language="js")
    assert r.text == "b.txt"
    r = sbx.run_code("({a: 1, b: [1, 2, {c: 3}]})", language="js")
    assert r.text == "{ a: 1, b: [ 1, 2, { c: 3 } ] }"
    r = sbx.run_code("console.log('only output')", language="js")
    assert r.results == [] and r.logs.stdout == ["only output\n"]


def test_js_errors_have_name_value_traceback(sbx: Sandbox) -> None:
    r = sbx.run_code("function bad() { throw new TypeError('boom') }\nbad()", language="javascript")
    assert r.error is not None
    assert (r.error.name, r.error.value) == ("TypeError", "boom")
    assert "at bad (<cell" in r.error.traceback and "runner.js" not in r.error.traceback
    r = sbx.run_code("let = = 1", language="javascript")
    assert r.error is not None and r.error.name == "SyntaxError" and "(1:" in r.error.value
    r = sbx.run_code("undefinedName + 1", language="javascript")
    assert r.error is not None and r.error.name == "ReferenceError"
    # the context lives on
    assert sbx.run_code("1 + 1", language="javascript").text == "2"


def test_js_output_streams_in_order(sbx: Sandbox) -> None:
    seen: list[tuple[str, str, float]] = []
    code = ("console.log('a'); console.error('b'); await new Promise(r => setTimeout(r, 700));\n"
            "console.log('c'); 42")
    t0 = time.monotonic()
    r = sbx.run_code(code, language="javascript",
                     on_stdout=lambda m: seen.append(("out", m.line, time.monotonic() - t0)),
                     on_stderr=lambda m: seen.append(("err", m.line, time.monotonic() - t0)))
    assert [(k, t) for k, t, _ in seen] == [("out", "a\n"), ("err", "b\n"), ("out", "c\n")]
    assert seen[0][2] < 0.6 <= seen[2][2], seen  # 'a' came before the wait was over
    assert r.text == "42"


def test_js_env_vars(sbx: Sandbox) -> None:
    assert sbx.run_code("process.env.GREETING", language="js").text == "hello"
    assert sbx.run_code("process.env.FOO", language="js", envs={"FOO": "bar"}).text == "bar"
    assert sbx.run_code("process.env.FOO || 'default'", language="js").text == "default"


def test_js_runaway_loop_is_interrupted_by_the_timeout(sbx: Sandbox, server_url: str) -> None:
    ctx = sbx.create_code_context(language="javascript")
    sbx.run_code("kept = 'yes'", context=ctx)
    t0 = time.monotonic()
    lines = execute_raw(sbx, server_url, code="while (true) {}", context_id=ctx.id, timeout=1)
    assert time.monotonic() - t0 < 3
    assert _error(lines)["name"] == "KeyboardInterrupt" and lines[-1]["type"] == "end_of_execution"
    # the same process, its state intact
    assert sbx.run_code("kept", context=ctx).text == "yes"
    lines = execute_raw(sbx, server_url, code="await new Promise(() => {})", context_id=ctx.id, timeout=1)
    assert _error(lines)["name"] == "KeyboardInterrupt"
    assert sbx.run_code("kept", context=ctx).text == "yes"


def test_js_busy_loop_after_await_is_killed_and_restarted(sbx: Sandbox, server_url: str) -> None:
    ctx = sbx.create_code_context(language="javascript")
    sbx.run_code("kept = 1", context=ctx)
    lines = execute_raw(sbx, server_url, code="await null; while (true) {}", context_id=ctx.id, timeout=1)
    assert _error(lines)["name"] == "UnexpectedEndOfExecution"
    r = sbx.run_code("typeof kept", context=ctx)  # a fresh process
    assert r.error is None and r.text == "undefined"


def test_js_runs_as_the_sandbox_user_inside(sbx: Sandbox) -> None:
    r = sbx.run_code("[process.getuid(), process.cwd(), require('os').hostname() !== '']", language="js")
    assert r.text == "[ 1000, '/home/user', true ]"
    r = sbx.run_code("require('fs').writeFileSync('/usr/x', 'y')", language="js")
    assert r.error is not None and r.error.value.startswith(("EROFS", "EACCES", "EPERM"))


# -- TypeScript ----------------------------------------------------------------------------------------

def test_typescript(sbx: Sandbox) -> None:
    r = sbx.run_code("const message: string = 'Hello, World!'; console.log(message)", language="ts")
    assert r.error is None and r.logs.stdout == ["Hello, World!\n"]
    ctx = sbx.create_code_context(language="typescript")
    assert ctx.language == "typescript"
    sbx.run_code("interface P { name: string }\nfunction greet(p: P): string { return `hi ${p.name}` }\n"
                 "enum Color { Red, Green }", context=ctx)
    r = sbx.run_code("const n: number = await Promise.resolve(41); greet({name: 'ann'}) + ' ' + Color[1] + ' ' + (n + 1)",
                     context=ctx)
    assert r.error is None and r.text == "hi ann Green 42"
    r = sbx.run_code("const y: = 3", context=ctx)
    assert r.error is not None and r.error.name == "SyntaxError"


# -- bash ----------------------------------------------------------------------------------------------

def test_bash_state_and_exit_status(sbx: Sandbox) -> None:
    ctx = sbx.create_code_context(language="bash")
    assert ctx.language == "bash" and ctx.cwd == "/home/user"
    r = sbx.run_code("x=5; f() { echo \"hi $1\"; }; mkdir -p d && cd d", context=ctx)
    assert r.error is None
    r = sbx.run_code("echo $x; f there; pwd; echo $GREETING", context=ctx)
    assert r.error is None and _stdout(r) == "5\nhi there\n/home/user/d\nhello\n"
    r = sbx.run_code("echo partial; false", context=ctx)
    assert _stdout(r) == "partial\n"
    assert r.error is not None and (r.error.name, r.error.value) == ("ExitCode", "1")
    r = sbx.run_code("printf 'h\\xc3\\xa9 %s\\n' \"it's\"; cat <<EOF\nline $x\nEOF", context=ctx)
    assert _stdout(r) == "hé it's\nline 5\n"
    r = sbx.run_code("echo $FOO", context=ctx, envs={"FOO": "bar"})
    assert _stdout(r) == "bar\n"
    assert _stdout(sbx.run_code("echo ${FOO:-default}", context=ctx)) == "default\n"
    r = sbx.run_code("read line; echo \"read: [$line]\"", context=ctx)  # stdin is empty, not the agent's
    assert _stdout(r) == "read: []\n"


def test_bash_interrupt_keeps_the_shell(sbx: Sandbox, server_url: str) -> None:
    ctx = sbx.create_code_context(language="bash")
    sbx.run_code("kept=yes", context=ctx)
    t0 = time.monotonic()
    lines = execute_raw(sbx, server_url, code="while true; do :; done; echo after", context_id=ctx.id, timeout=1)
    assert time.monotonic() - t0 < 3
    assert not [line for line in lines if line["type"] == "stdout"]
    assert (_error(lines)["name"], _error(lines)["value"]) == ("ExitCode", "130")
    lines = execute_raw(sbx, server_url, code="sleep 30; echo after", context_id=ctx.id, timeout=1)
    assert _error(lines)["value"] == "130" and not [line for line in lines if line["type"] == "stdout"]
    assert _stdout(sbx.run_code("echo $kept", context=ctx)) == "yes\n"
    r = sbx.run_code("exit 3", context=ctx)  # the shell ends: reported, and a new one starts
    assert r.error is not None and r.error.name == "UnexpectedEndOfExecution"
    assert _stdout(sbx.run_code("echo ${kept:-fresh}", context=ctx)) == "fresh\n"


# -- contexts and languages ----------------------------------------------------------------------------

def test_contexts_listing_and_defaults(server_url: str) -> None:
    s = Sandbox.create(api_url=server_url, timeout=120)
    try:
        langs = [c.language for c in s.list_code_contexts()]
        assert langs.count("python") == 1 and langs.count("javascript") == 1, langs
        # run_code(language=) runs in that language's default context: the listed one
        js_default = next(c for c in s.list_code_contexts() if c.language == "javascript")
        s.run_code("y = 40", language="javascript")
        assert s.run_code("y + 2", context=js_default).text == "42"
        s.run_code("echo hi", language="bash")
        contexts = s.list_code_contexts()
        assert sorted(c.language for c in contexts) == ["bash", "javascript", "python"]
        assert all(c.cwd == "/home/user" for c in contexts)
        ctx = s.create_code_context(language="ts", cwd="/tmp")
        listed = s.list_code_contexts()[-1]
        assert (listed.id, listed.language, listed.cwd) == (ctx.id, "typescript", "/tmp")
        assert s.run_code("process.cwd()", context=ctx).text == "/tmp"
        s.restart_code_context(js_default)
        r = s.run_code("typeof y", context=js_default)
        assert r.text == "undefined"
        s.remove_code_context(ctx)
        assert ctx.id not in [c.id for c in s.list_code_contexts()]
    finally:
        s.kill()


def test_java(sbx: Sandbox, e2b_env: str) -> None:
    """Java through JShell in one JVM per context, when the host has a JDK (this one does: Debian's)."""
    if kernel_java._missing():
        pytest.skip(f"no JDK on this host: {kernel_java._missing()} (test_unknown_and_missing_languages_are_400 checks the 400)")
    ctx = sbx.create_code_context(language="java")
    assert ctx.language == "java"
    assert sbx.run_code("int x = 40; long n = 0;\nString greet(String who) { return \"hi \" + who; }",
                        context=ctx).error is None
    r = sbx.run_code('System.out.println(greet("you")); x + 2', context=ctx)
    assert (r.logs.stdout, r.text) == (["hi you"], "42")  # a line without its newline, as E2B's Java kernel
    r = sbx.run_code('int[] a = new int[1]; a[3]', context=ctx)
    assert r.error is not None and r.error.name == "java.lang.ArrayIndexOutOfBoundsException", r.error
    r = sbx.run_code("undefinedThing + 1", context=ctx)
    assert r.error is not None and r.error.name == "CompilationException"
    with pytest.raises(Exception, match="timed out"):
        sbx.run_code("while (true) { n++; }", context=ctx, timeout=2)
    assert sbx.run_code("n >= 0 && x == 40", context=ctx).text == "true"  # interrupted, state kept
    r = sbx.run_code('System.getProperty("FOO", "none")', context=ctx, envs={"FOO": "bar"})
    assert r.text == "bar" and sbx.run_code('System.getProperty("FOO", "none")', context=ctx).text == "none"
    # as E2B's Java kernel: the sandbox's env vars are system properties (its own env-var tests)
    s = CodeSandbox.create(envs={"TEST_ENV_VAR": "supertest"})
    try:
        assert s.run_code('System.getProperty("TEST_ENV_VAR")', language="java").text.strip() == "supertest"
        r = s.run_code('System.getProperty("TEST_ENV_VAR")', language="java", envs={"TEST_ENV_VAR": "overwrite"})
        assert r.text.strip() == "overwrite"
    finally:
        s.kill()


def test_unknown_and_missing_languages_are_400(sbx: Sandbox, server_url: str) -> None:
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999",
               "X-Access-Token": sbx._conn.access_token or ""}
    with httpx.Client(base_url=server_url, headers=headers, timeout=30) as http:
        r = http.post("/execute", json={"code": "1", "language": "cobol"})
        assert r.status_code == 400 and "cobol" in r.text and "javascript" in r.text
        r = http.post("/contexts", json={"language": "cobol"})
        assert r.status_code == 400
        missing = ([("r", "r-base-core")] if kernel_r.R.missing() else []) + \
            ([("java", "JDK")] if kernel_java._missing() else [])
        for lang, needs in missing:
            r = http.post("/execute", json={"code": "1", "language": lang})
            assert r.status_code == 400 and needs in r.text, r.text
            r = http.post("/contexts", json={"language": lang})
            assert r.status_code == 400 and needs in r.text


# -- through the unchanged e2b_code_interpreter package ----------------------------------------------

def test_e2b_code_interpreter_languages(e2b_env: str) -> None:
    s = CodeSandbox.create(envs={"TEST_ENV_VAR": "supertest"})
    try:
        assert s.run_code("console.log('Hello, World!')", language="js").logs.stdout == ["Hello, World!\n"]
        r = s.run_code("\n    import { readFileSync } from 'fs'\n    console.log(typeof readFileSync)\n    ", language="js")
        assert r.logs.stdout == ["function\n"]
        assert s.run_code("\n    await Promise.resolve('Hello World!')\n    ", language="js").text == "Hello World!"
        r = s.run_code("const message: string = 'Hello, World!'; console.log(message)", language="ts")
        assert r.logs.stdout == ["Hello, World!\n"]
        assert s.run_code("process.env.TEST_ENV_VAR", language="javascript").text == "supertest"
        assert s.run_code("echo $TEST_ENV_VAR", language="bash").logs.stdout == ["supertest\n"]
        ctx = s.create_code_context(language="javascript")
        s.run_code("let counter = 1", context=ctx)
        assert s.run_code("counter += 1; counter", context=ctx).text == "2"
        r = s.run_code("null.x", context=ctx)
        assert r.error is not None and r.error.name == "TypeError" and "null" in r.error.value
        languages = [c.language for c in s.list_code_contexts()]
        assert "python" in languages and "javascript" in languages
    finally:
        s.kill()
