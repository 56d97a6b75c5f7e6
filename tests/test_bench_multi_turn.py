"""`hybrid-cache bench --workload multi-turn`: the feed, the reuse figures, the budget sweep,
and the flags' typed errors. Small workloads; hit rates are asserted where the allocator makes
them certain (a budget that holds everything), never timings."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.bench.multi_turn import MultiTurnFeed, MultiTurnShape, uniform_history_bytes
from hybrid_cache.bench.settings import BenchSettings
from hybrid_cache.bench.simulate import simulate_mode
from hybrid_cache.cli import main
from hybrid_cache.config import load_model_spec

SHAPE = MultiTurnShape(num_sessions=3, num_turns=3, system_len=16, turn_input_len=24, output_len=8)
SMALL_RUN = [
    "bench",
    "--model",
    "tiny-gemma3",
    "--workload",
    "multi-turn",
    "--num-sessions",
    "3",
    "--num-turns",
    "3",
    "--system-len",
    "16",
    "--turn-input-len",
    "24",
    "--output-len",
    "8",
    "--max-num-batched-tokens",
    "64",
    "--kv-group-layout",
    "equal",
    "--hf-overrides",
    '{"sliding_window": 32}',
]


def finish(feed: MultiTurnFeed, request_id: str, prompt: list[int], hit: int, output: list[int]):
    feed.record(
        SimpleNamespace(
            request_id=request_id,
            prompt_token_ids=prompt,
            output_token_ids=output,
            num_cached_tokens=hit,
        )
    )


def gpt_oss_at_a_third(**flags):
    """The hybrid engine, simulated, on BENCHMARKS.md's multi-turn workload (12 sessions x 4
    turns, windows of 64) with tiny-gpt-oss at a third of what uniform needs (2.25 MiB)."""
    shape = MultiTurnShape(
        num_sessions=12, num_turns=4, system_len=64, turn_input_len=96, output_len=32
    )
    settings = BenchSettings.for_multi_turn(
        "tiny-gpt-oss",
        shape,
        kv_cache_memory="2.25MiB",
        hf_overrides={"sliding_window": 64},
        **flags,
    )
    return simulate_mode(settings, "hybrid")


def test_feed_resends_the_history_wave_by_wave() -> None:
    feed = MultiTurnFeed(SHAPE, vocab_size=100, seed=3)
    first = feed.next_prompts()
    assert [request_id for request_id, _ in first] == ["s0-t0", "s1-t0", "s2-t0"]
    assert all(len(prompt) == SHAPE.prompt_len(0) == 40 for _, prompt in first)
    system = first[0][1][:16]
    assert all(prompt[:16] == system for _, prompt in first), "one shared system prompt"
    assert first[0][1][16:] != first[1][1][16:], "sessions differ after it"
    for index, (request_id, prompt) in enumerate(first[:2]):
        finish(feed, request_id, prompt, 0, [50 + index] * 8)
    assert feed.next_prompts() == [], "the next wave waits for the whole turn"
    finish(feed, *first[2], 0, [52] * 8)
    second = dict(feed.next_prompts())
    assert len(second["s1-t1"]) == SHAPE.prompt_len(1) == 72
    assert second["s1-t1"][:48] == first[1][1] + [51] * 8, "history: prompt, then outputs"
    assert not feed.exhausted
    for request_id, prompt in second.items():
        finish(feed, request_id, prompt, 32, [7] * 8)
    turns = feed.reuse.turns
    assert turns[1].reusable_tokens == 3 * (40 + 8 - 1), "the last output was never computed"
    assert turns[1].hit_tokens == 3 * 32
    assert feed.reuse.hit_rate == pytest.approx(96 / 141)
    assert turns[0].hit_rate is None


def test_the_net_rate_counts_what_a_preempted_request_recomputed() -> None:
    """A request that hit at first and, preempted, resumed with less recomputed the difference:
    the net rate counts the fewest tokens any of its schedulings took from the cache. Over the
    engine (tiny-gpt-oss at a third of uniform's memory, where "lpm" without admission
    headroom preempts newcomers to keep held histories) the net figure is lower than the
    first-scheduling one, and equal to it where nothing was preempted ("fcfs")."""
    feed = MultiTurnFeed(SHAPE, vocab_size=100, seed=3)
    for request_id, prompt in feed.next_prompts():
        finish(feed, request_id, prompt, 0, [5] * 8)
    second = feed.next_prompts()
    for index, (request_id, prompt) in enumerate(second):
        feed.record(
            SimpleNamespace(
                request_id=request_id,
                prompt_token_ids=prompt,
                output_token_ids=[7] * 8,
                num_cached_tokens=40,
                min_cached_tokens=0 if index == 0 else 40,  # the first recomputed everything
            )
        )
    assert feed.reuse.hit_tokens == 120 and feed.reuse.net_hit_tokens == 80
    assert feed.reuse.net_hit_rate == pytest.approx(80 / 141)
    assert feed.reuse.to_dict()["turns"][1]["net_hit_tokens"] == 80

    lpm, fcfs = (
        gpt_oss_at_a_third(scheduling_policy=policy, admission_headroom="off")
        for policy in ("lpm", "fcfs")
    )
    assert lpm.num_preemptions > 0 and lpm.reuse.net_hit_tokens < lpm.reuse.hit_tokens
    assert fcfs.num_preemptions == 0 and fcfs.reuse.net_hit_tokens == fcfs.reuse.hit_tokens


def test_admission_headroom_keeps_the_newcomers_lpm_preempted() -> None:
    """BENCHMARKS.md ("Admission headroom"): on the same workload, without the headroom two
    newcomers are admitted into the last free blocks and preempted at the next step, and
    resume with their histories evicted (net 83.9%); with it (the default for a model with
    windowed layers) they wait for the running requests instead, and the net rate clears the
    85% asked at a third of uniform's memory."""
    off, default = gpt_oss_at_a_third(admission_headroom="off"), gpt_oss_at_a_third()
    assert off.reuse.net_hit_rate < 0.85 <= default.reuse.net_hit_rate, (
        off.reuse.to_dict(),
        default.reuse.to_dict(),
    )
    assert default.num_preemptions < off.num_preemptions


