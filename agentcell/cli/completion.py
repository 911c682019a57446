"""`agentcell completion bash|zsh|fish`: the shell completion script (click's), to source or install."""

from __future__ import annotations

import click
from click.shell_completion import get_completion_class

from agentcell.cli import main

SHELLS = ["bash", "zsh", "fish"]


@main.command()
@click.argument("shell_name", metavar="SHELL", type=click.Choice(SHELLS))
def completion(shell_name: str) -> None:
    """Print the completion script for SHELL.

    \b
      bash: eval "$(agentcell completion bash)"    (in ~/.bashrc)
      zsh:  eval "$(agentcell completion zsh)"     (in ~/.zshrc)
      fish: agentcell completion fish > ~/.config/fish/completions/agentcell.fish
    """
    cls = get_completion_class(shell_name)
    assert cls is not None
    click.echo(cls(main, {}, "agentcell", "_AGENTCELL_COMPLETE").source())
