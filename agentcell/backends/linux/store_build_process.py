"""The runtime store's check-and-build (runtime_store._check_and_build), in a process of its own.

A start whose parts changed reads the store's hash cache: one entry per file any venv on the host ever
had (900,000 on a host that made many venvs: hundreds of MB as Python objects), then hashes and places
thousands of files with two forked workers (store_workers.py). In the server's process that memory
stayed as its allocators' high-water mark for the server's life (docs/reliability.md), and the workers
were forks of a multi-threaded server. Here it comes and goes with this process.

The caller holds the store's build lock and hands it over (an inherited fd: the lock is held until both
have closed it); the layout goes in pickled on stdin. Out come JSON lines on stdout: each log record
(the caller logs it as its own, under the same logger, so progress lines read as they always did), then
the parts' directory names, or an error.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from agentcell.backends.linux.runtime_store import Layout


class BuildProcessError(OSError):
    """The check-and-build process failed on the filesystem, or died; the message says which."""


class BuildRefused(Exception):
    """The check-and-build refused (runtime_store.RuntimeStoreError in the process): its message."""


def run(layout: Layout, root: str, build_lock_fd: int, log: Callable[[str], None]) -> list[str]:
    """Each part's directory name in the store (found, or built now), in the order of layout.parts."""
    with subprocess.Popen([sys.executable, "-m", __name__, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          pass_fds=(build_lock_fd,)) as proc:  # its pipes closed and the process waited for
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(pickle.dumps(layout))
        proc.stdin.close()
        names, error = _relay(proc.stdout, log)
    code = proc.returncode
    if error is not None:
        kind, message = error
        raise BuildRefused(message) if kind == "refused" else BuildProcessError(message)
    if names is None:
        raise BuildProcessError(f"the runtime store's build ({sys.executable} -m {__name__}) ended with "
                                f"{code} and no answer (its error is in the log above)")
    return names


def _relay(out: IO[bytes], log: Callable[[str], None]) -> tuple[list[str] | None, tuple[str, str] | None]:
    names: list[str] | None = None
    error: tuple[str, str] | None = None
    for line in out:
        try:
            msg = json.loads(line)
        except ValueError:
            continue  # not ours (a library printing): it must not hide the answer
        if "record" in msg:
            rec = msg["record"]
            logging.getLogger(rec["name"]).log(rec["level"], "%s", rec["message"])
        elif "log" in msg:
            log(msg["log"])
        elif "names" in msg:
            names = [str(n) for n in msg["names"]]
        elif "error" in msg:
            error = (str(msg.get("kind")), str(msg["error"]))
    return names, error


class _ToParent(logging.Handler):
    def __init__(self, out: IO[str]) -> None:
        super().__init__()
        self.out = out

    def emit(self, record: logging.LogRecord) -> None:
        say(self.out, record={"name": record.name, "level": record.levelno, "message": record.getMessage()})


_saying = threading.Lock()  # progress lines come from a timer thread too: one whole line at a time


def say(out: IO[str], **msg: object) -> None:
    with _saying:
        out.write(json.dumps(msg) + "\n")
        out.flush()


def main() -> None:
    root = sys.argv[1]
    out = os.fdopen(os.dup(1), "w")  # ours alone: anything else printing goes to stderr
    os.dup2(2, 1)
    logging.getLogger().addHandler(_ToParent(out))
    logging.getLogger().setLevel(logging.INFO)
    from agentcell.backends.linux import runtime_store
    from agentcell.runtime import statedir

    layout = pickle.loads(sys.stdin.buffer.read())  # noqa: S301 (our own parent's, through a pipe)
    try:
        names = runtime_store.find_or_build(layout, root, lambda m: say(out, log=m))
    except (runtime_store.RuntimeStoreError, statedir.UnsafeDirectoryError) as e:
        say(out, error=str(e), kind="refused")
        sys.exit(1)
    except OSError as e:
        say(out, error=str(e), kind="os")
        sys.exit(1)
    say(out, names=names)


if __name__ == "__main__":
    main()
