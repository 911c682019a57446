"""`python -m agentcell ...` is the `agentcell` command."""

from agentcell.cli import main

main()
