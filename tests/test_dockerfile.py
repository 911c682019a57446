"""Dockerfiles as E2B template builds (agentcell/templates/dockerfile.py, `agentcell template build`).

The conversion is checked on real Dockerfiles and build contexts: the steps JSON the server is sent,
the files hashes (a context file changed, an ignored one changed), .dockerignore with `!` and `**`,
Docker's ARG scoping and build args, and every refusal naming its line. The end-to-end tests build
through a real `agentcell serve` (a busybox base image pushed to a loopback registry) and run a sandbox
of the result; they skip, saying so, while the server answers 501 to the build API.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from agentcell.templates.dockerfile import (
    ConvertedDockerfile,
    DockerfileError,
    convert_dockerfile,
)

BASE = "127.0.0.1:5000/test/base:1"


def context(tmp_path: Path, files: dict[str, str | bytes] | None = None) -> Path:
    ctx = tmp_path / "ctx"
    ctx.mkdir(exist_ok=True)
    for name, data in (files or {}).items():
        path = ctx / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return ctx


def convert(tmp_path: Path, dockerfile: str, files: dict[str, str | bytes] | None = None,
            build_args: dict[str, str] | None = None, **kwargs: Any) -> ConvertedDockerfile:
    return convert_dockerfile(textwrap.dedent(dockerfile).lstrip("\n"), context(tmp_path, files), build_args, **kwargs)


def steps(converted: ConvertedDockerfile) -> list[tuple[str, list[str]]]:
    return [(s["type"], s["args"]) for s in converted.spec()["steps"]]


def refused(tmp_path: Path, dockerfile: str, files: dict[str, str | bytes] | None = None, **kwargs: Any) -> str:
    with pytest.raises(DockerfileError) as e:
        convert(tmp_path, dockerfile, files, **kwargs)
    return str(e.value)


# --- every instruction ------------------------------------------------------------------------------


def test_a_dockerfile_with_every_supported_instruction(tmp_path: Path) -> None:
    converted = convert(tmp_path, f"""
        # syntax=docker/dockerfile:1
        # a comment, then a stage name nobody uses
        FROM {BASE} AS app
        ENV GREETING="hello world" \\
            LANG=C.UTF-8
        ENV OLD_STYLE one two
        WORKDIR /srv
        WORKDIR app
        USER app:app
        RUN set -e; \\
            # a comment inside a continuation
            echo building > /tmp/log
        RUN ["touch", "/tmp/exec form"]
        COPY --chown=app:app --chmod=0640 conf.ini ./
        COPY src/ /srv/app/src/
        ADD notes.txt /srv/notes.txt
        COPY <<EOF /etc/motd
        Hello $GREETING
        EOF
        RUN <<EOF
        echo one
        echo two
        EOF
        ENTRYPOINT ["python3", "-m"]
        CMD ["http.server", "8080"]
        """, {"conf.ini": "[a]\n", "src/main.py": "print(1)\n", "notes.txt": "n\n"})
    got = steps(converted)
    assert got[:10] == [
        ("USER", ["root"]), ("WORKDIR", ["/"]),  # E2B's converter starts as Docker does
        ("ENV", ["GREETING", "hello world", "LANG", "C.UTF-8"]),
        ("ENV", ["OLD_STYLE", "one two"]),
        ("WORKDIR", ["/srv"]),
        ("WORKDIR", ["/srv/app"]),  # relative to the WORKDIR before, as in Docker
        ("USER", ["app:app"]),
        ("RUN", ["set -e;     echo building > /tmp/log"]),
        ("RUN", ["touch '/tmp/exec form'"]),
        ("COPY", ["conf.ini", "/srv/app/", "app:app", "0640"]),  # ./ is the WORKDIR
    ]
    assert got[10:12] == [("COPY", ["src/", "/srv/app/src/", "", ""]), ("COPY", ["notes.txt", "/srv/notes.txt", "", ""])]
    motd, script = got[12], got[13]
    assert motd[0] == "RUN" and motd[1][1] == "root" and "cat <<" in motd[1][0] and "/etc/motd" in motd[1][0]
    assert "Hello $GREETING" in motd[1][0]  # the shell of the build step expands it from the ENV
    assert script == ("RUN", ["echo one\necho two\n"])
    assert len(got) == 14  # USER and WORKDIR were set: no E2B defaults (user, /home/user) after
    spec = converted.spec()
    assert spec["fromImage"] == BASE
    assert spec["startCmd"] == "python3 -m http.server 8080"
    assert spec["readyCmd"] == "true"  # ready once started (E2B: sleep 20, which every standby would wait here)
    assert all(s.get("filesHash") for s in spec["steps"] if s["type"] == "COPY")
    assert converted.warnings == []
    # each step's Dockerfile line, for a build error's step
    assert converted.step_lines == [3, 3, 4, 6, 7, 8, 9, 10, 13, 14, 15, 16, 17, 20]
    assert converted.line_of_step("1") == 3 and converted.line_of_step("8") == 10
    assert converted.line_of_step("base") == 3 and converted.line_of_step("99") is None


def test_without_user_and_workdir_the_e2b_defaults_follow(tmp_path: Path) -> None:
    converted = convert(tmp_path, f"FROM {BASE}\nRUN true\n")
    assert steps(converted) == [("USER", ["root"]), ("WORKDIR", ["/"]), ("RUN", ["true"]),
                                ("USER", ["user"]), ("WORKDIR", ["/home/user"])]
    assert converted.step_lines == [1, 1, 2, None, None]
    assert "startCmd" not in converted.spec()
    from agentcell.templates.remote_build import _default_step

    # a build error at such a step says what the step is, having no line to name
    assert _default_step(converted, "4") == " (USER user, E2B's default after the Dockerfile)"
    assert converted.line_of_step("4") is None and converted.line_of_step("3") == 2


@pytest.mark.parametrize(("lines", "start"), [
    (['ENTRYPOINT ["/app/run", "--flag"]', 'CMD ["a b", "c"]'], "/app/run --flag 'a b' c"),
    (['ENTRYPOINT ["/app/run"]', "CMD echo $HOME"], "/app/run /bin/sh -c 'echo $HOME'"),
    (["ENTRYPOINT /app/run --shell-form", 'CMD ["ignored"]'], "/app/run --shell-form"),
    (["CMD python3 -m http.server"], "python3 -m http.server"),
    (['CMD ["python3", "-c", "print(1)"]'], "python3 -c 'print(1)'"),
    (['SHELL ["/bin/bash", "-o", "pipefail", "-c"]', "CMD serve | tee log"], "/bin/bash -o pipefail -c 'serve | tee log'"),
    (["CMD first", "CMD second"], "second"),
])
def test_entrypoint_and_cmd_make_the_start_command(tmp_path: Path, lines: list[str], start: str) -> None:
    converted = convert(tmp_path, "\n".join([f"FROM {BASE}", *lines]) + "\n")
    assert converted.spec()["startCmd"] == start


def test_healthcheck_is_the_ready_command_and_ready_cmd_overrides(tmp_path: Path) -> None:
    dockerfile = f"""
        FROM {BASE}
        HEALTHCHECK --interval=5s CMD curl -fs http://127.0.0.1:8080/ || exit 1
        CMD ["serve"]
        """
    converted = convert(tmp_path, dockerfile)
    assert converted.spec()["readyCmd"] == "curl -fs http://127.0.0.1:8080/ || exit 1"
    assert converted.warnings == ["Dockerfile:2: HEALTHCHECK --interval=5s ignored: the check runs until it "
                                  "succeeds, once, when the start command starts"]
    assert convert(tmp_path, dockerfile, ready_cmd="test -e /tmp/up").spec()["readyCmd"] == "test -e /tmp/up"
    exec_form = convert(tmp_path, f'FROM {BASE}\nHEALTHCHECK CMD ["test", "-e", "/tmp/a b"]\nCMD serve\n')
    assert exec_form.spec()["readyCmd"] == "test -e '/tmp/a b'"
    none = convert(tmp_path, f"FROM {BASE}\nHEALTHCHECK CMD true\nHEALTHCHECK NONE\nCMD serve\n")
    assert none.spec()["readyCmd"] == "true"
    alone = convert(tmp_path, f"FROM {BASE}\nHEALTHCHECK CMD true\n")
    assert "readyCmd" not in alone.spec() and any("HEALTHCHECK ignored" in w for w in alone.warnings)


def test_shell_applies_to_later_shell_form_runs(tmp_path: Path) -> None:
    converted = convert(tmp_path, f"""
        FROM {BASE}
        RUN echo before
        SHELL ["/bin/bash", "-euo", "pipefail", "-c"]
        RUN echo after | cat
        RUN ["echo", "exec form"]
        """)
    runs = [args[0] for kind, args in steps(converted) if kind == "RUN"]
    assert runs == ["echo before", "/bin/bash -euo pipefail -c 'echo after | cat'", "echo 'exec form'"]


def test_an_escape_directive_and_backtick_continuations(tmp_path: Path) -> None:
    converted = convert(tmp_path, f"""
        # escape=`
        FROM {BASE}
        RUN echo a `
            b
        COPY "my file.txt" C:\\data\\
        """, {"my file.txt": "x"})
    assert steps(converted)[2] == ("RUN", ["echo a     b"])
    assert steps(converted)[3] == ("COPY", ["my file.txt", "/C:\\data\\", "", ""])


def test_metadata_instructions_are_ignored_with_a_warning(tmp_path: Path) -> None:
    converted = convert(tmp_path, f"""
        FROM {BASE}
        LABEL org.example.team=infra
        MAINTAINER someone
        EXPOSE 8080/tcp
        VOLUME /data
        STOPSIGNAL SIGTERM
        ONBUILD RUN make
        RUN --mount=type=cache,target=/root/.cache pip --version
        RUN --network=none true
        COPY --link a /a
        """, {"a": "a"})
    assert [s[0] for s in steps(converted)] == ["USER", "WORKDIR", "RUN", "RUN", "COPY", "USER", "WORKDIR"]
    assert converted.warnings == [
        "Dockerfile:2: LABEL ignored: a template keeps no image labels",
        "Dockerfile:3: MAINTAINER ignored: a template keeps no image metadata",
        "Dockerfile:4: EXPOSE ignored: a sandbox's ports are reachable without it",
        "Dockerfile:5: VOLUME ignored: the directory stays part of the template's filesystem",
        "Dockerfile:6: STOPSIGNAL ignored: a sandbox is stopped as a whole",
        "Dockerfile:7: ONBUILD ignored: its triggers are for images built FROM this one",
        "Dockerfile:8: Ignoring unsupported RUN flag --mount",
        "Dockerfile:9: Ignoring unsupported RUN flag --network",
        "Dockerfile:10: Ignoring unsupported COPY flag --link",
    ]


# --- ARG and build args -----------------------------------------------------------------------------


def test_arg_scoping_follows_docker(tmp_path: Path) -> None:
    converted = convert(tmp_path, """
        ARG REGISTRY=127.0.0.1:5000
        ARG TAG=1
        FROM ${REGISTRY}/test/base:${TAG}
        ARG TAG
        ARG MODE=debug
        ARG EMPTY
        ARG not-a-shell-name=x
        ENV APP_MODE=$MODE APP_TAG=v${TAG} HOME_BIN=$HOME/bin
        WORKDIR /opt/$MODE${REGISTRY}
        RUN echo "$MODE $TAG"
        """)
    got = steps(converted)
    assert converted.spec()["fromImage"] == "127.0.0.1:5000/test/base:1"
    # ARGs never become the template's environment; values the Dockerfile defines are expanded,
    # a variable it does not define ($HOME, from the image) is left to the build
    assert got[2] == ("ENV", ["APP_MODE", "debug", "APP_TAG", "v1", "HOME_BIN", "$HOME/bin"])
    # a global ARG not declared again in the stage is not in scope (Docker: empty; the build decides)
    assert got[3] == ("WORKDIR", ["/opt/debug${REGISTRY}"])
    # RUN sees the ARGs in scope as exported variables (a declared ARG without a value: none)
    assert got[4] == ("RUN", ["export TAG=1 MODE=debug; echo \"$MODE $TAG\""])
    assert all(kind != "ENV" or "MODE" not in args for kind, args in got[3:])
    assert converted.warnings == []


def test_build_args_override_defaults_and_env_wins_over_arg(tmp_path: Path) -> None:
    dockerfile = f"""
        ARG BASE={BASE}
        FROM $BASE
        ARG VERSION=1.0
        ARG TOKEN
        ARG SHADOWED=from-arg
        ENV SHADOWED=from-env
        RUN build --version "$VERSION" --token "$TOKEN"
        """
    plain = convert(tmp_path, dockerfile)
    assert steps(plain)[3] == ("RUN", ['export VERSION=1.0; build --version "$VERSION" --token "$TOKEN"'])
    given = convert(tmp_path, dockerfile, build_args={"VERSION": "2.0 beta", "TOKEN": "t'k", "BASE": "other:2",
                                                      "UNUSED": "x"})
    assert given.spec()["fromImage"] == "other:2"
    assert steps(given)[3] == ("RUN", ["export VERSION='2.0 beta' TOKEN='t'\"'\"'k'; "
                                       'build --version "$VERSION" --token "$TOKEN"'])
    assert given.warnings == ["Dockerfile: build-args not consumed by any ARG: UNUSED"]
    assert steps(given)[2] == ("ENV", ["SHADOWED", "from-env"])


def test_an_arg_default_uses_the_args_before_it(tmp_path: Path) -> None:
    converted = convert(tmp_path, """
        ARG HOST=127.0.0.1 PORT=5000
        ARG REG=$HOST:$PORT
        FROM $REG/test/base:1
        ARG A=1 B=${A}0
        ARG C=$B$A
        RUN echo $C
        """, build_args={"A": "2"})
    assert converted.spec()["fromImage"] == BASE
    assert steps(converted)[2] == ("RUN", ["export A=2 B=20 C=202; echo $C"])


def test_build_args_reach_copy_and_heredocs(tmp_path: Path) -> None:
    converted = convert(tmp_path, f"""
        FROM {BASE}
        ARG DIR=/opt/app
        ARG FILE
        COPY ${{FILE}} $DIR/
        COPY <<EOF $DIR/version
        $FILE
        EOF
        """, {"v2.txt": "2"}, build_args={"FILE": "v2.txt"})
    got = steps(converted)
    assert got[2] == ("COPY", ["v2.txt", "/opt/app/", "", ""])
    assert got[3][0] == "RUN" and got[3][1][0].startswith("export DIR=/opt/app FILE=v2.txt; ")


# --- the context: files hashes and .dockerignore ----------------------------------------------------


def test_files_hashes_follow_the_context_and_not_its_ignored_files(tmp_path: Path) -> None:
    files = {"app/main.py": "print(1)\n", "app/cache/x.pyc": "junk", "app/README.md": "read me",
             "app/deep/er/notes.log": "log", "app/keep.log": "kept", ".dockerignore": "**/*.log\n!app/keep.log\napp/cache\n"}
    dockerfile = f"FROM {BASE}\nCOPY app /app\n"

    def files_hash() -> str:
        return convert_dockerfile(dockerfile, tmp_path / "ctx", {}).spec()["steps"][2]["filesHash"]

    context(tmp_path, files)
    first = files_hash()
    assert files_hash() == first  # stable
    (tmp_path / "ctx/app/deep/er/notes.log").write_text("changed log")
    (tmp_path / "ctx/app/cache/x.pyc").write_text("changed junk")
    assert files_hash() == first  # ignored files (`**`, a directory) are not part of it
    (tmp_path / "ctx/app/keep.log").write_text("changed, and re-included by !")
    second = files_hash()
    assert second != first
    (tmp_path / "ctx/app/main.py").write_text("print(2)\n")
    assert files_hash() not in (first, second)


def test_the_upload_leaves_out_ignored_files(tmp_path: Path) -> None:
    """What the SDK uploads for a COPY step (its tar) has what .dockerignore leaves."""
    from e2b.template.utils import read_dockerignore, tar_file_stream

    ctx = context(tmp_path, {"app/main.py": "1", "app/secret.env": "2", "app/sub/a.tmp": "3", "app/sub/b.txt": "4",
                             ".dockerignore": "# comment\n**/*.tmp\napp/secret.env\n"})
    convert_dockerfile(f"FROM {BASE}\nCOPY app /app\n", ctx, {})
    with tar_file_stream("app", str(ctx), read_dockerignore(str(ctx)), False, True) as f, \
            tarfile.open(fileobj=io.BytesIO(f.read())) as tar:
        assert sorted(tar.getnames()) == ["app", "app/main.py", "app/sub", "app/sub/b.txt"]


def test_a_source_matching_nothing_or_only_ignored_files_is_refused(tmp_path: Path) -> None:
    files = {"a.txt": "a", "secret.key": "k", ".dockerignore": "*.key\n"}
    assert refused(tmp_path, f"FROM {BASE}\nRUN true\nCOPY missing.txt /x\n", files).startswith(
        "Dockerfile:3: COPY missing.txt: no such file in the build context")
    assert refused(tmp_path, f"FROM {BASE}\nCOPY secret.key /x\n", files).startswith(
        "Dockerfile:2: COPY secret.key: no such file")
    assert refused(tmp_path, f"FROM {BASE}\nCOPY *.none /x/\n", files).startswith("Dockerfile:2: COPY *.none")
    assert refused(tmp_path, f"FROM {BASE}\nCOPY ../outside /x\n", files) == (
        "Dockerfile:2: COPY ../outside: the path is outside the build context")
    # Docker's sources are inside the context: a leading / is its root
    assert steps(convert(tmp_path, f"FROM {BASE}\nCOPY /a.txt *.txt sub/../a.txt /x/\n", files))[2:5] == [
        ("COPY", ["a.txt", "/x/", "", ""]), ("COPY", ["*.txt", "/x/", "", ""]), ("COPY", ["a.txt", "/x/", "", ""])]


def test_an_invalid_dockerignore_pattern_is_an_error(tmp_path: Path) -> None:
    message = refused(tmp_path, f"FROM {BASE}\nCOPY a /a\n", {"a": "a", ".dockerignore": "[unterminated\n"})
    assert message.startswith("Dockerfile: .dockerignore: ")


# --- ADD --------------------------------------------------------------------------------------------


def _tar(files: dict[str, bytes], mode: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_add_extracts_a_local_tar_archive_as_docker_does(tmp_path: Path) -> None:
    import gzip

    files = {"pkg.tar.gz": _tar({"lib/x.py": b"x"}, "w:gz"), "plain.tar": _tar({"y": b"y"}, "w"),
             "text.gz": gzip.compress(b"not a tar"), "notes.txt": "n"}
    converted = convert(tmp_path, f"""
        FROM {BASE}
        ADD pkg.tar.gz /opt/pkg
        ADD text.gz notes.txt /docs/
        ADD --unpack=false plain.tar /keep/
        """, files)
    got = steps(converted)
    assert got[2] == ("COPY", ["pkg.tar.gz", "/.agentcell-add/", "", ""])
    assert got[3] == ("RUN", ["mkdir -p /opt/pkg && gzip -dc /.agentcell-add/pkg.tar.gz > /.agentcell-add/.tar"
                              " && tar -xf /.agentcell-add/.tar -C /opt/pkg && rm -rf /.agentcell-add", "root"])
    # a gzip file that is no tar is copied as it is, as Docker does; --unpack=false keeps an archive
    assert got[4:7] == [("COPY", ["text.gz", "/docs/", "", ""]), ("COPY", ["notes.txt", "/docs/", "", ""]),
                        ("COPY", ["plain.tar", "/keep/", "", ""])]
    assert converted.step_lines[2:7] == [2, 2, 3, 3, 4]
    assert refused(tmp_path, f"FROM {BASE}\nADD --chown=1:1 pkg.tar.gz /x\n", files).startswith(
        "Dockerfile:2: ADD --chown/--chmod of a tar archive is not supported")


# --- refusals, each naming its line -----------------------------------------------------------------


@pytest.mark.parametrize(("dockerfile", "message"), [
    (f"FROM {BASE} AS build\nRUN make\nFROM {BASE}\nCOPY --from=build /out /out\n",
     "Dockerfile:3: a second FROM: multi-stage builds are not supported"),
    (f"FROM {BASE}\n\nCOPY --from=golang:1.22 /usr/local/go /go\n",
     "Dockerfile:3: COPY --from=golang:1.22 is not supported"),
    (f"FROM {BASE}\nCOPY --exclude=*.log . /app\n", "Dockerfile:2: COPY --exclude is not supported"),
    (f"FROM {BASE}\nCOPY --parents a/ /app\n", "Dockerfile:2: COPY --parents is not supported"),
    (f"FROM {BASE}\nADD https://example.com/x.tgz /x\n",
     "Dockerfile:2: ADD https://example.com/x.tgz: sources from URLs and git are not supported"),
    (f"FROM {BASE}\nADD git@github.com:o/r.git /src\n", "Dockerfile:2: ADD git@github.com:o/r.git: sources from URLs"),
    (f"FROM {BASE}\nRUN --mount=type=secret,id=tok cat /run/secrets/tok\n",
     "Dockerfile:2: RUN --mount=type=secret is not supported"),
    (f"FROM {BASE}\nRUN --mount=target=/src make\n", "Dockerfile:2: RUN --mount=type=bind is not supported"),
    ("FROM scratch\nCOPY a /a\n", "Dockerfile:1: FROM scratch is not supported"),
    ("ARG IMAGE\nFROM $IMAGE\n", "Dockerfile:2: FROM $IMAGE: the image name is empty"),
    ("RUN true\n", "Dockerfile: no FROM instruction"),
    (f"ENV A=1\nFROM {BASE}\n", "Dockerfile:1: ENV must be preceded by a FROM instruction"),
    (f"FROM {BASE}\nFETCH x\n", "Dockerfile:2: unknown instruction: FETCH"),
    (f"FROM {BASE}\nSHELL /bin/bash -c\n", "Dockerfile:2: SHELL takes a JSON array"),
    (f"FROM {BASE}\nHEALTHCHECK curl x\n", "Dockerfile:2: HEALTHCHECK takes CMD <command> or NONE"),
    (f"FROM {BASE}\nRUN <<EOF\necho never ends\n", "Dockerfile:2: unterminated heredoc"),
    (f"FROM {BASE}\nCOPY --chmod=rwx a /a\n", 'Dockerfile:2: invalid chmod value "rwx"'),
    (f"FROM {BASE}\nCOPY --bogus a /a\n", "Dockerfile:2: unknown flag: bogus"),
    (f"FROM {BASE}\nENV\n", "Dockerfile:2: ENV takes NAME=value pairs"),
    (f"FROM {BASE}\nUSER\n", "Dockerfile:2: USER requires exactly one argument"),
])
def test_what_cannot_be_done_is_refused_naming_its_line(tmp_path: Path, dockerfile: str, message: str) -> None:
    assert refused(tmp_path, dockerfile, {"a": "a"}).startswith(message)


def test_the_error_names_the_dockerfile_path(tmp_path: Path) -> None:
    from agentcell.templates.dockerfile import load_dockerfile

    ctx = context(tmp_path, {})
    (tmp_path / "build.Dockerfile").write_text(f"FROM {BASE}\nCOPY --from=x /a /a\n")
    with pytest.raises(DockerfileError) as e:
        load_dockerfile(tmp_path / "build.Dockerfile", ctx)
    assert str(e.value).startswith(f"{tmp_path}/build.Dockerfile:2: COPY --from=x")
    assert e.value.line == 2 and e.value.code == "invalid_argument"
    with pytest.raises(DockerfileError, match="cannot read it"):
        load_dockerfile(tmp_path / "nope", ctx)


def test_e2b_from_dockerfile_differs_where_this_converter_corrects_it(tmp_path: Path) -> None:
    """The reason for the subclass: E2B's own from_dockerfile leaves ${ARG} in FROM and makes ARGs ENVs
    (if a new SDK fixes this, the corrections can go)."""
    from e2b import Template

    text = "ARG V=1\nFROM test/base:${V}\nARG X=2\nRUN echo $X\n"
    e2b_json = json.loads(Template.to_json(Template(file_context_path=str(context(tmp_path))).from_dockerfile(text)))
    assert e2b_json["fromImage"] == "test/base:${V}"
    assert ("ENV", ["X", "2"]) in [(s["type"], s["args"]) for s in e2b_json["steps"]]
    ours = convert(tmp_path, text)
    assert ours.spec()["fromImage"] == "test/base:1" and all(kind != "ENV" for kind, _ in steps(ours))


# --- the CLI ----------------------------------------------------------------------------------------


def test_the_cli_refuses_a_dockerfile_error_before_any_request(tmp_path: Path) -> None:
    from agentcell.cli import main

    ctx = context(tmp_path, {"Dockerfile": f"FROM {BASE}\nLABEL a=b\nCOPY --from=build /a /a\n"})
    # a URL where nothing listens: the conversion fails first
    result = CliRunner().invoke(main, ["template", "build", str(ctx), "--name", "t", "--api-url", "http://127.0.0.1:9"])
    assert result.exit_code == 1, result.output
    assert f"{ctx}/Dockerfile:3: COPY --from=build is not supported" in result.output
    result = CliRunner().invoke(main, ["template", "build", str(ctx), "-f", "-", "--name", "t", "--api-url",
                                       "http://127.0.0.1:9"], input=f"FROM {BASE}\nADD git@host:r.git /r\n")
    assert result.exit_code == 1 and "Dockerfile:2: ADD git@host:r.git: sources from URLs" in result.output
    result = CliRunner().invoke(main, ["template", "build", str(ctx), "--name", "t"], env={"AGENTCELL_URL": None})
    assert result.exit_code != 0 and "needs a running agentcell server" in result.output


def test_the_cli_build_args(tmp_path: Path) -> None:
    from agentcell.cli.templates import _build_args

    os.environ["DF_TEST_FROM_ENV"] = "env value"
    try:
        assert _build_args(("A=1", "B=", "C=x=y", "DF_TEST_FROM_ENV", "DF_TEST_UNSET")) == {
            "A": "1", "B": "", "C": "x=y", "DF_TEST_FROM_ENV": "env value"}
    finally:
        del os.environ["DF_TEST_FROM_ENV"]


# --- end to end: through a real server --------------------------------------------------------------

E2E_TOOLS = ("skopeo", "umoci", "docker-registry")
e2e = pytest.mark.skipif(os.geteuid() != 0 or not all(shutil.which(t) for t in E2E_TOOLS),
                         reason="needs root and skopeo, umoci, docker-registry (scripts/setup)")


@pytest.fixture(scope="module")
def base_image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A musl/busybox image (tests/oci_images.py; users root, user, app) in a loopback registry."""
    from tests.oci_images import Registry, musl_root, root_image

    root = tmp_path_factory.mktemp("base")
    rootfs = musl_root(root / "rootfs")
    (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"
                                       "app:x:1001:1001::/srv:/bin/sh\n")
    (rootfs / "etc/group").write_text("root:x:0:\nuser:x:1000:\napp:x:1001:\n")
    (rootfs / "home/user").mkdir(parents=True)
    root_image(root / "layout", "1", rootfs)
    registry = Registry(root / "registry")
    try:
        registry.push(f"oci:{root / 'layout'}:1", "test/busybox:1")
        yield registry.address
    finally:
        registry.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, base_image: str) -> Iterator[str]:
    from tests.servers import SERVE, ServerProcess

    tmp = tmp_path_factory.mktemp("server")
    args = ["--state-dir", str(tmp / "state"), "--egress-uplink", "none", "--standbys", "0", "--no-record",
            "--insecure-registry", base_image, "--api-key", "test-key"]
    with ServerProcess(tmp / "server.log", *args, command=SERVE) as proc, proc.http_client(60) as http:
        answer = http.post("/v2/templates/probe/builds/probe", json={}, headers={"X-API-KEY": "test-key"})
        if answer.status_code == 501:
            pytest.skip("the server answers 501 to POST /v2/templates/{id}/builds/{buildID}: E2B's build API "
                        "(wp-e2bbuild) is not in this branch yet")
        yield proc.url


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    import sys

    return subprocess.run([sys.executable, "-m", "agentcell", "template", "build", *args], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "AGENTCELL_API_KEY": "test-key"},
                          cwd=Path(__file__).resolve().parent.parent)


@e2e
def test_a_dockerfile_built_by_the_cli_runs_as_a_sandbox(tmp_path: Path, base_image: str, server: str) -> None:
    from agentcell import Sandbox

    ctx = context(tmp_path, {
        "Dockerfile": textwrap.dedent("""
            ARG REGISTRY
            FROM $REGISTRY/test/busybox:1
            ARG GREETING=hi
            ENV APP_GREETING="$GREETING from the image" PATH=/srv/bin:$PATH
            WORKDIR /srv
            COPY --chown=app:app app/ ./app/
            ADD bundle.tar.gz /srv/bundle
            RUN echo "built with $GREETING" > /srv/built.txt && test -z "$APP_MISSING"
            USER app
            CMD ["sh", "-c", "echo started > /tmp/started; sleep 3600"]
            """),
        "app/main.sh": "echo main\n", "app/skip.tmp": "ignored", ".dockerignore": "**/*.tmp\n",
        "bundle.tar.gz": _tar({"lib/x.txt": b"from the archive"}, "w:gz")})
    done = _cli(str(ctx), "--name", "df-e2e", "--api-url", server, "--build-arg", f"REGISTRY={base_image}",
                "--build-arg", "GREETING=hello", "--ready-cmd", "test -e /tmp/started", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["name"] == "df-e2e"
    with Sandbox.create(template="df-e2e", api_url=server, api_key="test-key") as sbx:
        out = sbx.commands.run('echo "$APP_GREETING|$GREETING|$PATH"; pwd; id -un; stat -c %U /srv/app/main.sh; '
                               "for f in /tmp/started /srv/app/main.sh /srv/bundle/lib/x.txt /srv/built.txt; "
                               'do echo "$(cat $f)"; done; ls /srv/app').stdout.splitlines()
    # every fact at once, so that a failure shows all that differs
    assert dict(zip(["env", "pwd", "user", "owner", "started", "main.sh", "archive", "built", "app dir"], out,
                    strict=True)) == {
        "env": "hello from the image||/srv/bin:" + out[0].partition("||/srv/bin:")[2],  # ARG not in the env
        "pwd": "/srv",  # WORKDIR
        "user": out[2],  # USER: test_the_last_user_is_the_sandboxes_default_user
        "owner": out[3],  # COPY --chown: the same test
        "started": "started",  # CMD, the start command
        "main.sh": "echo main",  # COPY
        "archive": "from the archive",  # ADD of a tar.gz, extracted
        "built": "built with hello",  # RUN, with the build arg
        "app dir": "main.sh",  # .dockerignore left skip.tmp out
    }
    assert out[0].startswith("hello from the image||/srv/bin:/")


@e2e
@pytest.mark.xfail(strict=True, reason="a sandbox of a built template runs as `user` whatever the template's last "
                   "USER (E2B: the last USER is the sandbox's default), and image ids other than 0 and 1000 read "
                   "as 65534 in it (COPY --chown=app:app, uid 1001): the image-sandbox side, not the conversion")
def test_the_last_user_is_the_sandboxes_default_user(tmp_path: Path, base_image: str, server: str) -> None:
    from agentcell import Sandbox

    ctx = context(tmp_path, {"a.txt": "a", "Dockerfile": f"FROM {base_image}/test/busybox:1\n"
                                                         "COPY --chown=app:app a.txt /srv/a.txt\nUSER app\n"})
    done = _cli(str(ctx), "--name", "df-user", "--api-url", server)
    assert done.returncode == 0, done.stderr
    with Sandbox.create(template="df-user", api_url=server, api_key="test-key") as sbx:
        out = sbx.commands.run("id -un; stat -c %U:%G /srv/a.txt").stdout.split()
    assert out == ["app", "app:app"]


@e2e
def test_a_failing_step_fails_the_cli_naming_its_line(tmp_path: Path, base_image: str, server: str) -> None:
    ctx = context(tmp_path, {"Dockerfile": f"FROM {base_image}/test/busybox:1\nWORKDIR /srv\n\nUSER nobody-here\n"})
    done = _cli(str(ctx), "--name", "df-fails", "--api-url", server)
    assert done.returncode == 1
    assert f"{ctx}/Dockerfile:4: " in done.stderr and "nobody-here" in done.stderr, done.stderr
    (ctx / "Dockerfile").write_text(f"FROM {base_image}/test/busybox:1\nRUN true\nRUN exit 3\nRUN true\n")
    done = _cli(str(ctx), "--name", "df-fails", "--api-url", server)
    assert done.returncode == 1
    assert f"{ctx}/Dockerfile:3: " in done.stderr, done.stderr


@e2e
def test_e2b_from_dockerfile_builds_on_the_server(tmp_path: Path, base_image: str, server: str) -> None:
    """E2B's own SDK, unchanged: Template().from_dockerfile(...) + Template.build."""
    from e2b import Template

    ctx = context(tmp_path, {"hello.txt": "hello\n"})
    template = Template(file_context_path=str(ctx)).from_dockerfile(
        f"FROM {base_image}/test/busybox:1\nCOPY hello.txt /srv/\nRUN cat /srv/hello.txt\n")
    info = Template.build(template, "df-e2b", api_url=server, api_key="test-key")
    assert info.name == "df-e2b"
    from agentcell import Sandbox

    with Sandbox.create(template="df-e2b", api_url=server, api_key="test-key") as sbx:
        assert sbx.files.read("/srv/hello.txt") == "hello\n"
        assert sbx.commands.run("pwd; id -un").stdout.split() == ["/home/user", "user"]  # E2B's defaults
