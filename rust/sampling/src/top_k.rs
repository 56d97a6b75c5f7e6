//! The top k of each row in two passes that take few data-dependent branches (a row of fresh
//! logprobs defeats the branch predictor, and a mispredicted branch per candidate costs more
//! than the comparisons):
//!
//! 1. the maximum of each chunk of values (`chunk_size`) and whether the row holds a NaN, without a
//!    branch on the values (the comparisons vectorise);
//! 2. the `k + 1`-th largest chunk maximum `floor`: at least `k + 1` values (one per chunk)
//!    are at least `floor`, so every one of the `k + 1` largest is, and lies in a chunk whose
//!    maximum is; only those chunks are scanned, and only their values of at least `floor`
//!    enter the sorted buffer of the `k + 1` largest.

use crate::error::{ensure, SamplingError};
use crate::log_softmax::Shift;

/// Values per chunk of the first pass: at least `MIN_CHUNK`, a multiple of it, and few enough
/// chunks per row (`MAX_CHUNKS`) that selecting the floor among their maxima stays cheap. And
/// the independent maxima the first pass keeps per chunk.
const MIN_CHUNK: usize = 16;
const MAX_CHUNKS: usize = 64;
const LANES: usize = 8;

/// The first pass's chunk size for rows of `cols` values.
fn chunk_size(cols: usize) -> usize {
    cols.div_ceil(MAX_CHUNKS).div_ceil(MIN_CHUNK).max(1) * MIN_CHUNK
}

/// Where `top_k_rows` writes: `ids` / `values` `[rows, k + 1]` row-major, column 0 the chosen
/// token, columns `1..=k` the top k, most likely first; `ranks` `[rows]`, the chosen token's
/// rank: how many of the row's values are at least its value (itself included; a NaN counts
/// nowhere, so a NaN chosen value has rank 0).
pub struct TopK<'a> {
    pub ids: &'a mut [i64],
    pub values: &'a mut [f32],
    pub ranks: &'a mut [i64],
}

/// For each row `r` of `values` (`[rows, cols]`, row-major): `out.ids[r][0] = chosen[r]` with
/// its value, then the row's `k` largest values and their column ids, most likely first, and
/// the chosen token's rank in `out.ranks[r]`. Returns the rows whose top k is not settled (see
/// the crate docs: a tie among the `k + 1` largest, or a NaN); their top-k columns hold this
/// pass's guess and should be recomputed (their ranks are exact).
///
/// Needs `k < cols` (with `k + 1` values to compare) and every chosen id in `0..cols`.
pub fn top_k_rows(
    values: &[f32],
    cols: usize,
    k: usize,
    chosen: &[i64],
    out: TopK<'_>,
) -> Result<Vec<usize>, SamplingError> {
    shifted_top_k_rows(
        values,
        cols,
        k,
        Chosen::Given(chosen),
        out,
        |_, scan, _, _| Some((Shift::NONE, scan.at_least)),
    )
}

/// Each row's chosen token: given, or the row's largest value (`Largest`: a greedy pick, taken
/// from the scan; settled only where that value is the row's only maximum).
#[derive(Clone, Copy)]
pub(crate) enum Chosen<'a> {
    Given(&'a [i64]),
    Largest,
}

