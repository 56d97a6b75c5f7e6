//! Loops over f32 slices in 8 lanes through local arrays, which LLVM vectorises for whatever
//! the target has (or for AVX2+FMA, inlined into a function with those features): shared by the
//! portable kernel step (`paged/portable.rs`) and the element-wise ops (`elementwise/norm.rs`,
//! `elementwise/gated.rs`).

use crate::simd::dispatch::LANES;

/// `sum(a[i] * b[i])` in 8 independent lanes (so it vectorises without reassociating).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; LANES];
    let mut a_chunks = a.chunks_exact(LANES);
    let mut b_chunks = b.chunks_exact(LANES);
    for (x, y) in (&mut a_chunks).zip(&mut b_chunks) {
        let (x, y) = (lanes_of(x), lanes_of(y));
        for ((lane, x), y) in lanes.iter_mut().zip(x).zip(y) {
            *lane += x * y;
        }
    }
    // Pairwise (halves, quarters, eighths): 3 dependent adds instead of 7.
    let mut width = LANES / 2;
    while width > 0 {
        for lane in 0..width {
            lanes[lane] += lanes[lane + width];
        }
        width /= 2;
    }
    let mut sum = lanes[0];
    for (x, y) in a_chunks.remainder().iter().zip(b_chunks.remainder()) {
        sum += x * y;
    }
    sum
}

/// A chunk of `chunks_exact(LANES)` as an array (a copy, which is what makes the loops above
/// free of aliasing questions).
#[inline(always)]
pub(crate) fn lanes_of(chunk: &[f32]) -> [f32; LANES] {
    let mut lanes = [0.0f32; LANES];
    lanes.copy_from_slice(chunk);
    lanes
}

/// `out[i] = f(a[i], b[i])`, 8 lanes at a time through local arrays (so LLVM vectorises `f`
/// without proving that `out` overlaps nothing), then the tail one by one. The element-wise
/// loops of `elementwise/gated.rs` and `elementwise/norm.rs`; `f` is inlined into each caller
/// (and its build).
#[inline(always)]
pub(crate) fn map2(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(f32, f32) -> f32) {
    let mut out_chunks = out.chunks_exact_mut(LANES);
    let mut a_chunks = a.chunks_exact(LANES);
    let mut b_chunks = b.chunks_exact(LANES);
    for ((o, a), b) in (&mut out_chunks).zip(&mut a_chunks).zip(&mut b_chunks) {
        let (a, b) = (lanes_of(a), lanes_of(b));
        let mut lanes = [0.0f32; LANES];
        for ((lane, a), b) in lanes.iter_mut().zip(a).zip(b) {
            *lane = f(a, b);
        }
        o.copy_from_slice(&lanes);
    }
    let tail = out_chunks.into_remainder().iter_mut();
    for ((o, a), b) in tail.zip(a_chunks.remainder()).zip(b_chunks.remainder()) {
        *o = f(*a, *b);
    }
}
