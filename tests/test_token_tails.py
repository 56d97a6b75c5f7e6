"""Token tails end to end: the next turn of a conversation hits every token the previous turn
computed, ending inside a block, and its output equals a cold engine's bit for bit.

Setup (tiny transformers models of `test_engine_llm`, blocks of 4 tokens; Gemma-3 per-type
has full-attention blocks of 12): turn 1 is a 38-token prompt that generates 8 tokens, so 45
tokens are computed (the last sampled token is never fed back) and every group's row ends
inside a block. Turn 2 resends the prompt, the 8 outputs and 10 new tokens.
"""

from __future__ import annotations

import argparse
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

from tests.test_engine_llm import TinyModel, assert_all_blocks_free, make_prompts

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(
        not hasattr(_core, "Coordinator"), reason="the Rust Coordinator binding is not built"
    ),
    pytest.mark.usefixtures("one_torch_thread"),
]

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
COMPUTED = 38 + 8 - 1  # what turn 1 computed


@pytest.fixture(
    scope="module", params=["llama", "gemma3-per-type", "gemma3-equal", "gpt_oss", "gemma2"]
)
def tiny(request, tmp_path_factory) -> TinyModel:
    architecture, _, layout = request.param.partition("-")
    folder = tmp_path_factory.mktemp(f"tails-{request.param}")
    return TinyModel(architecture, folder, group_layout=layout or "auto")


def turns() -> tuple[list[int], list[int]]:
    first, new = make_prompts(81, lengths=(38, 10))
    return first, new


def run(llm: LLM, prompt: list[int]):
    (output,) = llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)
    return output


def two_turns(llm: LLM):
    first, new = turns()
    one = run(llm, first)
    return one, run(llm, first + list(one.outputs[0].token_ids) + new)


def test_the_next_turn_hits_every_computed_token_and_gives_the_cold_output(tiny):
    cold_one, cold_two = two_turns(tiny.llm(enable_prefix_caching=False))
    llm = tiny.llm()
    one, two = two_turns(llm)
    assert one.outputs[0].token_ids == cold_one.outputs[0].token_ids
    assert two.num_cached_tokens == COMPUTED
    assert llm.stats.num_token_tail_hits == 1
    # Beyond the aligned hit the same cache would give: the last multiple of 4 (the hit
    # alignment) before it, or of 12 for Gemma-3's per-type full-attention blocks (the tail
    # key replaces the partial key of whole units there).
    assert llm.stats.num_token_tail_gain_tokens in (COMPUTED % 4, COMPUTED % 12)
    assert two.outputs[0].token_ids == cold_two.outputs[0].token_ids
    # Bit for bit on the CPU: the same KV, read in the same order.
    assert math.isclose(
        two.outputs[0].cumulative_logprob, cold_two.outputs[0].cumulative_logprob, abs_tol=1e-6
    )
    assert_all_blocks_free(llm)


def test_without_token_tails_the_hit_stops_at_the_block_boundary(tiny):
    llm = tiny.llm(token_tails=False)
    _, two = two_turns(llm)
    assert two.num_cached_tokens == COMPUTED // 4 * 4
    assert llm.stats.num_token_tail_hits == 0


def test_a_third_turn_hits_the_second_turn_s_tail_after_writing_into_the_first_s(tiny):
    # Turn 2 took turn 1's tail blocks and wrote its own tokens into their free slots; turn 3
    # hits everything turn 2 computed, and still gives the cold engine's output.
    first, new = turns()
    cold = tiny.llm(enable_prefix_caching=False)
    llm = tiny.llm()
    history_cold, history = list(first), list(first)
    for turn in range(3):
        out_cold, out = run(cold, history_cold), run(llm, history)
        assert out.outputs[0].token_ids == out_cold.outputs[0].token_ids, f"turn {turn}"
        if turn > 0:
            assert out.num_cached_tokens == len(history) - len(new) - 1
        history_cold = history_cold + list(out_cold.outputs[0].token_ids) + new
        history = history + list(out.outputs[0].token_ids) + new
    assert llm.stats.num_token_tail_hits == 2


def test_the_flags_are_checked_and_reach_the_engine():
    with pytest.raises(EngineConfigError, match="token-tails"):
        EngineConfig("tiny-gemma3", token_tails="yes")
    for bad in (-0.1, 1.5, float("nan"), True, "half"):
        with pytest.raises(EngineConfigError, match="protected-prefix-fraction must be a number"):
            EngineConfig("tiny-gemma3", protected_prefix_fraction=bad)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(["--model", "tiny-gemma3"]))
    assert config.token_tails and config.protected_prefix_fraction == 0.75
    args = parser.parse_args(
        ["--model", "tiny-gemma3", "--no-token-tails", "--protected-prefix-fraction", "0"]
    )
    config = engine_config_from_args(args)
    assert config.token_tails is False and config.protected_prefix_fraction == 0.0


def test_an_engine_protects_finished_prefixes_up_to_its_budget(tiny):
    first, _ = turns()
    llm = tiny.llm(protected_prefix_fraction=0.5)
    run(llm, first)
    coordinator = llm.engine.kv_cache.coordinator
    protected = coordinator.num_protected_blocks()
    assert 0 < protected <= llm.engine.kv_cache.num_blocks // 2
    off = tiny.llm(protected_prefix_fraction=0.0)
    run(off, first)
    assert off.engine.kv_cache.coordinator.num_protected_blocks() == 0


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> TinyModel:
    return TinyModel("gemma3", tmp_path_factory.mktemp("tails-tp-gemma3"), group_layout="per-type")


def test_a_tail_hit_on_two_ranks_gives_the_cold_engine_s_output(gemma3):
    # The block tables and slots of a hit ending inside a block reach every rank: the next
    # turn computes from the tail on both, as one rank does (per-type pages).
    cold_one, cold_two = two_turns(gemma3.llm(enable_prefix_caching=False))
    llm = gemma3.llm(tensor_parallel_size=2)
    try:
        one, two = two_turns(llm)
        assert two.num_cached_tokens == COMPUTED
        assert llm.stats.num_token_tail_hits == 1
        assert two.outputs[0].token_ids == cold_two.outputs[0].token_ids
        assert math.isclose(
            two.outputs[0].cumulative_logprob, cold_two.outputs[0].cumulative_logprob, abs_tol=1e-4
        )
    finally:
        llm.shutdown()
