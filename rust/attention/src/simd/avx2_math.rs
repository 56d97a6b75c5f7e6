//! `exp` and `tanh` (as the soft-cap `cap * tanh(x / cap)`) on registers of 8 f32 in
//! AVX2+FMA: the same formulas as `math.rs` (with fused multiply-adds, so results differ from
//! the portable build by rounding only). For the AVX2 softmax step of the paged attention
//! (`paged/avx2/softmax.rs`) and the gated activations (`elementwise/avx2_gated.rs`).

use std::arch::x86_64::*;

use crate::simd::math::{LN2_HI, LN2_LO, LOG2_E, ROUND};

/// `math::exp_one` on 8 lanes: 2^n times a Taylor polynomial of e^r, r = x - n ln 2.
#[inline(always)]
pub(crate) unsafe fn exp(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.0)),
        _mm256_set1_ps(88.0),
    );
    // t holds n in its low mantissa bits (see `math::exp_one`).
    let t = _mm256_fmadd_ps(x, _mm256_set1_ps(LOG2_E), _mm256_set1_ps(ROUND));
    let n = _mm256_sub_ps(t, _mm256_set1_ps(ROUND));
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(1.0 / 5040.0);
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let n_bits = _mm256_sub_epi32(
        _mm256_castps_si256(t),
        _mm256_set1_epi32(ROUND.to_bits() as i32),
    );
    let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(n_bits, _mm256_set1_epi32(127)));
    _mm256_mul_ps(p, _mm256_castsi256_ps(two_n))
}

/// `cap * tanh(x / cap)` on 8 lanes, as `math::softcap`.
#[inline(always)]
pub(crate) unsafe fn softcap(x: __m256, cap: f32) -> __m256 {
    let x = _mm256_mul_ps(x, _mm256_set1_ps(1.0 / cap));
    let sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0));
    let a = _mm256_xor_ps(x, sign);
    // |x| >= 0.25: (1 - e) / (1 + e) with e = e^(-2|x|).
    let e = exp(_mm256_mul_ps(a, _mm256_set1_ps(-2.0)));
    let one = _mm256_set1_ps(1.0);
    let large = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    // |x| < 0.25: the odd Taylor series to x^9.
    let s = _mm256_mul_ps(a, a);
    let mut p = _mm256_set1_ps(62.0 / 2835.0);
    for c in [-17.0 / 315.0, 2.0 / 15.0, -1.0 / 3.0, 1.0] {
        p = _mm256_fmadd_ps(p, s, _mm256_set1_ps(c));
    }
    let small = _mm256_mul_ps(a, p);
    let is_small = _mm256_cmp_ps::<_CMP_LT_OQ>(a, _mm256_set1_ps(0.25));
    let t = _mm256_blendv_ps(large, small, is_small);
    _mm256_mul_ps(_mm256_or_ps(t, sign), _mm256_set1_ps(cap))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn supported() -> bool {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }

    /// `exp` or `softcap(cap)` (when `cap` is set) of every input, 8 lanes at a time.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn on_lanes(inputs: &[f32], cap: Option<f32>) -> Vec<f32> {
        let mut out = vec![0.0f32; inputs.len()];
        for (from, to) in inputs.chunks_exact(8).zip(out.chunks_exact_mut(8)) {
            let x = _mm256_loadu_ps(from.as_ptr());
            let y = match cap {
                Some(cap) => softcap(x, cap),
                None => exp(x),
            };
            _mm256_storeu_ps(to.as_mut_ptr(), y);
        }
        out
    }

    fn grid() -> Vec<f32> {
        (-200_000..200_000).map(|i| i as f32 * 4.4e-4).collect()
    }

    #[test]
    fn exp_is_within_4e_7_relative_of_f64() {
        if !supported() {
            return;
        }
        let inputs: Vec<f32> = grid().into_iter().filter(|x| *x >= -87.0).collect();
        let inputs = &inputs[..inputs.len() / 8 * 8];
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        let got = unsafe { on_lanes(inputs, None) };
        for (x, got) in inputs.iter().zip(got) {
            let want = (*x as f64).exp();
            let error = (got as f64 - want).abs() / want;
            assert!(error < 4e-7, "exp({x}) = {got}, want {want}");
        }
        let extreme = [
            -1000.0f32,
            -87.5,
            88.0,
            0.0,
            f32::NEG_INFINITY,
            1.0,
            -1.0,
            2.0,
        ];
        // SAFETY: as above.
        let got = unsafe { on_lanes(&extreme, None) };
        assert!(got[0] >= 0.0 && got[0] < 1e-37 && got[1] < 1e-37 && got[4] < 1e-37);
        assert!(got[2].is_finite() && got[3] == 1.0);
    }

    #[test]
    fn softcap_is_within_3e_7_of_f64_tanh() {
        if !supported() {
            return;
        }
        let mut inputs: Vec<f32> = grid().into_iter().map(|x| x * 0.1).collect();
        inputs.extend([0.0, -0.0, 1e-30, 1e6, -1e6, 0.25, -0.25, 0.2499]);
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        let got = unsafe { on_lanes(&inputs, Some(1.0)) };
        for (x, got) in inputs.iter().zip(&got) {
            let want = (*x as f64).tanh();
            assert!(
                (*got as f64 - want).abs() < 3e-7,
                "tanh({x}) = {got}, want {want}"
            );
        }
        // SAFETY: as above.
        let capped = unsafe { on_lanes(&[1e6, -1e6, 50.0, 0.0, 0.0, 0.0, 0.0, 0.0], Some(50.0)) };
        assert_eq!((capped[0], capped[1]), (50.0, -50.0));
        assert!((capped[2] - 50.0 * 1f32.tanh()).abs() < 2e-5);
    }
}
