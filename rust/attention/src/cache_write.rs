//! Storing a step's new keys (or values) in the paged cache: row `t` of `new`
//! (`[tokens, num_kv_heads, head_dim]`, row-major) goes to slot `slots[t]`, i.e. token
//! `slot % block_size` of block `slot / block_size`. Every slot is checked before anything is
//! written, so a bad slot changes nothing.

use crate::error::{ensure, AttentionError};
use crate::layout::{HeadShape, PagedCacheMut};

/// Writes row `t` of `new` to slot `slots[t]` of `cache` for every `t`. Errors (and writes
/// nothing) when a length does not fit the shape, the strides reach past the buffer, or a slot
/// is negative or past the cache's last token.
pub fn write_cache(
    cache: PagedCacheMut<'_>,
    new: &[f32],
    slots: &[i64],
    num_kv_heads: usize,
    head_dim: usize,
) -> Result<(), AttentionError> {
    let shape = HeadShape {
        num_heads: num_kv_heads,
        num_kv_heads,
        head_dim,
    };
    shape.check()?;
    cache.with_data(&*cache.data).check("cache", &shape)?;
    let row_len = num_kv_heads * head_dim;
    ensure(new.len() == slots.len() * row_len, || {
        format!(
            "new must hold slots x num_kv_heads x head_dim = {} values, got {}",
            slots.len() * row_len,
            new.len()
        )
    })?;
    let capacity = cache.num_blocks * cache.block_size;
    if let Some(&bad) = slots
        .iter()
        .find(|&&slot| slot < 0 || slot as u64 >= capacity as u64)
    {
        return Err(AttentionError::InvalidBlock(format!(
            "slot {bad} is outside the cache's {capacity} slots ({} blocks of {} tokens)",
            cache.num_blocks, cache.block_size
        )));
    }
    for (&slot, row) in slots.iter().zip(new.chunks_exact(row_len)) {
        let slot = slot as usize;
        let token_start = cache.offset
            + (slot / cache.block_size) * cache.block_stride
            + (slot % cache.block_size) * cache.token_stride;
        for (head, values) in row.chunks_exact(head_dim).enumerate() {
            let start = token_start + head * cache.head_stride;
            // In bounds: the slot is below num_blocks * block_size and `check` bounded the last
            // element of the last (block, token, head).
            cache.data[start..start + head_dim].copy_from_slice(values);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A slot tensor [blocks, 2, block_size, heads, dim] with K at [:, 0]: the engine's layout.
    fn keys_view(
        data: &mut [f32],
        blocks: usize,
        block_size: usize,
        heads: usize,
        dim: usize,
    ) -> PagedCacheMut<'_> {
        PagedCacheMut {
            data,
            offset: 0,
            num_blocks: blocks,
            block_size,
            block_stride: 2 * block_size * heads * dim,
            token_stride: heads * dim,
            head_stride: dim,
        }
    }

    #[test]
    fn rows_land_at_their_slots_and_nothing_else_changes() {
        let (blocks, block_size, heads, dim) = (3, 4, 2, 3);
        let mut data = vec![-1.0f32; blocks * 2 * block_size * heads * dim];
        let slots = [5i64, 0, 11];
        let new: Vec<f32> = (0..slots.len() * heads * dim).map(|x| x as f32).collect();
        let cache = keys_view(&mut data, blocks, block_size, heads, dim);
        write_cache(cache, &new, &slots, heads, dim).unwrap();
        let mut expected = vec![-1.0f32; data.len()];
        for (t, &slot) in slots.iter().enumerate() {
            let (block, token) = (slot as usize / block_size, slot as usize % block_size);
            for h in 0..heads {
                for d in 0..dim {
                    let at =
                        block * 2 * block_size * heads * dim + token * heads * dim + h * dim + d;
                    expected[at] = new[(t * heads + h) * dim + d];
                }
            }
        }
        assert_eq!(data, expected);
    }

    #[test]
    fn a_bad_slot_or_length_writes_nothing() {
        let (blocks, block_size, heads, dim) = (2, 4, 1, 2);
        let mut data = vec![0.0f32; blocks * 2 * block_size * heads * dim];
        let new = vec![1.0f32; 2 * heads * dim];
        for slots in [[1i64, 8], [-1, 0]] {
            let error = write_cache(
                keys_view(&mut data, blocks, block_size, heads, dim),
                &new,
                &slots,
                heads,
                dim,
            )
            .unwrap_err();
            assert!(matches!(error, AttentionError::InvalidBlock(_)), "{error}");
            assert!(
                error.to_string().contains("outside the cache's 8 slots"),
                "{error}"
            );
        }
        let error = write_cache(
            keys_view(&mut data, blocks, block_size, heads, dim),
            &new[1..],
            &[0, 1],
            heads,
            dim,
        )
        .unwrap_err();
        assert!(
            matches!(error, AttentionError::InvalidArgument(_)),
            "{error}"
        );
        assert!(data.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn strides_past_the_buffer_are_refused() {
        let mut data = vec![0.0f32; 10];
        let cache = keys_view(&mut data, 2, 4, 1, 2);
        let error = write_cache(cache, &[1.0, 1.0], &[0], 1, 2).unwrap_err();
        assert!(
            error.to_string().contains("the strides reach element"),
            "{error}"
        );
    }
}
