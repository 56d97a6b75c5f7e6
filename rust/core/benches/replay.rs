//! The allocator's phases on three scheduler traces, the way the engine calls the coordinator:
//! what `scripts/bench_vllm_replay.py` compares against vLLM's manager, here in Rust alone so the
//! figures reproduce without vLLM or Python.
//!
//! Pool of 131072 blocks of 16 tokens, one full-attention group and one sliding-window group
//! (window 4096), prefix caching on:
//! - T1: 256 requests of 2048 tokens (every other one starts with the same 1024 tokens), each
//!   admitted and prefilled whole, then 512 decode steps of all of them, then all freed;
//! - T2: 64 requests of 8192 unique tokens prefilled in 512-token chunks (all advance together),
//!   then 256 decode steps, then all freed;
//! - T3: T2's shape with 64 decode steps, in three waves of new prompts on one coordinator: from
//!   the third wave on every block allocated evicts a cached one (a server's steady state); the
//!   last wave is timed.
//!
//! Per phase (median of the rounds): lookup (adding the request, hashing its prompt and finding
//! its hit) per request, prefill allocation per call and per block, decode per request-step
//! (`allocate_batch` plus the step's `append_token_ids_batch`), free per request and per block.
//!
//! Run: `cargo bench -p hybrid-cache-core --bench replay [-- --rounds N --hash sha256|xxh3
//! --trace T1|T2|T3]`.

use std::time::Instant;

// The criterion bench uses the module's window too.
#[allow(dead_code)]
mod common;

use common::{gemma2_config, BLOCK_SIZE};

use hybrid_cache_core::{
    AllocateStep, BlockAllocator, Coordinator, CoordinatorConfig, ExtraKeys, HashAlgo, NewRequest,
};

const NUM_BLOCKS: usize = 131_072;
const VOCAB: u64 = 32_000;

#[derive(Clone, Copy)]
struct Trace {
    name: &'static str,
    num_reqs: usize,
    prompt_len: usize,
    shared_prefix_len: usize,
    /// Prefill chunk; `None`: the whole prompt in one step.
    chunk: Option<usize>,
    decode_steps: usize,
    /// Waves of new prompts on one coordinator; the last is timed.
    waves: usize,
}

const TRACES: [Trace; 3] = [
    Trace {
        name: "T1",
        num_reqs: 256,
        prompt_len: 2048,
        shared_prefix_len: 1024,
        chunk: None,
        decode_steps: 512,
        waves: 1,
    },
    Trace {
        name: "T2",
        num_reqs: 64,
        prompt_len: 8192,
        shared_prefix_len: 0,
        chunk: Some(512),
        decode_steps: 256,
        waves: 1,
    },
    Trace {
        name: "T3",
        num_reqs: 64,
        prompt_len: 8192,
        shared_prefix_len: 0,
        chunk: Some(512),
        decode_steps: 64,
        waves: 3,
    },
];

/// A small deterministic generator (splitmix64) for token ids.
struct Tokens(u64);

impl Tokens {
    fn next(&mut self) -> u32 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % VOCAB) as u32
    }
}

fn prompts(trace: &Trace, wave: usize) -> Vec<Vec<u32>> {
    let mut rng = Tokens(7 + 1000 * wave as u64);
    let shared: Vec<u32> = (0..trace.shared_prefix_len).map(|_| rng.next()).collect();
    (0..trace.num_reqs)
        .map(|index| {
            let mut prompt = if index % 2 == 0 {
                shared.clone()
            } else {
                Vec::new()
            };
            while prompt.len() < trace.prompt_len {
                prompt.push(rng.next());
            }
            prompt
        })
        .collect()
}

#[derive(Default, Clone, Copy)]
struct Phases {
    lookup: f64,
    prefill: f64,
    prefill_calls: usize,
    prefill_blocks: usize,
    decode: f64,
    decode_calls: usize,
    free: f64,
    free_blocks: usize,
    hit_tokens: usize,
}

fn run(trace: &Trace, hash: HashAlgo) -> Phases {
    let max_tokens = trace.decode_steps + 1;
    let config = CoordinatorConfig {
        max_num_batched_tokens: trace.chunk.unwrap_or(trace.prompt_len),
        hash,
        ..gemma2_config(
            NUM_BLOCKS,
            trace.num_reqs,
            trace.prompt_len + max_tokens + BLOCK_SIZE,
        )
    };
    let mut coordinator = Coordinator::new(config).unwrap();
    let mut phases = Phases::default();
    for wave in 0..trace.waves {
        phases = run_wave(trace, &mut coordinator, wave);
    }
    phases
}

