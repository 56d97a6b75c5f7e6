//! `log_softmax_rows` against the same formula in float64: within a few float32 ulp of the
//! row's `ln(sum)` on random rows (ties, `-inf`, huge and tiny values, every length), the
//! order of a row's values kept, and torch's all-NaN rows (a NaN, `+inf`, only `-inf`); and
//! `logprob_top_k_rows` against `log_softmax_rows` followed by `top_k_rows`; and
//! `greedy_logprob_top_k_rows` against `logprob_top_k_rows` of each row's first maximum.

use hybrid_cache_sampling::{
    greedy_logprob_top_k_rows, log_softmax_rows, logprob_top_k_rows, top_k_rows, SamplingError,
    TopK,
};
use proptest::prelude::*;

/// The reference in float64: `(x - max) - ln(sum(exp(x - max)))`, `-inf` where `x - max`
/// is beyond float32's range (as in float32, and in torch).
fn reference(line: &[f32]) -> Vec<f64> {
    let max = line
        .iter()
        .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
    let sum: f64 = line.iter().map(|&v| (f64::from(v) - max).exp()).sum();
    line.iter()
        .map(|&v| {
            if v - max as f32 == f32::NEG_INFINITY {
                f64::NEG_INFINITY
            } else {
                (f64::from(v) - max) - sum.ln()
            }
        })
        .collect()
}

fn run(values: &[f32], cols: usize) -> Vec<f32> {
    let mut out = vec![0.25; values.len()];
    log_softmax_rows(values, cols, &mut out).unwrap();
    out
}

fn check(values: &[f32], cols: usize) {
    let out = run(values, cols);
    for (line, got) in values.chunks(cols).zip(out.chunks(cols)) {
        let want = reference(line);
        // The error lies in ln(sum) (one value per row, up to ln(cols)) and the two
        // float32 subtractions, whose operands reach the row's range.
        let range = line.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
        let tolerance = 8.0 * f64::from(f32::EPSILON) * (range + (cols as f64).ln() + 1.0);
        for (column, (&g, &w)) in got.iter().zip(&want).enumerate() {
            if w == f64::NEG_INFINITY {
                assert_eq!(g, f32::NEG_INFINITY, "column {column} of {line:?}");
                continue;
            }
            assert!(
                (f64::from(g) - w).abs() <= tolerance,
                "column {column}: {g} against {w} (tolerance {tolerance}) in {line:?}"
            );
        }
        // One shift for the whole row: larger values stay at least as large.
        for a in 0..line.len() {
            for b in 0..line.len() {
                if line[a] > line[b] {
                    assert!(got[a] >= got[b], "columns {a}, {b} of {line:?}");
                }
            }
        }
    }
}

fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => -20.0f32..20.0,
        1 => Just(f32::NEG_INFINITY),
        1 => Just(1.5f32),
        1 => -3.0e38f32..3.0e38,
        1 => -1.0e-30f32..1.0e-30,
    ]
}

proptest! {
    #[test]
    fn rows_are_the_float64_formula(
        cols in 1usize..70,
        rows in 1usize..5,
        seed in proptest::collection::vec(value(), 1..350),
    ) {
        let values: Vec<f32> = (0..rows * cols).map(|i| seed[i % seed.len()]).collect();
        let values: Vec<f32> = values
            .chunks(cols)
            .flat_map(|line| {
                let mut line = line.to_vec();
                if line.iter().all(|v| *v == f32::NEG_INFINITY) {
                    line[0] = 0.0; // an all -inf row is NaN: checked on its own below
                }
                line
            })
            .collect();
        check(&values, cols);
    }
}

#[test]
fn rows_of_a_vocabulary_are_the_float64_formula() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let values: Vec<f32> = (0..4 * 32768)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32) / 1e6 - 8.0
        })
        .collect();
    check(&values, 32768);
}

#[test]
fn rows_torch_makes_nan_are_nan() {
    let inf = f32::INFINITY;
    for line in [
        vec![1.0, f32::NAN, 2.0],
        vec![1.0, inf, 2.0],
        vec![inf, inf],
        vec![f32::NEG_INFINITY; 3],
        vec![f32::NEG_INFINITY, inf],
        vec![0.5; 9].into_iter().chain([f32::NAN]).collect(),
    ] {
        let out = run(&line, line.len());
        assert!(out.iter().all(|v| v.is_nan()), "{line:?} gave {out:?}");
    }
    // A NaN row leaves the next one alone.
    let out = run(&[f32::NAN, 0.0, 0.0, 0.0], 2);
    assert!(out[0].is_nan() && out[1].is_nan());
    assert_eq!(out[2..], [-std::f32::consts::LN_2; 2]);
}

#[test]
fn equal_values_share_the_mass_exactly() {
    let out = run(&[3.0; 16], 16);
    assert!(out.iter().all(|&v| v == -(16f32.ln())), "{out:?}");
    assert_eq!(run(&[-1.0], 1), [0.0]);
}

