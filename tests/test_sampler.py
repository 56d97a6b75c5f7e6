"""Sampler: greedy, temperature, top-k / top-p / min-p filters, penalties, min_tokens, seeded
determinism, logprobs; SamplingParams validation; incremental detokenization and stop strings."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hybrid_cache.engine import logprobs as logprobs_module
from hybrid_cache.engine.detokenizer import IncrementalDetokenizer
from hybrid_cache.engine.errors import InvalidSamplingParamsError
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.logprobs import chosen_rank, greedy_token_logprobs, token_logprobs
from hybrid_cache.engine.penalties import apply_min_p, apply_penalties
from hybrid_cache.engine.request import FinishReason, Request
from hybrid_cache.engine.sampler import Sampler, apply_top_k_top_p, greedy_tokens
from hybrid_cache.engine.sampling_params import SamplingParams
from tiny_tokenizers import byte_level_bpe, metaspace_bpe


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
        {"top_k": -2},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"seed": "x"},
        {"seed": 2**63},
        {"seed": -(2**63) - 1},
        {"seed": 2**63 - 1, "n": 2, "temperature": 1.0},  # sample 1 would use 2**63
        {"stop_token_ids": [-3]},
        {"stop_token_ids": 7},
        {"stop_token_ids": "7"},
    ],
)
def test_invalid_sampling_params_raise_typed_error(kwargs):
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(**kwargs)


def test_the_extreme_seeds_sample():
    """The seed range's ends are seeds a torch generator takes (beyond them it overflows)."""
    for seed in (-(2**63), 2**63 - 1):
        tokens = Sampler().sample(torch.zeros(1, 5), ["r"], [SamplingParams(seed=seed)])
        assert 0 <= int(tokens[0]) < 5


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


# --- vLLM's sampling params: penalties, min_p, min_tokens, top_k=-1, validation -------------


def make_request(prompt, output, params, request_id="r", eos=(2,)):
    """A `Request` whose output so far is `output`."""
    request = Request(request_id, list(prompt), params, 0, max_total_tokens=1000, eos_token_ids=eos)
    for token in output:
        request.output_token_ids.append(token)
        request.all_token_ids.append(token)
    return request


