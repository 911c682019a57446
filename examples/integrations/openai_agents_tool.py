"""OpenAI Agents SDK: a function tool that runs Python in an agentcell sandbox (e2b_code_interpreter)."""

from agents import Agent, Runner, function_tool
from e2b_code_interpreter import Sandbox


def build_agent(model, sandbox: Sandbox) -> Agent:
    """`model`: a model name ("gpt-5-mini") or an agents `Model`."""

    @function_tool
    def run_python(code: str) -> str:
        """Run Python in a Jupyter kernel in a sandbox (variables persist between calls); returns the output."""
        execution = sandbox.run_code(code)
        if execution.error:
            return f"{execution.error.name}: {execution.error.value}\n{execution.error.traceback}"
        return "".join(execution.logs.stdout + execution.logs.stderr) + (execution.text or "")

    return Agent(name="analyst", instructions="Compute with the run_python tool; it runs in a sandbox.",
                 tools=[run_python], model=model)


if __name__ == "__main__":
    sandbox = Sandbox.create()
    try:
        result = Runner.run_sync(build_agent("gpt-5-mini", sandbox), "What is 6*7? Use Python.")
        print(result.final_output)
    finally:
        sandbox.kill()
