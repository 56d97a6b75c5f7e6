"""Logprobs: the chosen token's and the top-k of each row of raw logits, and their output form.

Rows are kept compact while a request runs (`TokenLogprobs`: the chosen token's id, logprob and
rank, then the top k's ids and logprobs, whose ranks are 1..k) and turned into vLLM's form, one
dict token id -> `Logprob(logprob, rank, decoded_token)` per position, when the request's output
is built. A batch whose rows all ask for the same k gets its rows from one `.tolist()` per
column, with no per-row Python.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import numpy as np
import torch

from hybrid_cache.engine.outputs import Logprob

# One position: the chosen token's id, logprob and rank; the top k's ids and logprobs (ranks
# 1..k, most likely first).
TokenLogprobs = tuple[int, float, int, list[int], list[float]]


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int]
) -> list[TokenLogprobs]:
    """Per row of `logits` [rows, vocab]: the logprob and rank of `token_ids[row]` and the
    `num_logprobs[row]` most likely tokens, from the log_softmax of the logits as given (rank
    1 = most likely; the chosen token's rank counts the tokens at least as likely). The
    log_softmax and top k are torch's; on the CPU the rest runs in numpy (fewer, cheaper calls
    on the same floats)."""
    logprobs = logits.float().log_softmax(dim=-1)
    k = min(max(num_logprobs, default=0), logprobs.shape[-1])
    top_values = top_ids = None
    if k > 0:
        top_values, top_ids = logprobs.topk(k, dim=-1)
    if logprobs.device.type == "cpu":
        array = logprobs.numpy()
        chosen_ids = token_ids.numpy()
        chosen = array[np.arange(len(chosen_ids)), chosen_ids][:, None]
        top = None if top_values is None else top_values.numpy()
    else:
        array = logprobs
        chosen_ids = token_ids.to(logprobs.device)
        chosen = logprobs.gather(1, chosen_ids.view(-1, 1))
        top = top_values
    ranks = chosen_ranks(array, chosen, top).tolist()
    chosen_values = chosen[:, 0].tolist()
    chosen_list = chosen_ids.tolist()
    if top_values is None or top_ids is None:
        return [(token, value, rank, [], []) for token, value, rank in zip(chosen_list, chosen_values, ranks)]
    values_rows, ids_rows = top.tolist(), top_ids.tolist()
    if min(num_logprobs) == k:  # every row asks for the same top k: the columns as they are
        return list(zip(chosen_list, chosen_values, ranks, ids_rows, values_rows))
    return [
        (token, value, rank, ids[:count], row_values[:count])
        for token, value, rank, ids, row_values, count in zip(
            chosen_list, chosen_values, ranks, ids_rows, values_rows, num_logprobs
        )
    ]


def chosen_ranks(logprobs: Any, chosen: Any, top: Optional[Any]) -> Any:
    """Per row, how many of `logprobs` [rows, vocab] are at least `chosen` [rows, 1] (numpy
    arrays or tensors alike). When every chosen value is above its row's least top value
    (`top`: each row's top k, descending), only the top k can be at least as large, so those
    are counted instead of the whole row: the same counts (a NaN anywhere there fails the
    test and takes the whole-row count)."""
    if top is not None and bool((chosen > top[:, -1:]).all()):
        return (top >= chosen).sum(-1)
    return (logprobs >= chosen).sum(-1)


# Each token's own text, per tokenizer, decoded once (forgotten with the tokenizer).
_token_texts: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def logprob_dicts(
    rows: Iterable[TokenLogprobs], tokenizer: Optional[Any]
) -> list[dict[int, Logprob]]:
    """vLLM's form of `rows`: per position, token id -> `Logprob`, the chosen token first (a
    top-k token that is also the chosen one appears once). `decoded_token` is each token's own
    text when a tokenizer is given, else None."""
    rows = list(rows)
    texts: dict[int, str] = {}
    if tokenizer is not None:
        texts = _token_texts.setdefault(tokenizer, {})
        seen = {row[0] for row in rows}.union(*(row[3] for row in rows))
        unique = sorted(seen - texts.keys())
        if unique:
            texts.update(zip(unique, tokenizer.batch_decode([[token] for token in unique])))
    result = []
    for chosen, value, rank, ids, values in rows:
        position = {chosen: Logprob(value, rank, texts.get(chosen))}
        for top_rank, (token, top_value) in enumerate(zip(ids, values), 1):
            if token not in position:
                position[token] = Logprob(top_value, top_rank, texts.get(token))
        result.append(position)
    return result
