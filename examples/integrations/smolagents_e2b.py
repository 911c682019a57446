"""smolagents: a CodeAgent whose code actions run in an agentcell sandbox (its E2B executor, which makes
the sandbox with e2b_code_interpreter and kills it at cleanup)."""

from smolagents import CodeAgent


def build_agent(model) -> CodeAgent:
    """`model`: any smolagents model (InferenceClientModel, LiteLLMModel, OpenAIServerModel ...)."""
    return CodeAgent(tools=[], model=model, executor_type="e2b")


if __name__ == "__main__":
    from smolagents import InferenceClientModel

    with build_agent(InferenceClientModel()) as agent:  # the with: the sandbox is killed on the way out
        print(agent.run("What is 6*7? Compute it in Python."))
