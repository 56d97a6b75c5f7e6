"""Type stubs for the PyO3 extension `hybrid_cache._core` (built from rust/python).

This file is the contract between the Rust binding and the Python engine.
"""

from typing import Any, Literal, Optional, Sequence

import numpy as np
import numpy.typing as npt

__version__: str

# The allocator's errors are the classes of `hybrid_cache.errors`, imported by the extension.
from hybrid_cache.errors import DoubleFreeError as DoubleFreeError
from hybrid_cache.errors import DuplicateRequestError as DuplicateRequestError
from hybrid_cache.errors import HybridCacheError as HybridCacheError
from hybrid_cache.errors import InvalidArgumentError as InvalidArgumentError
from hybrid_cache.errors import InvalidBlockError as InvalidBlockError
from hybrid_cache.errors import InvalidGroupError as InvalidGroupError
from hybrid_cache.errors import NoFreeBlocksError as NoFreeBlocksError
from hybrid_cache.errors import RequestTooLargeError as RequestTooLargeError
from hybrid_cache.errors import TooManyRequestsError as TooManyRequestsError
from hybrid_cache.errors import UnknownRequestError as UnknownRequestError

# Block id 0: never handed out; table entries a window (or chunk) released hold it.
NULL_BLOCK: int

AttentionKind = Literal["full", "sliding_window", "chunked_local"]

class GroupSpec:
    """One KV-cache group: its attention kind, window (sliding_window) or chunk (chunked_local),
    and block size in tokens."""

    kind: AttentionKind
    block_size: int
    window: Optional[int]
    chunk: Optional[int]
    def __init__(
        self,
        kind: AttentionKind,
        block_size: int,
        window: Optional[int] = None,
        chunk: Optional[int] = None,
    ) -> None: ...
    def max_live_blocks(self, max_total_tokens: int, max_num_batched_tokens: int) -> int:
        """Most blocks a request of `max_total_tokens` tokens holds at once in this group when
        a step computes at most `max_num_batched_tokens` tokens (the core's admission bound)."""

def worst_case_live_blocks(
    block_size: int,
    reach: Optional[int],
    max_total_tokens: int,
    max_num_batched_tokens: int,
) -> int:
    """The same bound for a group of `block_size`-token blocks whose queries see `reach` tokens
    back (a window or chunk; None for full attention): `cdiv(min(reach - 1 +
    max_num_batched_tokens, max_total_tokens), block_size) + 1`, at most all of the request's
    blocks. Unlike `GroupSpec`, a chunk need not be a multiple of the block size."""

def worst_case_live_tokens(
    reach: Optional[int], max_total_tokens: int, max_num_batched_tokens: int
) -> int:
    """Most tokens of KV a request of `max_total_tokens` tokens keeps at once when its queries
    see `reach` tokens back (None: all of them): `min(reach - 1 + max_num_batched_tokens,
    max_total_tokens)`. The bound above is this in blocks, plus one of misalignment."""

class BlockPool:
    """The lock-free block pool on its own (tests, benchmarks). Block 0 is the null block."""

    def __init__(self, num_blocks: int) -> None: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    def get_new_blocks(self, count: int) -> list[int]: ...
    def free_blocks(self, blocks: Sequence[int]) -> None: ...
    def cache_block(self, block: int, group: int, block_hash: int) -> bool: ...
    def cached_block(self, group: int, block_hash: int) -> Optional[int]: ...
    def touch_cached(self, block: int, group: int, block_hash: int) -> bool: ...
    def reset_prefix_cache(self) -> bool: ...
    def ref_count(self, block: int) -> int: ...
    def free_queue_order(self) -> list[int]: ...

class TableView:
    """Buffer-protocol exporter behind `block_table()` / `num_blocks_per_row()` (read-only)."""

