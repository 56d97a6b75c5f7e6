"""What `LLM.generate` and `LLM.chat` accept (vLLM's forms), checked and turned into token ids.

A prompt is text, `"..."` or `{"prompt": "..."}` (tokenized with the tokenizer's special
tokens, e.g. its BOS), or token ids, `[1, 2, 3]` or `{"prompt_token_ids": [...]}` (a list, a
tensor or an array; a dict with both keys runs the ids and reports the text). `generate` takes
one prompt or a list of them.

A chat is one conversation (a list of `{"role": ..., "content": ...}` messages; a content may be
a list of `{"type": "text", "text": ...}` parts) or a list of conversations. The chat template
renders each to text, which is tokenized without special tokens: the template writes its own
BOS, and a second one would change what the model sees (vLLM does the same).

Each function raises `InvalidRequestError` (or `NoTokenizerError`) for one bad prompt or
conversation; `LLM` collects those of a batch into one `InvalidRequestsError`.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hybrid_cache.errors import InvalidRequestError, NoTokenizerError

PROMPT_KEYS: tuple[str, ...] = ("prompt", "prompt_token_ids")
PROMPT_FORMS = "a string, a list of token ids, {'prompt': str} or {'prompt_token_ids': [...]}"


@dataclass(frozen=True)
class ParsedPrompt:
    """One prompt: its text (None for token ids alone) and its token ids (None: tokenize the
    text)."""

    text: Optional[str]
    token_ids: Optional[list[int]]


def split_prompts(prompts: Any) -> list[Any]:
    """The batch `generate(prompts)` runs: a single prompt (text, a dict, or a list of token
    ids) becomes a batch of one; a list of prompts is the batch."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if hasattr(prompts, "tolist"):  # a tensor or an array: one row of ids, or a row per prompt
        prompts = prompts.tolist()
    if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        if prompts and all(is_token_id(item) for item in prompts):
            return [list(prompts)]
        return list(prompts)
    raise InvalidRequestError(
        f"prompts must be a prompt or a list of them ({PROMPT_FORMS}), got {type(prompts).__name__}"
    )


def parse_prompt(prompt: Any) -> ParsedPrompt:
    """One prompt in any accepted form (see the module)."""
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if isinstance(prompt, Mapping):
        unknown = sorted(str(key) for key in prompt if key not in PROMPT_KEYS)
        if unknown:
            raise InvalidRequestError(
                f"unsupported prompt key(s) {', '.join(unknown)}: a prompt dict has "
                f"'prompt' (text) or 'prompt_token_ids'"
            )
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise InvalidRequestError(f"'prompt' must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            return ParsedPrompt(text, token_ids_of(prompt["prompt_token_ids"]))
        if text is None:
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return ParsedPrompt(text, None)
    if hasattr(prompt, "tolist") or (
        isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray))
    ):
        return ParsedPrompt(None, token_ids_of(prompt))
    raise InvalidRequestError(f"a prompt is {PROMPT_FORMS}; got {type(prompt).__name__}")


def is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def token_ids_of(value: Any) -> list[int]:
    """Token ids as a list of ints (from a list, a tensor or an array); the range is the
    engine's to check (it knows the vocabulary)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if (
        not isinstance(value, Sequence)
        or isinstance(value, (str, bytes, bytearray))
        or not all(is_token_id(item) for item in value)
    ):
        raise InvalidRequestError("prompt_token_ids must be a list of ints")
    return [int(item) for item in value]


def tokenize_prompt(prompt: Any, tokenizer: Any) -> tuple[Optional[str], list[int]]:
    """One prompt's text (None for ids alone) and ids: as given, or the text tokenized with
    the tokenizer's special tokens (its BOS)."""
    parsed = parse_prompt(prompt)
    if parsed.token_ids is not None:
        return parsed.text, parsed.token_ids
    if tokenizer is None:
        raise NoTokenizerError(
            "this model has no tokenizer: pass {'prompt_token_ids': [...]} instead of text"
        )
    return parsed.text, list(tokenizer.encode(parsed.text))


