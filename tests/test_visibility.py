"""`attention/visibility.py`, the one statement of which keys a query sees: ints, numpy arrays
and torch tensors agree with a brute-force reading of the rule."""

from __future__ import annotations

import numpy as np
import torch
from hybrid_cache.attention.visibility import first_visible_position, is_visible, visibility_mask

RULES = [(None, None), (1, None), (4, None), (None, 4), (5, 8), (9, 4)]


def sees(p: int, k: int, window, chunk) -> bool:
    return (
        k <= p
        and (window is None or p - k < window)
        and (chunk is None or k // chunk == p // chunk)
    )


def test_first_visible_position_is_the_first_key_seen_for_every_array_type():
    positions = list(range(40))
    for window, chunk in RULES:
        expected = [min(k for k in range(p + 1) if sees(p, k, window, chunk)) for p in positions]
        assert [first_visible_position(p, window, chunk) for p in positions] == expected
        as_numpy = first_visible_position(np.array(positions), window, chunk)
        as_torch = first_visible_position(torch.tensor(positions), window, chunk)
        assert as_numpy.tolist() == as_torch.tolist() == expected


def test_mask_is_the_rule():
    queries, keys = torch.arange(30), torch.arange(30)
    for window, chunk in RULES:
        mask = visibility_mask(queries, keys, window, chunk)
        expected = [[sees(p, k, window, chunk) for k in range(30)] for p in range(30)]
        assert mask.tolist() == expected
        assert (
            is_visible(np.arange(30)[:, None], np.arange(30)[None, :], window, chunk).tolist()
            == expected
        )
