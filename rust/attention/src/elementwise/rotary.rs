//! Neox-style rotary position embedding on the CPU: in each head, the first `rotary_dim` values
//! are two halves `(x1, x2)` rotated by each token's angles,
//! `(x1 cos - x2 sin, x2 cos + x1 sin)`, and the rest are copied. One pass over the data
//! instead of five torch ops; the products and sums are the same f32 operations in the same
//! order as the torch form (no fused multiply-add), so the results are identical.

use crate::error::{ensure, AttentionError};

/// Rotates `x` [tokens, heads, head_dim] (row-major) into `out` (same shape) with `cos` and
/// `sin` [tokens, rotary_dim / 2] (one row of angles per token, shared by every head). Checks
/// every length first and changes nothing when one is wrong.
pub fn rotate_neox(
    x: &[f32],
    heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    cos: &[f32],
    sin: &[f32],
    out: &mut [f32],
) -> Result<(), AttentionError> {
    ensure(heads > 0 && head_dim > 0, || {
        format!("heads and head_dim must be positive, got {heads} and {head_dim}")
    })?;
    ensure(
        rotary_dim > 0 && rotary_dim.is_multiple_of(2) && rotary_dim <= head_dim,
        || format!("rotary_dim must be even and in 2..={head_dim}, got {rotary_dim}"),
    )?;
    let token_len = heads * head_dim;
    ensure(
        x.len().is_multiple_of(token_len) && x.len() == out.len(),
        || {
            format!(
                "x and out must hold tokens x {heads} x {head_dim} values, got {} and {}",
                x.len(),
                out.len()
            )
        },
    )?;
    let tokens = x.len() / token_len;
    let half = rotary_dim / 2;
    ensure(cos.len() == tokens * half && sin.len() == cos.len(), || {
        format!(
            "cos and sin must hold tokens x rotary_dim / 2 = {tokens} x {half} values, got {} and {}",
            cos.len(),
            sin.len()
        )
    })?;
    for (token, (x_token, out_token)) in x
        .chunks_exact(token_len)
        .zip(out.chunks_exact_mut(token_len))
        .enumerate()
    {
        let cos = &cos[token * half..][..half];
        let sin = &sin[token * half..][..half];
        for (head, out_head) in x_token
            .chunks_exact(head_dim)
            .zip(out_token.chunks_exact_mut(head_dim))
        {
            rotate_head(head, half, cos, sin, out_head);
        }
    }
    Ok(())
}

fn rotate_head(x: &[f32], half: usize, cos: &[f32], sin: &[f32], out: &mut [f32]) {
    let (x1, rest) = x.split_at(half);
    let (x2, tail) = rest.split_at(half);
    let (out1, rest) = out.split_at_mut(half);
    let (out2, out_tail) = rest.split_at_mut(half);
    for i in 0..half {
        let (a, b) = (x1[i], x2[i]);
        out1[i] = a * cos[i] - b * sin[i];
        out2[i] = b * cos[i] + a * sin[i];
    }
    out_tail.copy_from_slice(tail);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_the_rotary_dims_and_copies_the_rest() {
        // 2 tokens, 1 head of 6 dims, rotary_dim 4 (half 2).
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, -1.0, 0.5, 2.0, -3.0, 7.0, 8.0];
        let cos = [0.5, 1.0, 0.0, -1.0];
        let sin = [0.25, 0.0, 1.0, 0.5];
        let mut out = [0.0; 12];
        rotate_neox(&x, 1, 6, 4, &cos, &sin, &mut out).unwrap();
        // (a, b) at (i, i + 2) -> (a cos - b sin, b cos + a sin), dims 4 and 5 copied.
        let rotate = |a: f32, b: f32, c: f32, s: f32| (a * c - b * s, b * c + a * s);
        let mut expected = x;
        for token in 0..2 {
            for i in 0..2 {
                let (a, b) = (x[token * 6 + i], x[token * 6 + i + 2]);
                let (c, s) = (cos[token * 2 + i], sin[token * 2 + i]);
                (expected[token * 6 + i], expected[token * 6 + i + 2]) = rotate(a, b, c, s);
            }
        }
        assert_eq!(expected[1], 2.0); // cos 1, sin 0: unchanged
        assert_eq!(expected[6], -2.0); // cos 0, sin 1: -x2
        assert_eq!(out, expected);
    }

    #[test]
    fn bad_lengths_are_refused_and_nothing_is_written() {
        let x = [1.0; 8];
        let mut out = [9.0; 8];
        let table = [0.5; 2];
        for (heads, head_dim, rotary_dim, cos_len) in [
            (1, 4, 3, 2),
            (1, 4, 6, 2),
            (3, 4, 4, 2),
            (1, 4, 4, 3),
            (0, 4, 4, 2),
        ] {
            let cos = &table[..cos_len.min(2)];
            let result = rotate_neox(&x, heads, head_dim, rotary_dim, cos, &table, &mut out);
            assert!(result.is_err(), "{heads} {head_dim} {rotary_dim} {cos_len}");
        }
        assert_eq!(out, [9.0; 8]);
    }
}
