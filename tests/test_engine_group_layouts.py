"""The engine on every KV-cache group layout gives the same tokens: a 7:2 windowed/full pattern
whose per-type pages pad (blocks of 4 and 12 tokens, 24 of 28 token slots used in a full page),
under preemption and prefix hits, against equal-size groups and the uniform layout."""

from __future__ import annotations

import random

import pytest
from hybrid_cache import LLM, SamplingParams

LAYER_TYPES = (
    ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 4 + ["full_attention"]
)
OVERRIDES = {"num_hidden_layers": 9, "layer_types": LAYER_TYPES, "sliding_window": 6}
PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    draw = random.Random(0)
    batch = [[draw.randrange(3, 500) for _ in range(draw.randrange(5, 60))] for _ in range(6)]
    return batch + [batch[0][:30] + [7, 8, 9], batch[0][:30] + [11]]  # a shared prefix


def run(mode: str, layout: str, memory: str) -> tuple[LLM, list[list[int]]]:
    llm = LLM(
        "tiny-gemma3",
        load_format="dummy",
        hf_overrides=OVERRIDES,
        kv_cache_memory=memory,
        max_model_len=88,  # the longest request is 60 + 20 tokens
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        seed=0,
        kv_cache_mode=mode,
        kv_group_layout=layout,
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], PARAMS, use_tqdm=False)
    assert all(output.finish_reason == "length" for output in outputs)
    kv_cache = llm.engine.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_blocks - 1, "every block came back"
    return llm, [output.token_ids for output in outputs]


@pytest.mark.parametrize(
    "mode, layout, memory, preempts",
    [
        ("hybrid", "per-type", "160KiB", True),
        ("hybrid", "per-type", "1MiB", False),
        ("hybrid", "equal", "96KiB", True),
        ("hybrid", "auto", "1MiB", False),
    ],
)
def test_every_group_layout_gives_the_uniform_tokens(mode, layout, memory, preempts):
    _, expected = run("uniform", "auto", "1MiB")
    assert len({token for tokens in expected for token in tokens}) > 10, "degenerate reference"
    llm, tokens = run(mode, layout, memory)
    assert tokens == expected
    assert (llm.stats.num_preemptions > 0) == preempts
    assert llm.stats.prefix_cache_hit_rate > 0
    groups = [(group.block_size, len(group.layer_indices)) for group in llm.layout.groups]
    if layout == "per-type":
        assert groups == [(4, 7), (12, 2)]
        assert any("pad their pages" in note for note in llm.layout.notes)
    else:  # auto keeps equal groups: 14% page padding is over max_padding_waste
        assert groups == [(4, 1)] * 9
