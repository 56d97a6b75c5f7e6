"""`EngineConfig`: each bad field is a typed error naming its flag and `LLM` argument, the
shared command-line flags give the same config as the keyword form, and `LLM` exposes it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from hybrid_cache.commands import bench as bench_command
from hybrid_cache.commands import generate as generate_command
from hybrid_cache.commands import plan as plan_command
from hybrid_cache.engine.engine_config import (
    DEFAULT_MAX_NUM_SEQS,
    EngineConfig,
    add_engine_arguments,
    engine_config_from_args,
    parse_hf_overrides,
)
from hybrid_cache.errors import (
    ConfigError,
    EngineConfigError,
    InvalidBlockSizeError,
    MemorySizeError,
    PlanError,
)
from hybrid_cache.planner import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_BATCHED_TOKENS


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("model", 3, EngineConfigError),
        ("load_format", "pt", EngineConfigError),
        ("hf_overrides", [1], ConfigError),
        ("kv_cache_memory", "lots", MemorySizeError),
        ("max_model_len", 0, PlanError),
        ("block_size", 24, InvalidBlockSizeError),
        ("block_size", True, InvalidBlockSizeError),
        ("kv_cache_mode", "paged", PlanError),
        ("kv_group_layout", "by-size", PlanError),
        ("max_num_seqs", 0, EngineConfigError),
        ("max_num_batched_tokens", -4, PlanError),
        ("enable_prefix_caching", "yes", EngineConfigError),
        ("dtype", "int4", ConfigError),
        ("seed", 1.5, EngineConfigError),
        ("attention_backend", None, EngineConfigError),
        ("gpu_memory_utilization", 1.5, EngineConfigError),
        ("gpu_memory_utilization", 0, EngineConfigError),
    ],
)
def test_each_bad_field_is_a_typed_error_naming_it(field, value, error):
    arguments = {"model": "tiny-llama", field: value}
    with pytest.raises(error) as caught:
        EngineConfig(**arguments)
    message = str(caught.value)
    assert "--" + field.replace("_", "-") in message, message
    assert f"LLM argument {field}" in message, message
    if error is PlanError or error is InvalidBlockSizeError:
        assert isinstance(caught.value, EngineConfigError), "a plan option is an engine argument"


def test_defaults_and_normalisation():
    config = EngineConfig("tiny-llama", kv_cache_memory="1MiB", hf_overrides={}, dtype=None)
    assert config.block_size == DEFAULT_BLOCK_SIZE
    assert config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert config.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert config.kv_cache_memory == 1024**2 and config.hf_overrides is None
    assert config.dtype == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.block_size = 32  # type: ignore[misc]


def test_of_takes_keywords_or_a_config_and_refuses_unknown_names():
    config = EngineConfig.of("tiny-llama", max_num_seqs=4)
    assert EngineConfig.of(config) is config
    assert EngineConfig.of(config, seed=3) == dataclasses.replace(config, seed=3)
    with pytest.raises(EngineConfigError, match="blok_size"):
        EngineConfig.of("tiny-llama", blok_size=16)


FLAGS = [
    "--model",
    "tiny-gemma3",
    "--kv-cache-memory",
    "2MiB",
    "--max-model-len",
    "128",
    "--block-size",
    "8",
    "--kv-group-layout",
    "equal",
    "--max-num-seqs",
    "3",
    "--max-num-batched-tokens",
    "64",
    "--hf-overrides",
    '{"sliding_window": 32}',
    "--seed",
    "5",
    "--attention-backend",
    "reference",
]
KEYWORDS = dict(
    kv_cache_memory="2MiB",
    max_model_len=128,
    block_size=8,
    kv_group_layout="equal",
    max_num_seqs=3,
    max_num_batched_tokens=64,
    hf_overrides={"sliding_window": 32},
    seed=5,
    attention_backend="reference",
)


def command_args(module, argv):
    parser = argparse.ArgumentParser()
    module.register(parser.add_subparsers())
    return parser.parse_args(argv)


def test_generate_flags_give_the_keyword_config():
    args = command_args(generate_command, ["generate", *FLAGS, "--no-prefix-caching"])
    expected = EngineConfig("tiny-gemma3", enable_prefix_caching=False, **KEYWORDS)
    assert engine_config_from_args(args) == expected
    defaults = command_args(generate_command, ["generate", "--model", "tiny-gemma3"])
    assert engine_config_from_args(defaults) == EngineConfig("tiny-gemma3")


def test_bench_flags_give_the_keyword_config():
    argv = ["bench", *FLAGS, "--output-len", "4", "--input-len", "8", "--num-prompts", "1"]
    args = command_args(bench_command, [*argv, "--no-enable-prefix-caching"])
    config = engine_config_from_args(args, kv_cache_mode="uniform")
    expected = EngineConfig(
        "tiny-gemma3",
        load_format="dummy",
        kv_cache_mode="uniform",
        enable_prefix_caching=False,
        **KEYWORDS,
    )
    assert config == expected
    settings = bench_command.settings_from_args(args, args.kv_cache_memory)
    assert settings.engine_config("uniform") == expected


def test_plan_flags_give_the_plan_options_of_the_keyword_config():
    argv = ["plan", "--model", "tiny-gemma3", "--kv-cache-memory", "2MiB", "--block-size", "8"]
    args = command_args(plan_command, [*argv, "--kv-cache-mode", "uniform"])
    config = engine_config_from_args(args)
    assert config == EngineConfig(
        "tiny-gemma3", kv_cache_memory="2MiB", block_size=8, kv_cache_mode="uniform"
    )
    assert not hasattr(args, "max_num_seqs"), "plan takes the model and plan options only"


def test_hf_overrides_are_parsed_once_with_one_error_type():
    assert parse_hf_overrides(None) is None
    assert parse_hf_overrides('{"a": {"b": 1}}') == {"a": {"b": 1}}
    for text in ("{oops", "[1]"):
        with pytest.raises(ConfigError, match="--hf-overrides must be a JSON object"):
            parse_hf_overrides(text)


def test_command_defaults_override_the_fields():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, load_format="dummy", max_num_seqs=7)
    config = engine_config_from_args(parser.parse_args(["--model", "tiny-llama"]))
    assert (config.load_format, config.max_num_seqs) == ("dummy", 7)


def test_llm_builds_and_exposes_its_config():
    from hybrid_cache.engine.llm import LLM

    llm = LLM("tiny-llama", kv_cache_memory="256KiB", max_model_len=64, max_num_seqs=2)
    assert llm.config == EngineConfig(
        "tiny-llama", kv_cache_memory="256KiB", max_model_len=64, max_num_seqs=2
    )
    assert llm.engine.kv_cache.max_num_seqs == 2 and llm.max_model_len == 64
    again = LLM(llm.config, seed=1)
    assert again.config == dataclasses.replace(llm.config, seed=1)
