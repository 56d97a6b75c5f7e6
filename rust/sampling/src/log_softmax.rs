//! The log-softmax of each row, `(x - max) - ln(sum(exp(x - max)))`, the formula torch's CPU
//! kernel uses, in passes over the row that vectorise (the maximum, the exponentials, their
//! sum, the output; `logprobs` takes the maximum from its top k and writes only k + 1
//! values). The exponential is a polynomial over a reduced range (no libm call per value),
//! within about one ulp; the sum is kept in independent float32 lanes (8 in the portable
//! build, 16 with AVX2 + FMA), added up in float64, so a value differs from torch's by at most
//! a few ulp of the row's `ln(sum)`, never in order.
//!
//! Rows torch makes all NaN are all NaN here too: a row holding a NaN or `+inf`, and a row of
//! only `-inf` (its maximum minus itself is NaN).

use crate::error::{ensure, SamplingError};

/// Independent maxima and sums the portable loops keep per row (one AVX2 register of float32).
const LANES: usize = 8;

/// Below this, `exp` is under float32's normal range; the row's maximum adds 1 to the sum, so
/// such terms change nothing and count as 0.
const EXP_FLOOR: f32 = -87.0;

/// A row's log-softmax as a shift of its values: `(x - max) - ln_sum`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shift {
    pub max: f32,
    pub ln_sum: f32,
}

impl Shift {
    /// Leaves values as they are (`(x - 0) - 0 == x`, NaN and signed zeros included).
    pub const NONE: Shift = Shift {
        max: 0.0,
        ln_sum: 0.0,
    };

    #[inline(always)]
    pub fn apply(self, value: f32) -> f32 {
        (value - self.max) - self.ln_sum
    }

    /// The shift of a row whose maximum is `max` (None when torch's formula makes the row
    /// NaN: `max` infinite, or the row holds a NaN), `scratch` a buffer of the row's length.
    pub fn of_row(line: &[f32], max: f32, nan: bool, scratch: &mut [f32]) -> Option<Shift> {
        if nan || !max.is_finite() {
            return None;
        }
        Some(Shift {
            max,
            ln_sum: ln_sum_exp(line, max, scratch),
        })
    }
}

/// Writes the log-softmax of each row of `logits` (`[rows, cols]`, row-major) into `out`
/// (the same shape).
pub fn log_softmax_rows(logits: &[f32], cols: usize, out: &mut [f32]) -> Result<(), SamplingError> {
    ensure(cols > 0 && logits.len().is_multiple_of(cols), || {
        format!("{} logits do not make rows of {cols} columns", logits.len())
    })?;
    ensure(out.len() == logits.len(), || {
        format!(
            "the output must hold as many values as the logits ({}), got {}",
            logits.len(),
            out.len()
        )
    })?;
    for (line, out_line) in logits.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
        let (max, nan) = max_and_nan(line);
        match Shift::of_row(line, max, nan, out_line) {
            Some(shift) => {
                for (slot, &value) in out_line.iter_mut().zip(line) {
                    *slot = shift.apply(value);
                }
            }
            None => out_line.fill(f32::NAN),
        }
    }
    Ok(())
}

/// `ln(sum(exp(x - max)))` over `line` (`max` its finite maximum): AVX2 with FMA where the CPU
/// has them, else the portable build, the exponentials written to `scratch` first (a plain
/// map vectorises; a sum folded into it did not). The two differ in rounding only (fused
/// multiply-adds), by an ulp or so of the sum.
fn ln_sum_exp(line: &[f32], max: f32, scratch: &mut [f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        return unsafe { sum_exp_avx2_fma(line, max) }.ln() as f32;
    }
    ln_sum_exp_body(line, max, scratch)
}

#[inline(always)]
fn ln_sum_exp_body(line: &[f32], max: f32, scratch: &mut [f32]) -> f32 {
    for (slot, &value) in scratch.iter_mut().zip(line) {
        *slot = exp_shifted(value - max);
    }
    let mut sums = [0f32; LANES];
    let mut parts = scratch[..line.len()].chunks_exact(LANES);
    for part in &mut parts {
        for lane in 0..LANES {
            sums[lane] += part[lane];
        }
    }
    let tail: f64 = parts
        .remainder()
        .iter()
        .map(|&value| f64::from(value))
        .sum();
    let sum = sums.iter().map(|&s| f64::from(s)).sum::<f64>() + tail;
    sum.ln() as f32
}

/// The row's maximum (NaN left out) and whether it holds a NaN.
fn max_and_nan(line: &[f32]) -> (f32, bool) {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut unordered = [false; LANES];
    let mut parts = line.chunks_exact(LANES);
    for part in &mut parts {
        for lane in 0..LANES {
            let value = part[lane];
            // `value > lanes[lane]` is false for NaN, which `unordered` records instead.
            lanes[lane] = if value > lanes[lane] {
                value
            } else {
                lanes[lane]
            };
            unordered[lane] |= value.is_nan();
        }
    }
    let mut max = f32::NEG_INFINITY;
    let mut nan = unordered.iter().any(|&flag| flag);
    for &value in lanes.iter().chain(parts.remainder()) {
        nan |= value.is_nan();
        if value > max {
            max = value;
        }
    }
    (max, nan)
}

