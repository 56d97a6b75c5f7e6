"""`--compare-hf`: our engine against transformers' own continuous batching, same run.

Both sides get the same weights, prompts and greedy settings:

1. A transformers model is built from the preset's (or folder's) config with seeded random
   weights and saved with `save_pretrained` to a temporary folder.
2. Our engine loads that folder (`load_format="auto"`) and runs the workload (hybrid mode, the
   bench flags) — timed as in `engine_run.py`.
3. transformers runs the same token-id prompts with `model.generate_batch(...)` (its
   continuous batching; greedy, EOS disabled, `max_new_tokens = output_len`), with a paged
   cache sized to hold every request at once (`num_blocks`) and our `max_num_batched_tokens`
   as its `max_batch_tokens`. A one-prompt call first warms it up (untimed); the timed call
   includes its per-call manager setup, which its API does not let us exclude.

The report gives both total tokens/s, the ratio, and how many requests got identical tokens
(greedy on float32 random weights; a near-tie can flip a token, so this is information, not
the benchmark's purpose).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

from hybrid_cache.bench.engine_run import run_engine_mode
from hybrid_cache.bench.metrics import RunResult
from hybrid_cache.bench.settings import BenchSettings
from hybrid_cache.bench.workload import make_prompts
from hybrid_cache.config import load_model_spec

HF_PAGE_SIZE = 64


def save_hf_model(settings: BenchSettings, folder: Path) -> Any:
    """A seeded random-weight transformers model of the bench model's config, saved to
    `folder`; returns the model (eval mode, float32)."""
    import torch
    import transformers

    spec = load_model_spec(settings.model, settings.hf_overrides)
    fields = {k: v for k, v in spec.hf_config.items() if k not in ("architectures", "model_type")}
    config = transformers.AutoConfig.for_model(spec.model_type, **fields)
    config.architectures = [spec.architecture]
    torch.manual_seed(settings.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.save_pretrained(str(folder))
    return model


def run_hf_generate_batch(
    model: Any, prompts: list[list[int]], settings: BenchSettings
) -> tuple[float, list[list[int]]]:
    """Seconds for `generate_batch` over the prompts, and the generated tokens in order."""
    import logging

    from transformers import ContinuousBatchingConfig, GenerationConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    generation = GenerationConfig(
        max_new_tokens=settings.output_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    pages_per_request = -(-(settings.input_len + settings.output_len) // HF_PAGE_SIZE)
    batching = ContinuousBatchingConfig(
        page_size=HF_PAGE_SIZE,
        num_blocks=pages_per_request * len(prompts) + 1,
        max_batch_tokens=settings.max_num_batched_tokens,
        max_requests_per_batch=settings.max_num_seqs,
    )
    kwargs = dict(generation_config=generation, continuous_batching_config=batching)
    model.generate_batch(prompts[:1], **kwargs)  # warm-up, untimed
    started = time.perf_counter()
    outputs = model.generate_batch(prompts, **kwargs)
    elapsed = time.perf_counter() - started
    tokens = [list(output.generated_tokens) for output in outputs.values()]
    return elapsed, tokens


def compare_with_hf(settings: BenchSettings, progress: Any = None) -> dict[str, Any]:
    """Runs both engines on one model and workload; returns the figures (see module doc).
    `progress` (a tqdm bar for our run) is closed before transformers starts."""
    with tempfile.TemporaryDirectory(prefix="hybrid-cache-bench-") as tmp:
        folder = Path(tmp) / "model"
        hf_model = save_hf_model(settings, folder)
        ours_settings = dataclasses.replace(settings, model=str(folder), load_format="auto")
        try:
            ours: RunResult = run_engine_mode(ours_settings, "hybrid", progress)
        finally:
            if progress is not None:
                progress.close()
    prompts = make_prompts(
        settings.num_prompts,
        settings.input_len,
        settings.prefix_len,
        hf_model.config.get_text_config().vocab_size,
        settings.seed,
    )
    hf_seconds, hf_tokens = run_hf_generate_batch(hf_model, prompts, settings)
    total_tokens = ours.num_prompt_tokens + ours.num_output_tokens
    hf_total_per_s = total_tokens / hf_seconds if hf_seconds > 0 else 0.0
    return {
        "ours": ours,
        "hf_elapsed_s": hf_seconds,
        "hf_total_tokens_per_s": hf_total_per_s,
        "hf_output_tokens_per_s": ours.num_output_tokens / hf_seconds if hf_seconds else 0.0,
        "num_identical_outputs": sum(a == b for a, b in zip(ours.output_token_ids, hf_tokens)),
        "ratio": ours.total_tokens_per_s / hf_total_per_s if hf_total_per_s else None,
    }
