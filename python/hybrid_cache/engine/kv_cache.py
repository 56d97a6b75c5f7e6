"""The engine's window onto the Rust coordinator: the engine's one user of `_core.Coordinator`.

It owns the `Coordinator`, maps engine request ids (strings) to the integer ids the core uses,
and exposes the persistent grouped block table as a torch tensor that shares the core's memory
(`torch.from_numpy` on the core's numpy view: no copy, ever).
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from hybrid_cache import _core
from hybrid_cache.engine.errors import InsufficientKVCacheError
from hybrid_cache.engine.request import Request, same_requests
from hybrid_cache.planner import KVCacheLayout

_REQUEST_ID = operator.attrgetter("request_id")


class KVCacheManager:
    """Block bookkeeping for the scheduler: admission, cache hits, allocation, release."""

    @classmethod
    def from_layout(
        cls,
        layout: KVCacheLayout,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        hash_seed: int = 0,
        tail_replay: bool = True,
        token_tails: bool = True,
        protected_fraction: float = 0.0,
    ) -> KVCacheManager:
        """A manager for the planner's layout (its groups, in group-id order, and pool size);
        with `tail_replay`, hits may replay a lost window tail where the layout allows it; with
        `token_tails`, a hit may end where a freed request's computed tokens ended, inside a
        block."""
        return cls(
            layout.num_blocks,
            layout.core_specs(),
            max_num_seqs,
            max_model_len,
            max_num_batched_tokens,
            enable_prefix_caching,
            hash_seed,
            tail_replay_tokens=layout.tail_replay_tokens() if tail_replay else None,
            token_tails=token_tails,
            protected_blocks=int(protected_fraction * layout.num_blocks) or None,
        )

    def __init__(
        self,
        num_blocks: int,
        groups: Sequence[_core.GroupSpec],
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        hash_seed: int = 0,
        tail_replay_tokens: Optional[int] = None,
        token_tails: bool = False,
        protected_blocks: Optional[int] = None,
    ) -> None:
        self.groups: list[_core.GroupSpec] = list(groups)
        # Block sizes of the groups whose blocks grow with a request's context (a windowed
        # group's stay level once its window is full: each new block replaces one it left).
        self.growing_block_sizes: list[int] = [
            group.block_size for group in self.groups if group.kind != "sliding_window"
        ]
        self.has_windows: bool = any(group.kind == "sliding_window" for group in self.groups)
        # R of the core's tail replay (None: off); see `replay_frontier`.
        self.tail_replay_tokens: Optional[int] = (
            tail_replay_tokens if enable_prefix_caching else None
        )
        self.enable_prefix_caching: bool = enable_prefix_caching
        self.coordinator: _core.Coordinator = _core.Coordinator(
            num_blocks,
            self.groups,
            max_num_reqs=max_num_seqs,
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            hash_seed=hash_seed,
            tail_replay_tokens=self.tail_replay_tokens,
            token_tails=token_tails,
            protected_blocks=protected_blocks,
        )
        self.core_ids: dict[str, int] = {}
        self.rows: dict[str, int] = {}
        # Core ids of requests given back with `free(..., keep=True)`, until added again.
        self.parked: dict[str, int] = {}
        self.next_core_ids: itertools.count[int] = itertools.count()
        # The last batch whose core ids were looked up, with them and (once asked) its rows:
        # a decode step asks for the same requests' ids two or three times, and the next step
        # for the same batch again. Forgotten when any request is freed (a request added
        # again gets new ones).
        self._batch_memo: Optional[_BatchMemo] = None
        with warnings.catch_warnings():
            # The core's view may be read-only; we never write through it.
            warnings.simplefilter("ignore", UserWarning)
            self.block_table: torch.Tensor = torch.from_numpy(self.coordinator.block_table())
            self.num_blocks_per_row: torch.Tensor = torch.from_numpy(
                self.coordinator.num_blocks_per_row()
            )

    @property
    def num_blocks(self) -> int:
        return self.coordinator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.coordinator.num_free_blocks

    @property
    def num_protected_blocks(self) -> int:
        """Free cached blocks of protected chains (evicted last; `docs/DESIGN.md`)."""
        return self.coordinator.num_protected_blocks()

    @property
    def num_groups(self) -> int:
        return self.coordinator.num_groups

    @property
    def max_num_seqs(self) -> int:
        return self.coordinator.max_num_reqs

    @property
    def max_blocks_per_req(self) -> int:
        return self.coordinator.max_blocks_per_req

    def can_ever_fit(self, num_kv_tokens: int) -> bool:
        """Whether a request holding KV for `num_kv_tokens` tokens fits an otherwise empty pool
        (block 0 is the null block and never handed out)."""
        return self.coordinator.max_blocks_needed(num_kv_tokens) <= self.num_blocks - 1

    def does_not_fit(
        self, request: Request, when: str = "", name: Optional[str] = None
    ) -> InsufficientKVCacheError:
        """The one error (and wording) for a request the pool can never hold: at admission,
        when the core refuses it, or (`when`) when it fails alone in an empty pool; `name`
        names the request in the message (default "request '<id>'")."""
        who = name or f"request {request.request_id!r}"
        return InsufficientKVCacheError(
            f"{who} needs KV for {num_kv_tokens(request)} tokens, "
            f"which does not fit the whole pool of {self.num_blocks - 1} blocks{when}; raise "
            "kv_cache_memory, or lower max_tokens, the prompt length or max_num_batched_tokens"
        )

    def add(self, request: Request) -> int:
        """Registers a request (prompt + output so far) and returns its block-table row. A
        request `free(..., keep=True)` gave back comes back with the tokens and block hashes
        the core kept (nothing copied or hashed again)."""
        assert request.request_id not in self.core_ids, f"{request} is already added"
        core_id = self.parked.pop(request.request_id, None)
        if core_id is not None:
            row = self._resume(request, core_id)
            if row is not None:
                self.core_ids[request.request_id] = core_id
                self.rows[request.request_id] = row
                return row
        core_id = next(self.next_core_ids)
        try:
            row = self.coordinator.add_request(
                core_id, request.all_token_ids, max_total_tokens=num_kv_tokens(request)
            )
        except _core.RequestTooLargeError as error:
            raise self.does_not_fit(request) from error
        self.core_ids[request.request_id] = core_id
        self.rows[request.request_id] = row
        return row

    def _resume(self, request: Request, core_id: int) -> Optional[int]:
        """The row of a kept request re-added by the core; None when the core no longer keeps
        it (beyond its limit) or its token count changed: then it is added anew."""
        try:
            return self.coordinator.resume_request(
                core_id, max_total_tokens=num_kv_tokens(request), num_tokens=request.num_tokens
            )
        except (_core.UnknownRequestError, _core.InvalidArgumentError):
            self.coordinator.forget_request(core_id)
            return None
        except _core.RequestTooLargeError as error:
            self.coordinator.forget_request(core_id)
            raise self.does_not_fit(request) from error
        except Exception:
            self.parked[request.request_id] = core_id  # still kept: the next add resumes it
            raise

    def forget(self, request: Request) -> None:
        """Drops what the core keeps of a request given back with `keep=True` (it finished or
        was aborted while waiting); nothing when none is kept."""
        core_id = self.parked.pop(request.request_id, None)
        if core_id is not None:
            self.coordinator.forget_request(core_id)

    def find_cache_hit(self, request: Request) -> int:
        """Tokens of the request the prefix cache can serve (0 when caching is off, or while
        the request still needs its prompt's logprobs: every prompt token is computed)."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return 0
        return self.coordinator.find_cache_hit(self.core_ids[request.request_id])

    def replay_frontier(self, request: Request) -> int:
        """Where the tail replay the request's hit took ends (0 without one): until its
        computed tokens reach it, the runner must not write full-attention KV for positions
        below it (they hold the cached KV the replay reads)."""
        if self.tail_replay_tokens is None:
            return 0
        return self.coordinator.replay_frontier(self.core_ids[request.request_id])

    def probe_cache_hit(self, request: Request) -> int:
        """The prefix-cache hit the request would get if it were admitted now (0 when caching
        is off, or while it needs its prompt's logprobs), without adding it or changing
        anything."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return 0
        return self.coordinator.probe_cache_hit(request.all_token_ids)

    def allocate(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int, reserve: int = 0
    ) -> bool:
        """All or nothing: blocks for `num_new_tokens` more tokens (applies the pending hit),
        refused also when fewer than `reserve` free blocks would be left."""
        core_id = self.core_ids[request.request_id]
        return self.coordinator.allocate(core_id, num_computed_tokens, num_new_tokens, reserve)

    def allocate_batch(
        self,
        requests: Sequence[Request],
        num_computed_tokens: Sequence[int],
        num_new_tokens: Sequence[int],
    ) -> int:
        """`allocate` for each request in order, in one call to the core: all or nothing per
        request; stops at the first that does not fit and returns how many were allocated."""
        # Lists of ints: the core reads them directly (building numpy arrays costs more).
        return self.coordinator.allocate_batch(
            self._core_ids_of(requests),
            num_computed_tokens,
            num_new_tokens,
        )

    def append_token_ids(self, requests: Sequence[Request], token_ids: Sequence[int]) -> None:
        """Records one sampled token per request (a decode step), in one call to the core."""
        self.coordinator.append_token_ids_batch(
            self._core_ids_of(requests),
            np.asarray(token_ids, dtype=np.int64) if not isinstance(token_ids, list) else token_ids,
        )

    def free(self, request: Request, keep: bool = False) -> None:
        """Returns every block of the request and its row (finish, abort or preemption). With
        `keep` (a request that will be added again: preempted, or not admitted this step) the
        core keeps its tokens and block hashes for the next `add`."""
        core_id = self.core_ids.pop(request.request_id)
        del self.rows[request.request_id]
        self._batch_memo = None
        if keep:
            self.coordinator.preempt_request(core_id)
            self.parked[request.request_id] = core_id
        else:
            self.coordinator.free_request(core_id)

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) pages the allocations since the last call need copied before the step
        runs: a cache hit that ends inside a block another request uses (or that stays cached
        for others) starts from a copy of it in a new block."""
        return self.coordinator.take_block_copies()

    def row_of(self, request: Request) -> int:
        return self.rows[request.request_id]

    def rows_of(self, requests: Sequence[Request]) -> list[int]:
        """`row_of` for each request."""
        memo = self._memo_of(requests)
        if memo.rows is None:
            memo.rows = list(map(self.rows.__getitem__, map(_REQUEST_ID, requests)))
        return memo.rows

    def _core_ids_of(self, requests: Sequence[Request]) -> list[int]:
        """The requests' core ids (C-level maps: no bytecode per request)."""
        return self._memo_of(requests).core_ids

    def _memo_of(self, requests: Sequence[Request]) -> _BatchMemo:
        """The batch memo of `requests` (the same objects in the same order), made anew when
        the last one is of another batch. The check reads no request's id."""
        memo = self._batch_memo
        if memo is None or not same_requests(memo.requests, requests):
            core_ids = list(map(self.core_ids.__getitem__, map(_REQUEST_ID, requests)))
            memo = self._batch_memo = _BatchMemo(list(requests), core_ids)
        return memo

    def num_used_blocks_per_group(self) -> list[int]:
        return self.coordinator.num_used_blocks_per_group()  # a new list each call

    def stats(self) -> dict[str, int]:
        return dict(self.coordinator.stats())

    @property
    def num_prefix_queries(self) -> int:
        """`stats()["prefix_queries"]` without building the dict: the prefix-cache counters
        move only when it does."""
        return self.coordinator.num_prefix_queries

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; refused (False) while any request holds blocks."""
        return self.coordinator.reset_prefix_cache()


@dataclass
class _BatchMemo:
    """A batch's requests and their core ids and rows (`KVCacheManager._memo_of`). The lists
    are handed out as they are: callers only read them."""

    requests: list[Request]
    core_ids: list[int]
    rows: Optional[list[int]] = None


def num_kv_tokens(request: Request) -> int:
    """Most tokens the request ever holds KV for: the last sampled token is never computed."""
    return max(request.num_tokens, request.max_total_tokens - 1)