const LOG2_E: f32 = std::f32::consts::LOG2_E;
/// ln 2's leading bits (exact times any n of the range) and the rest.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Adding 1.5 * 2^23 rounds to an integer, which lands in the low mantissa bits.
const ROUND: f32 = 12_582_912.0;
/// Cephes' polynomial for `(e^r - 1 - r) / r^2`, highest degree first.
const POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// `e^x` for `x <= 0` (a value minus its row's maximum; `-inf` included): Cody-Waite range
/// reduction `x = n ln 2 + r`, `|r| <= ln 2 / 2`, Cephes' degree-6 polynomial for `e^r`,
/// and `2^n` built in the exponent bits. 0 below `EXP_FLOOR`. No branch (it vectorises).
#[inline(always)]
fn exp_shifted(x: f32) -> f32 {
    let t = if x > EXP_FLOOR { x } else { EXP_FLOOR };
    let shifted = t * LOG2_E + ROUND;
    let n = shifted - ROUND; // round(t / ln 2), in -126..=0
    let r = (t - n * LN2_HI) - n * LN2_LO;
    let p = POLY[1..].iter().fold(POLY[0], |p, &c| p * r + c);
    let e_r = p * r * r + r + 1.0;
    // The integer n sits in the low bits of `shifted` (offset by ROUND's own bits).
    let n_int = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    let scale = f32::from_bits(((n_int + 127) as u32) << 23);
    if x > EXP_FLOOR {
        e_r * scale
    } else {
        0.0
    }
}

/// `sum(exp(x - max))` over `line`: `exp_shifted` on 8 lanes with fused multiply-adds, in two
/// independent sums (the additions' latency hidden), the last `len % 8` values one by one.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_exp_avx2_fma(line: &[f32], max: f32) -> f64 {
    use std::arch::x86_64::*;
    let vmax = _mm256_set1_ps(max);
    let floor = _mm256_set1_ps(EXP_FLOOR);
    let log2_e = _mm256_set1_ps(LOG2_E);
    let round = _mm256_set1_ps(ROUND);
    let ln2_hi = _mm256_set1_ps(LN2_HI);
    let ln2_lo = _mm256_set1_ps(LN2_LO);
    let one = _mm256_set1_ps(1.0);
    let bias = _mm256_set1_epi32(127 - ROUND.to_bits() as i32);
    let poly = POLY.map(|c| _mm256_set1_ps(c));
    let exp8 = |x: __m256| {
        let keep = _mm256_cmp_ps::<_CMP_GT_OQ>(x, floor);
        let t = _mm256_max_ps(x, floor);
        let shifted = _mm256_fmadd_ps(t, log2_e, round);
        let n = _mm256_sub_ps(shifted, round);
        let r = _mm256_fnmadd_ps(n, ln2_lo, _mm256_fnmadd_ps(n, ln2_hi, t));
        let mut p = poly[0];
        for &c in &poly[1..] {
            p = _mm256_fmadd_ps(p, r, c);
        }
        let e_r = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), one);
        let exponent = _mm256_add_epi32(_mm256_castps_si256(shifted), bias);
        let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(exponent));
        _mm256_and_ps(_mm256_mul_ps(e_r, scale), keep)
    };
    let mut sums = [_mm256_setzero_ps(); 2];
    let mut pairs = line.chunks_exact(16);
    for pair in &mut pairs {
        // SAFETY: `pair` holds 16 values; unaligned loads.
        let (a, b) = unsafe {
            (
                _mm256_loadu_ps(pair.as_ptr()),
                _mm256_loadu_ps(pair.as_ptr().add(8)),
            )
        };
        sums[0] = _mm256_add_ps(sums[0], exp8(_mm256_sub_ps(a, vmax)));
        sums[1] = _mm256_add_ps(sums[1], exp8(_mm256_sub_ps(b, vmax)));
    }
    let mut lanes = [0f32; 16];
    // SAFETY: `lanes` holds 16 values; unaligned stores.
    unsafe {
        _mm256_storeu_ps(lanes.as_mut_ptr(), sums[0]);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), sums[1]);
    }
    let tail = pairs.remainder();
    let tail_sum: f64 = tail.iter().map(|&v| f64::from(exp_shifted(v - max))).sum();
    lanes.iter().map(|&s| f64::from(s)).sum::<f64>() + tail_sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exponential_is_within_two_ulp_of_libm_over_its_range() {
        let mut worst = 0f64;
        let mut x = EXP_FLOOR + 1e-3;
        while x <= 0.0 {
            let got = f64::from(exp_shifted(x));
            let want = f64::from(x).exp();
            let ulp = f64::from(f32::EPSILON) * want;
            worst = worst.max((got - want).abs() / ulp);
            x += 0.000_37;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp_shifted(0.0), 1.0);
        assert_eq!(exp_shifted(-0.0), 1.0);
        assert_eq!(exp_shifted(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_shifted(-100.0), 0.0);
    }

    #[test]
    fn both_builds_sum_alike() {
        let line: Vec<f32> = (0..1003)
            .map(|i| ((i * 7919) % 1000) as f32 / 37.0 - 20.0)
            .chain([f32::NEG_INFINITY, -90.0, -86.9])
            .collect();
        let max = line.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut scratch = vec![0.0; line.len()];
        let portable = ln_sum_exp_body(&line, max, &mut scratch);
        let chosen = ln_sum_exp(&line, max, &mut scratch);
        let exact = line
            .iter()
            .map(|&v| (f64::from(v) - f64::from(max)).exp())
            .sum::<f64>()
            .ln();
        for got in [portable, chosen] {
            assert!((f64::from(got) - exact).abs() <= 4.0 * f64::from(f32::EPSILON) * exact);
        }
    }
}
