"""Incremental detokenization and stop strings, per request.

Each call decodes only a small window: the tokens since the last emitted text (`read_offset`)
after the few before them (`prefix_offset`), and keeps the difference, so a token's text is
read in context (a leading space, a character split over byte tokens) without decoding the
whole output again. The window starts on the last prompt tokens, so the first output token is
read as the prompt's continuation. A window whose text ends in an incomplete character
(U+FFFD) waits for the next token.

With a byte-level decoder (GPT-2, Llama-3, Qwen style), a token whose bytes are whole
characters reads the same in any context that ends on a whole character: such tokens' texts are
decoded once per tokenizer (`context_free_texts`) and looked up instead of stepping the stream
decoder while it holds nothing back (the stream then sees only the other tokens, which a
byte-level decoder reads the same after any whole character).

Stop strings are looked for in the text each new token adds plus the `len(stop) - 1`
characters before it, and only when the new text holds the last character of some stop string
(a stop string cannot end in text without its last character).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Optional

from hybrid_cache.engine.sampling_params import SamplingParams

# Prompt tokens the first window starts on (as vLLM's detokenizer).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """The text of one request's output tokens, decoded a few tokens at a time."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        self.tokenizer: Any = tokenizer
        # A fast tokenizer's own `tokenizers.Tokenizer`: what its `decode` calls, without the
        # argument handling around it (several microseconds a call, twice per token).
        self.backend: Optional[Any] = getattr(tokenizer, "backend_tokenizer", None)
        self.skip_special_tokens: bool = params.skip_special_tokens
        self.spaces_between_special_tokens: bool = params.spaces_between_special_tokens
        self.stop: tuple[str, ...] = params.stop
        self.include_stop_str_in_output: bool = params.include_stop_str_in_output
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.num_context_tokens: int = len(context)
        self.token_ids: list[int] = context
        self.prefix_offset: int = 0
        self.read_offset: int = len(context)
        self.pieces: list[str] = []
        self.num_chars: int = 0
        # How many characters before the new text a stop string may start in.
        self.tail_chars: int = max(map(len, self.stop), default=1) - 1
        # The stop strings' last characters: new text without any completes none.
        self.stop_ends: frozenset[str] = frozenset(stop[-1] for stop in self.stop)
        self.truncate_at: Optional[int] = None  # where a matched stop string cuts the text
        # With a fast tokenizer, `tokenizers`' own stream decoder (one call of about half a
        # microsecond per token, primed with the context) replaces the two window decodes.
        self.stream: Optional[Any] = _decode_stream(self.backend, context, self.skip_special_tokens)
        self.num_unflushed: int = 0  # tokens the stream holds back (a character in pieces)
        # Token id -> its text, for the tokens any context reads alike (None for the others).
        self.texts: dict[int, Optional[str]] = (
            context_free_texts(tokenizer, self.backend, self.skip_special_tokens)
            if self.stream is not None
            else {}
        )

    @property
    def num_output_tokens(self) -> int:
        """Output tokens handed to the detokenizer so far."""
        return len(self.token_ids) - self.num_context_tokens

    @property
    def text(self) -> str:
        text = "".join(self.pieces)
        return text if self.truncate_at is None else text[: self.truncate_at]

    def add_tokens(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Decodes `token_ids` after the tokens so far; returns the text they complete ("" when
        it waits for more). `final`: the output ends here, an incomplete character is kept
        (as U+FFFD, as a full decode shows it)."""
        self.token_ids.extend(token_ids)
        if self.stream is not None:
            return self._add_streamed(token_ids, final)
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self.pieces.append(delta)
        self.num_chars += len(delta)
        return delta

    def _add_streamed(self, token_ids: Sequence[int], final: bool) -> str:
        chunks = []
        texts = self.texts
        for token_id in token_ids:
            chunk = None if self.num_unflushed else texts[token_id]
            if chunk is None:
                chunk = self.stream.step(self.backend, token_id)
            if chunk is None:
                self.num_unflushed += 1
            else:
                chunks.append(chunk)
                self.num_unflushed = 0
        if final and self.num_unflushed:
            # An incomplete character at the very end: as a full decode shows it.
            chunks.append(self._decode(self.token_ids[-self.num_unflushed :]))
            self.num_unflushed = 0
        delta = "".join(chunks)
        if delta:
            self.pieces.append(delta)
            self.num_chars += len(delta)
        return delta

    def add_token_and_match(self, token_id: int, check_stop: bool) -> Optional[str]:
        """Adds one token; returns the stop string its text completes, if any (only looked
        for when `check_stop`). A match cuts the text before the stop string, or after it
        with `include_stop_str_in_output`. Called once per token: the streamed case is
        inlined (`_add_streamed` for one token), and the search runs only when the new text
        holds a stop string's end."""
        stream = self.stream
        if stream is None:
            delta = self.add_tokens((token_id,))
        else:
            self.token_ids.append(token_id)
            delta = None if self.num_unflushed else self.texts[token_id]
            if delta is None:
                delta = stream.step(self.backend, token_id)
                if delta is None:
                    self.num_unflushed += 1
                    return None
                self.num_unflushed = 0
            if delta:
                self.pieces.append(delta)
                self.num_chars += len(delta)
        if not delta or not check_stop or self.stop_ends.isdisjoint(delta):
            return None
        return self._match(delta)

    def _match(self, delta: str) -> Optional[str]:
        """The first stop string (in the params' order) that ends in `delta`, the text just
        added (the last of `pieces`); sets `truncate_at` on a match."""
        tail = self._text_before_last(self.tail_chars)
        window = tail + delta
        start = self.num_chars - len(window)  # the window's first character in the text
        for stop in self.stop:
            # A match must end in the new text: earlier ones were looked for before.
            index = window.find(stop, max(0, len(window) - len(delta) - len(stop) + 1))
            if index >= 0:
                end = start + index + (len(stop) if self.include_stop_str_in_output else 0)
                self.truncate_at = end
                return stop
        return None

    def _text_before_last(self, num_chars: int) -> str:
        """The last `num_chars` characters of the text before the last piece (fewer at the
        start of the text)."""
        if num_chars == 0:
            return ""
        parts: list[str] = []
        count = 0
        pieces = self.pieces
        for index in range(len(pieces) - 2, -1, -1):
            parts.append(pieces[index])
            count += len(pieces[index])
            if count >= num_chars:
                break
        return "".join(reversed(parts))[-num_chars:]

    def _decode(self, token_ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def _decode_stream(backend: Optional[Any], context: list[int], skip_special_tokens: bool) -> Any:
    """A `tokenizers.decoders.DecodeStream` primed with `context`; None without a fast
    tokenizer or with a `tokenizers` release that lacks it (the window decodes then).

    A context whose text ends in an incomplete character (a prompt of ids cut inside one) is
    primed without its last tokens up to a whole character: a stream primed on it would hand
    the context's whole text out with the first output token. The output then reads as the
    window decodes read it, after the prompt's text."""
    if backend is None:
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    end = len(context)
    while end and backend.decode(context[:end], skip_special_tokens=skip_special_tokens).endswith(
        REPLACEMENT_CHAR
    ):
        end -= 1
    try:
        return DecodeStream(ids=context[:end], skip_special_tokens=skip_special_tokens)
    except TypeError:
        return None


# Per tokenizer and skip_special_tokens: `context_free_texts` (forgotten with the tokenizer).
_context_free: weakref.WeakKeyDictionary[Any, dict[bool, "ContextFreeTexts"]] = (
    weakref.WeakKeyDictionary()
)


class ContextFreeTexts(dict[int, Optional[str]]):
    """Token id -> text for the tokens whose text is the same wherever they stand after a
    whole character, None for the others (`texts[token_id]`: a plain dict lookup once an id
    was seen). With a byte-level decoder alone: the vocabulary's tokens whose bytes are whole
    UTF-8 characters (their own decode holds no U+FFFD), and "" for tokens that decode to
    nothing (special ones when skipped, ids past the vocabulary). None for every id with any
    other decoder."""

    def __init__(self, texts: dict[int, Optional[str]], silent_from: Optional[int]) -> None:
        super().__init__(texts)
        self.silent_from = silent_from  # ids from here on decode to nothing (None: unknown)

    def __missing__(self, token_id: int) -> Optional[str]:
        silent = self.silent_from is not None and token_id >= self.silent_from
        text = "" if silent else None
        self[token_id] = text
        return text




def context_free_texts(
    tokenizer: Any, backend: Optional[Any], skip_special_tokens: bool
) -> ContextFreeTexts:
    """The tokenizer's `ContextFreeTexts` (decoded once per tokenizer and skip flag)."""
    per_flag = _context_free.setdefault(tokenizer, {})
    found = per_flag.get(skip_special_tokens)
    if found is not None:
        return found
    found = ContextFreeTexts({}, None)
    if backend is not None and _is_byte_level(backend.decoder):
        size = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        decoded = backend.decode_batch(
            [[token] for token in range(size + 1)], skip_special_tokens=skip_special_tokens
        )
        texts: dict[int, Optional[str]] = {}
        for token, text in enumerate(decoded[:size]):
            if token in added and not (text == "" and added[token].special):
                text = None  # an added token: decoded as its content, not as bytes
            texts[token] = None if text is None or REPLACEMENT_CHAR in text else text
        found = ContextFreeTexts(texts, size if decoded[size] == "" else None)
    per_flag[skip_special_tokens] = found
    return found


def _is_byte_level(decoder: Any) -> bool:
    try:
        from tokenizers.decoders import ByteLevel
    except ImportError:
        return False
    return isinstance(decoder, ByteLevel)