/// `top_k_rows` of each row shifted by `shift(row, scan, chosen value, largest)` (called
/// after the row's scan; `largest`: the row's k + 1 largest values, descending, as the scan
/// kept them), which also gives the chosen token's rank: the values written are
/// `shift.apply(value)`, the order that of the values as given (a shift keeps it). A row
/// whose shift is None is written as NaN, rank 0, and reported unsettled.
pub(crate) fn shifted_top_k_rows(
    values: &[f32],
    cols: usize,
    k: usize,
    chosen: Chosen<'_>,
    out: TopK<'_>,
    mut shift: impl FnMut(&[f32], &Scan, f32, &[f32]) -> Option<(Shift, usize)>,
) -> Result<Vec<usize>, SamplingError> {
    ensure(cols > 0 && values.len().is_multiple_of(cols), || {
        format!("{} values do not make rows of {cols} columns", values.len())
    })?;
    let rows = values.len() / cols;
    ensure(k < cols, || {
        format!("k = {k} needs more than k columns, got {cols}")
    })?;
    if let Chosen::Given(chosen) = chosen {
        ensure(chosen.len() == rows, || {
            format!("{} chosen ids for {rows} rows", chosen.len())
        })?;
    }
    let width = k + 1;
    ensure(
        out.ids.len() == rows * width && out.values.len() == rows * width,
        || {
            format!(
            "outputs must hold rows x (k + 1) = {rows} x {width} items, got {} ids and {} values",
            out.ids.len(),
            out.values.len()
        )
        },
    )?;
    ensure(out.ranks.len() == rows, || {
        format!(
            "ranks must hold one item per row ({rows}), got {}",
            out.ranks.len()
        )
    })?;
    let mut unsettled = Vec::new();
    // A greedy pick is settled only where the row's two largest differ: keep two at least.
    let mut best = Best::new(match chosen {
        Chosen::Given(_) => width,
        Chosen::Largest => width.max(2).min(cols),
    });
    for (row, (((line, ids), out_values), rank)) in values
        .chunks_exact(cols)
        .zip(out.ids.chunks_exact_mut(width))
        .zip(out.values.chunks_exact_mut(width))
        .zip(out.ranks.iter_mut())
        .enumerate()
    {
        let (scan, column) = match chosen {
            Chosen::Given(chosen) => {
                let token = chosen[row];
                let column = usize::try_from(token).ok().filter(|&c| c < cols);
                let Some(column) = column else {
                    return Err(SamplingError(format!(
                        "chosen id {token} of row {row} is outside 0..{cols}"
                    )));
                };
                (best.scan(line, line[column]), column)
            }
            // The count of values at least the chosen one is not used for a greedy pick (its
            // rank comes from the shift); a row with two largest values equal is unsettled.
            Chosen::Largest => {
                let scan = best.scan(line, f32::INFINITY);
                (scan, if scan.nan { 0 } else { best.ids[0] })
            }
        };
        ids[0] = column as i64;
        for (slot, &id) in best.ids[..k].iter().enumerate() {
            ids[slot + 1] = id as i64;
        }
        let Some((shift, at_least)) = shift(line, &scan, line[column], &best.values) else {
            out_values.fill(f32::NAN);
            *rank = 0;
            unsettled.push(row);
            continue;
        };
        out_values[0] = shift.apply(line[column]);
        *rank = at_least as i64;
        if !scan.settled {
            unsettled.push(row);
        }
        for (slot, &value) in best.values[..k].iter().enumerate() {
            out_values[slot + 1] = shift.apply(value);
        }
    }
    Ok(unsettled)
}

/// What a row's scan found.
#[derive(Clone, Copy)]
pub(crate) struct Scan {
    /// The top k is the only one (the k + 1 largest strictly decreasing, no NaN).
    pub settled: bool,
    /// How many of the row's values are at least the chosen one.
    pub at_least: usize,
    /// The row holds a NaN.
    pub nan: bool,
    /// The row's largest value (NaN left out; meaningless when `nan`).
    pub largest: f32,
}

/// The `width` largest values of one row seen so far, descending, with their columns.
struct Best {
    values: Vec<f32>,
    ids: Vec<usize>,
    len: usize,
    /// The row's chunk maxima, and a copy the floor is selected in.
    maxima: Vec<f32>,
    order: Vec<f32>,
}

impl Best {
    fn new(width: usize) -> Self {
        Best {
            values: vec![f32::NEG_INFINITY; width],
            ids: vec![0; width],
            len: 0,
            maxima: Vec::new(),
            order: Vec::new(),
        }
    }