def reference_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's / HF's formulas written token by token."""
    logits = logits.clone()
    for token in set(prompt) | set(output):
        value = logits[token]
        logits[token] = value / repetition if value > 0 else value * repetition
    for token in set(output):
        logits[token] -= frequency * output.count(token) + presence
    return logits


def test_penalties_match_the_formula_on_logits():
    torch.manual_seed(0)
    vocab = 50
    logits = torch.randn(3, vocab) * 3
    prompts = [[1, 4, 4, 9], [7, 8], [3]]
    outputs = [[4, 5, 5, 5, 11], [], [3, 3, 20]]
    settings = [(0.5, 0.3, 1.5), (-0.4, 1.0, 0.7), (0.0, 0.0, 1.3)]
    penalised = apply_penalties(
        logits,
        [torch.tensor(sorted(set(p))) for p in prompts],
        outputs,
        *[list(column) for column in zip(*settings)],
    )
    for row in range(3):
        expected = reference_penalties(logits[row], prompts[row], outputs[row], *settings[row])
        assert torch.allclose(penalised[row], expected, atol=1e-6), row
    assert not torch.equal(penalised, logits)


def test_penalised_greedy_rows_take_the_argmax_of_the_penalised_logits():
    torch.manual_seed(1)
    vocab = 40
    logits = torch.randn(4, vocab)
    top = logits.argmax(dim=-1).tolist()
    # Rows 0 and 2 repeat their favourite token: a strong penalty must move them off it.
    plain = SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, frequency_penalty=2.0, repetition_penalty=2.0)
    params = [penalised, plain, penalised, plain]
    requests = [
        make_request([5, 6], [top[0]] * 3, penalised, "a"),
        make_request([5, 6], [top[1]] * 3, plain, "b"),
        make_request([top[2]], [top[2]], penalised, "c"),
        make_request([5], [], plain, "d"),
    ]
    before = logits.clone()
    tokens = Sampler().sample(logits, list("abcd"), params, requests).tolist()
    assert torch.equal(logits, before), "the caller's logits are not changed"
    for row in (0, 2):
        request = requests[row]
        expected = reference_penalties(
            logits[row], request.prompt_token_ids, request.output_token_ids, 0.0, 2.0, 2.0
        )
        assert tokens[row] == expected.argmax().item() != top[row]
    assert [tokens[1], tokens[3]] == [top[1], top[3]]


def test_min_p_drops_tokens_below_its_share_of_the_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    masked = apply_min_p(probs.log(), torch.tensor([0.5, 0.0]))
    assert torch.isfinite(masked).tolist() == [[True, True, False, False], [True] * 4]
    # min_p = 1 keeps only the most likely token: sampling becomes the argmax.
    torch.manual_seed(2)
    logits = torch.randn(6, 30)
    params = [SamplingParams(temperature=1.0, min_p=1.0)] * 6
    tokens = Sampler(seed=4).sample(logits, list("abcdef"), params)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, 10)
    logits[0, 2] = 5.0  # EOS
    logits[0, 7] = 4.0  # a stop token
    logits[0, 3] = 3.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    sampler = Sampler()
    short = make_request([1], [3], params)
    assert sampler.sample(logits, ["r"], [params], [short]).item() == 3
    reached = make_request([1], [3, 3], params)
    assert sampler.sample(logits, ["r"], [params], [reached]).item() == 2
    # ignore_eos: EOS is no stop token, so only the stop token is masked.
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7], ignore_eos=True)
    assert sampler.sample(logits, ["r"], [ignoring], [make_request([1], [], ignoring)]).item() == 2


def test_top_k_minus_one_and_zero_are_off():
    torch.manual_seed(3)
    logits = torch.randn(2, 20)
    masked = apply_top_k_top_p(logits, torch.tensor([-1, 0]), torch.tensor([1.0, 1.0]))
    assert torch.equal(masked, logits)
    assert SamplingParams(top_k=-1).top_k == -1


def test_seeded_penalised_sampling_does_not_depend_on_the_batch():
    torch.manual_seed(4)
    logits = torch.randn(3, 60)
    seeded = SamplingParams(
        temperature=0.9, seed=11, presence_penalty=0.7, repetition_penalty=1.2, min_p=0.05
    )
    other = SamplingParams(temperature=1.0, frequency_penalty=0.5)
    mine = make_request([1, 2, 3], [4, 4, 9], seeded, "x")
    alone = Sampler().sample(logits[1:2], ["x"], [seeded], [mine]).item()
    batch = [make_request([5], [6], other, "p"), mine, make_request([7], [], other, "q")]
    batched = Sampler(seed=9).sample(logits, ["p", "x", "q"], [other, seeded, other], batch)
    assert batched[1].item() == alone


def test_token_logprobs_are_the_log_softmax_with_ranks():
    torch.manual_seed(5)
    logits = torch.randn(2, 12)
    chosen = torch.tensor([3, logits[1].argmax().item()])
    rows = token_logprobs(logits, chosen, [2, 0])
    reference = logits.log_softmax(dim=-1)
    ids, values, rank = rows[0]
    top = reference[0].topk(2)
    assert ids == [3, *top.indices.tolist()]
    assert values == pytest.approx([reference[0, 3].item(), *top.values.tolist()], abs=1e-6)
    assert rank == int((reference[0] >= reference[0, 3]).sum())
    assert rows[1] == ([chosen[1].item()], [pytest.approx(reference[1].max().item())], 1)


def whole_row_logprobs(logits, chosen, counts):
    """`token_logprobs` the slow way: one row at a time with torch's top k, each rank counted
    over the whole row."""
    reference = logits.float().log_softmax(dim=-1)
    rows = []
    for row, count in enumerate(counts):
        value = reference[row, chosen[row]]
        top = reference[row].topk(count)
        rows.append(
            (
                [int(chosen[row]), *top.indices.tolist()],
                [value.item(), *top.values.tolist()],
                int((reference[row] >= value).sum()),
            )
        )
    return rows


@pytest.mark.parametrize("counts", [[5, 5, 5, 5, 5, 5], [5, 0, 2, 5, 1, 3], [0] * 6, [20] * 6])
def test_token_logprobs_of_a_batch_are_each_rows_own(counts):
    """The batched rows (top k from the native routine, ranks counted over the top k when they
    can be) equal each row's own from torch's top k, ranked over the whole row: greedy tokens,
    tokens outside the top k, ties, -inf and NaN."""
    torch.manual_seed(7)
    logits = torch.randn(6, 40)
    logits[2, :8] = logits[2].max() + 1  # eight tokens tie for first place
    logits[3, 5:] = float("-inf")
    logits[4, 9] = float("nan")
    chosen = torch.tensor(
        [logits[0].argmax().item(), logits[1].argmin().item(), 4, 20, 9, logits[5].argmax()]
    )
    clean = torch.randn(6, 40)  # every row's top k + 1 distinct: the native routine alone
    cases = [(logits, chosen), (logits, logits.argmax(dim=-1)), (clean, clean.argmax(dim=-1))]
    for rows, batch in cases:
        got = [(*row[:2], chosen_rank(row)) for row in token_logprobs(rows, batch, counts)]
        want = whole_row_logprobs(rows, batch, counts)
        # The same ids and ranks; values within a few ulp of torch's log_softmax (the native
        # one on the CPU), NaN where torch has NaN.
        assert [(ids, rank) for ids, _, rank in got] == [(ids, rank) for ids, _, rank in want]
        for (_, values, _), (_, expected, _) in zip(got, want):
            assert values == pytest.approx(expected, rel=1e-6, abs=1e-6, nan_ok=True)


@pytest.mark.parametrize("counts", [[5] * 7, [0] * 7, [5, 0, 2, 5, 1, 3, 4], [40] * 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_greedy_pick_with_its_logprobs_equals_argmax_then_token_logprobs(counts, dtype):
    """`greedy_token_logprobs` (the pick taken from the top k's scan) gives numpy's argmax
    (first maximum, first NaN) and the rows `token_logprobs` gives for it: a tie for first
    place, a tie inside the top k, NaN, -inf, a row of one finite value, distinct rows."""
    torch.manual_seed(5)
    logits = torch.randn(7, 40)
    logits[1, [6, 17]] = logits[1].max() + 1  # two tokens tie for first place
    logits[2, [3, 9]] = logits[2].max() + 0.5  # a tie second: inside the top k
    logits[2, 30] = logits[2].max() + 1
    logits[3, 12] = float("nan")
    logits[4, 5:] = float("-inf")
    logits[5, :] = float("-inf")
    logits[5, 33] = 0.0
    logits = logits.to(dtype)
    chosen, rows = greedy_token_logprobs(logits, counts)
    want_chosen = greedy_tokens(logits.float())
    assert chosen.dtype == np.int64 and chosen.tolist() == want_chosen.tolist()
    want = token_logprobs(logits, want_chosen, counts)
    for row in range(7):
        (ids, values, _), (want_ids, want_values, _) = rows[row], want[row]
        assert ids == want_ids and chosen_rank(rows[row]) == chosen_rank(want[row]), row
        assert repr(values) == repr(want_values), row  # the same bits (NaN included)
    # Column-major logits, and the largest count given by the caller: the same rows.
    strided = logits.float().t().contiguous().t()
    again, again_rows = greedy_token_logprobs(strided, counts, max(counts))
    assert again.tolist() == chosen.tolist()
    assert repr(list(again_rows)) == repr(list(rows))


def test_top_k_takes_the_native_pass_only_where_it_is_exact(monkeypatch):
    torch.manual_seed(11)
    logprobs = torch.randn(5, 64).log_softmax(dim=-1)
    logprobs[1, [3, 9]] = logprobs[1].max() + 0.5  # a tie inside the top k: torch's order
    logprobs[2, :] = float("-inf")
    logprobs[2, 7] = 0.0  # one finite value
    logprobs[3, 30] = float("nan")
    before = logprobs.clone()
    calls = []
    real_topk = torch.Tensor.topk
    monkeypatch.setattr(
        torch.Tensor,
        "topk",
        lambda self, *a, **kw: calls.append(len(self)) or real_topk(self, *a, **kw),
    )
    chosen = np.array([0, 1, 2, 3, 4])
    ids, values, ranks = logprobs_module.top_k(logprobs, 4, chosen)
    monkeypatch.undo()
    want_values, want_ids = logprobs.topk(4, dim=-1)
    assert ids[:, 0].tolist() == chosen.tolist() and ids[:, 1:].tolist() == want_ids.tolist()
    assert repr(values[:, 0].tolist()) == repr(logprobs[range(5), chosen].tolist())
    assert repr(values[:, 1:].tolist()) == repr(want_values.tolist())
    assert calls == [3]  # one torch top k, over the three rows the native routine cannot settle
    # Ranks are counted natively on every row, settled or not (NaN counts nowhere).
    chosen_values = logprobs[range(5), chosen][:, None]
    assert ranks.tolist() == (logprobs >= chosen_values).sum(-1).tolist()
    assert torch.equal(logprobs.nan_to_num(), before.nan_to_num())  # left as it was


def test_a_rank_left_to_chosen_rank_is_counted_over_the_top_k():
    """Rows whose rank was not counted (the device path, when the chosen token is above the
    k-th): `chosen_rank` counts the top k at least as likely; the CPU rows count it always."""
    assert chosen_rank(([7, 3, 7, 1], [-0.5, -0.1, -0.5, -0.9], None)) == 2
    assert chosen_rank(([3, 3, 7], [-0.1, -0.1, -0.5], None)) == 1
    assert chosen_rank(([9, 3], [-4.0, -0.1], 30)) == 30
    torch.manual_seed(3)
    logits = torch.randn(4, 30)
    reference = logits.log_softmax(dim=-1)
    third = reference.topk(3, dim=-1).indices[:, 2]
    last = reference.argmin(dim=-1)
    rows = token_logprobs(logits, torch.cat([third[:2], last[2:]]), [5] * 4)
    assert [row[2] for row in rows] == [3, 3, 30, 30]
    assert list(map(chosen_rank, rows)) == [3, 3, 30, 30]
    rows = token_logprobs(logits, third, [1, 5, 0, 2])  # fewer asked: the rank over the row
    assert list(map(chosen_rank, rows)) == [3] * 4 and [len(row[0]) for row in rows] == [2, 6, 1, 3]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n must be at least 1"),
        ({"n": 3, "best_of": 2}, "best_of must be >= n"),
        ({"n": 2, "temperature": 0.0}, "greedy"),
        ({"best_of": 2, "temperature": 0.0}, "greedy"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens"),
        ({"min_tokens": -1}, "min_tokens must be at least 0"),
        ({"logprobs": -1}, "logprobs must be at least 0"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs must be an int"),
        ({"stop": ""}, "non-empty strings"),
        ({"stop": [3]}, "non-empty strings"),
        ({"stop": "x", "detokenize": False}, "set detokenize=True"),
        ({"include_stop_str_in_output": 1}, "must be True or False"),
        ({"skip_special_tokens": None}, "must be True or False"),
    ],
)
def test_new_sampling_params_say_what_to_change(kwargs, message):
    with pytest.raises(InvalidSamplingParamsError, match=re.escape(message)):
        SamplingParams(**kwargs)


def test_stop_accepts_a_string_or_a_list():
    assert SamplingParams(stop="ab").stop == ("ab",)
    assert (
        SamplingParams(stop=["a", "b"]).stop == ("a", "b") and SamplingParams(stop=None).stop == ()
    )
    params = SamplingParams(n=2, best_of=3, temperature=0.5)
    assert params.num_samples == 3 and not params.needs_history
    assert (
        SamplingParams(min_tokens=1).needs_history
        and SamplingParams(presence_penalty=1).has_penalties
    )


# --- incremental detokenization and stop strings ---------------------------------------------


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lengths = []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("make", [byte_level_bpe, metaspace_bpe])
def test_incremental_text_equals_the_full_decode_and_reads_a_small_window(make):
    tokenizer = make()
    prompt = tokenizer.encode("the old barn")
    text = " héllo wörld, naïve café — the quick brown fox jumps over the lazy dog"
    output = tokenizer.encode(text)
    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, prompt, SamplingParams())
    for token in output:
        detokenizer.add_tokens([token])
    detokenizer.add_tokens([], final=True)
    full = tokenizer.decode(prompt + output)
    assert detokenizer.text == full[len(tokenizer.decode(prompt)) :]
    assert detokenizer.text.strip() == tokenizer.decode(output).strip()
    if make is byte_level_bpe:
        assert detokenizer.text == text
        # Some tokens are parts of a character: they waited for the rest.
        assert any(chr(0xFFFD) in tokenizer.decode([token]) for token in output)
    # Each call decodes a few tokens, never the whole output.
    assert len(output) > 20 and max(counting.lengths) <= 8


@pytest.mark.parametrize("make", [byte_level_bpe, metaspace_bpe])
def test_streamed_text_equals_the_full_decode(make):
    # A fast tokenizer decodes through `tokenizers`' stream decoder, not the window decodes; a
    # byte-level one from its token bytes (tests/test_detokenizer_byte_level.py).
    tokenizer = make()
    prompt = tokenizer.encode("the old barn")
    output = tokenizer.encode(" héllo wörld, naïve café — the quick brown fox")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    if make is byte_level_bpe:
        assert detokenizer.vocab is not None and detokenizer.stream is None
    else:
        assert detokenizer.vocab is None and detokenizer.stream is not None
    for token in output:
        detokenizer.add_tokens([token])
    detokenizer.add_tokens([], final=True)
    full = tokenizer.decode(prompt + output)
    assert detokenizer.text == full[len(tokenizer.decode(prompt)) :]
    if make is byte_level_bpe:
        # Output that ends inside a character shows it as a full decode does.
        pieces = [t for t in output if chr(0xFFFD) in tokenizer.decode([t])]
        cut = output[: output.index(pieces[0]) + 1]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
        for token in cut:
            detokenizer.add_tokens([token])
        detokenizer.add_tokens([], final=True)
        assert detokenizer.text == tokenizer.decode(prompt + cut)[len(tokenizer.decode(prompt)) :]
        assert detokenizer.text.endswith(chr(0xFFFD))


def test_stop_strings_are_found_across_tokens_and_cut_the_text():
    tokenizer = byte_level_bpe()
    prompt = tokenizer.encode("the")
    output = tokenizer.encode(" cat sat on the mat and the dog")
    assert len(output) > 8

    def run(**kwargs):
        params = SamplingParams(**kwargs)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, params)
        for count, token in enumerate(output, 1):
            stop = detokenizer.add_token_and_match(token, check_stop=True)
            if stop is not None:
                return stop, count, detokenizer.text
        return None, len(output), detokenizer.text

    # "t on" ends inside a token that continues past it; it spans several tokens.
    stop, count, text = run(stop=["t on"])
    assert stop == "t on" and text == " cat sa"
    assert tokenizer.decode(output[:count]).endswith(" on")
    assert "t on" not in tokenizer.decode(output[: count - 1])
    assert run(stop=["t on"], include_stop_str_in_output=True)[2] == " cat sat on"
    # The first stop string in the list that the new text completes wins.
    assert run(stop=["mat", "the"])[0] == "the"
    assert run(stop=["zebra"]) == (None, len(output), " cat sat on the mat and the dog")


def test_special_tokens_are_in_the_text_only_when_not_skipped():
    tokenizer = byte_level_bpe()
    prompt = tokenizer.encode("the")
    output = tokenizer.encode(" cat") + [tokenizer.eos_token_id] + tokenizer.encode(" sat")
    for skip, expected in ((True, " cat sat"), (False, " cat</s> sat")):
        params = SamplingParams(skip_special_tokens=skip)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, params)
        for token in output:
            detokenizer.add_tokens([token])
        assert detokenizer.text == expected


@pytest.mark.parametrize("stop", [(), ("never",)])  # decoded once at the end, or per token
def test_a_stop_token_is_left_out_of_the_text_unless_asked(stop):
    tokenizer = byte_level_bpe()
    eos, prompt = tokenizer.eos_token_id, tokenizer.encode("the")
    stop_token = tokenizer.encode(" on")[0]
    for tokens, include, expected, reason in (
        (" cat sat", False, " cat sat", None),
        (" cat sat", True, " cat sat</s>", None),
        (" cat sat on", False, " cat sat", stop_token),
        (" cat sat on", True, " cat sat on", stop_token),
    ):
        params = SamplingParams(
            stop=stop,
            stop_token_ids=[stop_token],
            skip_special_tokens=False,
            include_stop_str_in_output=include,
        )
        request = Request(
            "r",
            prompt,
            params,
            0,
            max_total_tokens=100,
            eos_token_ids=(eos,),
            detokenizer=IncrementalDetokenizer(tokenizer, prompt, params),
        )
        output = tokenizer.encode(tokens) + ([] if reason else [eos])
        reasons = [request.append_output_token(token) for token in output]
        assert reasons == [None] * (len(output) - 1) + [FinishReason.STOP]
        assert request.stop_reason == reason and request.output_token_ids == output
        request.finish_text()
        assert request.output_text == expected


def test_the_logprob_log_forgets_what_no_unfinished_request_needs():
    """Records below every open cursor go: aborted, finished and unread requests pin none;
    a request that asks for no logprobs opens no cursor; each request keeps its own rows."""
    llm = LLM("tiny-llama", load_format="dummy", kv_cache_memory="16MiB", seed=0)
    engine = llm.engine
    log = engine.model_runner.logprob_log
    asks = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("a", list(range(3, 20)), asks)
    engine.add_request("b", list(range(4, 21)), short)
    engine.add_request("plain", list(range(5, 22)), plain)
    requests = {r.request_id: r for r in engine.scheduler.waiting}
    assert requests["plain"].logprob_cursor is None and sum(log.cursors.values()) == 2
    for _ in range(5):
        engine.step()
    assert requests["b"].is_finished and sum(log.cursors.values()) == 1
    engine.abort_request("a")
    assert not log.records and not log.cursors  # "plain" still runs: it needs none
    while engine.has_unfinished_requests():
        engine.step()
    assert not log.records
    for request_id, count in (("a", 5), ("b", 3)):
        rows = requests[request_id].sample_logprob_rows()
        assert len(rows) == count and all(len(ids) == 3 for ids, _, _ in rows)


def test_logprob_rows_read_late_equal_rows_read_every_step():
    """A step's rows stay arrays until read; a request read at the end (`LLM.generate`) gets
    the rows one read after every step (streaming) gets, and takes them out of the steps'."""

    def run(read_every_step):
        llm = LLM("tiny-llama", load_format="dummy", kv_cache_memory="16MiB", seed=0)
        engine = llm.engine
        long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3)
        short = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1)
        engine.add_request("long", list(range(3, 40)), long)
        for index in range(4):
            engine.add_request(f"short{index}", list(range(5 + index, 20)), short)
        request = next(r for r in engine.scheduler.waiting if r.request_id == "long")
        log = engine.model_runner.logprob_log
        kept = []  # every step's rows and ids, to see the long request's taken out of each
        record = log.record
        log.record = lambda rows, ids: kept.append((rows, list(ids))) or record(rows, ids)
        while engine.has_unfinished_requests():
            engine.step()
            if read_every_step and not request.is_finished:
                request.sample_logprob_rows()
                assert request.logprob_cursor == log.num_records
        # Finished, every request closed its cursor: the log keeps no record; the long
        # request keeps the records it has not read (none when it read every step).
        assert not log.records and not log.cursors
        assert len(request.logprob_span) <= (1 if read_every_step else 40)
        rows = request.sample_logprob_rows()
        assert not request.logprob_span and len(request.sample_logprobs) == 40
        steps = [(rows, ids.index("long")) for rows, ids in kept if "long" in ids]
        assert len(steps) == 40 and all(rows[index] is None for rows, index in steps)
        return rows, request.cumulative_logprob

    rows, cumulative = run(read_every_step=False)
    assert len(rows) == 40 and all(len(row[0]) == 4 for row in rows)
    assert (rows, cumulative) == run(read_every_step=True)


