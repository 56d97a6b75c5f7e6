//! The fused element-wise ops (RMSNorm rows, gated activations) against naive f64 versions, on
//! random shapes and magnitudes; dims that are not multiples of 8 exercise the tails. This file
//! runs the build the CPU picks (AVX2+FMA here); `portable.rs` the portable one.

mod common;

use common::elementwise::{check_gated, check_rms_norm, rms_norm_rows};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn rms_norm_matches_the_naive_version(
        (dim, x, weight) in rms_norm_rows(),
        magnitude in prop::sample::select(vec![1e-12f32, 1e-3, 1.0, 1e3, 1e15]),
        offset in prop::sample::select(vec![0.0f32, 1.0]),
        eps in prop::sample::select(vec![1e-6f32, 1e-5]),
    ) {
        let x: Vec<f32> = x.iter().map(|v| v * magnitude).collect();
        check_rms_norm(&x, dim, &weight, offset, eps);
    }

    #[test]
    fn gated_activations_match_the_naive_versions(
        (gate, up) in (0usize..70).prop_flat_map(|n| (
            prop::collection::vec(-1.0f32..1.0, n),
            prop::collection::vec(-4.0f32..4.0, n),
        )),
        magnitude in prop::sample::select(vec![1e-3f32, 1.0, 5.0, 12.0, 100.0]),
        gelu in any::<bool>(),
    ) {
        let gate: Vec<f32> = gate.iter().map(|v| v * magnitude).collect();
        check_gated(gelu, &gate, &up);
    }
}

#[test]
fn a_dense_grid_of_gates_matches_the_naive_activations() {
    let gate: Vec<f32> = (-40_000..40_000).map(|i| i as f32 * 3e-4).collect();
    let up = vec![1.0f32; gate.len()];
    check_gated(true, &gate, &up);
    check_gated(false, &gate, &up);
}

#[test]
fn every_specialised_dim_of_rms_norm_matches_the_naive_version() {
    for dim in [16usize, 32, 64, 128, 256] {
        for rows in [1usize, 8, 11] {
            let x: Vec<f32> = (0..rows * dim)
                .map(|i| ((i * 7919 % 997) as f32 - 498.0) / 97.0)
                .collect();
            let weight: Vec<f32> = (0..dim).map(|i| (i % 13) as f32 / 6.0 - 1.0).collect();
            check_rms_norm(&x, dim, &weight, 1.0, 1e-6);
            check_rms_norm(&x, dim, &weight, 0.0, 1e-6);
        }
    }
}
