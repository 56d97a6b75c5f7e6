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
//!
//! `log_softmax_rows`: the log-softmax of each row, torch's formula with a vectorised
//! exponential, within a few ulp of torch's values. `logprob_top_k_rows`: `top_k_rows` of that
//! log-softmax from the logits, writing only the k + 1 values it reports;
//! `greedy_logprob_top_k_rows` the same with each row's greedy pick as its chosen token.
//!
//! Layering: `error`, then `log_softmax`, then `top_k` (its scan shifts values by a row's
//! log-softmax), then `logprobs`, then this file's re-exports.

mod error;
mod log_softmax;
mod logprobs;
mod top_k;

pub use error::SamplingError;
pub use log_softmax::log_softmax_rows;
pub use logprobs::{greedy_logprob_top_k_rows, logprob_top_k_rows};
pub use top_k::{top_k_rows, TopK};
