"""Tail replay end to end: a prompt whose full-attention prefix is cached but whose windowed
blocks were evicted keeps the full-attention hit and recomputes only the tokens the windows
need; its output equals a cold engine's, and a replay range too short or a replay that rewrites
the cached full-attention KV gives a different output (so the check can fail).

Setup (tiny transformers models of `test_engine_llm`: windows of 8 tokens, blocks of 4): request
A computes a 76-token prompt in chunks of 16, so its windowed layers release their early blocks
while it runs (the free queue's `Low` tier, evicted first). Filler requests then take blocks
until the branch prompt (A's first 60 tokens, then new ones) hits by a replay: the windowed
blocks of the hit points before the replay start are gone (enough of them for the replay to
save more than it recomputes), A's full-attention blocks are all still cached.
"""

from __future__ import annotations

import argparse
import itertools
import math

import pytest
from hybrid_cache import _core
from hybrid_cache.engine.engine_config import (
    EngineConfig,
    add_engine_arguments,
    engine_config_from_args,
)
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.errors import EngineConfigError
from hybrid_cache.planner import KVCacheLayout

from tests.test_engine_llm import TinyModel, assert_all_blocks_free, make_prompts, small_pool

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(
        not hasattr(_core, "Coordinator"), reason="the Rust Coordinator binding is not built"
    ),
    pytest.mark.usefixtures("one_torch_thread"),
]

SHARED = 60  # tokens of A's prompt the branch shares: the full-attention hit point F
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
FILLER_IDS = itertools.count(10**9)  # core request ids the engine never uses


# Gemma-3 in both of its layouts: `auto` would plan equal groups in these small pools.
@pytest.fixture(scope="module", params=["gemma3-per-type", "gemma3-equal", "gpt_oss", "gemma2"])
def tiny(request, tmp_path_factory) -> TinyModel:
    architecture, _, layout = request.param.partition("-")
    folder = tmp_path_factory.mktemp(f"replay-{request.param}")
    return TinyModel(architecture, folder, group_layout=layout or "auto")


def engine(tiny: TinyModel, **overrides) -> LLM:
    """An engine whose pool holds one 88-token request at its worst case and a few blocks
    more, so few keyless blocks stand before A's in the free queue."""
    pool = small_pool(tiny, largest=88)
    options = dict(max_num_batched_tokens=16, max_num_seqs=64, **pool)
    return tiny.llm(**{**options, **overrides})


def prompts() -> tuple[list[int], list[int]]:
    (first,) = make_prompts(71, lengths=(76,))
    (new,) = make_prompts(72, lengths=(12,))
    return first, first[:SHARED] + new


def replay_start(llm: LLM) -> int:
    """`F - R` rounded down to the hit alignment (4): where a replay of the branch starts."""
    return (SHARED - llm.engine.kv_cache.tail_replay_tokens) // 4 * 4


def lose_windows(llm: LLM, first: list[int], branch: list[int], start: int) -> None:
    """Runs A, then holds filler blocks until the core's probe for `branch` is a replay from
    `start` (with replay off: until its plain hit is shorter than `start`), then frees the
    fillers."""
    assert start > 0, "the replay range must leave something to hit"
    llm.generate({"prompt_token_ids": first}, PARAMS, use_tqdm=False)
    coordinator = llm.engine.kv_cache.coordinator
    replaying = llm.engine.kv_cache.tail_replay_tokens is not None
    fillers = []
    while True:
        probe = coordinator.probe_cache_hit(branch)
        # With replay on, `start` is also the plain hit while the windows there are cached: a
        # prompt ending at `start` tells (it then hits all of itself but the last token).
        plain_below_start = coordinator.probe_cache_hit(branch[: start + 1]) < start
        if (probe == start and plain_below_start) if replaying else probe < start:
            break
        assert coordinator.num_free_blocks > 2, "the pool ran out before the windows were lost"
        core_id = next(FILLER_IDS)
        coordinator.add_request(core_id, [5000 + core_id % 1000 + i for i in range(4)])
        assert coordinator.allocate(core_id, 0, 4)
        fillers.append(core_id)
    for core_id in fillers:
        coordinator.free_request(core_id)


def run_branch(llm: LLM, branch: list[int]):
    (output,) = llm.generate({"prompt_token_ids": branch}, PARAMS, use_tqdm=False)
    return output


