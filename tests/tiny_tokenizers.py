"""Small real tokenizers for tests, trained in-process with `tokenizers` (no download).

- `byte_level_bpe()`: GPT-2 / Llama-3 style byte-level BPE: characters outside ASCII are split
  over byte tokens, so a token's text can be an incomplete character.
- `metaspace_bpe()`: SentencePiece style (Llama-2, Gemma): "▁" marks a word start, and the
  decoder drops the space before the first word, so a token's text depends on what precedes it.
- `byte_fallback_bpe()`: SentencePiece with byte fallback, decoded as Llama-2's, Mistral's and
  Gemma's converted tokenizers are (`Replace("▁", " ")`, `ByteFallback`, `Fuse`, `Strip`): a
  character outside the vocabulary is spelt as `<0xNN>` byte tokens, and a run of them that is
  not valid UTF-8 decodes as one U+FFFD per byte token.

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


BYTE_FALLBACK_WORDS = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "x", "▁", "a", "b", "é"]


def byte_fallback_bpe() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import normalizers

    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for word in BYTE_FALLBACK_WORDS:
        vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return _wrap(tokenizer)
