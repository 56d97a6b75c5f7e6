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

/// Where `top_k_rows` writes: `[rows, k + 1]` row-major, column 0 the chosen token, columns
/// `1..=k` the top k, most likely first.
pub struct TopK<'a> {
    pub ids: &'a mut [i64],
    pub values: &'a mut [f32],
}

/// For each row `r` of `values` (`[rows, cols]`, row-major): `out.ids[r][0] = chosen[r]` with
/// its value, then the row's `k` largest values and their column ids, most likely first.
/// Returns the rows whose top k is not settled (see the crate docs: a tie among the `k + 1`
/// largest, or a NaN); their top-k columns hold this pass's guess and should be recomputed.
///
/// Needs `k < cols` (with `k + 1` values to compare) and every chosen id in `0..cols`.
pub fn top_k_rows(
    values: &[f32],
    cols: usize,
    k: usize,
    chosen: &[i64],
    out: TopK<'_>,
) -> Result<Vec<usize>, SamplingError> {
    ensure(cols > 0 && values.len().is_multiple_of(cols), || {
        format!("{} values do not make rows of {cols} columns", values.len())
    })?;
    let rows = values.len() / cols;
    ensure(k < cols, || {
        format!("k = {k} needs more than k columns, got {cols}")
    })?;
    ensure(chosen.len() == rows, || {
        format!("{} chosen ids for {rows} rows", chosen.len())
    })?;
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
    let mut unsettled = Vec::new();
    let mut best = Best::new(width);
    for (row, ((line, ids), out_values)) in values
        .chunks_exact(cols)
        .zip(out.ids.chunks_exact_mut(width))
        .zip(out.values.chunks_exact_mut(width))
        .enumerate()
    {
        let token = chosen[row];
        let column = usize::try_from(token).ok().filter(|&c| c < cols);
        let Some(column) = column else {
            return Err(SamplingError(format!(
                "chosen id {token} of row {row} is outside 0..{cols}"
            )));
        };
        ids[0] = token;
        out_values[0] = line[column];
        if !best.scan(line) {
            unsettled.push(row);
        }
        for (slot, (&value, &id)) in best.values[..k].iter().zip(&best.ids[..k]).enumerate() {
            out_values[slot + 1] = value;
            ids[slot + 1] = id as i64;
        }
    }
    Ok(unsettled)
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

    /// Fills the buffer from `line`; true when the result is settled.
    fn scan(&mut self, line: &[f32]) -> bool {
        let width = self.values.len();
        self.values.fill(f32::NEG_INFINITY);
        self.len = 0;
        // Pass 1: chunk maxima and whether the row holds a NaN.
        let chunk = chunk_size(line.len());
        let nan = chunk_maxima(line, chunk, &mut self.maxima);
        if nan {
            return false; // the caller recomputes the row; the buffer holds -inf
        }
        // Pass 2: the floor, then the chunks that reach it.
        let floor = if self.maxima.len() > width {
            self.order.clear();
            self.order.extend_from_slice(&self.maxima);
            let (_, nth, _) = self
                .order
                .select_nth_unstable_by(width - 1, |a, b| b.total_cmp(a));
            *nth
        } else {
            f32::NEG_INFINITY
        };
        for index in 0..self.maxima.len() {
            if self.maxima[index] < floor {
                continue;
            }
            let start = index * chunk;
            let end = (start + chunk).min(line.len());
            for (column, &value) in line[start..end].iter().enumerate() {
                if value >= floor {
                    self.insert(value, start + column);
                }
            }
        }
        self.len == width && self.values.windows(2).all(|pair| pair[0] > pair[1])
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

/// Pass 1 of `Best::scan` into `maxima`; true when `line` holds a NaN. The AVX2 build where
/// the CPU has it (8 lanes), else the baseline build (4).
fn chunk_maxima(line: &[f32], chunk: usize, maxima: &mut Vec<f32>) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { chunk_maxima_avx2(line, chunk, maxima) };
    }
    chunk_maxima_body(line, chunk, maxima)
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn chunk_maxima_avx2(line: &[f32], chunk: usize, maxima: &mut Vec<f32>) -> bool {
    chunk_maxima_body(line, chunk, maxima)
}

/// The maximum of each chunk of `chunk` values (a multiple of `LANES`) (`f32::max` skips NaN; NaN is looked for on its
/// own), lane by lane in `LANES` independent maxima so the loop vectorises (a float reduction
/// in order would not).
#[inline(always)]
fn chunk_maxima_body(line: &[f32], chunk: usize, maxima: &mut Vec<f32>) -> bool {
    maxima.clear();
    let mut nan = false;
    let mut chunks = line.chunks_exact(chunk);
    for chunk in &mut chunks {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let mut unordered = [0u32; LANES];
        for part in chunk.chunks_exact(LANES) {
            for lane in 0..LANES {
                lanes[lane] = lanes[lane].max(part[lane]);
                unordered[lane] |= u32::from(part[lane].is_nan());
            }
        }
        nan |= unordered.iter().any(|&flag| flag != 0);
        maxima.push(lanes.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)));
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        nan |= tail.iter().any(|value| value.is_nan());
        maxima.push(tail.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)));
    }
    nan
}
