//! CPU paged attention for one query token per row, reading keys and values in place from a
//! paged KV cache through a block table (no gather copy). Pure Rust: no Python, no torch.
//!
//! The Python engine's CPU backend uses it for decode rows, where a batched torch version has
//! to copy every visible key and value of every request before two small matmuls; here each
//! row streams its keys and values once, in tiles of 16 tokens, with an online softmax per
//! query head (`paged/row.rs` drives a row, `paged/kernel.rs` / `paged/avx2/` compute a tile).
//! Runs of prefill rows (consecutive positions of one sequence) are computed together, every
//! key of their union range loaded once for all their query rows (`paged/block.rs`).
//!
//! Semantics (same as the engine's reference backend): query token `t` of head `j` attends to
//! the positions `low[t] ..= position[t]` of its sequence, with kv head `j / (Hq / Hkv)`
//! (grouped-query attention); scores are `scale * q.k`, optionally soft-capped
//! (`cap * tanh(s / cap)`), and an optional per-head sink logit joins the softmax denominator
//! without a value.
//!
//! Also the fused element-wise ops of the CPU forward (`elementwise/`): RMSNorm of rows, the
//! gated MLP activations `silu(gate) * up` / `gelu_tanh(gate) * up`, and the rotary position
//! embedding; the store of a step's new keys and values into their cache slots
//! (`cache_write.rs`); and a decode step's block tables and new-token slots
//! (`step_tables.rs`).
//!
//! Layering: a module uses only modules on lines above its own; inside a folder, only files
//! listed before it (`;` separates levels, `,` files of one level). A folder's `mod.rs` is its
//! top: no file uses its own folder's `mod.rs`.
//!
//! 1. `error`: `AttentionError`, `ensure`.
//! 2. `simd`: shared SIMD pieces, nothing about attention: `dispatch` (`LANES`, build choice),
//!    `math` (scalar exp/tanh), `loops` (8-lane slice loops), `avx2_math` (exp/tanh on
//!    registers).
//! 3. `layout`: `HeadShape` and the paged cache layout (uses `error`).
//! 4. The three jobs, none of which uses another:
//!    - `paged` (uses 1-3): `query`, `tile`, `lanes`; `softmax`; `kernel`; `portable`,
//!      `avx2/` (`loops`, `softmax`, then `mod.rs`), `block`; `row`; `mod.rs`
//!      (`paged_attention`).
//!    - `elementwise` (uses 1-2): `gated`, `norm`, `rotary`; `avx2_gated`; `mod.rs`
//!      (`rms_norm`, `silu_mul`, `gelu_tanh_mul`).
//!    - `cache_write` (uses 1 and 3).
//!    - `step_tables` (uses 1): a decode step's block tables and slots from the grouped table.
//! 5. This file: the public re-exports.

mod cache_write;
mod elementwise;
mod error;
mod layout;
mod paged;
mod simd;
mod step_tables;

pub use cache_write::write_cache;
pub use elementwise::rotary::rotate_neox;
pub use elementwise::{gelu_tanh_mul, rms_norm, silu_mul};
pub use error::AttentionError;
pub use layout::{HeadShape, Paged, PagedCache, PagedCacheMut};
pub use paged::paged_attention;
pub use paged::query::{AttentionParams, QueryRows};
pub use simd::dispatch::{force_portable, use_avx2_fma};
pub use step_tables::{decode_inputs, decode_tables, DecodeInputs, DecodeTables};
