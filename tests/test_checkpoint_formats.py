"""The checkpoint layouts people download, rebuilt small: Gemma-3 multimodal wrappers (both weight
layouts, the sparse published config) and gpt-oss with MXFP4 experts (packed here from the
format's spec, in one folder and across shards). Greedy tokens equal transformers' on each.

transformers' own MXFP4 path wants Triton kernels on a GPU; the reference model is the
transformers model holding the exact weights the packed tensors encode (every weight is chosen
on the FP4 grid times a power of two, so packing loses nothing). transformers' dequantising load
(`Mxfp4Config(dequantize=True)`, plain torch) of the same folder is checked to give those weights
too: an independent reading of the files.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from engine_harness import greedy_generate
from hybrid_cache.attention import attention_layers
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.models import WeightMismatchError, load_model
from hybrid_cache.models.mxfp4 import dequantize_mxfp4
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_models_vs_hf import (
    MAX_NEW_TOKENS,
    VOCAB,
    WINDOW,
    hf_greedy,
    make_prompts,
    peak_weights,
)

LOADER_LOGGER = "hybrid_cache.models.loader"

# ---------------------------------------------------------------------------------------------
# Gemma-3 4B/12B/27B: Gemma3ForConditionalGeneration folders.

GEMMA3_TEXT = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    intermediate_size=128,
    max_position_embeddings=256,
    head_dim=16,
    sliding_window=WINDOW,
    query_pre_attn_scalar=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_scaling={"rope_type": "linear", "factor": 4.0},
)
SIGLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)
# transformers' module names for the same tensors (what the older save layout is loaded as).
MODULE_NAMES = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("vision_tower.", "model.vision_tower."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)


def make_gemma3_wrapper(config: transformers.Gemma3Config, folder) -> torch.nn.Module:
    """A seeded Gemma3ForConditionalGeneration of `config`, peaked weights, saved to `folder`."""
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(
        config, attn_implementation="eager"
    )
    peak_weights(model, 0.2, 0.02)
    model.eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(folder)
    return model


def tensor_names(folder) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return list(handle.keys())


def rename_tensors(folder, renames) -> None:
    """Rewrites the folder's one weight file with each name's prefix replaced."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    renamed = {}
    for name, tensor in tensors.items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name.removeprefix(old)
                break
        renamed[name] = tensor
    save_file(renamed, path, metadata={"format": "pt"})


