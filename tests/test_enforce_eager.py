"""`enforce_eager` (LLM) / `--enforce-eager` (generate, bench): checked, and carried to the engine.

Without it, pure-decode steps on CUDA replay CUDA graphs (tests/test_decode_graphs.py compares
their tokens with eager steps'; scripts/gpu_engine_check.py on a GPU); with it the model runner
builds none.
"""

import argparse

import pytest
from hybrid_cache import LLM
from hybrid_cache.commands import bench as bench_command
from hybrid_cache.commands import generate as generate_command
from hybrid_cache.errors import EngineConfigError


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_enforce_eager_must_be_a_bool(value):
    with pytest.raises(EngineConfigError, match="enforce_eager must be True or False"):
        LLM("tiny-llama", enforce_eager=value, device="cpu", kv_cache_memory="1MiB")


def parser_with(register):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser


def test_the_bench_flag_reaches_the_engine():
    from hybrid_cache.bench.engine_run import build_llm

    parser = parser_with(bench_command.register)
    flags = ["bench", "--model", "tiny-llama", "--input-len", "8", "--output-len", "4"]
    flags += ["--num-prompts", "1", "--kv-cache-memory", "1MiB", "--max-model-len", "64"]
    for extra, expected in (([], False), (["--enforce-eager"], True)):
        args = parser.parse_args([*flags, *extra])
        settings = bench_command.settings_from_args(args, args.kv_cache_memory)
        assert settings.enforce_eager is expected
        assert build_llm(settings, "hybrid").enforce_eager is expected


def test_the_generate_flag_parses():
    parser = parser_with(generate_command.register)
    args = parser.parse_args(["generate", "--model", "tiny-llama", "--enforce-eager"])
    assert args.enforce_eager is True
    assert parser.parse_args(["generate", "--model", "tiny-llama"]).enforce_eager is False


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_the_flag_decides_whether_the_runner_builds_decode_graphs(enforce_eager, monkeypatch):
    from hybrid_cache.engine import model_runner

    built = []

    class Recorder:
        def __init__(self, model, kv_caches, block_sizes, max_model_len, max_batch, device):
            built.append((max_model_len, max_batch))

    monkeypatch.setattr(model_runner, "supports_decode_graphs", lambda model, device: True)
    monkeypatch.setattr(model_runner, "DecodeGraphs", Recorder)
    llm = LLM(
        "tiny-llama",
        enforce_eager=enforce_eager,
        device="cpu",
        kv_cache_memory="1MiB",
        max_model_len=64,
        max_num_seqs=5,
    )
    assert built == ([] if enforce_eager else [(64, 5)])
    assert (llm.engine.model_runner.decode_graphs is None) is enforce_eager
