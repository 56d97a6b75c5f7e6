//! Fused element-wise ops of a model's forward on the CPU: RMSNorm of rows and the gated
//! activations of an MLP (`act(gate) * up`), here, and the rotary position embedding
//! (`rotary.rs`). The entry points here check their lengths, then pick the build (AVX2+FMA or
//! portable, as `paged_attention` does) and hand the work to `norm.rs` or `gated.rs` /
//! `avx2_gated.rs`. One pass over the data instead of one torch op per step.

#[cfg(target_arch = "x86_64")]
mod avx2_gated;
mod gated;
mod norm;
pub(crate) mod rotary;

use crate::error::{ensure, AttentionError};
use crate::simd::dispatch;
use gated::Activation;

/// `out = x / sqrt(mean(x^2) + eps) * (offset + weight)` for each of the `rows` rows of `dim`
/// values of `x` (row-major), with the statistics in f32: `offset` 0 for Llama-style weights,
/// 1 for Gemma's (the stored weight is a delta around 1). Checks every length first and
/// changes nothing when one is wrong.
pub fn rms_norm(
    x: &[f32],
    rows: usize,
    dim: usize,
    weight: &[f32],
    offset: f32,
    eps: f32,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    ensure(dim > 0, || "dim must be positive".to_owned())?;
    ensure(weight.len() == dim, || {
        format!("weight must hold dim = {dim} values, got {}", weight.len())
    })?;
    let expected = rows.checked_mul(dim);
    ensure(
        expected == Some(x.len()) && expected == Some(out.len()),
        || {
            format!(
                "x and out must hold rows x dim = {rows} x {dim} values, got {} and {}",
                x.len(),
                out.len()
            )
        },
    )?;
    ensure(eps.is_finite() && eps >= 0.0 && offset.is_finite(), || {
        format!("eps must be finite and non-negative and offset finite, got {eps} and {offset}")
    })?;
    #[cfg(target_arch = "x86_64")]
    if dispatch::use_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time just above).
        unsafe { norm::rows_avx2(x, dim, weight, offset, eps, out) };
        return Ok(());
    }
    norm::rows_portable(x, dim, weight, offset, eps, out);
    Ok(())
}

/// `out = gelu(gate) * up` element-wise, with the tanh approximation of gelu
/// (`0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, torch's `approximate="tanh"`).
pub fn gelu_tanh_mul(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<(), AttentionError> {
    gated_mul(Activation::GeluTanh, gate, up, out)
}

/// `out = silu(gate) * up` element-wise (`silu(x) = x / (1 + e^-x)`).
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<(), AttentionError> {
    gated_mul(Activation::Silu, gate, up, out)
}

fn gated_mul(
    activation: Activation,
    gate: &[f32],
    up: &[f32],
    out: &mut [f32],
) -> Result<(), AttentionError> {
    ensure(gate.len() == up.len() && gate.len() == out.len(), || {
        format!(
            "gate, up and out must hold the same number of values, got {}, {} and {}",
            gate.len(),
            up.len(),
            out.len()
        )
    })?;
    #[cfg(target_arch = "x86_64")]
    if dispatch::use_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time just above).
        unsafe { avx2_gated::gated_mul(activation, gate, up, out) };
        return Ok(());
    }
    gated::gated_mul_portable(activation, gate, up, out);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid(result: Result<(), AttentionError>, needle: &str) {
        match result {
            Err(AttentionError::InvalidArgument(message)) => {
                assert!(message.contains(needle), "{message:?} lacks {needle:?}")
            }
            other => panic!("expected InvalidArgument({needle}), got {other:?}"),
        }
    }

    #[test]
    fn bad_lengths_are_refused_and_out_is_untouched() {
        let x = [1.0f32; 12];
        let mut out = [7.0f32; 12];
        invalid(rms_norm(&x, 3, 4, &[1.0; 3], 0.0, 1e-6, &mut out), "weight");
        invalid(
            rms_norm(&x, 4, 4, &[1.0; 4], 0.0, 1e-6, &mut out),
            "rows x dim",
        );
        invalid(
            rms_norm(&x, 3, 4, &[1.0; 4], 0.0, 1e-6, &mut out[..8]),
            "rows x dim",
        );
        invalid(
            rms_norm(&x, usize::MAX, 2, &[1.0; 2], 0.0, 1e-6, &mut out),
            "rows x dim",
        );
        invalid(
            rms_norm(&[], 0, 0, &[], 0.0, 1e-6, &mut []),
            "dim must be positive",
        );
        invalid(rms_norm(&x, 3, 4, &[1.0; 4], 0.0, -1.0, &mut out), "eps");
        invalid(
            rms_norm(&x, 3, 4, &[1.0; 4], f32::NAN, 1e-6, &mut out),
            "offset",
        );
        invalid(gelu_tanh_mul(&x, &x[..11], &mut out), "same number");
        invalid(silu_mul(&x, &x, &mut out[..5]), "same number");
        assert_eq!(out, [7.0; 12]);
    }

    #[test]
    fn empty_inputs_are_fine() {
        rms_norm(&[], 0, 5, &[1.0; 5], 1.0, 1e-6, &mut []).unwrap();
        gelu_tanh_mul(&[], &[], &mut []).unwrap();
        silu_mul(&[], &[], &mut []).unwrap();
    }

    #[test]
    fn a_row_of_equal_values_normalises_to_the_weight() {
        // mean(x^2) = 4, eps 0: x / 2 * (offset + w).
        let x = [2.0f32, 2.0, 2.0, -2.0, 3.0, 3.0, 3.0, 3.0];
        let mut out = [0.0f32; 8];
        rms_norm(&x, 2, 4, &[0.5, 1.0, 2.0, 0.0], 1.0, 0.0, &mut out).unwrap();
        assert_eq!(out, [1.5, 2.0, 3.0, -1.0, 1.5, 2.0, 3.0, 1.0]);
    }

    #[test]
    fn activations_at_known_points() {
        let gate = [0.0f32, 1.0, -1.0, 3.0, -3.0, 20.0, -20.0, 0.5, 2.0];
        let up = [1.0f32, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, -1.0, 0.0];
        let mut out = [9.0f32; 9];
        silu_mul(&gate, &up, &mut out).unwrap();
        for ((g, u), got) in gate.iter().zip(&up).zip(&out) {
            let x = *g as f64;
            let want = x / (1.0 + (-x).exp()) * *u as f64;
            assert!(
                (*got as f64 - want).abs() <= 4e-7 * want.abs() + 1e-30,
                "silu({g})"
            );
        }
        gelu_tanh_mul(&gate, &up, &mut out).unwrap();
        for ((g, u), got) in gate.iter().zip(&up).zip(&out) {
            let x = *g as f64;
            let inner = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            let want = 0.5 * x * (1.0 + inner.tanh()) * *u as f64;
            assert!(
                (*got as f64 - want).abs() <= 1e-6 * want.abs() + 1e-30,
                "gelu({g})"
            );
        }
        assert_eq!(out[0], 0.0);
        assert_eq!(out[8], 0.0);
    }
}
