//! The kernel: per row, one pass over the visible blocks. For each block, the scores of every
//! query head against its keys, then an online softmax (a running max and sum per head; the
//! accumulated output is rescaled when the max grows), then the block's values weighted into the
//! output. A block's K and V pages are read together, once.

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
    if simd::use_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time just above).
        unsafe { run_avx2(job) };
        return Ok(());
    }
    run::<false>(job);
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2(job: Job<'_, '_>) {
    run::<true>(job)
}

#[inline(always)]
fn run<const FMA: bool>(job: Job<'_, '_>) {
    let Job {
        q,
        keys,
        values,
        rows,
        shape,
        params,
        out,
    } = job;
    let (head_dim, group, num_heads) = (shape.head_dim, shape.group_size(), shape.num_heads);
    let block_size = keys.block_size;
    // Per head: the block's scores, then its softmax weights (stride block_size).
    let mut weights = vec![0.0f32; num_heads * block_size];
    // Per head: running max and running sum of exp(score - max) (the online softmax).
    let mut running_max = vec![f32::NEG_INFINITY; num_heads];
    let mut running_sum = vec![0.0f32; num_heads];
    for r in 0..rows.len() {
        let span = rows.span(r);
        let q_row = &q[r * shape.row_len()..(r + 1) * shape.row_len()];
        let out_row = &mut out[r * shape.row_len()..(r + 1) * shape.row_len()];
        out_row.fill(0.0);
        running_max.fill(f32::NEG_INFINITY);
        running_sum.fill(0.0);
        // One pass over the visible blocks; a block's K and V are read together.
        for (block, offsets, _) in rows.blocks(span, block_size) {
            let count = offsets.len();
            let key_base = keys.head_start(block, 0);
            for (j, token) in offsets.clone().enumerate() {
                let token_start = key_base + token * keys.token_stride;
                for kv_head in 0..shape.num_kv_heads {
                    let start = token_start + kv_head * keys.head_stride;
                    let key = &keys.data[start..start + head_dim];
                    for head in kv_head * group..(kv_head + 1) * group {
                        let query = &q_row[head * head_dim..(head + 1) * head_dim];
                        weights[head * block_size + j] =
                            simd::dot::<FMA>(query, key) * params.scale;
                    }
                }
            }
            for head in 0..num_heads {
                let block_scores = &mut weights[head * block_size..head * block_size + count];
                if let Some(cap) = params.softcap {
                    math::softcap(block_scores, cap);
                }
                let block_max = block_scores
                    .iter()
                    .copied()
                    .fold(f32::NEG_INFINITY, f32::max);
                let max = running_max[head].max(block_max);
                if max > running_max[head] && running_sum[head] > 0.0 {
                    // A larger score arrived: rescale what was accumulated so far.
                    let factor = (running_max[head] - max).exp();
                    running_sum[head] *= factor;
                    for value in &mut out_row[head * head_dim..(head + 1) * head_dim] {
                        *value *= factor;
                    }
                }
                running_max[head] = max;
                running_sum[head] += math::exp_shifted_sum(block_scores, max);
            }
            let value_base = values.head_start(block, 0);
            for (j, token) in offsets.enumerate() {
                let token_start = value_base + token * values.token_stride;
                for kv_head in 0..shape.num_kv_heads {
                    let start = token_start + kv_head * values.head_stride;
                    let value = &values.data[start..start + head_dim];
                    for head in kv_head * group..(kv_head + 1) * group {
                        let acc = &mut out_row[head * head_dim..(head + 1) * head_dim];
                        simd::axpy::<FMA>(acc, weights[head * block_size + j], value);
                    }
                }
            }
        }
        // The sink (if any) joins each head's denominator, then normalise.
        for (head, acc) in out_row.chunks_exact_mut(head_dim).enumerate() {
            let (mut max, mut sum) = (running_max[head], running_sum[head]);
            if let Some(sinks) = params.sinks {
                let sink = sinks[head];
                if sink > max {
                    let factor = (max - sink).exp();
                    sum *= factor;
                    for value in acc.iter_mut() {
                        *value *= factor;
                    }
                    max = sink;
                }
                sum += (sink - max).exp();
            }
            let inverse = 1.0 / sum;
            for value in acc {
                *value *= inverse;
            }
        }
    }
}
