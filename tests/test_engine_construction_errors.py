"""`LLM(...)` refuses what the machine or the budget cannot give, with a typed error that says
what to change, before the weights load: a device the machine lacks, a KV budget larger than the
free memory, a budget below one request of `max_model_len` tokens."""

from __future__ import annotations

import mmap
import re

import pytest
import torch
from hybrid_cache import _core
from hybrid_cache.engine import host_memory, memory
from hybrid_cache.engine import llm as llm_module
from hybrid_cache.engine.llm import LLM
from hybrid_cache.errors import (
    BudgetTooSmallError,
    DeviceUnavailableError,
    EngineConfigError,
    KVCacheMemoryError,
)

pytestmark = pytest.mark.skipif(
    not hasattr(_core, "Coordinator"), reason="the Rust Coordinator binding is not built"
)
MIB = 1024**2


@pytest.fixture
def no_loading(monkeypatch):
    """Fails the test if the weights load: each error here must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr(llm_module, "load_engine_model", refuse)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_cuda_without_a_gpu(monkeypatch, no_loading, device):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailableError, match="no usable CUDA device") as caught:
        LLM("tiny-llama", kv_cache_memory="1MiB", max_model_len=64, device=device)
    assert "--device cpu" in str(caught.value) and isinstance(caught.value, EngineConfigError)


def test_a_gpu_index_past_the_last(monkeypatch, no_loading):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(DeviceUnavailableError, match="has 2 CUDA device"):
        LLM("tiny-llama", kv_cache_memory="1MiB", max_model_len=64, device="cuda:2")


@pytest.mark.parametrize("device", ["gpu", "mps", 7])
def test_a_name_that_is_not_an_engine_device(no_loading, device):
    with pytest.raises(DeviceUnavailableError, match="--device"):
        LLM("tiny-llama", kv_cache_memory="1MiB", max_model_len=64, device=device)


def test_the_command_line_says_it_without_a_traceback(monkeypatch, no_loading, capsys):
    from hybrid_cache.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["generate", "--model=tiny-llama", "--kv-cache-memory=1MiB", "--device=cuda"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("hybrid-cache: error: DeviceUnavailableError: --device 'cuda'")
    assert "Traceback" not in err


def test_a_budget_above_the_free_host_memory(monkeypatch, no_loading):
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 3 * MIB)
    with pytest.raises(KVCacheMemoryError) as caught:
        LLM("tiny-llama", kv_cache_memory="8MiB", max_model_len=64, device="cpu")
    message = str(caught.value)
    assert "8.00 MiB" in message and "3.00 MiB of host memory is available" in message
    assert "lower --kv-cache-memory to at most 3.00 MiB" in message


def test_host_memory_is_read_from_the_machine():
    available = host_memory.available_bytes()
    assert available is not None and 0 < available
    with open("/proc/meminfo") as file:
        total = int(next(line for line in file if line.startswith("MemTotal:")).split()[1])
    assert available <= total * 1024


def test_a_refused_host_mapping_is_typed(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(host_memory, "ENABLED", True)
    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(KVCacheMemoryError, match="Cannot allocate memory"):
        host_memory.zeros((4, 1024, 1024), torch.float32)


def test_a_budget_above_the_free_gpu_memory(monkeypatch):
    gib = 1024**3
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * gib, 16 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * gib)
    cuda = torch.device("cuda", 0)
    memory.check_kv_cache_fits(3 * gib, cuda)  # 2 GiB free + 1 GiB cached by torch, unused
    with pytest.raises(KVCacheMemoryError, match="3.00 GiB is free on cuda:0"):
        memory.check_kv_cache_fits(3 * gib + 1, cuda)


def suggestions(error: BudgetTooSmallError) -> tuple[str, int]:
    message = str(error)
    budget = re.search(r"raise --kv-cache-memory to at least ([\d.]+ \w+)", message).group(1)
    length = int(re.search(r"lower --max-model-len to at most (\d+)", message).group(1))
    return budget.replace(" ", ""), length


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3"])
def test_a_budget_below_one_max_model_len_request(monkeypatch, preset):
    options = dict(max_model_len=256, block_size=4, max_num_batched_tokens=32, device="cpu")
    with monkeypatch.context() as patch:
        patch.setattr(llm_module, "load_engine_model", lambda *a, **k: pytest.fail("loaded first"))
        with pytest.raises(BudgetTooSmallError) as caught:
            LLM(preset, kv_cache_memory="96KiB", **options)
    message = str(caught.value)
    assert "cannot hold one request of max_model_len=256 tokens" in message
    assert isinstance(caught.value, EngineConfigError)
    budget, length = suggestions(caught.value)
    # Both ways out the message names work, and the length is the longest that does.
    assert LLM(preset, kv_cache_memory=budget, **options).layout.num_blocks > 0
    fits = LLM(preset, kv_cache_memory="96KiB", **{**options, "max_model_len": length})
    assert fits.max_model_len == length
    (output,) = fits.generate([[5] * (length - 1)], use_tqdm=False)
    assert output.finish_reason in ("length", "stop")
    with pytest.raises(BudgetTooSmallError):
        LLM(preset, kv_cache_memory="96KiB", **{**options, "max_model_len": length + 1})