/// One wave of the trace's requests (ids from `wave * num_reqs` on) on `coordinator`.
fn run_wave(trace: &Trace, coordinator: &mut Coordinator, wave: usize) -> Phases {
    let prompts = prompts(trace, wave);
    let max_tokens = trace.decode_steps + 1;
    let usable = NUM_BLOCKS - 1;
    let mut phases = Phases::default();
    let mut rng = Tokens(11);
    let base = (wave * trace.num_reqs) as u64;
    let ids: Vec<u64> = (base..base + trace.num_reqs as u64).collect();
    let mut computed = vec![0usize; trace.num_reqs];
    let chunk = trace.chunk.unwrap_or(trace.prompt_len);

    // Admission and the first chunk, one request at a time.
    for (index, prompt) in prompts.iter().enumerate() {
        let request_id = base + index as u64;
        let start = Instant::now();
        coordinator
            .add_request(NewRequest {
                request_id,
                prompt_token_ids: prompt,
                max_total_tokens: Some(prompt.len() + max_tokens - 1),
                extra: ExtraKeys::default(),
            })
            .unwrap();
        let hit = coordinator.find_cache_hit(request_id).unwrap();
        let looked_up = Instant::now();
        let new = chunk.min(prompt.len() - hit);
        let free_before = coordinator.pool().num_free_blocks();
        let step = AllocateStep {
            request_id,
            num_computed_tokens: hit,
            num_new_tokens: new,
        };
        assert!(coordinator.allocate(step).unwrap());
        let done = Instant::now();
        phases.lookup += (looked_up - start).as_secs_f64();
        phases.prefill += (done - looked_up).as_secs_f64();
        phases.prefill_calls += 1;
        phases.prefill_blocks += free_before - coordinator.pool().num_free_blocks();
        phases.hit_tokens += hit;
        computed[index] = hit + new;
        if computed[index] == prompt.len() {
            coordinator
                .append_token_ids(request_id, &[rng.next()])
                .unwrap();
        }
    }
    // Later chunks: every request still prefilling, one allocate_batch per step.
    let mut steps = Vec::with_capacity(trace.num_reqs);
    loop {
        steps.clear();
        for (index, prompt) in prompts.iter().enumerate() {
            if computed[index] < prompt.len() {
                steps.push(AllocateStep {
                    request_id: base + index as u64,
                    num_computed_tokens: computed[index],
                    num_new_tokens: chunk.min(prompt.len() - computed[index]),
                });
            }
        }
        if steps.is_empty() {
            break;
        }
        let free_before = coordinator.pool().num_free_blocks();
        let start = Instant::now();
        assert_eq!(coordinator.allocate_batch(&steps).unwrap(), steps.len());
        phases.prefill += start.elapsed().as_secs_f64();
        phases.prefill_calls += steps.len();
        phases.prefill_blocks += free_before - coordinator.pool().num_free_blocks();
        for step in &steps {
            let index = (step.request_id - base) as usize;
            computed[index] += step.num_new_tokens;
            if computed[index] == prompts[index].len() {
                coordinator
                    .append_token_ids(step.request_id, &[rng.next()])
                    .unwrap();
            }
        }
    }
    // Decode.
    let mut sampled = vec![0u32; trace.num_reqs];
    for _ in 0..trace.decode_steps {
        steps.clear();
        steps.extend(ids.iter().map(|&request_id| AllocateStep {
            request_id,
            num_computed_tokens: computed[(request_id - base) as usize],
            num_new_tokens: 1,
        }));
        for token in &mut sampled {
            *token = rng.next();
        }
        let start = Instant::now();
        assert_eq!(coordinator.allocate_batch(&steps).unwrap(), trace.num_reqs);
        coordinator.append_token_ids_batch(&ids, &sampled).unwrap();
        phases.decode += start.elapsed().as_secs_f64();
        phases.decode_calls += trace.num_reqs;
        for count in &mut computed {
            *count += 1;
        }
    }
    // Free.
    let used = usable - coordinator.pool().num_free_blocks();
    let start = Instant::now();
    for &request_id in &ids {
        coordinator.free_request(request_id).unwrap();
    }
    phases.free = start.elapsed().as_secs_f64();
    phases.free_blocks = used;
    assert_eq!(
        coordinator.pool().num_free_blocks(),
        usable,
        "a block leaked"
    );
    phases
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let option = |name: &str| {
        args.iter()
            .position(|arg| arg == name)
            .and_then(|at| args.get(at + 1).cloned())
    };
    let rounds: usize = option("--rounds").map_or(5, |value| value.parse().unwrap());
    let hashes = match option("--hash").as_deref() {
        Some("sha256") => vec![HashAlgo::Sha256],
        Some("xxh3") => vec![HashAlgo::Xxh3],
        _ => vec![HashAlgo::Sha256, HashAlgo::Xxh3],
    };
    println!(
        "{:<4} {:<6} {:>14} {:>14} {:>15} {:>16} {:>13} {:>15} {:>10}",
        "",
        "hash",
        "lookup us/req",
        "prefill us/call",
        "prefill ns/block",
        "decode ns/req-step",
        "free us/req",
        "free ns/block",
        "whole ms"
    );
    let only = option("--trace");
    for trace in TRACES
        .iter()
        .filter(|trace| only.as_deref().is_none_or(|name| name == trace.name))
    {
        for &hash in &hashes {
            let runs: Vec<Phases> = (0..rounds).map(|_| run(trace, hash)).collect();
            let first = runs[0];
            let per = |f: &dyn Fn(&Phases) -> f64| median(runs.iter().map(f).collect());
            let whole = per(&|p| p.lookup + p.prefill + p.decode + p.free) * 1e3;
            println!(
                "{:<4} {:<6} {:>14.2} {:>14.2} {:>15.1} {:>16.1} {:>13.2} {:>15.1} {:>10.2}",
                trace.name,
                format!("{hash:?}").to_lowercase(),
                per(&|p| p.lookup / trace.num_reqs as f64) * 1e6,
                per(&|p| p.prefill / p.prefill_calls as f64) * 1e6,
                per(&|p| p.prefill / p.prefill_blocks as f64) * 1e9,
                per(&|p| p.decode / p.decode_calls as f64) * 1e9,
                per(&|p| p.free / trace.num_reqs as f64) * 1e6,
                per(&|p| p.free / p.free_blocks as f64) * 1e9,
                whole,
            );
            assert!(runs.iter().all(|p| p.hit_tokens == first.hit_tokens));
        }
    }
    println!("(median of {rounds} rounds per figure)");
}
