"""langchain-e2b on its own: the Deep Agents sandbox backend's operations (shell, files, search) on an
agentcell sandbox, with no agent or model: what a Deep Agent's tools do underneath."""

from e2b import Sandbox
from langchain_e2b import E2BSandbox


def tour(backend: E2BSandbox) -> dict:
    backend.write("/home/user/notes/todo.txt", "buy milk\nwrite tests\n")
    backend.edit("/home/user/notes/todo.txt", "buy milk", "buy oat milk")
    return {
        "execute": backend.execute("python3 -c 'print(6*7)'"),
        "read": backend.read("/home/user/notes/todo.txt"),
        "ls": backend.ls("/home/user/notes"),
        "grep": backend.grep("oat", path="/home/user/notes"),
        "glob": backend.glob("*.txt", path="/home/user/notes"),
    }


if __name__ == "__main__":
    sandbox = Sandbox.create()
    try:
        for operation, result in tour(E2BSandbox(sandbox=sandbox)).items():
            print(operation, result)
    finally:
        sandbox.kill()
