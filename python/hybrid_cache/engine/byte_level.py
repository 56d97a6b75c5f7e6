"""Byte-level BPE vocabularies (GPT-2, Llama-3, Qwen style) read without a decoder call.

A byte-level decoder maps each character of each token to one byte (GPT-2's byte table; a
token with a character outside it, such as an added token's, gives its UTF-8 bytes) and
decodes all the bytes together as UTF-8, each invalid sequence as U+FFFD. After text that ends
on a whole character, the next tokens therefore read as their own bytes decoded alone, which
Python's `bytes.decode("utf-8", "replace")` does as `tokenizers` does. `ByteLevelVocab` holds,
per token, its bytes and, for a token of whole characters, its text, so incremental decoding
(`detokenizer.py`) needs no call into the tokenizer per token.

The vocabulary is built once per tokenizer and skip_special_tokens flag, and only when every
token's bytes decode alone exactly as the tokenizer decodes that token (else None: the stream
decoder is used).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

REPLACEMENT_CHAR = "\ufffd"


def gpt2_byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: character -> the byte it stands for. Printable Latin-1
    bytes stand for themselves; the others (controls, space, soft hyphen...) for 256 + n in
    byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in printable:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


class TokenTexts(dict[int, Optional[str]]):
    """Token id -> its text where the token is whole characters ("" for one that decodes to
    nothing), else None: a plain dict lookup once an id was seen. Ids past the vocabulary
    decode to nothing."""

    def __init__(self, texts: dict[int, Optional[str]], size: int) -> None:
        super().__init__(texts)
        self.size = size

    def __missing__(self, token_id: int) -> Optional[str]:
        text = "" if token_id >= self.size else None
        self[token_id] = text
        return text


class ByteLevelVocab:
    """Per token id: `texts` (`TokenTexts`) and `token_bytes` (past the vocabulary: b"")."""

    def __init__(self, texts: TokenTexts, token_bytes: list[bytes]) -> None:
        self.texts = texts
        self.token_bytes = token_bytes

    def bytes_of(self, token_id: int) -> bytes:
        token_bytes = self.token_bytes
        return token_bytes[token_id] if token_id < len(token_bytes) else b""


# Per tokenizer and skip_special_tokens flag (forgotten with the tokenizer).
_vocabs: weakref.WeakKeyDictionary[Any, dict[bool, Optional[ByteLevelVocab]]] = (
    weakref.WeakKeyDictionary()
)


def byte_level_vocab(
    tokenizer: Any, backend: Optional[Any], skip_special_tokens: bool
) -> Optional[ByteLevelVocab]:
    """The tokenizer's `ByteLevelVocab` (built once), or None when its `tokenizers` backend
    does not decode with a byte-level decoder alone or a token does not decode as its bytes."""
    per_flag = _vocabs.setdefault(tokenizer, {})
    if skip_special_tokens not in per_flag:
        per_flag[skip_special_tokens] = _build(backend, skip_special_tokens)
    return per_flag[skip_special_tokens]


def _build(backend: Optional[Any], skip_special_tokens: bool) -> Optional[ByteLevelVocab]:
    if backend is None or not _is_byte_level(backend.decoder):
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    decoded = backend.decode_batch(
        [[token] for token in range(size + 1)], skip_special_tokens=skip_special_tokens
    )
    if decoded[size] != "":  # an id past the vocabulary must decode to nothing
        return None
    strings: list[Optional[str]] = [None] * size
    for string, token in backend.get_vocab(with_added_tokens=False).items():
        if token < size:
            strings[token] = string
    added = backend.get_added_tokens_decoder()
    byte_table = gpt2_byte_table()
    alphabet = byte_table.keys()
    translation = str.maketrans(byte_table)
    token_bytes: list[bytes] = []
    texts: dict[int, Optional[str]] = {}
    for token in range(size):
        string = strings[token]
        if token in added:
            string = added[token].content
            if skip_special_tokens and added[token].special:
                string = ""
        if string is None:
            return None
        if alphabet >= set(string):
            raw = string.translate(translation).encode("latin-1")
        else:
            raw = string.encode("utf-8")
        text = raw.decode("utf-8", "replace")
        if text != decoded[token]:
            return None
        token_bytes.append(raw)
        texts[token] = None if REPLACEMENT_CHAR in text else text
    return ByteLevelVocab(TokenTexts(texts, size), token_bytes)


def _is_byte_level(decoder: Any) -> bool:
    try:
        from tokenizers.decoders import ByteLevel
    except ImportError:
        return False
    return isinstance(decoder, ByteLevel)