def llm_greedy(folder, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of the offline `LLM` on `folder` (the engine's own load and cache)."""
    llm = LLM(str(folder), kv_cache_memory="2MiB", max_model_len=64, block_size=4)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [{"prompt_token_ids": prompt} for prompt in prompts]
    outputs = llm.generate(requests, params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def assert_greedy_equal(ours: torch.nn.Module, hf_model: torch.nn.Module) -> list[list[int]]:
    prompts = make_prompts()
    result = greedy_generate(ours, prompts, MAX_NEW_TOKENS, block_size=4, prefill_chunk=5)
    expected = hf_greedy(hf_model, prompts)
    assert result.tokens == expected
    assert sum(result.nulled_blocks) > 0, "no block left a window: the test proves nothing"
    assert sum(len(set(tokens)) > 1 for tokens in expected) >= 2
    return expected


@pytest.mark.parametrize("layout", ["saved", "module_names"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gemma3_wrapper_folder_matches_transformers(layout, tied, tmp_path, caplog) -> None:
    """transformers 5 saves a Gemma3ForConditionalGeneration in the published layout
    (`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`, and
    `language_model.lm_head.weight` when untied); transformers' module names
    (`model.language_model.*`, `lm_head.weight`) load too. The text model is loaded, the vision
    tower and projector are skipped with one log line counting them."""
    config = transformers.Gemma3Config(
        text_config=GEMMA3_TEXT,
        vision_config=SIGLIP,
        mm_tokens_per_image=4,
        tie_word_embeddings=tied,
    )
    folder = tmp_path / "gemma3"
    hf_model = make_gemma3_wrapper(config, folder)
    names = tensor_names(folder)
    assert "language_model.model.embed_tokens.weight" in names
    assert ("language_model.lm_head.weight" in names) == (not tied)
    if layout == "module_names":
        rename_tensors(folder, MODULE_NAMES)
        names = tensor_names(folder)
        assert ("lm_head.weight" in names) == (not tied)
        reloaded = transformers.AutoModelForImageTextToText.from_pretrained(folder)
        assert torch.equal(  # transformers reads this layout as the same model
            reloaded.model.language_model.layers[0].mlp.up_proj.weight,
            hf_model.model.language_model.layers[0].mlp.up_proj.weight,
        )
    vision = sum(".vision_tower." in f".{name}" for name in names)
    projector = sum(".multi_modal_projector." in f".{name}" for name in names)
    assert vision > 10 and projector == 2

    with caplog.at_level(logging.INFO, logger=LOADER_LOGGER):
        ours = load_model(folder)
    assert type(ours).__name__ == "Gemma3ForCausalLM"
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    skipped = [record.getMessage() for record in caplog.records if "skipped" in record.message]
    assert len(skipped) == 1
    expected = f"skipped {vision} vision tower and {projector} multimodal projector tensors"
    assert expected in skipped[0]
    windows = [layer.sliding_window for layer in attention_layers(ours)]
    assert windows == [WINDOW, None, WINDOW]
    expected = assert_greedy_equal(ours, hf_model)
    if tied and layout == "saved":  # the offline API on the same folder
        assert llm_greedy(folder, make_prompts()) == expected


def test_gemma3_wrapper_tensor_outside_its_layout_is_named(tmp_path) -> None:
    config = transformers.Gemma3Config(
        text_config=GEMMA3_TEXT, vision_config=SIGLIP, mm_tokens_per_image=4
    )
    folder = tmp_path / "gemma3"
    make_gemma3_wrapper(config, folder)
    rename_tensors(folder, [("language_model.model.norm.", "text_model.norm.")])
    with pytest.raises(WeightMismatchError, match="'text_model.norm.weight' has no place") as error:
        load_model(folder)
    assert "language_model.model.* or model.language_model.*" in str(error.value)


def gemma3_4b_config_shape() -> dict:
    """gemma-3-4b-it's config.json as published (its text_config states 6 fields, the class
    defaults give the rest: 8 heads of 256, 4 kv heads, vocab 262208, rotary bases 1e6 global
    and 1e4 local, tied embeddings), scaled down by the fields it states."""
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "boi_token_index": 255999,
        "eoi_token_index": 256000,
        "eos_token_id": [1, 106],
        "image_token_index": 262144,
        "initializer_range": 0.02,
        "mm_tokens_per_image": 4,
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "model_type": "gemma3_text",
            "num_hidden_layers": 6,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": WINDOW,
        },
        "torch_dtype": "float32",
        "vision_config": {**SIGLIP, "model_type": "siglip_vision_model", "vision_use_head": False},
    }


def test_gemma3_published_sparse_config_matches_transformers(tmp_path) -> None:
    """A folder whose config.json leaves the text fields to the class defaults, as the published
    gemma-3-4b-it does: our model takes the same defaults as transformers' (heads, head dim,
    vocabulary, norm eps, query scale, both rotary bases, tied embeddings)."""
    published = gemma3_4b_config_shape()
    fields = {key: value for key, value in published.items() if key != "model_type"}
    config = transformers.AutoConfig.for_model("gemma3", **fields)
    assert config.text_config.num_attention_heads == 8 and config.text_config.head_dim == 256
    folder = tmp_path / "gemma3-4b-shape"
    hf_model = make_gemma3_wrapper(config, folder)
    (folder / "config.json").write_text(json.dumps(published))  # the sparse file, not to_dict's

    ours = load_model(folder)
    assert ours.spec.vocab_size == 262_208
    assert ours.lm_head.weight is ours.model.embed_tokens.weight
    windows = [layer.sliding_window for layer in attention_layers(ours)]
    assert windows == [WINDOW] * 5 + [None]
    assert_greedy_equal(ours, hf_model)


# ---------------------------------------------------------------------------------------------
# gpt-oss: MXFP4 experts, packed here as the format specifies (see models/mxfp4.py's docstring:
# E2M1 codes, low nibble first, 32-element blocks, E8M0 scale byte = exponent + 127).

FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
GPT_OSS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    intermediate_size=64,
    max_position_embeddings=256,
    head_dim=16,
    sliding_window=WINDOW,
    num_local_experts=4,
    num_experts_per_tok=2,
)
EXPERT_MATRICES = ("gate_up_proj", "down_proj")
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}


def fp4_grid_weights(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` [..., rows, cols] moved onto the MXFP4 grid: (values, codes [..., rows, cols],
    exponents [..., rows, cols / 32]), values = +-magnitude[code & 7] * 2 ** exponent exactly."""
    blocks = weight.reshape(*weight.shape[:-1], -1, 32)
    largest = blocks.abs().amax(-1).clamp(min=2.0**-20)
    exponents = torch.ceil(torch.log2(largest / 6.0)).to(torch.int64)  # |block| / 2**e <= 6
    scaled = blocks / torch.exp2(exponents.double()).unsqueeze(-1)
    magnitude = (scaled.abs().unsqueeze(-1) - FP4_MAGNITUDES).abs().argmin(-1)
    negative = (scaled < 0) & (magnitude > 0)
    codes = magnitude + 8 * negative
    values = FP4_MAGNITUDES[magnitude] * torch.where(negative, -1.0, 1.0)
    values = values * torch.exp2(exponents.double()).unsqueeze(-1)
    return values.reshape(weight.shape).float(), codes.reshape(weight.shape), exponents


def pack_mxfp4(codes: torch.Tensor, exponents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks uint8 [..., rows, n_blocks, 16], scales uint8 [..., rows, n_blocks]): two codes a
    byte, the even element in the low nibble; scale byte = exponent + 127."""
    pairs = codes.reshape(*codes.shape[:-1], -1, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, (exponents + 127).to(torch.uint8)


def test_dequantize_mxfp4_by_hand() -> None:
    """Bytes worked out from the format: 0x2F = code 0xF (-6) then code 0x2 (+1); 0x81 = code 1
    (+0.5) then code 8 (-0); 0x7E = code 0xE (-4) then code 7 (+6); scale byte 128 doubles,
    125 divides by 4, 0 is 2 ** -127."""
    blocks = torch.zeros(3, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0], blocks[0, 0, 15] = 0x2F, 0x81
    blocks[1, 0, 1] = 0x7E
    blocks[2, 0, 0] = 0x02  # code 2 (+1) then code 0
    scales = torch.tensor([[128], [125], [0]], dtype=torch.uint8)
    weight = dequantize_mxfp4(blocks, scales)
    assert weight.shape == (3, 32) and weight.dtype == torch.float32
    expected = torch.zeros(3, 32)
    expected[0, 0], expected[0, 1], expected[0, 30] = -12.0, 2.0, 1.0
    expected[1, 2], expected[1, 3] = -1.0, 1.5
    expected[2, 0] = 2.0**-127
    assert torch.equal(weight, expected)
    assert torch.signbit(weight[0, 31]), "code 8 is -0"
    assert dequantize_mxfp4(blocks, scales, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(WeightMismatchError, match="need scales"):
        dequantize_mxfp4(blocks, scales[:2])


def test_packer_round_trips_and_agrees_with_transformers_dequantiser() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 8, 96, generator=generator) * 0.3  # [E, rows, cols]
    values, codes, exponents = fp4_grid_weights(weight)
    assert not torch.equal(values, weight)
    step = torch.exp2(exponents.float()).repeat_interleave(32, dim=-1)  # half the widest gap
    assert ((values - weight).abs() <= step).all()
    blocks, scales = pack_mxfp4(codes, exponents)
    assert blocks.shape == (3, 8, 3, 16) and scales.shape == (3, 8, 3)
    assert torch.equal(dequantize_mxfp4(blocks, scales), values)
    # transformers' plain-torch dequantiser returns the expert layout [E, cols, rows].
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(theirs.transpose(1, 2), values)


def make_mxfp4_gpt_oss(tmp_path, name: str = "gpt-oss-mxfp4") -> tuple[torch.nn.Module, object]:
    """A tiny gpt-oss whose experts lie on the MXFP4 grid, saved as the published checkpoints
    are: experts as `*_blocks` / `*_scales` ([E, out, in / 32, 16] / [E, out, in / 32]), the
    rest as float tensors, in two shards (every `_blocks` in the first, its `_scales` in the
    second) with `model.safetensors.index.json`, and `quantization_config` mxfp4."""
    config = transformers.GptOssConfig(**GPT_OSS)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    peak_weights(model, 0.2, 0.3)
    packed: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            for matrix in EXPERT_MATRICES:
                parameter = getattr(layer.mlp.experts, matrix)  # [E, in, out]
                values, codes, exponents = fp4_grid_weights(parameter.transpose(1, 2))
                parameter.copy_(values.transpose(1, 2))
                prefix = f"model.layers.{index}.mlp.experts.{matrix}"
                packed[f"{prefix}_blocks"], packed[f"{prefix}_scales"] = pack_mxfp4(
                    codes, exponents
                )
    model.eval()
    model.generation_config.eos_token_id = None
    folder = tmp_path / name
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    kept = {key: value for key, value in tensors.items() if not key.endswith(EXPERT_MATRICES)}
    assert len(kept) == len(tensors) - 2 * len(model.model.layers)
    shards = {
        "model-00001-of-00002.safetensors": {
            key: value for key, value in packed.items() if key.endswith("_blocks")
        },
        "model-00002-of-00002.safetensors": {
            **kept,
            **{key: value for key, value in packed.items() if key.endswith("_scales")},
        },
    }
    weight_map = {}
    for file_name, shard in shards.items():
        save_file(shard, folder / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config_path = folder / "config.json"
    config_json = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config_json, "quantization_config": MXFP4_CONFIG}))
    return model, folder


def expert_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        getattr(layer.mlp.experts, matrix)
        for layer in model.model.layers
        for matrix in EXPERT_MATRICES
    ]


def test_gpt_oss_mxfp4_folder_matches_transformers(tmp_path) -> None:
    hf_model, folder = make_mxfp4_gpt_oss(tmp_path)
    ours = load_model(folder)
    exact = expert_weights(hf_model)
    assert all(torch.equal(a, b) for a, b in zip(expert_weights(ours), exact, strict=True))
    in_bf16 = load_model(folder, dtype=torch.bfloat16)
    for a, b in zip(expert_weights(in_bf16), exact, strict=True):
        assert a.dtype == torch.bfloat16 and torch.equal(a.float(), b)  # exact in bf16 too
    # transformers' own (plain torch) dequantising load reads the folder as the same weights.
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
    )
    assert all(torch.equal(a, b) for a, b in zip(expert_weights(theirs), exact, strict=True))
    expected = assert_greedy_equal(ours, hf_model)
    assert llm_greedy(folder, make_prompts()) == expected  # the offline API on the same folder


def rewrite_shard(folder, edit) -> None:
    path = folder / "model-00002-of-00002.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {
        key: file
        for key, file in index["weight_map"].items()
        if file != path.name or key in tensors
    }
    index["weight_map"].update(dict.fromkeys(tensors, path.name))
    index_path.write_text(json.dumps(index))


def test_mxfp4_errors_name_the_tensor(tmp_path) -> None:
    _, folder = make_mxfp4_gpt_oss(tmp_path)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    rewrite_shard(folder, lambda tensors: tensors.pop(name))
    with pytest.raises(WeightMismatchError, match="without their other half.*down_proj_blocks"):
        load_model(folder)

    _, folder = make_mxfp4_gpt_oss(tmp_path, "wrong-scales")

    def halve(tensors):
        tensors[name] = tensors[name][:, :32].contiguous()

    rewrite_shard(folder, halve)
    with pytest.raises(WeightMismatchError, match="down_proj_blocks / _scales: blocks"):
        load_model(folder)


def test_mxfp4_block_count_follows_the_config(tmp_path) -> None:
    """A config whose intermediate size disagrees with the packed experts is named as such."""
    _, folder = make_mxfp4_gpt_oss(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 32
    (folder / "config.json").write_text(json.dumps(config))
    match = r"down_proj_blocks / _scales dequantise to shape \(4, 64, 64\), config.json implies"
    with pytest.raises(WeightMismatchError, match=match + r" \(4, 64, 32\)"):
        load_model(folder)
