"""What the pool does for a Gemma-2-shaped model: hybrid vs uniform allocation.

Gemma-2 alternates full-attention and sliding-window (4096 tokens) layers. A uniform allocator
gives both kinds of layers the KV memory of full attention; the hybrid one gives the windowed
layers their own block table and frees the blocks that slide out of the window while the request
runs. This script drives both through the same requests and prints the blocks each group holds,
then shows a prefix-cache hit for a repeated prompt.

Run: `python -m hybrid_cache.demo`.
"""

from __future__ import annotations

import numpy as np

from hybrid_cache import Coordinator, GroupSpec

BLOCK_SIZE = 16
WINDOW = 4096
PROMPT_LEN = 4000
NUM_DECODE_STEPS = 1200
NUM_REQUESTS = 4
CHUNK = 2048  # prefill chunk (max_num_batched_tokens)
REPORT_EVERY = 300


def make_coordinator(hybrid: bool) -> Coordinator:
    """Two groups of layers; in the uniform layout the windowed layers are treated as full."""
    windowed = (
        GroupSpec("sliding_window", BLOCK_SIZE, window=WINDOW)
        if hybrid
        else GroupSpec("full", BLOCK_SIZE)
    )
    groups = [GroupSpec("full", BLOCK_SIZE), windowed]
    return Coordinator(
        num_blocks=4096,
        groups=groups,
        max_num_reqs=8,
        max_model_len=8192,
        max_num_batched_tokens=CHUNK,
    )


def prompt_for(request_id: int) -> np.ndarray:
    rng = np.random.default_rng(request_id)
    return rng.integers(0, 32000, size=PROMPT_LEN, dtype=np.int64)


def prefill(coordinator: Coordinator, request_ids: np.ndarray) -> None:
    for request_id in request_ids:
        coordinator.add_request(int(request_id), prompt_for(int(request_id)), max_total_tokens=8192)
    for start in range(0, PROMPT_LEN, CHUNK):
        count = min(CHUNK, PROMPT_LEN - start)
        computed = np.full(len(request_ids), start, dtype=np.int64)
        new = np.full(len(request_ids), count, dtype=np.int64)
        allocated = coordinator.allocate_batch(request_ids, computed, new)
        assert allocated == len(request_ids), "the demo pool is sized to fit"


def run() -> None:
    request_ids = np.arange(NUM_REQUESTS, dtype=np.int64)
    layouts = {"hybrid": make_coordinator(True), "uniform": make_coordinator(False)}
    for coordinator in layouts.values():
        prefill(coordinator, request_ids)

    print(
        f"Gemma-2-shaped model: group 0 full attention, group 1 sliding window {WINDOW}, "
        f"block {BLOCK_SIZE} tokens; {NUM_REQUESTS} requests, prompt {PROMPT_LEN}, "
        f"decoding {NUM_DECODE_STEPS} tokens each."
    )
    print(f"{'tokens':>7} | {'hybrid full':>11} {'window':>7} {'total':>6} | ", end="")
    print(f"{'uniform full':>12} {'windowed-as-full':>16} {'total':>6} | saved")
    ones = np.ones(NUM_REQUESTS, dtype=np.int64)
    for step in range(NUM_DECODE_STEPS + 1):
        computed = PROMPT_LEN + step
        if step % REPORT_EVERY == 0:
            hybrid = layouts["hybrid"].num_used_blocks_per_group()
            uniform = layouts["uniform"].num_used_blocks_per_group()
            saved = 1 - sum(hybrid) / sum(uniform)
            print(
                f"{computed:>7} | {hybrid[0]:>11} {hybrid[1]:>7} {sum(hybrid):>6} | "
                f"{uniform[0]:>12} {uniform[1]:>16} {sum(uniform):>6} | {saved:5.1%}"
            )
        if step == NUM_DECODE_STEPS:
            break
        for coordinator in layouts.values():
            coordinator.append_token_ids_batch(request_ids, ones)
            computed_array = np.full(NUM_REQUESTS, computed, dtype=np.int64)
            assert coordinator.allocate_batch(request_ids, computed_array, ones) == NUM_REQUESTS

    hybrid = layouts["hybrid"]
    length = 8192
    print(
        f"\nWorst case for one {length}-token request: {hybrid.max_blocks_needed(length)} "
        f"blocks hybrid, {layouts['uniform'].max_blocks_needed(length)} uniform "
        "(admission refuses a request whose worst case exceeds the pool)."
    )
    table = hybrid.block_table()
    row = hybrid.row_of(0)
    live = int(np.count_nonzero(table[1, row, : hybrid.num_blocks_per_row()[1, row]]))
    print(
        f"\nRequest 0's window row holds {live} live blocks; the rest of its "
        f"{hybrid.num_blocks_per_row()[1, row]} entries are the null block (0)."
    )

    for request_id in request_ids:
        hybrid.free_request(int(request_id))
    repeat_id = 100
    hybrid.add_request(repeat_id, prompt_for(0))
    hit = hybrid.find_cache_hit(repeat_id)
    assert hybrid.allocate(repeat_id, hit, PROMPT_LEN - hit)
    stats = hybrid.stats()
    print(
        f"Prefix cache: the repeated prompt of request 0 hits {hit} of {PROMPT_LEN} tokens "
        f"(queries {stats['prefix_queries']} tokens, hits {stats['prefix_hits']}); only "
        f"{PROMPT_LEN - hit} tokens need computing."
    )


if __name__ == "__main__":
    run()
