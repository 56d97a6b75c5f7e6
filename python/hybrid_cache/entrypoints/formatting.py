"""Logprobs, usage and server-sent events in the OpenAI API's shapes.

A logprobs row (`engine/logprobs.py`) holds the chosen token first, then the top k. A token's
text is its own decode (`TokenTexts`, cached per id); without a tokenizer it is
`token_id:<id>`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Optional

from hybrid_cache.engine.logprobs import TokenLogprobs

DONE_EVENT = b"data: [DONE]\n\n"


class TokenTexts:
    """Each token id's own text, decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.texts.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id])
            self.texts[token_id] = text
        return text


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event holding `payload` as JSON."""
    return (
        b"data: "
        + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        + b"\n\n"
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _safe_logprob(value: float) -> float:
    """JSON has no -inf: a token the model gives no chance gets the lowest float instead."""
    return value if value > -1e38 else -9999.0


def completion_logprobs(
    rows: Sequence[Optional[TokenLogprobs]],
    texts: TokenTexts,
    text_offset: int,
    first_prompt_token: Optional[int] = None,
) -> dict[str, Any]:
    """`/v1/completions` logprobs of some tokens: their texts, logprobs, top tokens (the
    chosen one with them) and text offsets. A None row is the first prompt token of an echo
    (`first_prompt_token`), which has no logprob."""
    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: list[Optional[dict[str, float]]] = []
    offsets: list[int] = []
    for row in rows:
        offsets.append(text_offset)
        if row is None:
            text = "" if first_prompt_token is None else texts(first_prompt_token)
            tokens.append(text)
            token_logprobs.append(None)
            top_logprobs.append(None)
            text_offset += len(text)
            continue
        ids, values, _ = row
        text = texts(ids[0])
        tokens.append(text)
        token_logprobs.append(_safe_logprob(values[0]))
        top: dict[str, float] = {}
        for token_id, value in zip(ids, values):
            top.setdefault(texts(token_id), _safe_logprob(value))
        top_logprobs.append(top)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def merge_completion_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two `completion_logprobs` one after the other (an echoed prompt, then the output)."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(rows: Sequence[TokenLogprobs], texts: TokenTexts) -> dict[str, Any]:
    """`/v1/chat/completions` logprobs: per token its text, logprob, UTF-8 bytes and the top
    tokens (as many as the request's `top_logprobs`)."""
    content = []
    for ids, values, _ in rows:
        text = texts(ids[0])
        content.append(
            {
                "token": text,
                "logprob": _safe_logprob(values[0]),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": texts(token_id),
                        "logprob": _safe_logprob(value),
                        "bytes": list(texts(token_id).encode("utf-8")),
                    }
                    for token_id, value in zip(ids[1:], values[1:])
                ],
            }
        )
    return {"content": content}
