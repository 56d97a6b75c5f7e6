"""End to end on the CPU: a small model generates the same greedy tokens with the Triton backend
(under TRITON_INTERPRET=1) as with the torch reference backend.

Driven by `tests/engine_harness.py` (paged runner without the Rust allocator): prompts are
prefilled in chunks mixed with decode tokens, windows of 6 tokens over blocks of 4 are crossed
several times, and released pages (and block 0) are NaN, so a backend that read one would turn the
logits into NaN and fail the token comparison.
"""

import os

# Must be set before Triton decorates the kernels (before hybrid_cache.kernels' launchers load).
os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from engine_harness import greedy_generate
from hybrid_cache import _core
from hybrid_cache.attention import attention_layers
from hybrid_cache.attention.selector import attention_backends_by_group
from hybrid_cache.kernels._launch import is_interpreted
from hybrid_cache.models import load_model
from hybrid_cache.presets import read_preset

WINDOW = 6
BLOCK_SIZE = 4
NUM_NEW_TOKENS = 6
PROMPTS = [[3, 17, 99, 4, 250, 31, 8, 77, 12, 5, 140, 66, 9], [42, 7, 300], [11, 2, 480, 95, 23]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_model(preset: str, overrides: dict, weight_scale: float, qk_scale: float):
    """Two layers (windowed, full) of a tiny preset with seeded random weights, scaled so that
    greedy tokens vary and attention is sharp enough for the window, softcap and sinks to change
    them (checked below)."""
    config = {
        **read_preset(preset),
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": WINDOW,
        **overrides,
    }
    model = load_model(config=config, load_format="dummy", seed=3)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.mul_(weight_scale)
            if "q_proj" in name or "k_proj" in name:
                parameter.mul_(qk_scale)
    return model


@pytest.mark.parametrize(
    "preset, overrides, weight_scale, qk_scale",
    [
        pytest.param("tiny-gpt-oss", {}, 12.0, 1.0, id="gpt-oss-sinks-window"),
        pytest.param(
            "tiny-gemma2", {"attn_logit_softcapping": 5.0}, 1.0, 10.0, id="gemma2-softcap-window"
        ),
    ],
)
def test_triton_backend_generates_the_reference_tokens(preset, overrides, weight_scale, qk_scale):
    model = small_model(preset, overrides, weight_scale, qk_scale)
    assert [layer.sliding_window for layer in attention_layers(model)] == [WINDOW, None]
    runs = {
        backend: greedy_generate(
            model, PROMPTS, NUM_NEW_TOKENS, block_size=BLOCK_SIZE, prefill_chunk=5, backend=backend
        )
        for backend in ("reference", "triton")
    }
    reference, triton = runs["reference"], runs["triton"]
    assert all(layer.backend == "triton" for layer in attention_layers(model))
    assert triton.tokens == reference.tokens
    # The comparison means something: windows were crossed (pages released), prefill chunks
    # ran with decode tokens, the tokens are not one repeated id, and the window changes them.
    assert triton.nulled_blocks[0] > 0 and triton.nulled_blocks == reference.nulled_blocks
    assert triton.num_mixed_steps > 0
    assert sum(len(set(tokens)) > 1 for tokens in triton.tokens) >= 2
    attention_layers(model)[0].sliding_window = None
    unwindowed = greedy_generate(model, PROMPTS, NUM_NEW_TOKENS, BLOCK_SIZE, prefill_chunk=5)
    assert unwindowed.tokens != reference.tokens


@pytest.mark.skipif(
    not hasattr(_core, "Coordinator"), reason="the Rust Coordinator binding is not built"
)
@pytest.mark.parametrize(
    "preset, layer_types, block_sizes, weight_scale",
    [
        pytest.param(
            "tiny-gpt-oss", ["sliding_attention", "full_attention"], [4, 4], 12.0, id="gpt-oss"
        ),
        # 3:1, planned per type: the full layer's blocks are 3 x 4 = 12 tokens (no power of two).
        pytest.param(
            "tiny-gemma3", ["sliding_attention"] * 3 + ["full_attention"], [4, 12], 1.0, id="gemma3"
        ),
    ],
)
def test_llm_with_the_triton_backend_generates_the_reference_tokens(
    preset, layer_types, block_sizes, weight_scale
):
    """Through the engine: `LLM(..., attention_backend="triton")` against "reference" on a tiny
    preset whose 6-token window is crossed by prompts and generation."""
    from hybrid_cache import LLM, SamplingParams

    overrides = {
        "num_hidden_layers": len(layer_types),
        "layer_types": layer_types,
        "sliding_window": WINDOW,
    }
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("reference", "triton"):
        llm = LLM(
            preset,
            load_format="dummy",
            hf_overrides=overrides,
            kv_cache_memory="1MiB",
            max_model_len=64,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=8,
            max_num_seqs=4,
            device="cpu",
            seed=0,
            attention_backend=backend,
        )
        assert attention_backends_by_group(llm.model) == {0: backend, 1: backend}
        assert [group.block_size for group in llm.layout.groups] == block_sizes
        with torch.no_grad():
            for parameter in llm.model.parameters():
                parameter.mul_(weight_scale)  # sharper logits where needed (as above)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        tokens[backend] = [output.token_ids for output in outputs]
    assert tokens["triton"] == tokens["reference"]
    assert all(len(generated) == NUM_NEW_TOKENS for generated in tokens["reference"])
    assert sum(len(set(generated)) > 1 for generated in tokens["reference"]) >= 2


def test_the_kernels_ran_under_the_interpreter():
    from hybrid_cache.kernels.paged_attention import _unified_attention_kernel

    assert is_interpreted(_unified_attention_kernel)
