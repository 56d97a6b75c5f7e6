"""Incremental detokenization and stop strings, per request.

Each call decodes only a small window: the tokens since the last emitted text (`read_offset`)
after the few before them (`prefix_offset`), and keeps the difference, so a token's text is
read in context (a leading space, a character split over byte tokens) without decoding the
whole output again. The window starts on the last prompt tokens, so the first output token is
read as the prompt's continuation. A window whose text ends in an incomplete character
(U+FFFD) waits for the next token.

With a fast tokenizer, `tokenizers`' stream decoder replaces the window decodes; with a
byte-level one (GPT-2, Llama-3, Qwen style) each token's bytes and text come from a table
built once per tokenizer (`byte_level.py`) and the text is decoded in Python: a token of whole
characters adds its text, the others' bytes wait until they decode to text that does not end
in U+FFFD (as the stream decoder does), with no call into the tokenizer.

Stop strings are looked for in the text each new token adds plus the `len(stop) - 1`
characters before it, and only when the new text holds the last character of some stop string
(a stop string cannot end in text without its last character). With a byte-level vocabulary a
request does not even decode the tokens that cannot complete a stop string: a token of whole
characters completes one only where its text, up to an occurrence of a stop string's last
character, ends with that stop string's end; a token that is not whole characters (a
character split over byte tokens) completes one only if its bytes hold a stop string's last
byte, since a match ends on a character whose last byte is the stop string's (`StopFlags`, per
vocabulary and stop strings, filled as tokens are seen). Those tokens wait, undecoded, until a
token that may complete one comes, or the text is read; then the waiting tokens are decoded
together with it (`catch_up_and_match`): they hold no stop string's end, so the search finds
what a decode per token would have found. While the decoded text ends in an incomplete
character every token is decoded (the character's text comes out with a later token). A stop
string ending in U+FFFD makes every token decode: any token can end an invalid byte sequence
whose replacement character then completes it.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Optional

from hybrid_cache.engine.byte_level import (
    REPLACEMENT_CHAR,
    ByteLevelVocab,
    TokenTexts,
    byte_level_vocab,
)
from hybrid_cache.engine.sampling_params import SamplingParams

# Prompt tokens the first window starts on (as vLLM's detokenizer).
PROMPT_CONTEXT_TOKENS = 5
# Without a byte-level vocabulary no token's text is known ahead (every id: None).
NO_TEXTS = TokenTexts({}, size=1 << 62)
# What `tokenizers`' stream decoder says when a token makes the text so far decode differently
# (a SentencePiece byte-fallback group that turns invalid, e.g. <0xC3> <0xA9> <0xC3> then a word:
# "é" shown, then the three bytes decode as three U+FFFD). vLLM's users hit the same error.
INVALID_PREFIX = "Invalid prefix encountered"


class StreamBroken(Exception):
    """The stream decoder cannot go on for this request (`INVALID_PREFIX`): its later tokens
    take the window decodes, which re-read the text around each new token."""


# Stop-string sets whose `StopFlags` are kept per vocabulary (the least recently used go).
MAX_STOP_FLAG_SETS = 256


class StopFlags(dict[int, bool]):
    """Token id -> whether the token may complete one of `stop` (`may_complete` for a token
    of whole characters, `bytes_may_complete` for the others), filled on first sight of each
    id: a plain dict lookup afterwards."""

    def __init__(self, vocab: ByteLevelVocab, stop: tuple[str, ...]) -> None:
        super().__init__()
        self.vocab = vocab
        self.stop = stop
        self.last_bytes = frozenset(string.encode("utf-8")[-1] for string in stop)
        self.every_token = any(string.endswith(REPLACEMENT_CHAR) for string in stop)

    def __missing__(self, token_id: int) -> bool:
        text = self.vocab.texts[token_id]
        if self.every_token:
            flag = True
        elif text is None:
            flag = bytes_may_complete(self.vocab.bytes_of(token_id), self.last_bytes)
        else:
            flag = may_complete(text, self.stop)
        self[token_id] = flag
        return flag


def bytes_may_complete(raw: bytes, last_bytes: frozenset[int]) -> bool:
    """Whether a token of bytes `raw` that are not whole characters may complete a stop string
    whose UTF-8 ends in one of `last_bytes`: a match ends on a character whose last byte is the
    stop string's, and the characters a token completes end in its own bytes."""
    return not last_bytes.isdisjoint(raw)


