"""`python -m agentcell.cli ...` is the `agentcell` command."""

from agentcell.cli import main

main()
