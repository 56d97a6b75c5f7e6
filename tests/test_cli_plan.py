"""`hybrid-cache plan` through `main([...])` and `python -m hybrid_cache`."""

import json
import subprocess
import sys

import pytest
from hybrid_cache.cli import main
from hybrid_cache.config import load_model_spec
from hybrid_cache.planner import PlanOptions, plan_kv_cache, report_plan

GEMMA3 = [
    "plan",
    "--model",
    "gemma-3-27b",
    "--kv-cache-memory",
    "40GiB",
    "--max-model-len",
    "32768",
]


def run_json(capsys, *extra):
    assert main([*GEMMA3, "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_text_table_shows_both_modes_side_by_side(capsys):
    assert main(GEMMA3) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "hybrid" in line and "uniform" in line)
    assert header.index("hybrid") < header.index("uniform")
    concurrency = next(line for line in out.splitlines() if line.startswith("max concurrency"))
    assert concurrency.split()[-2:] == ["10", "2"]
    assert "memory efficiency" in out and "97.96%" in out
    assert "hybrid groups" in out and "uniform groups" in out
    assert "0-61" in out, "the uniform group lists every layer"


def test_json_matches_the_library(capsys):
    result = run_json(capsys)
    model = load_model_spec("gemma-3-27b")
    layout = plan_kv_cache(model, PlanOptions("40GiB", 32768))
    report = report_plan(layout, model)
    hybrid = result["hybrid"]
    assert hybrid["num_blocks"] == layout.num_blocks
    assert hybrid["page_bytes"] == layout.page_bytes == 131072
    assert hybrid["report"]["max_concurrency"] == report.max_concurrency
    assert [g["layer_indices"] for g in hybrid["groups"]] == [
        list(g.layer_indices) for g in layout.groups
    ]
    assert result["uniform"]["layers_per_group"] == 62
    assert result["options"]["kv_cache_memory"] == 40 * 1024**3
    assert result["model"]["layer_kinds"].count("full") == 10


def test_single_mode_and_flags(capsys):
    result = run_json(
        capsys,
        "--kv-cache-mode",
        "hybrid",
        "--block-size",
        "32",
        "--kv-cache-dtype",
        "fp8",
        "--max-num-batched-tokens",
        "512",
    )
    assert "uniform" not in result
    assert {g["block_size"] for g in result["hybrid"]["groups"]} == {32}
    assert result["hybrid"]["page_bytes"] == 32 * 16 * 256 * 1
    assert result["hybrid"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert result["options"]["max_num_batched_tokens"] == 512


def test_hf_overrides_reach_the_plan(capsys):
    result = run_json(capsys, "--hf-overrides", '{"text_config": {"sliding_window": 512}}')
    windows = {g["window"] for g in result["hybrid"]["groups"]}
    assert windows == {512, None}


def test_max_model_len_defaults_to_the_model(capsys):
    assert main(["plan", "--model", "tiny-gemma2", "--kv-cache-memory", "8MiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["options"]["max_model_len"] == 2048


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--kv-cache-memory", "40 gigs"], "MemorySizeError"),
        (["--model", "no-such-model"], "UnknownModelError"),
        (["--block-size", "24"], "InvalidBlockSizeError"),
        (["--kv-cache-memory", "1MiB"], "BudgetTooSmallError"),
        (["--hf-overrides", "{oops"], "ConfigError"),
        (["--hf-overrides", "[1]"], "ConfigError"),
        (["--max-model-len", "0"], "PlanError"),
        (["--max-model-len", "1024", "--strict-windows"], "WindowTooLargeError"),
    ],
)
def test_bad_input_exits_with_the_typed_error(capsys, argv, error):
    assert main([*GEMMA3, *argv]) == 1
    assert f"error: {error}:" in capsys.readouterr().err


def test_no_subcommand_prints_help(capsys):
    assert main([]) == 2
    assert "plan" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli():
    completed = subprocess.run(
        [sys.executable, "-m", "hybrid_cache", *GEMMA3, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout)["hybrid"]["layers_per_group"] == 5


def test_group_layout_flag_chooses_per_type_or_equal_groups(capsys):
    base = ["plan", "--model", "gemma-3-12b", "--kv-cache-memory", "40GiB"]
    base += ["--max-model-len", "32768", "--kv-cache-mode", "hybrid"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "40/8 (per type)" in out and "per-type layout" in out
    equal = run_json_of(capsys, [*base, "--kv-group-layout", "equal"])["hybrid"]
    auto = run_json_of(capsys, base)["hybrid"]
    assert [g["block_size"] for g in equal["groups"]] == [16] * 6
    assert [(g["block_size"], g["layers_per_page"]) for g in auto["groups"]] == [(16, 40), (80, 8)]
    assert auto["layers_per_group"] == 1 and len(auto["tensor_slots"]) == 1
    # Same bytes either way: the per-type pool holds the same tokens.
    assert auto["num_blocks"] * auto["page_bytes"] == equal["num_blocks"] * equal["page_bytes"] * 8
    with pytest.raises(SystemExit):
        main([*base, "--kv-group-layout", "sideways"])


def run_json_of(capsys, args):
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)
