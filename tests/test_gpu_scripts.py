"""The GPU scripts that `scripts/bench_gpu.sh` runs import, parse their arguments and (in their
CPU dry-run modes, under TRITON_INTERPRET=1 where they use the kernels) run their own logic
here, so a prepared GPU run does not fail on a typo. Their figures mean nothing on the CPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = [
    "gpu_check.py",
    "gpu_engine_check.py",
    "gpu_engine_timing.py",
    "gpu_decode_anatomy.py",
    "gpu_bf16_check.py",
]


@pytest.mark.parametrize("script", SCRIPTS)
def test_gpu_script_parses_its_arguments(script):
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "--cpu-dry-run" in done.stdout


def test_bench_gpu_script_parses():
    done = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "bench_gpu.sh")], timeout=30)
    assert done.returncode == 0


def test_bench_gpu_dry_run_runs_the_build_kernel_and_timing_stages(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable}
    env.pop("TRITON_INTERPRET", None)  # gpu_check's dry run sets it itself, before Triton loads
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "bench_gpu.sh"), str(tmp_path), "build kernels timing"],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
        env=env,
    )
    log = (tmp_path / "gpu.log").read_text()
    assert done.returncode == 0, log[-4000:]
    assert "no build needed" in log and "== build: exit 0" in log
    assert "== kernels: exit 0" in log and "== engine-timing: exit 0" in log
    short = [line for line in log.splitlines() if "contexts up to" in line]
    assert len(short) == 24 and all(line.endswith(" ok") for line in short), short
    assert any("splits 16:" in line for line in short)
    assert "| decode 2x40 | 16 | 16 |" in log  # a windowed timing row
    figures = json.loads((tmp_path / "engine-timing.json").read_text())
    assert len(figures["runs"]) == 2 and figures["first_over_second"] > 0
    assert all(run["warm_up_s"] > 0 and run["decode_steps"] > 0 for run in figures["runs"])
    for run in figures["runs"]:
        split = run["decode_split_median_s"]
        assert set(split) == {"step", "forward", "lm_head", "engine", "issue"}
        assert 0 < split["issue"] <= split["forward"] < split["step"]
    assert "their medians (ms): forward" in log


def test_the_issue_time_stops_before_the_benchmark_waits_for_the_device():
    """The forward's issue time (what gpu_engine_timing.py reports) excludes the benchmark
    timer's synchronisations at both ends, which here each sleep 20 ms."""
    import time

    import torch
    from hybrid_cache.bench.engine_run import ForwardTimer

    module = torch.nn.Linear(4, 4)
    forward = ForwardTimer(module, lambda: time.sleep(0.02))
    module(torch.ones(1, 4))
    issued, waited = forward.take_issue(), forward.take()
    assert issued < 0.015, issued
    assert waited >= 0.02 + issued, (waited, issued)
    forward.remove()
    module(torch.ones(1, 4))
    assert forward.take_issue() == 0.0 and forward.take() == 0.0, "hooks removed"


def test_the_decode_anatomy_dry_run_counts_a_decode_forwards_operators(tmp_path):
    """On the CPU the script measures plain forwards and counts one forward's aten operators
    (the device sleep needs CUDA); each layer dispatches some, and the CPU asks for no sync."""
    out = tmp_path / "anatomy.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_decode_anatomy.py"), "--cpu-dry-run",
         "--output-json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["samples"]["plain"] >= 1 and figures["samples"]["ops"] >= 1
    assert figures["samples"]["asleep"] == 0 and "after_sleep_s" not in figures
    assert figures["num_layers"] > 0 and figures["aten_ops_per_layer"] >= 10
    assert sum(figures["top_ops"].values()) <= figures["aten_ops"]
    assert 0 < figures["plain_issue_s"] <= figures["plain_wall_s"]
    assert 0 < figures["plain_first_layer_at_s"] < figures["plain_issue_s"]
    assert 0 < figures["plain_layer_issue_s"] < figures["plain_issue_s"]
    assert "aten ops" in done.stdout


def test_the_bf16_stage_dry_run_compares_every_architecture(tmp_path):
    """`bench_gpu.sh OUT bf16` on the CPU: the bf16 comparison for every architecture, within its
    bounds, its figures written for BENCHMARKS.md."""
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "bench_gpu.sh"), str(tmp_path), "bf16"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )
    log = (tmp_path / "gpu.log").read_text()
    assert done.returncode == 0, log[-4000:]
    assert "== bf16: exit 0" in log and "7/7 architectures within bounds" in log
    figures = json.loads((tmp_path / "bf16.json").read_text())
    assert figures["device"] == "cpu" and len(figures["results"]) == 7
    for result in figures["results"]:
        assert result["failures"] == []
        assert 0 < result["our_median_error"] <= result["our_max_error"]
