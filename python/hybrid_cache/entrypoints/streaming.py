"""What a request has produced since it was last read: per sample, new tokens, text, logprobs.

`SampleStream` follows one sample (`Request`) on the engine thread. Each call to `delta` takes
the output tokens it has not sent, decodes them incrementally (a request with stop strings is
decoded as it runs already; others are fed to their detokenizer here), and returns the new
text. While a request with stop strings runs, the last `max(len(stop)) - 1` characters are
held back, since a stop string starting there would cut them from the final text; once it has
finished, the rest of the final text is sent. So the sent pieces always join to the
`RequestOutput` text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from hybrid_cache.engine.logprobs import TokenLogprobs
from hybrid_cache.engine.outputs import RequestOutput
from hybrid_cache.engine.request import Request


@dataclass
class SampleDelta:
    """New output of sample `index` (`n > 1`: one per sample). `logprobs` holds a row per new
    token when the params ask for logprobs (the chosen token first, then the top k)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[TokenLogprobs]] = None
    finish_reason: Optional[str] = None  # set on the sample's last delta
    stop_reason: Union[int, str, None] = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its constructor's arguments (the engine process sends one per request
        # and step): a third smaller and half the time to load of the default state dict.
        return (
            SampleDelta,
            (
                self.index,
                self.text,
                self.token_ids,
                self.logprobs,
                self.finish_reason,
                self.stop_reason,
            ),
        )

    def merge(self, later: SampleDelta) -> None:
        """Appends a later delta of the same sample."""
        self.text += later.text
        self.token_ids += later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        if later.finish_reason is not None:
            self.finish_reason = later.finish_reason
            self.stop_reason = later.stop_reason


@dataclass
class StreamOutput:
    """What `AsyncLLM.generate` yields: the samples with news, and on the last one (`finished`)
    the whole `RequestOutput` as `LLM.generate` returns it. `prompt_logprobs` (rows for prompt
    tokens 1.., when asked) come with the first output that has any."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    deltas: list[SampleDelta] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list[TokenLogprobs]] = None
    output: Optional[RequestOutput] = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            StreamOutput,
            (
                self.request_id,
                self.prompt,
                self.prompt_token_ids,
                self.deltas,
                self.finished,
                self.num_cached_tokens,
                self.prompt_logprobs,
                self.output,
            ),
        )

    def merge(self, later: StreamOutput) -> None:
        """Folds a later output of the same request into this one (a consumer that fell
        behind reads several steps at once)."""
        by_index = {delta.index: delta for delta in self.deltas}
        for delta in later.deltas:
            if delta.index in by_index:
                by_index[delta.index].merge(delta)
            else:
                self.deltas.append(delta)
                by_index[delta.index] = delta
        self.deltas.sort(key=lambda delta: delta.index)
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.output = later.output


class SampleStream:
    """What sample `index` has sent so far (see the module)."""

    def __init__(self, index: int, request: Request) -> None:
        self.index: int = index
        self.num_tokens: int = 0
        self.num_chars: int = 0  # text sent
        self.num_pieces: int = 0  # detokenizer pieces moved into `pending`
        self.pending: str = ""  # decoded, held back
        stop = request.sampling_params.stop
        self.hold_back: int = max(map(len, stop)) - 1 if stop else 0
        self.wants_logprobs: bool = request.sampling_params.logprobs is not None
        self.done: bool = False

    def delta(self, request: Request) -> Optional[SampleDelta]:
        """The sample's output since the last call; None when there is nothing new."""
        if self.done:
            return None
        num_tokens = len(request.output_token_ids)
        finished = request.is_finished
        if num_tokens == self.num_tokens and not finished:
            return None
        text = self._new_text(request, finished)
        start, self.num_tokens = self.num_tokens, num_tokens
        delta = SampleDelta(
            self.index,
            text,
            request.output_token_ids[start:num_tokens],
            request.sample_logprob_rows(start, num_tokens) if self.wants_logprobs else None,
        )
        if finished:
            self.done = True
            assert request.finish_reason is not None
            delta.finish_reason = request.finish_reason.value
            delta.stop_reason = request.stop_reason
        return delta

    def _new_text(self, request: Request, finished: bool) -> str:
        detokenizer = request.detokenizer
        if detokenizer is None:
            return ""
        if finished:  # `finish_text` has run: the final text, cut at a stop string
            text = detokenizer.text[self.num_chars :]
            self.num_chars += len(text)
            self.pending = ""
            return text
        # Tokens not decoded yet (stop-string requests decode only the tokens that may
        # complete one as they run: the others cannot, so no search is needed here).
        unseen = request.output_token_ids[detokenizer.num_output_tokens :]
        if unseen:
            detokenizer.add_tokens(unseen)
        pieces = detokenizer.pieces
        if len(pieces) > self.num_pieces:
            self.pending += "".join(pieces[self.num_pieces :])
            self.num_pieces = len(pieces)
        cut = len(self.pending) - self.hold_back
        if cut <= 0:
            return ""
        text, self.pending = self.pending[:cut], self.pending[cut:]
        self.num_chars += len(text)
        return text
