"""The request bodies of `/v1/completions` and `/v1/chat/completions`, checked strictly.

OpenAI's fields, plus vLLM's sampling extensions (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`skip_special_tokens`, `spaces_between_special_tokens`, chat template options) and
`return_token_ids` (token ids in every choice, and the prompt's ids in the response). Types are
strict (a string is not a number, `true` is not 1) and an unknown field is refused; ranges are
checked by `SamplingParams`. OpenAI fields this server does not implement are accepted only
at their "off" value (`unsupported_fields`), and a few informational ones are ignored.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

# Most choices (`n`, `best_of`) and logprobs per token one request may ask for.
MAX_CHOICES = 128
MAX_LOGPROBS = 20


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Body):
    include_usage: bool = False


class SamplingFields(Body):
    """The fields both endpoints share."""

    model: str
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extensions.
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_token_ids: bool = False

    def unsupported_fields(self) -> dict[str, Any]:
        """Fields set to something this server does not do (name -> value)."""
        return {"logit_bias": self.logit_bias} if self.logit_bias else {}


# A completion prompt: text, token ids, or a list of either (one choice set per prompt).
PromptField = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_CHOICES)
    suffix: Optional[str] = None
    add_special_tokens: bool = True

    def unsupported_fields(self) -> dict[str, Any]:
        fields = super().unsupported_fields()
        if self.suffix:
            fields["suffix"] = self.suffix
        return fields


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: Optional[dict[str, Any]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None
    prediction: Optional[dict[str, Any]] = None
    # Informational, ignored.
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    # vLLM's chat template options.
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False

    def unsupported_fields(self) -> dict[str, Any]:
        fields = super().unsupported_fields()
        for name in ("tools", "functions", "audio", "prediction"):
            if getattr(self, name):
                fields[name] = getattr(self, name)
        for name in ("tool_choice", "function_call"):
            value = getattr(self, name)
            if value is not None and value != "none":
                fields[name] = value
        if self.response_format is not None and self.response_format.get("type") != "text":
            fields["response_format"] = self.response_format
        if self.modalities is not None and list(self.modalities) != ["text"]:
            fields["modalities"] = self.modalities
        return fields
