//! Gated activations `out = act(gate) * up`, portable build (`avx2_gated.rs` has the AVX2 one).
//!
//! Both activations are `x * sigmoid(z)`, computed as `x / (1 + e^-z)`: silu with `z = x`, and
//! gelu-tanh with `z = 2 sqrt(2/pi) (x + 0.044715 x^3)`, since `0.5 (1 + tanh(u))` is
//! `sigmoid(2u)`. This form has no cancellation where `tanh(u)` is close to -1 (large negative
//! x), so it stays within a few ulp of the exact value everywhere; torch's `1 + tanh(u)` loses
//! relative precision there (on values below 1e-3 in magnitude).

use crate::simd::loops::map2;
use crate::simd::math::exp_one;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Activation {
    Silu,
    GeluTanh,
}

/// -2 sqrt(2/pi): `-z = GELU_SCALE * (x + GELU_CUBIC x^3)`.
pub(crate) const GELU_SCALE: f32 = -1.595_769_2;
pub(crate) const GELU_CUBIC: f32 = 0.044_715;

/// `act(x)` for one value (inlined into the loop below, which LLVM vectorises).
#[inline(always)]
fn activate<const GELU: bool>(x: f32) -> f32 {
    let minus_z = if GELU {
        GELU_SCALE * (x + GELU_CUBIC * (x * x * x))
    } else {
        -x
    };
    x / (1.0 + exp_one(minus_z))
}

#[inline(always)]
fn run<const GELU: bool>(gate: &[f32], up: &[f32], out: &mut [f32]) {
    map2(gate, up, out, |g, u| activate::<GELU>(g) * u);
}

/// The portable build, for the baseline target (lengths already checked equal).
#[inline(never)]
pub(crate) fn gated_mul_portable(
    activation: Activation,
    gate: &[f32],
    up: &[f32],
    out: &mut [f32],
) {
    match activation {
        Activation::Silu => run::<false>(gate, up, out),
        Activation::GeluTanh => run::<true>(gate, up, out),
    }
}
