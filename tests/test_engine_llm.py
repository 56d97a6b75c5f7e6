"""End to end: `LLM.generate` on tiny random-weight models against transformers' `generate`.

Each model is built from transformers' own config class (seeded), saved with `save_pretrained`
and loaded by our loader. Windows are 8 tokens and blocks 4, so prompts of up to 30 tokens plus
16 generated ones cross every window several times; a small `max_num_batched_tokens` forces
chunked prefill mixed with decodes.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hybrid_cache import _core
from hybrid_cache.config import load_model_spec
from hybrid_cache.engine.llm import LLM
from hybrid_cache.engine.sampling_params import SamplingParams
from hybrid_cache.planner import PlanOptions, plan_kv_cache

transformers = pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(
        not hasattr(_core, "Coordinator"), reason="the Rust Coordinator binding is not built"
    ),
    pytest.mark.usefixtures("one_torch_thread"),
]

NUM_NEW_TOKENS = 16
WINDOW = 8
PROMPT_LENGTHS = (5, 19, 30)
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)


def hf_model(architecture: str):
    """A seeded tiny transformers model; weight scales chosen so greedy output varies."""
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    if architecture == "llama":
        config, model_class, scale = (
            transformers.LlamaConfig(num_hidden_layers=2, **common),
            transformers.LlamaForCausalLM,
            0.1,
        )
    elif architecture == "mistral":
        config = transformers.MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **common)
        model_class, scale = transformers.MistralForCausalLM, 0.1
    elif architecture == "gemma2":
        config = transformers.Gemma2Config(num_hidden_layers=4, sliding_window=WINDOW, **common)
        model_class, scale = transformers.Gemma2ForCausalLM, 0.02
    elif architecture == "gemma3":
        layer_types = ["sliding_attention"] * 3 + ["full_attention"]
        config = transformers.Gemma3TextConfig(
            num_hidden_layers=4, sliding_window=WINDOW, layer_types=layer_types, **common
        )
        model_class, scale = transformers.Gemma3ForCausalLM, 0.02
    elif architecture == "gpt_oss":
        common["intermediate_size"] = 64
        config = transformers.GptOssConfig(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
            **common,
        )
        model_class, scale = transformers.GptOssForCausalLM, 0.3
    else:
        raise AssertionError(architecture)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, scale if parameter.dim() > 1 else 0.1)
    return model


def make_prompts(
    seed: int, lengths=PROMPT_LENGTHS, prefix: tuple[int, ...] = ()
) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        list(prefix) + torch.randint(3, 128, (length,), generator=generator).tolist()
        for length in lengths
    ]


def hf_greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        generated = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=NUM_NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


class TinyModel:
    """A tiny transformers model saved to `folder`, and engines over it. `group_layout` is the
    planner's ("auto": one group per layer type where that pays, as for this Gemma-3's exact 3:1
    pattern; "equal": equal-size groups, one layer each here)."""

    def __init__(self, architecture: str, folder, group_layout: str = "auto") -> None:
        self.architecture = architecture
        self.group_layout = group_layout
        self.hf = hf_model(architecture)
        self.hf.save_pretrained(folder)
        self.folder = str(folder)

    def llm(self, **overrides) -> LLM:
        options = dict(
            kv_cache_memory="1MiB",
            max_model_len=128,
            block_size=4,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            kv_group_layout=self.group_layout,
        )
        options.update(overrides)
        return LLM(self.folder, **options)


@pytest.fixture(
    scope="module", params=["llama", "mistral", "gemma2", "gemma3", "gemma3-equal", "gpt_oss"]
)
def tiny(request, tmp_path_factory) -> TinyModel:
    architecture, _, layout = request.param.partition("-")
    folder = tmp_path_factory.mktemp(request.param)
    return TinyModel(architecture, folder, group_layout=layout or "auto")


def generate_ids(llm: LLM, prompts: list[list[int]], params=GREEDY) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [output.token_ids for output in outputs]


def assert_all_blocks_free(llm: LLM) -> None:
    kv_cache = llm.engine.kv_cache
    assert kv_cache.num_free_blocks == kv_cache.num_blocks - 1
    assert not llm.engine.has_unfinished_requests()


def test_greedy_matches_transformers_with_chunked_prefill(tiny):
    prompts = make_prompts(1)
    expected = hf_greedy(tiny.hf, prompts)
    assert len({token for tokens in expected for token in tokens}) > 3, "degenerate reference"
    llm = tiny.llm()
    assert generate_ids(llm, prompts) == expected
    # Chunked prefill happened: some step computed 16 tokens while a prompt was longer.
    assert max(stats.num_scheduled_tokens for stats in llm.step_stats) == 16
    assert_all_blocks_free(llm)


def test_hybrid_and_uniform_modes_give_the_same_tokens(tiny):
    prompts = make_prompts(2)
    hybrid = tiny.llm(kv_cache_mode="hybrid")
    uniform = tiny.llm(kv_cache_mode="uniform")
    assert (
        generate_ids(hybrid, prompts)
        == generate_ids(uniform, prompts)
        == hf_greedy(tiny.hf, prompts)
    )
    assert uniform.layout.num_groups == 1
    if tiny.architecture == "gemma3":  # 3 windowed layers + 1 full, blocks of 4 tokens
        per_type = [(len(g.layer_indices), g.block_size) for g in hybrid.layout.groups]
        assert per_type == ([(3, 4), (1, 12)] if tiny.group_layout == "auto" else [(1, 4)] * 4)
    # Windowed groups release what slid out: their peak (tokens per layer) stays below the
    # full group's.
    kinds = [group.kind for group in hybrid.layout.groups]
    peaks = hybrid.stats.max_used_blocks_per_group
    assert len(peaks) == len(kinds) == len(hybrid.step_stats[-1].num_used_blocks_per_group)
    tokens = [peak * group.block_size for peak, group in zip(peaks, hybrid.layout.groups)]
    if "full" in kinds and "sliding_window" in kinds:
        full_peak = max(t for t, kind in zip(tokens, kinds) if kind == "full")
        assert max(t for t, kind in zip(tokens, kinds) if kind != "full") < full_peak
    assert_all_blocks_free(hybrid)
    assert_all_blocks_free(uniform)


def test_preemption_by_recompute_gives_the_same_tokens(tiny):
    prompts = make_prompts(3, lengths=(24, 26, 28, 30))
    # Room for about one and a half requests: the newest running ones get preempted.
    llm = tiny.llm(**small_pool(tiny))
    assert generate_ids(llm, prompts) == hf_greedy(tiny.hf, prompts)
    assert llm.stats.num_preemptions > 0
    assert_all_blocks_free(llm)


def small_pool(
    tiny: TinyModel,
    mode: str = "hybrid",
    max_num_batched_tokens: int = 16,
    largest: int = 30 + NUM_NEW_TOKENS,
) -> dict:
    """`LLM` arguments for a pool just larger than the `largest` request (in tokens, also the
    `max_model_len`) at its worst case: admission passes, but four requests running together
    must preempt."""
    spec = load_model_spec(tiny.folder)
    options = PlanOptions(
        kv_cache_memory="1MiB",
        max_model_len=largest,
        block_size=4,
        max_num_batched_tokens=max_num_batched_tokens,
        kv_cache_dtype="float32",
        group_layout=tiny.group_layout,
    )
    layout = plan_kv_cache(spec, options, mode=mode)
    need = sum(g.max_blocks_per_request(largest, max_num_batched_tokens) for g in layout.groups)
    num_blocks = 1 + need + 2
    return {
        "kv_cache_memory": num_blocks * layout.page_bytes * layout.layers_per_group,
        "max_model_len": largest,
    }


def test_prefix_cache_hits_give_the_same_tokens(tiny):
    shared = tuple(make_prompts(4, lengths=(24,))[0])
    llm = tiny.llm()
    first = make_prompts(5, lengths=(6, 9), prefix=shared)
    assert generate_ids(llm, first) == hf_greedy(tiny.hf, first)
    second = make_prompts(6, lengths=(5, 11), prefix=shared)
    outputs = llm.generate([{"prompt_token_ids": p} for p in second], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy(tiny.hf, second)
    assert all(output.num_cached_tokens >= 16 for output in outputs)
    assert llm.stats.prefix_cache_hit_rate > 0
    assert_all_blocks_free(llm)
    assert llm.reset_prefix_cache()
    (cold,) = llm.generate({"prompt_token_ids": second[0]}, GREEDY, use_tqdm=False)
    assert cold.num_cached_tokens == 0 and cold.token_ids == outputs[0].token_ids


def test_the_next_turn_of_a_conversation_hits_its_whole_history(tiny):
    # The second turn resends the first turn's prompt and output plus new tokens. Its hit is
    # everything the first turn computed (28 tokens: the last sampled token was never fed),
    # rounded to a block of 4: with Gemma-3's per-type layout (full-attention blocks of 12)
    # that hit ends inside a full-attention block, which the first turn's freed tail supplies.
    llm = tiny.llm()
    (first_prompt,) = make_prompts(21, lengths=(13,))
    (first,) = llm.generate({"prompt_token_ids": first_prompt}, GREEDY, use_tqdm=False)
    history = first_prompt + first.token_ids
    (user,) = make_prompts(22, lengths=(5,))
    second_prompt = history + user
    (second,) = llm.generate({"prompt_token_ids": second_prompt}, GREEDY, use_tqdm=False)
    assert second.num_cached_tokens == (len(history) - 1) // 4 * 4 == 28
    # The reference is a cold engine: transformers' `generate` itself departs from its own
    # full forward on this prompt for the tiny gpt-oss (a near tie after a sliding-window cache).
    cold = tiny.llm(enable_prefix_caching=False)
    assert second.token_ids == generate_ids(cold, [second_prompt])[0]
    assert_all_blocks_free(llm)


def test_a_shared_prefix_inside_a_block_is_hit_alone_and_together(tiny):
    # Prompts share 20 tokens: with Gemma-3's per-type layout (full-attention blocks of 12) the
    # hit ends 8 tokens into a full-attention block that holds another prompt's tokens after
    # them, which a hit can only use as a copy, and only once the step that computes that
    # block has run. In one batch over an empty cache (the block is computed in the step the
    # others are admitted in), one after the other (the first's block is cached and free),
    # then in one batch again (the block is in use while the others are admitted). Every
    # output equals a cold engine's.
    shared = tuple(make_prompts(31, lengths=(20,))[0])
    prompts = make_prompts(32, lengths=(9, 7, 11), prefix=shared)
    cold = generate_ids(tiny.llm(enable_prefix_caching=False), prompts)
    llm = tiny.llm()
    assert generate_ids(llm, prompts) == cold
    assert llm.reset_prefix_cache()
    (first,) = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)
    (second,) = llm.generate({"prompt_token_ids": prompts[1]}, GREEDY, use_tqdm=False)
    assert [first.token_ids, second.token_ids] == cold[:2]
    assert second.num_cached_tokens == 20
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [output.token_ids for output in outputs] == cold
    assert_all_blocks_free(llm)


def test_every_prompt_token_is_a_hit_or_a_counted_miss(tiny):
    # A 13-token prompt twice: the first lookup finds nothing ever cached (12 tokens; the last
    # token is always computed), the second hits those 12. LLM.stats and the last step's stats
    # say so; per group, what it alone would hit.
    llm = tiny.llm()
    (prompt,) = make_prompts(41, lengths=(13,))
    llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    first = llm.stats.prefix_misses
    assert (first.never_cached, first.evicted, first.window_tail, first.alignment) == (12, 0, 0, 1)
    (again,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == 12
    misses = llm.stats.prefix_misses
    assert (misses.never_cached, misses.alignment, misses.total) == (12, 2, 14)
    assert llm.stats.num_prefix_hit_tokens + misses.total == llm.stats.num_prefix_query_tokens
    assert llm.step_stats[-1].prefix_misses == misses
    alone = llm.stats.prefix_alone_hit_tokens_per_group
    assert alone == [12] * llm.layout.num_groups
    assert llm.stats.prefix_shortened_tokens_per_group == [0] * llm.layout.num_groups


def test_prefix_hits_preemption_and_chunks_together(tiny):
    shared = tuple(make_prompts(11, lengths=(20,))[0])
    prompts = make_prompts(12, lengths=(3, 9, 25), prefix=shared) + make_prompts(13, (4, 30))
    largest = max(len(p) for p in prompts) + NUM_NEW_TOKENS
    pool = small_pool(tiny, max_num_batched_tokens=8, largest=largest)
    llm = tiny.llm(**pool, max_num_batched_tokens=8, max_num_seqs=3)
    expected = hf_greedy(tiny.hf, prompts)
    assert generate_ids(llm, prompts) == expected
    assert generate_ids(llm, prompts) == expected  # again, now over a warm prefix cache
    assert llm.stats.num_preemptions > 0 and llm.stats.prefix_cache_hit_rate > 0
    assert_all_blocks_free(llm)


def test_longest_prefix_first_admission_gives_the_same_tokens(tiny):
    # "lpm" admits the prompts whose prefix is cached first (here the second batch's prompts
    # that share the first's prefix), with preemption in a small pool: same tokens.
    shared = tuple(make_prompts(51, lengths=(20,))[0])
    warm = make_prompts(52, lengths=(6,), prefix=shared)
    prompts = make_prompts(53, (4, 30)) + make_prompts(54, lengths=(3, 9), prefix=shared)
    largest = max(len(p) for p in prompts) + NUM_NEW_TOKENS
    pool = small_pool(tiny, max_num_batched_tokens=8, largest=largest)
    llm = tiny.llm(**pool, max_num_batched_tokens=8, max_num_seqs=3, scheduling_policy="lpm")
    assert generate_ids(llm, warm) == hf_greedy(tiny.hf, warm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [output.token_ids for output in outputs] == hf_greedy(tiny.hf, prompts)
    assert outputs[3].num_cached_tokens > 0, "a prompt sharing the warm prefix hit it"
    assert llm.stats.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_seeded_sampling_is_reproducible_across_batches_and_preemption(tiny):
    prompts = make_prompts(7, lengths=(24, 26, 28, 30))
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=i) for i in range(4)]
    roomy = tiny.llm(enable_prefix_caching=False)
    cramped = tiny.llm(**small_pool(tiny))
    alone = [generate_ids(roomy, [p], [q])[0] for p, q in zip(prompts, params)]
    assert generate_ids(roomy, prompts, params) == alone
    assert generate_ids(cramped, prompts, params) == alone
    assert cramped.stats.num_preemptions > 0
    assert_all_blocks_free(cramped)


def save_word_tokenizer(folder) -> None:
    """A word-level tokenizer over a few words, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = "the a cat dog sat on mat and ran far".split()
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{word: 3 + i for i, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(folder)


def test_text_prompts_use_the_folder_tokenizer(tmp_path):
    model = hf_model("llama")
    model.save_pretrained(tmp_path)
    save_word_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory="1MiB", max_model_len=128, block_size=4)
    text_output, ids_output = llm.generate(
        ["the cat sat on the mat", {"prompt_token_ids": [3, 5, 7, 8, 3, 9]}],
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        use_tqdm=True,
    )
    assert text_output.prompt_token_ids == [3, 5, 7, 8, 3, 9]
    assert text_output.token_ids == ids_output.token_ids
    expected_text = llm.tokenizer.decode(text_output.token_ids, skip_special_tokens=True)
    assert text_output.text == expected_text and ids_output.text == expected_text
    assert isinstance(text_output.text, str)
    assert_all_blocks_free(llm)


