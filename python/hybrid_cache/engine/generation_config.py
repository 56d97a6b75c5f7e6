"""The model's `generation_config.json`: end-of-sequence ids and default sampling values, applied
as vLLM applies them.

`generation_config` (an `EngineConfig` field, `--generation-config`) says where they come from:

- "auto" (the default): the model folder's `generation_config.json`, when it has one;
- "vllm": the engine's own sampling defaults (`SamplingParams()`); the folder's EOS ids still
  count, as in vLLM (a chat model's end-of-turn token is often listed only there);
- a folder holding a `generation_config.json` (or the file itself), read instead.

Its `eos_token_id` (an int or a list) joins the model's EOS set. Its sampling values
(`SAMPLING_KEYS`: `temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty`, and
`max_new_tokens` as `max_tokens`) become `LLM.get_default_sampling_params()`, the parameters of
a `generate` / `chat` call that passes none. A value `SamplingParams` has no field for is left
out and logged. Imports neither torch nor transformers.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hybrid_cache.checks import is_int
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.errors import ConfigError, EngineConfigError, InvalidSamplingParamsError

logger = logging.getLogger("hybrid_cache.engine.llm")

GENERATION_CONFIG_FILE = "generation_config.json"
GENERATION_CONFIG_MODES: tuple[str, ...] = ("auto", "vllm")
# generation_config.json key -> the SamplingParams field it sets (vLLM's list).
SAMPLING_KEYS: Mapping[str, str] = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    """What a model's generation config contributes: `source` (the file read, None when there
    is none), its EOS ids, the `SamplingParams` fields it sets (`sampling`), and the values
    this engine's `SamplingParams` has no field for (`ignored`, by file key)."""

    source: Optional[str] = None
    eos_token_ids: tuple[int, ...] = ()
    sampling: Mapping[str, Any] = field(default_factory=dict)
    ignored: Mapping[str, Any] = field(default_factory=dict)

    def sampling_params(self) -> SamplingParams:
        """`SamplingParams()` with this config's sampling values."""
        return SamplingParams(**self.sampling)


def check_generation_config(value: Any, hint: str = "") -> str:
    """`value` as `EngineConfig.generation_config`: "auto", "vllm", or an existing folder with a
    `generation_config.json` (or such a file); `EngineConfigError` otherwise."""
    fix = f"{hint}; use auto, vllm, or a folder holding {GENERATION_CONFIG_FILE}"
    if not isinstance(value, (str, os.PathLike)):
        raise EngineConfigError(f"--generation-config must be a string, got {value!r}{fix}")
    value = os.fspath(value)
    if value in GENERATION_CONFIG_MODES:
        return value
    path = Path(value)
    if path.is_file() or (path / GENERATION_CONFIG_FILE).is_file():
        return value
    what = f"the folder has no {GENERATION_CONFIG_FILE}" if path.is_dir() else "no such path"
    raise EngineConfigError(f"--generation-config {value!r}: {what}{fix}")


def generation_config_path(model: str, generation_config: str) -> Optional[Path]:
    """The file to read: the model folder's (for "auto" and "vllm", when the model is a folder
    with one), or the one `generation_config` names; None when there is none."""
    if generation_config in GENERATION_CONFIG_MODES:
        candidate = Path(model) / GENERATION_CONFIG_FILE
        return candidate if candidate.is_file() else None
    path = Path(generation_config)
    return path / GENERATION_CONFIG_FILE if path.is_dir() else path


def read_generation_defaults(model: str, generation_config: str = "auto") -> GenerationDefaults:
    """The `GenerationDefaults` of a model folder (or preset: none) under `generation_config`
    ("auto", "vllm" or a path; see the module). A malformed file or a value `SamplingParams`
    refuses raises `ConfigError` naming the file."""
    path = generation_config_path(model, generation_config)
    if path is None:
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"cannot read {path}: {error}{_fix(generation_config)}") from error
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object{_fix(generation_config)}")
    eos = _eos_ids(raw.get("eos_token_id"), path, generation_config)
    if generation_config == "vllm":
        return GenerationDefaults(str(path), eos)
    fields = set(inspect.signature(SamplingParams).parameters)
    sampling: dict[str, Any] = {}
    ignored: dict[str, Any] = {}
    for key, name in SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if name in fields:
            sampling[name] = value
        else:
            ignored[key] = value
    defaults = GenerationDefaults(str(path), eos, sampling, ignored)
    try:
        defaults.sampling_params()
    except InvalidSamplingParamsError as error:
        raise ConfigError(
            f"{path} sets a sampling value the engine refuses: {error}{_fix(generation_config)}"
        ) from error
    return defaults


def log_generation_defaults(defaults: GenerationDefaults, generation_config: str) -> None:
    """Logs (INFO) what the generation config changed: EOS ids and default sampling values."""
    if defaults.source is None:
        return
    if defaults.eos_token_ids:
        logger.info(
            "generation config %s: eos_token_id %s joins the EOS set",
            defaults.source,
            list(defaults.eos_token_ids),
        )
    if defaults.sampling:
        values = ", ".join(f"{name}={value}" for name, value in defaults.sampling.items())
        logger.info(
            "generation config %s: default sampling params %s (the params of a call that passes "
            "none; generation_config='vllm' keeps the engine's defaults)",
            defaults.source,
            values,
        )
    if defaults.ignored:
        values = ", ".join(f"{key}={value}" for key, value in defaults.ignored.items())
        logger.info(
            "generation config %s: %s not applied (SamplingParams has no such field)",
            defaults.source,
            values,
        )
    if generation_config == "vllm":
        logger.info("generation_config='vllm': the engine's default sampling params")


def _eos_ids(value: Any, path: Path, generation_config: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    if not all(is_int(item) and item >= 0 for item in values):
        raise ConfigError(
            f"{path}: eos_token_id must be a token id or a list of them, got {value!r}"
            f"{_fix(generation_config)}"
        )
    return tuple(values)


def _fix(generation_config: str) -> str:
    if generation_config in GENERATION_CONFIG_MODES:
        return "; fix the file, or pass --generation-config with another folder"
    return f"; fix the file or point --generation-config elsewhere (it is {generation_config!r})"
