//! The logprobs a step reports, straight from its logits: per row the chosen token's logprob
//! and rank and the top k, where the log-softmax is a shift of the row (`Shift`), so the top
//! k is that of the logits, and only the k + 1 values written are shifted. The row's maximum
//! comes from the top k's scan; one pass sums the exponentials, and one counts the rank unless
//! the top k settles it (`rank_in_top_k`).

use crate::error::SamplingError;
use crate::log_softmax::Shift;
use crate::top_k::{shifted_top_k_rows, Chosen, Scan, TopK};

/// `top_k_rows` of the log-softmax of `logits` (`[rows, cols]`, row-major) without writing
/// it: the values are `log_softmax_rows`' to the bit and the ranks count its values (as
/// `top_k_rows` of it would); the ids are ordered by the logits (the log-softmax keeps their
/// order; where rounding makes two logprobs equal, the logit decides). Rows the log-softmax
/// makes NaN (a NaN or `+inf`, or only `-inf`) get NaN values, rank 0 (a NaN counts nowhere)
/// and are reported unsettled, as are rows whose top k is not settled in the logits: recompute
/// those from `log_softmax_rows`.
pub fn logprob_top_k_rows(
    logits: &[f32],
    cols: usize,
    k: usize,
    chosen: &[i64],
    out: TopK<'_>,
) -> Result<Vec<usize>, SamplingError> {
    logprobs_of(logits, cols, k, Chosen::Given(chosen), out)
}

/// `logprob_top_k_rows` with each row's chosen token its largest logit (a greedy pick, found
/// by the same scan: no argmax pass of its own), written to `out.ids[r][0]`. A row is settled
/// only where that logit is the row's only maximum (its two largest differ) besides
/// `logprob_top_k_rows`' conditions; on an unsettled row the pick is this pass's guess (on a
/// NaN row, id 0): recompute those rows (a greedy pick there is the first maximum, or the
/// first NaN, as numpy's argmax).
pub fn greedy_logprob_top_k_rows(
    logits: &[f32],
    cols: usize,
    k: usize,
    out: TopK<'_>,
) -> Result<Vec<usize>, SamplingError> {
    logprobs_of(logits, cols, k, Chosen::Largest, out)
}

fn logprobs_of(
    logits: &[f32],
    cols: usize,
    k: usize,
    chosen: Chosen<'_>,
    out: TopK<'_>,
) -> Result<Vec<usize>, SamplingError> {
    let mut scratch = vec![0f32; cols];
    shifted_top_k_rows(
        logits,
        cols,
        k,
        chosen,
        out,
        |line, scan, chosen, largest| {
            let shift = Shift::of_row(line, scan.largest, scan.nan, &mut scratch)?;
            let logprob = shift.apply(chosen);
            let rank = rank_in_top_k(scan, shift, logprob, largest)
                .unwrap_or_else(|| at_least(line, shift, logprob));
            Some((shift, rank))
        },
    )
}

/// The chosen token's rank from the row's `largest` k + 1 values alone, where they settle it:
/// the row is settled (those are its k + 1 largest) and the (k + 1)-th largest's logprob is
/// below the chosen one's. A shift is monotone (a rounded subtraction never reverses an
/// order), so every value outside the top k, being at most the (k + 1)-th, has a logprob below
/// the chosen one's too, and the count over the top k is the count over the row. This is the
/// usual case (a greedy or likely token), and it saves the pass over the row.
fn rank_in_top_k(scan: &Scan, shift: Shift, logprob: f32, largest: &[f32]) -> Option<usize> {
    let (&next, top) = largest.split_last()?;
    if !scan.settled || shift.apply(next) >= logprob {
        return None;
    }
    Some(
        top.iter()
            .filter(|&&value| shift.apply(value) >= logprob)
            .count(),
    )
}

/// How many of `line`'s logprobs (`shift` of its values) are at least `logprob`: the values'
/// own count can be lower, where rounding makes logprobs of different values equal.
fn at_least(line: &[f32], shift: Shift, logprob: f32) -> usize {
    const LANES: usize = 8;
    let mut counts = [0u32; LANES];
    let mut parts = line.chunks_exact(LANES);
    for part in &mut parts {
        for lane in 0..LANES {
            counts[lane] += u32::from(shift.apply(part[lane]) >= logprob);
        }
    }
    let tail = parts.remainder().iter();
    let tail = tail.filter(|&&value| shift.apply(value) >= logprob).count();
    counts.iter().map(|&count| count as usize).sum::<usize>() + tail
}
