//! Shared by the test files: random paged cases and a naive f64 implementation to compare
//! the kernel with.

#![allow(dead_code)] // each test file uses part of it

use hybrid_cache_attention::{
    paged_attention, AttentionError, AttentionParams, HeadShape, PagedCache, QueryRows,
};

pub struct Case {
    pub shape: HeadShape,
    pub block_size: usize,
    pub num_blocks: usize,
    /// [num_blocks, 2, block_size, Hkv, D]: K then V of each block (the engine's slot layout).
    pub data: Vec<f32>,
    pub table: Vec<i32>,
    pub width: usize,
    pub sequence: Vec<i64>,
    pub position: Vec<i64>,
    pub low: Vec<i64>,
    pub q: Vec<f32>,
    pub sinks: Option<Vec<f32>>,
    pub softcap: Option<f32>,
    pub scale: f32,
}

impl Case {
    pub fn cache(&self, half: usize) -> PagedCache<'_> {
        let token_stride = self.shape.num_kv_heads * self.shape.head_dim;
        PagedCache {
            data: &self.data,
            offset: half * self.block_size * token_stride,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
            block_stride: 2 * self.block_size * token_stride,
            token_stride,
            head_stride: self.shape.head_dim,
        }
    }

    pub fn rows(&self) -> QueryRows<'_> {
        QueryRows {
            block_table: &self.table,
            table_width: self.width,
            sequence: &self.sequence,
            position: &self.position,
            low: &self.low,
        }
    }

    pub fn params(&self) -> AttentionParams<'_> {
        AttentionParams {
            scale: self.scale,
            softcap: self.softcap,
            sinks: self.sinks.as_deref(),
        }
    }

    pub fn run(&self) -> Result<Vec<f32>, AttentionError> {
        let mut out = vec![f32::NAN; self.q.len()];
        paged_attention(
            &self.q,
            self.cache(0),
            self.cache(1),
            self.rows(),
            self.shape,
            self.params(),
            &mut out,
        )?;
        Ok(out)
    }

    /// Runs the case at `scale` and checks it against the naive attention: every output
    /// finite (no NaN page was read) and within the naive attention's error bound.
    pub fn check(&mut self, scale: f32, seed: u64) {
        self.scale = scale;
        let got = self.run().unwrap();
        assert!(
            got.iter().all(|x| x.is_finite()),
            "seed {seed}: a NaN page was read"
        );
        let (want, slack) = self.naive();
        assert_close(&got, &want, &slack, seed);
    }

    /// The attention in f64, and per element the rounding an f32 kernel may add on top of the
    /// relative tolerance: an f32 logit is off by about `EPSILON` times the sum of its terms'
    /// magnitudes (scaled), the softmax turns that into the same relative error in every
    /// weight, and the weights multiply values of magnitude at most 1.
    pub fn naive(&self) -> (Vec<f32>, Vec<f64>) {
        let HeadShape {
            num_heads,
            num_kv_heads,
            head_dim,
        } = self.shape;
        let group = num_heads / num_kv_heads;
        let (k, v) = (self.cache(0), self.cache(1));
        let mut out = Vec::new();
        let mut slack = Vec::new();
        for r in 0..self.sequence.len() {
            let s = self.sequence[r] as usize;
            for head in 0..num_heads {
                let kv = head / group;
                let query = &self.q[(r * num_heads + head) * head_dim..][..head_dim];
                let mut logits = Vec::new();
                let mut vals = Vec::new();
                let mut magnitude: f64 = 0.0;
                for p in self.low[r] as usize..=self.position[r] as usize {
                    let block = self.table[s * self.width + p / self.block_size] as usize;
                    let start = |c: &PagedCache| {
                        c.offset
                            + block * c.block_stride
                            + (p % self.block_size) * c.token_stride
                            + kv * c.head_stride
                    };
                    let key = &self.data[start(&k)..][..head_dim];
                    let mut score: f64 = query
                        .iter()
                        .zip(key)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    let terms: f64 = query
                        .iter()
                        .zip(key)
                        .map(|(a, b)| (*a as f64 * *b as f64).abs())
                        .sum();
                    magnitude = magnitude.max(terms * self.scale as f64);
                    score *= self.scale as f64;
                    if let Some(cap) = self.softcap {
                        score = cap as f64 * (score / cap as f64).tanh();
                    }
                    logits.push(score);
                    vals.push(&self.data[start(&v)..][..head_dim]);
                }
                let sink = self.sinks.as_ref().map(|s| s[head] as f64);
                let max = logits
                    .iter()
                    .copied()
                    .chain(sink)
                    .fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                let total: f64 =
                    weights.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
                for d in 0..head_dim {
                    let acc: f64 = weights
                        .iter()
                        .zip(&vals)
                        .map(|(w, v)| w * v[d] as f64)
                        .sum();
                    out.push((acc / total) as f32);
                    slack.push(f32::EPSILON as f64 * magnitude);
                }
            }
        }
        (out, slack)
    }
}