def may_complete(text: Optional[str], stop: Sequence[str]) -> bool:
    """Whether a token whose own text is `text` (None: not whole characters) may complete one
    of `stop` when added after whole characters: some occurrence in `text` of a stop string's
    last character is preceded in `text` by that stop string's characters before it (as many
    as `text` has there)."""
    if text is None:
        return True
    for string in stop:
        last = string[-1]
        index = text.find(last)
        while index >= 0:
            length = min(len(string), index + 1)
            if text[index + 1 - length : index + 1] == string[len(string) - length :]:
                return True
            index = text.find(last, index + 1)
    return False


# Per byte-level vocabulary: stop strings -> their `StopFlags` (forgotten with the vocabulary).
_stop_flags: weakref.WeakKeyDictionary[ByteLevelVocab, OrderedDict[tuple[str, ...], StopFlags]] = (
    weakref.WeakKeyDictionary()
)


def stop_flags(vocab: ByteLevelVocab, stop: tuple[str, ...]) -> StopFlags:
    """The shared `StopFlags` of `stop` over `vocab`'s tokens."""
    per_vocab = _stop_flags.setdefault(vocab, OrderedDict())
    flags = per_vocab.get(stop)
    if flags is None:
        flags = per_vocab[stop] = StopFlags(vocab, stop)
        if len(per_vocab) > MAX_STOP_FLAG_SETS:
            per_vocab.popitem(last=False)
    else:
        per_vocab.move_to_end(stop)
    return flags


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
        # A byte-level tokenizer's token bytes and texts (no stream decoder then), else, with
        # a fast tokenizer, `tokenizers`' own stream decoder primed with the context (one
        # call of about half a microsecond per token) in place of the two window decodes.
        self.vocab: Optional[ByteLevelVocab] = byte_level_vocab(
            tokenizer, self.backend, self.skip_special_tokens
        )
        self.texts: dict[int, Optional[str]] = NO_TEXTS if self.vocab is None else self.vocab.texts
        self.pending: bytes = b""  # the bytes of the tokens held back (byte-level)
        self.stream: Optional[Any] = (
            None
            if self.vocab is not None
            else _decode_stream(self.backend, context, self.skip_special_tokens)
        )
        self.streamed: bool = self.vocab is not None or self.stream is not None
        self.num_unflushed: int = 0  # tokens held back (a character in pieces)
        # Which tokens may complete a stop string (None: every token is decoded as it comes).
        self.stop_flags: Optional[StopFlags] = (
            stop_flags(self.vocab, self.stop) if self.vocab is not None and self.stop else None
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
        if self.streamed:
            return self._add_streamed(token_ids, final)
        return self._add_windowed(final)

    def _add_windowed(self, final: bool) -> str:
        """The window decodes over the tokens after `read_offset` (all in `token_ids`)."""
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(REPLACEMENT_CHAR)):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self._show(delta)
        return delta

    def _add_streamed(self, token_ids: Sequence[int], final: bool) -> str:
        chunks = []
        texts = self.texts
        for index, token_id in enumerate(token_ids):
            chunk = None if self.num_unflushed else texts[token_id]
            if chunk is None:
                try:
                    chunk = self._step(token_id)
                except StreamBroken:
                    # This token and the ones after it (all in `token_ids` already) go
                    # through the window decodes, from the first one not shown yet.
                    earlier = "".join(chunks)
                    self._show(earlier)
                    current = len(self.token_ids) - (len(token_ids) - index)
                    self._leave_stream(current - self.num_unflushed)
                    return earlier + self._add_windowed(final)
            if chunk is None:
                self.num_unflushed += 1
            else:
                chunks.append(chunk)
                self.num_unflushed = 0
        if final and self.num_unflushed:
            # An incomplete character at the very end: as a full decode shows it.
            chunks.append(self._decode(self.token_ids[-self.num_unflushed :]))
            self.num_unflushed = 0
            self.pending = b""
        delta = "".join(chunks)
        self._show(delta)
        return delta

    def add_token_and_match(self, token_id: int, check_stop: bool) -> Optional[str]:
        """Adds one token; returns the stop string its text completes, if any (only looked
        for when `check_stop`). A match cuts the text before the stop string, or after it
        with `include_stop_str_in_output`. Called once per token: the streamed case is
        inlined (`_add_streamed` for one token), and the search runs only when the new text
        holds a stop string's end."""
        if not self.streamed:
            delta = self.add_tokens((token_id,))
        else:
            self.token_ids.append(token_id)
            delta = None if self.num_unflushed else self.texts[token_id]
            if delta is None:
                try:
                    delta = self._step(token_id)
                except StreamBroken:
                    self._leave_stream(len(self.token_ids) - 1 - self.num_unflushed)
                    return self._match_new(self._add_windowed(final=False), check_stop)
                if delta is None:
                    self.num_unflushed += 1
                    return None
                self.num_unflushed = 0
            if delta:  # `_show` and `_match_new` inlined: this runs once per token
                self.pieces.append(delta)
                self.num_chars += len(delta)
        if not delta or not check_stop or self.stop_ends.isdisjoint(delta):
            return None
        return self._match(delta)

    def catch_up_and_match(
        self, output_token_ids: Sequence[int], check_stop: bool
    ) -> Optional[str]:
        """Decodes the output tokens not decoded yet (the last of `output_token_ids` is the
        new one; the ones before it cannot complete a stop string, see the module docstring);
        returns the stop string the new text completes, if any (only looked for when
        `check_stop`)."""
        start = self.num_output_tokens
        if start == len(output_token_ids) - 1:
            return self.add_token_and_match(output_token_ids[-1], check_stop)
        return self._match_new(self.add_tokens(output_token_ids[start:]), check_stop)

    def _leave_stream(self, first_unshown: int) -> None:
        """Switches to the window decodes after the stream decoder broke: the text shown so
        far ends before `token_ids[first_unshown]` (the tokens held back since are decoded
        again, in their window)."""
        self.stream = None
        self.streamed = False
        self.num_unflushed = 0
        self.read_offset = first_unshown
        self.prefix_offset = max(0, first_unshown - PROMPT_CONTEXT_TOKENS)

    def _step(self, token_id: int) -> Optional[str]:
        """One token through the stream decoder, or its bytes after the held-back ones
        (byte-level): the text they complete, None while it ends in U+FFFD or is empty."""
        if self.vocab is None:
            try:
                return self.stream.step(self.backend, token_id)
            except Exception as error:  # tokenizers raises a bare Exception
                if INVALID_PREFIX not in str(error):
                    raise
                raise StreamBroken from error
        pending = self.pending + self.vocab.bytes_of(token_id)
        text = pending.decode("utf-8", "replace")
        if not text or text.endswith(REPLACEMENT_CHAR):
            self.pending = pending
            return None
        self.pending = b""
        return text

    def _show(self, text: str) -> None:
        """Appends `text` (if any) to the text shown so far."""
        if text:
            self.pieces.append(text)
            self.num_chars += len(text)

    def _match_new(self, delta: str, check_stop: bool) -> Optional[str]:
        """`_match` on the text just shown, when asked and when it holds a stop string's end."""
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
