"""The engine under hostile input.

- Every kind of bad request mixed into one batch with good ones: `generate` raises one
  `InvalidRequestsError` listing each bad one (index and typed error) and runs nothing; through
  the step API each bad request fails alone and the good ones produce exactly the tokens of a
  clean run; every block returns.
- Bad sampling parameters: a typed error before any work, the engine untouched.
- Malformed model folders, truncated safetensors and a config.json that lies about the shapes
  its weights have: `LLM(...)` raises a typed `HybridCacheError`; an engine built before keeps
  working.
- Aborts at random points of a run (hypothesis picks the schedule), on full-attention and on
  sliding-window models with small pools (so preemption happens): every block comes back.
- An exception in the middle of `generate` (an interrupted call) aborts its requests and frees
  every block.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hybrid_cache import _core
from hybrid_cache.config import ConfigError
from hybrid_cache.engine.errors import (
    InsufficientKVCacheError,
    InvalidRequestError,
    InvalidRequestsError,
    InvalidSamplingParamsError,
    PromptTooLongError,
)
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.errors import HybridCacheError
from hybrid_cache.models import ModelLoadError, WeightMismatchError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(
    not hasattr(_core, "Coordinator"), reason="the Rust Coordinator binding is not built"
)

MAX_MODEL_LEN = 64
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def small_llm(preset: str, memory: str = "68KiB", **kwargs) -> LLM:
    return LLM(
        preset,
        kv_cache_memory=memory,
        max_model_len=MAX_MODEL_LEN,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        device="cpu",
        **kwargs,
    )


@pytest.fixture(scope="module")
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def llama(single_thread) -> LLM:
    return small_llm("tiny-llama")


@pytest.fixture(scope="module")
def gemma3(single_thread) -> LLM:
    # Sliding-window and full groups; a small pool so long requests preempt each other.
    return small_llm("tiny-gemma3", memory="96KiB")


def assert_quiescent(llm: LLM) -> None:
    """Nothing running, every block free, no request id left behind."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert not engine.unfinished_request_ids
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks - 1
    assert all(count == 0 for count in engine.kv_cache.num_used_blocks_per_group())


def good_prompts(vocab_size: int) -> list[dict]:
    return [
        {"prompt_token_ids": [(7 * i + j) % vocab_size for j in range(3 + 5 * i)]} for i in range(4)
    ]


def bad_prompts(llm: LLM) -> list[tuple[object, type]]:
    vocab = llm.spec.vocab_size
    return [
        ({"prompt_token_ids": []}, InvalidRequestError),
        ({"prompt_token_ids": [1] * (MAX_MODEL_LEN + 1)}, PromptTooLongError),
        ({"prompt_token_ids": [1] * 10_000}, PromptTooLongError),
        ({"prompt_token_ids": [3, vocab]}, InvalidRequestError),
        ({"prompt_token_ids": [3, -1]}, InvalidRequestError),
        ({"prompt_token_ids": [2**63]}, InvalidRequestError),
        ({"prompt_token_ids": [3, 1.5]}, InvalidRequestError),
        ({"prompt_token_ids": [True, 2]}, InvalidRequestError),
        ({"prompt_token_ids": [[1, 2]]}, InvalidRequestError),
        ({"prompt_token_ids": "1 2 3"}, InvalidRequestError),
        ({"prompt_token_ids": None}, InvalidRequestError),
        ({"prompt_token_ids": torch.tensor([0.5, 1.5])}, InvalidRequestError),
        ({"tokens": [1, 2]}, InvalidRequestError),
        ("text, but the model has no tokenizer", InvalidRequestError),
        (None, InvalidRequestError),
        (12, InvalidRequestError),
    ]


@pytest.mark.parametrize("preset", ["llama", "gemma3"])
def test_every_bad_request_is_listed_and_nothing_runs(preset, request):
    llm: LLM = request.getfixturevalue(preset)
    good = good_prompts(llm.spec.vocab_size)
    clean = [output.token_ids for output in llm.generate(good, GREEDY, use_tqdm=False)]
    bad = bad_prompts(llm)
    prompts: list[object] = []
    for index, (prompt, _) in enumerate(bad):
        prompts += [good[index % len(good)], prompt]
    steps = llm.stats.num_steps
    with pytest.raises(InvalidRequestsError) as caught:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    listed = caught.value.errors
    assert [index for index, _ in listed] == list(range(1, len(prompts), 2))
    for (index, error), (prompt, error_type) in zip(listed, bad):
        assert isinstance(error, error_type), (prompt, error)
        assert isinstance(error, HybridCacheError)
        assert f"[{index}] {type(error).__name__}: {error}" in str(caught.value)
    assert llm.stats.num_steps == steps, "nothing ran"
    assert_quiescent(llm)
    # The good half of the batch, alone, gives the tokens of the clean run.
    outputs = llm.generate(prompts[0::2], GREEDY, use_tqdm=False)
    assert [output.token_ids for output in outputs] == [
        clean[index % len(good)] for index in range(len(bad))
    ]
    assert_quiescent(llm)


