"""`GET /metrics`: the server's figures in Prometheus' text format (prometheus_client).

Engine state is read at scrape time from the last `EngineSnapshot` the engine shipped with a
step's batch (never from the engine itself, which may run in another process). Request
figures are recorded by `ServerMetrics` as the engine's batches report them
(`RequestListener`, on the thread that delivers them); its histograms are plain bucket counts
(one bisect per observation: one token of one request costs that much).

Prefix cache: `prefix_cache_queries_total` counts prompt tokens looked up (the same tokens in
every KV-cache group) and `prefix_cache_hits_total` the tokens served (the hybrid hit, the
shortest of the groups'); each looked-up token that missed counts once in
`prefix_cache_misses_total{reason}` (`EngineStats.prefix_misses`). Per group,
`prefix_cache_group_hits_total` counts the tokens that group alone would have hit and
`prefix_cache_group_shortened_total` those of them another group cut. Token tails and tail
replays count their lookups and the tokens they served beyond the aligned or common hit.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from hybrid_cache.entrypoints.async_llm import EngineSnapshot, RequestListener

PREFIX = "hybrid_cache:"
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error")


class Histogram:
    """Bucket counts and a sum, written by one thread, read by the scrape."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds: tuple[float, ...] = tuple(bounds)
        self.counts: list[int] = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def family(self, name: str, documentation: str, labels: dict[str, str]) -> Any:
        counts = list(self.counts)
        buckets, total = [], 0
        for bound, count in zip(self.bounds, counts):
            total += count
            buckets.append((repr(bound), total))
        buckets.append(("+Inf", total + counts[-1]))
        family = HistogramMetricFamily(name, documentation, labels=list(labels))
        family.add_metric(list(labels.values()), buckets, self.sum)
        return family