def test_generate_command_runs_a_preset(capsys):
    import json

    from hybrid_cache.cli import main

    flags = ["generate", "--model=tiny-gemma3", "--kv-cache-memory=1MiB", "--max-model-len=128"]
    code = main([*flags, "--max-tokens=5", "--ignore-eos", "--prompt-token-ids=5,6,7", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    (good,) = result["outputs"]
    assert good["finish_reason"] == "length" and len(good["token_ids"]) == 5
    assert good["prompt_token_ids"] == [5, 6, 7] and good["error"] is None
    assert result["summary"]["num_steps"] >= 5


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prompt-token-ids=5,6,7", "--prompt-token-ids="], "InvalidRequestError"),
        (["--prompt-token-ids=5,x"], "comma-separated ints"),
        (["--temperature=-1"], "InvalidSamplingParamsError: temperature"),
        (["--max-tokens=0"], "InvalidSamplingParamsError: max_tokens"),
        (["--num-prompts=0"], "--num-prompts must be a positive integer"),
        (["--chat", "--prompt-token-ids=1,2"], "--chat sends --prompt texts"),
        (["--chat-template=x.jinja", "--prompt=hi"], "--chat-template applies with --chat"),
        (["--device=gpu"], "DeviceUnavailableError"),
        (["--prompt=the cat"], "NoTokenizerError: --prompt is text"),
        (["--chat", "--prompt=the cat"], "NoTokenizerError: --prompt with --chat is text"),
        (["--generation-config=/no/such/folder"], "EngineConfigError: --generation-config"),
    ],
)
def test_generate_command_checks_its_flags_before_the_model_loads(
    capsys, monkeypatch, flags, message
):
    from hybrid_cache.cli import main
    from hybrid_cache.engine import llm as llm_module

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(llm_module, "load_engine_model", no_loading)
    code = main(["generate", "--model=tiny-gemma3", "--kv-cache-memory=1MiB", *flags])
    assert code == 1
    assert message in capsys.readouterr().err


