"""OpenAI Agents SDK: agentcell's own MCP server as the agent's tools (create_sandbox, run_code,
run_command, read_file, write_file, list_files, kill_sandbox ...), over stdio or streamable HTTP.
The sandboxes an MCP session creates are killed when the session ends."""

import asyncio
import os

from agents import Agent, Runner
from agents.mcp import MCPServerStdio, MCPServerStreamableHttp


def agentcell_mcp(transport: str = "stdio"):
    url, key = os.environ["AGENTCELL_URL"], os.environ["AGENTCELL_API_KEY"]
    if transport == "http":  # `agentcell serve` answers MCP at /mcp, under its API key
        return MCPServerStreamableHttp(name="agentcell", params={"url": f"{url}/mcp", "headers": {"X-API-KEY": key}})
    # `agentcell mcp` as a child process; MCP clients pass it no environment unless told to
    return MCPServerStdio(name="agentcell", params={
        "command": "agentcell", "args": ["mcp"], "env": {"AGENTCELL_URL": url, "AGENTCELL_API_KEY": key}})


async def ask(model, task: str, transport: str = "stdio"):
    """`model`: a model name ("gpt-5-mini") or an agents `Model`. Returns the run's result."""
    async with agentcell_mcp(transport) as agentcell:
        agent = Agent(name="coder", instructions="Create a sandbox, then work in it with its tools.",
                      mcp_servers=[agentcell], model=model)
        return await Runner.run(agent, task)


if __name__ == "__main__":
    print(asyncio.run(ask("gpt-5-mini", "What is 6*7? Compute it in a sandbox.")).final_output)
