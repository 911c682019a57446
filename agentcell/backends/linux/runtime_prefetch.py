"""The runtime store's check and the "base" zygote, started before the server's own imports.

`agentcell serve` spends ~0.7 s importing the server (starlette, e2b's generated classes ...), the warm
store check takes ~0.6 s (a stat of every file of the venv) and the zygote's import of the sandboxes'
Python runtime ~1.5 s. One after the other they were a warm start of over 2 s. start() runs the check
in a thread at the top of `serve` and, when the store has a note of the parts the last start of this
layout found (runtime_store.last_store), launches the zygote from those parts at once: it imports while
the server imports itself and checks. The first LinuxBackend.start() takes both (take()): it places
the zygote if the check found the same parts, and discards it otherwise (a changed venv or checkout),
so what sandboxes run is always what the check found.

The check is the same call with the same arguments the backend makes (runtime_store.ensure() with the
defaults read from the environment), so what the sandboxes get does not change; an error reaches the
backend's start() exactly as before, through the future.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import threading
from dataclasses import dataclass

from agentcell.backends.linux import runtime_store
from agentcell.backends.linux.zygote_process import DEFAULT_ENTRY, ZygoteProcess
from agentcell.runtime import statedir


@dataclass
class Early:
    check: concurrent.futures.Future[runtime_store.Store]
    zygote: ZygoteProcess | None  # launched from the last start's parts, not yet placed


_lock = threading.Lock()
_pending: Early | None = None


def start(zygote: bool = True) -> None:
    """Begin runtime_store.ensure() in a thread (once per process), and launch the "base" zygote
    from the last start's parts if `zygote`. Call after the environment that names the store
    (AGENTCELL_RUNTIME_STORE, AGENTCELL_RUNTIME_STORE_MAX_GB) is final."""
    global _pending
    with _lock:
        if _pending is not None:
            return
        future: concurrent.futures.Future[runtime_store.Store] = concurrent.futures.Future()
        try:
            layout: runtime_store.Layout | None = runtime_store.plan()  # once, for the three of them
        except OSError:
            layout = None  # ensure() plans again and says why, through the future
        _pending = Early(future, _launch(layout) if zygote and layout is not None else None)

    walker = _walk_in_child(layout) if layout is not None else None

    def run() -> None:
        try:
            future.set_result(runtime_store.ensure(layout, stat_keys=_keys_from(walker)))
        except BaseException as e:  # noqa: BLE001 - handed to whoever takes it
            future.set_exception(e)

    threading.Thread(target=run, name="agentcell-store-check", daemon=True).start()


def _walk_in_child(layout: runtime_store.Layout) -> tuple[int, int] | None:
    """The store check's walk (a stat of every file of the venv: ~0.5 s of CPU) in a forked child, so
    that it does not share this process's GIL with the server's imports meanwhile. (pid, read end)."""
    try:
        r, w = os.pipe()
    except OSError:
        return None
    pid = os.fork()
    if pid == 0:  # the child: no thread of ours runs yet (serve calls start() first thing); only the walk
        try:
            os.close(r)
            os.nice(10)  # the zygote's imports are the longer wait: they go first
            data = json.dumps(runtime_store.stat_keys(layout)).encode()
            with os.fdopen(w, "wb") as out:
                out.write(data)
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def _keys_from(walker: tuple[int, int] | None) -> dict[str, str] | None:
    """The child's stat keys; None if it failed (ensure() then walks itself)."""
    if walker is None:
        return None
    pid, r = walker
    try:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        os.waitpid(pid, 0)
        keys = json.loads(data) if data else None
    except (OSError, ValueError):
        return None
    return keys if isinstance(keys, dict) else None


def _launch(layout: runtime_store.Layout) -> ZygoteProcess | None:
    try:
        last = runtime_store.last_store(layout)
    except (OSError, runtime_store.RuntimeStoreError):
        return None
    if last is None:
        return None
    try:
        state_dir = statedir.private_dir(statedir.default_state_dir("zygote"))
        return ZygoteProcess("base", DEFAULT_ENTRY, True, last, state_dir)
    except (OSError, statedir.UnsafeDirectoryError) as e:
        last.close()
        print(f"agentcell: could not start the zygote early ({e}); it starts after the runtime check",
              file=sys.stderr)
        return None


def take() -> Early | None:
    """What start() began, for its one taker (the first backend to start); None if nothing was."""
    global _pending
    with _lock:
        early, _pending = _pending, None
    return early
