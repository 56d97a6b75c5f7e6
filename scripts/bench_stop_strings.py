"""The per-token cost of a stop string: `Request.append_output_token` over the tokens of an
English text, with a stop string that never matches, decoding only the tokens that may
complete it (the engine's way, `engine/detokenizer.py` StopFlags) against decoding every token,
and without a stop string. Best of 7 runs each.

    python scripts/make_tokenizer.py /tmp/tok
    python scripts/bench_stop_strings.py --tokenizer /tmp/tok [--stop "User:"]
"""

from __future__ import annotations

import argparse
import time

import transformers
from hybrid_cache.engine.detokenizer import IncrementalDetokenizer
from hybrid_cache.engine.request import Request
from hybrid_cache.engine.sampling_params import SamplingParams

TEXT = (
    "once upon a time there was a small engine that cached what it had seen, and the cat sat"
    " on the mat while the quick brown fox jumped over the lazy dog near the old barn. "
)


def per_token_ns(tokenizer, tokens: list[int], stop: list[str], every_token: bool) -> float:
    best = float("inf")
    for _ in range(7):
        params = SamplingParams(stop=stop, max_tokens=len(tokens) + 1, ignore_eos=True)
        detokenizer = IncrementalDetokenizer(tokenizer, [1], params)
        if every_token:
            detokenizer.stop_flags = None
        request = Request("r", [1], params, 0, len(tokens) + 2, detokenizer=detokenizer)
        start = time.perf_counter()
        for token in tokens:
            request.append_output_token(token)
        best = min(best, time.perf_counter() - start)
    return best / len(tokens) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a byte-level tokenizer folder")
    parser.add_argument("--stop", default="User:")
    parser.add_argument("--repeat-text", type=int, default=40)
    args = parser.parse_args()
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    tokens = tokenizer.encode(TEXT * args.repeat_text, add_special_tokens=False)
    lazy = per_token_ns(tokenizer, tokens, [args.stop], every_token=False)
    eager = per_token_ns(tokenizer, tokens, [args.stop], every_token=True)
    none = per_token_ns(tokenizer, tokens, [], every_token=False)
    print(
        f"{len(tokens)} tokens, stop {args.stop!r}: {lazy:.0f} ns/token decoding only tokens "
        f"that may complete it, {eager:.0f} decoding every token ({eager / lazy:.2f}x), "
        f"{none:.0f} without a stop string"
    )


if __name__ == "__main__":
    main()