class Coordinator:
    """The hybrid KV-cache coordinator: requests, grouped block table, cache hits, admission.

    Request ids are integers in 0..2^63 chosen by the engine. The block table is persistent Rust
    memory: `block_table()` returns a numpy view (no copy), shape (num_groups, max_num_reqs,
    max_blocks_per_req), int32, where row `row_of(id)` belongs to a request while it is added.
    """

    def __init__(
        self,
        num_blocks: int,
        groups: Sequence[GroupSpec],
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = True,
        hash_algo: Literal["xxh3", "sha256"] = "xxh3",
        hash_seed: int = 0,
        tail_replay_tokens: Optional[int] = None,
        token_tails: bool = False,
        protected_blocks: Optional[int] = None,
    ) -> None:
        """`tail_replay_tokens` (R): let a hit replay a lost window tail, keeping the
        full-attention blocks up to their hit point F and starting the windowed groups over at
        F - R (rounded down to the hit alignment) when that is later than every group's common
        hit; R is the sum of W - 1 over the windowed layers. None: no replay.
        `token_tails`: a freed request's last, partly filled block in each group stays cached
        under a key of exactly its tokens, and a hit may end there, inside a block (the next
        turn of a conversation hits every token the previous turn computed).
        `protected_blocks`: a freed request's cached blocks join a free tier evicted last while
        they fit this many blocks; protected blocks not hit within twice the reuse distance
        seen lately are moved back to LRU order (conversations served round-robin beyond the
        pool's size keep hitting). None: plain LRU."""
    @property
    def num_groups(self) -> int: ...
    @property
    def max_num_reqs(self) -> int: ...
    @property
    def max_blocks_per_req(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    def max_blocks_needed(self, num_tokens: int) -> int:
        """Worst-case blocks (all groups) a request of `num_tokens` total tokens can hold at once."""
    def add_request(
        self,
        request_id: int,
        prompt_token_ids: Sequence[int] | npt.NDArray[np.int64],
        max_total_tokens: Optional[int] = None,
        lora_id: Optional[int] = None,
        cache_salt: Optional[str] = None,
        mm_hashes: Optional[Sequence[tuple[int, int, int]]] = None,
    ) -> int:
        """Adds a request and returns its block-table row. Raises RequestTooLargeError when
        `max_total_tokens` (default: len(prompt)) can never fit; room for that many tokens (and
        the last sampled one) is allocated up front. `mm_hashes` are
        (start_token, num_tokens, item_hash) triples mixed into the blocks they overlap. With
        prefix caching on, a list prompt's blocks are hashed as it is read (other sequences and
        arrays at `find_cache_hit`)."""
    def append_token_ids(self, request_id: int, token_ids: Sequence[int]) -> None: ...
    def append_token_ids_batch(
        self,
        request_ids: npt.NDArray[np.int64] | Sequence[int],
        token_ids: npt.NDArray[np.int64] | Sequence[int],
    ) -> None:
        """One sampled token per request (a decode step) in one call; validated as a whole
        first (known ids, no id twice, room below max_model_len): an error changes nothing."""
    def find_cache_hit(self, request_id: int, max_tokens: Optional[int] = None) -> int:
        """Longest prefix (tokens) every group can hit, at most len(tokens) - 1 and
        `max_tokens`; a multiple of the lcm of block sizes unless it ends on token tails. Stored
        as the request's pending hit; nothing is touched."""
    def replay_frontier(self, request_id: int) -> int:
        """F of the tail replay the request's hit took (0 without one): until its computed
        tokens reach F, full-attention KV below F must be read, never written."""
    def pending_hit_tokens(self, request_id: int) -> int:
        """Tokens of the pending hit (0 when none): the first `allocate` starts there or at 0."""
    def allocate(
        self, request_id: int, num_computed_tokens: int, num_new_tokens: int, reserve: int = 0
    ) -> bool:
        """Releases blocks the window skipped, applies the pending hit, allocates blocks for
        `num_new_tokens` more tokens and caches newly full blocks. All or nothing: returns False
        (nothing changed) when the pool lacks blocks, or would keep fewer than `reserve` free
        blocks after this allocation (room left for others). Also False when the pending hit was
        evicted since `find_cache_hit` (other requests reused its blocks): the pending hit is
        then dropped; call `find_cache_hit` again (or start at 0).

        The first allocate of a request starts at 0 computed tokens, at its pending hit, or
        inside it at a shorter hit (one every group has of exactly that many tokens: a multiple
        of the hit alignment whose blocks are cached; InvalidArgumentError otherwise, the
        pending hit kept). `allocate_batch` takes only 0 or the pending hit. Later
        ones never go back, never pass the tokens that have slots or are known, and ask for at
        most `max_num_batched_tokens` new tokens."""
    def allocate_batch(
        self,
        request_ids: npt.NDArray[np.int64] | Sequence[int],
        num_computed_tokens: npt.NDArray[np.int64] | Sequence[int],
        num_new_tokens: npt.NDArray[np.int64] | Sequence[int],
    ) -> int:
        """`allocate` for each request in order; stops at the first that does not fit and
        returns how many were allocated. int64 arrays are read through the buffer protocol (one
        copy, no per-item Python calls); other sequences of ints work too. Every entry is
        validated before any is applied (unknown ids, an id twice, bad counts raise and change
        nothing)."""
    def preempt_request(self, request_id: int) -> None:
        """Frees the request's blocks and row as free_request does, and keeps its tokens
        (prompt and appended), extra keys and block hashes, so resume_request re-adds it
        without copying or hashing them again. At most 4 * max(max_num_reqs, 4) are kept (the
        oldest forgotten first)."""
    def resume_request(
        self,
        request_id: int,
        max_total_tokens: Optional[int] = None,
        num_tokens: Optional[int] = None,
    ) -> int:
        """Re-adds a request preempt_request kept, with its kept tokens and hashes; returns its
        row. add_request's checks apply; `num_tokens`, when given, must equal the kept count.
        UnknownRequestError when none is kept (never preempted, forgotten, or dropped beyond
        the limit): add it anew. On error the request stays kept."""
    def forget_request(self, request_id: int) -> bool:
        """Drops a request preempt_request kept; False when none is."""
    def free_request(self, request_id: int) -> None:
        """Frees every block of the request (newest first) and releases its row."""
    def num_tokens(self, request_id: int) -> int:
        """Tokens known for the request: prompt plus appended."""
    def row_of(self, request_id: int) -> int: ...
    def request_blocks(self, request_id: int, group: int) -> list[int]:
        """The request's table row in `group` (a copy; 0 marks released entries)."""
    def block_table(self) -> npt.NDArray[np.int32]:
        """Read-only numpy view of the table (no copy); it stays valid while it lives (it keeps
        the coordinator alive) and shows later allocations without calling again. Unused
        entries and blocks released by a window are 0 (the null block)."""
    def num_blocks_per_row(self) -> npt.NDArray[np.int32]:
        """(num_groups, max_num_reqs) int32 view: table entries in use per row."""
    @property
    def num_prefix_queries(self) -> int:
        """`stats()["prefix_queries"]` without the dict: the prefix-cache counters move only
        when it does."""
    def num_used_blocks_per_group(self) -> list[int]:
        """Non-null table entries per group (a block shared by two requests counts twice)."""
    def probe_cache_hit(
        self,
        prompt_token_ids: Sequence[int] | npt.NDArray[np.integer],
        lora_id: Optional[int] = None,
        cache_salt: Optional[str] = None,
        mm_hashes: Optional[Sequence[tuple[int, int, int | bytes]]] = None,
    ) -> int:
        """The hit find_cache_hit would find for this prompt, without adding a request or
        changing anything (not counted in the statistics)."""
    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) page copies the allocations since the last call asked for: the caller
        copies page src into page dst in every layer slot before running the step. A hit that
        ends inside a block another request uses gets a new block holding such a copy."""
    def cached_blocks(self) -> list[tuple[int, int, int]]:
        """Every cached block as (block, group, hash), by block id: a read-only view for tests
        and debugging (reads every block)."""
    def free_queue_order(self) -> list[int]:
        """The free blocks in eviction order, first evicted first (keyless blocks, then the
        Low, Normal and High tiers, oldest first in each)."""
    def num_protected_blocks(self) -> int:
        """Free blocks currently protected (`protected_blocks`), as the coordinator counts
        them."""
    def reset_prefix_cache(self) -> bool: ...
    def stats(self) -> dict[str, Any]:
        """num_blocks, num_free_blocks, num_cached_blocks, num_spare_blocks, num_evictions,
        prefix_queries (tokens looked up), prefix_hits (tokens hit); why the other tokens missed:
        prefix_miss_window_tail (the full-attention prefix was cached further but a windowed
        group lacked the blocks a hit point there needs), prefix_miss_never_cached,
        prefix_miss_evicted, prefix_miss_alignment (the last token and the tokens past the last
        multiple of the hit alignment); per group (lists): prefix_alone_hits_per_group (what the
        group alone would have hit) and prefix_shortened_per_group (of that, what other groups
        cut); tail replays: prefix_replays (lookups), prefix_replay_tokens (tokens they
        recompute below F), prefix_replay_gain (tokens they hit beyond the common hit); token
        tails: prefix_tail_hits (lookups whose hit ended on them), prefix_tail_gain (tokens
        beyond the aligned hit); hashed_blocks (blocks of requests' hash chains hashed so far:
        prompts and sampled tokens, not probes or token tails) and parked_requests (requests
        preempt_request keeps)."""

def paged_attention_cpu(
    q: npt.NDArray[np.float32],
    k_cache: npt.NDArray[np.float32],
    v_cache: npt.NDArray[np.float32],
    block_table: npt.NDArray[np.int32],
    sequence: npt.NDArray[np.int64],
    position: npt.NDArray[np.int64],
    low: npt.NDArray[np.int64],
    out: npt.NDArray[np.float32],
    scale: float,
    softcap: Optional[float] = None,
    sinks: Optional[npt.NDArray[np.float32]] = None,
) -> None:
    """Decode attention on the CPU, reading K/V in place: row r of `q` [rows, Hq, D] attends to
    positions `low[r]..=position[r]` of block-table row `sequence[r]` through `block_table`
    [sequences, width] in the paged caches [num_blocks, block_size, Hkv, D] (any non-negative
    strides, unit last stride); writes `out` (q's shape, C-contiguous, overlapping no input).
    Everything is checked first: `InvalidArgumentError` for shapes, strides and ranges,
    `InvalidBlockError` when a visible position is in the null block or out of range; `out` is
    untouched then."""

def write_cache_cpu(
    cache: npt.NDArray[np.float32],
    new: npt.NDArray[np.float32],
    slots: npt.NDArray[np.int64],
) -> None:
    """Stores row t of `new` [tokens, Hkv, D] (C-contiguous) at slot `slots[t]` (token
    `slot % block_size` of block `slot / block_size`) of `cache` [num_blocks, block_size, Hkv, D]
    (writable, any non-negative strides, unit last stride: the K or V view of a slot tensor).
    `InvalidBlockError` for a slot outside the cache, `InvalidArgumentError` for shapes, strides
    and overlaps; nothing is written then."""

def decode_inputs_cpu(
    block_table: npt.NDArray[np.int32],
    rows: Sequence[int],
    num_computed: Sequence[int],
    block_sizes: Sequence[int],
    positions_out: npt.NDArray[np.int64],
    seq_lens_out: npt.NDArray[np.int32],
    tables_out: npt.NDArray[np.int32],
    slots_out: npt.NDArray[np.int64],
) -> int:
    """A decode step's inputs: for `block_table` [groups, rows, width] (C-contiguous) and the
    sequences at table rows `rows` whose new token sits at `num_computed`, one group per entry
    of `block_sizes`, writes the prefixes of the 1-d buffers `positions_out` (`num_computed`),
    `seq_lens_out` (one more), `tables_out` (group g's `[seqs, ceil(max_seq_len /
    block_sizes[g])]` after group g - 1's) and `slots_out` (`[groups, seqs]`, the new token's
    slot, `block * block_size + position % block_size`); returns `max_seq_len`.
    `InvalidBlockError` when a new token maps to the null block, `InvalidArgumentError` for a
    row or block outside the table, buffers too short or overlapping; outputs are then
    unspecified."""

def rotary_neox_cpu(
    x: npt.NDArray[np.float32],
    cos: npt.NDArray[np.float32],
    sin: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32],
    rotary_dim: int,
) -> None:
    """Neox-style rotary embedding on the CPU: `x` [tokens, heads, head_dim] rotated on its first
    `rotary_dim` dims, `(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)`, by `cos` / `sin`
    (tokens x rotary_dim / 2 values each), the rest copied, into `out` (x's shape, writable,
    overlapping no input). Raises `InvalidArgumentError` on bad shapes and writes nothing."""

def rms_norm_cpu(
    x: npt.NDArray[np.float32],
    weight: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32],
    offset: float,
    eps: float,
) -> None:
    """RMSNorm over the last axis on the CPU: `out = x / sqrt(mean(x^2) + eps) * (offset +
    weight)` with float32 statistics, `x` [..., dim] and `out` (x's shape, writable, overlapping
    no input) C-contiguous, `weight` [dim]. `InvalidArgumentError` for shapes, a non-finite or
    negative eps or an overlap; `out` is untouched then."""

def gelu_tanh_mul_cpu(
    gate: npt.NDArray[np.float32],
    up: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32],
) -> None:
    """`out = gelu(gate, approximate="tanh") * up` element-wise on the CPU; `gate`, `up` and
    `out` C-contiguous, one shape, `out` writable and overlapping no input
    (`InvalidArgumentError` otherwise, `out` untouched)."""

def silu_mul_cpu(
    gate: npt.NDArray[np.float32],
    up: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32],
) -> None:
    """`out = silu(gate) * up` element-wise on the CPU, with `gelu_tanh_mul_cpu`'s arguments."""

def log_softmax_rows_cpu(logits: npt.NDArray[np.float32], out: npt.NDArray[np.float32]) -> None:
    """Writes the log-softmax of each row of `logits` [rows, cols] (C-contiguous) into `out`
    (the same shape, writable, not overlapping `logits`): torch's formula
    `(x - max) - log(sum(exp(x - max)))` with a vectorised exponential, within a few ulp of
    torch's values; a row holding a NaN or +inf, or only -inf, is all NaN, as in torch."""

def top_k_rows_cpu(
    logprobs: npt.NDArray[np.float32],
    k: int,
    chosen: npt.NDArray[np.int64],
    ids_out: npt.NDArray[np.int64],
    values_out: npt.NDArray[np.float32],
    ranks_out: npt.NDArray[np.int64],
) -> list[int]:
    """Per row of `logprobs` [rows, cols] (C-contiguous): `ids_out` / `values_out` [rows, k + 1]
    (writable, overlapping no input or other output) get the chosen token `chosen[row]` and its
    value in column 0, then the row's k largest values and their ids, most likely first;
    `ranks_out` [rows] the chosen token's rank (how many values are at least its own; NaN
    counts nowhere). Returns the rows whose top k is not settled (a tie among the k + 1
    largest, or a NaN): their top-k columns are a guess, to be recomputed (ranks are exact). `InvalidArgumentError` for shapes, `k >= cols` or a chosen id
    outside the row."""

def logprob_top_k_rows_cpu(
    logits: npt.NDArray[np.float32],
    k: int,
    chosen: npt.NDArray[np.int64],
    ids_out: npt.NDArray[np.int64],
    values_out: npt.NDArray[np.float32],
    ranks_out: npt.NDArray[np.int64],
) -> list[int]:
    """`top_k_rows_cpu` of the log-softmax of `logits` without writing it: the values are
    `log_softmax_rows_cpu`'s to the bit and the ranks count them; the ids are ordered by the
    logits (the same order; where rounding makes two logprobs equal, the logit decides).
    Returns the unsettled rows
    and the rows the log-softmax makes NaN (NaN values, rank 0): recompute those from
    `log_softmax_rows_cpu`. Errors as `top_k_rows_cpu`'s."""

def greedy_logprob_top_k_rows_cpu(
    logits: npt.NDArray[np.float32],
    k: int,
    ids_out: npt.NDArray[np.int64],
    values_out: npt.NDArray[np.float32],
    ranks_out: npt.NDArray[np.int64],
) -> list[int]:
    """`logprob_top_k_rows_cpu` with each row's chosen token its largest logit (a greedy
    pick), written to `ids_out[:, 0]`. Returns the unsettled rows (as `logprob_top_k_rows_cpu`,
    and the rows whose largest logit is not the only maximum): their pick and top k are
    guesses, to recompute."""