def test_feed_ends_after_the_last_turn() -> None:
    feed = MultiTurnFeed(SHAPE, vocab_size=100, seed=0)
    for _ in range(SHAPE.num_turns):
        wave = feed.next_prompts()
        assert len(wave) == 3
        for request_id, prompt in wave:
            finish(feed, request_id, prompt, 0, [9] * 8)
    assert feed.exhausted and feed.next_prompts() == []
    assert len(feed.reuse.turns) == 3


def test_uniform_history_bytes_counts_every_layer() -> None:
    spec = load_model_spec("tiny-gemma3")
    per_token = sum(layer.bytes_per_token() for layer in spec.layers)
    assert uniform_history_bytes(spec, SHAPE) == 3 * (16 + 3 * 32 - 1) * per_token


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_sessions": 0}, "--num-sessions must be a positive integer"),
        ({"num_turns": -1}, "--num-turns must be a positive integer"),
        ({"system_len": -3}, "--system-len must be 0 or more"),
        ({"turn_input_len": True}, "--turn-input-len must be a positive integer"),
    ],
)
def test_shape_rejects_bad_sizes(changes, message) -> None:
    sizes = (
        dict(num_sessions=2, num_turns=2, system_len=0, turn_input_len=4, output_len=2) | changes
    )
    with pytest.raises(BenchConfigError, match=message):
        MultiTurnShape(**sizes)


def test_max_model_len_must_hold_the_last_turn() -> None:
    with pytest.raises(BenchConfigError, match="a session's last turn"):
        BenchSettings.for_multi_turn("tiny-llama", SHAPE, max_model_len=100)
    settings = BenchSettings.for_multi_turn("tiny-llama", SHAPE)
    assert settings.context_len == SHAPE.max_total_tokens == 112
    assert settings.num_prompts == 9 and settings.workload == "multi-turn"


