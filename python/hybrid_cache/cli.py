"""The `hybrid-cache` command line: one subcommand per module in `hybrid_cache.commands`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from hybrid_cache._core import __version__
from hybrid_cache.commands import register_all, resolve_nested
from hybrid_cache.errors import HybridCacheError


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Shows each option's default after its help, unless the help already speaks of its
    default or there is none to show (a required option, a switch, an unset value)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if (
            "(default" in text
            or "default:" in text
            or not action.option_strings
            or action.required
            or switch
            or default is None
            or default is argparse.SUPPRESS
            or default == []
        ):
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-cache",
        description="KV-cache planning and inference for hybrid full/sliding-window attention LLMs",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    register_all(subparsers)
    for command in subparsers.choices.values():
        command.formatter_class = DefaultsHelpFormatter
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs one subcommand; returns the exit code (1 for a typed error, printed without a
    traceback because its message already says what to change)."""
    parser = build_parser()
    args = parser.parse_args(resolve_nested(sys.argv[1:] if argv is None else argv))
    if not hasattr(args, "handler"):
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.handler(args)
    except HybridCacheError as error:
        print(f"hybrid-cache: error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
