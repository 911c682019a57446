"""Runs one snippet of docs/integrations.md (examples/integrations/NAME.py) in the integrations venv, with a
fake model where one is needed, against the agentcell server the environment names; prints one JSON line
of what happened (the tool's results, the agent's answer, the sandbox), which tests/test_integrations.py
checks against the sandbox itself. Sandboxes the snippet leaves alive are the test's to check and kill.

    python run_snippet.py langchain_agent | langchain_e2b_backend | deepagents_e2b | smolagents_e2b
    python run_snippet.py openai_agents_tool
    python run_snippet.py openai_agents_mcp stdio|http
    python run_snippet.py e2b_mcp_server PYTHON_OF_ITS_VENV [shim|unshimmed]
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "integrations"
# What the fake models make the agents do: compute 6*7 in the sandbox and leave a file there.
CODE = "open('/home/user/{name}.txt', 'w').write(str(6*7))\nprint(6*7)"


def snippet(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def langchain_model(steps: list[Any]) -> Any:
    """A LangChain chat model that answers with `steps` in turn: an AIMessage, or a function of the
    conversation so far returning one (to quote a tool's result back)."""
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.outputs import ChatGeneration, ChatResult

    class ScriptedChatModel(BaseChatModel):
        script: list[Any]
        turn: int = 0

        @property
        def _llm_type(self) -> str:
            return "scripted"

        def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedChatModel:
            return self

        def _generate(self, messages: list[Any], stop: Any = None, run_manager: Any = None, **kwargs: Any) -> ChatResult:
            step = self.script[self.turn]
            self.turn += 1
            message = step(messages) if callable(step) else step
            return ChatResult(generations=[ChatGeneration(message=message)])

    return ScriptedChatModel(script=steps)


def quote_last_tool_result(messages: list[Any]) -> Any:
    from langchain_core.messages import AIMessage, ToolMessage

    last = [m for m in messages if isinstance(m, ToolMessage)][-1]
    return AIMessage(content=f"The sandbox said: {last.content}")


def run_langchain_agent() -> dict[str, Any]:
    from e2b_code_interpreter import Sandbox
    from langchain_core.messages import AIMessage, ToolMessage

    code = CODE.format(name="langchain")
    model = langchain_model([
        AIMessage(content="", tool_calls=[{"name": "run_python", "args": {"code": code}, "id": "call_1"}]),
        quote_last_tool_result])
    sandbox = Sandbox.create()
    result = snippet("langchain_agent").build_agent(model, sandbox).invoke(
        {"messages": [{"role": "user", "content": "What is 6*7? Use Python."}]})
    tools = [m.content for m in result["messages"] if isinstance(m, ToolMessage)]
    return {"sandbox_id": sandbox.sandbox_id, "tool_results": tools, "answer": result["messages"][-1].content}


def run_deepagents_e2b() -> dict[str, Any]:
    from e2b import Sandbox
    from langchain_core.messages import AIMessage, ToolMessage

    model = langchain_model([
        AIMessage(content="", tool_calls=[{"name": "write_file", "id": "call_1", "args": {
            "file_path": "/home/user/hello.py", "content": "print(6*7)\n"}}]),
        AIMessage(content="", tool_calls=[{"name": "execute", "id": "call_2", "args": {
            "command": "python3 /home/user/hello.py && echo ran as $(whoami) on $(hostname)"}}]),
        quote_last_tool_result])
    sandbox = Sandbox.create(timeout=600)
    task = "Write /home/user/hello.py that prints 6*7, run it, and tell me what it printed."
    result = snippet("deepagents_e2b").build_agent(model, sandbox).invoke({"messages": [{"role": "user", "content": task}]})
    tools = [m.content for m in result["messages"] if isinstance(m, ToolMessage)]
    return {"sandbox_id": sandbox.sandbox_id, "tool_results": tools, "answer": result["messages"][-1].content}


def run_langchain_e2b_backend() -> dict[str, Any]:
    from e2b import Sandbox
    from langchain_e2b import E2BSandbox

    sandbox = Sandbox.create()
    results = snippet("langchain_e2b_backend").tour(E2BSandbox(sandbox=sandbox))
    return {"sandbox_id": sandbox.sandbox_id, **{k: dataclasses.asdict(v) for k, v in results.items()}}


def run_smolagents_e2b() -> dict[str, Any]:
    from smolagents.models import ChatMessage, MessageRole, Model

    class FixedCodeModel(Model):
        """Answers every turn with the same code action (the first one ends the run by final_answer)."""

        def generate(self, messages: Any, stop_sequences: Any = None, **kwargs: Any) -> ChatMessage:
            action = ("Thought: I compute it in the sandbox.\n<code>\n" + CODE.format(name="smolagents")
                      + "\nfinal_answer(6*7)\n</code>")
            return ChatMessage(role=MessageRole.ASSISTANT, content=action)

    agent = snippet("smolagents_e2b").build_agent(FixedCodeModel(model_id="fixed"))
    answer = agent.run("What is 6*7? Compute it in Python.")
    logs = [getattr(step, "observations", None) for step in agent.memory.steps]
    return {"sandbox_id": agent.python_executor.sandbox.sandbox_id, "answer": answer,
            "tool_results": [o for o in logs if o]}


def openai_model(plan: Any) -> Any:
    """An agents `Model` whose next output `plan(input items)` decides: a tool call (name, arguments)
    or a final text."""
    from agents import ModelResponse, Usage
    from agents.models.interface import Model
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

    class ScriptedModel(Model):
        turn = 0

        async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any) -> ModelResponse:
            self.turn += 1
            items = [input] if isinstance(input, str) else list(input)
            step = plan(self.turn, [i if isinstance(i, dict) else i.model_dump() for i in items])
            if isinstance(step, tuple):
                name, arguments = step
                out: Any = ResponseFunctionToolCall(type="function_call", name=name, arguments=json.dumps(arguments),
                                                    call_id=f"call_{self.turn}", id=f"fc_{self.turn}", status="completed")
            else:
                out = ResponseOutputMessage(type="message", id=f"msg_{self.turn}", role="assistant", status="completed",
                                            content=[ResponseOutputText(type="output_text", text=step, annotations=[])])
            return ModelResponse(output=[out], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("the tests do not stream")

    return ScriptedModel()


def tool_outputs(items: list[dict[str, Any]]) -> list[str]:
    """The text of each tool result (an MCP tool's is a list of content parts)."""
    def text(output: Any) -> str:
        return "".join(part.get("text", "") for part in output) if isinstance(output, list) else str(output)

    return [text(i["output"]) for i in items if i.get("type") == "function_call_output"]


def run_openai_agents_tool() -> dict[str, Any]:
    from agents import Runner, set_tracing_disabled
    from e2b_code_interpreter import Sandbox

    set_tracing_disabled(True)

    def plan(turn: int, items: list[dict[str, Any]]) -> Any:
        if turn == 1:
            return ("run_python", {"code": CODE.format(name="openai_agents")})
        return f"The sandbox said: {tool_outputs(items)[-1]}"

    sandbox = Sandbox.create()
    agent = snippet("openai_agents_tool").build_agent(openai_model(plan), sandbox)
    result = Runner.run_sync(agent, "What is 6*7? Use Python.")
    items = [i if isinstance(i, dict) else i.model_dump() for i in result.to_input_list()]
    return {"sandbox_id": sandbox.sandbox_id, "tool_results": tool_outputs(items), "answer": result.final_output}


def run_openai_agents_mcp(transport: str) -> dict[str, Any]:
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    seen: dict[str, Any] = {}

    def plan(turn: int, items: list[dict[str, Any]]) -> Any:
        outputs = tool_outputs(items)
        if turn == 1:
            return ("create_sandbox", {})
        sandbox_id = seen.setdefault("sandbox_id", re.search(r'"sandbox_id": *"(\w+)"', outputs[0]).group(1))
        if turn == 2:
            return ("write_file", {"sandbox_id": sandbox_id, "path": "/home/user/question.txt", "content": "6*7"})
        if turn == 3:
            return ("run_code", {"sandbox_id": sandbox_id, "code": "print(eval(open('/home/user/question.txt').read()))"})
        if turn == 4:
            return ("run_command", {"sandbox_id": sandbox_id, "command": "cat /home/user/question.txt; echo; whoami"})
        return f"The sandbox said: {outputs[-2]}"

    result = asyncio.run(snippet("openai_agents_mcp").ask(openai_model(plan), "What is 6*7?", transport))
    items = [i if isinstance(i, dict) else i.model_dump() for i in result.to_input_list()]
    return {"sandbox_id": seen.get("sandbox_id"), "tool_results": tool_outputs(items), "answer": result.final_output}


def run_e2b_mcp_server(server_python: str, shim: str = "shim") -> dict[str, Any]:
    """E2B's MCP server through the shim (or, with "unshimmed", as it comes), called by an MCP client (the
    agents SDK's). The package installs no command: its main() is what a client would run."""
    import os

    from agents.mcp import MCPServerStdio

    names = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "PYTHONPATH", "AGENTCELL_NET_GUARD")
    args = ([str(EXAMPLES / "e2b_mcp_server_agentcell.py")] if shim == "shim"
            else ["-c", "from e2b_mcp_server import main; main()"])
    params = {"command": server_python, "args": args,
              "env": {n: os.environ[n] for n in names if n in os.environ}}

    async def call() -> dict[str, Any]:
        async with MCPServerStdio(name="e2b", params=params, client_session_timeout_seconds=60) as e2b:
            tools = [t.name for t in await e2b.list_tools()]
            result = await e2b.call_tool("run_code", {"code": CODE.format(name="e2b_mcp_server")})
            return {"tools": tools, "tool_results": [c.text for c in result.content], "is_error": result.is_error}

    return asyncio.run(call())


def main() -> None:
    name, *rest = sys.argv[1:]
    runs = {"langchain_agent": run_langchain_agent, "langchain_e2b_backend": run_langchain_e2b_backend,
            "deepagents_e2b": run_deepagents_e2b,
            "smolagents_e2b": run_smolagents_e2b, "openai_agents_tool": run_openai_agents_tool,
            "openai_agents_mcp": lambda: run_openai_agents_mcp(*rest),
            "e2b_mcp_server": lambda: run_e2b_mcp_server(*rest)}
    print("RESULT " + json.dumps(runs[name](), default=str), flush=True)


if __name__ == "__main__":
    main()
