"""`ServeBenchSettings`: what one `hybrid-cache bench serve` run sends, checked up front (no
HTTP client needed to build or check it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hybrid_cache.bench.errors import BenchConfigError
from hybrid_cache.bench.multi_turn import MultiTurnShape

SERVE_WORKLOADS = ("random", "shared-prefix", "multi-turn")


@dataclass(frozen=True)
class ServeBenchSettings:
    """One run's workload and load shape (checked by `check`)."""

    base_url: str
    workload: str = "random"
    num_prompts: int = 100
    input_len: int = 256
    output_len: int = 64
    prefix_len: int = 0
    multi_turn: Optional[MultiTurnShape] = None
    request_rate: float = float("inf")
    max_concurrency: Optional[int] = None
    model: Optional[str] = None
    api_key: Optional[str] = None
    seed: int = 0
    timeout_s: float = 600.0

    def check(self) -> None:
        if self.workload not in SERVE_WORKLOADS:
            raise BenchConfigError(
                f"--workload must be one of {', '.join(SERVE_WORKLOADS)}, got {self.workload!r}"
            )
        if not self.base_url.startswith(("http://", "https://")):
            raise BenchConfigError(
                f"--base-url must start with http:// or https://, got {self.base_url!r}"
            )
        for name in ("num_prompts", "input_len", "output_len"):
            value = getattr(self, name)
            if value <= 0:
                raise BenchConfigError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if not self.request_rate > 0:
            raise BenchConfigError(
                f"--request-rate must be positive (inf: all at once), got {self.request_rate}"
            )
        if self.max_concurrency is not None and self.max_concurrency <= 0:
            raise BenchConfigError(
                f"--max-concurrency must be positive, got {self.max_concurrency}"
            )
        if self.workload == "shared-prefix" and not 0 < self.prefix_len < self.input_len:
            raise BenchConfigError(
                f"--workload shared-prefix needs 0 < --prefix-len < --input-len, got "
                f"--prefix-len {self.prefix_len}"
            )
        if self.workload == "random" and self.prefix_len:
            raise BenchConfigError("--prefix-len belongs to --workload shared-prefix")
        if self.workload == "multi-turn" and self.multi_turn is None:
            raise BenchConfigError("--workload multi-turn needs --turn-input-len")
        if self.timeout_s <= 0:
            raise BenchConfigError(f"--timeout must be positive, got {self.timeout_s}")