    /// Fills the buffer from `line`; says whether the result is settled, how many of the
    /// row's values are at least `chosen`, whether the row holds a NaN, and its largest value.
    fn scan(&mut self, line: &[f32], chosen: f32) -> Scan {
        let width = self.values.len();
        self.values.fill(f32::NEG_INFINITY);
        self.len = 0;
        // Pass 1: chunk maxima, whether the row holds a NaN, the values at least `chosen`.
        let chunk = chunk_size(line.len());
        let pass = first_pass(line, chunk, chosen, &mut self.maxima);
        if pass.nan {
            // The caller recomputes the row's top k.
            return Scan {
                settled: false,
                at_least: pass.at_least,
                nan: true,
                largest: f32::NAN,
            };
        }
        // Pass 2: the floor, then the chunks that reach it.
        let floor = if self.maxima.len() > width {
            nth_largest(&self.maxima, width, &mut self.order)
        } else {
            f32::NEG_INFINITY
        };
        for index in 0..self.maxima.len() {
            if self.maxima[index] < floor {
                continue;
            }
            let start = index * chunk;
            let end = (start + chunk).min(line.len());
            self.insert_at_least(&line[start..end], start, floor);
        }
        let settled = self.len == width && self.values.windows(2).all(|pair| pair[0] > pair[1]);
        Scan {
            settled,
            at_least: pass.at_least,
            nan: false,
            largest: self.values[0],
        }
    }

    /// Inserts the values of `part` (columns from `start`) that are at least `floor`, in
    /// column order: a mask of `LANES` comparisons, then one insertion per set bit (few: a
    /// branch per value would be mispredicted on fresh rows).
    fn insert_at_least(&mut self, part: &[f32], start: usize, floor: f32) {
        let mut groups = part.chunks_exact(LANES);
        let mut offset = start;
        for group in &mut groups {
            let mut bits = 0u32;
            for (lane, &value) in group.iter().enumerate() {
                bits |= u32::from(value >= floor) << lane;
            }
            while bits != 0 {
                let lane = bits.trailing_zeros() as usize;
                self.insert(group[lane], offset + lane);
                bits &= bits - 1;
            }
            offset += LANES;
        }
        for (lane, &value) in groups.remainder().iter().enumerate() {
            if value >= floor {
                self.insert(value, offset + lane);
            }
        }
    }

    /// Inserts after every kept value at least as large (earlier columns first among equals),
    /// dropping the smallest when full: shifts the smaller ones down one slot (at most
    /// `k + 1`, so a plain loop beats a search and a memmove). Never sees NaN (a row holding
    /// one is left after the first pass).
    fn insert(&mut self, value: f32, column: usize) {
        let width = self.values.len();
        let mut slot = self.len.min(width - 1);
        if self.len == width && self.values[slot] >= value {
            return;
        }
        while slot > 0 && self.values[slot - 1] < value {
            self.values[slot] = self.values[slot - 1];
            self.ids[slot] = self.ids[slot - 1];
            slot -= 1;
        }
        self.values[slot] = value;
        self.ids[slot] = column;
        self.len = (self.len + 1).min(width);
    }
}

/// Widths up to this select their floor among the chunk maxima by a pass of compare-exchanges
/// (no data-dependent branch), larger ones by `select_nth_unstable_by`.
const MAX_EXCHANGE_WIDTH: usize = 8;

/// The `width`-th largest of `maxima` (none NaN; more than `width` of them), `order` a
/// scratch buffer for large widths.
fn nth_largest(maxima: &[f32], width: usize, order: &mut Vec<f32>) -> f32 {
    if width > MAX_EXCHANGE_WIDTH {
        order.clear();
        order.extend_from_slice(maxima);
        let (_, nth, _) = order.select_nth_unstable_by(width - 1, |a, b| b.total_cmp(a));
        return *nth;
    }
    // `top` stays sorted, largest first: each value moves down through it, every slot keeping
    // the larger of itself and the value passing by.
    let mut top = [f32::NEG_INFINITY; MAX_EXCHANGE_WIDTH];
    for &value in maxima {
        let mut passing = value;
        for slot in top.iter_mut().take(width) {
            let kept = larger(*slot, passing);
            passing = if passing > *slot { *slot } else { passing };
            *slot = kept;
        }
    }
    top[width - 1]
}

