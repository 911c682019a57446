"""`python -m agentcell.cli ...` is the `agentcell` command."""

from agentcell.cli import main

main(prog_name="agentcell")
