//! CPU paged attention for one query token per row, reading keys and values in place from a
//! paged KV cache through a block table (no gather copy). Pure Rust: no Python, no torch.
//!
//! The Python engine's CPU backend uses it for decode rows, where a batched torch version has
//! to copy every visible key and value of every request before two small matmuls; here each
//! row streams its keys and values once, in tiles of 16 tokens, with an online softmax per
//! query head (`row.rs` drives a row, `kernel.rs` / `avx2*.rs` compute a tile). Runs of
//! prefill rows (consecutive positions of one sequence) are computed together, every key of
//! their union range loaded once for all their query rows (`block.rs`).
//!
//! Semantics (same as the engine's reference backend): query token `t` of head `j` attends to
//! the positions `low[t] ..= position[t]` of its sequence, with kv head `j / (Hq / Hkv)`
//! (grouped-query attention); scores are `scale * q.k`, optionally soft-capped
//! (`cap * tanh(s / cap)`), and an optional per-head sink logit joins the softmax denominator
//! without a value.
//!
//! Also the fused element-wise ops of the CPU forward (`elementwise.rs`): RMSNorm of rows and
//! the gated MLP activations `silu(gate) * up` / `gelu_tanh(gate) * up`, and the rotary
//! position embedding (`rotary.rs`); and the store of a step's new keys and values into their
//! cache slots (`cache_write.rs`).

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_gated;
#[cfg(target_arch = "x86_64")]
mod avx2_loops;
#[cfg(target_arch = "x86_64")]
mod avx2_math;
mod block;
mod cache_write;
mod decode;
mod elementwise;
mod error;
mod gated;
mod kernel;
mod layout;
mod math;
mod norm;
mod portable;
mod rotary;
mod row;
mod simd;
mod softmax;

pub use cache_write::write_cache;
pub use decode::paged_attention;
pub use elementwise::{gelu_tanh_mul, rms_norm, silu_mul};
pub use error::AttentionError;
pub use layout::{AttentionParams, HeadShape, Paged, PagedCache, PagedCacheMut, QueryRows};
pub use rotary::rotate_neox;
pub use simd::{force_portable, use_avx2_fma};
