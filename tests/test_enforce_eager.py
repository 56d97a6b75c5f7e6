"""`enforce_eager` (LLM) / `--enforce-eager` (generate, bench): checked, and carried to the engine.

Every step runs eagerly today (CUDA graphs for pure-decode steps are not built), so on the CPU
the flag changes nothing; the CUDA test compares the tokens of both settings and runs only where
a GPU is present.
"""

import argparse

import pytest
import torch
from hybrid_cache import LLM, SamplingParams
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


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="GPU-only: CUDA tokens with and without enforce_eager (tells once graphs exist)",
)
def test_cuda_tokens_do_not_depend_on_enforce_eager():
    prompts = [{"prompt_token_ids": list(range(3, 3 + length))} for length in (5, 40, 130, 7)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        llm = LLM(
            "tiny-gemma3",
            load_format="dummy",
            kv_cache_memory="16MiB",
            max_model_len=512,
            dtype="float32",
            device="cuda",
            seed=0,
            enforce_eager=eager,
        )
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[eager] = [output.token_ids for output in outputs]
    assert tokens[True] == tokens[False]
    assert all(len(generated) == 24 for generated in tokens[True])
