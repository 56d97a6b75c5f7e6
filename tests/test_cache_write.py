"""Storing new keys and values in the paged cache: the Rust copy (`_core.write_cache_cpu`,
wrapped by `attention.cpu_kernel.write_kv`, what the CPU torch backend uses) against the torch
reference (`reference.write_kv`), and its refusals. The Rust unit tests cover the layout maths
(rust/attention/src/cache_write.rs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_cache import _core
from hybrid_cache.attention import cpu_kernel, reference, torch_batched


def slot_tensor(seed: int, blocks: int = 9, block_size: int = 4, heads: int = 2, dim: int = 8):
    """The engine's per-layer slot tensor [blocks, 2, block_size, Hkv, D]: K and V are views."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(blocks, 2, block_size, heads, dim, generator=generator), generator


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_the_rust_copy_writes_what_the_reference_writes(seed, slot_dtype) -> None:
    slots, generator = slot_tensor(seed)
    expected = slots.clone()
    num_slots = slots.shape[0] * slots.shape[2]
    tokens = 1 + seed * 7
    mapping = torch.randperm(num_slots, generator=generator)[:tokens].to(slot_dtype)
    k = torch.randn(tokens, 2, 8, generator=generator)
    # Values as a non-contiguous view, as a model's split projections hand them over.
    v = torch.randn(tokens, 8, 2, generator=generator).transpose(1, 2)
    cpu_kernel.write_kv(slots[:, 0], slots[:, 1], k, v, mapping)
    reference.write_kv(expected[:, 0], expected[:, 1], k, v, mapping)
    assert torch.equal(slots, expected)
    assert torch_batched.write_kv is cpu_kernel.write_kv  # the CPU backend's store


def test_other_dtypes_take_the_reference_path() -> None:
    slots, generator = slot_tensor(5)
    slots = slots.to(torch.bfloat16)
    expected = slots.clone()
    mapping = torch.tensor([0, 5, 35])
    k, v = torch.randn(3, 2, 8, generator=generator), torch.randn(3, 2, 8, generator=generator)
    cpu_kernel.write_kv(slots[:, 0], slots[:, 1], k, v, mapping)
    reference.write_kv(expected[:, 0], expected[:, 1], k, v, mapping)
    assert torch.equal(slots, expected)


@pytest.mark.parametrize("bad", [36, -1])
def test_a_slot_outside_the_cache_is_refused_and_nothing_is_written(bad) -> None:
    slots, generator = slot_tensor(6)
    before = slots.clone()
    k, v = torch.randn(2, 2, 8, generator=generator), torch.randn(2, 2, 8, generator=generator)
    with pytest.raises(_core.InvalidBlockError, match="outside the cache's 36 slots"):
        cpu_kernel.write_kv(slots[:, 0], slots[:, 1], k, v, torch.tensor([3, bad]))
    assert torch.equal(slots, before)


def test_bad_buffers_are_refused_with_what_to_change() -> None:
    slots, _ = slot_tensor(7)
    keys = slots[:, 0].numpy()
    new = np.ones((2, 2, 8), dtype=np.float32)
    mapping = np.array([0, 1], dtype=np.int64)
    with pytest.raises(_core.InvalidArgumentError, match=r"new must be \[len\(slots\)=3"):
        _core.write_cache_cpu(keys, new, np.array([0, 1, 2], dtype=np.int64))
    with pytest.raises(_core.InvalidArgumentError, match="new must be"):
        _core.write_cache_cpu(keys, np.ones((2, 2, 4), dtype=np.float32), mapping)
    with pytest.raises(_core.InvalidArgumentError, match="must not overlap the cache"):
        _core.write_cache_cpu(keys, slots[0, 0, :2].numpy(), mapping)
    read_only = slots[:, 0].numpy().copy()
    read_only.setflags(write=False)
    with pytest.raises((_core.InvalidArgumentError, BufferError, ValueError)):
        _core.write_cache_cpu(read_only, new, mapping)
    assert np.array_equal(slots.numpy(), slot_tensor(7)[0].numpy())
