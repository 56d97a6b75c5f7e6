"""Logprobs: the chosen token's and the top-k of each row of raw logits, and their output form.

Rows are kept compact while a request runs (`TokenLogprobs`: token ids, logprobs, ranks, the
chosen token first, then the top k) and turned into vLLM's form, one dict token id ->
`Logprob(logprob, rank, decoded_token)` per position, when the request's output is built.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch

from hybrid_cache.engine.outputs import Logprob

# (token ids, logprobs, ranks) of one position: the chosen token first, then the top k.
TokenLogprobs = tuple[list[int], list[float], list[int]]


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: Sequence[int]
) -> list[TokenLogprobs]:
    """Per row of `logits` [rows, vocab]: the logprob and rank of `token_ids[row]` and the
    `num_logprobs[row]` most likely tokens, from the log_softmax of the logits as given (rank
    1 = most likely; the chosen token's rank counts the tokens at least as likely)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.view(-1, 1).to(logprobs.device))
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    chosen_values = chosen.squeeze(1).tolist()
    chosen_ids = token_ids.tolist()
    k = max(num_logprobs, default=0)
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k > 0:
        values, indices = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = values.tolist(), indices.tolist()
    if k > 0 and min(num_logprobs) == k:  # every row asks for the same top k: no slicing
        top_ranks = list(range(1, k + 1))
        return [
            ([token, *ids], [value, *values], [rank, *top_ranks])
            for token, value, rank, ids, values in zip(
                chosen_ids, chosen_values, ranks, top_ids, top_values
            )
        ]
    rows: list[TokenLogprobs] = []
    for row, count in enumerate(num_logprobs):
        ids = [chosen_ids[row]]
        values_row = [chosen_values[row]]
        ranks_row = [ranks[row]]
        if count:
            ids += top_ids[row][:count]
            values_row += top_values[row][:count]
            ranks_row += list(range(1, count + 1))
        rows.append((ids, values_row, ranks_row))
    return rows


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
        unique = sorted({token for ids, _, _ in rows for token in ids} - texts.keys())
        if unique:
            texts.update(zip(unique, tokenizer.batch_decode([[token] for token in unique])))
    result = []
    for ids, values, ranks in rows:
        position: dict[int, Logprob] = {}
        for token, value, rank in zip(ids, values, ranks):
            if token not in position:
                position[token] = Logprob(value, rank, texts.get(token))
        result.append(position)
    return result
