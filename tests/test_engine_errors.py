"""Bad input: `LLM.generate` checks its whole batch and raises one typed error listing every bad
prompt before anything runs; the step API (`LLMEngine.add_request`) fails one request alone;
every block comes back. Bad call arguments raise before any work."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hybrid_cache import _core
from hybrid_cache.engine.engine_config import SchedulerLimits
from hybrid_cache.engine.errors import (
    EngineConfigError,
    InsufficientKVCacheError,
    InvalidRequestError,
    InvalidRequestsError,
    InvalidSamplingParamsError,
    NoTokenizerError,
    PromptTooLongError,
)
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.llm_engine import LLMEngine
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.errors import HybridCacheError
from hybrid_cache.planner import PlanOptions, plan_kv_cache

needs_coordinator = pytest.mark.skipif(
    not hasattr(_core, "Coordinator"), reason="the Rust Coordinator binding is not built"
)

MAX_MODEL_LEN = 64
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm():
    # tiny-llama: 4 layers of 2 KV heads x 16 dims, float32 -> 256 B per token per layer, so a
    # block of 4 tokens is 4 KiB. 68 KiB of KV is 17 blocks (block 0 is null): 64 tokens, one
    # request of max_model_len.
    return LLM(
        "tiny-llama",
        kv_cache_memory="68KiB",
        max_model_len=MAX_MODEL_LEN,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )


def assert_all_blocks_free(llm: LLM) -> None:
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks - 1


GOOD = {"prompt_token_ids": [5, 6, 7, 8, 9]}


@needs_coordinator
@pytest.mark.parametrize(
    ("bad_prompt", "error_type"),
    [
        ({"prompt_token_ids": []}, InvalidRequestError),
        ({"prompt_token_ids": [1] * (MAX_MODEL_LEN + 1)}, PromptTooLongError),
        ({"prompt_token_ids": [3, 512]}, InvalidRequestError),
        ({"prompt_token_ids": [3, -1]}, InvalidRequestError),
        ({"prompt_token_ids": [3, "x"]}, InvalidRequestError),
        ({"tokens": [1, 2]}, InvalidRequestError),
        ("text without a tokenizer", NoTokenizerError),
    ],
)
def test_a_bad_prompt_fails_the_batch_before_anything_runs(llm, bad_prompt, error_type):
    steps = llm.stats.num_steps
    with pytest.raises(InvalidRequestsError) as caught:
        llm.generate([GOOD, bad_prompt, GOOD], PARAMS, use_tqdm=False)
    error = caught.value
    assert isinstance(error, HybridCacheError) and isinstance(error, ValueError)
    assert [index for index, _ in error.errors] == [1]
    assert type(error.errors[0][1]) is error_type
    assert "1 of 3 prompts" in str(error) and f"[1] {error_type.__name__}" in str(error)
    assert llm.stats.num_steps == steps, "nothing ran"
    assert not llm.engine.has_unfinished_requests()
    assert_all_blocks_free(llm)
    good_first, good_last = llm.generate([GOOD, GOOD], PARAMS, use_tqdm=False)
    assert good_first.finish_reason == good_last.finish_reason == "length"
    assert len(good_first.token_ids) == 4 and good_first.token_ids == good_last.token_ids


@needs_coordinator
def test_every_bad_prompt_is_listed_with_its_index(llm):
    prompts = [{"prompt_token_ids": []}, GOOD, "no tokenizer", GOOD, [1] * (MAX_MODEL_LEN + 1)]
    with pytest.raises(InvalidRequestsError) as caught:
        llm.generate(prompts, PARAMS, use_tqdm=False)
    listed = [(index, type(error)) for index, error in caught.value.errors]
    assert listed == [(0, InvalidRequestError), (2, NoTokenizerError), (4, PromptTooLongError)]
    assert "3 of 5 prompts" in str(caught.value)
    assert_all_blocks_free(llm)


@needs_coordinator
def test_a_bad_prompt_is_named_by_its_index_not_the_engine_s_id(llm):
    llm.generate([GOOD] * 3, PARAMS, use_tqdm=False)  # the engine's ids move on
    with pytest.raises(InvalidRequestsError) as caught:
        llm.generate([GOOD, {"prompt_token_ids": [1] * (MAX_MODEL_LEN + 1)}], PARAMS)
    ((index, error),) = caught.value.errors
    assert index == 1 and str(error).startswith("prompt 1: the prompt has")
    assert "request '" not in str(caught.value)


@needs_coordinator
def test_token_ids_as_tensor_or_array_are_accepted(llm):
    import numpy as np

    as_list, as_tensor, as_array = llm.generate(
        [
            GOOD,
            {"prompt_token_ids": torch.tensor([5, 6, 7, 8, 9])},
            {"prompt_token_ids": np.arange(5, 10)},
        ],
        PARAMS,
        use_tqdm=False,
    )
    assert as_list.token_ids == as_tensor.token_ids == as_array.token_ids
    assert as_array.prompt_token_ids == [5, 6, 7, 8, 9] and as_array.error is None


@needs_coordinator
def test_step_api_fails_a_request_larger_than_the_pool_alone(llm):
    """An engine built on a pool smaller than one `max_model_len` request (`LLM` refuses such a
    budget; the step API takes it): the request that can never fit fails alone and typed."""
    options = PlanOptions(
        kv_cache_memory=64 * 1024,
        max_model_len=MAX_MODEL_LEN,
        block_size=4,
        max_num_batched_tokens=32,
    )
    layout = plan_kv_cache(llm.spec, options)
    engine = LLMEngine.from_model(
        llm.model,
        layout,
        SchedulerLimits(MAX_MODEL_LEN, 4, 32, True),
        vocab_size=llm.spec.vocab_size,
        eos_token_ids=(),
        dtype=llm.dtype,
        device=llm.device,
    )
    too_big = SamplingParams(max_tokens=MAX_MODEL_LEN, temperature=0.0, ignore_eos=True)
    engine.add_request("fits", [5, 6, 7, 8, 9], PARAMS)
    with pytest.raises(InsufficientKVCacheError) as caught:
        engine.add_request("too-big", [3] * 60, too_big)
    assert isinstance(caught.value, _core.RequestTooLargeError)
    assert "raise kv_cache_memory" in str(caught.value)
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [request.request_id for request in finished] == ["fits"]
    assert len(finished[0].output_token_ids) == 4
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks - 1


@needs_coordinator
def test_prompt_of_max_model_len_generates_one_token():
    roomy = LLM("tiny-llama", kv_cache_memory="128KiB", max_model_len=MAX_MODEL_LEN, block_size=4)
    prompt = {"prompt_token_ids": [7] * MAX_MODEL_LEN}
    (output,) = roomy.generate([prompt], PARAMS, use_tqdm=False)
    assert output.finish_reason == "length" and len(output.token_ids) == 1
    assert_all_blocks_free(roomy)


@needs_coordinator
def test_bad_sampling_params_raise_before_any_work(llm):
    with pytest.raises(InvalidSamplingParamsError):
        llm.generate([GOOD, GOOD], [PARAMS], use_tqdm=False)
    with pytest.raises(InvalidSamplingParamsError):
        llm.generate([GOOD], [{"temperature": 0.0}], use_tqdm=False)
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(temperature=-1.0)
    assert not llm.engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


@needs_coordinator
def test_abort_returns_every_block(llm):
    engine = llm.engine
    long_params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("abort-running", [4] * 20, long_params)
    engine.add_request("abort-waiting", [4] * 20, long_params)
    with pytest.raises(InvalidRequestError):
        engine.add_request("abort-waiting", [4] * 3, long_params)
    engine.step()
    assert engine.kv_cache.num_free_blocks < engine.kv_cache.num_blocks - 1
    running = engine.abort_request("abort-running")
    waiting = engine.abort_request("abort-waiting")
    assert running.finish_reason.value == waiting.finish_reason.value == "abort"
    assert engine.abort_request("abort-running") is None
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kv_cache_mode": "paged"},
        {"kv_group_layout": "by-size"},
        {"load_format": "pt"},
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": -4},
        {"max_model_len": 0},
        {"gpu_memory_utilization": 1.5},
        {"scheduling_policy": "lifo"},
    ],
)
def test_bad_engine_arguments_raise_typed_errors(kwargs):
    with pytest.raises(EngineConfigError):
        LLM("tiny-llama", kv_cache_memory="64KiB", **kwargs)


def test_engine_errors_are_reexported_and_typed():
    import hybrid_cache.errors as errors

    for name in ("InvalidRequestError", "InvalidSamplingParamsError", "EngineConfigError"):
        error_type = getattr(errors, name)
        assert issubclass(error_type, HybridCacheError) and issubclass(error_type, ValueError)
    assert issubclass(errors.PromptTooLongError, errors.InvalidRequestError)


def test_package_exports_are_lazy():
    code = (
        "import sys, hybrid_cache, hybrid_cache.errors; "
        "assert 'torch' not in sys.modules, 'import hybrid_cache imported torch'; "
        "assert hybrid_cache.SamplingParams(max_tokens=3).max_tokens == 3; "
        "assert hybrid_cache.LLM.__name__ == 'LLM'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kv_cache_budget_defaults():
    from hybrid_cache.engine.memory import DEFAULT_CPU_KV_CACHE_MEMORY, kv_cache_budget
    from hybrid_cache.sizes import MemorySizeError

    cpu = torch.device("cpu")
    assert kv_cache_budget(None, cpu, "2MiB", 0.9, 64, 4) == 2 * 1024**2
    assert kv_cache_budget(None, cpu, None, 0.9, 64, 4) == DEFAULT_CPU_KV_CACHE_MEMORY
    with pytest.raises(MemorySizeError):
        kv_cache_budget(None, cpu, "lots", 0.9, 64, 4)


@needs_coordinator
@pytest.mark.parametrize("backend", ["no-such-backend", "flash_attn"])
def test_attention_backend_that_cannot_run_raises_typed_error(backend):
    with pytest.raises(HybridCacheError, match=backend):
        LLM(
            "tiny-llama",
            kv_cache_memory="128KiB",
            max_model_len=MAX_MODEL_LEN,
            device="cpu",
            attention_backend=backend,
        )


@needs_coordinator
def test_random_aborts_while_running_return_every_block(llm):
    engine = llm.engine
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    live: list[str] = []
    for index in range(24):
        length = int(torch.randint(1, 30, (1,), generator=generator))
        request_id = f"random-abort-{index}"
        engine.add_request(request_id, [5] * length, params)
        live.append(request_id)
        for finished in engine.step():
            live.remove(finished.request_id)
        if live and index % 3 == 0:
            victim = live.pop(int(torch.randint(0, len(live), (1,), generator=generator)))
            assert engine.abort_request(victim) is not None
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)


def test_cuda_profile_budget_formula_runs_a_full_batch_forward(monkeypatch):
    """The CUDA profile path, run on the CPU with torch.cuda's memory queries faked: it must run
    one forward of max_num_batched_tokens tokens and apply the budget formula."""
    from hybrid_cache.engine import memory
    from hybrid_cache.models import load_model
    from hybrid_cache.presets import read_preset

    gib = 1024**3
    fake = {
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda device=None: None,
        "max_memory_allocated": lambda device=None: 3 * gib,
        "memory_reserved": lambda device=None: 4 * gib,
        "mem_get_info": lambda device=None: (10 * gib, 16 * gib),
    }
    for name, function in fake.items():
        monkeypatch.setattr(torch.cuda, name, function)
    model = load_model(config=read_preset("tiny-gemma3"), load_format="dummy")
    forwards = []
    model.register_forward_hook(lambda module, args, output: forwards.append(args[0].shape))
    budget = memory.profile_cuda_budget(model, torch.device("cpu"), 0.5, 64, 8)
    assert forwards == [torch.Size([64])]
    # 16 GiB * 0.5 - (16 - 10 - 4) GiB outside torch - (3 GiB peak - the small scratch cache)
    assert 3 * gib < budget < 3 * gib + 1024**2
    with pytest.raises(EngineConfigError):
        memory.profile_cuda_budget(model, torch.device("cpu"), 0.1, 64, 8)
