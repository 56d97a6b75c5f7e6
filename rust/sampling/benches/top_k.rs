//! `top_k_rows` on a decode step's logprobs, and `log_softmax_rows`, `logprob_top_k_rows` and
//! `greedy_logprob_top_k_rows` on its logits: 64 rows, k = 5, vocabularies of 512 (the tiny presets) and 32768. Each iteration takes the next of 16 different matrices: on one matrix
//! over and over the branch predictor learns the row and the figure is several times too
//! good.

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use hybrid_cache_sampling::{
    greedy_logprob_top_k_rows, log_softmax_rows, logprob_top_k_rows, top_k_rows, SamplingError,
    TopK,
};

/// `top_k_rows`, `logprob_top_k_rows` and `greedy_logprob_top_k_rows` (its chosen ids unused).
type TopKRows = fn(&[f32], usize, usize, &[i64], TopK<'_>) -> Result<Vec<usize>, SamplingError>;

fn rows(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
    (0..rows * cols)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            -((state >> 40) as f32) / 1e5
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    for cols in [512, 32768] {
        let matrices: Vec<Vec<f32>> = (0..16).map(|seed| rows(64, cols, seed)).collect();
        let mut next = 0;
        let chosen = vec![1i64; 64];
        let mut ids = vec![0i64; 64 * 6];
        let mut values = vec![0f32; 64 * 6];
        let mut ranks = vec![0i64; 64];
        let cases: [(&str, TopKRows); 3] = [
            ("top_5", top_k_rows),
            ("logprob_top_5", logprob_top_k_rows),
            ("greedy_logprob_top_5", |values, cols, k, _, out| {
                greedy_logprob_top_k_rows(values, cols, k, out)
            }),
        ];
        for (name, top_k) in cases {
            c.bench_function(&format!("{name}_of_64_rows_x_{cols}"), |b| {
                b.iter(|| {
                    next = (next + 1) % matrices.len();
                    let out = TopK {
                        ids: &mut ids,
                        values: &mut values,
                        ranks: &mut ranks,
                    };
                    top_k(black_box(&matrices[next]), cols, 5, &chosen, out).unwrap()
                })
            });
        }
        let mut logprobs = vec![0f32; 64 * cols];
        c.bench_function(&format!("log_softmax_of_64_rows_x_{cols}"), |b| {
            b.iter(|| {
                next = (next + 1) % matrices.len();
                log_softmax_rows(black_box(&matrices[next]), cols, &mut logprobs).unwrap()
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
