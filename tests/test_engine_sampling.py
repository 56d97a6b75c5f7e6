"""`LLM.generate` with vLLM's sampling params, end to end on a tiny random-weight Llama saved
with a real (in-process trained) tokenizer: logprobs against transformers' logits, penalties
and min_tokens against a step-by-step reimplementation on transformers' logits, stop strings
on the text, n > 1 samples sharing the prompt's KV, best_of, metrics. Float32 throughout.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hybrid_cache import _core
from hybrid_cache.engine.errors import UnsupportedSamplingParamsError
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.parallel_sampling import SampleGroup
from hybrid_cache.engine.sampling_params import SamplingParams
from tiny_tokenizers import metaspace_bpe

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(
        not hasattr(_core, "Coordinator"), reason="the Rust Coordinator binding is not built"
    ),
    pytest.mark.usefixtures("one_torch_thread"),
]

BLOCK = 4
PROMPT = [5, 17, 33, 9, 71, 12, 48, 90, 23, 7, 64, 101, 3, 88, 41, 19, 120, 56, 30, 77, 8, 99, 15]


class Tiny:
    """A seeded tiny Llama (its vocabulary = the tokenizer's) saved with its tokenizer."""

    def __init__(self, folder) -> None:
        self.tokenizer = metaspace_bpe()
        config = transformers.LlamaConfig(
            vocab_size=len(self.tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_hidden_layers=2,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
        )
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        self.hf = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for parameter in self.hf.parameters():
                parameter.normal_(0.0, 0.1 if parameter.dim() > 1 else 0.1)
        self.hf.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        self.folder = str(folder)

    def llm(self, **overrides) -> LLM:
        options = dict(
            kv_cache_memory="1MiB",
            max_model_len=128,
            block_size=BLOCK,
            max_num_batched_tokens=16,
            max_num_seqs=8,
        )
        options.update(overrides)
        return LLM(self.folder, **options)

    @torch.no_grad()
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """transformers' float32 logits at every position of `token_ids`."""
        return self.hf(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return Tiny(tmp_path_factory.mktemp("tiny-llama-tokenizer"))


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return tiny.llm()


def generate(llm: LLM, params: SamplingParams, prompts=(PROMPT,)):
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)


def assert_all_blocks_free(llm: LLM) -> None:
    kv_cache = llm.engine.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_blocks - 1
    assert not llm.engine.has_unfinished_requests()


def reference_greedy(tiny: Tiny, prompt, steps, process) -> list[int]:
    """Greedy tokens from transformers' logits, each step's logits passed through
    `process(logits, output_so_far)` first (a reimplementation of the formulas)."""
    output: list[int] = []
    for _ in range(steps):
        logits = tiny.logits(list(prompt) + output)[-1]
        output.append(int(process(logits, output).argmax()))
    return output


def test_logprobs_and_prompt_logprobs_are_transformers_log_softmax(tiny, llm):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    (plain,) = generate(llm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    (output,) = generate(
        llm, SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True, logprobs=3)
    )
    (greedy,) = generate(llm, dataclasses.replace(params, prompt_logprobs=2))
    # Asking for logprobs does not change the tokens.
    assert greedy.token_ids == plain.token_ids
    for result in (output, greedy):
        completion = result.outputs[0]
        tokens = completion.token_ids
        reference = tiny.logits(PROMPT + tokens).log_softmax(dim=-1)
        assert len(completion.logprobs) == len(tokens) == 8
        for step, (token, position) in enumerate(zip(tokens, completion.logprobs)):
            row = reference[len(PROMPT) - 1 + step]
            assert next(iter(position)) == token, "the sampled token comes first"
            assert position[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert position[token].rank == int((row >= row[token]).sum())
            top = row.topk(3)
            for rank, (value, top_token) in enumerate(zip(top.values, top.indices.tolist()), 1):
                assert position[top_token].logprob == pytest.approx(value.item(), abs=1e-4)
                if top_token != token:
                    assert position[top_token].rank == rank
            assert position[token].decoded_token == tiny.tokenizer.decode([token])
        expected = sum(reference[len(PROMPT) - 1 + i, t].item() for i, t in enumerate(tokens))
        assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-3)
    assert greedy.outputs[0].logprobs[0][greedy.token_ids[0]].rank == 1
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None

    prompt_logprobs = greedy.prompt_logprobs
    assert plain.prompt_logprobs is None
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    reference = tiny.logits(PROMPT).log_softmax(dim=-1)
    for index in range(1, len(PROMPT)):
        position, row, token = prompt_logprobs[index], reference[index - 1], PROMPT[index]
        assert position[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert position[token].rank == int((row >= row[token]).sum())
        assert len(position) <= 3 and position.keys() >= set(row.topk(2).indices.tolist())
    # Prompt logprobs need every prompt position: the prompt was computed, not cache-hit.
    assert greedy.num_cached_tokens == 0
    assert_all_blocks_free(llm)


def test_prompt_logprobs_survive_chunked_prefill_and_preemption(tiny):
    # Four prompts of about 45 tokens in a pool of 15 blocks (60 tokens): chunks of 8 tokens,
    # preemptions mid-prompt.
    prompts = [PROMPT * 2, PROMPT[::-1] * 2, PROMPT[3:] * 2, PROMPT[:20] * 2]
    llm = tiny.llm(kv_cache_memory="32KiB", max_num_batched_tokens=8, max_model_len=56)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outputs = generate(llm, params, prompts)
    assert llm.stats.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        reference = tiny.logits(prompt).log_softmax(dim=-1)
        got = [output.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
        expected = [reference[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
        assert got == pytest.approx(expected, abs=1e-4)
    assert_all_blocks_free(llm)


def test_repetition_penalty_matches_transformers_generate(tiny, llm):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.8)
    (output,) = generate(llm, params)
    expected = tiny.hf.generate(
        torch.tensor([PROMPT]),
        attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
        max_new_tokens=12,
        do_sample=False,
        repetition_penalty=1.8,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(PROMPT) :].tolist()
    assert output.token_ids == expected
    (plain,) = generate(llm, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert plain.token_ids != expected, "the penalty changes this output"


@pytest.mark.parametrize("frequency, presence", [(0.6, 1.1), (-1.0, -0.5)])
def test_frequency_and_presence_penalties_match_the_formula(tiny, llm, frequency, presence):
    def process(logits, output):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=len(logits))
        return logits - frequency * counts - presence * (counts > 0)

    params = SamplingParams(
        max_tokens=10,
        temperature=0.0,
        ignore_eos=True,
        frequency_penalty=frequency,
        presence_penalty=presence,
    )
    (output,) = generate(llm, params)
    expected = reference_greedy(tiny, PROMPT, 10, process)
    assert output.token_ids == expected
    if frequency < 0:  # rewarding repeats changes this output
        assert expected != reference_greedy(tiny, PROMPT, 10, lambda logits, _: logits)


def test_min_tokens_masks_stop_tokens_until_reached(tiny, llm):
    (free,) = generate(llm, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    stop = free.token_ids[0]
    (stopped,) = generate(
        llm, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    )
    assert stopped.token_ids == [stop] and stopped.outputs[0].stop_reason == stop

    def process(logits, output):
        return (
            logits.index_fill(0, torch.tensor([stop, 2]), float("-inf"))
            if len(output) < 3
            else logits
        )

    params = SamplingParams(max_tokens=10, temperature=0.0, min_tokens=3, stop_token_ids=[stop])
    (output,) = generate(llm, params)
    expected = reference_greedy(tiny, PROMPT, 10, process)
    # The engine stops at the first stop token or EOS (2) from the 4th token on.
    ends = [index for index, token in enumerate(expected) if index >= 3 and token in (stop, 2)]
    if ends:
        expected = expected[: ends[0] + 1]
    assert output.token_ids == expected and len(expected) >= 3
    assert stop not in output.token_ids[:3] and 2 not in output.token_ids[:3]
    assert_all_blocks_free(llm)


def test_stop_strings_cut_the_text_and_say_why(tiny, llm):
    base = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    (free,) = generate(llm, SamplingParams(**base))
    text, tokens = free.text, free.token_ids
    # The output text continues the prompt's (its first token read after the prompt's).
    decoded_prompt = tiny.tokenizer.decode(PROMPT)
    assert text == tiny.tokenizer.decode(PROMPT + tokens)[len(decoded_prompt) :]
    # A stop string that starts mid-way through the output and spans a token boundary.
    start = len(tiny.tokenizer.decode(tokens[:6]))
    stop = text[start - 2 : start + 2]
    assert len(stop) == 4 and text.find(stop) >= 1
    (stopped,) = generate(llm, SamplingParams(**base, stop=["never there", stop]))
    cut = text.find(stop)
    assert stopped.text == text[:cut]
    assert stopped.finish_reason == "stop" and stopped.outputs[0].stop_reason == stop
    # Every token generated stays: up to the one that completed the stop string.
    count = len(stopped.token_ids)
    assert stopped.token_ids == tokens[:count]
    assert stop in tiny.tokenizer.decode(PROMPT + tokens[:count])[len(decoded_prompt) :]
    assert stop not in tiny.tokenizer.decode(PROMPT + tokens[: count - 1])[len(decoded_prompt) :]
    (kept,) = generate(llm, SamplingParams(**base, stop=stop, include_stop_str_in_output=True))
    assert kept.text == text[: cut + len(stop)] and kept.token_ids == stopped.token_ids
    # A stop token's text is left out unless asked for; EOS is a special token: skipped.
    stop_token = tokens[2]
    (by_token,) = generate(llm, SamplingParams(**base, stop_token_ids=[stop_token]))
    assert by_token.token_ids == tokens[:3]
    assert by_token.text == tiny.tokenizer.decode(PROMPT + tokens[:2])[len(decoded_prompt) :]
    (no_text,) = generate(llm, SamplingParams(**base, detokenize=False))
    assert no_text.text is None and no_text.token_ids == tokens
    assert free.outputs[0].stop_reason is None and free.finish_reason == "length"
    assert_all_blocks_free(llm)


def test_stop_strings_need_a_tokenizer():
    llm = LLM("tiny-llama", kv_cache_memory="1MiB", max_model_len=64, block_size=4)
    with pytest.raises(UnsupportedSamplingParamsError, match="stop_token_ids"):
        llm.engine.add_request("r", [1, 2, 3], SamplingParams(stop="x"))
    with pytest.raises(UnsupportedSamplingParamsError, match="lower it"):
        llm.engine.add_request("r", [1, 2, 3], SamplingParams(logprobs=llm.spec.vocab_size + 1))
    assert not llm.engine.has_unfinished_requests()


def test_n_samples_share_the_prompt_kv(tiny):
    prompt = PROMPT + PROMPT[:6]  # 29 tokens: the samples after the first hit 28 of them
    params = SamplingParams(n=3, max_tokens=6, temperature=0.9, seed=5, ignore_eos=True)
    llm = tiny.llm(max_num_batched_tokens=64)
    (output,) = generate(llm, params, [prompt])
    assert [c.index for c in output.outputs] == [0, 1, 2]
    # Sample i is the request with seed + i, alone on a cold engine.
    cold = tiny.llm(enable_prefix_caching=False)
    for index, completion in enumerate(output.outputs):
        single = SamplingParams(max_tokens=6, temperature=0.9, seed=5 + index, ignore_eos=True)
        assert completion.token_ids == generate(cold, single, [prompt])[0].token_ids
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1
    # The prompt was computed once: each later sample hit all of it but the last token's block.
    hit = (len(prompt) - 1) // BLOCK * BLOCK
    assert output.num_cached_tokens == 0
    assert llm.stats.num_prefix_hit_tokens == 2 * hit
    computed = sum(step.num_scheduled_tokens for step in llm.step_stats)
    assert computed == len(prompt) + 2 * (len(prompt) - hit) + 3 * (6 - 1)
    # Without the prefix cache each sample computes the whole prompt.
    (again,) = generate(cold, params, [prompt])
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]
    assert sum(step.num_scheduled_tokens for step in cold.step_stats) == 3 * len(prompt) + 15
    assert_all_blocks_free(llm)


def test_the_engine_returns_a_sample_group_with_each_sample(tiny, llm):
    assert llm.reset_prefix_cache()
    group = llm.engine.add_request("g", PROMPT, SamplingParams(n=2, temperature=1.0, seed=1))
    assert isinstance(group, SampleGroup) and len(group.children) == 2
    finished = []
    while llm.engine.has_unfinished_requests():
        finished += llm.engine.step()
    assert finished == [group] and group.is_finished
    assert [child.num_cached_tokens for child in group.children] == [0, 20]
    assert llm.engine.abort_request("g") is None
    assert_all_blocks_free(llm)
    # Aborting a group mid-run (here by one sample's id) stops every sample.
    other = llm.engine.add_request("h", PROMPT, SamplingParams(n=3, temperature=1.0))
    llm.engine.step()
    llm.engine.step()
    assert llm.engine.abort_request(other.children[1].request_id) is other
    assert [child.finish_reason.value for child in other.children] == ["abort"] * 3
    assert "h" not in llm.engine.unfinished_request_ids
    assert_all_blocks_free(llm)


def test_best_of_returns_the_n_most_likely_samples(tiny, llm):
    base = dict(max_tokens=5, temperature=1.2, ignore_eos=True)
    (output,) = generate(llm, SamplingParams(n=2, best_of=4, seed=8, **base))
    singles = [
        generate(llm, SamplingParams(seed=8 + index, logprobs=0, **base))[0].outputs[0]
        for index in range(4)
    ]
    ranked = sorted(singles, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in output.outputs] == [c.token_ids for c in ranked]
    assert [c.cumulative_logprob for c in output.outputs] == pytest.approx(
        [c.cumulative_logprob for c in ranked], abs=1e-4
    )
    assert all(c.logprobs is None for c in output.outputs), "logprobs were not asked for"
    assert_all_blocks_free(llm)


def test_seeded_sampling_with_new_params_does_not_depend_on_the_batch(tiny, llm):
    params = SamplingParams(
        max_tokens=8,
        temperature=0.8,
        seed=21,
        min_p=0.02,
        top_k=-1,
        presence_penalty=0.5,
        repetition_penalty=1.1,
        min_tokens=2,
        logprobs=1,
    )
    (alone,) = generate(llm, params)
    others = SamplingParams(max_tokens=8, temperature=1.0, frequency_penalty=0.3)
    batch = llm.generate(
        [
            {"prompt_token_ids": PROMPT[::-1]},
            {"prompt_token_ids": PROMPT},
            {"prompt_token_ids": PROMPT[4:]},
        ],
        [others, params, others],
        use_tqdm=False,
    )
    assert batch[1].token_ids == alone.token_ids
    assert batch[1].outputs[0].cumulative_logprob == pytest.approx(
        alone.outputs[0].cumulative_logprob, abs=1e-4
    )


def test_request_metrics_are_in_order(llm):
    (output,) = generate(llm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    metrics = output.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    assert metrics.first_token_time <= metrics.last_token_time <= metrics.finished_time
    assert metrics.time_in_queue == pytest.approx(
        metrics.first_scheduled_time - metrics.arrival_time
    )
