"""Sampler: greedy, temperature, top-k / top-p filters, seeded determinism."""

from __future__ import annotations

import pytest
import torch
from hybrid_cache.engine.errors import InvalidSamplingParamsError
from hybrid_cache.engine.sampler import Sampler, apply_top_k_top_p
from hybrid_cache.engine.sampling_params import SamplingParams


def test_greedy_takes_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=0.0)] * 2
    assert Sampler().sample(logits, ["a", "b"], params).tolist() == [1, 0]


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    masked = apply_top_k_top_p(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 0.85]))
    kept = torch.isfinite(masked)
    assert kept[0].tolist() == [True, True, False, False]  # top-2
    assert kept[1].tolist() == [True, True, False, False]  # 0.5 + 0.3 reaches 0.7
    assert kept[2].tolist() == [True, True, True, False]  # needs 0.95 to pass 0.85
    assert torch.equal(masked[kept], logits[kept])


def test_top_k_one_is_greedy():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=1.5, top_k=1)] * 4
    tokens = Sampler(seed=3).sample(logits, list("abcd"), params)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_seeded_requests_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0)
    alone = Sampler().sample(logits[1:2], ["x"], [seeded]).item()
    sampler = Sampler(seed=7)
    batched = sampler.sample(logits, ["p", "x", "q"], [other, seeded, other])
    assert batched[1].item() == alone
    # The generator advances: a second draw comes from the next state, reproducibly.
    second = sampler.sample(logits[1:2], ["x"], [seeded]).item()
    fresh = Sampler()
    fresh.sample(logits[1:2], ["x"], [seeded])
    assert fresh.sample(logits[1:2], ["x"], [seeded]).item() == second


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = torch.log(probs).expand(4000, 4).contiguous()
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens = Sampler(seed=1).sample(logits, [str(i) for i in range(4000)], params)
    counts = torch.bincount(tokens, minlength=4).float() / 4000
    assert counts[3] == 0
    assert torch.allclose(counts, probs, atol=0.03)


def test_free_forgets_generator():
    sampler = Sampler()
    sampler.sample(torch.zeros(1, 5), ["r"], [SamplingParams(seed=1)])
    assert "r" in sampler.generators
    sampler.free("r")
    assert "r" not in sampler.generators


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": 2.5},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"seed": "x"},
        {"stop_token_ids": [-3]},
        {"stop_token_ids": 7},
        {"stop_token_ids": "7"},
    ],
)
def test_invalid_sampling_params_raise_typed_error(kwargs):
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(**kwargs)


def test_invalid_sampling_params_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(top_p=2.0)


def test_sampling_params_normalise_stop_token_ids():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    params = SamplingParams(stop_token_ids=[4, 5])
    assert params.stop_token_ids == (4, 5) and hash(params) == hash(
        SamplingParams(stop_token_ids=(4, 5))
    )
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams(temperature=0.5).is_greedy
