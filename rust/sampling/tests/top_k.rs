//! `top_k_rows` against a sort of each row: the same ids and values wherever it reports a row
//! settled, and a row unsettled exactly when its k + 1 largest values are not strictly
//! decreasing or it holds a NaN.

use hybrid_cache_sampling::{top_k_rows, SamplingError, TopK};
use proptest::prelude::*;

/// The reference: columns sorted by value descending, earlier columns first among equals
/// (NaN rows: None).
fn sorted_columns(line: &[f32]) -> Option<Vec<usize>> {
    if line.iter().any(|v| v.is_nan()) {
        return None;
    }
    let mut columns: Vec<usize> = (0..line.len()).collect();
    columns.sort_by(|&a, &b| line[b].partial_cmp(&line[a]).unwrap().then(a.cmp(&b)));
    Some(columns)
}

fn run(values: &[f32], cols: usize, k: usize, chosen: &[i64]) -> (Vec<i64>, Vec<f32>, Vec<usize>) {
    let (ids, out, _, unsettled) = run_ranked(values, cols, k, chosen);
    (ids, out, unsettled)
}

fn run_ranked(
    values: &[f32],
    cols: usize,
    k: usize,
    chosen: &[i64],
) -> (Vec<i64>, Vec<f32>, Vec<i64>, Vec<usize>) {
    let rows = values.len() / cols;
    let mut ids = vec![-7; rows * (k + 1)];
    let mut out = vec![0.5; rows * (k + 1)];
    let mut ranks = vec![-7; rows];
    let unsettled = top_k_rows(
        values,
        cols,
        k,
        chosen,
        TopK {
            ids: &mut ids,
            values: &mut out,
            ranks: &mut ranks,
        },
    )
    .unwrap();
    (ids, out, ranks, unsettled)
}

fn check(values: &[f32], cols: usize, k: usize, chosen: &[i64]) {
    let (ids, out, ranks, unsettled) = run_ranked(values, cols, k, chosen);
    for (row, line) in values.chunks_exact(cols).enumerate() {
        // The rank counts every value at least the chosen one (NaN: none), ties included.
        let chosen_value = line[chosen[row] as usize];
        let at_least = line.iter().filter(|&&value| value >= chosen_value).count();
        assert_eq!(ranks[row], at_least as i64, "row {row}: {line:?}");
        let got_ids = &ids[row * (k + 1)..(row + 1) * (k + 1)];
        let got_values = &out[row * (k + 1)..(row + 1) * (k + 1)];
        assert_eq!(got_ids[0], chosen[row]);
        assert_eq!(
            got_values[0].to_bits(),
            line[chosen[row] as usize].to_bits()
        );
        let expected_unsettled = match sorted_columns(line) {
            None => true,
            Some(order) => {
                let top: Vec<f32> = order[..=k].iter().map(|&c| line[c]).collect();
                let distinct = top.windows(2).all(|pair| pair[0] > pair[1]);
                if distinct {
                    let expected: Vec<i64> = order[..k].iter().map(|&c| c as i64).collect();
                    assert_eq!(&got_ids[1..], &expected[..], "row {row}");
                    let expected_values: Vec<f32> = order[..k].iter().map(|&c| line[c]).collect();
                    assert_eq!(&got_values[1..], &expected_values[..], "row {row}");
                }
                !distinct
            }
        };
        assert_eq!(
            unsettled.contains(&row),
            expected_unsettled,
            "row {row}: {line:?}"
        );
    }
}