@pytest.mark.parametrize("vocab_size", [7, 512, 4099])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_the_native_top_k_equals_torchs_on_random_rows(vocab_size, k):
    """Random logprobs (half-precision steps, so ties occur in the small vocabulary) of a
    step's rows: ids and values equal `torch.topk`'s exactly, in order."""
    torch.manual_seed(vocab_size + k)
    k = min(k, vocab_size - 1)
    logprobs = (torch.randn(33, vocab_size) * 4).half().float().log_softmax(dim=-1)
    chosen = torch.randint(0, vocab_size, (33,))
    ids, values, ranks = logprobs_module.top_k(logprobs, k, chosen.numpy())
    want_values, want_ids = logprobs.topk(k, dim=-1)
    assert ranks.tolist() == (logprobs >= logprobs[range(33), chosen][:, None]).sum(-1).tolist()
    assert ids[:, 1:].tolist() == want_ids.tolist()
    assert values[:, 1:].tolist() == want_values.tolist()
    assert ids[:, 0].tolist() == chosen.tolist()
    assert values[:, 0].tolist() == logprobs[range(33), chosen].tolist()


def test_the_native_top_k_refuses_bad_buffers_with_what_to_change():
    from hybrid_cache._core import top_k_rows_cpu
    from hybrid_cache.errors import InvalidArgumentError

    logprobs = torch.randn(4, 10).log_softmax(dim=-1).numpy()
    chosen = np.zeros(4, dtype=np.int64)
    ids, values = np.empty((4, 3), np.int64), np.empty((4, 3), np.float32)
    ranks = np.empty(4, np.int64)
    assert top_k_rows_cpu(logprobs, 2, chosen, ids, values, ranks) == []
    assert ranks.tolist() == (logprobs >= logprobs[:, :1]).sum(-1).tolist()
    # Values viewing the ids' memory: two writable views of one buffer are refused.
    backing = np.empty(2 * 4 * 3, np.int64)
    aliased = backing.view(np.float32)[: 4 * 3].reshape(4, 3)
    with pytest.raises(InvalidArgumentError, match="values_out overlaps"):
        top_k_rows_cpu(logprobs, 2, chosen, backing[: 4 * 3].reshape(4, 3), aliased, ranks)
    with pytest.raises(InvalidArgumentError, match="ranks_out overlaps"):
        top_k_rows_cpu(logprobs, 2, chosen, ids, values, ids.reshape(-1)[:4])
    with pytest.raises(InvalidArgumentError, match="ranks_out must be a writable C-contiguous"):
        top_k_rows_cpu(logprobs, 2, chosen, ids, values, np.empty(3, np.int64))
    with pytest.raises(InvalidArgumentError, match="ids_out must be a writable C-contiguous"):
        top_k_rows_cpu(logprobs, 2, chosen, np.empty((4, 4), np.int64), values, ranks)
    with pytest.raises(InvalidArgumentError, match="chosen id 10 of row 0 is outside 0..10"):
        top_k_rows_cpu(logprobs, 2, np.full(4, 10, np.int64), ids, values, ranks)
    with pytest.raises(InvalidArgumentError, match="needs more than k columns"):
        top_k_rows_cpu(
            logprobs,
            10,
            chosen,
            np.empty((4, 11), np.int64),
            np.empty((4, 11), np.float32),
            ranks,
        )


