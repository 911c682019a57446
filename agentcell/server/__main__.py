"""`python -m agentcell.server [--host H] [--port P] [--api-key K]`: run the server."""

from __future__ import annotations

import argparse

from agentcell.server import ServerConfig, serve


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m agentcell.server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=3000)
    p.add_argument("--uds", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-sandboxes", type=int, default=1000)
    p.add_argument("--backend", default="linux")
    a = p.parse_args()
    serve(ServerConfig(host=a.host, port=a.port, uds=a.uds, api_key=a.api_key, max_sandboxes=a.max_sandboxes, backend=a.backend))


if __name__ == "__main__":
    main()
