"""The console's response headers and error answers."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

# the pages' policy (docs/console.md): nothing but this origin, no inline scripts, never framed
PAGE_CSP = ("default-src 'self'; img-src 'self' data: blob:; style-src 'self' 'unsafe-inline'; connect-src 'self'; "
            "frame-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
# a passed-through answer (the HTML report) may be shown in the console's own <iframe sandbox>
PASSED_CSP = "frame-ancestors 'self'; base-uri 'none'; form-action 'none'"
_COMMON = ((b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer"),
           (b"cache-control", b"no-store"))


def with_headers(send: Any, csp: str, cache: bool = False) -> Any:
    """`send` with the console's security headers added to the response head (replacing any CSP)."""

    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            drop = {b"content-security-policy", b"x-content-type-options", b"referrer-policy"}
            if not cache:
                drop.add(b"cache-control")
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in drop]
            headers += [(b"content-security-policy", csp.encode())]
            headers += [h for h in _COMMON if cache is False or h[0] != b"cache-control"]
            message = {**message, "headers": headers}
        await send(message)

    return wrapped


def framable(send: Any) -> Any:
    """`send` for an answer passed through from the API: the server's own CSP kept (the HTML report's
    keeps its content inert), but with `frame-ancestors 'self'` so the console's <iframe sandbox> may
    show it, and no X-Frame-Options; not cached."""

    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            drop = {b"content-security-policy", b"x-frame-options", b"x-content-type-options", b"referrer-policy",
                    b"cache-control"}
            theirs = [v.decode("latin-1") for k, v in message.get("headers", []) if k.lower() == b"content-security-policy"]
            directives = [d.strip() for policy in theirs for d in policy.split(";")
                          if d.strip() and not d.strip().lower().startswith("frame-ancestors")]
            csp = "; ".join([*directives, "frame-ancestors 'self'"]) if directives else PASSED_CSP
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in drop]
            headers += [(b"content-security-policy", csp.encode()), *_COMMON]
            message = {**message, "headers": headers}
        await send(message)

    return wrapped


def error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"message": message, **extra}, status_code=status)
