"""The Rust CPU decode kernel (`_core.paged_attention_cpu`, wrapped by `attention.cpu_kernel`):
where the torch backend uses it, and its refusals. Its results against the reference are in
test_torch_batched.py (every case runs with and without it) and, in Rust, against a naive
implementation in rust/attention/tests/against_naive.rs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hybrid_cache import _core
from hybrid_cache.attention import cpu_kernel, reference, torch_batched
from hybrid_cache.attention.params import AttentionParams
from test_torch_batched import fresh_seed, random_step


def kernel_inputs(seed):
    """A random step's one-query rows, as the torch backend hands them to the kernel."""
    q, k_cache, v_cache, metadata = random_step(seed, 4, 2, 4, None, None)
    group = metadata.groups[0]
    plan = torch_batched.step_plan(
        metadata, group, None, None, q.device, kernel=torch_batched.KERNEL_DECODE
    )
    assert isinstance(plan.decode, cpu_kernel.KernelRows)
    rows = plan.decode
    return q, k_cache, v_cache, torch.from_numpy(rows.block_table), rows


def call(q, k_cache, v_cache, table, rows, out):
    _core.paged_attention_cpu(
        q,
        k_cache.numpy(),
        v_cache.numpy(),
        table.numpy(),
        rows.spans.sequences,
        rows.spans.positions,
        rows.spans.low,
        out,
        0.35,
    )


def test_the_torch_backend_sends_decode_rows_to_the_kernel_on_float32_caches():
    seed = fresh_seed()
    q, k_cache, v_cache, metadata = random_step(seed, 4, 2, 4, 5, None)
    assert cpu_kernel.usable(q, k_cache, v_cache)
    assert not cpu_kernel.usable(q, k_cache.bfloat16(), v_cache.bfloat16())
    group = metadata.groups[0]
    plan = torch_batched.step_plan(metadata, group, 5, None, q.device, torch_batched.KERNEL_DECODE)
    assert isinstance(plan.decode, torch_batched.KernelBatch), f"seed {seed}"
    assert isinstance(plan.prefill, torch_batched.RowBatch), f"seed {seed}"
    plan = torch_batched.step_plan(metadata, group, 5, None, q.device, torch_batched.KERNEL_NONE)
    assert isinstance(plan.decode, torch_batched.RowBatch), f"seed {seed}"
    # With softcap or sinks every query token is a kernel row (no torch prefill rows).
    plan = torch_batched.step_plan(metadata, group, 5, None, q.device, torch_batched.KERNEL_ALL)
    assert isinstance(plan.decode, torch_batched.KernelBatch) and plan.prefill is None
    num_tokens = int(metadata.query_start_loc[-1])
    assert plan.decode.token_rows.tolist() == list(range(num_tokens))
    assert plan.decode.every_token


def test_bfloat16_caches_stay_on_the_torch_path_and_match_the_reference():
    seed = fresh_seed()
    q, k_cache, v_cache, metadata = random_step(seed, 4, 2, 4, None, None)
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    args = (q.bfloat16(), k16, v16, metadata, metadata.groups[0], AttentionParams(0.35))
    torch.testing.assert_close(
        torch_batched.paged_attention(*args).float(),
        reference.paged_attention(*args).float(),
        rtol=2e-2,
        atol=2e-2,
        msg=f"seed {seed}",
    )


def test_a_visible_position_in_the_null_block_is_refused_and_nothing_is_written():
    seed = fresh_seed()
    q, k_cache, v_cache, table, rows = kernel_inputs(seed)
    table = table.clone()
    table[rows.spans.sequences[0], rows.spans.positions[0] // k_cache.shape[1]] = 0
    queries = q[rows.token_rows].contiguous().numpy()
    out = np.full(queries.shape, -7.0, dtype=np.float32)
    with pytest.raises(_core.InvalidBlockError, match="null block"):
        call(queries, k_cache, v_cache, table, rows, out)
    assert (out == -7.0).all(), f"seed {seed}: a refused call wrote its output"


def test_bad_buffers_are_refused_with_what_to_change():
    q, k_cache, v_cache, table, rows = kernel_inputs(fresh_seed())
    queries = q[rows.token_rows].contiguous().numpy()
    out = np.zeros_like(queries)
    with pytest.raises(_core.InvalidArgumentError, match="separate output array"):
        call(queries, k_cache, v_cache, table, rows, queries)
    with pytest.raises(_core.InvalidArgumentError, match="q's shape"):
        call(queries, k_cache, v_cache, table, rows, out[:, :1])
    with pytest.raises(_core.InvalidArgumentError, match="must have 3 dimensions"):
        call(queries[0], k_cache, v_cache, table, rows, out)
    with pytest.raises(_core.InvalidArgumentError, match="C-contiguous"):
        call(queries, k_cache, v_cache, table.t(), rows, out)
    with pytest.raises(BufferError, match="not compatible with f32"):
        call(queries.astype(np.float64), k_cache, v_cache, table, rows, out)
    with pytest.raises(_core.InvalidArgumentError, match="same shape"):
        call(queries, k_cache, v_cache[:, :2], table, rows, out)
