"""The Rust CPU decode kernel (`_core.paged_attention_cpu`) on torch tensors.

One query token per row reads its visible keys and values in place through the block table
(no gather copy), so a decode row over a long context costs one pass over its K/V pages. The
torch backend (`torch_batched`) sends its one-query rows here when `usable` says the tensors
fit (CPU, float32, unit last stride); everything else stays on its torch path. `write_kv`
stores a step's new keys and values with the Rust copy (`_core.write_cache_cpu`) under the
same conditions. Set `HYBRID_CACHE_CPU_KERNEL=0` in the environment to turn both off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from hybrid_cache import _core
from hybrid_cache.attention import reference
from hybrid_cache.attention.params import AttentionParams

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


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`reference.write_kv` (new keys/values [tokens, Hkv, D] to their slots) with one Rust copy
    per cache when the tensors fit: what `usable` asks of the caches, float32 CPU keys and
    values, CPU slots. In the engine (64 decode rows) the copy takes ~24-27 us per layer against
    ~42-56 us for torch's indexed assignment. A slot outside the cache raises `InvalidBlockError`
    and writes nothing."""
    fits = (
        usable(k, k_cache, v_cache)
        and v.device.type == "cpu"
        and v.dtype == torch.float32
        and slot_mapping.device.type == "cpu"
    )
    if not fits:
        reference.write_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    slots = slot_mapping.to(torch.int64).contiguous().numpy()
    _core.write_cache_cpu(k_cache.detach().numpy(), k.detach().contiguous().numpy(), slots)
    _core.write_cache_cpu(v_cache.detach().numpy(), v.detach().contiguous().numpy(), slots)


@dataclass(frozen=True)
class RowSpans:
    """A step's kernel rows in the kernel's form, without a block table: row r is query token
    `token_rows[r]`, block-table row `sequences[r]`, visible positions `low[r] ..= positions[r]`.
    Converted once per step and set of visibility options, then shared by every KV-cache group
    with those options (with six one-layer groups, converting per group cost ~0.1 ms each)."""

    token_rows: torch.Tensor  # [rows] int64
    every_token: bool  # token_rows is 0..num_tokens-1 in order: q and out need no gather
    sequences: np.ndarray  # [rows] int64
    positions: np.ndarray  # [rows] int64
    low: np.ndarray  # [rows] int64


@dataclass(frozen=True)
class KernelRows:
    """Row spans placed in one group's block table: what `attend` reads."""

    spans: RowSpans
    block_table: np.ndarray  # [sequences, width] int32, C-contiguous

    @property
    def token_rows(self) -> torch.Tensor:
        return self.spans.token_rows

    @property
    def every_token(self) -> bool:
        return self.spans.every_token


def row_spans(
    token_rows: torch.Tensor,
    num_tokens: int,
    sequences: torch.Tensor,
    positions: torch.Tensor,
    low: torch.Tensor,
) -> RowSpans:
    def as_int64(tensor: torch.Tensor) -> np.ndarray:
        return tensor.to(torch.int64).contiguous().numpy()

    every_token = len(token_rows) == num_tokens and bool(
        (token_rows == torch.arange(num_tokens)).all()
    )
    return RowSpans(
        token_rows=token_rows,
        every_token=every_token,
        sequences=as_int64(sequences),
        positions=as_int64(positions),
        low=as_int64(low),
    )


def kernel_rows(spans: RowSpans, block_table: torch.Tensor) -> KernelRows:
    """The spans over one group's block table [sequences, width] (any integer dtype)."""
    return KernelRows(spans=spans, block_table=block_table.to(torch.int32).contiguous().numpy())


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: KernelRows,
    params: AttentionParams,
) -> torch.Tensor:
    """Attention of the rows' query tokens of q [num_tokens, Hq, D]; returns [rows, Hq, D]
    float32 (in token order when `rows.every_token`). Raises `InvalidArgumentError` /
    `InvalidBlockError` (a visible position in the null block) and writes nothing then."""
    queries = q if rows.every_token else q.index_select(0, rows.token_rows)
    queries = queries.contiguous()
    out = torch.empty_like(queries)
    _core.paged_attention_cpu(
        queries.numpy(),
        k_cache.numpy(),
        v_cache.numpy(),
        rows.block_table,
        rows.spans.sequences,
        rows.spans.positions,
        rows.spans.low,
        out.numpy(),
        float(params.scale),
        None if params.softcap is None else float(params.softcap),
        None if params.sinks is None else params.sinks.detach().float().contiguous().numpy(),
    )
    return out
