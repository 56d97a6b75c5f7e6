//! The portable build of the inner loops (what a CPU without AVX2+FMA runs) against the naive
//! implementation; its own test binary, because `force_portable` is process-wide.

mod common;

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
}

#[test]
fn every_specialised_shape_of_the_portable_build_matches_the_naive_attention() {
    hybrid_cache_attention::force_portable(true);
    assert!(!hybrid_cache_attention::use_avx2_fma());
    sweep();
}
