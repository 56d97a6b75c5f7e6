"""Writes a small byte-level BPE tokenizer folder, trained here (no download), for presets.

Presets have random weights and no tokenizer; `--tokenizer DIR` gives them one, so text
features (stop strings, detokenized output) can be run and timed on them:

    python scripts/make_tokenizer.py --vocab-size 512 /tmp/tok
    hybrid-cache bench --model tiny-llama --tokenizer /tmp/tok --stop "@@" --logprobs 5 ...

The vocabulary (256 byte tokens, 3 special ones, merges up to `--vocab-size`) must not exceed
the model's; ids the tokenizer does not have decode to nothing.
"""

from __future__ import annotations

import argparse

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "the cat sat on the mat and the dog ran far away from the old barn",
    "a quick brown fox jumps over the lazy dog while the bird sings",
    "numbers 0123456789 and symbols ()[]{}<>+-*/=?!.,:;",
    "once upon a time there was a small engine that cached what it had seen",
]


def make_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 8, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="where to write the tokenizer files")
    parser.add_argument("--vocab-size", type=int, default=512, help="at most the model's")
    args = parser.parse_args()
    tokenizer = make_tokenizer(args.vocab_size)
    assert len(tokenizer) <= args.vocab_size, f"{len(tokenizer)} tokens > {args.vocab_size}"
    tokenizer.save_pretrained(args.folder)
    print(f"wrote a {len(tokenizer)}-token tokenizer to {args.folder}")


if __name__ == "__main__":
    main()
