//! The kernel against a naive per-row implementation (f64, gathered keys), on random paged
//! layouts: shuffled blocks, strided K/V halves of one buffer, GQA, windows, softcap, sinks.
//! Every element that no row may read is NaN, so a stray read fails the comparison. This file
//! runs the build the CPU picks (AVX2+FMA here); `portable.rs` the portable one.

mod common;

use common::{build, sweep};
use hybrid_cache_attention::{
    paged_attention, AttentionError, AttentionParams, HeadShape, QueryRows,
};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn matches_the_naive_attention(
        seed in any::<u64>(),
        num_kv_heads in 1usize..4,
        group in prop::sample::select(vec![1usize, 2, 3, 4, 8]),
        head_dim in prop::sample::select(vec![4usize, 8, 13, 16, 32, 64, 128]),
        block_size in prop::sample::select(vec![1usize, 4, 16]),
        window in prop::option::of(1usize..40),
        softcap in any::<bool>(),
        sinks in any::<bool>(),
        scale in prop::sample::select(vec![0.3f32, 4.0]),
    ) {
        build(seed, num_kv_heads, group, head_dim, block_size, window, softcap, sinks)
            .check(scale, seed);
    }
}

#[test]
fn every_specialised_shape_matches_the_naive_attention() {
    sweep();
}

#[test]
fn a_row_over_the_null_block_is_refused_and_out_is_untouched() {
    let mut case = build(7, 2, 2, 8, 4, Some(5), false, false);
    // Widen a row's range to reach a released (null) block.
    let row = case
        .position
        .iter()
        .position(|&p| p >= 8)
        .expect("a row past two blocks");
    case.low[row] = 0;
    let mut out = vec![-2.0f32; case.q.len()];
    let error = paged_attention(
        &case.q,
        case.cache(0),
        case.cache(1),
        case.rows(),
        case.shape,
        case.params(),
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(error, AttentionError::InvalidBlock(ref m) if m.contains("null block")));
    assert!(
        out.iter().all(|&x| x == -2.0),
        "a refused call wrote its output"
    );
}

#[test]
fn bad_arguments_are_typed_errors_that_say_what_to_change() {
    let case = build(11, 1, 4, 8, 4, None, false, false);
    let mut out = vec![0.0f32; case.q.len()];
    let run =
        |q: &[f32], rows: QueryRows, shape: HeadShape, params: AttentionParams, out: &mut [f32]| {
            paged_attention(q, case.cache(0), case.cache(1), rows, shape, params, out)
        };
    let message = |e: AttentionError| e.to_string();
    // q of the wrong length.
    let e = run(
        &case.q[1..],
        case.rows(),
        case.shape,
        case.params(),
        &mut out,
    )
    .unwrap_err();
    assert!(message(e).contains("rows x num_heads x head_dim"));
    // Heads that do not divide.
    let shape = HeadShape {
        num_heads: 3,
        num_kv_heads: 2,
        head_dim: 8,
    };
    let e = run(&case.q, case.rows(), shape, case.params(), &mut out).unwrap_err();
    assert!(message(e).contains("multiple of num_kv_heads"));
    // A sequence index outside the table.
    let sequence = vec![99i64; case.sequence.len()];
    let rows = QueryRows {
        sequence: &sequence,
        ..case.rows()
    };
    let e = run(&case.q, rows, case.shape, case.params(), &mut out).unwrap_err();
    assert!(message(e).contains("is not a block-table row"));
    // low > position.
    let low: Vec<i64> = case.position.iter().map(|p| p + 1).collect();
    let rows = QueryRows {
        low: &low,
        ..case.rows()
    };
    let e = run(&case.q, rows, case.shape, case.params(), &mut out).unwrap_err();
    assert!(message(e).contains("is empty or negative"));
    // Sinks of the wrong length, a non-positive softcap.
    let sinks = [0.0f32; 3];
    let params = AttentionParams {
        sinks: Some(&sinks),
        ..case.params()
    };
    let e = run(&case.q, case.rows(), case.shape, params, &mut out).unwrap_err();
    assert!(message(e).contains("one logit per query head"));
    let params = AttentionParams {
        softcap: Some(0.0),
        ..case.params()
    };
    let e = run(&case.q, case.rows(), case.shape, params, &mut out).unwrap_err();
    assert!(message(e).contains("softcap must be a positive"));
    // Strides that reach past the buffer.
    let mut keys = case.cache(0);
    keys.num_blocks += 1;
    let e = paged_attention(
        &case.q,
        keys,
        case.cache(1),
        case.rows(),
        case.shape,
        case.params(),
        &mut out,
    )
    .unwrap_err();
    assert!(message(e).contains("pass the cache's real offset and strides"));
}
