"""The engine's Triton path with KV splits, and the warm-up's compile list, on the CPU under
TRITON_INTERPRET=1.

The interpreter has no multiprocessors, so the default rule never splits there; these tests
pretend a 4-multiprocessor GPU (and 1 key tile a split) so that the small batches of
`tests/engine_harness.py` split, then check the tokens against the reference backend and that
every kernel variant the steps launched is one `compile_kernel_variants` compiles.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before Triton decorates the kernels

import pytest
import torch
from engine_harness import greedy_generate
from hybrid_cache.attention import attention_layers
from hybrid_cache.attention.triton_backend import compile_kernel_variants
from hybrid_cache.kernels import paged_attention
from test_engine_triton import BLOCK_SIZE, NUM_NEW_TOKENS, PROMPTS, WINDOW, small_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    "preset, overrides, weight_scale, qk_scale",
    [
        pytest.param("tiny-gpt-oss", {}, 12.0, 1.0, id="gpt-oss-sinks-window"),
        pytest.param("tiny-gemma2", {"attn_logit_softcapping": 5.0}, 1.0, 10.0, id="gemma2"),
    ],
)
def test_split_steps_match_the_reference_and_were_compiled_by_the_warm_up(
    monkeypatch, preset, overrides, weight_scale, qk_scale
):
    model = small_model(preset, overrides, weight_scale, qk_scale)
    reference = greedy_generate(
        model, PROMPTS, NUM_NEW_TOKENS, block_size=BLOCK_SIZE, prefill_chunk=5, backend="reference"
    )
    monkeypatch.setattr(paged_attention, "_multiprocessors", lambda device: 4)
    monkeypatch.setattr(paged_attention, "MIN_TILES_PER_SPLIT", 1)
    launched = []
    plan_launch = paged_attention.plan_launch

    def recording_plan_launch(**arguments):
        plan = plan_launch(**arguments)
        launched.append(plan)
        return plan

    monkeypatch.setattr(paged_attention, "plan_launch", recording_plan_launch)
    triton = greedy_generate(
        model, PROMPTS, NUM_NEW_TOKENS, block_size=BLOCK_SIZE, prefill_chunk=5, backend="triton"
    )
    assert triton.tokens == reference.tokens
    assert triton.num_mixed_steps > 0 and triton.nulled_blocks[0] > 0
    split = {dict(plan.variant)["BLOCK_Q"] for plan in launched if plan.num_kv_splits > 1}
    assert len(split) == 2, "decode-only and mixed steps both split"

    layers = attention_layers(model)
    assert [layer.sliding_window for layer in layers] == [WINDOW, None]
    kv_caches = [
        tuple(torch.zeros(3, BLOCK_SIZE, layer.num_kv_heads, layer.head_dim) for _ in range(2))
        for layer in layers
    ]
    compiled = compile_kernel_variants(model, kv_caches)
    assert len(compiled) == 4 * len(layers)  # the two layers differ (window)
    assert {plan.variant for plan in launched} <= set(compiled)
