"""Logits processing before sampling, vectorised over the rows that ask for it: repetition,
frequency and presence penalties, the min_tokens mask and min_p (vLLM's formulas)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: Sequence[torch.Tensor],
    output_token_ids: Sequence[Sequence[int]],
    presence: Sequence[float],
    frequency: Sequence[float],
    repetition: Sequence[float],
) -> torch.Tensor:
    """A penalised copy of `logits` [rows, vocab], one row per request.

    Repetition (over prompt and output tokens, HF's rule): a seen token's logit is divided by
    the penalty when positive, multiplied when negative. Then the frequency penalty times the
    token's count in the output and the presence penalty once per token in the output are
    subtracted. Rows whose repetition penalty is 1 need no `prompt_token_ids` entry.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    counts = torch.zeros((num_rows, vocab_size), dtype=logits.dtype, device=device)
    lengths = list(map(len, output_token_ids))
    if sum(lengths):
        rows = torch.repeat_interleave(
            torch.arange(num_rows, device=device), torch.tensor(lengths, device=device)
        )
        tokens = torch.tensor(list(itertools.chain.from_iterable(output_token_ids)), device=device)
        counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=logits.dtype), True)
    in_output = counts > 0
    if any(penalty != 1.0 for penalty in repetition):
        seen = in_output.clone()
        for row, tokens in enumerate(prompt_token_ids):
            seen[row, tokens.to(device)] = True
        penalty = torch.tensor(repetition, dtype=logits.dtype, device=device).unsqueeze(1)
        logits = torch.where(
            seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits
        )
    frequency_t = torch.tensor(frequency, dtype=logits.dtype, device=device).unsqueeze(1)
    presence_t = torch.tensor(presence, dtype=logits.dtype, device=device).unsqueeze(1)
    return logits - frequency_t * counts - presence_t * in_output.to(logits.dtype)


def mask_tokens(
    logits: torch.Tensor, rows: Sequence[int], token_ids: Sequence[Sequence[int]]
) -> None:
    """Sets `logits[rows[i], token_ids[i]]` to -inf in place (ids past the vocabulary are
    ignored): the stop tokens of requests still short of their min_tokens."""
    vocab_size = logits.shape[-1]
    row_index: list[int] = []
    column_index: list[int] = []
    for row, tokens in zip(rows, token_ids):
        kept = [token for token in tokens if token < vocab_size]
        row_index += [row] * len(kept)
        column_index += kept
    if row_index:
        device = logits.device
        logits[
            torch.tensor(row_index, device=device), torch.tensor(column_index, device=device)
        ] = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks (to -inf) the tokens whose probability is below `min_p` (one per row, 0 = off)
    times the row's largest probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))
