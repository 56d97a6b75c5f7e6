"""Our engine in bfloat16 against transformers in bfloat16 (tests/bf16_compare.py): prompt
log-probabilities as far from transformers' float32 as transformers' own bf16 ones are, and greedy
tokens that part only at near-ties. Every architecture on the CPU path; the ones with windows,
softcaps and sinks also through the Triton kernels (interpreted here; scripts/gpu_bf16_check.py
runs the same comparison on a GPU).

What it can see: lost precision (activations rounded through float8 below), a kernel wrong in
bf16, positions or windows off. What it cannot: a rounding-order choice (RMSNorm's rounding
before or after the weight, say) stays inside bf16's noise, here and on 12-layer models alike.
"""

from __future__ import annotations

import pytest
import torch
from bf16_compare import MAX_ERROR, TIE, Bf16Figures, compare, gap_at_difference
from hybrid_cache.engine.outputs import Logprob
from hybrid_cache.models import layers
from test_models_vs_hf import ARCHITECTURES

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_bf16_prompt_logprobs_and_greedy_tokens_match_transformers(name, tmp_path):
    figures = compare(name, tmp_path, "cpu")
    assert figures.failures() == [], figures.summary()
    assert len(figures.our_errors) == len(figures.hf_errors) == 40 - 1 + 300 - 1


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt_oss"])
def test_bf16_through_the_triton_kernels_matches_transformers(name, tmp_path):
    figures = compare(name, tmp_path, "cpu", attention_backend="triton")
    assert figures.failures() == [], figures.summary()


def test_the_comparison_sees_lost_precision(tmp_path, monkeypatch):
    """Every normalised activation rounded through float8 (4 fewer mantissa bits than bf16):
    the median error grows several times over transformers' and the comparison fails."""
    forward = layers.RMSNorm.forward

    def through_float8(self, x):
        return forward(self, x).to(torch.float8_e4m3fn).to(x.dtype)

    monkeypatch.setattr(layers.RMSNorm, "forward", through_float8)
    figures = compare("llama3", tmp_path, "cpu")
    assert figures.our_median > 3 * figures.hf_median
    assert any(failure.startswith("median error") for failure in figures.failures())


def test_greedy_picks_are_tied_only_within_the_gap():
    their_rows = [torch.tensor([-1.0, -1.02, -3.0]).log_softmax(0)] * 2
    ours = [{0: Logprob(-1.0, 1), 1: Logprob(-1.05, 2)}, {1: Logprob(-0.9, 1)}]
    # Equal first token; at the second, ours (1) is 0.02 below their best and theirs (0) is not
    # among our logprobs: no gap can be measured, so it counts as far apart.
    assert gap_at_difference([0, 1], ours, [0, 0], their_rows) == (1, float("inf"))
    ours[1][0] = Logprob(-0.95, 2)
    at, gap = gap_at_difference([0, 1], ours, [0, 0], their_rows)
    assert at == 1 and gap == pytest.approx(0.05)
    assert gap_at_difference([0, 0], ours, [0, 0], their_rows) == (2, 0.0)
    figures = Bf16Figures("x", [0.01], [0.01], [1], [TIE + 0.01])
    assert len(figures.failures()) == 1 and "apart" in figures.failures()[0]
    figures = Bf16Figures("x", [0.01], [MAX_ERROR + 0.1], [2], [0.0])
    assert [failure.split()[0] for failure in figures.failures()] == ["median", "max"]
