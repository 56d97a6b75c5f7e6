"""The fused Rust CPU ops of the model layers (`models.cpu_ops`: RMSNorm, silu/gelu-tanh times
up, rotary embedding) against the torch formulas they replace, the cases that stay on torch, and
the binding's refusals. Their accuracy against f64 over many shapes is also checked in Rust
(rust/attention/tests/elementwise.rs)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hybrid_cache import _core
from hybrid_cache.models import cpu_ops
from hybrid_cache.models.layers import GatedMLP, RMSNorm
from hybrid_cache.models.rotary import RotaryEmbedding


def torch_rms_norm(x, weight, offset, eps):
    """`RMSNorm.forward`'s torch path (float32: both rounding orders are this)."""
    x_float = x.float()
    normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (offset + weight.float())).to(x.dtype)


def f64_rms_norm(x, weight, offset, eps):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + weight.double())


def f64_gelu_tanh(x):
    """In f64, with `0.5 (1 + tanh(u)) = sigmoid(2u)` (1 + tanh cancels for large negative x,
    even in f64)."""
    x = x.double()
    return x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))


def norm_inputs(seed, shape, magnitude):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * magnitude
    weight = torch.randn(shape[-1], generator=generator) * 0.5
    return x, weight


NORM_SHAPES = [(5, 1), (3, 7), (17, 16), (4, 33), (9, 64), (2, 130), (11, 4, 16), (6, 3, 7)]


@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 3e4])
def test_fused_rms_norm_matches_the_torch_formula(shape, offset, magnitude):
    seed = hash((shape, offset, magnitude)) % 2**31
    x, weight = norm_inputs(seed, shape, magnitude)
    with torch.no_grad():
        fused = cpu_ops.rms_norm(x, weight, offset, 1e-6)
    assert fused is not None and fused.shape == x.shape and fused.dtype == torch.float32
    want = torch_rms_norm(x, weight, offset, 1e-6)
    torch.testing.assert_close(fused, want, rtol=2e-6, atol=1e-30, msg=f"seed {seed}")
    exact = f64_rms_norm(x, weight, offset, 1e-6)
    torch.testing.assert_close(fused.double(), exact, rtol=2e-6, atol=1e-30, msg=f"seed {seed}")


def test_eps_dominates_tiny_rows_as_in_torch():
    x, weight = norm_inputs(3, (4, 33), 1e-12)
    fused = cpu_ops.rms_norm(x, weight, 1.0, 1e-5)
    assert fused is not None
    torch.testing.assert_close(fused, torch_rms_norm(x, weight, 1.0, 1e-5), rtol=2e-6, atol=0)
    # mean(x^2) ~ 1e-24 vanishes next to eps: out = x / sqrt(eps) * (1 + weight).
    torch.testing.assert_close(fused, x / math.sqrt(1e-5) * (1 + weight), rtol=1e-5, atol=0)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_module_runs_the_fused_op_on_q_norm_style_views(offset):
    """Gemma's q_norm: [tokens, heads, head_dim] views of a projection's output."""
    projected = torch.randn(13, 4 * 16)
    q = projected.view(13, 4, 16)
    norm = RMSNorm(16, 1e-6, offset=offset)
    with torch.no_grad():
        norm.weight.normal_()
        assert cpu_ops.rms_norm(q, norm.weight, offset, 1e-6) is not None
        got = norm(q)
    assert got.shape == q.shape
    torch.testing.assert_close(got, torch_rms_norm(q, norm.weight, offset, 1e-6), rtol=2e-6, atol=0)


def fallback_inputs():
    x, weight = norm_inputs(5, (6, 24), 1.0)
    return {
        "float64": (x.double(), weight.double()),
        "bfloat16": (x.bfloat16(), weight.bfloat16()),
        "non-contiguous": (torch.randn(24, 6).t(), weight),
        "float64 weight": (x, weight.double()),
        "empty": (torch.empty(0, 24), weight),
    }


