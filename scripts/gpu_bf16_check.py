"""Our engine in bfloat16 on CUDA against transformers in bfloat16 on CUDA, both measured from
transformers in float32: the comparison of tests/bf16_compare.py (prompt log-probabilities,
greedy tokens parting only at near-ties) for every architecture of tests/test_models_vs_hf.py,
with the attention backend CUDA picks (Triton without flash-attn). Prints each architecture's
median and largest errors and exits non-zero if any is out of bounds.

    python scripts/gpu_bf16_check.py [--output-json bf16.json]   # on a machine with CUDA
    python scripts/gpu_bf16_check.py --cpu-dry-run                # the script's logic on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402
from bf16_compare import MAX_ERROR, MEDIAN_RATIO, TIE, compare  # noqa: E402
from test_models_vs_hf import ARCHITECTURES  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="run on the CPU")
    parser.add_argument("--output-json", help="write every architecture's figures here")
    args = parser.parse_args()
    device = "cpu" if args.cpu_dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --cpu-dry-run to run the logic on the CPU)")
        return 2
    print(
        f"bf16 on {device}: errors are |logprob - transformers float32| per prompt position; "
        f"bounds: median <= {MEDIAN_RATIO} x transformers' bf16 median, max <= {MAX_ERROR}, "
        f"greedy picks parting within {TIE}"
    )
    print("| model | transformers bf16 median / max | ours median / max | tokens agreed | gap |")
    print("| --- | --- | --- | --- | --- |")
    results, failed = [], 0
    with tempfile.TemporaryDirectory() as folder:
        for name in ARCHITECTURES:
            started = time.perf_counter()
            figures = compare(name, Path(folder), device)
            summary = {**figures.summary(), "seconds": time.perf_counter() - started}
            results.append(summary)
            failed += bool(summary["failures"])
            print(
                f"| {name} | {summary['hf_median_error']:.4f} / {summary['hf_max_error']:.4f} "
                f"| {summary['our_median_error']:.4f} / {summary['our_max_error']:.4f} "
                f"| {summary['agreed_tokens']} | {max(summary['gaps_at_difference']):.3f} |"
                + (f" FAILED: {'; '.join(summary['failures'])}" if summary["failures"] else "")
            )
    print(f"{len(results) - failed}/{len(results)} architectures within bounds")
    if args.output_json:
        payload = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
        Path(args.output_json).write_text(json.dumps({**payload, "results": results}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
