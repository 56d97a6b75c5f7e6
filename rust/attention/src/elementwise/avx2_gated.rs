//! Gated activations `out = act(gate) * up` in AVX2+FMA, 8 values a register: the formulas of
//! `gated.rs` with `simd::avx2_math::exp`. A tail of fewer than 8 values goes through a padded
//! register, so every value gets the same arithmetic wherever it sits.

use std::arch::x86_64::*;

use crate::elementwise::gated::{Activation, GELU_CUBIC, GELU_SCALE};
use crate::simd::avx2_math::exp;
use crate::simd::dispatch::LANES;

/// `act(x) * up` on 8 lanes.
#[inline(always)]
unsafe fn lanes<const GELU: bool>(x: __m256, up: __m256) -> __m256 {
    let minus_z = if GELU {
        let cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
        let inner = _mm256_fmadd_ps(cube, _mm256_set1_ps(GELU_CUBIC), x);
        _mm256_mul_ps(inner, _mm256_set1_ps(GELU_SCALE))
    } else {
        _mm256_xor_ps(x, _mm256_set1_ps(-0.0))
    };
    let denominator = _mm256_add_ps(_mm256_set1_ps(1.0), exp(minus_z));
    _mm256_mul_ps(_mm256_div_ps(x, denominator), up)
}

#[inline(always)]
unsafe fn run<const GELU: bool>(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let mut out_chunks = out.chunks_exact_mut(LANES);
    let mut gate_chunks = gate.chunks_exact(LANES);
    let mut up_chunks = up.chunks_exact(LANES);
    for ((o, g), u) in (&mut out_chunks).zip(&mut gate_chunks).zip(&mut up_chunks) {
        let y = lanes::<GELU>(_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr()));
        _mm256_storeu_ps(o.as_mut_ptr(), y);
    }
    let tail = out_chunks.into_remainder();
    if !tail.is_empty() {
        let len = tail.len();
        let (mut g, mut u, mut y) = ([0.0f32; LANES], [0.0f32; LANES], [0.0f32; LANES]);
        g[..len].copy_from_slice(gate_chunks.remainder());
        u[..len].copy_from_slice(up_chunks.remainder());
        let result = lanes::<GELU>(_mm256_loadu_ps(g.as_ptr()), _mm256_loadu_ps(u.as_ptr()));
        _mm256_storeu_ps(y.as_mut_ptr(), result);
        tail.copy_from_slice(&y[..len]);
    }
}

/// The AVX2+FMA build (lengths already checked equal).
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn gated_mul(activation: Activation, gate: &[f32], up: &[f32], out: &mut [f32]) {
    match activation {
        Activation::Silu => run::<false>(gate, up, out),
        Activation::GeluTanh => run::<true>(gate, up, out),
    }
}
