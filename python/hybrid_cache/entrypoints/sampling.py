"""A request body's `SamplingParams`: the fields it sets, over the model's generation-config
defaults (`LLM.get_default_sampling_params`), over the API's defaults (`SamplingParams`'s:
temperature 1, top_p 1, ...).

`max_tokens`: the request's; else the generation config's `max_new_tokens`; else the
endpoint's (`/v1/completions`: 16, as OpenAI; chat: what `max_model_len` leaves after the
prompt), at most what `max_model_len` leaves. A request whose own `max_tokens` does not fit
after its prompt is refused (`PromptTooLongError`), as OpenAI and vLLM do.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.entrypoints.protocol import SamplingFields
from hybrid_cache.errors import InvalidFieldError, InvalidSamplingParamsError, PromptTooLongError

# Request fields passed to `SamplingParams` under the same name, when set.
OPTIONAL_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
PLAIN_FIELDS = (
    "n",
    "seed",
    "min_tokens",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
)
COMPLETIONS_MAX_TOKENS = 16


def max_tokens_for(
    requested: Optional[int],
    defaults: Mapping[str, Any],
    endpoint_default: Optional[int],
    num_prompt_tokens: int,
    max_model_len: int,
) -> int:
    """The request's `max_tokens` (see the module)."""
    room = max_model_len - num_prompt_tokens
    if room <= 0:
        raise PromptTooLongError(
            f"the prompt has {num_prompt_tokens} tokens and this model's context "
            f"(max_model_len) is {max_model_len}: no room for one generated token; shorten it"
        )
    if requested is not None:
        if requested < 1:
            raise InvalidFieldError(f"max_tokens must be at least 1, got {requested}", "max_tokens")
        if requested > room:
            raise PromptTooLongError(
                f"this model's context (max_model_len) is {max_model_len} tokens, and the "
                f"request asks for {num_prompt_tokens + requested} ({num_prompt_tokens} in the "
                f"prompt, {requested} to generate): lower max_tokens or shorten the prompt"
            )
        return requested
    default = defaults.get("max_tokens", endpoint_default)
    return room if default is None else min(default, room)


def sampling_params(
    body: SamplingFields,
    defaults: Mapping[str, Any],
    max_tokens: int,
    logprobs: Optional[int],
    prompt_logprobs: Optional[int] = None,
    best_of: Optional[int] = None,
) -> SamplingParams:
    """The body's params (`InvalidFieldError` naming the field for a value out of range)."""
    values: dict[str, Any] = {k: v for k, v in defaults.items() if k != "max_tokens"}
    for name in OPTIONAL_FIELDS:
        value = getattr(body, name)
        if value is not None:
            values[name] = value
    for name in PLAIN_FIELDS:
        values[name] = getattr(body, name)
    stop = body.stop
    values.update(
        max_tokens=max_tokens,
        stop=[stop] if isinstance(stop, str) else list(stop or ()),
        stop_token_ids=list(body.stop_token_ids or ()),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        best_of=best_of,
    )
    try:
        return SamplingParams(**values)
    except InvalidSamplingParamsError as error:
        message = str(error)
        field = next((name for name in values if message.startswith(name + " ")), None)
        raise InvalidFieldError(message, field) from error
