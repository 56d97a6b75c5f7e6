"""`hybrid-cache generate`: run prompts through the engine from the shell.

Prompts are text (`--prompt`, needs a model folder with a tokenizer) or token ids
(`--prompt-token-ids 1,2,3`); with neither, `--num-prompts` random prompts of `--prompt-len`
token ids are generated (seeded), so a preset like `tiny-gemma3` runs end to end as a demo.
`--chat` sends each `--prompt` as one user message through the tokenizer's chat template.

The sampling flags not given take the model's generation config (`--generation-config`), else
the command's defaults (greedy, 32 tokens). Every flag is checked, and the prompts parsed,
before the model loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from typing import Any

from hybrid_cache.checks import check_positive_int
from hybrid_cache.engine.engine_config import (
    EngineConfig,
    add_engine_arguments,
    engine_config_from_args,
)
from hybrid_cache.engine.generation_config import read_generation_defaults
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.engine.tokenizer import has_tokenizer_files
from hybrid_cache.errors import InvalidRequestError, NoTokenizerError

# What a sampling flag means when neither it nor the generation config sets it.
DEFAULT_MAX_TOKENS = 32
DEFAULT_TEMPERATURE = 0.0  # greedy
SAMPLING_FLAGS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "n",
    "logprobs",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text or token ids with the engine (continuous batching, hybrid KV cache)",
        description="Runs prompts to completion and prints each output and the engine figures.",
    )
    add_engine_arguments(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeat)")
    parser.add_argument(
        "--prompt-token-ids", action="append", default=[], help="comma-separated ids (repeat)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="send each --prompt as one user message through the tokenizer's chat template",
    )
    parser.add_argument(
        "--chat-template",
        help="with --chat: a Jinja chat template, or a file holding one (default: the tokenizer's)",
    )
    parser.add_argument("--num-prompts", type=int, default=4, help="random prompts if none given")
    parser.add_argument("--prompt-len", type=int, default=32, help="length of random prompts")
    parser.add_argument(
        "--max-tokens",
        type=int,
        help=f"most tokens generated per prompt (default: the generation config's "
        f"max_new_tokens, else {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        help="0 = greedy (default: the generation config's, else 0)",
    )
    parser.add_argument(
        "--top-k", type=int, help="0 = no top-k filter (default: the generation config's, else 0)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        help="nucleus sampling mass, 1 = off (default: the generation config's, else 1)",
    )
    parser.add_argument("--min-p", type=float, help="drop tokens below min_p x the top one's")
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        help="> 1 discourages tokens of the prompt and output (default: the generation "
        "config's, else 1 = off)",
    )
    parser.add_argument(
        "--presence-penalty", type=float, help="subtracted from tokens the output has (0 = off)"
    )
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        help="subtracted per occurrence in the output (0 = off)",
    )
    parser.add_argument(
        "--min-tokens", type=int, help="no end-of-sequence or stop token before this many"
    )
    parser.add_argument("--n", type=int, help="samples per prompt (needs --temperature > 0)")
    parser.add_argument(
        "--logprobs", type=int, help="print the sampled tokens' logprobs (and this many top ones)"
    )
    parser.add_argument(
        "--stop", action="append", default=[], help="a stop string (repeat; needs a tokenizer)"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    params = sampling_params_from_args(args, config)
    prompts = build_prompts(args, config)

    from hybrid_cache.engine.llm import LLM

    if not args.json:
        # The engine logs its KV-cache plan at INFO; show it on stderr, above the outputs.
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    llm = LLM(config)
    use_tqdm = not args.json
    if args.chat:
        conversations = [[{"role": "user", "content": text}] for text in prompts]
        outputs = llm.chat(conversations, params, use_tqdm, chat_template=args.chat_template)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    stats = llm.engine.stats
    summary = {
        "num_steps": len(llm.step_stats),
        "num_preemptions": sum(step.num_preemptions for step in llm.step_stats),
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "max_used_blocks_per_group": stats.max_used_blocks_per_group,
        "num_blocks": llm.layout.num_blocks,
    }
    results = [
        {
            "prompt": output.prompt,
            "prompt_token_ids": output.prompt_token_ids,
            "token_ids": output.token_ids,
            "text": output.text,
            "finish_reason": output.finish_reason,
            "num_cached_tokens": output.num_cached_tokens,
            "completions": [
                {
                    "token_ids": completion.token_ids,
                    "text": completion.text,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                    "cumulative_logprob": completion.cumulative_logprob,
                }
                for completion in output.outputs
            ],
            "error": None
            if output.error is None
            else f"{type(output.error).__name__}: {output.error}",
        }
        for output in outputs
    ]
    if args.json:
        print(json.dumps({"outputs": results, "summary": summary}, indent=2))
    else:
        for index, result in enumerate(results):
            if result["error"]:
                print(f"[{index}] ({result['error']})")
                continue
            for number, completion in enumerate(result["completions"]):
                shown = completion["text"]
                shown = completion["token_ids"] if shown is None else shown
                detail = f"{completion['finish_reason']}, {len(completion['token_ids'])} tokens"
                if completion["cumulative_logprob"] is not None:
                    detail += f", logprob {completion['cumulative_logprob']:.3f}"
                label = f"[{index}]" if len(result["completions"]) == 1 else f"[{index}.{number}]"
                print(f"{label} ({detail}) {shown}")
        print(
            f"{summary['num_steps']} steps, {summary['num_preemptions']} preemptions, "
            f"prefix-cache hit rate {summary['prefix_cache_hit_rate']:.1%}, peak blocks per "
            f"group {summary['max_used_blocks_per_group']} of {summary['num_blocks'] - 1}"
        )
    return 1 if any(output.error is not None for output in outputs) else 0


def sampling_params_from_args(args: argparse.Namespace, config: EngineConfig) -> SamplingParams:
    """The flags given, over the generation config's values, over the command's defaults
    (`InvalidSamplingParamsError` for a bad value, before the model loads)."""
    defaults = read_generation_defaults(config.model, config.generation_config).sampling
    values: dict[str, Any] = {
        "max_tokens": DEFAULT_MAX_TOKENS,
        "temperature": DEFAULT_TEMPERATURE,
        **defaults,
    }
    values.update(
        {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    )
    values["seed"] = args.seed if values["temperature"] > 0 else None
    values["ignore_eos"] = args.ignore_eos
    if args.stop:
        if not has_tokenizer_files(config.tokenizer_source):
            raise NoTokenizerError(
                f"--stop matches text, and {config.model} has no tokenizer: use a model folder "
                "with tokenizer files, or --tokenizer"
            )
        values["stop"] = list(args.stop)
    return SamplingParams(**values)


def build_prompts(args: argparse.Namespace, config: EngineConfig) -> list[Any]:
    """The prompts the flags ask for (`InvalidRequestError` for a bad flag, before the model
    loads): the texts, the id lists, or seeded random ids."""
    if args.chat and (args.prompt_token_ids or not args.prompt):
        raise InvalidRequestError(
            "--chat sends --prompt texts as user messages: give --prompt, not --prompt-token-ids"
        )
    if args.chat_template is not None and not args.chat:
        raise InvalidRequestError("--chat-template applies with --chat only")
    if args.prompt and not has_tokenizer_files(config.tokenizer_source):
        raise NoTokenizerError(
            f"--prompt{' with --chat' if args.chat else ''} is text, and {config.model} has no "
            "tokenizer (a preset, or a folder without tokenizer files): use --prompt-token-ids"
        )
    prompts: list[Any] = list(args.prompt)
    for text in args.prompt_token_ids:
        prompts.append({"prompt_token_ids": parse_token_ids(text)})
    if prompts:
        return prompts
    check_positive_int(args.num_prompts, "--num-prompts", InvalidRequestError)
    check_positive_int(args.prompt_len, "--prompt-len", InvalidRequestError)
    vocab_size = config.model_spec().vocab_size
    generator = random.Random(args.seed)
    return [
        {"prompt_token_ids": [generator.randrange(3, vocab_size) for _ in range(args.prompt_len)]}
        for _ in range(args.num_prompts)
    ]


def parse_token_ids(text: str) -> list[int]:
    """`--prompt-token-ids 1,2,3` as ids; `InvalidRequestError` for anything else or none."""
    try:
        ids = [int(item) for item in text.split(",") if item.strip()]
    except ValueError as error:
        raise InvalidRequestError(
            f"--prompt-token-ids takes comma-separated ints, got {text!r}"
        ) from error
    if not ids:
        raise InvalidRequestError(f"--prompt-token-ids {text!r} holds no token ids")
    return ids