# ---------------------------------------------------------------------------------------------
# Chat.


def split_conversations(messages: Any) -> list[Any]:
    """The conversations of `chat(messages)`: one (a list of messages) or a list of them."""
    if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidRequestError(
            "messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) "
            f"or a list of conversations, got {type(messages).__name__}"
        )
    if messages and all(
        isinstance(item, Sequence) and not isinstance(item, (str, Mapping)) for item in messages
    ):
        return list(messages)
    return [messages]


def check_conversation(conversation: Any) -> list[dict[str, Any]]:
    """The conversation as a list of message dicts (text parts of a content list joined with
    newlines), or `InvalidRequestError` naming the bad message."""
    if not isinstance(conversation, Sequence) or isinstance(conversation, (str, Mapping)):
        raise InvalidRequestError(
            f"a conversation is a list of messages, got {type(conversation).__name__}"
        )
    if not conversation:
        raise InvalidRequestError("the conversation has no messages")
    checked = []
    for number, message in enumerate(conversation):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"message {number} must be a dict with 'role' and 'content', got "
                f"{type(message).__name__}"
            )
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"message {number} needs a 'role' string")
        message = dict(message)
        content = message.get("content")
        if isinstance(content, Sequence) and not isinstance(content, str):
            message["content"] = _join_text_parts(content, number)
        elif content is not None and not isinstance(content, str):
            raise InvalidRequestError(
                f"message {number}: 'content' must be a string or a list of text parts, got "
                f"{type(content).__name__}"
            )
        checked.append(message)
    return checked


def _join_text_parts(parts: Sequence[Any], number: int) -> str:
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type") == "text":
            if not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"message {number}: a text part needs a 'text' string")
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequestError(
                f"message {number}: content part {kind!r} is not supported (text only)"
            )
    return "\n".join(texts)


def resolve_chat_template(tokenizer: Any, chat_template: Optional[str]) -> str:
    """The template a chat renders with: `chat_template` (a Jinja string, or a file holding
    one) or the tokenizer's own. `NoTokenizerError` without a tokenizer, `InvalidRequestError`
    when neither gives a template."""
    if tokenizer is None:
        raise NoTokenizerError(
            "chat needs the model's tokenizer, and this model has none (a preset, or a folder "
            "without tokenizer files): use generate() with token ids"
        )
    if chat_template is not None:
        if not isinstance(chat_template, str):
            raise InvalidRequestError(
                f"chat_template must be a string, got {type(chat_template).__name__}"
            )
        if "{" not in chat_template:  # not a template: a path
            path = Path(chat_template)
            try:
                return path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise InvalidRequestError(
                    f"chat_template {chat_template!r} is neither a Jinja template nor a "
                    f"readable file ({error})"
                ) from error
        return chat_template
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequestError(
            "the tokenizer has no chat template: pass chat_template= (a Jinja template or a "
            "file; --chat-template on the command line), or use generate() with the text"
        )
    return template


def render_chat(
    tokenizer: Any,
    conversation: Any,
    chat_template: str,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: Optional[list[Any]],
    chat_template_kwargs: Optional[Mapping[str, Any]],
) -> tuple[str, list[int]]:
    """The conversation rendered by the template, and its ids (no special tokens added)."""
    messages = check_conversation(conversation)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **dict(chat_template_kwargs or {}),
        )
    except Exception as error:  # jinja2's errors, and the template's own raise_exception
        raise InvalidRequestError(
            f"the chat template failed on this conversation: {type(error).__name__}: {error}"
        ) from error
    if not isinstance(text, str):
        raise InvalidRequestError(f"the chat template gave {type(text).__name__}, not text")
    return text, list(tokenizer.encode(text, add_special_tokens=False))
