//! The rows of `elementwise::rms_norm` (arguments already checked): per row, the sum of
//! squares in 8 lanes (`simd::loops::dot`), one square root, then `(x * r) * (offset + w)` in the
//! order torch's float32 RMSNorm rounds (`offset + w` first, once per call). The same loops
//! are compiled twice: for the baseline target and with AVX2+FMA enabled (LLVM then vectorises
//! them 8 lanes wide).

use crate::simd::dispatch::LANES;
use crate::simd::loops::{dot, map2};

/// Rows of `dim` values: `out = x * (1 / sqrt(mean(x^2) + eps)) * (offset + weight)`. Rows go
/// in blocks of `LANES`: their sums of squares are independent chains the CPU overlaps, and the
/// block's square roots and divisions are one vector step (with small dims, as in the tiny
/// models, a row's latency from loads to its scale factor otherwise sets the pace).
/// `D` is `dim` where a copy is compiled for it (unrolled row loops, no tails), else 0.
#[inline(always)]
fn rows<const D: usize>(
    x: &[f32],
    dim: usize,
    weight: &[f32],
    offset: f32,
    eps: f32,
    out: &mut [f32],
) {
    let dim = if D == 0 { dim } else { D };
    let factors: Vec<f32> = weight.iter().map(|w| offset + w).collect();
    let count = dim as f32;
    for (x, out) in x.chunks(LANES * dim).zip(out.chunks_mut(LANES * dim)) {
        let mut scales = [0.0f32; LANES];
        for (scale, row) in scales.iter_mut().zip(x.chunks_exact(dim)) {
            *scale = dot(row, row);
        }
        // Lanes past the last row of a short block compute a value nobody reads.
        for scale in &mut scales {
            *scale = 1.0 / (*scale / count + eps).sqrt();
        }
        let rows = x.chunks_exact(dim).zip(out.chunks_exact_mut(dim));
        for ((row, out), scale) in rows.zip(scales) {
            scale_row(row, scale, &factors, out);
        }
    }
}

/// One copy of the rows per common dim (the q/k norms' head dims and small hidden sizes, where
/// per-row overheads matter), the generic one (0) for any other.
macro_rules! by_dim {
    ($dim:expr, ($($arg:expr),*)) => {
        match $dim {
            16 => rows::<16>($($arg),*),
            32 => rows::<32>($($arg),*),
            64 => rows::<64>($($arg),*),
            128 => rows::<128>($($arg),*),
            256 => rows::<256>($($arg),*),
            _ => rows::<0>($($arg),*),
        }
    };
}

/// `out[i] = (x[i] * r) * factors[i]` (`factors`: offset + weight).
#[inline(always)]
fn scale_row(x: &[f32], r: f32, factors: &[f32], out: &mut [f32]) {
    map2(x, factors, out, |x, w| (x * r) * w);
}

/// The AVX2+FMA build.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn rows_avx2(
    x: &[f32],
    dim: usize,
    weight: &[f32],
    offset: f32,
    eps: f32,
    out: &mut [f32],
) {
    by_dim!(dim, (x, dim, weight, offset, eps, out))
}

/// The portable build, for the baseline target.
#[inline(never)]
pub(crate) fn rows_portable(
    x: &[f32],
    dim: usize,
    weight: &[f32],
    offset: f32,
    eps: f32,
    out: &mut [f32],
) {
    by_dim!(dim, (x, dim, weight, offset, eps, out))
}
