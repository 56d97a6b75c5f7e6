"""A minimal paged runner for tests: greedy generation on one of our models, no Rust allocator.

Block bookkeeping is deliberately naive so that only the model side is under test: every request
gets fresh, contiguous block ids in every KV-cache group (one group per distinct attention type),
and the full table row is reserved up front. What it does exercise like the real engine:
- all scheduled requests run in one flattened forward, prefill chunks mixed with decode tokens;
- prefill in chunks of `prefill_chunk` tokens (or one chunk);
- before each step, a sliding-window group replaces the blocks no future query can see
  (`skipped = c - W + 1`, chunked-local `floor(c / C) * C`) by the null block 0, exactly as the
  allocator does, and those pages are overwritten with NaN. Block 0 is NaN from the start. A
  backend that read either would turn the logits into NaN and fail the token comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hybrid_cache.attention import (
    Attention,
    assign_layer_groups,
    attention_layers,
    build_attention_metadata,
    set_attention_backend,
    set_forward_context,
)
from hybrid_cache.attention.metadata import NULL_BLOCK
from torch import nn


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_key(layer: Attention) -> tuple[str, int | None]:
    return (layer.kind, layer.reach)


def skipped_tokens(layer: Attention, num_computed: int) -> int:
    """Tokens no query from position `num_computed` on can see.

    `skipped(c)` of docs/DESIGN.md "Window release"."""
    if layer.kind == "sliding_window":
        return max(0, num_computed - layer.reach + 1)
    if layer.kind == "chunked_local":
        return (num_computed // layer.reach) * layer.reach
    return 0


@dataclass
class HarnessResult:
    tokens: list[list[int]]  # generated tokens per prompt
    num_steps: int = 0
    num_mixed_steps: int = 0  # steps that ran prefill chunks and decode tokens together
    nulled_blocks: list[int] = field(default_factory=list)  # per group, blocks released by windows


class PagedState:
    """Block tables, K/V caches and request progress of one `greedy_generate` run."""

    def __init__(
        self, model: nn.Module, prompts: list[list[int]], max_new_tokens: int, block_size: int
    ) -> None:
        specs = attention_layers(model)
        keys: list[tuple[str, int | None]] = []
        for spec in specs:
            if group_key(spec) not in keys:
                keys.append(group_key(spec))
        self.group_of_layer: list[int] = [keys.index(group_key(spec)) for spec in specs]
        self.group_specs: list[Attention] = [
            specs[self.group_of_layer.index(group)] for group in range(len(keys))
        ]
        self.block_size: int = block_size
        parameter = next(model.parameters())
        num_requests = len(prompts)
        blocks_per_request = max(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)
        num_blocks = 1 + num_requests * blocks_per_request
        fresh_ids = 1 + torch.arange(num_requests * blocks_per_request, dtype=torch.int32)
        self.tables: list[torch.Tensor] = [
            fresh_ids.view(num_requests, blocks_per_request).clone() for _ in keys
        ]
        # One K and one V page tensor per layer, NaN until written: a stray read poisons logits.
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for spec in specs:
            shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
            k_cache, v_cache = (
                torch.full(shape, float("nan"), dtype=parameter.dtype, device=parameter.device)
                for _ in range(2)
            )
            self.kv_caches.append((k_cache, v_cache))
        self.tokens: list[list[int]] = [list(prompt) for prompt in prompts]
        self.num_computed: list[int] = [0] * num_requests
        self.nulled_blocks: list[int] = [0] * len(keys)

    def release_window_blocks(self, scheduled: list[int]) -> None:
        """Nulls (and NaN-fills) every block left of each windowed group's visible range."""
        for group, spec in enumerate(self.group_specs):
            layers = [i for i, g in enumerate(self.group_of_layer) if g == group]
            for request in scheduled:
                skipped = skipped_tokens(spec, self.num_computed[request])
                row = self.tables[group][request, : skipped // self.block_size]
                live = row[row != NULL_BLOCK].long()
                if len(live) == 0:
                    continue
                for layer in layers:
                    for cache in self.kv_caches[layer]:
                        cache[live] = float("nan")
                row[:] = NULL_BLOCK
                self.nulled_blocks[group] += len(live)


def greedy_generate(
    model: nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    block_size: int = 4,
    prefill_chunk: int | None = None,
    backend: str = "torch",
) -> HarnessResult:
    """Greedy tokens for every prompt, all unfinished prompts batched in each forward."""
    state = PagedState(model, prompts, max_new_tokens, block_size)
    group_attention = [(layer.kind, layer.reach) for layer in state.group_specs]
    assign_layer_groups(model, state.group_of_layer, group_attention)
    set_attention_backend(model, backend)
    device = next(model.parameters()).device
    generated: list[list[int]] = [[] for _ in prompts]
    result = HarnessResult(tokens=generated, nulled_blocks=state.nulled_blocks)
    while any(len(out) < max_new_tokens for out in generated):
        scheduled = [r for r in range(len(prompts)) if len(generated[r]) < max_new_tokens]
        computed = [state.num_computed[r] for r in scheduled]
        pending = [len(state.tokens[r]) - c for r, c in zip(scheduled, computed)]
        query_lens = [min(n, prefill_chunk or n) for n in pending]
        state.release_window_blocks(scheduled)
        metadata, positions = build_attention_metadata(
            query_lens,
            computed,
            [table[scheduled] for table in state.tables],
            [block_size] * len(state.tables),
        )
        input_ids = torch.tensor(
            [
                token
                for r, c, n in zip(scheduled, computed, query_lens)
                for token in state.tokens[r][c : c + n]
            ]
        )
        with torch.no_grad(), set_forward_context(metadata, state.kv_caches):
            hidden = model(input_ids.to(device), positions.to(device))
            last_rows = (metadata.query_start_loc[1:] - 1).long().to(device)
            next_tokens = model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()
        decoding = [c >= len(prompts[r]) for r, c in zip(scheduled, computed)]
        result.num_steps += 1
        result.num_mixed_steps += int(any(decoding) and not all(decoding))
        for request, query_len, token in zip(scheduled, query_lens, next_tokens):
            state.num_computed[request] += query_len
            if state.num_computed[request] == len(state.tokens[request]):
                state.tokens[request].append(token)
                generated[request].append(token)
    return result
