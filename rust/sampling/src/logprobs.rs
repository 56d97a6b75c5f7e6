//! The logprobs a step reports, straight from its logits: per row the chosen token's logprob
//! and rank and the top k, where the log-softmax is a shift of the row (`Shift`), so the top
//! k and the ranks are those of the logits, and only the k + 1 values written are shifted.
//! The row's maximum comes from the top k's scan; one more pass sums the exponentials.

use crate::error::SamplingError;
use crate::log_softmax::Shift;
use crate::top_k::{shifted_top_k_rows, TopK};

/// `top_k_rows` of the log-softmax of `logits` (`[rows, cols]`, row-major) without writing
/// it: the values are `log_softmax_rows`' to the bit, the ids and ranks those of the logits
/// (the log-softmax keeps their order; where rounding makes two logprobs equal, the logit
/// decides). Rows the log-softmax makes NaN (a NaN or `+inf`, or only `-inf`) get NaN values,
/// rank 0 (a NaN counts nowhere) and are reported unsettled, as are rows whose top k is not
/// settled: recompute those from `log_softmax_rows`.
pub fn logprob_top_k_rows(
    logits: &[f32],
    cols: usize,
    k: usize,
    chosen: &[i64],
    out: TopK<'_>,
) -> Result<Vec<usize>, SamplingError> {
    let mut scratch = vec![0f32; cols];
    shifted_top_k_rows(logits, cols, k, chosen, out, |line, scan| {
        Shift::of_row(line, scan.largest, scan.nan, &mut scratch)
    })
}
