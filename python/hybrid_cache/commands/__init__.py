"""Subcommands of the `hybrid-cache` CLI, one module each.

Adding a subcommand: write `commands/<name>.py` with `register(subparsers)` that adds its parser
and sets `handler=<function(args) -> exit code>` with `set_defaults`, then add `<name>` to
`COMMAND_MODULES`. Keep heavy imports (torch, the engine) inside the handler so `hybrid-cache
plan` starts fast and works without them.
"""

from __future__ import annotations

import argparse
import importlib

from hybrid_cache.planner import GROUP_LAYOUTS

COMMAND_MODULES: tuple[str, ...] = ("plan", "generate", "bench")


def add_group_layout_argument(parser: argparse.ArgumentParser) -> None:
    """`--kv-group-layout`, the planner's `group_layout`, for every command that plans."""
    parser.add_argument(
        "--kv-group-layout",
        choices=GROUP_LAYOUTS,
        default="auto",
        help="KV-cache groups: equal-size ('equal'), one per layer type ('per-type'), or 'auto' "
        "(per type where that makes fewer groups with little page padding; docs/PLANNER.md)",
    )


def register_all(subparsers: argparse._SubParsersAction) -> None:
    """Adds every subcommand's parser."""
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
