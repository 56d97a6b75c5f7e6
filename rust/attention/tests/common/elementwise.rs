//! Naive f64 versions of the fused element-wise ops and the checks the test files share.

use hybrid_cache_attention::{gelu_tanh_mul, rms_norm, silu_mul};
use proptest::prelude::*;

/// Random RMSNorm inputs: (dim 1..80, 0..6 rows of x in -4..4, weight in -2..2); dims that are
/// not multiples of 8 exercise the tails.
pub fn rms_norm_rows() -> impl Strategy<Value = (usize, Vec<f32>, Vec<f32>)> {
    (1usize..80, 0usize..6).prop_flat_map(|(dim, rows)| {
        (
            Just(dim),
            prop::collection::vec(-4.0f32..4.0, rows * dim),
            prop::collection::vec(-2.0f32..2.0, dim),
        )
    })
}

/// `x / sqrt(mean(x^2) + eps) * (offset + weight)` per row, in f64.
pub fn naive_rms_norm(x: &[f32], dim: usize, weight: &[f32], offset: f32, eps: f32) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(dim) {
        let mean = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
        let r = 1.0 / (mean + eps as f64).sqrt();
        for (v, w) in row.iter().zip(weight) {
            out.push(*v as f64 * r * (offset as f64 + *w as f64));
        }
    }
    out
}

/// torch's `gelu(x, approximate="tanh")` in f64. Where `tanh(u)` is within e^-10 of -1, f64
/// would cancel too, so there `1 + tanh(u)` is written `2 e^2u / (1 + e^2u)`.
pub fn naive_gelu_tanh(x: f64) -> f64 {
    let u = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
    if u > -5.0 {
        0.5 * x * (1.0 + u.tanh())
    } else {
        x * (2.0 * u).exp() / (1.0 + (2.0 * u).exp())
    }
}

pub fn naive_silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Runs `rms_norm` and compares with the f64 version: within 2e-6 relative per element.
pub fn check_rms_norm(x: &[f32], dim: usize, weight: &[f32], offset: f32, eps: f32) {
    let mut got = vec![f32::NAN; x.len()];
    rms_norm(x, x.len() / dim, dim, weight, offset, eps, &mut got).unwrap();
    let want = naive_rms_norm(x, dim, weight, offset, eps);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let error = (*g as f64 - w).abs();
        assert!(
            error <= 2e-6 * w.abs() + 1e-37,
            "dim {dim} offset {offset} element {i}: fused {g}, naive {w}"
        );
    }
}

/// Runs the gated op (`gelu` true: gelu-tanh, else silu) and compares with the f64 version.
/// The tolerance is 1e-6 relative plus what rounding the f32 exponent `z` (|z| up to ~88)
/// costs where the sigmoid is small, and an absolute 1e-36 |x up| for values f32 cannot
/// resolve (e^-88 and below).
pub fn check_gated(gelu: bool, gate: &[f32], up: &[f32]) {
    let mut got = vec![f32::NAN; gate.len()];
    if gelu {
        gelu_tanh_mul(gate, up, &mut got).unwrap();
    } else {
        silu_mul(gate, up, &mut got).unwrap();
    }
    for (i, ((g, u), y)) in gate.iter().zip(up).zip(&got).enumerate() {
        let (x, u) = (*g as f64, *u as f64);
        let (want, z) = if gelu {
            let z = 2.0 * (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            (naive_gelu_tanh(x) * u, z)
        } else {
            (naive_silu(x) * u, x)
        };
        let small_sigmoid = if z < 0.0 { -z } else { 0.0 };
        let tolerance = (1e-6 + 3e-7 * small_sigmoid) * want.abs() + 1e-36 * (x * u).abs();
        assert!(
            (*y as f64 - want).abs() <= tolerance,
            "gelu {gelu} element {i}: act({g}) * {u} fused {y}, naive {want}"
        );
    }
}