@pytest.mark.parametrize("case", sorted(fallback_inputs()))
def test_other_tensors_take_the_torch_path_unchanged(case):
    x, weight = fallback_inputs()[case]
    assert cpu_ops.rms_norm(x, weight, 1.0, 1e-6) is None
    for offset in (0.0, 1.0):
        norm = RMSNorm(24, 1e-6, offset=offset)
        with torch.no_grad():
            norm.weight.copy_(weight)
            norm.weight.data = norm.weight.data.to(weight.dtype)
            got = norm(x)
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + 1e-6)
        if norm.round_before_weight:
            want = norm.weight * normed.to(x.dtype)
        else:
            want = (normed * (offset + norm.weight.float())).to(x.dtype)
        assert got.dtype == want.dtype
        assert torch.equal(got, want), f"{case}: the torch path changed"


def test_autograd_keeps_the_torch_path():
    norm = RMSNorm(8, 1e-6, offset=1.0)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 8, requires_grad=True)
    assert cpu_ops.rms_norm(x, norm.weight, 1.0, 1e-6) is None
    out = norm(x)
    assert out.grad_fn is not None
    out.sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    with torch.no_grad():
        assert cpu_ops.rms_norm(x, norm.weight, 1.0, 1e-6) is not None
    with torch.inference_mode():
        assert cpu_ops.rms_norm(torch.randn(3, 8), norm.weight, 1.0, 1e-6) is not None


GATED_SHAPES = [(1,), (7,), (3, 33), (64, 128), (2, 5, 9)]


def gated_inputs(shape, magnitude):
    """(gate, up): gate scaled by `magnitude`, seeded by the case."""
    generator = torch.Generator().manual_seed(hash((shape, magnitude)) % 2**31)
    gate = torch.randn(shape, generator=generator) * magnitude
    return gate, torch.randn(shape, generator=generator)


@pytest.mark.parametrize("shape", GATED_SHAPES)
@pytest.mark.parametrize("magnitude", [1e-2, 1.0, 8.0])
def test_fused_gelu_tanh_times_up_matches_torch(shape, magnitude):
    gate, up = gated_inputs(shape, magnitude)
    fused = cpu_ops.gated("gelu_pytorch_tanh", gate, up)
    assert fused is not None and fused.shape == gate.shape
    # torch's 1 + tanh(u) cancels for negative gates (absolute error ~1e-7 |gate up|).
    want = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(fused, want, rtol=2e-6, atol=2e-7 * magnitude)
    exact = f64_gelu_tanh(gate) * up.double()
    torch.testing.assert_close(fused.double(), exact, rtol=2e-5, atol=1e-30)


@pytest.mark.parametrize("shape", GATED_SHAPES)
@pytest.mark.parametrize("magnitude", [1e-2, 1.0, 30.0])
def test_fused_silu_times_up_matches_torch(shape, magnitude):
    gate, up = gated_inputs(shape, magnitude)
    fused = cpu_ops.gated("silu", gate, up)
    assert fused is not None
    torch.testing.assert_close(fused, F.silu(gate) * up, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "gelu"])
def test_gated_mlp_matches_its_torch_formula(act):
    torch.manual_seed(0)
    mlp = GatedMLP(16, 40, act)
    x = torch.randn(9, 16)
    with torch.no_grad():
        got = mlp(x)
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        want = mlp.down_proj(mlp.act(gate) * up)
        assert (cpu_ops.gated(act, gate, up) is None) == (act == "gelu")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if act == "gelu":
        assert torch.equal(got, want)


def test_gated_falls_back_for_other_tensors():
    gate, up = torch.randn(4, 8), torch.randn(4, 8)
    assert cpu_ops.gated("gelu", gate, up) is None
    assert cpu_ops.gated("silu", gate.double(), up.double()) is None
    assert cpu_ops.gated("silu", gate.bfloat16(), up.bfloat16()) is None
    assert cpu_ops.gated("silu", gate.t(), up.t()) is None
    assert cpu_ops.gated("silu", gate, up[:, :4]) is None
    assert cpu_ops.gated("silu", gate.requires_grad_(), up) is None
    with torch.no_grad():
        assert cpu_ops.gated("silu", gate, up) is not None