@pytest.mark.parametrize("preset", ["llama", "gemma3"])
def test_step_api_fails_each_bad_request_alone(preset, request):
    llm: LLM = request.getfixturevalue(preset)
    engine = llm.engine
    good = good_prompts(llm.spec.vocab_size)
    clean = [output.token_ids for output in llm.generate(good, GREEDY, use_tqdm=False)]
    vocab = llm.spec.vocab_size
    bad = [
        ([], InvalidRequestError),
        ([1] * (MAX_MODEL_LEN + 1), PromptTooLongError),
        ([1] * 10_000, PromptTooLongError),
        ([3, vocab], InvalidRequestError),
        ([3, -1], InvalidRequestError),
        ([2**63], InvalidRequestError),
    ]
    for index, (prompt, error_type) in enumerate(bad):
        engine.add_request(f"good-{index}", good[index % len(good)]["prompt_token_ids"], GREEDY)
        with pytest.raises(error_type):
            engine.add_request(f"bad-{index}", prompt, GREEDY)
        assert f"bad-{index}" not in engine.unfinished_request_ids
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((r.request_id, r) for r in engine.step())
    assert sorted(finished) == sorted(f"good-{index}" for index in range(len(bad)))
    for index in range(len(bad)):
        done = finished[f"good-{index}"]
        assert done.error is None and done.output_token_ids == clean[index % len(good)]
    assert_quiescent(llm)


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"max_tokens": 2.5},
        {"max_tokens": True},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"temperature": "hot"},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": float("nan")},
        {"top_k": -2},
        {"top_k": 1.5},
        {"n": 0},
        {"n": 2, "best_of": 1},
        {"repetition_penalty": 0.0},
        {"presence_penalty": float("nan")},
        {"min_p": -0.1},
        {"min_tokens": 17},
        {"logprobs": -1},
        {"stop": [""]},
        {"detokenize": "no"},
        {"seed": "x"},
        {"stop_token_ids": "abc"},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": 5},
    ],
)
def test_bad_sampling_params_are_typed_and_touch_nothing(llama, fields):
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(**fields)
    good = good_prompts(llama.spec.vocab_size)
    with pytest.raises(InvalidSamplingParamsError):
        llama.generate(good, [GREEDY] * (len(good) - 1), use_tqdm=False)
    with pytest.raises(InvalidSamplingParamsError):
        llama.generate(good[:1], [fields], use_tqdm=False)
    assert_quiescent(llama)


# ---- model folders --------------------------------------------------------------------------

TINY_LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    intermediate_size=128,
    max_position_embeddings=128,
)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, single_thread) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA))
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def copy_of(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(folder, target)
    return target


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def weight_file(folder: Path) -> Path:
    (path,) = folder.glob("*.safetensors")
    return path


def break_missing_config(folder):
    (folder / "config.json").unlink()


def break_config_not_json(folder):
    (folder / "config.json").write_text("{ not json")


def break_config_a_list(folder):
    (folder / "config.json").write_text("[1, 2, 3]")


def break_config_empty_file(folder):
    (folder / "config.json").write_text("")


def break_unknown_architecture(folder):
    edit_config(folder, architectures=["NoSuchModelForCausalLM"], model_type="no-such-model")


def break_negative_layers(folder):
    edit_config(folder, num_hidden_layers=-2)


def break_heads_as_string(folder):
    edit_config(folder, num_attention_heads="four")


def break_truncated_weights(folder):
    path = weight_file(folder)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def break_weights_header_only(folder):
    path = weight_file(folder)
    data = path.read_bytes()
    header_len = int.from_bytes(data[:8], "little")
    path.write_bytes(data[: 8 + header_len])


def break_weights_garbage(folder):
    weight_file(folder).write_bytes(b"\xff" * 64)


def break_weights_empty(folder):
    weight_file(folder).write_bytes(b"")


def break_no_weights(folder):
    weight_file(folder).unlink()


def lie_hidden_size(folder):
    edit_config(folder, hidden_size=128)


def lie_more_layers(folder):
    edit_config(folder, num_hidden_layers=3)


def lie_fewer_layers(folder):
    edit_config(folder, num_hidden_layers=1)


def lie_vocab_size(folder):
    edit_config(folder, vocab_size=300)


def lie_kv_heads(folder):
    edit_config(folder, num_key_value_heads=4)


def lie_intermediate_size(folder):
    edit_config(folder, intermediate_size=96)


BROKEN_FOLDERS = [
    break_missing_config,
    break_config_not_json,
    break_config_a_list,
    break_config_empty_file,
    break_unknown_architecture,
    break_negative_layers,
    break_heads_as_string,
    break_truncated_weights,
    break_weights_header_only,
    break_weights_garbage,
    break_weights_empty,
    break_no_weights,
]
LYING_CONFIGS = [
    lie_hidden_size,
    lie_more_layers,
    lie_fewer_layers,
    lie_vocab_size,
    lie_kv_heads,
    lie_intermediate_size,
]


def test_the_intact_folder_loads(llama_folder):
    llm = small_llm(str(llama_folder))
    (output,) = llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)
    assert output.error is None and len(output.token_ids) == 5
    assert_quiescent(llm)


