"""`scripts/bench_pairs.sh` runs a bench command on another checkout and on this one in turn and
prints each run's figures (here against itself, on a tiny run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_each_pair_runs_the_other_checkout_then_this_one():
    args = "--model tiny-llama --input-len 16 --output-len 4 --num-prompts 4 --num-threads 1"
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "bench_pairs.sh"), str(ROOT), "2", *args.split()],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["other", "here"] * 2
    pattern = r"(other|here): [0-9.]+ total tokens/s; overhead [0-9.]+% of steps with \d+ requests"
    assert all(re.fullmatch(pattern, line) for line in lines), lines


def test_it_says_how_to_call_it():
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "bench_pairs.sh"), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "usage:" in result.stderr
