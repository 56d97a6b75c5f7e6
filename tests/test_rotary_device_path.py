"""`RotaryEmbedding.rotate_wide`, the rotation CUDA tensors take (4 operators instead of 11),
against `_rotate`, the one the CPU keeps: the same values bit for bit in every dtype. They run
on the CPU here (the same torch code); on CUDA `scripts/gpu_engine_check.py` runs the engine
against the CPU engine token for token and `scripts/gpu_decode_anatomy.py` counts the
operators."""

from __future__ import annotations

import pytest
import torch
from hybrid_cache.models.rotary import RotaryEmbedding

ROPES = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("head_dim", [16, 256])
def test_the_wide_rotation_equals_the_halves_rotation_bit_for_bit(dtype, rope, head_dim):
    rotary = RotaryEmbedding(head_dim, rope)
    generator = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 40000, (37,), generator=generator)
    x = (torch.randn(37, 6, head_dim, generator=generator) * 4).to(dtype)
    x[0, 0] = 0.0  # zero products on both sides
    cos, sin = rotary.tables(positions, dtype)
    wide_cos, wide_sin = rotary.wide_tables(positions, dtype)
    assert wide_cos.shape == wide_sin.shape == (37, 1, head_dim)
    got, want = rotary.rotate_wide(x, wide_cos, wide_sin), rotary._rotate(x, cos, sin)
    assert got.dtype == dtype and torch.equal(got, want)
    assert not torch.equal(got, x)  # it did rotate


def test_the_wide_tables_are_built_once_per_step():
    rotary = RotaryEmbedding(32, ROPES[0])
    positions = torch.arange(9)
    first = rotary.wide_tables(positions, torch.bfloat16)
    assert rotary.wide_tables(positions, torch.bfloat16) is first
    assert rotary.wide_tables(torch.arange(9), torch.bfloat16) is not first  # a new step


def test_cpu_tensors_keep_the_halves_rotation(monkeypatch):
    """Off CUDA `forward` writes one output (`_rotate`, or the Rust op in float32)."""
    rotary = RotaryEmbedding(16, ROPES[0])
    monkeypatch.setattr(RotaryEmbedding, "rotate_wide", lambda *args: pytest.fail("wide path"))
    q, k = torch.randn(5, 4, 16).bfloat16(), torch.randn(5, 2, 16).bfloat16()
    positions = torch.arange(5)
    got_q, got_k = rotary(positions, q, k)
    cos, sin = rotary.tables(positions, torch.bfloat16)
    assert torch.equal(got_q, rotary._rotate(q, cos, sin))
    assert torch.equal(got_k, rotary._rotate(k, cos, sin))
