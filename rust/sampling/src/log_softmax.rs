//! The log-softmax of each row, `(x - max) - ln(sum(exp(x - max)))`, the formula torch's CPU
//! kernel uses, in passes over the row that vectorise (the maximum, the exponentials, their
//! sum, the output; `logprobs` takes the maximum from its top k and writes only k + 1 values). The exponential is a polynomial over a reduced range (no libm
//! call per value), within about one ulp; the sum is kept in `LANES` independent float32
//! sums, added up in float64, so a value differs from torch's by at most a few ulp of the
//! row's `ln(sum)`, never in order.
//!
//! Rows torch makes all NaN are all NaN here too: a row holding a NaN or `+inf`, and a row of
//! only `-inf` (its maximum minus itself is NaN).

use crate::error::{ensure, SamplingError};

/// Independent maxima and sums kept per row (one AVX2 register of float32).
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

/// `ln(sum(exp(x - max)))` over `line` (`max` its finite maximum), the exponentials written
/// to `scratch` first (a plain map vectorises; a sum folded into it did not). The AVX2 build
/// where the CPU has it, else the baseline build.
fn ln_sum_exp(line: &[f32], max: f32, scratch: &mut [f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { ln_sum_exp_avx2(line, max, scratch) };
    }
    ln_sum_exp_body(line, max, scratch)
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn ln_sum_exp_avx2(line: &[f32], max: f32, scratch: &mut [f32]) -> f32 {
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

/// `e^x` for `x <= 0` (a value minus its row's maximum; `-inf` included): Cody-Waite range
/// reduction `x = n ln 2 + r`, `|r| <= ln 2 / 2`, Cephes' degree-6 polynomial for `e^r`,
/// and `2^n` built in the exponent bits. 0 below `EXP_FLOOR`. No branch (it vectorises).
#[inline(always)]
fn exp_shifted(x: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4; // ln 2's leading bits (exact times any small n)
    const LN2_LO: f32 = -2.121_944_4e-4; // ln 2 - LN2_HI
                                         // Adding 1.5 * 2^23 rounds to an integer in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let t = if x > EXP_FLOOR { x } else { EXP_FLOOR };
    let shifted = t * LOG2_E + ROUND;
    let n = shifted - ROUND; // round(t / ln 2), in -126..=0
    let r = (t - n * LN2_HI) - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
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
        assert_eq!(exp_shifted(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_shifted(-100.0), 0.0);
    }
}
