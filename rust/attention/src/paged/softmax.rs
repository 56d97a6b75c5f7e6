//! The online softmax of one query head, a tile of scores at a time: a running max and a
//! running sum of `exp(score - max)`; when a tile raises the max, what was accumulated so far
//! is scaled down by `exp(old max - new max)`. `finish` adds the sink and normalises.

use crate::paged::tile::TILE;
use crate::simd::dispatch::LANES;
use crate::simd::math;

/// `a.max(b)` for numbers: a plain compare, which is one instruction (`f32::max` also orders
/// NaNs, a compare and a blend more per lane).
#[inline(always)]
fn larger(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

/// Reduces 8 lanes pairwise (halves, quarters, eighths): three vector steps instead of a
/// chain of seven scalar ones.
#[inline(always)]
fn fold_tree(mut lanes: [f32; LANES], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for lane in 0..width {
            lanes[lane] = op(lanes[lane], lanes[lane + width]);
        }
        width /= 2;
    }
    lanes[0]
}

/// One query head's state. The sum is kept in 8 lanes (added up in `finish`), so a step adds
/// its weights lane-wise, with no horizontal sum per tile.
#[derive(Clone, Copy)]
pub(crate) struct Running {
    pub max: f32,
    pub sum: [f32; LANES],
}

impl Running {
    pub const EMPTY: Running = Running {
        max: f32::NEG_INFINITY,
        sum: [0.0; LANES],
    };

    /// Turns a tile's dot products into its softmax weights against the new running max,
    /// adds them to the running sum, and returns the factor the output accumulated so far
    /// must be multiplied by. `padding` is 0 for the tile's real lanes and -inf for the
    /// others, whose weights become 0.
    #[inline(always)]
    pub fn absorb(
        &mut self,
        scores: &mut [f32; TILE],
        padding: &[f32; TILE],
        scale: f32,
        softcap: Option<f32>,
    ) -> f32 {
        for score in scores.iter_mut() {
            *score *= scale;
        }
        if let Some(cap) = softcap {
            math::softcap(scores, cap);
        }
        // Fixed-width loops of 8 lanes over the halves of the tile, so that each is one vector
        // operation, and reductions as trees of vector operations.
        let mut lanes = [f32::NEG_INFINITY; LANES];
        for (chunk, pad) in scores
            .chunks_exact_mut(LANES)
            .zip(padding.chunks_exact(LANES))
        {
            for ((score, pad), lane) in chunk.iter_mut().zip(pad).zip(&mut lanes) {
                *score += pad;
                *lane = larger(*lane, *score);
            }
        }
        let max = larger(self.max, fold_tree(lanes, larger));
        // The first tile: exp_one(-inf) is a tiny positive number, and it multiplies zeros.
        let factor = if max > self.max {
            math::exp_one(self.max - max)
        } else {
            1.0
        };
        for sum in &mut self.sum {
            *sum *= factor;
        }
        for chunk in scores.chunks_exact_mut(LANES) {
            for (score, sum) in chunk.iter_mut().zip(&mut self.sum) {
                let weight = math::exp_one(*score - max);
                *score = if *score == f32::NEG_INFINITY {
                    0.0
                } else {
                    weight
                };
                *sum += *score;
            }
        }
        self.max = max;
        factor
    }

    /// Adds the sink logit (if any) to the denominator and divides the accumulated output.
    #[inline(always)]
    pub fn finish(self, acc: &mut [f32], sink: Option<f32>) {
        let (mut max, mut factor) = (self.max, 1.0f32);
        let mut sum = fold_tree(self.sum, |a, b| a + b);
        if let Some(sink) = sink {
            if sink > max {
                factor = (max - sink).exp();
                sum *= factor;
                max = sink;
            }
            sum += (sink - max).exp();
        }
        let scale = factor / sum;
        for value in acc {
            *value *= scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Absorbs `scores` tile by tile (the last one partial) and returns the state and the
    /// weights of every tile, each rescaled to the final max as the accumulator would be.
    fn absorb_all(scores: &[f32], scale: f32, softcap: Option<f32>) -> (Running, Vec<f64>) {
        let mut running = Running::EMPTY;
        let mut weights: Vec<f64> = Vec::new();
        for chunk in scores.chunks(TILE) {
            let mut tile = [0.0f32; TILE];
            tile[..chunk.len()].copy_from_slice(chunk);
            let mut padding = [f32::NEG_INFINITY; TILE];
            padding[..chunk.len()].fill(0.0);
            let factor = running.absorb(&mut tile, &padding, scale, softcap);
            assert!(
                tile[chunk.len()..].iter().all(|w| *w == 0.0),
                "padding weighs"
            );
            weights.iter_mut().for_each(|w| *w *= factor as f64);
            weights.extend(tile[..chunk.len()].iter().map(|w| *w as f64));
        }
        (running, weights)
    }

    #[test]
    fn tiles_add_up_to_the_softmax_of_the_whole_row() {
        // Scores that rise and fall, so the max grows over several tiles, then a short tile.
        let scores: Vec<f32> = (0..1003).map(|i| (i as f32 * 0.37).sin() * 30.0).collect();
        for softcap in [None, Some(20.0)] {
            let logit = |s: f32| {
                let s = s as f64 * 0.5;
                softcap.map_or(s, |cap| cap as f64 * (s / cap as f64).tanh())
            };
            let max = scores
                .iter()
                .map(|s| logit(*s))
                .fold(f64::NEG_INFINITY, f64::max);
            let (running, weights) = absorb_all(&scores, 0.5, softcap);
            // exp is within 4e-7 relative; tanh within 3e-7, which the cap multiplies.
            let tolerance = if softcap.is_some() { 1e-5 } else { 1e-6 };
            assert!(
                (running.max as f64 - max).abs() < 1e-5,
                "{} vs {max}",
                running.max
            );
            let sum = fold_tree(running.sum, |a, b| a + b) as f64;
            let expected: f64 = scores.iter().map(|s| (logit(*s) - max).exp()).sum();
            let error = (sum - expected).abs() / expected;
            assert!(error < tolerance, "{softcap:?}: {sum} vs {expected}");
            for (got, s) in weights.iter().zip(&scores) {
                let want = (logit(*s) - max).exp();
                let error = (got - want).abs() / want.max(1e-3);
                assert!(error < tolerance, "{softcap:?}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn finish_adds_the_sink_to_the_denominator() {
        let (running, _) = absorb_all(&[1.0, 2.0, 3.0], 1.0, None);
        let sum: f64 = [1.0f64, 2.0, 3.0].iter().map(|s| s.exp()).sum();
        for sink in [None, Some(0.5f32), Some(7.0)] {
            let mut acc = [(2.0f64.exp() / 3.0f64.exp()) as f32];
            running.finish(&mut acc, sink);
            let total = sum + sink.map_or(0.0, |s| (s as f64).exp());
            let want = 2.0f64.exp() / total;
            assert!(
                (acc[0] as f64 - want).abs() < 1e-6 * want,
                "{} vs {want}",
                acc[0]
            );
        }
    }
}
