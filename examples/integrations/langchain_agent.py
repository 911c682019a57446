"""LangChain: an agent whose tool runs Python in an agentcell sandbox, through E2B's code interpreter SDK."""

from e2b_code_interpreter import Sandbox
from langchain.agents import create_agent
from langchain.tools import tool


def sandbox_tool(sandbox: Sandbox):
    @tool
    def run_python(code: str) -> str:
        """Run Python in a Jupyter kernel in a sandbox (variables persist between calls); returns the output."""
        execution = sandbox.run_code(code)
        if execution.error:
            return f"{execution.error.name}: {execution.error.value}\n{execution.error.traceback}"
        return "".join(execution.logs.stdout + execution.logs.stderr) + (execution.text or "")

    return run_python


def build_agent(model, sandbox: Sandbox):
    """`model`: any LangChain chat model that calls tools (or its "provider:name" string)."""
    return create_agent(model, tools=[sandbox_tool(sandbox)],
                        system_prompt="Compute with the run_python tool; it runs in a sandbox.")


if __name__ == "__main__":
    sandbox = Sandbox.create()
    try:
        agent = build_agent("openai:gpt-5-mini", sandbox)
        result = agent.invoke({"messages": [{"role": "user", "content": "What is 6*7? Use Python."}]})
        print(result["messages"][-1].content)
    finally:
        sandbox.kill()
