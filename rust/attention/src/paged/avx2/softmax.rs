//! The online-softmax step of the AVX2+FMA kernel step (`avx2/mod.rs`) on registers of 8
//! scores: the scale and soft-cap, the horizontal max, and the weights, with the vector `exp`
//! and `softcap` of `simd/avx2_math.rs`.

use std::arch::x86_64::*;

use crate::paged::query::AttentionParams;
use crate::paged::softmax::Running;
use crate::paged::tile::TILE;
use crate::simd::avx2_math::{exp, softcap};
use crate::simd::dispatch::LANES;

const GROUPS: usize = TILE / LANES;

/// Scales (and soft-caps) a tile's dot products, masks the padding lanes, and does the
/// online-softmax step on `running`: returns the tile's weights `exp(score - new max)` (0 on
/// padding) and the factor `exp(old max - new max)` for what was accumulated so far.
#[inline(always)]
pub(crate) unsafe fn absorb(
    running: &mut Running,
    mut scores: [__m256; GROUPS],
    padding: &[f32; TILE],
    params: &AttentionParams<'_>,
) -> ([__m256; GROUPS], __m256) {
    let scale = _mm256_set1_ps(params.scale);
    for (score, pad) in scores.iter_mut().zip(padding.chunks_exact(LANES)) {
        *score = _mm256_mul_ps(*score, scale);
        if let Some(cap) = params.softcap {
            *score = softcap(*score, cap);
        }
        *score = _mm256_add_ps(*score, _mm256_loadu_ps(pad.as_ptr()));
    }
    let mut tile_max = scores[0];
    for score in &scores[1..] {
        tile_max = _mm256_max_ps(tile_max, *score);
    }
    let old = _mm256_set1_ps(running.max);
    // Every lane holds the new max; exp(0) is exactly 1 when it did not grow. The first tile:
    // exp(-inf) is clamped to a tiny positive number, and it multiplies zeros.
    let max = _mm256_max_ps(old, all_lanes_max(tile_max));
    let factor = exp(_mm256_sub_ps(old, max));
    running.max = _mm256_cvtss_f32(max);
    let mut sum = _mm256_mul_ps(_mm256_loadu_ps(running.sum.as_ptr()), factor);
    let padded = _mm256_set1_ps(f32::NEG_INFINITY);
    for score in &mut scores {
        let real = _mm256_cmp_ps::<_CMP_NEQ_OQ>(*score, padded);
        *score = _mm256_and_ps(exp(_mm256_sub_ps(*score, max)), real);
        sum = _mm256_add_ps(sum, *score);
    }
    _mm256_storeu_ps(running.sum.as_mut_ptr(), sum);
    (scores, factor)
}

/// The max of the 8 lanes, in every lane.
#[inline(always)]
unsafe fn all_lanes_max(x: __m256) -> __m256 {
    let m = _mm256_max_ps(x, _mm256_permute2f128_ps::<1>(x, x));
    let m = _mm256_max_ps(m, _mm256_permute_ps::<0b01_00_11_10>(m));
    _mm256_max_ps(m, _mm256_permute_ps::<0b10_11_00_01>(m))
}