def test_block_table_is_a_zero_copy_view_of_the_core():
    from hybrid_cache._core import GroupSpec
    from hybrid_cache.engine.kv_cache import KVCacheManager
    from hybrid_cache.engine.request import Request

    groups = [GroupSpec("full", 4), GroupSpec("sliding_window", 4, window=8)]
    kv_cache = KVCacheManager(
        num_blocks=64, groups=groups, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16
    )
    core_view = kv_cache.coordinator.block_table()
    assert kv_cache.block_table.data_ptr() == core_view.ctypes.data
    request = Request("r", list(range(3, 23)), GREEDY, 0, max_total_tokens=36)
    row = kv_cache.add(request)
    assert kv_cache.allocate(request, 0, 16)
    full_row, window_row = kv_cache.block_table[0, row], kv_cache.block_table[1, row]
    assert (full_row[:4] > 0).all() and (window_row[:4] > 0).all()
    # Computing 4 more tokens at c=16: the window (8) no longer sees blocks 0-1 (positions 0-7).
    assert kv_cache.allocate(request, 16, 4)
    assert window_row[:2].tolist() == [0, 0] and (window_row[2:5] > 0).all()
    assert (full_row[:5] > 0).all()
    kv_cache.free(request)
    assert kv_cache.num_free_blocks == kv_cache.num_blocks - 1


