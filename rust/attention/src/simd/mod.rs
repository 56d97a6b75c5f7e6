//! What the two builds of the inner loops share, with no knowledge of attention: the vector
//! width and the run-time choice of build (`dispatch.rs`), the scalar `exp` / `tanh` the
//! portable loops inline (`math.rs`), loops over slices in 8 lanes (`loops.rs`), and the same
//! `exp` / `tanh` on AVX2 registers (`avx2_math.rs`).

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2_math;
pub(crate) mod dispatch;
pub(crate) mod loops;
pub(crate) mod math;
