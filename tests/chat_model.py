"""A tiny chat model folder for tests: a seeded transformers Llama saved with `save_pretrained`,
and a word-level fast tokenizer with a ChatML-like chat template that writes its own BOS (the
tokenizer's post-processor adds a BOS to plain text too, so a chat tokenized with special tokens
would carry two)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = "the a cat dog sat on mat and ran far user assistant system".split()
SPECIAL = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
VOCAB = {token: index for index, token in enumerate(SPECIAL + WORDS)}
BOS, EOS, IM_END = VOCAB["<s>"], VOCAB["</s>"], VOCAB["<|im_end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}"
    "{% if not (loop.last and continue_final_message) %}<|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def save_chat_tokenizer(folder: Path, chat_template: str | None = CHAT_TEMPLATE) -> None:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(folder)


def save_chat_model(folder: Path, chat_template: str | None = CHAT_TEMPLATE):
    """Saves the model, its tokenizer and no generation config; returns the transformers model
    (eager attention, for reference generations)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=BOS,
        eos_token_id=EOS,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    generation_config = folder / "generation_config.json"
    if generation_config.exists():
        generation_config.unlink()  # each test writes the one it needs
    save_chat_tokenizer(folder, chat_template)
    return model


def write_generation_config(folder: Path, **values) -> Path:
    path = folder / "generation_config.json"
    path.write_text(json.dumps(values))
    return path


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    generated = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return generated[0, len(prompt) :].tolist()