@pytest.mark.parametrize("breakage", BROKEN_FOLDERS + LYING_CONFIGS, ids=lambda f: f.__name__)
def test_malformed_model_folder_raises_a_typed_error(llama_folder, llama, tmp_path, breakage):
    folder = copy_of(llama_folder, tmp_path)
    breakage(folder)
    good = good_prompts(llama.spec.vocab_size)
    before = [output.token_ids for output in llama.generate(good, GREEDY, use_tqdm=False)]
    with pytest.raises(HybridCacheError) as raised:
        small_llm(str(folder))
    assert isinstance(raised.value, (ModelLoadError, ConfigError)), repr(raised.value)
    if breakage in LYING_CONFIGS:
        assert isinstance(raised.value, WeightMismatchError), repr(raised.value)
    # Nothing else affected: an engine built before still gives the same tokens.
    after = [output.token_ids for output in llama.generate(good, GREEDY, use_tqdm=False)]
    assert after == before
    assert_quiescent(llama)


# ---- aborts ---------------------------------------------------------------------------------


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    preset=st.sampled_from(["llama", "gemma3"]),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=10),
    max_tokens=st.lists(st.integers(1, 20), min_size=1, max_size=10),
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 40)), max_size=12),
    shared_prefix=st.integers(0, 16),
)
def test_aborts_at_random_points_return_every_block(
    request, preset, lengths, max_tokens, aborts, shared_prefix
):
    """Requests (sharing a prefix, so cache hits happen) run step by step; at the steps
    hypothesis picks, a request (waiting, running, finished or never added) is aborted."""
    llm: LLM = request.getfixturevalue(preset)
    engine = llm.engine
    ids = [f"hostile-{index}" for index in range(len(lengths))]
    try:
        run_with_aborts(engine, ids, lengths, max_tokens, aborts, shared_prefix)
    finally:
        for request_id in ids:  # a failed example must not leave requests to the next one
            engine.abort_request(request_id)
    assert_quiescent(llm)
    assert llm.reset_prefix_cache()


def run_with_aborts(engine, ids, lengths, max_tokens, aborts, shared_prefix) -> None:
    live: set[str] = set()
    for index, (request_id, length) in enumerate(zip(ids, lengths)):
        shared = min(shared_prefix, length)
        prompt = [9] * shared + [index % 50 + 1] * (length - shared)
        params = SamplingParams(
            max_tokens=max_tokens[index % len(max_tokens)], temperature=0.0, ignore_eos=True
        )
        try:
            engine.add_request(request_id, prompt, params)
            live.add(request_id)
        except InsufficientKVCacheError:
            pass  # can never fit this pool: refused up front, nothing held
    abort_at: dict[int, list[int]] = {}
    for step, victim in aborts:
        abort_at.setdefault(step, []).append(victim)
    step = 0
    while engine.has_unfinished_requests():
        for victim in abort_at.get(step, []):
            request_id = f"hostile-{victim}"
            result = engine.abort_request(request_id)
            # Aborting a waiting or running request works; a finished, refused or unknown one
            # is a no-op.
            assert (result is not None) == (request_id in live)
            if result is not None:
                assert result.finish_reason.value == "abort"
                live.discard(request_id)
        for done in engine.step():
            live.discard(done.request_id)
        step += 1
        assert step < 2000, "the engine makes progress"
    assert not live


@pytest.mark.parametrize("fail_at_step", [0, 1, 3, 7])
def test_an_interrupted_generate_frees_everything(gemma3, monkeypatch, fail_at_step):
    engine = gemma3.engine
    original_step = engine.step
    calls = {"count": 0}

    def step_then_fail():
        if calls["count"] == fail_at_step:
            raise KeyboardInterrupt("simulated interrupt")
        calls["count"] += 1
        return original_step()

    monkeypatch.setattr(engine, "step", step_then_fail)
    prompts = good_prompts(gemma3.spec.vocab_size) * 2
    with pytest.raises(KeyboardInterrupt):
        gemma3.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    monkeypatch.undo()
    assert_quiescent(gemma3)
    # The engine still works afterwards.
    outputs = gemma3.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert all(output.error is None and len(output.token_ids) == 5 for output in outputs)
    assert_quiescent(gemma3)
