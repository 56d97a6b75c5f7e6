"""Greedy tokens of our paged models equal transformers' `generate`, token for token.

Each architecture: a tiny random-weight model built from transformers' own config class (seeded),
saved with `save_pretrained` (safetensors), loaded by our loader, run by the test harness with
chunked prefill mixed with decode in one batch, on prompts whose lengths cross the sliding window
(8 tokens) several times. Windowed groups null their out-of-window blocks and NaN their pages.
Float32 throughout; transformers runs the eager attention (sinks and softcaps need it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from engine_harness import greedy_generate
from hybrid_cache.attention import attention_layers
from hybrid_cache.models import load_model
from hybrid_cache.models.rotary import rope_inv_freq, rope_parameters
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

WINDOW = 8
MAX_NEW_TOKENS = 12
PROMPT_LENGTHS = (3, 13, 29)
VOCAB = 256

BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    intermediate_size=128,
    max_position_embeddings=256,
)

# name -> (config class, overrides, std of random matrices, std of the embedding)
ARCHITECTURES = {
    "llama3": (
        "LlamaConfig",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
        0.3,
        0.3,
    ),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW), 0.3, 0.3),
    "qwen2": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        0.3,
        0.3,
    ),
    "qwen3": ("Qwen3Config", dict(head_dim=16), 0.3, 0.3),
    "gemma2": (
        "Gemma2Config",
        dict(
            head_dim=16,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            final_logit_softcapping=5.0,
            attn_logit_softcapping=3.0,
        ),
        0.2,
        0.02,
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
        0.2,
        0.02,
    ),
    "gpt_oss": (
        "GptOssConfig",
        dict(head_dim=16, sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
        0.3,
        0.3,
    ),
}


def make_hf_model(name: str, tmp_path, **fields: Any) -> tuple[torch.nn.Module, str]:
    """A seeded tiny transformers model of `name` (config `fields` changed), saved to a folder;
    returns (model, folder)."""
    config_class, overrides, matrix_std, embedding_std = ARCHITECTURES[name]
    config = getattr(transformers, config_class)(**{**BASE, **overrides, **fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    peak_weights(model, matrix_std, embedding_std)
    model.eval()
    model.generation_config.eos_token_id = None
    folder = str(tmp_path / name)
    model.save_pretrained(folder)
    return model, folder


def peak_weights(model: torch.nn.Module, matrix_std: float, embedding_std: float) -> None:
    """Larger-than-default weights make the logits peaked, so greedy picks are far from ties."""
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "norm" in parameter_name:
                parameter.normal_(0, 0.1)
            else:
                parameter.normal_(0, embedding_std if "embed" in parameter_name else matrix_std)


def make_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        generated = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_tokens_match_transformers(name: str, tmp_path) -> None:
    hf_model, folder = make_hf_model(name, tmp_path)
    ours = load_model(folder, dtype=torch.float32)
    prompts = make_prompts()
    result = greedy_generate(ours, prompts, MAX_NEW_TOKENS, block_size=4, prefill_chunk=5)
    expected = hf_greedy(hf_model, prompts)
    assert result.tokens == expected
    assert result.num_mixed_steps > 0, "prefill chunks and decode tokens never shared a step"
    windowed = [layer.sliding_window for layer in attention_layers(ours) if layer.sliding_window]
    if windowed:
        assert windowed[0] == WINDOW
        assert sum(result.nulled_blocks) > 0, "no block left a window: the test proves nothing"
    # Sequences that repeat one token throughout would hide position bugs.
    assert sum(len(set(tokens)) > 1 for tokens in expected) >= 2


def test_qwen2_max_window_layers_without_layer_types(tmp_path) -> None:
    """The shape of many published Qwen2 configs: `use_sliding_window` and `max_window_layers`
    but no `layer_types`. transformers slides from layer `max_window_layers` on and the layers
    below attend fully; our model does the same (both read from the one ModelSpec)."""
    hf_model, folder = make_hf_model("qwen2", tmp_path)  # 2 layers, max_window_layers=1
    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    config.pop("layer_types", None)
    assert config["use_sliding_window"] and config["max_window_layers"] == 1
    path.write_text(json.dumps(config))
    reloaded = transformers.AutoConfig.from_pretrained(folder)
    assert reloaded.layer_types == ["full_attention", "sliding_attention"]
    ours = load_model(folder)
    assert [layer.sliding_window for layer in attention_layers(ours)] == [None, WINDOW]
    prompts = make_prompts()
    expected = hf_greedy(hf_model, prompts)
    result = greedy_generate(ours, prompts, MAX_NEW_TOKENS, block_size=4, prefill_chunk=5)
    assert result.tokens == expected
    assert sum(result.nulled_blocks) > 0, "no block left a window: the test proves nothing"
    # The comparison sees the difference: windowing layer 0 as well changes the tokens.
    attention_layers(ours)[0].sliding_window = WINDOW
    windowed = greedy_generate(ours, prompts, MAX_NEW_TOKENS, block_size=4, prefill_chunk=5)
    assert windowed.tokens != expected


def test_prefill_in_one_chunk_matches_chunked(tmp_path) -> None:
    _, folder = make_hf_model("gemma2", tmp_path)
    ours = load_model(folder)
    prompts = make_prompts()
    chunked = greedy_generate(ours, prompts, 8, block_size=4, prefill_chunk=3)
    whole = greedy_generate(ours, prompts, 8, block_size=8, prefill_chunk=None)
    assert chunked.tokens == whole.tokens


def test_wrong_window_diverges(tmp_path) -> None:
    """The comparison is sensitive to the window convention: off by one changes the tokens."""
    hf_model, folder = make_hf_model("mistral", tmp_path)
    ours = load_model(folder)
    for layer in attention_layers(ours):
        layer.sliding_window = WINDOW + 1
    prompts = make_prompts()
    result = greedy_generate(ours, prompts, MAX_NEW_TOKENS, block_size=4, prefill_chunk=5)
    assert result.tokens != hf_greedy(hf_model, prompts)


def test_chunked_local_layers_agree_across_prefill_chunking() -> None:
    """Chunked-local attention (no transformers oracle among our architectures): the same tokens
    whether prompts are prefilled in 3-token chunks or whole, with blocks of chunks released."""
    config = {**BASE, "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-6}
    model = load_model(config=config, load_format="dummy", seed=5)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(15.0)  # N(0, 0.3): peaked logits, far from ties
    for layer in attention_layers(model):
        layer.chunk = 6
    prompts = make_prompts()
    chunked = greedy_generate(model, prompts, 10, block_size=2, prefill_chunk=3)
    whole = greedy_generate(model, prompts, 10, block_size=2, prefill_chunk=None)
    assert chunked.tokens == whole.tokens
    assert sum(chunked.nulled_blocks) > 0
    assert sum(len(set(tokens)) > 1 for tokens in chunked.tokens) >= 2


ROPE_CASES = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "mscale": 0.7, "mscale_all_dim": 1.0,
     "original_max_position_embeddings": 64},
]  # fmt: skip


@pytest.mark.parametrize("rope", ROPE_CASES, ids=lambda rope: rope["rope_type"])
def test_rope_tables_match_transformers(rope) -> None:
    hf = transformers.LlamaConfig(
        **{**BASE, "head_dim": 32, "rope_parameters": {**rope, "rope_theta": 50000.0}}
    )
    expected_inv_freq, expected_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    ours = rope_parameters(hf.to_dict())
    inv_freq, scaling = rope_inv_freq(32, ours)
    torch.testing.assert_close(inv_freq, expected_inv_freq.float(), rtol=1e-6, atol=0)
    assert scaling == pytest.approx(expected_scaling)


def test_gemma3_old_and_new_rope_configs_agree() -> None:
    """Older Gemma-3 configs spell local/global rotary as rope_local_base_freq + rope_scaling."""
    new = transformers.Gemma3TextConfig(
        **BASE, head_dim=16, rope_scaling={"rope_type": "linear", "factor": 8.0}
    ).to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    for layer_type in ("sliding_attention", "full_attention"):
        assert rope_parameters(old, layer_type) == rope_parameters(new, layer_type)
    assert rope_parameters(new, "sliding_attention")["rope_theta"] == 10_000.0
    assert rope_parameters(new, "full_attention")["factor"] == 8.0


def test_a_prompt_holding_the_pad_token_matches_transformers(tmp_path) -> None:
    """transformers takes prompt tokens equal to `pad_token_id` for padding unless given an
    attention mask (hf_greedy gives one): a prompt holding token 0 is compared whole."""
    hf_model, folder = make_hf_model("gemma2", tmp_path)
    prompt = make_prompts()[2]
    prompt[6] = 0
    result = greedy_generate(load_model(folder, dtype=torch.float32), [prompt], MAX_NEW_TOKENS)
    assert result.tokens == hf_greedy(hf_model, [prompt])
    with torch.no_grad():
        whole = hf_model(torch.tensor([prompt])).logits[0, -1]
        inferred = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=1, pad_token_id=0, eos_token_id=None,
            do_sample=False, output_logits=True, return_dict_in_generate=True,
        ).logits[0][0]  # fmt: skip
    assert not torch.allclose(whole, inferred, atol=1e-3), "the mask made no difference here"
