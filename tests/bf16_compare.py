"""Our engine in bfloat16 against transformers in bfloat16, both measured from transformers in
float32 (the reference), on the tiny seeded models of `test_models_vs_hf`.

Two bf16 implementations never agree bit for bit (different kernels round differently), so the
check is the one vLLM's model tests make, plus an error budget:

- prompt: each prompt position's log-probability of the next prompt token (prompt logprobs, a
  teacher-forced pass); our error from the float32 reference should be of the size of
  transformers' own bf16 error (medians compared), with no position far off;
- greedy: our bf16 greedy tokens and transformers' bf16 greedy tokens agree up to their first
  difference, where the two tokens are near-tied on both sides: each side's pick is within
  `TIE` of the other side's best log-probability (vLLM asks for each in the other's top k; tiny
  random models have many near-equal logits, so a fixed k flags true ties).

Used by tests/test_bf16_vs_hf.py on the CPU and by scripts/gpu_bf16_check.py on a GPU.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.sampling_params import SamplingParams
from test_models_vs_hf import VOCAB, make_hf_model

# A short prompt and one past 256 positions (bf16 holds integers exactly only up to 256: a
# position or rotary angle rounded to bf16 shows there).
PROMPT_LENGTHS = (40, 300)
MAX_MODEL_LEN = 512
NEW_TOKENS = 16
TOP_K = 20  # our logprobs per step (the API's most); the other pick must be among them
TIE = 0.1  # log-probability gap under which two greedy picks count as tied
# Our median error at most this many times transformers' (plus `MEDIAN_SLACK`), and no
# position's error above `MAX_ERROR` (a mixture of experts may route a near-tied token to another
# expert in bf16: a few positions move by a few hundredths).
MEDIAN_RATIO = 2.0
MEDIAN_SLACK = 1e-3
MAX_ERROR = 0.25


@dataclass
class Bf16Figures:
    """One architecture's comparison; errors are absolute log-probability differences from the
    float32 reference, one per prompt position (all prompts together)."""

    name: str
    hf_errors: list[float] = field(default_factory=list)
    our_errors: list[float] = field(default_factory=list)
    # Per prompt: greedy tokens equal before the first difference (NEW_TOKENS when none), and
    # there the larger of the two sides' gaps (0 when none; inf when transformers' pick is not
    # in our top TOP_K).
    agreed_tokens: list[int] = field(default_factory=list)
    gaps_at_difference: list[float] = field(default_factory=list)

    @property
    def hf_median(self) -> float:
        return statistics.median(self.hf_errors)

    @property
    def our_median(self) -> float:
        return statistics.median(self.our_errors)

    @property
    def our_max(self) -> float:
        return max(self.our_errors)

    def failures(self) -> list[str]:
        """What is out of bounds, in words (empty when the comparison passes)."""
        out = []
        if not self.hf_median > 0:
            out.append("transformers' bf16 equals its float32: bf16 was not exercised")
        if self.our_median > MEDIAN_RATIO * self.hf_median + MEDIAN_SLACK:
            out.append(
                f"median error {self.our_median:.4f} > {MEDIAN_RATIO} x transformers' "
                f"{self.hf_median:.4f} + {MEDIAN_SLACK}"
            )
        if self.our_max > MAX_ERROR:
            out.append(f"max error {self.our_max:.4f} > {MAX_ERROR}")
        if max(self.gaps_at_difference) > TIE:
            out.append(
                f"greedy tokens part where the picks are {max(self.gaps_at_difference):.3f} apart "
                f"(ties are under {TIE})"
            )
        return out

    def summary(self) -> dict:
        return dict(
            name=self.name,
            hf_median_error=self.hf_median,
            our_median_error=self.our_median,
            hf_max_error=max(self.hf_errors),
            our_max_error=self.our_max,
            agreed_tokens=self.agreed_tokens,
            gaps_at_difference=self.gaps_at_difference,
            failures=self.failures(),
        )


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def next_token_logprobs(model: torch.nn.Module, prompt: list[int], device: str) -> torch.Tensor:
    """transformers' log-probability of each prompt token from the position before it."""
    logits = model(torch.tensor([prompt], device=device)).logits[0].float().cpu()
    rows = logits.log_softmax(dim=-1)[:-1]
    return rows.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], device: str):
    """transformers' greedy tokens and each step's log-probabilities (a row per step)."""
    generated = model.generate(
        torch.tensor([prompt], device=device),
        # Given, so that transformers does not take prompt tokens equal to pad_token_id for padding.
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = generated.sequences[0, len(prompt) :].tolist()
    rows = [logits[0].float().cpu().log_softmax(dim=-1) for logits in generated.logits]
    return tokens, rows


def gap_at_difference(ours: list[int], our_logprobs, theirs: list[int], their_rows) -> tuple:
    """(tokens equal before the first difference, the larger side's gap there): each side's
    best log-probability minus that of the other side's pick (0 without a difference)."""
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    if at == len(ours):
        return at, 0.0
    row, mine = their_rows[at], {t: entry.logprob for t, entry in our_logprobs[at].items()}
    their_gap = float(row.max() - row[ours[at]])
    our_gap = mine[ours[at]] - mine.get(theirs[at], float("-inf"))
    return at, max(their_gap, our_gap)


def compare(name: str, folder: Path, device: str, attention_backend: str = "auto") -> Bf16Figures:
    """`name`'s tiny model saved under `folder`, run by transformers (float32 and bf16) and by our
    engine (bf16, `attention_backend`) on `device`."""
    hf_model, path = make_hf_model(name, folder, max_position_embeddings=MAX_MODEL_LEN)
    hf_model.to(device)
    cases = prompts()
    references = [next_token_logprobs(hf_model, prompt, device) for prompt in cases]
    hf_model.to(torch.bfloat16)
    figures = Bf16Figures(name)
    llm = LLM(
        path,
        dtype="bfloat16",
        device=device,
        kv_cache_memory="4MiB",
        max_model_len=MAX_MODEL_LEN,
        block_size=16,
        max_num_batched_tokens=128,
        attention_backend=attention_backend,
    )
    assert llm.dtype == torch.bfloat16
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP_K, prompt_logprobs=0
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in cases], params, use_tqdm=False)
    for prompt, reference, output in zip(cases, references, outputs):
        theirs = next_token_logprobs(hf_model, prompt, device)
        ours = torch.tensor(
            [output.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        )
        figures.hf_errors += (theirs - reference).abs().tolist()
        figures.our_errors += (ours - reference).abs().tolist()
        hf_tokens, hf_rows = hf_greedy(hf_model, prompt, device)
        completion = output.outputs[0]
        at, gap = gap_at_difference(completion.token_ids, completion.logprobs, hf_tokens, hf_rows)
        figures.agreed_tokens.append(at)
        figures.gaps_at_difference.append(gap)
    llm.shutdown()
    return figures
