//! Paged attention: one query token per row, keys and values read in place from the paged
//! cache through the block table. This file is the entry point: it checks every argument,
//! then picks the build (AVX2+FMA or portable) and a head_dim specialisation, and hands the
//! checked job to the row driver (`row.rs`).

#[cfg(target_arch = "x86_64")]
mod avx2;
mod block;
mod kernel;
mod lanes;
mod portable;
pub(crate) mod query;
mod row;
mod softmax;
mod tile;

use crate::error::{ensure, AttentionError};
use crate::layout::{HeadShape, PagedCache};
use crate::simd::dispatch;
use portable::Portable;
use query::{AttentionParams, QueryRows};
use row::Job;

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
    // One copy of the driver per common head_dim, where the constant lets LLVM unroll the
    // column loops; any other head_dim runs the generic copy (0). Each copy is a function of
    // its own, which LLVM optimises (and vectorises) better than one function holding all.
    macro_rules! by_head_dim {
        ($run:ident) => {
            match job.shape.head_dim {
                16 => $run::<16>(job),
                32 => $run::<32>(job),
                64 => $run::<64>(job),
                128 => $run::<128>(job),
                _ => $run::<0>(job),
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    if dispatch::use_avx2_fma() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time just above).
        unsafe { by_head_dim!(run_avx2) };
        return Ok(());
    }
    by_head_dim!(run_portable);
    Ok(())
}

/// The AVX2+FMA build: the driver and the kernel are inlined into this function, so they are
/// compiled with these target features.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2<const D: usize>(job: Job<'_, '_>) {
    row::run::<avx2::Avx2, D>(job)
}

/// The portable build, for the baseline target.
#[inline(never)]
fn run_portable<const D: usize>(job: Job<'_, '_>) {
    row::run::<Portable, D>(job)
}
