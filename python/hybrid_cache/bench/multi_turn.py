"""The multi-turn chat workload (`hybrid-cache bench --workload multi-turn`) and its reuse figures.

`num_sessions` chat sessions share one system prompt of `system_len` seeded random token ids.
Turn `t` of a session sends the session's whole history (the system prompt, then every earlier
turn's user tokens and generated tokens) followed by `turn_input_len` new user tokens, and
generates `output_len` tokens. Sessions are served round-robin in waves: turn `t` of every
session is added at once, and turn `t + 1` only after every session finished turn `t`, so a
session's history comes back after all the other sessions ran (the pattern that flushes a plain
LRU cache that is smaller than all histories).

Reuse figures: for turn `t >= 1` of a session, the *reusable* tokens are those whose KV an earlier
turn computed: the previous turn's prompt and its outputs but the last (the last sampled token
was never fed back). A request's hit is the engine's `num_cached_tokens` (prefix-cache tokens at
its first scheduling). The reusable-token hit rate is hit tokens over reusable tokens, summed
over turns 1.. (turn 0 has nothing earlier; its hits are the shared system prompt).

```text
  turn 0:  [system | user0]                         -> out0
  turn 1:  [system | user0 | out0 | user1]          -> out1
            <-------- reusable ------->  (out0 minus its last token)
```
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Optional

from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.bench.workload import FIRST_ORDINARY_ID


@dataclass(frozen=True)
class MultiTurnShape:
    """Sizes of the multi-turn workload (validated on construction)."""

    num_sessions: int
    num_turns: int
    system_len: int
    turn_input_len: int
    output_len: int

    def __post_init__(self) -> None:
        for name in ("num_sessions", "num_turns", "turn_input_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                flag = "--" + name.replace("_", "-")
                raise BenchConfigError(f"{flag} must be a positive integer, got {value!r}")
        if isinstance(self.system_len, bool) or not isinstance(self.system_len, int):
            raise BenchConfigError(f"--system-len must be an integer, got {self.system_len!r}")
        if self.system_len < 0:
            raise BenchConfigError(f"--system-len must be 0 or more, got {self.system_len}")

    @property
    def num_requests(self) -> int:
        return self.num_sessions * self.num_turns

    @property
    def max_total_tokens(self) -> int:
        """Tokens of a session's last turn, prompt and output: what max_model_len must hold."""
        return self.system_len + self.num_turns * (self.turn_input_len + self.output_len)

    def prompt_len(self, turn: int) -> int:
        return (
            self.system_len + turn * (self.turn_input_len + self.output_len) + self.turn_input_len
        )


@dataclass
class TurnReuse:
    """Sums over the sessions of one turn."""

    turn: int
    hit_tokens: int = 0
    reusable_tokens: int = 0
    prompt_tokens: int = 0
    # Hit tokens counting a preempted request's recomputation: per request the fewest tokens
    # any of its schedulings took from the cache.
    net_hit_tokens: int = 0

    @property
    def hit_rate(self) -> Optional[float]:
        """Hit over reusable tokens; None for turn 0 (nothing was computed earlier)."""
        return self.hit_tokens / self.reusable_tokens if self.reusable_tokens else None

    @property
    def net_hit_rate(self) -> Optional[float]:
        """`hit_rate` net of what preempted requests recomputed."""
        return self.net_hit_tokens / self.reusable_tokens if self.reusable_tokens else None


@dataclass
class ReuseFigures:
    """Per turn and overall reusable-token hit rate of one run."""

    turns: list[TurnReuse] = field(default_factory=list)

    @property
    def hit_tokens(self) -> int:
        return sum(turn.hit_tokens for turn in self.turns if turn.turn > 0)

    @property
    def net_hit_tokens(self) -> int:
        return sum(turn.net_hit_tokens for turn in self.turns if turn.turn > 0)

    @property
    def reusable_tokens(self) -> int:
        return sum(turn.reusable_tokens for turn in self.turns)

    @property
    def hit_rate(self) -> Optional[float]:
        """Over turns 1.. (None with one turn only)."""
        reusable = self.reusable_tokens
        return self.hit_tokens / reusable if reusable else None

    @property
    def net_hit_rate(self) -> Optional[float]:
        """`hit_rate` net of what preempted requests recomputed (None with one turn only)."""
        reusable = self.reusable_tokens
        return self.net_hit_tokens / reusable if reusable else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "reusable_hit_rate": self.hit_rate,
            "reusable_net_hit_rate": self.net_hit_rate,
            "hit_tokens": self.hit_tokens,
            "net_hit_tokens": self.net_hit_tokens,
            "reusable_tokens": self.reusable_tokens,
            "turns": [
                {
                    "turn": turn.turn,
                    "hit_tokens": turn.hit_tokens,
                    "net_hit_tokens": turn.net_hit_tokens,
                    "reusable_tokens": turn.reusable_tokens,
                    "prompt_tokens": turn.prompt_tokens,
                    "hit_rate": turn.hit_rate,
                    "net_hit_rate": turn.net_hit_rate,
                }
                for turn in self.turns
            ],
        }