#[test]
fn mismatched_shapes_say_what_to_change() {
    let mut out = vec![0.0; 6];
    let error = log_softmax_rows(&[0.0; 5], 2, &mut out).unwrap_err();
    assert!(
        error.0.contains("5 logits do not make rows of 2"),
        "{error}"
    );
    let error: SamplingError = log_softmax_rows(&[0.0; 4], 2, &mut out).unwrap_err();
    assert!(
        error.0.contains("as many values as the logits (4), got 6"),
        "{error}"
    );
    assert!(log_softmax_rows(&[0.0; 4], 0, &mut out[..4]).is_err());
}

/// What a top k writes for `rows` rows of `width` columns (outputs filled with markers first),
/// and the rows it leaves unsettled.
fn outputs(
    rows: usize,
    width: usize,
    top_k: impl FnOnce(TopK<'_>) -> Vec<usize>,
) -> (Vec<i64>, Vec<f32>, Vec<i64>, Vec<usize>) {
    let (mut ids, mut values, mut ranks) = (
        vec![-7; rows * width],
        vec![0.5; rows * width],
        vec![-7; rows],
    );
    let unsettled = top_k(TopK {
        ids: &mut ids,
        values: &mut values,
        ranks: &mut ranks,
    });
    (ids, values, ranks, unsettled)
}

/// `logprob_top_k_rows` and `log_softmax_rows` then `top_k_rows`: the same value bits in every
/// column and the same ranks; the ids of the logits, which are the log-softmax's wherever its
/// top k + 1 stay distinct; all-NaN rows as NaN, rank 0, unsettled.
fn check_logprob_top_k(logits: &[f32], cols: usize, k: usize, chosen: &[i64]) {
    let rows = logits.len() / cols;
    let width = k + 1;
    let (ids, values, ranks, unsettled) = outputs(rows, width, |out| {
        logprob_top_k_rows(logits, cols, k, chosen, out).unwrap()
    });
    let mut logprobs = vec![0.0; logits.len()];
    log_softmax_rows(logits, cols, &mut logprobs).unwrap();
    let on_logits = outputs(rows, width, |out| {
        top_k_rows(logits, cols, k, chosen, out).unwrap()
    });
    let on_logprobs = outputs(rows, width, |out| {
        top_k_rows(&logprobs, cols, k, chosen, out).unwrap()
    });
    for row in 0..rows {
        let line = &logprobs[row * cols..(row + 1) * cols];
        let span = row * width..(row + 1) * width;
        if line.iter().all(|v| v.is_nan()) {
            assert!(values[span].iter().all(|v| v.is_nan()) && ranks[row] == 0);
            assert!(unsettled.contains(&row));
            continue;
        }
        // The ids and settledness are the logits' own; the rank counts the logprobs.
        assert_eq!(ids[span.clone()], on_logits.0[span.clone()], "row {row}");
        assert_eq!(unsettled.contains(&row), on_logits.3.contains(&row));
        assert_eq!(ranks[row], on_logprobs.2[row], "row {row}");
        // Each value is the log-softmax at its id, to the bit.
        for (&id, &value) in ids[span.clone()].iter().zip(&values[span.clone()]) {
            assert_eq!(
                value.to_bits(),
                line[id as usize].to_bits(),
                "row {row} id {id}"
            );
        }
        if !on_logprobs.3.contains(&row) && !unsettled.contains(&row) {
            assert_eq!(ids[span.clone()], on_logprobs.0[span], "row {row}");
        }
    }
}

proptest! {
    #[test]
    fn the_top_k_of_the_logprobs_from_the_logits(
        cols in 2usize..90,
        rows in 1usize..5,
        seed in proptest::collection::vec(value(), 1..400),
        k_seed in 0usize..1000,
        chosen_seed in 0usize..1000,
    ) {
        let values: Vec<f32> = (0..rows * cols).map(|i| seed[i % seed.len()]).collect();
        let k = k_seed % cols;
        let chosen: Vec<i64> = (0..rows).map(|r| ((chosen_seed * (r + 3)) % cols) as i64).collect();
        check_logprob_top_k(&values, cols, k, &chosen);
    }
}

/// `greedy_logprob_top_k_rows` against `logprob_top_k_rows` with each row's first maximum
/// (numpy's argmax) as the chosen token: a row is settled exactly when the latter settles it,
/// holds no NaN and its largest value is the only one; a settled row's ids, value bits and rank
/// are the latter's.
fn check_greedy(logits: &[f32], cols: usize, k: usize) {
    let rows = logits.len() / cols;
    let width = k + 1;
    let first_maximum = |line: &[f32]| {
        let mut best = 0;
        for (column, &value) in line.iter().enumerate() {
            if value.is_nan() {
                return column;
            }
            if value > line[best] {
                best = column;
            }
        }
        best
    };
    let chosen: Vec<i64> = logits
        .chunks(cols)
        .map(|line| first_maximum(line) as i64)
        .collect();
    let (ids, values, ranks, unsettled) = outputs(rows, width, |out| {
        greedy_logprob_top_k_rows(logits, cols, k, out).unwrap()
    });
    let (want_ids, want_values, want_ranks, want_unsettled) = outputs(rows, width, |out| {
        logprob_top_k_rows(logits, cols, k, &chosen, out).unwrap()
    });
    for (row, line) in logits.chunks(cols).enumerate() {
        let mut sorted = line.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let only_maximum = cols == 1 || sorted[0] > sorted[1];
        let nan = line.iter().any(|v| v.is_nan());
        let settled = !want_unsettled.contains(&row) && only_maximum && !nan;
        assert_eq!(!unsettled.contains(&row), settled, "row {row}: {line:?}");
        if !settled {
            continue;
        }
        let span = row * width..(row + 1) * width;
        assert_eq!(ids[span.clone()], want_ids[span.clone()], "row {row}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&values[span.clone()]),
            bits(&want_values[span]),
            "row {row}"
        );
        assert_eq!(ranks[row], want_ranks[row], "row {row}");
    }
}

proptest! {
    #[test]
    fn a_greedy_pick_is_the_first_maximum_with_its_logprobs(
        cols in 1usize..90,
        rows in 1usize..5,
        seed in proptest::collection::vec(value(), 1..400),
        k_seed in 0usize..1000,
        nan_at in proptest::option::of(0usize..400),
    ) {
        let mut values: Vec<f32> = (0..rows * cols).map(|i| seed[i % seed.len()]).collect();
        if let Some(at) = nan_at {
            values[at % (rows * cols)] = f32::NAN;
        }
        check_greedy(&values, cols, k_seed % cols);
    }
}

#[test]
fn a_greedy_pick_between_equal_maxima_is_left_to_the_caller() {
    // Row 0: two equal maxima (k = 0 still sees the tie); row 1: one maximum; row 2: NaN.
    let logits = [
        [3.0, 1.0, 3.0, 0.5],
        [0.0, 2.0, 1.0, 0.5],
        [1.0, f32::NAN, 0.0, 0.5],
    ]
    .concat();
    for k in 0..3 {
        let width = k + 1;
        let (ids, _, ranks, unsettled) = outputs(3, width, |out| {
            greedy_logprob_top_k_rows(&logits, 4, k, out).unwrap()
        });
        assert_eq!(unsettled, vec![0, 2], "k = {k}");
        assert_eq!((ids[width], ranks[1]), (1, 1), "k = {k}");
        check_greedy(&logits, 4, k);
    }
}

proptest! {
    /// The chosen token among the row's largest (greedy or likely: the rank then comes from the
    /// top k alone), in rows whose values crowd within rounding of each other near the top, so
    /// that distinct logits share a logprob: the rank still counts the logprobs.
    #[test]
    fn the_rank_of_a_chosen_token_among_the_largest(
        cols in 2usize..90,
        base in -20.0f32..20.0,
        // Steps of a few ulp at magnitudes around the base: collisions after the shift.
        steps in proptest::collection::vec(0u32..6, 90),
        spread in proptest::collection::vec(-8.0f32..0.0, 90),
        crowd in 1usize..12,
        k_seed in 0usize..1000,
        place in 0usize..1000,
    ) {
        let mut line: Vec<f32> = (0..cols).map(|i| base + spread[i]).collect();
        // The first `crowd` columns sit a few ulp apart at and below a common top value, positive
        // so that one less in its bits is the next float down.
        let mut top = base.abs() + 1.0;
        for (slot, &step) in line.iter_mut().zip(&steps).take(crowd.min(cols)) {
            *slot = top;
            for _ in 0..step {
                top = f32::from_bits(top.to_bits() - 1);
            }
        }
        let k = k_seed % cols;
        let mut order: Vec<usize> = (0..cols).collect();
        order.sort_by(|&a, &b| line[b].total_cmp(&line[a]));
        let chosen = order[place % (k + 1)] as i64;
        check_logprob_top_k(&line, cols, k, &[chosen]);
    }
}

#[test]
fn the_top_k_of_the_logprobs_of_nan_and_infinite_rows() {
    let inf = f32::INFINITY;
    let logits = [
        [0.0, 1.0, f32::NAN, 2.0],
        [inf, 1.0, 0.0, -1.0],
        [f32::NEG_INFINITY; 4],
        [3.0, -inf, 1.0, 2.0],
    ]
    .concat();
    check_logprob_top_k(&logits, 4, 2, &[0, 1, 2, 1]);
    let error = logprob_top_k_rows(
        &logits,
        4,
        2,
        &[0, 1, 2, 4],
        TopK {
            ids: &mut [0; 12],
            values: &mut [0.0; 12],
            ranks: &mut [0; 4],
        },
    )
    .unwrap_err();
    assert!(
        error.0.contains("chosen id 4 of row 3 is outside 0..4"),
        "{error}"
    );
}
