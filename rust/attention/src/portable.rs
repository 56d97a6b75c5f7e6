//! The portable build of a step (contract in `kernel.rs`): plain loops over 8-lane arrays,
//! which LLVM vectorises for whatever the target has (SSE2 on baseline x86-64, NEON on
//! aarch64); what a CPU without AVX2+FMA runs.

use crate::block::Lanes;
use crate::kernel::{Kernel, Tile, TILE};
use crate::layout::AttentionParams;
use crate::math;
use crate::softmax::{Running, LANES};

pub(crate) struct Portable;

impl Kernel for Portable {
    type Lanes = [f32; LANES];

    #[inline(always)]
    fn prefetch<const NEAR: bool>(_data: &[f32], _offsets: &[usize], _len: usize) {}

    #[inline(always)]
    unsafe fn step(
        queries: &[f32],
        accs: &mut [f32],
        running: &mut [Running],
        (keys, values): (&[f32], &[f32]),
        tile: &Tile,
        params: &AttentionParams<'_>,
        d: usize,
    ) {
        // Up to 4 heads at a time, phase by phase (all scores, all softmax steps, all values):
        // each head's chain of dependent work is long, and side by side the heads' chains
        // overlap (as in `avx2.rs`).
        const BATCH: usize = 4;
        let batches = queries
            .chunks(BATCH * d)
            .zip(accs.chunks_mut(BATCH * d))
            .zip(running.chunks_mut(BATCH));
        for ((queries, accs), running) in batches {
            let mut weights = [[0.0f32; TILE]; BATCH];
            for (head, q) in weights.iter_mut().zip(queries.chunks_exact(d)) {
                for (score, &key) in head.iter_mut().zip(&tile.keys).take(tile.len) {
                    *score = dot(q, &keys[key..key + d]);
                }
            }
            let mut factors = [1.0f32; BATCH];
            for ((head, factor), running) in weights.iter_mut().zip(&mut factors).zip(running) {
                *factor = running.absorb(head, &tile.padding, params.scale, params.softcap);
            }
            let heads = weights.iter().zip(factors).zip(accs.chunks_exact_mut(d));
            for ((head, factor), acc) in heads {
                if factor != 1.0 {
                    for a in acc.iter_mut() {
                        *a *= factor;
                    }
                }
                for (&weight, &value) in head.iter().zip(&tile.values).take(tile.len) {
                    axpy(acc, weight, &values[value..value + d]);
                }
            }
        }
    }
}

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

/// `acc[i] += weight * x[i]`, 8 lanes at a time through local arrays: each chunk's loads come
/// before its stores, so LLVM vectorises without having to prove that `acc` and `x` do not
/// overlap (it cannot once everything is inlined, and then leaves the loop scalar).
#[inline(always)]
fn axpy(acc: &mut [f32], weight: f32, x: &[f32]) {
    let mut acc_chunks = acc.chunks_exact_mut(LANES);
    let mut x_chunks = x.chunks_exact(LANES);
    for (a, x) in (&mut acc_chunks).zip(&mut x_chunks) {
        let (mut sum, x) = (lanes_of(a), lanes_of(x));
        for (s, x) in sum.iter_mut().zip(x) {
            *s += weight * x;
        }
        a.copy_from_slice(&sum);
    }
    let tail = acc_chunks.into_remainder().iter_mut();
    for (a, x) in tail.zip(x_chunks.remainder()) {
        *a += weight * x;
    }
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
/// loops of `gated.rs` and `norm.rs`; `f` is inlined into each caller (and its build).
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

/// The portable lanes of `block.rs`: loops over 8 floats, which LLVM vectorises. Nothing here
/// needs a CPU feature (the methods are `unsafe` for the AVX2 build's sake only).
impl Lanes for [f32; LANES] {
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        [x; LANES]
    }
    #[inline(always)]
    unsafe fn load(from: &[f32; LANES]) -> Self {
        *from
    }
    #[inline(always)]
    unsafe fn store(self, to: &mut [f32; LANES]) {
        *to = self;
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        std::array::from_fn(|i| self[i] * b[i] + c[i])
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        std::array::from_fn(|i| self[i] * b[i])
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        std::array::from_fn(|i| self[i] + b[i])
    }
    #[inline(always)]
    unsafe fn max(self, b: Self) -> Self {
        std::array::from_fn(|i| if self[i] > b[i] { self[i] } else { b[i] })
    }
    #[inline(always)]
    unsafe fn exp(self) -> Self {
        self.map(math::exp_one)
    }
    #[inline(always)]
    unsafe fn softcap(mut self, cap: f32) -> Self {
        math::softcap(&mut self, cap);
        self
    }
    #[inline(always)]
    unsafe fn unless_masked(self, score: Self) -> Self {
        std::array::from_fn(|i| {
            if score[i] == f32::NEG_INFINITY {
                0.0
            } else {
                self[i]
            }
        })
    }
    #[inline(always)]
    unsafe fn rescale(old: Self, new: Self) -> Self {
        std::array::from_fn(|i| {
            if old[i] == new[i] {
                1.0
            } else {
                math::exp_one(old[i] - new[i])
            }
        })
    }
}
