"""A tiny model folder to serve in tests: a seeded transformers Qwen2 with one full-attention
and one sliding-window layer (two KV-cache groups, two attention kinds), saved with a
byte-level BPE tokenizer (`tiny_tokenizers.py`: characters outside ASCII split over byte
tokens, so streamed text must wait for whole characters) and a ChatML-like chat template."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tiny_tokenizers import byte_level_bpe

WINDOW = 16
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def save_serve_model(folder: Path) -> str:
    tokenizer = byte_level_bpe()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(0.0, 0.1 if "norm" in name else 0.3)
    model.save_pretrained(folder)
    generation_config = folder / "generation_config.json"
    if generation_config.exists():
        generation_config.unlink()
    tokenizer.save_pretrained(folder)
    return str(folder)