/// What pass 1 learns of a row besides its chunk maxima.
struct FirstPass {
    /// The row holds a NaN.
    nan: bool,
    /// How many values are at least the chosen one.
    at_least: usize,
}

/// Pass 1 of `Best::scan` into `maxima`. The AVX2 build where the CPU has it (8 lanes), else
/// the baseline build (4).
fn first_pass(line: &[f32], chunk: usize, chosen: f32, maxima: &mut Vec<f32>) -> FirstPass {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { first_pass_avx2(line, chunk, chosen, maxima) };
    }
    first_pass_body(line, chunk, chosen, maxima)
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn first_pass_avx2(
    line: &[f32],
    chunk: usize,
    chosen: f32,
    maxima: &mut Vec<f32>,
) -> FirstPass {
    first_pass_body(line, chunk, chosen, maxima)
}

/// The larger of two values that are not NaN (one `max` instruction: `f32::max` also orders
/// NaN, which costs a compare and a blend per lane).
#[inline(always)]
fn larger(a: f32, b: f32) -> f32 {
    if b > a {
        b
    } else {
        a
    }
}

/// The maximum of each chunk of `chunk` values (a multiple of `LANES`), lane by lane in
/// `LANES` independent maxima so the loop vectorises (a float reduction in order would not).
/// A NaN never enters a maximum (`larger` keeps the other operand); it is looked for on its
/// own, and the values at least `chosen` counted, per lane over the whole row.
#[inline(always)]
fn first_pass_body(line: &[f32], chunk: usize, chosen: f32, maxima: &mut Vec<f32>) -> FirstPass {
    maxima.clear();
    let mut unordered = [0u32; LANES];
    let mut counts = [0u32; LANES];
    let mut chunks = line.chunks_exact(chunk);
    for chunk in &mut chunks {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        for part in chunk.chunks_exact(LANES) {
            for lane in 0..LANES {
                let value = part[lane];
                lanes[lane] = larger(lanes[lane], value);
                unordered[lane] |= u32::from(value.is_nan());
                counts[lane] += u32::from(value >= chosen);
            }
        }
        maxima.push(lanes.iter().fold(f32::NEG_INFINITY, |a, &b| larger(a, b)));
    }
    let mut nan = unordered.iter().any(|&flag| flag != 0);
    let mut at_least: usize = counts.iter().map(|&count| count as usize).sum();
    let tail = chunks.remainder();
    if !tail.is_empty() {
        nan |= tail.iter().any(|value| value.is_nan());
        at_least += tail.iter().filter(|&&value| value >= chosen).count();
        maxima.push(tail.iter().fold(f32::NEG_INFINITY, |a, &b| larger(a, b)));
    }
    FirstPass { nan, at_least }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_is_the_width_th_largest_by_either_selection() {
        let maxima: Vec<f32> = (0..40)
            .map(|i| ((i * 37) % 23) as f32 - 11.0)
            .chain([f32::NEG_INFINITY, 12.0, 12.0, -0.0, 0.0])
            .collect();
        let mut sorted = maxima.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let mut order = Vec::new();
        for width in 1..=20 {
            let want = sorted[width - 1];
            let got = nth_largest(&maxima, width, &mut order);
            assert!(got == want, "width {width}: {got} against {want}");
        }
        let lows = [f32::NEG_INFINITY, f32::NEG_INFINITY, -1.0];
        assert_eq!(nth_largest(&lows, 2, &mut order), f32::NEG_INFINITY);
    }
}
