//! The two inner loops of the AVX2+FMA step, with the register blocking that LLVM does not
//! find on its own:
//!
//! - scores (`dot8`): 8 keys at a time, one accumulator register per key (8 independent FMA
//!   chains, enough to hide FMA latency), then one transposed reduction that turns the 8
//!   registers into one register of 8 scores, instead of a horizontal sum per key;
//! - values (`accumulate`): the head's output slice stays in up to 8 registers for the whole
//!   tile, split over `P` partial sums of alternating keys when the head is too short to give
//!   8 independent chains by itself.
//!
//! A head_dim that is not a multiple of 8 ends with masked loads and stores.

use std::arch::x86_64::*;

use crate::paged::tile::TILE;

/// Lane j = `q . data[keys[j]..][..q.len()]`. Caller: `keys` holds 8 offsets, each plus
/// `q.len()` at most `data.len()`.
#[inline(always)]
pub(crate) unsafe fn dot8(q: &[f32], data: &[f32], keys: &[usize]) -> __m256 {
    debug_assert_eq!(keys.len(), 8);
    let mut pointers = [data.as_ptr(); 8];
    for (pointer, &offset) in pointers.iter_mut().zip(keys) {
        *pointer = pointer.add(offset);
    }
    let d = q.len();
    let q = q.as_ptr();
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut col = 0;
    while col + 8 <= d {
        let x = _mm256_loadu_ps(q.add(col));
        for (a, key) in acc.iter_mut().zip(&pointers) {
            *a = _mm256_fmadd_ps(x, _mm256_loadu_ps(key.add(col)), *a);
        }
        col += 8;
    }
    if col < d {
        let mask = first_lanes(d - col);
        let x = _mm256_maskload_ps(q.add(col), mask);
        for (a, key) in acc.iter_mut().zip(&pointers) {
            *a = _mm256_fmadd_ps(x, _mm256_maskload_ps(key.add(col), mask), *a);
        }
    }
    // Transposed reduction: two rounds of pairwise adds leave, in each 128-bit half of u0
    // (keys 0-3) and u1 (keys 4-7), one partial sum per key; adding the halves crosswise
    // gives [s0 .. s7] in one register.
    let u0 = _mm256_hadd_ps(
        _mm256_hadd_ps(acc[0], acc[1]),
        _mm256_hadd_ps(acc[2], acc[3]),
    );
    let u1 = _mm256_hadd_ps(
        _mm256_hadd_ps(acc[4], acc[5]),
        _mm256_hadd_ps(acc[6], acc[7]),
    );
    let low_high = _mm256_blend_ps(u0, u1, 0b1111_0000); // [u0 low half | u1 high half]
    let high_low = _mm256_permute2f128_ps(u0, u1, 0x21); // [u0 high half | u1 low half]
    _mm256_add_ps(low_high, high_low)
}

/// `acc = acc * factor + sum over j < n of weights[j] * data[values[j]..][..acc.len()]`,
/// in slabs of columns. Caller: every value offset plus `acc.len()` is inside `data`, and
/// the weights of lanes `n..TILE` are 0.
#[inline(always)]
pub(crate) unsafe fn accumulate(
    acc: &mut [f32],
    factor: __m256,
    weights: &[f32; TILE],
    data: &[f32],
    values: &[usize; TILE],
    n: usize,
) {
    let d = acc.len();
    let out = acc.as_mut_ptr();
    let mut v = [data.as_ptr(); TILE];
    for (pointer, &offset) in v.iter_mut().zip(values) {
        *pointer = pointer.add(offset);
    }
    // Every slab covers columns `col..col + width` with `col + width <= d`.
    let mut col = 0;
    while col + 64 <= d {
        slab::<8, 1>(out.add(col), factor, weights, &v, col, n);
        col += 64;
    }
    if col + 32 <= d {
        slab::<4, 2>(out.add(col), factor, weights, &v, col, n);
        col += 32;
    }
    if col + 16 <= d {
        slab::<2, 4>(out.add(col), factor, weights, &v, col, n);
        col += 16;
    }
    if col + 8 <= d {
        slab::<1, 8>(out.add(col), factor, weights, &v, col, n);
        col += 8;
    }
    if col < d {
        masked_slab(out.add(col), d - col, factor, weights, &v, col, n);
    }
}

/// Columns `col..col + 8 * C` of `accumulate`, with the `8 * C` accumulators in registers
/// and keys split over `P` partial sums (C * P = 8 chains). Runs `n` rounded up to a
/// multiple of `P` keys: the extra lanes have weight 0 and valid pointers. Caller: `out` is
/// valid for `8 * C` floats and every `v[j]` for `col + 8 * C`.
#[inline(always)]
unsafe fn slab<const C: usize, const P: usize>(
    out: *mut f32,
    factor: __m256,
    weights: &[f32; TILE],
    v: &[*const f32; TILE],
    col: usize,
    n: usize,
) {
    let mut sums = [[_mm256_setzero_ps(); C]; P];
    for (c, sum) in sums[0].iter_mut().enumerate() {
        *sum = _mm256_mul_ps(_mm256_loadu_ps(out.add(8 * c)), factor);
    }
    let steps = n.div_ceil(P);
    for (w, v) in weights.chunks_exact(P).zip(v.chunks_exact(P)).take(steps) {
        for ((sum, &w), &v) in sums.iter_mut().zip(w).zip(v) {
            let w = _mm256_set1_ps(w);
            for (c, s) in sum.iter_mut().enumerate() {
                *s = _mm256_fmadd_ps(w, _mm256_loadu_ps(v.add(col + 8 * c)), *s);
            }
        }
    }
    for c in 0..C {
        let mut total = sums[0][c];
        for sum in &sums[1..] {
            total = _mm256_add_ps(total, sum[c]);
        }
        _mm256_storeu_ps(out.add(8 * c), total);
    }
}

/// `slab` for the last `r < 8` columns, with masked loads and stores. Caller: `out` is valid
/// for `r` floats and every `v[j]` for `col + r`.
#[inline(always)]
unsafe fn masked_slab(
    out: *mut f32,
    r: usize,
    factor: __m256,
    weights: &[f32; TILE],
    v: &[*const f32; TILE],
    col: usize,
    n: usize,
) {
    let mask = first_lanes(r);
    let mut sum = _mm256_mul_ps(_mm256_maskload_ps(out, mask), factor);
    for (&w, &v) in weights.iter().zip(v).take(n) {
        let x = _mm256_maskload_ps(v.add(col), mask);
        sum = _mm256_fmadd_ps(_mm256_set1_ps(w), x, sum);
    }
    _mm256_maskstore_ps(out, mask, sum);
}

/// The mask of the first `r` lanes (1 <= r <= 8) for masked loads and stores, which do not
/// touch the other lanes' memory: how a head_dim that is not a multiple of 8 is finished.
#[inline(always)]
unsafe fn first_lanes(r: usize) -> __m256i {
    static BITS: [i32; 16] = [-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0];
    debug_assert!((1..=8).contains(&r));
    // SAFETY: 8 - r is in 0..=7, so the 8 lanes read are inside BITS.
    _mm256_loadu_si256(BITS.as_ptr().add(8 - r).cast())
}