/// Values from a small set (ties are common), the infinities and NaN now and then.
fn value() -> impl Strategy<Value = f32> {
    prop_oneof![
        8 => (-40i32..40).prop_map(|v| v as f32 / 4.0),
        4 => -1e3f32..1e3,
        1 => Just(f32::NEG_INFINITY),
        1 => Just(f32::INFINITY),
        1 => Just(f32::NAN),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(if cfg!(miri) { 8 } else { 512 }))]
    #[test]
    fn settled_rows_equal_a_sort(
        (cols, k, values, chosen) in (1usize..70, 0usize..24).prop_flat_map(|(cols, k)| {
            let k = k.min(cols - 1);
            let rows = 1usize..6;
            rows.prop_flat_map(move |rows| {
                (
                    Just(cols),
                    Just(k),
                    proptest::collection::vec(value(), rows * cols),
                    proptest::collection::vec(0..cols as i64, rows),
                )
            })
        })
    ) {
        check(&values, cols, k, &chosen);
    }

    #[test]
    fn distinct_rows_are_always_settled(
        cols in 2usize..600, k in 0usize..21, seed in any::<u64>(), rows in 1usize..4
    ) {
        let k = k.min(cols - 1);
        let mut state = seed | 1;
        let values: Vec<f32> = (0..rows * cols)
            .map(|index| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                // Distinct: the index breaks any tie of the random part.
                (state % 1000) as f32 + index as f32 / (rows * cols) as f32
            })
            .collect();
        let chosen = vec![0; rows];
        let (_, _, unsettled) = run(&values, cols, k, &chosen);
        prop_assert!(unsettled.is_empty());
        check(&values, cols, k, &chosen);
    }
}

#[test]
fn ties_and_nan_leave_a_row_unsettled() {
    // Row 0: the 2nd and 3rd largest tie (k = 2 needs 3 distinct). Row 1: a tie below the top
    // k + 1 only (settled). Row 2: a NaN. Row 3: fewer finite values than k + 1 (-inf ties).
    let values = [
        1.0,
        5.0,
        3.0,
        3.0,
        0.0, //
        9.0,
        8.0,
        7.0,
        1.0,
        1.0, //
        1.0,
        f32::NAN,
        2.0,
        3.0,
        4.0, //
        f32::NEG_INFINITY,
        2.0,
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
    ];
    let (ids, out, unsettled) = run(&values, 5, 2, &[1, 4, 0, 1]);
    assert_eq!(unsettled, vec![0, 2, 3]);
    assert_eq!(&ids[3..6], &[4, 0, 1]);
    assert_eq!(&out[3..6], &[1.0, 9.0, 8.0]);
    check(&values, 5, 2, &[1, 4, 0, 1]);
}

#[test]
fn bad_shapes_and_ids_are_errors_that_say_what_to_change() {
    let values = [0.0f32; 6];
    let mut ids = vec![0i64; 4];
    let mut out = vec![0f32; 4];
    let mut ranks = vec![0i64; 2];
    let mut call = |cols: usize, k: usize, chosen: &[i64]| {
        top_k_rows(
            &values,
            cols,
            k,
            chosen,
            TopK {
                ids: &mut ids,
                values: &mut out,
                ranks: &mut ranks,
            },
        )
    };
    let message = |result: Result<Vec<usize>, SamplingError>| result.unwrap_err().0;
    assert!(message(call(4, 1, &[0])).contains("do not make rows of 4 columns"));
    assert!(message(call(3, 3, &[0, 0])).contains("needs more than k columns"));
    assert!(message(call(3, 1, &[0])).contains("1 chosen ids for 2 rows"));
    assert!(message(call(3, 1, &[0, 3])).contains("chosen id 3 of row 1 is outside 0..3"));
    assert!(message(call(3, 2, &[0, 0])).contains("rows x (k + 1) = 2 x 3"));
    // A valid call: all values tie, so both rows are left to the caller.
    assert_eq!(call(3, 1, &[2, 0]).unwrap(), vec![0, 1]);
    let mut one_rank = [0i64; 1];
    let short = top_k_rows(
        &values,
        3,
        1,
        &[0, 0],
        TopK {
            ids: &mut ids,
            values: &mut out,
            ranks: &mut one_rank,
        },
    );
    assert!(message(short).contains("ranks must hold one item per row (2), got 1"));
}
