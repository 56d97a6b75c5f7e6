"""`hybrid-cache bench` and the `hybrid_cache.bench` parts: small, fast workloads only.

Figures are never asserted against timings (benchmarks are scripts); these tests check that the
command runs and reports, that the simulation's concurrency follows the allocator, that the cost
model moves the right way, and that bad flags give typed errors.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from hybrid_cache.bench.cost_model import CostModel, Hardware, count_parameters
from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.bench.settings import BenchSettings
from hybrid_cache.bench.simulate import SimulatedRunner, simulate_mode
from hybrid_cache.bench.workload import make_prompts
from hybrid_cache.cli import main
from hybrid_cache.config import load_model_spec
from hybrid_cache.engine import llm_engine
from hybrid_cache.engine.llm_engine import LLMEngine

THROUGHPUT_LINE = re.compile(
    r"^Throughput: [0-9.]+ requests/s, [0-9.]+ total tokens/s, [0-9.]+ output tokens/s$", re.M
)
TINY_RUN = [
    "bench",
    "--model",
    "tiny-gemma2",
    "--input-len",
    "40",
    "--output-len",
    "4",
    "--num-prompts",
    "4",
    "--kv-cache-memory",
    "1MiB",
    "--max-num-batched-tokens",
    "64",
]


def test_bench_runs_both_modes_and_prints_throughput(tmp_path, capsys) -> None:
    json_path = tmp_path / "bench.json"
    assert main([*TINY_RUN, "--kv-cache-mode", "both", "--output-json", str(json_path)]) == 0
    printed = capsys.readouterr().out
    assert len(THROUGHPUT_LINE.findall(printed)) == 2, printed
    assert "== hybrid" in printed and "== uniform" in printed
    assert "Hybrid/uniform:" in printed and "Peak blocks per group" in printed

    document = json.loads(json_path.read_text())
    assert document["settings"]["model"] == "tiny-gemma2"
    assert set(document["results"]) == {"hybrid", "uniform"}
    for mode, result in document["results"].items():
        assert result["num_requests"] == 4
        assert result["num_prompt_tokens"] == 4 * 40 and result["num_output_tokens"] == 4 * 4
        assert result["total_tokens_per_s"] > 0 and result["output_tokens_per_s"] > 0
        for key in ("num_preemptions", "mean_running", "prefix_cache_hit_rate"):
            assert key in result, (mode, key)
        assert len(result["steps"]["running"]) == result["num_steps"] > 0
        assert len(result["peak_blocks_per_group"]) == len(result["group_kinds"])
        assert 0.0 <= result["engine_overhead_share"] < 1.0
        # The LM head is timed on every step that samples (every step here) and counted as
        # model time; the share with it counted as engine time is larger.
        steps = result["steps"]
        assert len(steps["logits_time_s"]) == result["num_steps"]
        assert all(t > 0 for t in steps["logits_time_s"])
        assert all(
            f + h <= s
            for f, h, s in zip(
                steps["forward_time_s"], steps["logits_time_s"], steps["step_time_s"]
            )
        )
        assert (
            result["engine_overhead_share_at_max_running_lm_head_as_engine"]
            > result["engine_overhead_share_at_max_running"]
        )
    assert len(document["results"]["hybrid"]["group_kinds"]) == 2  # sliding + full
    assert document["ratio"]["total_tokens_per_s"] > 0


def test_repeat_alternates_modes_and_keeps_every_time(tmp_path, capsys) -> None:
    json_path = tmp_path / "bench.json"
    args = [*TINY_RUN, "--num-prompts", "2", "--repeat", "2", "--output-json", str(json_path)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "fastest of 2 alternating runs" in printed
    assert "per pair of neighbouring runs: median" in printed
    document = json.loads(json_path.read_text())
    every = document["elapsed_s_of_every_run"]
    assert len(every["hybrid"]) == len(every["uniform"]) == 2
    assert document["results"]["hybrid"]["elapsed_s"] == min(every["hybrid"])
    pairs = document["ratio_total_tokens_per_s_of_each_pair"]
    assert pairs == [u / h for h, u in zip(every["hybrid"], every["uniform"])]


def test_shared_prefix_is_hit_in_the_prefix_cache(capsys) -> None:
    args = [*TINY_RUN, "--kv-cache-mode", "hybrid", "--prefix-len", "32"]
    args[args.index("--max-num-batched-tokens") + 1] = "40"  # one prompt per step
    assert main(args) == 0
    printed = capsys.readouterr().out
    rate = float(re.search(r"prefix-cache hit rate: ([0-9.]+)%", printed).group(1))
    assert rate > 0.0, printed


def test_plot_writes_a_png(tmp_path) -> None:
    png = tmp_path / "plot.png"
    args = ["bench", "--simulate", "--model", "gemma-2-27b", "--input-len", "512"]
    args += ["--output-len", "8", "--num-prompts", "4", "--plot", str(png)]
    assert main(args) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def simulated(model: str, mode: str) -> object:
    settings = BenchSettings(model, 2048, 32, 16, kv_cache_memory="4GB")
    return simulate_mode(settings, mode)


def test_simulation_gives_gemma3_more_concurrency_with_hybrid() -> None:
    hybrid, uniform = simulated("gemma-3-27b", "hybrid"), simulated("gemma-3-27b", "uniform")
    assert hybrid.num_output_tokens == uniform.num_output_tokens == 16 * 32
    assert hybrid.mean_running > uniform.mean_running
    assert max(hybrid.running_per_step) > max(uniform.running_per_step)
    assert hybrid.total_tokens_per_s > uniform.total_tokens_per_s


def test_simulation_gives_llama_equal_concurrency() -> None:
    hybrid, uniform = simulated("llama-3.1-8b", "hybrid"), simulated("llama-3.1-8b", "uniform")
    assert hybrid.running_per_step == uniform.running_per_step
    assert hybrid.elapsed_s == pytest.approx(uniform.elapsed_s)


def test_simulation_steps_through_the_engine(monkeypatch) -> None:
    """Each simulated step is one `LLMEngine.step()` and one `SimulatedRunner.execute`, no
    `ModelRunner` is built (no weights, no KV tensors), and the figures are those the
    simulation gave before it ran through the engine (its own scheduler loop)."""
    calls = {"step": 0, "execute": 0}
    step, execute = LLMEngine.step, SimulatedRunner.execute

    def counted_step(engine):
        calls["step"] += 1
        return step(engine)

    def counted_execute(runner, output):
        calls["execute"] += 1
        return execute(runner, output)

    def no_model_runner(*args, **kwargs):
        raise AssertionError("the simulation must not build a ModelRunner")

    monkeypatch.setattr(LLMEngine, "step", counted_step)
    monkeypatch.setattr(SimulatedRunner, "execute", counted_execute)
    monkeypatch.setattr(llm_engine, "ModelRunner", no_model_runner)
    settings = BenchSettings("gemma-3-27b", 2048, 32, 16, prefix_len=512, kv_cache_memory="4GB")
    result = simulate_mode(settings, "uniform")
    assert calls["step"] == calls["execute"] == result.num_steps == 131
    # The 2 preempted requests resume from every token they computed (their token tails):
    # 23 tokens fewer than resuming from their last full block (25607 with --no-token-tails).
    assert sum(result.running_per_step) == 522 and sum(result.tokens_per_step) == 25584
    assert result.num_preemptions == 2 and result.peak_blocks_per_group == [611]
    # 15 requests hit the 512-token prefix, the 2 preempted ones hit again when readmitted;
    # lookups that did not lead to computing are not counted (once per admission).
    assert result.prefix_cache_hit_rate == pytest.approx(0.2775336371527778)
    assert result.num_requests == 16 and result.num_output_tokens == 16 * 32
    assert result.elapsed_s == pytest.approx(5.802352737636241, rel=1e-9)
    without = simulate_mode(dataclasses.replace(settings, token_tails=False), "uniform")
    assert sum(without.tokens_per_step) == 25607
    assert without.prefix_cache_hit_rate == pytest.approx(0.2769097222222222)


def test_simulation_rejects_a_request_larger_than_the_pool() -> None:
    settings = BenchSettings("gemma-2-27b", 6144, 1024, 2, kv_cache_memory="100MB")
    with pytest.raises(BenchConfigError, match=r"6144\+1024 tokens does not fit the hybrid"):
        simulate_mode(settings, "hybrid")


def test_simulate_prints_the_ratio(capsys) -> None:
    args = ["bench", "--simulate", "--model", "gpt-oss-120b", "--input-len", "1024"]
    assert main([*args, "--output-len", "16", "--num-prompts", "8"]) == 0
    printed = capsys.readouterr().out
    assert "(simulated;" in printed and len(THROUGHPUT_LINE.findall(printed)) == 2
    assert re.search(r"Hybrid/uniform: [0-9.]+x total tokens/s", printed)


def test_cost_model_is_monotonic() -> None:
    cost = CostModel(load_model_spec("gemma-2-27b"), Hardware())
    decode = cost.step_time([(4000, 1)] * 8)
    assert cost.step_time([(4000, 1)] * 16) > decode  # more requests
    assert cost.step_time([(8000, 1)] * 8) > decode  # longer contexts
    assert cost.step_time([(0, 512)]) > cost.step_time([(0, 256)])  # more prefill tokens
    assert cost.step_time([]) == 0.0
    # Weights are read once a step: per-token cost falls as the batch grows.
    assert cost.step_time([(4000, 1)] * 16) / 16 < decode / 8
    # Sliding-window layers read at most the window; full-attention layers the whole context.
    full_only = CostModel(load_model_spec("llama-3.1-8b"), Hardware())
    growth_full = full_only.kv_bytes_attended(20000, 1) / full_only.kv_bytes_attended(10000, 1)
    growth_hybrid = cost.kv_bytes_attended(20000, 1) / cost.kv_bytes_attended(10000, 1)
    assert growth_full == pytest.approx(2.0) and growth_hybrid < 2.0


def test_parameter_counts_and_gpu_budget() -> None:
    assert 7.9e9 < count_parameters(load_model_spec("llama-3.1-8b")).total < 8.1e9
    assert 26e9 < count_parameters(load_model_spec("gemma-2-27b")).total < 28e9
    moe = count_parameters(load_model_spec("gpt-oss-120b"))
    assert 110e9 < moe.total < 125e9 and moe.active < moe.total / 10
    assert Hardware().kv_cache_budget(60 * 10**9) == 12 * 10**9


def test_the_lm_head_is_counted_unless_the_spec_ties_it() -> None:
    spec = load_model_spec("tiny-gemma3")  # tied: the head is the embedding
    assert spec.tie_word_embeddings
    untied = dataclasses.replace(spec, tie_word_embeddings=False)
    head = spec.vocab_size * spec.hidden_size
    assert count_parameters(untied).total - count_parameters(spec).total == head
    with pytest.raises(BenchConfigError, match="--kv-cache-memory"):
        Hardware().kv_cache_budget(75 * 10**9)


def test_prompts_share_the_prefix_and_are_seeded() -> None:
    prompts = make_prompts(3, 10, 4, 100, seed=1)
    assert all(len(p) == 10 and p[:4] == prompts[0][:4] for p in prompts)
    assert prompts[1][4:] != prompts[2][4:]
    assert prompts == make_prompts(3, 10, 4, 100, seed=1) != make_prompts(3, 10, 4, 100, seed=2)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--prefix-len", "41"], "BenchConfigError: --prefix-len"),
        (["--max-model-len", "30"], "BenchConfigError: --max-model-len"),
        (["--kv-cache-memory", "12XB"], "MemorySizeError"),
        (["--hf-overrides", "[1]"], "error: ConfigError: --hf-overrides"),
        (["--plot", "out.jpg"], "BenchConfigError: --plot"),
        (["--simulate", "--compare-hf"], "BenchConfigError: --compare-hf"),
        (["--block-size", "0"], "BenchConfigError: --block-size"),
        (["--repeat", "0"], "BenchConfigError: --repeat"),
        (["--interleave", "--simulate"], "BenchConfigError: --interleave"),
        (["--interleave", "--kv-cache-mode", "hybrid"], "BenchConfigError: --interleave"),
        (["--model", "no-such-model"], "UnknownModelError"),
    ],
)
def test_bad_flags_give_typed_errors(extra, message, capsys) -> None:
    assert main([*TINY_RUN, *extra]) == 1
    assert message in capsys.readouterr().err


def test_settings_reject_an_unknown_group_layout() -> None:
    with pytest.raises(BenchConfigError, match="--kv-group-layout must be one of auto, equal"):
        BenchSettings("tiny-llama", 8, 4, 1, kv_group_layout="sideways")


def test_settings_reject_non_positive_lengths() -> None:
    with pytest.raises(BenchConfigError, match="--output-len must be a positive integer"):
        BenchSettings("tiny-llama", 8, 0, 1)


def test_repeat_runs_the_modes_in_abba_order(monkeypatch) -> None:
    """hybrid, uniform, uniform, hybrid, ...: neither mode always runs first after a pause."""
    from types import SimpleNamespace

    from hybrid_cache.commands import bench as bench_command

    order = []

    def fake_run_mode(args, settings, mode):
        order.append(mode)
        return SimpleNamespace(elapsed_s=float(len(order)))

    monkeypatch.setattr(bench_command, "run_mode", fake_run_mode)
    args = SimpleNamespace(repeat=4, kv_cache_mode="both", interleave=False)
    results, every = bench_command.run_modes(args, settings=None)
    assert order == ["hybrid", "uniform", "uniform", "hybrid"] * 2
    assert every == {"hybrid": [1.0, 4.0, 5.0, 8.0], "uniform": [2.0, 3.0, 6.0, 7.0]}
    assert results["hybrid"].elapsed_s == 1.0 and results["uniform"].elapsed_s == 2.0


def test_pair_ratios_need_both_modes_and_two_repeats() -> None:
    from hybrid_cache.bench.report import format_pair_ratios, pair_ratios

    assert pair_ratios({"hybrid": [1.0], "uniform": [2.0]}) is None
    assert pair_ratios({"hybrid": [1.0, 2.0]}) is None
    ratios = pair_ratios({"hybrid": [1.0, 2.0, 4.0], "uniform": [2.0, 3.0, 4.0]})
    assert ratios == [2.0, 1.5, 1.0]
    assert "median 1.50x (from 1.00x to 2.00x over 3 pairs)" in format_pair_ratios(ratios)


def test_warm_up_meets_every_split_count_on_cuda_only() -> None:
    from hybrid_cache.bench.engine_run import warm_up_batches

    assert warm_up_batches("cpu", 64, 256) == [1]
    assert warm_up_batches("cuda", 64, 256) == [1, 2, 4, 8, 16, 32, 64]
    assert warm_up_batches("cuda", 100, 48) == [1, 2, 4, 8, 16, 32, 48]
    assert warm_up_batches("cuda", 1, 256) == [1]


def test_timers_synchronise_the_device_before_reading_the_clock() -> None:
    """On CUDA the model's kernels run asynchronously: the hooks synchronise first, so model
    time is the kernels' time (a counting stand-in here; the CPU needs none)."""
    import torch
    from hybrid_cache.bench import engine_run

    calls = []

    class Model(torch.nn.Linear):
        def compute_logits(self, hidden):
            return hidden.sum()

    model = Model(4, 4)
    forward = engine_run.ForwardTimer(model, lambda: calls.append("forward"))
    logits = engine_run.LogitsTimer(model, lambda: calls.append("logits"))
    model.compute_logits(model(torch.ones(2, 4)))
    assert calls == ["forward", "forward", "logits", "logits"]
    assert forward.take() > 0 and logits.take() > 0 and forward.take() == 0
    forward.remove()
    logits.remove()
    model(torch.ones(2, 4))
    assert len(calls) == 4
    assert engine_run.synchronizer("cpu") is engine_run._no_sync
    assert engine_run.synchronizer(torch.device("cuda", 0)) is not engine_run._no_sync


