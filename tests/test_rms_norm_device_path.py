"""`RMSNorm.forward_fused`, the path CUDA tensors take (torch's `rms_norm` on the float32 values:
3-5 operators launched instead of 10), against `forward`'s torch path in each rounding order.
It runs on the CPU here (the same torch code; on CUDA torch dispatches a fused kernel for
`rms_norm`, exercised by `scripts/gpu_engine_check.py` and timed by
`scripts/gpu_decode_anatomy.py` on a GPU)."""

from __future__ import annotations

import pytest
import torch
from hybrid_cache.models.layers import RMSNorm

# (offset, round_before_weight): Llama, Gemma, gpt-oss.
MODES = [(0.0, True), (1.0, False), (0.0, False)]


def torch_path(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`RMSNorm.forward`'s torch formula (what runs off CUDA when the Rust op does not)."""
    x_float = x.float()
    normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + norm.eps)
    if norm.round_before_weight:
        return norm.weight * normed.to(x.dtype)
    return (normed * (norm.offset + norm.weight.float())).to(x.dtype)


def make(dim: int, offset: float, round_before: bool, dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(dim, 1e-6, offset=offset, round_before_weight=round_before)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = torch.randn(dim, generator=generator) * 0.3 + (1.0 if offset == 0.0 else 0.0)
        norm.weight.data = weight.to(dtype)
    return norm


@pytest.mark.parametrize("offset, round_before", MODES)
@pytest.mark.parametrize("shape", [(7, 64), (3, 4, 16), (1, 3840), (32, 16, 256)])
def test_the_fused_path_equals_the_torch_path_in_float32(offset, round_before, shape):
    norm = make(shape[-1], offset, round_before, torch.float32, seed=len(shape) + shape[-1])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])) * 3.0
    with torch.no_grad():
        got, want = norm.forward_fused(x), torch_path(norm, x)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("offset, round_before", MODES)
def test_the_fused_path_rounds_bf16_where_the_torch_path_does(offset, round_before):
    """In bf16 both paths round the same float32 values once (before or after the weight): at
    most one bf16 step apart where the float32 values straddle a rounding boundary."""
    norm = make(256, offset, round_before, torch.bfloat16, seed=5)
    x = (torch.randn(64, 256, generator=torch.Generator().manual_seed(9)) * 2).bfloat16()
    with torch.no_grad():
        got, want = norm.forward_fused(x), torch_path(norm, x)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    same = (got == want).float().mean().item()
    assert same >= 0.99, same
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


def test_the_fused_path_follows_a_weight_changed_in_place():
    """Nothing derived from the weight is kept between calls: a reloaded weight is used."""
    norm = make(32, 1.0, False, torch.float32, seed=1)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = norm.forward_fused(x)
        norm.weight.data.mul_(2.0)
        after = norm.forward_fused(x)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, torch_path(norm, x), rtol=2e-6, atol=1e-7)


def test_cpu_tensors_do_not_take_the_fused_path(monkeypatch):
    """Off CUDA `forward` keeps its own paths (the Rust op, else the torch formula)."""
    norm = make(16, 1.0, False, torch.bfloat16, seed=3)
    calls = []
    monkeypatch.setattr(RMSNorm, "forward_fused", lambda self, x: calls.append(x))
    x = torch.randn(2, 16).bfloat16()
    with torch.no_grad():
        got = norm(x)
    assert calls == [] and torch.equal(got, torch_path(norm, x))
