"""Subcommands of the `hybrid-cache` CLI, one module each.

Adding a subcommand: write `commands/<name>.py` with `register(subparsers)` that adds its parser
and sets `handler=<function(args) -> exit code>` with `set_defaults`, then add `<name>` to
`COMMAND_MODULES`. A command that builds an engine takes its flags from
`engine.engine_config.add_engine_arguments` and its config from `engine_config_from_args`. Keep
heavy imports (torch, the engine) inside the handler so `hybrid-cache plan` starts fast and
works without them.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

COMMAND_MODULES: tuple[str, ...] = ("plan", "generate", "bench", "bench_serve", "serve")
# Two-word commands: `hybrid-cache bench serve ...` runs the `bench-serve` parser.
NESTED_COMMANDS: dict[tuple[str, str], str] = {("bench", "serve"): "bench-serve"}


def resolve_nested(argv: Sequence[str]) -> list[str]:
    """The arguments with a two-word command (`NESTED_COMMANDS`) replaced by its parser's name."""
    args = list(argv)
    name = NESTED_COMMANDS.get(tuple(args[:2]))  # type: ignore[arg-type]
    return [name, *args[2:]] if name is not None else args


def register_all(subparsers: argparse._SubParsersAction) -> None:
    """Adds every subcommand's parser."""
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
