"""Memory sizes as people write them: `40GiB`, `512MB`, `1.5 gib`, or plain bytes.

One parser for every place a size is taken (the `plan` command, `LLM(kv_cache_memory=...)`,
benchmark flags), so `40GB` means the same thing everywhere: decimal units (KB, MB, GB, TB) are
powers of 1000, binary units (KiB, MiB, GiB, TiB) powers of 1024, as on disk labels and in
`nvidia-smi` respectively. Units are case-insensitive.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Union

from hybrid_cache.errors import MemorySizeError

MemorySize = Union[int, str]

_UNIT_BYTES = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")
_BINARY_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def parse_memory_size(value: MemorySize) -> int:
    """Returns the size in bytes. Fractional sizes (`1.5GiB`) must come to whole bytes."""
    if isinstance(value, bool):
        raise MemorySizeError(f"memory size must be bytes or a string like '40GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise MemorySizeError(f"memory size must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise MemorySizeError(
            f"memory size must be bytes or a string like '40GiB', got {type(value).__name__}"
        )
    match = _SIZE_PATTERN.match(value)
    if match is None:
        raise MemorySizeError(
            f"cannot read memory size {value!r}: write bytes or a number with a unit, "
            "e.g. '40GiB', '512MB', '1.5TiB'"
        )
    number_text, unit_text = match.groups()
    unit_bytes = _UNIT_BYTES.get(unit_text.lower())
    if unit_bytes is None:
        raise MemorySizeError(
            f"unknown unit {unit_text!r} in memory size {value!r}: use one of "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
        )
    try:
        num_bytes = Decimal(number_text) * unit_bytes
    except InvalidOperation as error:  # pragma: no cover - the pattern only admits decimals
        raise MemorySizeError(f"cannot read the number in memory size {value!r}") from error
    if num_bytes != num_bytes.to_integral_value():
        raise MemorySizeError(
            f"memory size {value!r} is {num_bytes} bytes, not a whole number of bytes: "
            "use a larger unit or fewer decimals"
        )
    return int(num_bytes)


def format_memory_size(num_bytes: int) -> str:
    """Readable binary size, e.g. `40.00 GiB`; sizes under 1 KiB in bytes."""
    for unit, unit_bytes in _BINARY_UNITS:
        if abs(num_bytes) >= unit_bytes:
            return f"{num_bytes / unit_bytes:.2f} {unit}"
    return f"{num_bytes} B"
