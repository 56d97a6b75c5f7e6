"""`hybrid-cache generate`: run prompts through the engine from the shell.

Prompts are text (`--prompt`, needs a model folder with a tokenizer) or token ids
(`--prompt-token-ids 1,2,3`); with neither, `--num-prompts` random prompts of `--prompt-len`
token ids are generated (seeded), so a preset like `tiny-gemma3` runs end to end as a demo.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from typing import Any

from hybrid_cache.config import ConfigError
from hybrid_cache.engine.engine_config import add_engine_arguments, engine_config_from_args


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
    parser.add_argument("--num-prompts", type=int, default=4, help="random prompts if none given")
    parser.add_argument("--prompt-len", type=int, default=32, help="length of random prompts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from hybrid_cache.engine.llm import LLM
    from hybrid_cache.engine.sampling_params import SamplingParams

    if not args.json:
        # The engine logs its KV-cache plan at INFO; show it on stderr, above the outputs.
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    llm = LLM(engine_config_from_args(args))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed if args.temperature > 0 else None,
        ignore_eos=args.ignore_eos,
    )
    prompts = build_prompts(args, llm.spec.vocab_size)
    outputs = llm.generate(prompts, params, use_tqdm=not args.json)
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
            shown = result["text"] if result["text"] is not None else result["token_ids"]
            detail = (
                result["error"] or f"{result['finish_reason']}, {len(result['token_ids'])} tokens"
            )
            print(f"[{index}] ({detail}) {shown}")
        print(
            f"{summary['num_steps']} steps, {summary['num_preemptions']} preemptions, "
            f"prefix-cache hit rate {summary['prefix_cache_hit_rate']:.1%}, peak blocks per "
            f"group {summary['max_used_blocks_per_group']} of {summary['num_blocks'] - 1}"
        )
    return 1 if any(output.error is not None for output in outputs) else 0


def build_prompts(args: argparse.Namespace, vocab_size: int) -> list[Any]:
    prompts: list[Any] = list(args.prompt)
    for text in args.prompt_token_ids:
        try:
            prompts.append({"prompt_token_ids": [int(t) for t in text.split(",") if t.strip()]})
        except ValueError as error:
            raise ConfigError(f"--prompt-token-ids takes comma-separated ints: {error}") from error
    if not prompts:
        generator = random.Random(args.seed)
        prompts = [
            {
                "prompt_token_ids": [
                    generator.randrange(3, vocab_size) for _ in range(args.prompt_len)
                ]
            }
            for _ in range(args.num_prompts)
        ]
    return prompts
