"""The runtime store's check, started before the server's own imports.

`agentcell serve` spends ~0.7 s importing the server (starlette, e2b's generated classes ...) and the
warm store check takes ~0.6 s (a stat of every file of the venv); both used to run one after the
other, in front of the zygote's ~2 s import of the sandboxes' Python runtime, which cannot start before
the store is checked (the zygote runs from it). start() runs the check in a thread at the top of
`serve`, so the first LinuxBackend.start() finds it done (take()) and launches its zygote at once.

The check is the same call with the same arguments the backend makes (runtime_store.ensure() with the
defaults read from the environment), so what the sandboxes get does not change; an error reaches the
backend's start() exactly as before, through the future.
"""

from __future__ import annotations

import concurrent.futures
import threading

from agentcell.backends.linux import runtime_store

_lock = threading.Lock()
_pending: concurrent.futures.Future[runtime_store.Store] | None = None


def start() -> None:
    """Begin runtime_store.ensure() in a thread (once per process). Call after the environment that
    names the store (AGENTCELL_RUNTIME_STORE, AGENTCELL_RUNTIME_STORE_MAX_GB) is final."""
    global _pending
    with _lock:
        if _pending is not None:
            return
        future: concurrent.futures.Future[runtime_store.Store] = concurrent.futures.Future()
        _pending = future

    def run() -> None:
        try:
            future.set_result(runtime_store.ensure())
        except BaseException as e:  # noqa: BLE001 - handed to whoever takes it
            future.set_exception(e)

    threading.Thread(target=run, name="agentcell-store-check", daemon=True).start()


def take() -> concurrent.futures.Future[runtime_store.Store] | None:
    """The check start() began, for its one taker (the first backend to start); None if none was."""
    global _pending
    with _lock:
        future, _pending = _pending, None
    return future