def test_the_binding_refuses_bad_buffers_and_writes_nothing():
    x = np.ones((3, 8), dtype=np.float32)
    weight = np.ones(8, dtype=np.float32)
    out = np.full((3, 8), -7.0, dtype=np.float32)
    with pytest.raises(_core.InvalidArgumentError, match="weight must hold dim = 8"):
        _core.rms_norm_cpu(x, weight[:7], out, 1.0, 1e-6)
    with pytest.raises(_core.InvalidArgumentError, match="eps"):
        _core.rms_norm_cpu(x, weight, out, 1.0, -1.0)
    with pytest.raises(_core.InvalidArgumentError, match="shape"):
        _core.rms_norm_cpu(x, weight, out[:2], 1.0, 1e-6)
    with pytest.raises(_core.InvalidArgumentError, match="C-contiguous"):
        _core.rms_norm_cpu(np.ones((8, 3), dtype=np.float32).T, weight, out, 1.0, 1e-6)
    with pytest.raises(_core.InvalidArgumentError, match="separate output array"):
        _core.rms_norm_cpu(x, weight, x, 1.0, 1e-6)
    with pytest.raises(BufferError):
        _core.rms_norm_cpu(x.astype(np.float64), weight, out, 1.0, 1e-6)
    gate = np.ones((3, 8), dtype=np.float32)
    with pytest.raises(_core.InvalidArgumentError, match="same shape"):
        _core.gelu_tanh_mul_cpu(gate, gate[:, :4].copy(), out)
    with pytest.raises(_core.InvalidArgumentError, match="separate output array"):
        _core.silu_mul_cpu(gate, out, out)
    with pytest.raises(_core.InvalidArgumentError, match="writable"):
        readonly = np.zeros((3, 8), dtype=np.float32)
        readonly.flags.writeable = False
        _core.silu_mul_cpu(gate, gate, readonly)
    assert (out == -7.0).all(), "a refused call wrote its output"


@pytest.mark.parametrize(
    "head_dim,factor,heads", [(32, 1.0, 4), (64, 0.5, 2), (18, 1.0, 3), (128, 0.25, 1)]
)
def test_fused_rotary_is_identical_to_the_torch_rotation(head_dim, factor, heads):
    """Same f32 operations in the same order: bit-identical, partial rotary dims copied."""
    rope = {"rope_theta": 10000.0, "partial_rotary_factor": factor}
    rotary = RotaryEmbedding(head_dim, rope)
    generator = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, 8000, (257,), generator=generator)
    x = torch.randn(257, heads, head_dim, generator=generator) * 5
    cos, sin = rotary.tables(positions, x.dtype)
    fused = cpu_ops.rotary_neox(x, cos, sin, rotary.rotary_dim)
    assert fused is not None
    rotated = rotary._rotate(x, cos, sin)  # the module takes the fused op too
    assert torch.equal(fused, rotated)
    cpu_ops.ENABLED = False
    try:
        by_torch = rotary._rotate(x, cos, sin)
    finally:
        cpu_ops.ENABLED = True
    assert torch.equal(fused, by_torch)
    assert torch.equal(fused[..., rotary.rotary_dim :], x[..., rotary.rotary_dim :])


def test_rotary_falls_back_for_other_tensors():
    rotary = RotaryEmbedding(16, {"rope_theta": 10000.0})
    x = torch.randn(9, 2, 16)
    cos, sin = rotary.tables(torch.arange(9), x.dtype)
    assert cpu_ops.rotary_neox(x.double(), cos.double(), sin.double(), 16) is None
    assert cpu_ops.rotary_neox(x.transpose(0, 1), cos, sin, 16) is None  # not contiguous
    assert cpu_ops.rotary_neox(x, cos[:4], sin[:4], 16) is None  # tables of other tokens
    out = np.full(x.shape, 7.0, dtype=np.float32)
    with pytest.raises(_core.InvalidArgumentError, match="rotary_dim"):
        _core.rotary_neox_cpu(x.numpy(), cos.numpy(), sin.numpy(), out, 15)
    assert (out == 7.0).all()