class MultiTurnFeed:
    """Prompts of the multi-turn workload, a wave (one turn of every session) at a time; see the
    module docs. The same arguments give the same user tokens, so two engines compare on the
    same conversation as long as they generate the same tokens (greedy, same weights); the
    user tokens never depend on what was generated."""

    def __init__(self, shape: MultiTurnShape, vocab_size: int, seed: int) -> None:
        if vocab_size <= FIRST_ORDINARY_ID:
            raise BenchConfigError(f"the vocabulary ({vocab_size} ids) is too small for prompts")
        generator = random.Random(seed)

        def tokens(count: int) -> list[int]:
            return [generator.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(count)]

        self.shape = shape
        system = tokens(shape.system_len)
        self._user = [
            [tokens(shape.turn_input_len) for _ in range(shape.num_turns)]
            for _ in range(shape.num_sessions)
        ]
        self._history = [list(system) for _ in range(shape.num_sessions)]
        # Per session: (prompt length, output count) of its last finished turn.
        self._previous: list[Optional[tuple[int, int]]] = [None] * shape.num_sessions
        self._turn = 0
        self._in_flight: set[str] = set()
        self.reuse = ReuseFigures()

    @property
    def exhausted(self) -> bool:
        """Every turn handed out (requests may still be running)."""
        return self._turn >= self.shape.num_turns and not self._in_flight

    def next_prompts(self) -> list[tuple[str, list[int]]]:
        """The next wave's (request id, prompt) pairs once the current wave has finished;
        nothing while it runs or after the last turn."""
        if self._in_flight or self._turn >= self.shape.num_turns:
            return []
        turn = self._turn
        self.reuse.turns.append(TurnReuse(turn))
        wave = []
        for session in range(self.shape.num_sessions):
            request_id = f"s{session}-t{turn}"
            wave.append((request_id, self._history[session] + self._user[session][turn]))
            self._in_flight.add(request_id)
        return wave

    def record(self, request: Any) -> None:
        """A finished request of the current wave (`request_id`, `prompt_token_ids`,
        `output_token_ids`, `num_cached_tokens`, and `min_cached_tokens` where the engine counts
        recomputation after preemptions); the next wave follows the last of them."""
        self._in_flight.remove(request.request_id)
        session = int(request.request_id[1:].split("-t")[0])
        figures = self.reuse.turns[-1]
        figures.hit_tokens += request.num_cached_tokens
        figures.net_hit_tokens += getattr(request, "min_cached_tokens", request.num_cached_tokens)
        figures.prompt_tokens += len(request.prompt_token_ids)
        previous = self._previous[session]
        if previous is not None:
            figures.reusable_tokens += previous[0] + previous[1] - 1
        self._previous[session] = (len(request.prompt_token_ids), len(request.output_token_ids))
        self._history[session] = list(request.prompt_token_ids) + list(request.output_token_ids)
        if not self._in_flight:
            self._turn += 1


def uniform_history_bytes(spec: Any, shape: MultiTurnShape) -> int:
    """KV bytes a uniform cache (every layer keeps every token) needs to hold every session's
    whole history at the end (`max_total_tokens - 1` tokens each, the last sampled token never
    computed): the yardstick for `--kv-cache-memory` budgets of this workload."""
    per_token = sum(layer.bytes_per_token() for layer in spec.layers)
    return shape.num_sessions * (shape.max_total_tokens - 1) * per_token
