"""Run E2B's MCP server (PyPI e2b-mcp-server 0.1.1) against agentcell: `python e2b_mcp_server_agentcell.py`
in place of `e2b-mcp-server`, with E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY set.

It needs this shim: it pins e2b-code-interpreter<2, whose e2b 1.x SDK knows only E2B_DOMAIN (then
https://api.DOMAIN and https://49999-ID.DOMAIN, wildcard DNS and TLS), and it sends run_code without
the sandbox's access token. The shim sends the API to E2B_API_URL and the code to E2B_SANDBOX_URL, naming
the sandbox by E2B's routing headers, with its token."""

import os

import e2b.connection_config
import httpx
from e2b_code_interpreter import Sandbox
from e2b_mcp_server import main, server

API_URL, SANDBOX_URL = os.environ["E2B_API_URL"], os.environ["E2B_SANDBOX_URL"].rstrip("/")
_config_init = e2b.connection_config.ConnectionConfig.__init__


def _at_api_url(self, *args, **kwargs):
    _config_init(self, *args, **kwargs)
    self.api_url = API_URL


class AgentcellSandbox(Sandbox):
    @property
    def _jupyter_url(self) -> str:
        return SANDBOX_URL

    @property
    def _client(self) -> httpx.Client:
        return httpx.Client(transport=self._transport, headers={
            "E2b-Sandbox-Id": self.sandbox_id, "E2b-Sandbox-Port": "49999",
            "X-Access-Token": self._envd_access_token or ""})


e2b.connection_config.ConnectionConfig.__init__ = _at_api_url
server.Sandbox = AgentcellSandbox

if __name__ == "__main__":
    main()