class ServerMetrics(RequestListener, Collector):
    """Request figures (fed by `AsyncLLM` as a `RequestListener`) and the engine's state, in
    one registry of their own (so several servers in one process do not mix)."""

    def __init__(
        self,
        snapshot: Callable[[], EngineSnapshot],
        group_kinds: Sequence[str],
        num_usable_blocks: int,
        model_name: str,
        healthy: Callable[[], bool] = lambda: True,
    ) -> None:
        self.snapshot = snapshot
        self.group_kinds: tuple[str, ...] = tuple(group_kinds)
        self.num_usable_blocks: int = num_usable_blocks
        self.labels: dict[str, str] = {"model_name": model_name}
        self.healthy = healthy
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.finished: dict[str, int] = dict.fromkeys(FINISH_REASONS, 0)
        self.errors: dict[str, int] = {}
        self._errors_lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # RequestListener (the thread that delivers the engine's batches).
    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_finished(
        self,
        num_prompt_tokens: int,
        num_generated_tokens: int,
        finish_reasons: list[str],
        seconds: float,
    ) -> None:
        self.num_prompt_tokens += num_prompt_tokens
        self.num_generation_tokens += num_generated_tokens
        for reason in finish_reasons:
            self.finished[reason] = self.finished.get(reason, 0) + 1
        self.e2e.observe(seconds)

    # The server (the event loop).
    def count_error(self, status: int) -> None:
        """An error response the server sent (any route)."""
        with self._errors_lock:
            key = str(status)
            self.errors[key] = self.errors.get(key, 0) + 1

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # Collector.
    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        labels = self.labels
        names, values = list(labels), list(labels.values())
        snapshot = self.snapshot()
        stats = snapshot.stats

        def gauge(name: str, documentation: str, value: float) -> Any:
            family = GaugeMetricFamily(PREFIX + name, documentation, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, documentation: str, value: float) -> Any:
            family = CounterMetricFamily(PREFIX + name, documentation, labels=names)
            family.add_metric(values, value)
            return family

        def labelled(kind: Any, name: str, documentation: str, label: str, items: Any) -> Any:
            family = kind(PREFIX + name, documentation, labels=[*names, *label.split(",")])
            for key, value in items:
                family.add_metric([*values, *key], value)
            return family

        yield gauge("healthy", "1 while the engine loop runs, else 0", int(self.healthy()))
        yield gauge(
            "num_requests_running", "Requests (samples) in the running batch", snapshot.num_running
        )
        yield gauge(
            "num_requests_waiting", "Requests (samples) waiting or preempted", snapshot.num_waiting
        )
        used = list(snapshot.num_used_blocks_per_group)
        kinds = self.group_kinds
        yield labelled(
            GaugeMetricFamily,
            "kv_cache_blocks_used",
            "KV-cache blocks in use, per group",
            "group,kind",
            [((str(group), kinds[group]), count) for group, count in enumerate(used)],
        )
        per_kind: dict[str, int] = {}
        for group, count in enumerate(used):
            per_kind[kinds[group]] = per_kind.get(kinds[group], 0) + count
        yield labelled(
            GaugeMetricFamily,
            "kv_cache_blocks_used_by_kind",
            "KV-cache blocks in use, per attention kind (its groups summed)",
            "kind",
            [((kind,), count) for kind, count in per_kind.items()],
        )
        yield gauge(
            "kv_cache_blocks",
            "Usable KV-cache blocks (the null block apart)",
            self.num_usable_blocks,
        )
        yield gauge(
            "kv_cache_blocks_free",
            "KV-cache blocks free (cached ones included)",
            snapshot.num_free_blocks,
        )
        yield gauge(
            "kv_cache_blocks_protected",
            "Free cached blocks of protected prefix chains (evicted after every other free block)",
            snapshot.num_protected_blocks,
        )
        yield counter("engine_steps", "Engine steps run", stats.num_steps)
        yield counter(
            "num_preemptions", "Requests preempted (recomputed later)", stats.num_preemptions
        )
        yield counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            stats.num_prefix_query_tokens,
        )
        yield counter(
            "prefix_cache_hits",
            "Prompt tokens served from the prefix cache",
            stats.num_prefix_hit_tokens,
        )
        yield counter(
            "prefix_cache_token_tail_hits",
            "Lookups whose hit ended on token tails (where a finished request's tokens ended)",
            stats.num_token_tail_hits,
        )
        yield counter(
            "prefix_cache_token_tail_gain_tokens",
            "Prompt tokens token-tail hits served beyond the block-aligned hit",
            stats.num_token_tail_gain_tokens,
        )
        yield counter(
            "prefix_cache_tail_replays",
            "Lookups that kept a full-attention hit and recomputed lost windows (tail replay)",
            stats.num_tail_replays,
        )
        yield counter(
            "prefix_cache_tail_replay_gain_tokens",
            "Prompt tokens tail replays served beyond the hit every group had",
            stats.num_tail_replay_gain_tokens,
        )
        misses = stats.prefix_misses
        yield labelled(
            CounterMetricFamily,
            "prefix_cache_misses",
            "Looked-up prompt tokens that missed, by reason",
            "reason",
            [
                (("window_tail",), misses.window_tail),
                (("never_cached",), misses.never_cached),
                (("evicted",), misses.evicted),
                (("alignment",), misses.alignment),
            ],
        )
        yield labelled(
            CounterMetricFamily,
            "prefix_cache_group_hits",
            "Prompt tokens this KV-cache group alone would have served",
            "group,kind",
            [
                ((str(group), kinds[group]), count)
                for group, count in enumerate(stats.prefix_alone_hit_tokens_per_group)
            ],
        )
        yield labelled(
            CounterMetricFamily,
            "prefix_cache_group_shortened",
            "Of this group's own hit, tokens another group cut",
            "group,kind",
            [
                ((str(group), kinds[group]), count)
                for group, count in enumerate(stats.prefix_shortened_tokens_per_group)
            ],
        )
        yield counter("prompt_tokens", "Prompt tokens of finished requests", self.num_prompt_tokens)
        yield counter(
            "generation_tokens", "Tokens generated by finished requests", self.num_generation_tokens
        )
        yield labelled(
            CounterMetricFamily,
            "request_success",
            "Finished samples, by finish reason",
            "finished_reason",
            [((reason,), count) for reason, count in self.finished.items()],
        )
        with self._errors_lock:
            errors = list(self.errors.items())
        yield labelled(
            CounterMetricFamily,
            "http_error_responses",
            "Error responses sent, by HTTP status",
            "status",
            [((status,), count) for status, count in errors],
        )
        yield self.ttft.family(
            PREFIX + "time_to_first_token_seconds", "Time to the first token", labels
        )
        yield self.itl.family(
            PREFIX + "inter_token_latency_seconds", "Time between two tokens of a sample", labels
        )
        yield self.e2e.family(
            PREFIX + "e2e_request_latency_seconds",
            "Time from arrival to the end of a request",
            labels,
        )
