//! The two inner loops (dot product, scaled accumulate), written with 8 independent lanes so
//! LLVM vectorises them, and compiled twice on x86-64: for the baseline target and for AVX2 with
//! FMA, chosen once at run time. `FMA` picks fused multiply-adds (`mul_add`), which are one
//! instruction with the `fma` target feature and a slow library call without it, so only the
//! AVX2+FMA build sets it.

use std::sync::atomic::{AtomicBool, Ordering};

const LANES: usize = 8;

/// `acc + x * y`, fused when `FMA`.
#[inline(always)]
fn multiply_add<const FMA: bool>(x: f32, y: f32, acc: f32) -> f32 {
    if FMA {
        x.mul_add(y, acc)
    } else {
        acc + x * y
    }
}

/// `sum(a[i] * b[i])`.
#[inline(always)]
pub fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut lanes = [0.0f32; LANES];
    let mut a_chunks = a.chunks_exact(LANES);
    let mut b_chunks = b.chunks_exact(LANES);
    for (x, y) in (&mut a_chunks).zip(&mut b_chunks) {
        for lane in 0..LANES {
            lanes[lane] = multiply_add::<FMA>(x[lane], y[lane], lanes[lane]);
        }
    }
    let mut sum: f32 = lanes.iter().sum();
    for (x, y) in a_chunks.remainder().iter().zip(b_chunks.remainder()) {
        sum += x * y;
    }
    sum
}

/// `acc[i] += weight * x[i]`.
#[inline(always)]
pub fn axpy<const FMA: bool>(acc: &mut [f32], weight: f32, x: &[f32]) {
    debug_assert_eq!(acc.len(), x.len());
    for (a, v) in acc.iter_mut().zip(x) {
        *a = multiply_add::<FMA>(weight, *v, *a);
    }
}

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