def test_stop_token_ends_the_request_with_stop():
    llm = LLM("tiny-llama", kv_cache_memory="1MiB", max_model_len=128, block_size=4)
    prompt = {"prompt_token_ids": [11, 12, 13, 14, 15]}
    (free_run,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    # The last token that appears for the first time: stopping there cuts the output short.
    stop_at = max(i for i, t in enumerate(free_run.token_ids) if free_run.token_ids.index(t) == i)
    stop_token = free_run.token_ids[stop_at]
    params = SamplingParams(
        max_tokens=NUM_NEW_TOKENS, temperature=0.0, stop_token_ids=[stop_token], ignore_eos=True
    )
    (stopped,) = llm.generate(prompt, params, use_tqdm=False)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free_run.token_ids[: stop_at + 1]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == NUM_NEW_TOKENS
    assert_all_blocks_free(llm)


def test_engine_logs_its_plan_and_backends(caplog):
    with caplog.at_level(logging.INFO, logger="hybrid_cache.engine"):
        llm = LLM("tiny-gemma3", kv_cache_memory="1MiB", max_model_len=128, block_size=4)
    text = caplog.text
    assert f"KV cache (hybrid): {llm.layout.num_blocks} blocks" in text
    assert "sliding_window(W=16)" in text and "tokens of capacity" in text
    assert "attention backends: group 0" in text and ": torch" in text


def test_step_stats_are_bounded_for_callers_that_never_reset(monkeypatch):
    """A server looping on `step()` must not grow without bound (the soak found ~270 B/step)."""
    from hybrid_cache.engine import llm_engine

    monkeypatch.setattr(llm_engine, "MAX_STEP_STATS", 3)
    llm = LLM(model="tiny-llama", kv_cache_memory="4MiB", max_model_len=256, seed=0)
    llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}],
        SamplingParams(max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(llm.step_stats) == 3
    assert llm.stats.num_steps >= 8
