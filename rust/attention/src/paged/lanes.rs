//! The 8-lane vectors of f32 that runs of prefill rows (`block.rs`) are written over, one lane
//! per query row; each build of the kernel has its own (`Kernel::Lanes`).

use crate::simd::dispatch::LANES;

/// Eight f32 lanes, one per query row. The methods are `unsafe` because the AVX2 build's are
/// intrinsics: they may only run where the CPU has AVX2 and FMA (inside the target-feature
/// entry of `paged/mod.rs`, where they are inlined).
pub(crate) trait Lanes: Copy {
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(from: &[f32; LANES]) -> Self;
    unsafe fn store(self, to: &mut [f32; LANES]);
    /// `self * b + c` (fused where the build has FMA).
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
    unsafe fn mul(self, b: Self) -> Self;
    unsafe fn add(self, b: Self) -> Self;
    unsafe fn max(self, b: Self) -> Self;
    /// `simd::math::exp_one` per lane.
    unsafe fn exp(self) -> Self;
    /// `cap * tanh(x / cap)` per lane, as `simd::math::softcap`.
    unsafe fn softcap(self, cap: f32) -> Self;
    /// `self` where `score` is not -inf, else 0 (a select, so a NaN in `self` goes too).
    unsafe fn unless_masked(self, score: Self) -> Self;
    /// `exp(old - new)`, and exactly 1 where `old == new` (also where both are -inf: a query
    /// row that has seen only masked keys so far).
    unsafe fn rescale(old: Self, new: Self) -> Self;
}