/// A deterministic pseudo-random stream (no extra dependency).
struct Stream(u64);

impl Stream {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn float(&mut self) -> f32 {
        (self.next() % 20001) as f32 / 10000.0 - 1.0
    }
}

#[allow(clippy::too_many_arguments)]
pub fn build(
    seed: u64,
    num_kv_heads: usize,
    group: usize,
    head_dim: usize,
    block_size: usize,
    window: Option<usize>,
    softcap: bool,
    sinks: bool,
) -> Case {
    let mut rng = Stream(seed | 1);
    let shape = HeadShape {
        num_heads: num_kv_heads * group,
        num_kv_heads,
        head_dim,
    };
    let num_seqs = 1 + rng.below(5);
    let lens: Vec<usize> = (0..num_seqs).map(|_| 1 + rng.below(70)).collect();
    let width = lens.iter().map(|n| n.div_ceil(block_size)).max().unwrap() + 1;
    let num_blocks = 1 + num_seqs * width;
    let mut ids: Vec<i32> = (1..num_blocks as i32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.below(i + 1));
    }
    let mut table = vec![0i32; num_seqs * width];
    let token_stride = num_kv_heads * head_dim;
    let mut data = vec![f32::NAN; num_blocks * 2 * block_size * token_stride];
    let (mut sequence, mut position, mut low) = (Vec::new(), Vec::new(), Vec::new());
    for (s, &len) in lens.iter().enumerate() {
        // The rows of this sequence: a decode row for the last token, sometimes an earlier
        // one, and sometimes a prefill chunk (consecutive positions, as the engine sends
        // them; runs of these are computed together, across block boundaries).
        let mut positions = vec![len - 1];
        if rng.below(2) == 0 {
            positions.push((len - 1) / 2);
        }
        if rng.below(3) != 0 {
            let start = rng.below(len);
            let tokens = 1 + rng.below((len - start).min(40));
            // Before or after the decode rows.
            let chunk = start..start + tokens;
            if rng.below(2) == 0 {
                positions.splice(0..0, chunk);
            } else {
                positions.extend(chunk);
            }
        }
        let first = |p: usize| window.map_or(0, |w| (p + 1).saturating_sub(w));
        let lowest = positions.iter().map(|&p| first(p)).min().unwrap();
        for column in 0..len.div_ceil(block_size) {
            // Blocks wholly before every row's window are released: the null block, as in the
            // engine.
            if (column + 1) * block_size <= lowest {
                continue;
            }
            let block = ids.pop().unwrap() as usize;
            table[s * width + column] = block as i32;
            for t in 0..block_size {
                if column * block_size + t >= len {
                    break; // the unwritten tail stays NaN
                }
                for half in 0..2 {
                    let start = ((block * 2 + half) * block_size + t) * token_stride;
                    for x in &mut data[start..start + token_stride] {
                        *x = rng.float();
                    }
                }
            }
        }
        for p in positions {
            sequence.push(s as i64);
            position.push(p as i64);
            low.push(first(p) as i64);
        }
    }
    let q = (0..sequence.len() * shape.row_len())
        .map(|_| rng.float())
        .collect();
    Case {
        shape,
        block_size,
        num_blocks,
        data,
        table,
        width,
        sequence,
        position,
        low,
        q,
        sinks: sinks.then(|| (0..shape.num_heads).map(|_| rng.float() * 3.0).collect()),
        softcap: softcap.then_some(0.8),
        scale: 0.3,
    }
}

/// `got` within `1e-5 + 1e-4 |want|` of `want`, plus each element's rounding `slack`.
pub fn assert_close(got: &[f32], want: &[f32], slack: &[f64], seed: u64) {
    assert_eq!(got.len(), want.len());
    for (i, ((g, w), s)) in got.iter().zip(want).zip(slack).enumerate() {
        assert!(
            ((g - w).abs() as f64) <= 1e-5 + 1e-4 * w.abs() as f64 + s,
            "seed {seed}: element {i}: kernel {g}, naive {w}"
        );
    }
}

/// Every specialised head_dim (and two that are not), group sizes 1 to 8, one and two kv
/// heads, with and without softcap and sinks, full rows and window rows (some shorter than a
/// block), small and large logits: the build the process runs against the naive one.
pub fn sweep() {
    let mut seed = 1;
    for head_dim in [16, 32, 64, 128, 8, 13] {
        for group in [1, 2, 4, 8] {
            for num_kv_heads in [1, 2] {
                for (softcap, sinks) in [(false, false), (true, false), (false, true), (true, true)]
                {
                    for window in [None, Some(16), Some(5), Some(27)] {
                        seed += 1;
                        let mut case = build(
                            seed,
                            num_kv_heads,
                            group,
                            head_dim,
                            16,
                            window,
                            softcap,
                            sinks,
                        );
                        for scale in [0.3, 3.0] {
                            case.check(scale, seed);
                        }
                    }
                }
            }
        }
    }
}

pub mod elementwise;
