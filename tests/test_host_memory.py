"""The CPU KV cache's memory (`engine/host_memory.py`): zero-filled, 2 MiB-aligned anonymous
mappings advised for transparent huge pages, alive as long as the tensor is. Whether the kernel
grants huge pages depends on the machine's `transparent_hugepage` setting, so the tests check
what the module controls (alignment, contents, lifetime, fallbacks), not the page size."""

from __future__ import annotations

import gc

import torch
from hybrid_cache.engine import host_memory
from hybrid_cache.engine.llm import LLM

MIB = 1 << 20


def test_large_tensors_are_zero_aligned_and_outlive_their_mapping_reference() -> None:
    tensor = host_memory.zeros((3 * 256, 1024), torch.float32)  # 3 MiB
    assert tensor.shape == (768, 1024) and tensor.dtype == torch.float32
    assert not tensor.any()
    if host_memory.ENABLED:
        assert tensor.data_ptr() % (2 * MIB) == 0
    tensor[-1, -1] = 5.0
    gc.collect()  # the mapping lives as long as the tensor does
    assert float(tensor.sum()) == 5.0


def test_small_tensors_and_the_switch_fall_back_to_torch_zeros(monkeypatch) -> None:
    small = host_memory.zeros((16, 16), torch.bfloat16)
    assert small.dtype == torch.bfloat16 and not small.any()
    monkeypatch.setattr(host_memory, "ENABLED", False)
    plain = host_memory.zeros((1024, 1024), torch.float32)
    assert plain.shape == (1024, 1024) and not plain.any()


def test_the_cpu_engine_puts_its_kv_pool_there() -> None:
    llm = LLM("tiny-gemma3", kv_cache_memory="8MiB", max_model_len=256)
    slots = llm.engine.model_runner.slot_tensors
    assert slots and all(slot.device.type == "cpu" for slot in slots)
    if host_memory.ENABLED:
        assert all(slot.data_ptr() % (2 * MIB) == 0 for slot in slots)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], use_tqdm=False)
    assert len(out[0].token_ids) > 0
