"""Batched token sampling: greedy, temperature, top-k and top-p, with per-request seeds.

Random rows draw with the exponential race (`argmax(p / q)`, q ~ Exp(1)), which samples from `p`
exactly. A request with a seed draws q from its own generator, so its tokens do not depend on
which other requests share the batch, nor on preemption (the generator is never rewound and
already sampled tokens are kept). Unseeded requests share the sampler's generator.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

from hybrid_cache.engine.sampling_params import SamplingParams


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Masks (to -inf) the logits outside each row's top-k and top-p sets.

    `top_k` (int64, 0 = off) and `top_p` (float, 1.0 = off) hold one value per row. The most
    likely token always survives.
    """
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab_size, device=logits.device).expand_as(sorted_logits)
    effective_k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)
    sorted_logits = sorted_logits.masked_fill(ranks >= effective_k.unsqueeze(1), float("-inf"))

    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Keep the smallest prefix whose mass reaches top_p; rows with top_p == 1 skip the filter so
    # rounding in the cumulative sum can never drop a token.
    outside_top_p = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    outside_top_p[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(outside_top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_index, sorted_logits)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` (int64): on the CPU through numpy, whose argmax is vectorised
    (about 7x faster than torch's at [64, 512] and 14x at [64, 32000] on one thread) and picks
    the same index: the first maximum, or the first NaN in a row holding one."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    return torch.from_numpy(_cpu_argmax(logits).astype(np.int64, copy=False))


def _cpu_argmax(logits: torch.Tensor) -> np.ndarray:
    """numpy's argmax over the last axis of CPU logits (see `greedy_tokens`)."""
    return logits.detach().numpy().argmax(axis=-1)


_TEMPERATURE = operator.attrgetter("temperature")


class Sampler:
    """Picks one token per row of logits; owns the per-request generators of seeded requests."""

    def __init__(self, seed: int = 0) -> None:
        self.seed: int = seed
        self.generators: dict[str, torch.Generator] = {}
        self.shared_generators: dict[torch.device, torch.Generator] = {}

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: Sequence[str],
        params: Sequence[SamplingParams],
    ) -> torch.Tensor:
        """Returns one token id per row of `logits` (num_rows, vocab_size) as an int64 tensor."""
        assert logits.dim() == 2 and logits.shape[0] == len(request_ids) == len(params), (
            "one row of logits per request"
        )
        logits = logits.float()
        tokens = greedy_tokens(logits)
        # Greedy rows have temperature 0 (falsy): one C-level pass decides an all-greedy batch.
        if not any(map(_TEMPERATURE, params)):
            return tokens
        random_rows = [row for row, p in enumerate(params) if not p.is_greedy]

        device = logits.device
        rows = torch.tensor(random_rows, device=device)
        temperature = torch.tensor([params[r].temperature for r in random_rows], device=device)
        top_k = torch.tensor([params[r].top_k for r in random_rows], device=device)
        top_p = torch.tensor([params[r].top_p for r in random_rows], device=device)
        scaled = logits[rows] / temperature.unsqueeze(1)
        probs = apply_top_k_top_p(scaled, top_k, top_p).softmax(dim=-1)

        noise = torch.empty_like(probs)
        for index, row in enumerate(random_rows):
            generator = self._generator_for(request_ids[row], params[row], device)
            noise[index].exponential_(generator=generator)
        tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens

    def sample_token_ids(
        self,
        logits: torch.Tensor,
        request_ids: Sequence[str],
        params: Sequence[SamplingParams],
    ) -> list[int]:
        """`sample(...).tolist()`; an all-greedy batch on the CPU goes from numpy's argmax
        straight to a list (no int64 cast, no tensor: the same ints, fewer calls)."""
        if logits.device.type == "cpu" and not any(map(_TEMPERATURE, params)):
            assert logits.dim() == 2 and logits.shape[0] == len(request_ids) == len(params), (
                "one row of logits per request"
            )
            return _cpu_argmax(logits.float()).tolist()
        return self.sample(logits, request_ids, params).tolist()

    def free(self, request_id: str) -> None:
        """Forgets a finished request's generator."""
        self.generators.pop(request_id, None)

    def _generator_for(
        self, request_id: str, params: SamplingParams, device: torch.device
    ) -> torch.Generator:
        if params.seed is None:
            shared: Optional[torch.Generator] = self.shared_generators.get(device)
            if shared is None:
                shared = torch.Generator(device=device).manual_seed(self.seed)
                self.shared_generators[device] = shared
            return shared
        generator = self.generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
            self.generators[request_id] = generator
        return generator