def test_the_forward_timer_times_replayed_decode_graphs() -> None:
    """A decode step replayed from a graph calls no module forward: the timer wraps the graphs'
    `run` (device synchronised at both ends; its host time apart) and unwraps it on removal."""
    import time

    import torch
    from hybrid_cache.bench import engine_run

    class Graphs:
        def run(self, *args):
            time.sleep(0.01)
            return "hidden"

    calls, graphs = [], Graphs()
    timer = engine_run.ForwardTimer(torch.nn.Linear(2, 2), lambda: calls.append("sync"), graphs)
    assert graphs.run(1, 2) == "hidden"
    assert calls == ["sync", "sync"]
    forward, issue = timer.take(), timer.take_issue()
    assert forward >= issue >= 0.01 and timer.take() == timer.take_issue() == 0
    timer.remove()
    assert "run" not in vars(graphs) and graphs.run() == "hidden" and len(calls) == 2


def test_the_group_layout_flag_reaches_the_engine() -> None:
    import argparse

    from hybrid_cache.bench.engine_run import build_llm
    from hybrid_cache.commands import bench as bench_command

    parser = argparse.ArgumentParser()
    bench_command.register(parser.add_subparsers())
    flags = ["bench", "--model", "tiny-gemma3", "--input-len", "8", "--output-len", "4"]
    flags += ["--num-prompts", "1", "--kv-cache-memory", "1MiB", "--max-model-len", "64"]
    for layout, groups in (("equal", 6), ("auto", 2)):
        args = parser.parse_args([*flags, "--kv-group-layout", layout])
        settings = bench_command.settings_from_args(args, args.kv_cache_memory)
        assert settings.kv_group_layout == layout
        assert build_llm(settings, "hybrid").layout.num_groups == groups
