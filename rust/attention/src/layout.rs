//! The layout of a paged KV cache (a flat f32 buffer with block, token and head strides) and the
//! head shape, shared by the paged attention (which reads the cache) and the cache write (which
//! stores into it). Checked once, before any arithmetic.

use crate::error::{ensure, AttentionError};

/// Query, kv and head-dimension sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl HeadShape {
    /// Query heads per kv head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// Elements of one row of `q` or of the output.
    pub fn row_len(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub(crate) fn check(&self) -> Result<(), AttentionError> {
        ensure(self.num_kv_heads >= 1 && self.head_dim >= 1, || {
            format!("heads and head_dim must be at least 1, got {self:?}")
        })?;
        ensure(
            self.num_heads.is_multiple_of(self.num_kv_heads) && self.num_heads >= 1,
            || {
                format!(
                    "num_heads ({}) must be a positive multiple of num_kv_heads ({})",
                    self.num_heads, self.num_kv_heads
                )
            },
        )
    }
}

/// One layer's keys (or values) inside a flat f32 buffer `data`: element (block, token, head,
/// d) is at `offset + block * block_stride + token * token_stride + head * head_stride + d`.
/// Read through `PagedCache`, written through `PagedCacheMut` (`cache_write.rs`).
#[derive(Clone, Copy, Debug)]
pub struct Paged<D> {
    pub data: D,
    pub offset: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub block_stride: usize,
    pub token_stride: usize,
    pub head_stride: usize,
}

/// A paged cache the kernel reads.
pub type PagedCache<'a> = Paged<&'a [f32]>;

/// A paged cache written in place (new keys or values stored at their slots).
pub type PagedCacheMut<'a> = Paged<&'a mut [f32]>;

impl<D> Paged<D> {
    /// The same layout over other data (e.g. a read-only view of a writable cache).
    pub(crate) fn with_data<E>(&self, data: E) -> Paged<E> {
        Paged {
            data,
            offset: self.offset,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            block_stride: self.block_stride,
            token_stride: self.token_stride,
            head_stride: self.head_stride,
        }
    }
}

impl PagedCache<'_> {
    /// Element index of (block, token 0, head, 0); with `token * token_stride` added and
    /// `head_dim` elements on, in bounds once `check` passed.
    #[inline(always)]
    pub(crate) fn head_start(&self, block: usize, head: usize) -> usize {
        self.offset + block * self.block_stride + head * self.head_stride
    }

    pub(crate) fn check(&self, name: &str, shape: &HeadShape) -> Result<(), AttentionError> {
        ensure(self.num_blocks >= 1 && self.block_size >= 1, || {
            format!("{name}: num_blocks and block_size must be at least 1")
        })?;
        let last = self.offset
            + (self.num_blocks - 1) * self.block_stride
            + (self.block_size - 1) * self.token_stride
            + (shape.num_kv_heads - 1) * self.head_stride
            + shape.head_dim;
        ensure(last <= self.data.len(), || {
            format!(
                "{name}: the strides reach element {last} but the buffer holds {}; pass the \
                 cache's real offset and strides",
                self.data.len()
            )
        })
    }
}
