"""Small real tokenizers for tests, trained in-process with `tokenizers` (no download).

- `byte_level_bpe()`: GPT-2 / Llama-3 style byte-level BPE: characters outside ASCII are split
  over byte tokens, so a token's text can be an incomplete character.
- `metaspace_bpe()`: SentencePiece style (Llama-2, Gemma): "▁" marks a word start, and the
  decoder drops the space before the first word, so a token's text depends on what precedes it.

Both are wrapped as transformers fast tokenizers with `<s>` (bos), `</s>` (eos), `<pad>`.
"""

from __future__ import annotations

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "the cat sat on the mat and the dog ran far away from the old barn",
    "a quick brown fox jumps over the lazy dog while the bird sings",
    "héllo wörld, naïve café déjà vu — über straße ñandú",
    "STOP here. then go on; stop again! the end of the line is near",
    "numbers 0123456789 and symbols ()[]{}<>+-*/=?!.,:;",
]
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


def _wrap(tokenizer: Tokenizer) -> transformers.PreTrainedTokenizerFast:
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def byte_level_bpe(vocab_size: int = 320) -> transformers.PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return _wrap(tokenizer)


def metaspace_bpe(vocab_size: int = 160) -> transformers.PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return _wrap(tokenizer)