def test_a_replayed_prefix_gives_the_cold_engine_s_output(tiny):
    first, branch = prompts()
    cold = run_branch(engine(tiny, enable_prefix_caching=False), branch)
    llm = engine(tiny)
    start = replay_start(llm)
    lose_windows(llm, first, branch, start)
    hot = run_branch(llm, branch)
    assert llm.stats.num_tail_replays == 1
    assert llm.stats.num_tail_replay_tokens == SHARED - start
    assert hot.num_cached_tokens == start
    assert hot.outputs[0].token_ids == cold.outputs[0].token_ids
    # Bit for bit on the CPU: the same KV, read in the same order.
    assert math.isclose(
        hot.outputs[0].cumulative_logprob, cold.outputs[0].cumulative_logprob, abs_tol=1e-6
    )
    # The next turn hits what the replay computed and cached (its windowed blocks from where
    # every windowed layer's KV is right), plainly, and still gives the cold engine's output.
    (more,) = make_prompts(73, lengths=(8,))
    follow_up = branch + hot.outputs[0].token_ids + more
    cold_next = run_branch(engine(tiny, enable_prefix_caching=False), follow_up)
    hot_next = run_branch(llm, follow_up)
    assert llm.stats.num_tail_replays == 1
    assert hot_next.num_cached_tokens >= len(branch) // 4 * 4
    assert hot_next.outputs[0].token_ids == cold_next.outputs[0].token_ids
    assert math.isclose(
        hot_next.outputs[0].cumulative_logprob,
        cold_next.outputs[0].cumulative_logprob,
        abs_tol=1e-6,
    )
    assert_all_blocks_free(llm)


def test_without_replay_the_lost_windows_cost_the_hit(tiny):
    first, branch = prompts()
    start = replay_start(engine(tiny))
    llm = engine(tiny, tail_replay=False)
    assert llm.engine.kv_cache.tail_replay_tokens is None
    lose_windows(llm, first, branch, start)
    output = run_branch(llm, branch)
    assert llm.stats.num_tail_replays == 0
    assert output.num_cached_tokens < start
    assert llm.stats.prefix_misses.window_tail >= SHARED - start


def distance_to_cold(tiny: TinyModel, llm: LLM) -> float:
    first, branch = prompts()
    cold = run_branch(engine(tiny, enable_prefix_caching=False), branch)
    lose_windows(llm, first, branch, replay_start(llm))
    hot = run_branch(llm, branch)
    assert llm.stats.num_tail_replays == 1
    return abs(hot.outputs[0].cumulative_logprob - cold.outputs[0].cumulative_logprob)


def test_a_replay_range_too_short_changes_the_output(tiny, monkeypatch):
    # Half the range the rule asks: the upper windowed layers see keys computed from a partial
    # window.
    rule = KVCacheLayout.tail_replay_tokens
    monkeypatch.setattr(KVCacheLayout, "tail_replay_tokens", lambda self: rule(self) // 2)
    llm = engine(tiny)
    # A right replay is bit for bit (0.0, asserted within 1e-6 above); a wrong one is off by
    # 4e-5 (Gemma-3 per-type) to 2e-1.
    assert distance_to_cold(tiny, llm) > 1e-5


def test_a_replay_that_rewrites_the_cached_full_attention_kv_changes_the_output(tiny):
    llm = engine(tiny)
    llm.engine.model_runner.full_groups = ()  # the runner writes every group's KV
    assert distance_to_cold(tiny, llm) > 1e-4


def test_the_replay_range_is_the_windows_summed(tiny):
    layout = engine(tiny).layout
    kinds = [group.kind for group in layout.groups]
    windowed = [
        layer
        for group in layout.groups
        if group.kind == "sliding_window"
        for layer in group.layer_indices
    ]
    assert "full" in kinds and len(windowed) > 0
    assert layout.tail_replay_tokens() == len(windowed) * (8 - 1)
    uniform = tiny.llm(kv_cache_mode="uniform")  # every group full: nothing to replay
    assert uniform.layout.tail_replay_tokens() is None
    assert uniform.engine.kv_cache.tail_replay_tokens is None


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> TinyModel:
    folder = tmp_path_factory.mktemp("replay-tp-gemma3")
    return TinyModel("gemma3", folder, group_layout="per-type")


def test_a_replay_on_two_ranks_gives_the_cold_engine_s_output(gemma3):
    # The frontiers travel in the step inputs: every rank leaves the cached full-attention KV
    # below them as it is (per-type pages, which no other tensor-parallel test plans in a pool
    # this small). Half the budget per device: a rank's page holds half the KV heads.
    first, branch = prompts()
    cold = run_branch(engine(gemma3, enable_prefix_caching=False), branch)
    one_rank = small_pool(gemma3, largest=88)["kv_cache_memory"]
    llm = engine(gemma3, tensor_parallel_size=2, kv_cache_memory=one_rank // 2)
    try:
        lose_windows(llm, first, branch, replay_start(llm))
        hot = run_branch(llm, branch)
        assert llm.stats.num_tail_replays == 1
        assert hot.outputs[0].token_ids == cold.outputs[0].token_ids
        assert math.isclose(
            hot.outputs[0].cumulative_logprob, cold.outputs[0].cumulative_logprob, abs_tol=1e-4
        )
    finally:
        llm.shutdown()


def test_the_flag_is_checked_and_reaches_the_engine():
    with pytest.raises(EngineConfigError, match="tail-replay"):
        EngineConfig("tiny-gemma3", tail_replay="yes")
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(["--model", "tiny-gemma3"])).tail_replay
    args = parser.parse_args(["--model", "tiny-gemma3", "--no-tail-replay"])
    assert engine_config_from_args(args).tail_replay is False
