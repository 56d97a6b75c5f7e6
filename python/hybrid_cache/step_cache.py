"""Per-step caches: a value built once per step and reused by every layer, stored on an object
that lives exactly as long as the step (its attention metadata, its positions tensor)."""

from __future__ import annotations

from typing import Any, Callable


def cached_on(
    owner: Any, attribute: str, key: tuple, sources: tuple, build: Callable[[], Any]
) -> Any:
    """`build()`, computed once per (owner, key) while `sources` are the same objects.

    `owner` is a per-step metadata object, so the cache lives exactly as long as the step.
    """
    cache: dict = owner.__dict__.setdefault(attribute, {})
    entry = cache.get(key)
    if entry is not None and len(entry[0]) == len(sources):
        if all(old is new for old, new in zip(entry[0], sources)):
            return entry[1]
    value = build()
    cache[key] = (sources, value)
    return value