def test_the_native_log_softmax_is_torchs_within_a_few_ulp():
    """`log_softmax_rows_cpu` (what the CPU logprobs use) against torch's on the rows a model
    gives (vocabularies of 512 and 32000, half-precision logits made float), rows with -inf
    (masked tokens) and huge values, and torch's all-NaN rows; the order inside each row is
    torch's. Refuses an output of another shape or aliasing the logits."""
    from hybrid_cache._core import log_softmax_rows_cpu
    from hybrid_cache.errors import InvalidArgumentError

    torch.manual_seed(13)
    inf, nan = float("inf"), float("nan")
    cases = [torch.randn(64, 512) * 3, (torch.randn(8, 32000) * 6).half().float()]
    edge = torch.randn(7, 33)
    edge[0, 3:20] = -inf
    edge[1] *= 1e37
    edge[2, 5] = nan
    edge[3, 0] = inf
    edge[4] = -inf
    edge[5] = 2.5  # all equal
    edge[6, :] = -inf
    edge[6, 30] = 0.0  # one finite value: logprob 0
    cases.append(edge)
    for logits in cases:
        out = np.empty(tuple(logits.shape), np.float32)
        log_softmax_rows_cpu(logits.numpy(), out)
        expected = logits.log_softmax(dim=-1)
        got = torch.from_numpy(out)
        assert torch.equal(got.isnan(), expected.isnan())
        assert torch.equal(got.isneginf(), expected.isneginf())
        finite = expected.isfinite()
        tolerance = 8 * torch.finfo(torch.float32).eps * (logits.abs().amax(-1, keepdim=True) + 12)
        assert ((got - expected).abs()[finite] <= tolerance.expand_as(got)[finite]).all()
        # Ranked alike: argsorts agree wherever torch's values are distinct.
        for row in range(len(logits)):
            values = expected[row][finite[row]]
            if values.unique().numel() == values.numel():
                assert torch.equal(got[row][finite[row]].argsort(), values.argsort())
    assert out[6].tolist() == [-inf] * 30 + [0.0, -inf, -inf]

    logits = torch.randn(4, 10).numpy()
    with pytest.raises(InvalidArgumentError, match="out must be a writable C-contiguous array"):
        log_softmax_rows_cpu(logits, np.empty((4, 11), np.float32))
    with pytest.raises(InvalidArgumentError, match="out overlaps"):
        log_softmax_rows_cpu(logits, logits)
    with pytest.raises(InvalidArgumentError, match="logits must be C-contiguous"):
        log_softmax_rows_cpu(logits.T, np.empty((10, 4), np.float32))


def test_a_rank_counts_logprobs_rounding_made_equal():
    """Distinct logits whose logprobs round to one value (small logits beside a large one):
    the chosen token's rank counts every token whose logprob is at least its own, as torch's
    log_softmax gives them, not only the larger logits."""
    logits = torch.tensor([[30.0, 1e-7, 2e-7, 0.0, -1e-7, -5.0, 3e-7]])
    reference = logits.log_softmax(dim=-1)[0]
    assert reference[1] == reference[2] == reference[3]  # the case: rounding ties them
    for chosen in (1, 3, 4, 5):
        (row,) = token_logprobs(logits, torch.tensor([chosen]), [2])
        assert row[2] == int((reference >= reference[chosen]).sum()), chosen
        assert row[1][0] == pytest.approx(reference[chosen].item(), abs=1e-6)
        assert row[0][1] == 0  # the largest logit leads
