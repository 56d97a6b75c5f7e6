"""`hybrid-cache bench serve` against a real server: every request completes with exactly
`--output-len` tokens, the figures and the JSON file are written, the shared-prefix and
multi-turn workloads hit the prefix cache; bad flags and an unreachable server are typed
errors (exit 1)."""

from __future__ import annotations

import json

import pytest
from hybrid_cache.cli import main
from hybrid_cache.entrypoints.api_server import ServerSettings
from serve_harness import make_llm, running_server

KEY = "bench-key"


@pytest.fixture(scope="module")
def url(serve_model_folder):
    folder = serve_model_folder
    with running_server(make_llm(folder), ServerSettings(api_key=KEY)) as (base_url, _):
        yield base_url


def bench(url, tmp_path, *flags) -> dict:
    path = tmp_path / "serve.json"
    code = main(
        ["bench", "serve", "--base-url", url, "--api-key", KEY, "--output-json", str(path), *flags]
    )
    assert code == 0
    return json.loads(path.read_text())


def test_random_workload(url, tmp_path, capsys):
    results = bench(
        url, tmp_path, "--num-prompts", "12", "--input-len", "32", "--output-len", "8",
        "--max-concurrency", "4", "--request-rate", "200",
    )  # fmt: skip
    assert results["completed"] == 12 and results["failed"] == 0
    assert results["total_output_tokens"] == 12 * 8
    assert results["total_input_tokens"] == 12 * 32
    for name in ("ttft", "tpot", "itl"):
        figures = results[name]
        assert 0 < figures["median_ms"] <= figures["p99_ms"]
    assert results["output_throughput"] == pytest.approx(96 / results["duration_s"])
    printed = capsys.readouterr().out
    assert "Output token throughput" in printed and "TTFT" in printed


def test_shared_prefix_workload_hits_the_prefix_cache(url, tmp_path):
    results = bench(
        url, tmp_path, "--workload", "shared-prefix", "--num-prompts", "8",
        "--input-len", "64", "--prefix-len", "48", "--output-len", "4", "--max-concurrency", "2",
    )  # fmt: skip
    assert results["completed"] == 8
    assert results["cached_prompt_tokens"] >= 7 * 32  # the later ones reuse whole blocks


def test_multi_turn_workload_reports_reuse(url, tmp_path):
    results = bench(
        url, tmp_path, "--workload", "multi-turn", "--num-sessions", "3", "--num-turns", "3",
        "--system-len", "16", "--turn-input-len", "12", "--output-len", "6",
    )  # fmt: skip
    assert results["completed"] == 9
    reuse = results["multi_turn_reuse"]
    assert len(reuse["turns"]) == 3 and reuse["reusable_hit_rate"] > 0


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--workload", "shared-prefix"], "--prefix-len"),
        (["--max-concurrency", "0"], "--max-concurrency"),
        (["--request-rate", "-1"], "--request-rate"),
        (["--turn-input-len", "4"], "multi-turn"),
    ],
)
def test_bad_flags(url, flags, says, capsys):
    assert main(["bench", "serve", "--base-url", url, *flags]) == 1
    assert says in capsys.readouterr().err


def test_a_server_that_is_not_there(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_a_wrong_key_is_reported(url, capsys):
    assert main(["bench", "serve", "--base-url", url, "--api-key", "nope"]) == 1
    assert "401" in capsys.readouterr().err
