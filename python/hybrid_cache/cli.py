"""The `hybrid-cache` command line: one subcommand per module in `hybrid_cache.commands`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from hybrid_cache.commands import register_all
from hybrid_cache.errors import HybridCacheError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-cache",
        description="KV-cache planning and inference for hybrid full/sliding-window attention LLMs",
    )
    register_all(parser.add_subparsers(title="commands", metavar="COMMAND"))
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs one subcommand; returns the exit code (1 for a typed error, printed without a
    traceback because its message already says what to change)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.handler(args)
    except HybridCacheError as error:
        print(f"hybrid-cache: error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
