//! The kernel: per row and kv head, one pass over the visible keys for the scores of the
//! group's query heads, a softmax per head, one pass over the values.

use crate::error::{ensure, AttentionError};
use crate::layout::{AttentionParams, HeadShape, PagedCache, QueryRows};
use crate::{math, simd};

/// Everything one call reads and writes, checked.
struct Job<'a, 'o> {
    q: &'a [f32],
    keys: PagedCache<'a>,
    values: PagedCache<'a>,
    rows: QueryRows<'a>,
    shape: HeadShape,
    params: AttentionParams<'a>,
    out: &'o mut [f32],
}

/// Attention of `q` (`[rows, num_heads, head_dim]`, row-major) over the paged `keys`/`values`,
/// written to `out` (same shape). Checks every length, stride and visible block first and
/// changes nothing when one is wrong.
pub fn paged_attention(
    q: &[f32],
    keys: PagedCache<'_>,
    values: PagedCache<'_>,
    rows: QueryRows<'_>,
    shape: HeadShape,
    params: AttentionParams<'_>,
    out: &mut [f32],
) -> Result<(), AttentionError> {
    shape.check()?;
    params.check(&shape)?;
    keys.check("keys", &shape)?;
    values.check("values", &shape)?;
    ensure(keys.block_size == values.block_size, || {
        format!(
            "keys and values have block sizes {} and {}",
            keys.block_size, values.block_size
        )
    })?;
    let expected = rows.len() * shape.row_len();
    ensure(q.len() == expected && out.len() == expected, || {
        format!(
            "q and out must hold rows x num_heads x head_dim = {expected} values, got {} and {}",
            q.len(),
            out.len()
        )
    })?;
    rows.check(keys.block_size, keys.num_blocks.min(values.num_blocks))?;
    let job = Job {
        q,
        keys,
        values,
        rows,
        shape,
        params,
        out,
    };
    #[cfg(target_arch = "x86_64")]
    if simd::has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked at run time just above).
        unsafe { run_avx2(job) };
        return Ok(());
    }
    run(job);
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn run_avx2(job: Job<'_, '_>) {
    run(job)
}

#[inline(always)]
fn run(job: Job<'_, '_>) {
    let Job {
        q,
        keys,
        values,
        rows,
        shape,
        params,
        out,
    } = job;
    let (head_dim, group) = (shape.head_dim, shape.group_size());
    let block_size = keys.block_size;
    let mut scores: Vec<f32> = Vec::new();
    let mut inverse = vec![0.0f32; shape.num_heads];
    for r in 0..rows.len() {
        let span = rows.span(r);
        let (_, low, position) = span;
        let visible = position - low + 1;
        let q_row = &q[r * shape.row_len()..(r + 1) * shape.row_len()];
        let out_row = &mut out[r * shape.row_len()..(r + 1) * shape.row_len()];
        out_row.fill(0.0);
        scores.clear();
        scores.resize(shape.num_heads * visible, 0.0);
        // Pass 1: scores[head * visible + i] for key i, every head, each block read once.
        for (block, offsets, first) in rows.blocks(span, block_size) {
            let base = keys.head_start(block, 0);
            for (i, token) in (first..).zip(offsets) {
                let token_start = base + token * keys.token_stride;
                for kv_head in 0..shape.num_kv_heads {
                    let start = token_start + kv_head * keys.head_stride;
                    let key = &keys.data[start..start + head_dim];
                    for head in kv_head * group..(kv_head + 1) * group {
                        let query = &q_row[head * head_dim..(head + 1) * head_dim];
                        scores[head * visible + i] = simd::dot(query, key) * params.scale;
                    }
                }
            }
        }
        // Softmax per query head (the sink, if any, joins the denominator).
        for (head, head_scores) in scores.chunks_exact_mut(visible).enumerate() {
            if let Some(cap) = params.softcap {
                math::softcap(head_scores, cap);
            }
            let sink = params.sinks.map(|sinks| sinks[head]);
            let mut max = head_scores
                .iter()
                .copied()
                .fold(f32::NEG_INFINITY, f32::max);
            if let Some(sink) = sink {
                max = max.max(sink);
            }
            let mut sum = math::exp_shifted_sum(head_scores, max);
            if let Some(sink) = sink {
                sum += (sink - max).exp();
            }
            inverse[head] = 1.0 / sum;
        }
        // Pass 2: weighted values, each block read once.
        for (block, offsets, first) in rows.blocks(span, block_size) {
            let base = values.head_start(block, 0);
            for (i, token) in (first..).zip(offsets) {
                let token_start = base + token * values.token_stride;
                for kv_head in 0..shape.num_kv_heads {
                    let start = token_start + kv_head * values.head_stride;
                    let value = &values.data[start..start + head_dim];
                    for head in kv_head * group..(kv_head + 1) * group {
                        let acc = &mut out_row[head * head_dim..(head + 1) * head_dim];
                        simd::axpy(acc, scores[head * visible + i], value);
                    }
                }
            }
        }
        for (acc, scale) in out_row.chunks_exact_mut(head_dim).zip(&inverse) {
            for value in acc {
                *value *= scale;
            }
        }
    }
}
