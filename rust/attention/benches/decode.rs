//! Decode-kernel benchmarks on the shapes the CPU engine runs, in the engine's cache layout (one
//! slot buffer [num_blocks, 2, block_size, Hkv, D], K and V strided views of it) with the
//! blocks shuffled, as a paged cache is after some traffic. One row per sequence.
//!
//! - `gemma3_full`: 64 rows x 600 keys, 1 kv head x 4 query heads, D=32 (the full layer).
//! - `gemma3_window`: 64 rows x 16 keys (a sliding-window layer), same heads.
//! - `gemma2_softcap`: 64 rows x 600 keys, 2 x 2 heads, D=16, softcap 50.
//! - `gqa_8x4_d32`, `gqa_8x4_d128`: 16 rows x 2048 keys, 8 x 4 heads, D=32 and D=128 (7B-like).
//! - `sinks_8x4_d64`: 16 rows x 1024 keys, 8 x 4 heads, D=64, with sinks (gpt-oss-like).
//!
//! Prefill (one row per prompt token, the rows of a prompt consecutive, as the engine sends a
//! prefill chunk):
//!
//! - `prefill/gemma3_full`: 4 prompts x 512 tokens, 1 kv head x 4 query heads, D=32.
//! - `prefill/gemma3_window`: the same with a 16-token sliding window.
//! - `prefill/gqa_8x2_d64`: 4 prompts x 512 tokens, 2 kv heads x 4 query heads, D=64.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use hybrid_cache_attention::{paged_attention, AttentionParams, HeadShape, PagedCache, QueryRows};

const BLOCK_SIZE: usize = 16;

struct Bench {
    shape: HeadShape,
    num_blocks: usize,
    data: Vec<f32>,
    table: Vec<i32>,
    width: usize,
    sequence: Vec<i64>,
    position: Vec<i64>,
    low: Vec<i64>,
    q: Vec<f32>,
    sinks: Option<Vec<f32>>,
    softcap: Option<f32>,
}

/// A small xorshift stream: deterministic inputs without another dependency.
struct Stream(u64);

impl Stream {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn float(&mut self) -> f32 {
        (self.next() % 20001) as f32 / 10000.0 - 1.0
    }
}

impl Bench {
    /// `rows` sequences of `context` tokens each; every row is its sequence's last token and
    /// sees the last `window` tokens (all of them when `None`).
    fn new(rows: usize, context: usize, window: Option<usize>, shape: HeadShape) -> Self {
        let mut rng = Stream(0x9e37_79b9_7f4a_7c15);
        let width = context.div_ceil(BLOCK_SIZE);
        let num_blocks = 1 + rows * width;
        let mut ids: Vec<i32> = (1..num_blocks as i32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        let size = num_blocks * 2 * BLOCK_SIZE * shape.num_kv_heads * shape.head_dim;
        let data = (0..size).map(|_| rng.float()).collect();
        let position = vec![context as i64 - 1; rows];
        let low = vec![window.map_or(0, |w| context.saturating_sub(w)) as i64; rows];
        let q = (0..rows * shape.row_len()).map(|_| rng.float()).collect();
        Bench {
            shape,
            num_blocks,
            data,
            table: ids,
            width,
            sequence: (0..rows as i64).collect(),
            position,
            low,
            q,
            sinks: None,
            softcap: None,
        }
    }

    /// `prompts` sequences of `len` tokens, one row per token (the rows of a prompt in
    /// order); each row sees its last `window` tokens (all of them when `None`).
    fn prefill(prompts: usize, len: usize, window: Option<usize>, shape: HeadShape) -> Self {
        let mut bench = Bench::new(prompts, len, window, shape);
        bench.sequence = (0..prompts as i64)
            .flat_map(|s| (0..len).map(move |_| s))
            .collect();
        bench.position = (0..prompts).flat_map(|_| 0..len as i64).collect();
        bench.low = bench
            .position
            .iter()
            .map(|&p| window.map_or(0, |w| (p + 1 - w as i64).max(0)))
            .collect();
        let mut rng = Stream(0x2545_f491_4f6c_dd1d);
        bench.q = (0..bench.sequence.len() * shape.row_len())
            .map(|_| rng.float())
            .collect();
        bench
    }

    fn cache(&self, half: usize) -> PagedCache<'_> {
        let token_stride = self.shape.num_kv_heads * self.shape.head_dim;
        PagedCache {
            data: &self.data,
            offset: half * BLOCK_SIZE * token_stride,
            num_blocks: self.num_blocks,
            block_size: BLOCK_SIZE,
            block_stride: 2 * BLOCK_SIZE * token_stride,
            token_stride,
            head_stride: self.shape.head_dim,
        }
    }

