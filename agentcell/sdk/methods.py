"""`hybrid`: a method callable on an instance (`sbx.kill()`) or on the class (`Sandbox.kill(sandbox_id)`),
as e2b's `class_method_variant` does; `call_back`: a user's callback, sync or async."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any


class hybrid:  # noqa: N801 - used as a decorator
    def __init__(self, class_variant: str) -> None:
        self.class_variant = class_variant
        self.method: Callable[..., Any] | None = None

    def __call__(self, method: Callable[..., Any]) -> Any:
        self.method = method
        functools.update_wrapper(self, method)  # type: ignore[arg-type]
        return self

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        assert self.method is not None
        if obj is not None:
            return functools.partial(self.method, obj)
        class_variant = getattr(objtype, self.class_variant)
        method = self.method

        @functools.wraps(class_variant)
        def call(*args: Any, **kwargs: Any) -> Any:
            if args and objtype is not None and isinstance(args[0], objtype):
                return method(*args, **kwargs)  # Sandbox.kill(sbx) is sbx.kill()
            return class_variant(*args, **kwargs)

        return call


async def call_back(cb: Callable[[Any], Any] | None, value: Any) -> None:
    """Call a user's callback (the async SDK takes plain functions and coroutine functions alike)."""
    if cb is not None:
        r = cb(value)
        if inspect.isawaitable(r):
            await r
