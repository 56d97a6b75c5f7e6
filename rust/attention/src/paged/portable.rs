//! The portable build of a step (contract in `kernel.rs`): plain loops over 8-lane arrays,
//! which LLVM vectorises for whatever the target has (SSE2 on baseline x86-64, NEON on
//! aarch64); what a CPU without AVX2+FMA runs.

use crate::paged::kernel::Kernel;
use crate::paged::lanes::Lanes;
use crate::paged::query::AttentionParams;
use crate::paged::softmax::Running;
use crate::paged::tile::{Tile, TILE};
use crate::simd::dispatch::LANES;
use crate::simd::loops::{dot, lanes_of};
use crate::simd::math;

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
        // overlap (as in `avx2/mod.rs`).
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

/// The portable lanes (`lanes.rs`) of `block.rs`: loops over 8 floats, which LLVM vectorises.
/// Nothing here needs a CPU feature (the methods are `unsafe` for the AVX2 build's sake only).
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
