"""Which keys a query sees: the one statement of the rule every attention backend, the torch
oracle and the row plans apply (the Triton kernel writes the same rule in its own language).

Visibility of key position k to a query at position p (all rules combine with AND):

    causal          k <= p
    sliding window  k >  p - W          (W keys including the query itself; transformers'
                                         `sliding_window_overlay` for Mistral, Gemma-2/3, gpt-oss)
    chunked local   k // C == p // C    (same chunk)

    positions:  0 1 2 3 4 5 6 7 8 9
    W=4, p=7:           . . . x x x x .     keys 4..7
    C=4, p=7:           . . . . x x x x     keys 4..7 (chunk 1)

So the first key a query at p sees is max(0, p - W + 1, (p // C) * C); later queries of the same
sequence see nothing further left, so no key left of the first query's bound is ever read (the
blocks there may be the null block). The functions take Python ints, numpy arrays or torch
tensors alike (torch is not imported here).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np


def _maximum(a: Any, b: Any) -> Any:
    """Element-wise max of two ints, numpy arrays or torch tensors (without importing torch)."""
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    if hasattr(a, "maximum"):  # torch tensors
        return a.maximum(b)
    return np.maximum(a, b)


def keys_left_of_query(sliding_window: int) -> int:
    """How many keys left of itself a query sees under a window of `sliding_window` keys
    (flash-attn's `window_size[0]`)."""
    return sliding_window - 1


def first_visible_position(
    first_query: Any, sliding_window: Optional[int], chunk: Optional[int]
) -> Any:
    """The lowest key position a query at `first_query` (or any later one) can see."""
    low = first_query * 0
    if sliding_window is not None:
        low = _maximum(low, first_query - keys_left_of_query(sliding_window))
    if chunk is not None:
        low = _maximum(low, (first_query // chunk) * chunk)
    return low


def is_visible(query: Any, key: Any, sliding_window: Optional[int], chunk: Optional[int]) -> Any:
    """Whether `key` is visible to `query` (positions; arrays broadcast against each other)."""
    mask = key <= query
    if sliding_window is not None:
        mask &= key >= query - keys_left_of_query(sliding_window)
    if chunk is not None:
        mask &= (key // chunk) == (query // chunk)
    return mask


def visibility_mask(
    query_positions: Any, key_positions: Any, sliding_window: Optional[int], chunk: Optional[int]
) -> Any:
    """[num_queries, num_keys] bool: which of the keys (1-D) each query (1-D) attends to."""
    return is_visible(query_positions[:, None], key_positions[None, :], sliding_window, chunk)
