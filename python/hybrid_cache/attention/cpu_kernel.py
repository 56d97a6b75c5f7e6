"""The Rust CPU decode kernel (`_core.paged_attention_cpu`) on torch tensors.

One query token per row reads its visible keys and values in place through the block table
(no gather copy), so a decode row over a long context costs one pass over its K/V pages. The
torch backend (`torch_batched`) sends its one-query rows here when `usable` says the tensors
fit (CPU, float32, unit last stride); everything else stays on its torch path. Set
`HYBRID_CACHE_CPU_KERNEL=0` in the environment to turn it off.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from hybrid_cache import _core

ENABLED = os.environ.get("HYBRID_CACHE_CPU_KERNEL", "1") != "0"


def usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel can run on these tensors (else the caller uses torch ops)."""
    return (
        ENABLED
        and q.device.type == "cpu"
        and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (q, k_cache, v_cache))
        and k_cache.dim() == 4
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    sequences: torch.Tensor,
    positions: torch.Tensor,
    low: torch.Tensor,
    scale: float,
    softcap: Optional[float],
    sinks: Optional[torch.Tensor],
) -> torch.Tensor:
    """Row r of q [rows, Hq, D] over positions low[r]..positions[r] of block-table row
    sequences[r]; returns [rows, Hq, D] float32. Raises `InvalidArgumentError` /
    `InvalidBlockError` (a visible position in the null block) and writes nothing then."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _core.paged_attention_cpu(
        q.contiguous().numpy(),
        k_cache.numpy(),
        v_cache.numpy(),
        block_table.to(torch.int32).contiguous().numpy(),
        sequences.contiguous().numpy(),
        positions.contiguous().numpy(),
        low.contiguous().numpy(),
        out.numpy(),
        float(scale),
        None if softcap is None else float(softcap),
        None if sinks is None else sinks.detach().float().contiguous().numpy(),
    )
    return out
