"""`hybrid-cache bench --interleave`: both modes' engines side by side in one process, time
slices by turns, each mode timed by the sum of its own slices."""

from __future__ import annotations

import json

import pytest
from hybrid_cache.bench import interleaved
from hybrid_cache.cli import main

from tests.test_bench import THROUGHPUT_LINE, TINY_RUN


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRun:
    """A mode whose steps cost `step_s` each on the fake clock; done after `steps` steps."""

    def __init__(self, clock: FakeClock, mode: str, step_s: float, steps: int, log: list) -> None:
        self.clock, self.mode, self.step_s, self.left, self.log = clock, mode, step_s, steps, log
        self.closed = False

    @property
    def done(self) -> bool:
        return self.left == 0

    def step(self) -> float:
        self.clock.now += self.step_s
        self.left -= 1
        self.log.append((self.mode, self.clock.now))
        return self.step_s

    def close(self) -> None:
        self.closed = True

    def finish(self, elapsed_s: float, cpu_time_s: float):
        return {"mode": self.mode, "elapsed_s": elapsed_s, "closed": self.closed}


def fake_runs(monkeypatch, costs: dict[str, tuple[float, int]]) -> tuple[FakeClock, list]:
    clock, log = FakeClock(), []

    def make(settings, mode, progress=None):
        step_s, steps = costs[mode]
        return FakeRun(clock, mode, step_s, steps, log)

    monkeypatch.setattr(interleaved, "ModeRun", make)
    return clock, log


def test_each_mode_is_timed_by_its_own_slices(monkeypatch) -> None:
    # Steps of 1/64 s (exact in binary): hybrid 16 of them (0.25 s), uniform 32 (0.5 s).
    step = 1 / 64
    clock, log = fake_runs(monkeypatch, {"hybrid": (step, 16), "uniform": (step, 32)})
    results = interleaved.run_interleaved(None, ("hybrid", "uniform"), clock=clock)
    assert results["hybrid"]["elapsed_s"] == 0.25
    assert results["uniform"]["elapsed_s"] == 0.5
    assert all(result["closed"] for result in results.values())
    # A slice ends with the first step past 50 ms (4 steps); by turns while both run, then the
    # rest of uniform alone.
    modes = [mode for mode, _ in log]
    assert modes[:32] == (["hybrid"] * 4 + ["uniform"] * 4) * 4
    assert modes[32:] == ["uniform"] * 16
    assert clock.now == 0.75


def test_expected_times_keep_both_modes_in_step(monkeypatch) -> None:
    """With the previous repeat's times as weights, each mode gets slices in proportion, so
    both are about as far through their work at any moment and finish together."""
    clock, log = fake_runs(monkeypatch, {"hybrid": (1 / 64, 40), "uniform": (1 / 64, 160)})
    interleaved.run_interleaved(
        None, ("hybrid", "uniform"), expected_s={"hybrid": 0.625, "uniform": 2.5}, clock=clock
    )
    last_hybrid = max(at for mode, at in log if mode == "hybrid")
    assert last_hybrid > 0.85 * clock.now  # hybrid ran until near the end, not only at first
    for done_share in (0.25, 0.5, 0.75):
        until = done_share * clock.now
        hybrid = sum(1 for mode, at in log if mode == "hybrid" and at <= until) / 40
        uniform = sum(1 for mode, at in log if mode == "uniform" and at <= until) / 160
        assert abs(hybrid - uniform) < 0.15, (done_share, hybrid, uniform)


def test_non_positive_expected_time_is_rejected(monkeypatch) -> None:
    fake_runs(monkeypatch, {"hybrid": (0.01, 1), "uniform": (0.01, 1)})
    with pytest.raises(ValueError, match="expected times must be positive"):
        interleaved.run_interleaved(None, ("hybrid", "uniform"), expected_s={"hybrid": 0.0})


def test_interleave_flag_runs_both_engines_side_by_side(tmp_path, capsys) -> None:
    json_path = tmp_path / "bench.json"
    args = [*TINY_RUN, "--interleave", "--repeat", "2", "--output-json", str(json_path)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert len(THROUGHPUT_LINE.findall(printed)) == 2, printed
    assert "both modes side by side in one process" in printed
    assert "Hybrid/uniform per interleaved pair: median" in printed
    document = json.loads(json_path.read_text())
    assert document["interleave"] is True
    every = document["elapsed_s_of_every_run"]
    assert len(every["hybrid"]) == len(every["uniform"]) == 2
    for mode, result in document["results"].items():
        assert result["num_requests"] == 4, mode
        assert result["elapsed_s"] == min(every[mode])
        # A mode's time is its own slices: at least the sum of its steps' times.
        assert result["elapsed_s"] >= sum(result["steps"]["step_time_s"]) > 0
    assert document["ratio_total_tokens_per_s_of_each_pair"] == [
        u / h for h, u in zip(every["hybrid"], every["uniform"])
    ]