    fn run(&self, out: &mut [f32]) {
        let rows = QueryRows {
            block_table: &self.table,
            table_width: self.width,
            sequence: &self.sequence,
            position: &self.position,
            low: &self.low,
        };
        let params = AttentionParams {
            scale: 0.17,
            softcap: self.softcap,
            sinks: self.sinks.as_deref(),
        };
        paged_attention(
            black_box(&self.q),
            self.cache(0),
            self.cache(1),
            rows,
            self.shape,
            params,
            out,
        )
        .unwrap();
    }

    /// (key, query head) pairs per call.
    fn pairs(&self) -> u64 {
        let keys: i64 = self
            .position
            .iter()
            .zip(&self.low)
            .map(|(p, l)| p - l + 1)
            .sum();
        keys as u64 * self.shape.num_heads as u64
    }
}

fn shape(num_kv_heads: usize, group: usize, head_dim: usize) -> HeadShape {
    HeadShape {
        num_heads: num_kv_heads * group,
        num_kv_heads,
        head_dim,
    }
}

fn decode(c: &mut Criterion) {
    let mut gemma2 = Bench::new(64, 600, None, shape(2, 2, 16));
    gemma2.softcap = Some(50.0);
    let mut sinks = Bench::new(16, 1024, None, shape(8, 4, 64));
    let mut rng = Stream(7);
    sinks.sinks = Some((0..32).map(|_| rng.float() * 3.0).collect());
    let cases = [
        ("gemma3_full", Bench::new(64, 600, None, shape(1, 4, 32))),
        (
            "gemma3_window",
            Bench::new(64, 600, Some(16), shape(1, 4, 32)),
        ),
        ("gemma2_softcap", gemma2),
        ("gqa_8x4_d32", Bench::new(16, 2048, None, shape(8, 4, 32))),
        ("gqa_8x4_d128", Bench::new(16, 2048, None, shape(8, 4, 128))),
        ("sinks_8x4_d64", sinks),
    ];
    let mut group = c.benchmark_group("decode");
    for (name, bench) in &cases {
        let mut out = vec![0.0f32; bench.q.len()];
        // Elements = (key, query head) pairs, so the report's rate is pairs per second.
        group.throughput(Throughput::Elements(bench.pairs()));
        group.bench_function(*name, |b| b.iter(|| bench.run(black_box(&mut out))));
    }
    group.finish();
}

fn prefill(c: &mut Criterion) {
    let cases = [
        ("gemma3_full", Bench::prefill(4, 512, None, shape(1, 4, 32))),
        (
            "gemma3_window",
            Bench::prefill(4, 512, Some(16), shape(1, 4, 32)),
        ),
        ("gqa_8x2_d64", Bench::prefill(4, 512, None, shape(2, 4, 64))),
    ];
    let mut group = c.benchmark_group("prefill");
    group.sample_size(20);
    for (name, bench) in &cases {
        let mut out = vec![0.0f32; bench.q.len()];
        group.throughput(Throughput::Elements(bench.pairs()));
        group.bench_function(*name, |b| b.iter(|| bench.run(black_box(&mut out))));
    }
    group.finish();
}

criterion_group!(benches, decode, prefill);
criterion_main!(benches);
