"""`python -m agentcell.server [serve options]`: the same as `agentcell serve`."""

from __future__ import annotations

import sys

from agentcell.cli import main

if __name__ == "__main__":
    main(["serve", *sys.argv[1:]], prog_name="python -m agentcell.server")
