//! The kernel against a naive per-row implementation (f64, gathered keys), on random paged
//! layouts: shuffled blocks, strided K/V halves of one buffer, GQA, windows, softcap, sinks.
//! Every element that no row may read is NaN, so a stray read fails the comparison.

use hybrid_cache_attention::{
    paged_attention, AttentionError, AttentionParams, HeadShape, PagedCache, QueryRows,
};
use proptest::prelude::*;

struct Case {
    shape: HeadShape,
    block_size: usize,
    num_blocks: usize,
    /// [num_blocks, 2, block_size, Hkv, D]: K then V of each block (the engine's slot layout).
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

impl Case {
    fn cache(&self, half: usize) -> PagedCache<'_> {
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

    fn rows(&self) -> QueryRows<'_> {
        QueryRows {
            block_table: &self.table,
            table_width: self.width,
            sequence: &self.sequence,
            position: &self.position,
            low: &self.low,
        }
    }

    fn params(&self) -> AttentionParams<'_> {
        AttentionParams {
            scale: 0.3,
            softcap: self.softcap,
            sinks: self.sinks.as_deref(),
        }
    }

    fn run(&self) -> Result<Vec<f32>, AttentionError> {
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

    fn naive(&self) -> Vec<f32> {
        let HeadShape {
            num_heads,
            num_kv_heads,
            head_dim,
        } = self.shape;
        let group = num_heads / num_kv_heads;
        let (k, v) = (self.cache(0), self.cache(1));
        let mut out = Vec::new();
        for r in 0..self.sequence.len() {
            let s = self.sequence[r] as usize;
            for head in 0..num_heads {
                let kv = head / group;
                let query = &self.q[(r * num_heads + head) * head_dim..][..head_dim];
                let mut logits = Vec::new();
                let mut vals = Vec::new();
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
                    score *= 0.3;
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
                }
            }
        }
        out
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
fn build(
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
        let lowest = window.map_or(0, |w| len.saturating_sub(w));
        for column in 0..len.div_ceil(block_size) {
            // Blocks wholly before the window are released: the null block, as in the engine.
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
        // A decode row for the last token, and (when the window allows) an earlier one.
        for p in [len - 1, (len - 1) / 2] {
            let first = window.map_or(0, |w| (p + 1).saturating_sub(w));
            if first < lowest {
                continue;
            }
            sequence.push(s as i64);
            position.push(p as i64);
            low.push(first as i64);
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
    }
}

fn assert_close(got: &[f32], want: &[f32], seed: u64) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 + 1e-4 * w.abs(),
            "seed {seed}: element {i}: kernel {g}, naive {w}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn matches_the_naive_attention(
        seed in any::<u64>(),
        num_kv_heads in 1usize..4,
        group in prop::sample::select(vec![1usize, 2, 4, 8]),
        head_dim in prop::sample::select(vec![4usize, 8, 13, 32, 64]),
        block_size in prop::sample::select(vec![1usize, 4, 16]),
        window in prop::option::of(1usize..40),
        softcap in any::<bool>(),
        sinks in any::<bool>(),
    ) {
        let case = build(seed, num_kv_heads, group, head_dim, block_size, window, softcap, sinks);
        let got = case.run().unwrap();
        assert!(got.iter().all(|x| x.is_finite()), "seed {seed}: a NaN page was read");
        assert_close(&got, &case.naive(), seed);
    }
}

#[test]
fn a_row_over_the_null_block_is_refused_and_out_is_untouched() {
    let mut case = build(7, 2, 2, 8, 4, Some(5), false, false);
    // Widen a row's range to reach a released (null) block.
    let row = case
        .position
        .iter()
        .position(|&p| p >= 8)
        .expect("a row past two blocks");
    case.low[row] = 0;
    let mut out = vec![-2.0f32; case.q.len()];
    let error = paged_attention(
        &case.q,
        case.cache(0),
        case.cache(1),
        case.rows(),
        case.shape,
        case.params(),
        &mut out,
    )
    .unwrap_err();
    assert!(matches!(error, AttentionError::InvalidBlock(ref m) if m.contains("null block")));
    assert!(
        out.iter().all(|&x| x == -2.0),
        "a refused call wrote its output"
    );
}

#[test]
fn bad_arguments_are_typed_errors_that_say_what_to_change() {
    let case = build(11, 1, 4, 8, 4, None, false, false);
    let mut out = vec![0.0f32; case.q.len()];
    let run =
        |q: &[f32], rows: QueryRows, shape: HeadShape, params: AttentionParams, out: &mut [f32]| {
            paged_attention(q, case.cache(0), case.cache(1), rows, shape, params, out)
        };
    let message = |e: AttentionError| e.to_string();
    // q of the wrong length.
    let e = run(
        &case.q[1..],
        case.rows(),
        case.shape,
        case.params(),
        &mut out,
    )
    .unwrap_err();
    assert!(message(e).contains("rows x num_heads x head_dim"));
    // Heads that do not divide.
    let shape = HeadShape {
        num_heads: 3,
        num_kv_heads: 2,
        head_dim: 8,
    };
    let e = run(&case.q, case.rows(), shape, case.params(), &mut out).unwrap_err();
    assert!(message(e).contains("multiple of num_kv_heads"));
    // A sequence index outside the table.
    let sequence = vec![99i64; case.sequence.len()];
    let rows = QueryRows {
        sequence: &sequence,
        ..case.rows()
    };
    let e = run(&case.q, rows, case.shape, case.params(), &mut out).unwrap_err();
    assert!(message(e).contains("is not a block-table row"));
    // low > position.
    let low: Vec<i64> = case.position.iter().map(|p| p + 1).collect();
    let rows = QueryRows {
        low: &low,
        ..case.rows()
    };
    let e = run(&case.q, rows, case.shape, case.params(), &mut out).unwrap_err();
    assert!(message(e).contains("is empty or negative"));
    // Sinks of the wrong length, a non-positive softcap.
    let sinks = [0.0f32; 3];
    let params = AttentionParams {
        sinks: Some(&sinks),
        ..case.params()
    };
    let e = run(&case.q, case.rows(), case.shape, params, &mut out).unwrap_err();
    assert!(message(e).contains("one logit per query head"));
    let params = AttentionParams {
        softcap: Some(0.0),
        ..case.params()
    };
    let e = run(&case.q, case.rows(), case.shape, params, &mut out).unwrap_err();
    assert!(message(e).contains("softcap must be a positive"));
    // Strides that reach past the buffer.
    let mut keys = case.cache(0);
    keys.num_blocks += 1;
    let e = paged_attention(
        &case.q,
        keys,
        case.cache(1),
        case.rows(),
        case.shape,
        case.params(),
        &mut out,
    )
    .unwrap_err();
    assert!(message(e).contains("pass the cache's real offset and strides"));
}
