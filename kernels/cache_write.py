"""Writes the new tokens' keys and values into the paged cache by slot mapping.

Token i goes to slot `slot_mapping[i] = page * block_size + offset` of both caches; a negative
slot (padding, or a token whose KV is not kept) is skipped. One program per token copies all of
its kv heads.
"""

import torch
import triton
import triton.language as tl

from ._launch import (
    CACHE_DTYPES,
    check_devices,
    check_tensor,
    next_power_of_2,
)
from .errors import KernelArgumentError


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    NUM_KV_HEADS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, NUM_KV_HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    cache_offsets = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_slot
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    tl.store(key_cache_ptr + cache_offsets, key, mask=mask)
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    tl.store(value_cache_ptr + cache_offsets, value, mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatters `key`/`value` [num_tokens, num_kv_heads, head_dim] into the caches
    [num_blocks, block_size, num_kv_heads, head_dim] (same dtype) at `slot_mapping`
    [num_tokens] (int32 or int64; slot = page * block_size + offset, negative = skip).

    Slots must be below num_blocks * block_size (not checked on the device: that would need a
    sync). Raises `KernelArgumentError` before launching on any bad argument.
    """
    kernel = _write_kv_cache_kernel
    check_tensor("key_cache", key_cache, ndim=4, dtypes=CACHE_DTYPES)
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    check_tensor(
        "value_cache", value_cache, ndim=4, dtypes=(key_cache.dtype,), shape=key_cache.shape
    )
    if value_cache.stride() != key_cache.stride():
        raise KernelArgumentError(
            f"value_cache strides {value_cache.stride()} differ from key_cache strides "
            f"{key_cache.stride()}; allocate both caches with the same layout"
        )
    check_tensor(
        "key", key, ndim=3, dtypes=(key_cache.dtype,), shape=(None, num_kv_heads, head_dim)
    )
    num_tokens = key.shape[0]
    check_tensor("value", value, ndim=3, dtypes=(key_cache.dtype,), shape=key.shape)
    check_tensor(
        "slot_mapping",
        slot_mapping,
        ndim=1,
        dtypes=(torch.int32, torch.int64),
        shape=(num_tokens,),
        contiguous=True,
    )
    check_devices(
        kernel,
        {
            "key": key,
            "value": value,
            "key_cache": key_cache,
            "value_cache": value_cache,
            "slot_mapping": slot_mapping,
        },
    )
    if num_tokens == 0:
        return
    kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        NUM_KV_HEADS_PADDED=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
    )
