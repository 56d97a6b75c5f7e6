//! The portable build of the inner loops (what a CPU without AVX2+FMA runs) against the naive
//! implementation; its own test binary, because `force_portable` is process-wide.

mod common;

use common::elementwise::{check_gated, check_rms_norm, rms_norm_rows};
use common::{build, sweep};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]
    #[test]
    fn the_portable_build_matches_the_naive_attention(
        seed in any::<u64>(),
        num_kv_heads in 1usize..4,
        group in prop::sample::select(vec![1usize, 2, 3, 4, 8]),
        head_dim in prop::sample::select(vec![4usize, 13, 16, 32, 64, 128]),
        block_size in prop::sample::select(vec![1usize, 16]),
        window in prop::option::of(1usize..40),
        softcap in any::<bool>(),
        sinks in any::<bool>(),
        scale in prop::sample::select(vec![0.3f32, 4.0]),
    ) {
        hybrid_cache_attention::force_portable(true);
        assert!(!hybrid_cache_attention::use_avx2_fma());
        build(seed, num_kv_heads, group, head_dim, block_size, window, softcap, sinks)
            .check(scale, seed);
    }

    #[test]
    fn the_portable_rms_norm_matches_the_naive_version(
        (dim, x, weight) in rms_norm_rows(),
        magnitude in prop::sample::select(vec![1e-12f32, 1.0, 1e15]),
        offset in prop::sample::select(vec![0.0f32, 1.0]),
    ) {
        hybrid_cache_attention::force_portable(true);
        let x: Vec<f32> = x.iter().map(|v| v * magnitude).collect();
        check_rms_norm(&x, dim, &weight, offset, 1e-6);
    }

    #[test]
    fn the_portable_gated_activations_match_the_naive_versions(
        (gate, up) in (0usize..70).prop_flat_map(|n| (
            prop::collection::vec(-12.0f32..12.0, n),
            prop::collection::vec(-4.0f32..4.0, n),
        )),
        gelu in any::<bool>(),
    ) {
        hybrid_cache_attention::force_portable(true);
        check_gated(gelu, &gate, &up);
    }
}

#[test]
fn every_specialised_shape_of_the_portable_build_matches_the_naive_attention() {
    hybrid_cache_attention::force_portable(true);
    assert!(!hybrid_cache_attention::use_avx2_fma());
    sweep();
}

#[test]
fn a_dense_grid_of_gates_matches_the_naive_activations_in_the_portable_build() {
    hybrid_cache_attention::force_portable(true);
    let gate: Vec<f32> = (-40_000..40_000).map(|i| i as f32 * 3e-4).collect();
    let up = vec![1.0f32; gate.len()];
    check_gated(true, &gate, &up);
    check_gated(false, &gate, &up);
}
