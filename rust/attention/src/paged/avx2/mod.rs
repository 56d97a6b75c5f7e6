//! The AVX2+FMA build of a step (contract in `kernel.rs`), with intrinsics: the scores of a
//! tile's 8-key groups and the value accumulation (`loops.rs`), and the softmax step on
//! registers of 8 scores (`softmax.rs`), for up to 4 query heads side by side.
//!
//! All helpers are `#[inline(always)]` without target features of their own: they are only
//! called from the `#[target_feature(enable = "avx2,fma")]` entry in `paged/mod.rs`, and once
//! inlined there the intrinsics compile to single instructions.

mod loops;
mod softmax;

use std::arch::x86_64::*;

use crate::paged::kernel::Kernel;
use crate::paged::lanes::Lanes;
use crate::paged::query::AttentionParams;
use crate::paged::softmax::Running;
use crate::paged::tile::{Tile, TILE};
use crate::simd::avx2_math;
use crate::simd::dispatch::LANES;
use loops::{accumulate, dot8};

/// Vectors of scores per tile.
const GROUPS: usize = TILE / LANES;
const _: () = assert!(TILE.is_multiple_of(LANES) && LANES == 8);

pub(crate) struct Avx2;

impl Kernel for Avx2 {
    type Lanes = Ymm;

    #[inline(always)]
    fn prefetch<const NEAR: bool>(data: &[f32], offsets: &[usize], len: usize) {
        const LINE: usize = 64 / std::mem::size_of::<f32>();
        for &offset in offsets {
            // Every 16th float, then the last one, so that a run straddling a line boundary is
            // covered: a loop the compiler unrolls when `len` is a constant. The addresses are
            // computed with wrapping arithmetic and never dereferenced.
            let start = data.as_ptr().wrapping_add(offset);
            let mut at = 0;
            while at < len {
                prefetch_line::<NEAR>(start.wrapping_add(at));
                at += LINE;
            }
            prefetch_line::<NEAR>(start.wrapping_add(len.saturating_sub(1)));
        }
    }

    #[inline(always)]
    unsafe fn step(
        queries: &[f32],
        accs: &mut [f32],
        running: &mut [Running],
        caches: (&[f32], &[f32]),
        tile: &Tile,
        params: &AttentionParams<'_>,
        d: usize,
    ) {
        // Four, two or one heads at a time (see `heads`).
        let mut queries = queries.chunks_exact(4 * d);
        let mut accs = accs.chunks_exact_mut(4 * d);
        let mut running = running.chunks_exact_mut(4);
        for ((q, acc), run) in (&mut queries).zip(&mut accs).zip(&mut running) {
            heads::<4>(q, acc, run, caches, tile, params, d);
        }
        let (mut q, mut acc, mut run) = (
            queries.remainder(),
            accs.into_remainder(),
            running.into_remainder(),
        );
        if run.len() >= 2 {
            let (q2, q1) = q.split_at(2 * d);
            let (acc2, acc1) = acc.split_at_mut(2 * d);
            let (run2, run1) = run.split_at_mut(2);
            heads::<2>(q2, acc2, run2, caches, tile, params, d);
            (q, acc, run) = (q1, acc1, run1);
        }
        if run.len() == 1 {
            heads::<1>(q, acc, run, caches, tile, params, d);
        }
    }
}

/// The step for `B` query heads side by side, phase by phase (scores of all, softmax of all,
/// values of all): each head's work is one long dependent chain (dot products -> max -> exp
/// -> weights -> accumulate) too long for the CPU to overlap with the next head's on its
/// own; written side by side, the heads' chains run in parallel.
#[inline(always)]
unsafe fn heads<const B: usize>(
    queries: &[f32],
    accs: &mut [f32],
    running: &mut [Running],
    (keys, values): (&[f32], &[f32]),
    tile: &Tile,
    params: &AttentionParams<'_>,
    d: usize,
) {
    // SAFETY (the loads below): the trait's contract, every key and value offset of the tile
    // plus `d` is inside `keys` / `values`.
    let mut scores = [[_mm256_setzero_ps(); GROUPS]; B];
    for (head, q) in scores.iter_mut().zip(queries.chunks_exact(d)) {
        for (group, score) in head.iter_mut().enumerate() {
            // Groups past the tile's tokens stay 0 (then padding: weight 0).
            if group * LANES < tile.len {
                *score = dot8(q, keys, &tile.keys[group * LANES..(group + 1) * LANES]);
            }
        }
    }
    let mut factors = [_mm256_setzero_ps(); B];
    for ((head, factor), run) in scores.iter_mut().zip(&mut factors).zip(running.iter_mut()) {
        (*head, *factor) = softmax::absorb(run, *head, &tile.padding, params);
    }
    for ((head, &factor), acc) in scores.iter().zip(&factors).zip(accs.chunks_exact_mut(d)) {
        let mut w = [0.0f32; TILE];
        for (chunk, &weight) in w.chunks_exact_mut(LANES).zip(head) {
            _mm256_storeu_ps(chunk.as_mut_ptr(), weight);
        }
        accumulate(acc, factor, &w, values, &tile.values, tile.len);
    }
}

/// Asks for the cache line holding `at` to be brought into L1 (`NEAR`) or L2.
#[inline(always)]
fn prefetch_line<const NEAR: bool>(at: *const f32) {
    // SAFETY: SSE is part of x86-64, and a prefetch reads nothing (it cannot fault).
    unsafe {
        if NEAR {
            _mm_prefetch::<_MM_HINT_T0>(at.cast());
        } else {
            _mm_prefetch::<_MM_HINT_T1>(at.cast());
        }
    }
}

/// The AVX2+FMA lanes (`lanes.rs`) of `block.rs`: one register.
#[derive(Clone, Copy)]
pub(crate) struct Ymm(__m256);

impl Lanes for Ymm {
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Ymm(_mm256_set1_ps(x))
    }
    #[inline(always)]
    unsafe fn load(from: &[f32; LANES]) -> Self {
        Ymm(_mm256_loadu_ps(from.as_ptr()))
    }
    #[inline(always)]
    unsafe fn store(self, to: &mut [f32; LANES]) {
        _mm256_storeu_ps(to.as_mut_ptr(), self.0)
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        Ymm(_mm256_fmadd_ps(self.0, b.0, c.0))
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        Ymm(_mm256_mul_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        Ymm(_mm256_add_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn max(self, b: Self) -> Self {
        Ymm(_mm256_max_ps(self.0, b.0))
    }
    #[inline(always)]
    unsafe fn exp(self) -> Self {
        Ymm(avx2_math::exp(self.0))
    }
    #[inline(always)]
    unsafe fn softcap(self, cap: f32) -> Self {
        Ymm(avx2_math::softcap(self.0, cap))
    }
    #[inline(always)]
    unsafe fn unless_masked(self, score: Self) -> Self {
        let real = _mm256_cmp_ps::<_CMP_NEQ_OQ>(score.0, _mm256_set1_ps(f32::NEG_INFINITY));
        Ymm(_mm256_and_ps(self.0, real))
    }
    #[inline(always)]
    unsafe fn rescale(old: Self, new: Self) -> Self {
        let same = _mm256_cmp_ps::<_CMP_EQ_OQ>(old.0, new.0);
        let factor = avx2_math::exp(_mm256_sub_ps(old.0, new.0));
        Ymm(_mm256_blendv_ps(factor, _mm256_set1_ps(1.0), same))
    }
}