@pytest.mark.parametrize("token_tails", [True, False])
@pytest.mark.parametrize("layout", ["equal", "auto"])
def test_a_budget_that_holds_everything_hits_every_history(layout, token_tails) -> None:
    """With room for every history, each turn after the first hits all of its reusable tokens
    (with token tails, the default), or them rounded down to the smallest block size (16)
    without, with equal groups and with the default per-type layout (Gemma-3's full-attention
    blocks of 80 tokens are keyed by 16-token units): the simulation runs the real scheduler and
    allocator."""
    settings = BenchSettings.for_multi_turn(
        "tiny-gemma3",
        SHAPE,
        kv_cache_memory="4MiB",
        kv_group_layout=layout,
        hf_overrides={"sliding_window": 32},
        token_tails=token_tails,
    )
    for mode in ("hybrid", "uniform"):
        result = simulate_mode(settings, mode)
        reuse = result.reuse
        assert result.num_requests == 9
        for turn in reuse.turns[1:]:
            assert turn.reusable_tokens == 3 * (SHAPE.prompt_len(turn.turn - 1) + 8 - 1)
            # Each session hits its reusable tokens (without tails: rounded down to a block).
            reusable = SHAPE.prompt_len(turn.turn - 1) + 8 - 1
            expected = 3 * (reusable if token_tails else reusable // 16 * 16)
            assert turn.hit_tokens == expected, (mode, turn)
        # Sessions 1 and 2 hit the system prompt, which they share with session 0 in the step
        # that computes it; with the per-type layout it ends inside a full-attention block
        # that would have to be copied before it is computed, so that hit waits a step.
        per_type = mode == "hybrid" and layout == "auto"
        assert reuse.turns[0].hit_tokens == (0 if per_type else 2 * 16)
        counters = result.cache_counters
        misses = sum(counters[name] for name in counters if name.startswith("prefix_miss_"))
        assert counters["prefix_hits"] + misses == counters["prefix_queries"]


def test_lpm_admission_and_holds_keep_the_histories_first_come_first_served_evicts() -> None:
    """8 sessions served in waves over a pool that holds a few histories: first come first
    served admits each wave's misses first, and their blocks evict the histories the later
    sessions would hit; longest-prefix-first admits the hits first, and holds keep each
    waiting session's history from being evicted whatever the order."""
    shape = MultiTurnShape(
        num_sessions=8, num_turns=4, system_len=16, turn_input_len=48, output_len=16
    )
    rates = {}
    for policy, hold in (("fcfs", False), ("lpm", False), ("fcfs", True)):
        settings = BenchSettings.for_multi_turn(
            "tiny-gemma3",
            shape,
            kv_cache_memory="768KiB",
            hf_overrides={"sliding_window": 32},
            scheduling_policy=policy,
            hold_waiting_prefixes=hold,
        )
        result = simulate_mode(settings, "hybrid")
        assert result.num_requests == 32
        rates[policy, hold] = result.reuse.hit_rate
    assert rates["lpm", False] > rates["fcfs", False] + 0.1, rates
    assert rates["fcfs", True] > rates["fcfs", False] + 0.2, rates


def test_protected_chains_keep_round_robin_sessions_hitting_where_lru_flushes() -> None:
    """12 sessions served one at a time (`max_num_seqs` 1: nothing waits holding a hit), a pool
    of a third of what uniform needs (BENCHMARKS.md, "Protected chains"): plain LRU evicts each
    history just before its session comes back, so only the system prompt hits after the first
    turns; protected chains keep a fixed subset of the sessions whole. In arrival order
    (`fcfs`): "lpm" would take the sessions whose histories are cached first, which is not the
    round robin this pattern stands for."""
    rates = {}
    for fraction in (0.0, 0.75):
        result = gpt_oss_at_a_third(
            max_num_seqs=1, scheduling_policy="fcfs", protected_prefix_fraction=fraction
        )
        assert result.num_requests == 48
        rates[fraction] = result.reuse
    lru, protected = rates[0.0], rates[0.75]
    # LRU: the last turn hits little beyond the system prompt (64 of ~447 tokens a session).
    assert lru.turns[3].hit_rate < 0.2, lru.to_dict()
    assert protected.turns[3].hit_rate > 0.5, protected.to_dict()
    assert protected.hit_rate > lru.hit_rate + 0.3


def test_the_default_layout_reuses_as_much_as_equal_groups_in_a_tight_pool() -> None:
    """The multi-turn benchmark of BENCHMARKS.md at a sixth of uniform's memory: with per-type
    blocks (80 tokens for the full-attention layer) each history costs more pages (its last
    block, and a system prompt that ends inside a block and is not shared), so fewer histories
    survive a wave; "auto" plans equal groups for a pool this small and reuses what they do."""
    shape = MultiTurnShape(
        num_sessions=12, num_turns=4, system_len=64, turn_input_len=96, output_len=32
    )
    rates = {}
    for layout in ("auto", "equal", "per-type"):
        settings = BenchSettings.for_multi_turn(
            "tiny-gemma3",
            shape,
            kv_cache_memory="1.75MiB",
            kv_group_layout=layout,
            hf_overrides={"sliding_window": 64},
        )
        result = simulate_mode(settings, "hybrid")
        assert result.num_requests == 48
        rates[layout] = result.reuse.hit_rate
    assert rates["equal"] > rates["per-type"] + 0.05, rates
    assert rates["auto"] >= rates["equal"], rates


def test_multi_turn_bench_on_the_engine_reports_reuse(tmp_path, capsys) -> None:
    json_path = tmp_path / "multi.json"
    assert main([*SMALL_RUN, "--kv-cache-memory", "1MiB", "--output-json", str(json_path)]) == 0
    printed = capsys.readouterr().out
    assert "Multi-turn workload: 3 sessions x 3 turns" in printed
    assert printed.count("Reusable-token hit rate:") == 2, printed
    document = json.loads(json_path.read_text())
    for result in document["results"].values():
        assert result["num_requests"] == 9
        reuse = result["reuse"]
        assert [turn["turn"] for turn in reuse["turns"]] == [0, 1, 2]
        assert 0 < reuse["reusable_hit_rate"] <= 1
        counters = result["cache_counters"]
        assert counters["prefix_queries"] > 0
        assert len(counters["prefix_alone_hits_per_group"]) == len(result["group_kinds"])
    assert printed.count("Prompt tokens looked up: hit ") == 2, printed
    assert "each group alone would hit: " in printed
    # Each later turn ends on the previous turn's token tails, and the line says so.
    tails = [
        result["cache_counters"]["prefix_tail_hits"] for result in document["results"].values()
    ]
    assert all(count > 0 for count in tails), tails
    assert printed.count("hits ended on token tails (+") == 2, printed


def test_budget_sweep_prints_a_row_per_budget_and_plots(tmp_path, capsys) -> None:
    plot = tmp_path / "sweep.png"
    json_path = tmp_path / "sweep.json"
    args = [*SMALL_RUN, "--simulate", "--kv-cache-memory", "256KiB, 1MiB"]
    assert main([*args, "--plot", str(plot), "--output-json", str(json_path)]) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("== budget sweep ==") :].splitlines()
    assert table[1].split()[:3] == ["budget", "hybrid", "hit"]
    assert [row.split()[0] for row in table[2:4]] == ["256KiB", "1MiB"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = json.loads(json_path.read_text())["sweep"]
    assert [point["settings"]["kv_cache_memory"] for point in sweep] == ["256KiB", "1MiB"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--input-len", "8"], "--input-len belongs to the random workload"),
        (["--num-prompts", "8"], "--num-prompts belongs to the random workload"),
        (["--prefix-len", "8"], "--prefix-len belongs to the random workload"),
        (["--num-sessions", "0"], "--num-sessions must be a positive integer"),
        (["--kv-cache-memory", "1MiB,,2MiB"], "has an empty entry"),
        (["--kv-cache-memory", "1MiB,2XB"], "MemorySizeError"),
        (["--max-model-len", "50"], "a session's last turn"),
        (["--scheduling-policy", "lifo"], "--scheduling-policy must be one of fcfs, lpm"),
    ],
)
def test_bad_multi_turn_flags_give_typed_errors(extra, message, capsys) -> None:
    assert main([*SMALL_RUN, *extra]) == 1
    assert message in capsys.readouterr().err


def test_random_workload_flags_are_still_required(capsys) -> None:
    base = ["bench", "--model", "tiny-llama", "--output-len", "4"]
    assert main([*base, "--input-len", "8"]) == 1
    assert "--num-prompts is required" in capsys.readouterr().err
    assert main([*base, "--input-len", "8", "--num-prompts", "2", "--turn-input-len", "4"]) == 1
    assert "add --workload multi-turn" in capsys.readouterr().err
    assert (
        main(["bench", "--model", "tiny-llama", "--workload", "multi-turn", "--output-len", "4"])
        == 1
    )
    assert "needs --turn-input-len" in capsys.readouterr().err
