//! CPU row operations for the sampler. Pure Rust: no Python, no torch.
//!
//! `top_k_rows`: the `k` largest values of each row of a `[rows, cols]` float32 matrix (the
//! logprobs of a step's sampled rows), most likely first, and each row's chosen token with its
//! value, in one pass over each row and a second over the few chunks of it that can hold the
//! top k. A row's top k is reported as *settled* only when the `k + 1` largest values are
//! strictly decreasing and the row holds no NaN: then its top k,
//! in order, is the only one there is (no tie decides membership or order), so any correct
//! top-k routine returns the same ids. Other rows are left to the caller (the engine asks
//! `torch.topk`, whose order among equal values is its own).
//!
//! Layering: `error`, then `top_k`, then this file's re-exports.

mod error;
mod top_k;

pub use error::SamplingError;
pub use top_k::{top_k_rows, TopK};
