//! The two builds of the inner loops: the AVX2+FMA one where the CPU has both, else the
//! portable one. Their vector width (`LANES`), and which build runs, chosen at run time once
//! per call.

use std::sync::atomic::{AtomicBool, Ordering};

/// Lanes of a vector of f32 with AVX2; the portable loops use the same width.
pub(crate) const LANES: usize = 8;

static PORTABLE_ONLY: AtomicBool = AtomicBool::new(false);

/// Runs the portable build even where AVX2+FMA is available (for tests and comparisons; the
/// setting is process-wide).
pub fn force_portable(on: bool) {
    PORTABLE_ONLY.store(on, Ordering::Relaxed);
}

/// Whether the AVX2+FMA build runs: the CPU has both (checked once) and `force_portable` is off.
pub fn use_avx2_fma() -> bool {
    !PORTABLE_ONLY.load(Ordering::Relaxed) && has_avx2_fma()
}

/// Whether the AVX2+FMA build of the kernel can run on this CPU (checked once).
#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    use std::sync::OnceLock;
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx2_fma() -> bool {
    false
}
