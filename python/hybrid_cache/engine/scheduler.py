"""Continuous batching: which requests run this step and how many tokens each computes.

Every step has a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`). Running requests are served first, oldest first, each taking as many of its
uncomputed tokens as the budget leaves (a long prompt is prefilled in chunks over several steps).
Then waiting requests are admitted, starting after their prefix-cache hit: longest cached prefix
first (`"lpm"`, the default, as SGLang's policy of that name), or first come first served
(`"fcfs"`, vLLM's default). Under `"lpm"`, among the first `LPM_WINDOW` waiting requests the one
whose prompt the cache holds the most of goes first (equal hits, nothing cached among them, go
in arrival order), so hits are taken before other admissions evict them. When many requests with
cached histories arrive together (a wave of conversation turns, a batch over shared documents)
first come first served admits the misses first and their allocations evict the very
histories the later requests would hit; `"lpm"` keeps them. A request overtaken
`LPM_MAX_OVERTAKES` times is admitted next whatever its hit, so nothing waits forever. Why it
is the default, and what it costs: BENCHMARKS.md ("Prefix reuse under memory pressure").

Holds (`hold_waiting_prefixes`, on by default): a request arriving with a prefix-cache hit takes
that hit at once (its blocks are in use, so nothing evicts them) and waits holding it, when a
block-table row is free. First come first served then no longer lets the admissions ahead of it
evict what it would hit: on the multi-turn workload at a quarter of uniform's memory that is
the difference between 26% and 79% of the history reused (`BENCHMARKS.md`). Holds give way:
when a running request cannot grow, or an admission needs a row, the newest hold is released
(its blocks stay cached and it is looked up again when admitted) before anything is preempted;
when nothing runs and the first waiting request cannot fit, the holds behind it are released.
Under `"lpm"`, which orders admissions by what the cache holds, a running request that cannot
grow first preempts the running requests newer than itself, newest first, and only then are
holds released: the preempted requests' blocks stay cached too, and the held histories, which
the waves of a multi-turn workload would otherwise lose, are kept (`BENCHMARKS.md`: 83.9 ->
90.0% of the history reused on tiny-gpt-oss at a third of uniform's memory).

Admission headroom (`admission_headroom`, on by default for pools with windowed groups): while
requests run and waiting requests hold hits, an admission must leave free the blocks the running
requests take at their next token. Otherwise the next step's growth preempts the newcomer at
once (it is the newest), after its prefill, and with the holds pinning the pool its blocks are
the only free ones, so they are evicted before it resumes: in a windowed group that loses its
whole hit. Measured in BENCHMARKS.md ("Admission headroom").

When the pool has no blocks for a running request, the newest running request is preempted by
recompute: its blocks are freed and it goes back to the front of the waiting queue; when
re-admitted it is re-added with prompt + output tokens so far (often hitting its own blocks in
the prefix cache) and continues exactly where it stopped. A preempted request, like one whose
admission is given back this step, is freed with `keep=True`: the core keeps its tokens and
block hashes, so re-adding it copies and hashes nothing again (an abort or failure forgets them).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import operator
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple, Optional

from hybrid_cache.engine.engine_config import SCHEDULING_POLICIES
from hybrid_cache.engine.errors import InsufficientKVCacheError
from hybrid_cache.engine.request import FinishReason, Request, RequestStatus
from hybrid_cache.errors import OutputProcessingError

if TYPE_CHECKING:
    from hybrid_cache.engine.kv_cache import KVCacheManager

logger = logging.getLogger(__name__)


class ScheduledRequest(NamedTuple):
    """One scheduled request of a step (`SchedulerOutput.scheduled`)."""

    request: Request
    row: int  # the request's row in the grouped block table
    num_computed_tokens: int  # before this step
    num_new_tokens: int
    # Whether this step computes the request's last token, so a token is sampled for it.
    samples: bool


@dataclass
class SchedulerOutput:
    """A step's schedule as columns, one item per scheduled request in order: the request, its
    row in the grouped block table, its computed tokens before the step and its new tokens (no
    object per request and step: the runner and the update read whole columns). `scheduled`
    gives the items as `ScheduledRequest`s."""

    requests: list[Request] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # Requests that failed while being admitted (they hold no blocks).
    failed: list[Request] = field(default_factory=list)
    # (src, dst) KV pages to copy, every layer slot, before the step runs (cache hits that end
    # inside a block another request uses start from a copy of it).
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    _samples: Optional[list[bool]] = field(default=None, repr=False)

    def add(self, request: Request, row: int, num_computed: int, num_new: int) -> None:
        """Schedules `num_new` tokens of `request` after its `num_computed`."""
        self.requests.append(request)
        self.rows.append(row)
        self.num_computed.append(num_computed)
        self.num_new.append(num_new)

    @property
    def samples(self) -> list[bool]:
        """Per item, whether this step computes the request's last token, so a token is
        sampled for it: worked out on first use (before the sampled tokens are appended)."""
        if self._samples is None or len(self._samples) != len(self.requests):
            totals = map(operator.add, self.num_computed, self.num_new)
            self._samples = list(
                map(operator.eq, totals, map(len, map(_ALL_TOKEN_IDS, self.requests)))
            )
        return self._samples

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        return list(
            map(
                ScheduledRequest,
                self.requests,
                self.rows,
                self.num_computed,
                self.num_new,
                self.samples,
            )
        )

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(self.num_new)


_NUM_COMPUTED = attrgetter("num_computed_tokens")
_ALL_TOKEN_IDS = attrgetter("all_token_ids")


def _budget_shares(
    requests: list[Request], token_budget: int
) -> tuple[list[Request], list[int], list[int]]:
    """The requests, oldest first, that `token_budget` reaches, with their computed counts and
    shares: each takes all its uncomputed tokens, the last one reached what is left.

    Whole lists per field through C-level maps rather than one loop over requests with
    appends (fewer bytecodes per request); the prefix sums find where the budget runs out.
    """
    computed_counts = list(map(_NUM_COMPUTED, requests))
    new_counts = list(map(operator.sub, map(len, map(_ALL_TOKEN_IDS, requests)), computed_counts))
    ends = list(itertools.accumulate(new_counts))
    if ends[-1] > token_budget:
        # The first request whose share ends at or after the budget is the last one reached.
        last = bisect.bisect_left(ends, token_budget)
        del requests[last + 1 :], computed_counts[last + 1 :], new_counts[last + 1 :]
        new_counts[last] = token_budget - (ends[last - 1] if last else 0)
    assert min(new_counts) > 0, (
        f"running {requests[new_counts.index(min(new_counts))]} has nothing to compute"
    )
    return requests, computed_counts, new_counts


# "lpm": how many waiting requests (from the front) are weighed by their cached prefix, and how
# often a request may be overtaken before it goes first.
LPM_WINDOW = 32
LPM_MAX_OVERTAKES = 64


class Scheduler:
    """Decides each step's batch; keeps the waiting and running queues."""

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        hold_waiting_prefixes: bool = True,
        admission_headroom: bool = False,
    ) -> None:
        assert policy in SCHEDULING_POLICIES, f"policy {policy!r} is validated by the caller"
        self.policy: str = policy
        self.hold_waiting_prefixes: bool = hold_waiting_prefixes
        self.admission_headroom: bool = admission_headroom
        # Waiting requests holding their prefix-cache hit: request id -> hit tokens (oldest
        # hold first).
        self.held: dict[str, int] = {}
        # Whether the last admission stopped at a request the free blocks could not hold.
        self.head_blocked: bool = False
        # "lpm": times each waiting request was overtaken by a later one.
        self.overtaken: dict[str, int] = {}
        assert max_num_seqs > 0 and max_num_batched_tokens > 0, "limits must be positive"
        self.kv_cache: KVCacheManager = kv_cache
        self.max_num_seqs: int = max_num_seqs
        self.max_num_batched_tokens: int = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the newest
        self.num_preemptions: int = 0

    def add_request(self, request: Request) -> None:
        assert request.status is RequestStatus.WAITING, f"{request} is not new"
        request.open_sample_logprobs()  # it finishes (or is aborted) through `_finish`
        self.waiting.append(request)
        if self.hold_waiting_prefixes:
            self._hold_prefix(request)

    def _hold_prefix(self, request: Request) -> None:
        """Takes a new request's prefix-cache hit now, while it waits, so the allocations of
        the requests admitted before it cannot evict it (see the module docstring)."""
        kv_cache = self.kv_cache
        if len(self.running) + len(self.held) >= self.max_num_seqs:
            return  # every block-table row may be needed by a running request
        if self.head_blocked:
            return  # the blocks it would hold are the ones the next in line waits for
        if kv_cache.probe_cache_hit(request) == 0:
            return
        try:
            kv_cache.add(request)
        except InsufficientKVCacheError:
            return  # it fails alone when it is admitted
        hit = kv_cache.find_cache_hit(request)
        if hit > 0 and kv_cache.allocate(request, hit, 0):
            self.held[request.request_id] = hit
        else:
            kv_cache.free(request, keep=True)

    def _release_held(self, keep: Optional[Request] = None) -> bool:
        """Frees the newest hold (other than `keep`'s); False when there is none. Its blocks
        stay cached, so the request may still hit them when it is admitted."""
        for request_id in reversed(self.held):
            if keep is None or request_id != keep.request_id:
                del self.held[request_id]
                request = next(r for r in self.waiting if r.request_id == request_id)
                self.kv_cache.free(request, keep=True)
                return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def abort_request(self, request_id: str) -> Optional[Request]:
        """Stops a request wherever it is and returns its blocks; None if it is unknown."""
        for request in self.running:
            if request.request_id == request_id:
                self.running.remove(request)
                self.kv_cache.free(request)
                self._finish(request, FinishReason.ABORT)
                return request
        for request in self.waiting:
            if request.request_id == request_id:
                if self.held.pop(request_id, None) is not None:
                    self.kv_cache.free(request)
                self.kv_cache.forget(request)
                self._unqueue(request)
                self._finish(request, FinishReason.ABORT)
                return request
        return None

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        token_budget = self._schedule_running(output)
        # Admitting while preempting would take back the blocks just freed.
        if output.num_preemptions == 0:
            self._admit_waiting(token_budget, output)
        output.block_copies = self.kv_cache.take_block_copies()
        return output

    def _schedule_running(self, output: SchedulerOutput) -> int:
        """Schedules the running requests oldest first, each taking as many of its uncomputed
        tokens as the budget leaves, preempting newest-first when one does not fit; returns
        the budget left.

        The same decisions as allocating one request at a time, in fewer core calls: a
        request's share of the budget depends only on the requests before it, so the shares
        are worked out first and allocated with one `allocate_batch` (in order, all or nothing
        per request, stopping at the first that does not fit). When one does not fit, newest
        requests are preempted until it does (or it was the newest), and the requests after it
        go on in another batch.
        """
        running = self.running
        kv_cache = self.kv_cache
        token_budget = self.max_num_batched_tokens
        index = 0  # running[:index] are scheduled
        while index < len(running) and token_budget > 0:
            requests, computed_counts, new_counts = _budget_shares(running[index:], token_budget)
            budget = token_budget - sum(new_counts)
            num_allocated = kv_cache.allocate_batch(requests, computed_counts, new_counts)
            allocated = requests[:num_allocated]
            output.requests += allocated
            output.rows += kv_cache.rows_of(allocated)
            output.num_computed += computed_counts[:num_allocated]
            output.num_new += new_counts[:num_allocated]
            if num_allocated == len(requests):
                return budget
            token_budget -= sum(new_counts[:num_allocated])
            index += num_allocated

            # requests[num_allocated] does not fit (its failed allocate changed nothing).
            request = requests[num_allocated]
            num_computed = computed_counts[num_allocated]
            num_new_tokens = new_counts[num_allocated]
            if not self._preempt_until_fits(request, num_computed, num_new_tokens, output):
                break  # the request itself was preempted (it was the newest)
            output.add(request, kv_cache.row_of(request), num_computed, num_new_tokens)
            token_budget -= num_new_tokens
            index += 1
        return token_budget

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: Sequence[int]
    ) -> list[Request]:
        """Advances computed counts, records sampled tokens (one per scheduled request that
        samples, in order); returns requests finished now."""
        finished: list[Request] = []
        now = time.time()
        tokens = iter(sampled_token_ids)
        for request, samples, computed, new in zip(
            output.requests, output.samples, output.num_computed, output.num_new
        ):
            request.num_computed_tokens = computed + new
            if not samples:
                continue
            token_id = next(tokens)
            if not request.output_token_ids:
                request.first_token_time = now
            request.last_token_time = now
            try:
                finish_reason = request.append_output_token(token_id)
            except Exception as cause:  # its own text or stop check: it fails alone
                error = OutputProcessingError(
                    f"request {request.request_id!r} failed reading its sampled token "
                    f"{token_id}: {type(cause).__name__}: {cause}"
                )
                error.__cause__ = cause
                logger.warning("%s", error)
                request.error = error
                finish_reason = FinishReason.ERROR
            if finish_reason is None:
                continue
            self.kv_cache.free(request)
            self._finish(request, finish_reason)
            finished.append(request)
        # The core hashes blocks as they fill, so it needs every sampled token (one call). In
        # most decode steps every request sampled and none finished: the step's own lists.
        if not finished and len(sampled_token_ids) == len(output.requests):
            continuing, continuing_token_ids = output.requests, sampled_token_ids
        else:
            sampling = list(itertools.compress(output.requests, output.samples))
            kept = [request.status is not RequestStatus.FINISHED for request in sampling]
            continuing = list(itertools.compress(sampling, kept))
            continuing_token_ids = list(itertools.compress(sampled_token_ids, kept))
        if finished:
            # One pass (order kept) instead of a `list.remove` per finished request.
            self.running[:] = [
                request for request in self.running if request.status is not RequestStatus.FINISHED
            ]
        if continuing:
            self.kv_cache.append_token_ids(continuing, continuing_token_ids)
        return finished

    def _preempt_until_fits(
        self,
        request: Request,
        num_computed_tokens: int,
        num_new_tokens: int,
        output: SchedulerOutput,
    ) -> bool:
        """After `request`'s allocation failed: preempts newest-first, retrying after each,
        until it fits; False when the request itself had to be preempted. `request` is running
        (the newest running request at worst)."""
        kv_cache = self.kv_cache
        if self.policy == "lpm":
            # The holds are the cached prefixes "lpm" orders by: newer running requests give
            # way first (their blocks stay cached, so a preempted request often resumes from
            # them; measured in BENCHMARKS.md).
            while self.held and self.running[-1] is not request:
                self._preempt_newest(output)
                if kv_cache.allocate(request, num_computed_tokens, num_new_tokens):
                    return True
        while self._release_held():
            if kv_cache.allocate(request, num_computed_tokens, num_new_tokens):
                return True
        while True:
            if self._preempt_newest(output) is request:
                return False
            if kv_cache.allocate(request, num_computed_tokens, num_new_tokens):
                return True

    def _preempt_newest(self, output: SchedulerOutput) -> Request:
        """Preempts the newest running request (counted in `output`); returns it."""
        victim = self.running.pop()
        self._preempt(victim)
        output.num_preemptions += 1
        return victim

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request, keep=True)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        waiting = self.waiting
        if not waiting or waiting[0].arrival_index > request.arrival_index:
            # The usual case under "fcfs": every running request arrived before every waiting
            # one, and victims go newest first, so the front keeps the queue in arrival order.
            waiting.appendleft(request)
            return
        # It ran out of arrival order ("lpm", or a hold started while the one before it
        # waited for blocks): put it back where its arrival puts it.
        assert self.policy == "lpm" or self.hold_waiting_prefixes, "fcfs runs in arrival order"
        position = next(
            (i for i, r in enumerate(waiting) if r.arrival_index > request.arrival_index),
            len(waiting),
        )
        waiting.insert(position, request)

    def _lpm_order(self) -> list[Request]:
        """The first `LPM_WINDOW` waiting requests, the longest cached prefix first (ties in
        arrival order); a request overtaken `LPM_MAX_OVERTAKES` times leads. A request that
        holds its hit is weighed by that hit: a probe would not see the blocks it took for
        itself (a token tail), and could weigh it below requests that hit less."""
        window = list(itertools.islice(self.waiting, LPM_WINDOW))
        overtaken = self.overtaken
        held = self.held
        probe = self.kv_cache.probe_cache_hit
        scored = sorted(
            (
                (
                    overtaken.get(request.request_id, 0) < LPM_MAX_OVERTAKES,
                    -(held.get(request.request_id) or probe(request)),
                    i,
                )
                for i, request in enumerate(window)
            ),
        )
        return [window[i] for _, _, i in scored]

    def _admit_waiting(self, token_budget: int, output: SchedulerOutput) -> None:
        self.head_blocked = False
        lpm = self.policy == "lpm" and len(self.waiting) > 1
        order = None  # "lpm": worked out when a request is first taken (not on a full batch)
        retry: Optional[Request] = None  # admitted again after other holds were released
        while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
            if retry is not None:
                request, retry = retry, None
            elif lpm:
                if order is None:
                    order = iter(self._lpm_order())
                request = next(order, self.waiting[0])
            else:
                request = self.waiting[0]
            held = self.held.get(request.request_id)
            if held is None:
                # Holds give their block-table rows to admissions.
                while len(self.running) + len(self.held) >= self.max_num_seqs:
                    self._release_held()
                try:
                    row = self.kv_cache.add(request)
                except InsufficientKVCacheError as error:
                    self._unqueue(request)
                    self._fail(request, error, output)
                    continue
                num_hit_tokens = self.kv_cache.find_cache_hit(request)
            else:
                row, num_hit_tokens = self.kv_cache.row_of(request), held
            num_new_tokens = min(request.num_tokens - num_hit_tokens, token_budget)
            reserve = self._admission_reserve()
            if not self.kv_cache.allocate(request, num_hit_tokens, num_new_tokens, reserve):
                if self.running:
                    if held is None:
                        self.kv_cache.free(request, keep=True)
                    # Blocks come back as running requests finish; meanwhile requests that
                    # hold their hit need blocks for their new tokens only.
                    self.head_blocked = True
                    self._admit_held(token_budget, output, request)
                    break
                if self._release_held(keep=request):
                    if held is None:
                        # Looked up again, with more blocks free.
                        self.kv_cache.free(request, keep=True)
                    retry = request
                    continue
                # Nothing else holds blocks: this request can never start.
                self.held.pop(request.request_id, None)
                self.kv_cache.free(request)
                self._unqueue(request)
                error = self.kv_cache.does_not_fit(request, " (it fails alone, at its first step)")
                self._fail(request, error, output)
                continue
            if lpm:
                self._note_overtakes(request)
            self._start(request, row, num_hit_tokens, num_new_tokens, output)
            token_budget -= num_new_tokens

    def _admission_reserve(self) -> int:
        """Free blocks an admission must leave (`admission_headroom`, while requests run and
        waiting requests, the newcomer among them, hold hits): one per running request and
        growing group whose next token starts a block, so the next step's growth does not
        preempt the newcomer."""
        if not (self.admission_headroom and self.running and self.held):
            return 0
        sizes = self.kv_cache.growing_block_sizes
        return sum(request.num_tokens % size == 0 for request in self.running for size in sizes)

    def _admit_held(self, token_budget: int, output: SchedulerOutput, blocked: Request) -> None:
        """While `blocked` (the next in line) waits for blocks, the waiting requests holding
        their hit start, in arrival order, where the blocks for their new tokens fit: they
        need no block the pool could give `blocked` beyond those."""
        if not self.held:
            return  # no scan of the waiting queue on the steps of a run without holds
        waiting_held = [r for r in self.waiting if r.request_id in self.held and r is not blocked]
        for request in waiting_held:
            if token_budget <= 0 or len(self.running) >= self.max_num_seqs:
                return
            hit = self.held[request.request_id]
            num_new_tokens = min(request.num_tokens - hit, token_budget)
            if self.kv_cache.allocate(request, hit, num_new_tokens, self._admission_reserve()):
                self._start(request, self.kv_cache.row_of(request), hit, num_new_tokens, output)
                token_budget -= num_new_tokens

    def _start(
        self,
        request: Request,
        row: int,
        num_hit_tokens: int,
        num_new_tokens: int,
        output: SchedulerOutput,
    ) -> None:
        """Moves an admitted request (its blocks allocated) from waiting to running."""
        self.held.pop(request.request_id, None)
        self._unqueue(request)
        if not request.has_been_scheduled:
            request.num_cached_tokens = request.min_cached_tokens = num_hit_tokens
            request.has_been_scheduled = True
            request.first_scheduled_time = time.time()
        elif num_hit_tokens < request.min_cached_tokens:
            request.min_cached_tokens = num_hit_tokens  # resumed after a preemption
        request.num_computed_tokens = num_hit_tokens
        request.replay_frontier = self.kv_cache.replay_frontier(request) if num_hit_tokens else 0
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        output.add(request, row, num_hit_tokens, num_new_tokens)

    def _unqueue(self, request: Request) -> None:
        """Takes `request` out of the waiting queue (the front, unless "lpm" picked another)."""
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:
            del self.waiting[next(i for i, r in enumerate(self.waiting) if r is request)]
        self.overtaken.pop(request.request_id, None)

    def _note_overtakes(self, request: Request) -> None:
        """Counts one overtake for every waiting request that arrived before `request`."""
        for earlier in self.waiting:
            if earlier is request:
                return
            self.overtaken[earlier.request_id] = self.overtaken.get(earlier.request_id, 0) + 1

    def _fail(self, request: Request, error: Exception, output: SchedulerOutput) -> None:
        self.kv_cache.forget(request)
        self._finish(request, FinishReason.ERROR)
        request.error = error
        output.failed.append(request)

    @staticmethod
    def _finish(request: Request, reason: FinishReason) -> None:
        request.close_sample_logprobs()  # its logprob rows stay with it, unread
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = time.time()
