"""Argument checks shared by the planner's `PlanOptions` and the engine's `EngineConfig`.

Each check raises the error type its caller gives, with a message that says what to change:
`what` is how the caller names the value (`"group_layout"`, or `"--kv-group-layout"` followed by
`hint`, e.g. " (LLM argument kv_group_layout)").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybrid_cache.errors import HybridCacheError, InvalidBlockSizeError


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive_int(
    value: Any, what: str, error: type[HybridCacheError], hint: str = ""
) -> None:
    if not is_int(value) or value <= 0:
        raise error(f"{what} must be a positive integer, got {value!r}{hint}")


def check_bool(value: Any, what: str, error: type[HybridCacheError], hint: str = "") -> None:
    if not isinstance(value, bool):
        raise error(f"{what} must be True or False, got {value!r}{hint}")


def check_choice(
    value: Any, choices: Sequence[str], what: str, error: type[HybridCacheError], hint: str = ""
) -> None:
    if value not in choices:
        raise error(f"{what} must be one of {', '.join(choices)}, got {value!r}{hint}")


def check_block_size(value: Any, what: str = "block size", hint: str = "") -> None:
    """A positive power of two (`InvalidBlockSizeError` otherwise)."""
    if not is_int(value) or value <= 0:
        raise InvalidBlockSizeError(f"{what} must be a positive power of two, got {value!r}{hint}")
    if value & (value - 1):
        raise InvalidBlockSizeError(
            f"{what} must be a positive power of two (8, 16, 32, ...), got {value}{hint}"
        )
