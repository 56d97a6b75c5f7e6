//! The two inner loops (dot product, scaled accumulate), written with 8 independent lanes so
//! LLVM vectorises them, and compiled twice on x86-64: for the baseline target and for AVX2,
//! chosen once at run time.

const LANES: usize = 8;

/// `sum(a[i] * b[i])`.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut lanes = [0.0f32; LANES];
    let mut a_chunks = a.chunks_exact(LANES);
    let mut b_chunks = b.chunks_exact(LANES);
    for (x, y) in (&mut a_chunks).zip(&mut b_chunks) {
        for lane in 0..LANES {
            lanes[lane] += x[lane] * y[lane];
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
pub fn axpy(acc: &mut [f32], weight: f32, x: &[f32]) {
    debug_assert_eq!(acc.len(), x.len());
    for (a, v) in acc.iter_mut().zip(x) {
        *a += weight * v;
    }
}

/// Whether the AVX2 build of the kernel can run on this CPU (checked once).
#[cfg(target_arch = "x86_64")]
pub fn has_avx2() -> bool {
    use std::sync::OnceLock;
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| std::is_x86_feature_detected!("avx2"))
}

#[cfg(not(target_arch = "x86_64"))]
pub fn has_avx2() -> bool {
    false
}
