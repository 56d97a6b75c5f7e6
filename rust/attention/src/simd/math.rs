//! `exp` and `tanh` for the portable build, written so LLVM vectorises the loops they are
//! inlined into (no libm call per element); `avx2_math.rs` has the same formulas on vectors.
//! Accuracy: `exp` within 2 ulp-ish (relative error below 4e-7) for inputs in [-87, 88];
//! smaller inputs give a tiny positive number instead of 0 (harmless in a softmax, where the
//! largest term is 1). `tanh` within 3e-7 absolute. Both are checked against f64 below.

pub(crate) const LOG2_E: f32 = std::f32::consts::LOG2_E;
// ln 2 split in two so that n * LN2_HI is exact for the n used here.
pub(crate) const LN2_HI: f32 = 0.693_359_4;
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// Adding and subtracting this rounds a float below 2^22 in magnitude to an integer.
pub(crate) const ROUND: f32 = 12_582_912.0;

/// e^x for one value; inlined into the loops of the softmax step.
#[inline(always)]
pub(crate) fn exp_one(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    // `t` holds the integer n = round(x / ln 2) in its low mantissa bits (ROUND is 1.5 * 2^23).
    let t = x * LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO; // |r| <= ln2 / 2
                                           // Taylor series of e^r to r^7: truncation error below 2e-8 relative for |r| <= 0.35.
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n from n's bits in `t` (integer arithmetic, so it vectorises; `n as i32` would be a
    // saturating conversion, which LLVM compiles one lane at a time). n is in -126..=127.
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    p * scale
}

/// `values[i] = cap * tanh(values[i] / cap)` (logit soft-capping).
#[inline(always)]
pub fn softcap(values: &mut [f32], cap: f32) {
    let inverse = 1.0 / cap;
    for value in values.iter_mut() {
        *value = cap * tanh_one(*value * inverse);
    }
}

#[inline(always)]
fn tanh_one(x: f32) -> f32 {
    let a = x.abs();
    // |x| >= 0.25: (1 - e) / (1 + e) with e = e^(-2|x|) <= 0.61, no cancellation.
    let e = exp_one(-2.0 * a);
    let large = (1.0 - e) / (1.0 + e);
    // |x| < 0.25: the odd Taylor series to x^9 (next term below 4e-9).
    let s = a * a;
    let small =
        a * (1.0 + s * (-1.0 / 3.0 + s * (2.0 / 15.0 + s * (-17.0 / 315.0 + s * (62.0 / 2835.0)))));
    let t = if a < 0.25 { small } else { large };
    t.copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> impl Iterator<Item = f32> {
        (-200_000..=200_000).map(|i| i as f32 * 4.4e-4)
    }

    #[test]
    fn exp_is_within_4e_7_relative_of_f64() {
        for x in grid().filter(|x| *x >= -87.0) {
            let (got, want) = (exp_one(x), (x as f64).exp());
            let error = (got as f64 - want).abs() / want;
            assert!(
                error < 4e-7,
                "exp({x}) = {got}, want {want} (relative error {error})"
            );
        }
        let extreme = [-1000.0f32, -87.5, 88.0, 0.0, f32::NEG_INFINITY].map(exp_one);
        assert!(extreme[0] >= 0.0 && extreme[0] < 1e-37 && extreme[1] < 1e-37);
        assert!(extreme[2].is_finite() && extreme[3] == 1.0);
        assert!(extreme[4] >= 0.0 && extreme[4] < 1e-37);
    }

    #[test]
    fn softcap_is_within_3e_7_of_f64_tanh() {
        let inputs: Vec<f32> = grid().map(|x| x * 0.1).chain([0.0, -0.0, 1e-30]).collect();
        let mut values = inputs.clone();
        softcap(&mut values, 1.0);
        for (x, got) in inputs.iter().zip(&values) {
            let want = (*x as f64).tanh();
            assert!(
                (*got as f64 - want).abs() < 3e-7,
                "tanh({x}) = {got}, want {want}"
            );
        }
        let mut capped = [1e6f32, -1e6, 50.0];
        softcap(&mut capped, 50.0);
        assert_eq!(capped[0], 50.0);
        assert_eq!(capped[1], -50.0);
        assert!((capped[2] - 50.0 * 1f32.tanh()).abs() < 2e-5);
    }
}
