"""`scripts/bench_core_ab.py` loads several builds of `_core` into one process and alternates
them on the allocator's phases (here the installed build against a copy of itself)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import hybrid_cache._core as core

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_core_ab.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )


def test_two_builds_alternate_and_each_phase_gets_a_ratio(tmp_path):
    copy = tmp_path / Path(core.__file__).name
    shutil.copy(core.__file__, copy)
    builds = f"{core.__file__},{copy}"
    number = r"[0-9]+\.[0-9]+"
    ratio = rf"  {re.escape(str(copy))}: median {number}, ratio to the first {number} \[{number}\.\.{number}\].*"
    for workload, keys in (
        ("lookup", ["lookup us/request"]),
        ("prefill", ["prefill ms", "free ms"]),
        ("evict", ["evicting prefill ns/block"]),
        (
            "T2",
            [
                "lookup us/request",
                "prefill ns/block",
                "decode ns/request-step",
                "free ns/block",
                "whole ms",
            ],
        ),
    ):
        rounds = "1" if workload == "T2" else "3"
        result = run(builds, "--workload", workload, "--tokens", "64", "--rounds", rounds)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert [line.split(":")[0] for line in lines[::2]] == keys
        assert all(re.fullmatch(ratio, line) for line in lines[1::2]), lines


def test_per_round_prints_a_row_per_round_with_a_figure_per_build(tmp_path):
    copy = tmp_path / Path(core.__file__).name
    shutil.copy(core.__file__, copy)
    result = run(
        f"{core.__file__},{copy}",
        "--workload",
        "lookup",
        "--tokens",
        "64",
        "--rounds",
        "3",
        "--per-round",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"lookup us/request, per round: {core.__file__}, {copy}"
    rows = [line.split() for line in lines[1:4]]
    assert [row[0] for row in rows] == ["0", "1", "2"]
    assert all(len(row) == 3 and all(float(x) > 0 for x in row[1:]) for row in rows), rows
    assert lines[4].startswith("lookup us/request: ")


def test_one_build_is_refused():
    result = run(core.__file__)
    assert result.returncode == 2 and "at least two builds" in result.stderr
