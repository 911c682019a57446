"""Deep Agents: the agent's file tools (ls, read_file, write_file, edit_file, glob, grep) and its shell
(execute) run in an agentcell sandbox, through langchain-e2b's backend."""

from deepagents import create_deep_agent
from e2b import Sandbox
from langchain_e2b import E2BSandbox


def build_agent(model, sandbox: Sandbox):
    """`model`: any LangChain chat model that calls tools (or its "provider:name" string)."""
    return create_deep_agent(model=model, backend=E2BSandbox(sandbox=sandbox),
                             system_prompt="You are a coding agent working in an isolated Linux sandbox.")


if __name__ == "__main__":
    sandbox = Sandbox.create(timeout=600)
    try:
        agent = build_agent("anthropic:claude-sonnet-4-6", sandbox)
        task = "Write /home/user/hello.py that prints 6*7, run it, and tell me what it printed."
        result = agent.invoke({"messages": [{"role": "user", "content": task}]})
        print(result["messages"][-1].content)
    finally:
        sandbox.kill()
