"""The FlashAttention backend (optional extra `flash-attn`): FA2's paged-KV varlen kernel.

UNTESTED HERE: this module was written against flash-attn 2's documented API
(`flash_attn.flash_attn_varlen_func(..., block_table=...)`, flash-attn >= 2.6) on a machine with
no GPU and no flash-attn. Only its refusals and capability checks are tested (tests/
test_attention_backends.py); the call itself has never run. Check it on a GPU against the torch
reference before relying on it.

How one step maps onto the call (per layer; the int32 tensors are built once per step):

    q                    [num_tokens, Hq, D]            the flattened queries
    k, v                 the layer's paged caches       [num_blocks, block_size, Hkv, D]
    block_table          the group's table              [num_seqs, max_blocks] int32
    cu_seqlens_q         metadata.query_start_loc       [num_seqs + 1] int32
    cu_seqlens_k         0, cumsum(seq_lens)            [num_seqs + 1] int32 (key lengths)
    max_seqlen_q / _k    metadata.max_query_len / max_seq_len (host ints: no sync)
    causal=True          FA aligns the causal mask bottom-right: a sequence's queries are its
                         last positions, as in our metadata
    window_size          (visibility.keys_left_of_query(W), 0) for a window W, else (-1, -1)
    softcap              the layer's cap, 0.0 for none

What it cannot do, so it refuses (typed `AttentionBackendUnavailableError`, never a wrong answer):
attention sinks (gpt-oss), chunked-local attention, block sizes that are not a multiple of 256
(FA2's paged path), dtypes other than fp16/bf16, non-CUDA tensors. `selector.py` checks the same
rules before selecting it, so "auto" only picks it where it works.

Null blocks: FA2 skips key tiles wholly left of the window, and its key tiles (<= 128 keys) never
start in a page left of the page holding the first visible key, so the released pages (block 0)
left of the window are not read.

Writing K/V uses the torch reference's scatter (FA2 has no slot-mapping write for a shared paged
cache); the Triton `write_kv_cache` kernel would save a few launches per layer.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from hybrid_cache.attention import reference
from hybrid_cache.attention.metadata import AttentionMetadata, GroupMetadata
from hybrid_cache.attention.params import AttentionParams
from hybrid_cache.attention.selector import (
    FLASH_ATTN_BLOCK_MULTIPLE,
    FLASH_ATTN_DTYPES,
    AttentionBackendUnavailableError,
    _flash_attn_import_error,
)
from hybrid_cache.attention.triton_backend import (
    _STEP_CACHE,
    as_kernel_int32,
    group_block_table,
    step_tensors,
)
from hybrid_cache.attention.visibility import keys_left_of_query
from hybrid_cache.step_cache import cached_on

INSTEAD = "use attention_backend='triton' (or 'auto', which picks what the layer needs)"


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores the new tokens' keys/values at their slots (the reference scatter)."""
    reference.write_kv(k_cache, v_cache, k, v, slot_mapping)


def check_supported(
    q: torch.Tensor,
    group: GroupMetadata,
    sinks: Optional[torch.Tensor],
    chunk: Optional[int],
) -> None:
    """Raises `AttentionBackendUnavailableError` for a layer FA2's paged path cannot run.
    Runs before flash_attn is imported, so it holds where flash_attn is absent."""
    if sinks is not None:
        raise AttentionBackendUnavailableError(
            f"flash_attn cannot apply attention sinks (gpt-oss layers); {INSTEAD}"
        )
    if chunk is not None:
        raise AttentionBackendUnavailableError(
            f"flash_attn cannot do chunked-local attention (chunk {chunk}); {INSTEAD}"
        )
    if group.block_size % FLASH_ATTN_BLOCK_MULTIPLE != 0:
        raise AttentionBackendUnavailableError(
            f"flash_attn's paged KV path needs a block size that is a multiple of "
            f"{FLASH_ATTN_BLOCK_MULTIPLE}, got {group.block_size}; pass block_size=256 or {INSTEAD}"
        )
    if q.dtype not in FLASH_ATTN_DTYPES:
        raise AttentionBackendUnavailableError(
            f"flash_attn takes float16/bfloat16, not {q.dtype}; pass dtype='bfloat16' or {INSTEAD}"
        )
    if q.device.type != "cuda":
        raise AttentionBackendUnavailableError(
            f"flash_attn runs on CUDA only, and the tensors are on {q.device}; {INSTEAD}"
        )


def _varlen_function() -> Any:
    error = _flash_attn_import_error()
    if error is not None:
        raise AttentionBackendUnavailableError(
            f"flash_attn is not importable ({error}); install "
            f"`pip install 'hybrid-cache[flash-attn]'` or {INSTEAD}"
        )
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def key_start_loc(metadata: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """cu_seqlens_k: [num_seqs + 1] int32 prefix sums of seq_lens, once per step."""
    seq_lens = step_tensors(metadata, device).seq_lens
    return cached_on(
        metadata,
        _STEP_CACHE,
        ("flash_attn_cu_seqlens_k", torch.device(device)),
        (seq_lens,),
        lambda: as_kernel_int32(
            torch.nn.functional.pad(torch.cumsum(seq_lens, 0, dtype=torch.int32), (1, 0)), device
        ),
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    group: GroupMetadata,
    params: AttentionParams,
) -> torch.Tensor:
    """Same contract as `reference.paged_attention`, through `flash_attn_varlen_func` with a
    block table. Refuses (typed error) what FA2 cannot do; see the module docstring."""
    check_supported(q, group, params.sinks, params.chunk)
    assert k_cache.shape[1] == group.block_size, "cache block size differs from the group's"
    varlen = _varlen_function()
    device = q.device
    sliding_window = params.sliding_window
    return varlen(
        q,
        k_cache,
        v_cache,
        cu_seqlens_q=step_tensors(metadata, device).query_start_loc,
        cu_seqlens_k=key_start_loc(metadata, device),
        max_seqlen_q=metadata.max_query_len,
        max_seqlen_k=metadata.max_seq_len,
        softmax_scale=params.scale,
        causal=True,
        window_size=(-1, -1) if sliding_window is None else (keys_left_of_query(sliding_window), 0),
        softcap=params.softcap if params.softcap is not None else 0.0,
        block_table=group_block_table(group, device),
    )
