//! Property test: random add / hit / allocate / append / free / abort sequences over up to three
//! groups (full, sliding window, chunked local; different block sizes, full attention keyed by
//! sub-blocks where its blocks are a multiple of the smallest) against a reference
//! model of what each request's table must look like, checking after every operation:
//! - every block's ref count equals the number of table entries naming it (nothing lost, nothing
//!   handed out twice), and a block belongs to one group only;
//! - the free count equals the blocks nobody references;
//! - each row has the expected length, null entries exactly where the window/chunk released
//!   them, and the persistent table mirrors it; unused rows are empty;
//! - a refused allocation changes nothing; everything is free once every request is freed;
//! - a cache hit only hands out blocks that were filled with the same prefix of tokens (a block
//!   the hit ends inside: at least up to the hit).

use std::collections::HashMap;

use hybrid_cache_core::coordinator::RowRef;
use hybrid_cache_core::{
    AllocateStep, AttentionKind, BlockAllocator, Coordinator, CoordinatorConfig, ExtraKeys,
    GroupSpec, HashAlgo, NewRequest, NULL_BLOCK,
};
use proptest::prelude::*;

const MAX_MODEL_LEN: usize = 64;
const MAX_BATCHED: usize = 12;
const MAX_REQUESTS: usize = 4;

#[derive(Clone, Debug)]
enum Op {
    /// Add request `slot` with a prompt: `shared` tokens of the common prefix, then `own`
    /// tokens of its own.
    Add {
        slot: u64,
        shared: usize,
        own: usize,
    },
    Hit {
        slot: u64,
    },
    Allocate {
        slot: u64,
        new: usize,
    },
    Batch {
        slots: Vec<u64>,
        new: usize,
    },
    Append {
        slot: u64,
        count: usize,
    },
    Free {
        slot: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let slot = 0..6u64;
    prop_oneof![
        2 => (slot.clone(), 0..24usize, 1..8usize)
            .prop_map(|(slot, shared, own)| Op::Add { slot, shared, own }),
        2 => slot.clone().prop_map(|slot| Op::Hit { slot }),
        3 => (slot.clone(), 1..=MAX_BATCHED).prop_map(|(slot, new)| Op::Allocate { slot, new }),
        2 => (prop::collection::vec(slot.clone(), 1..4), 1..4usize)
            .prop_map(|(slots, new)| Op::Batch { slots, new }),
        1 => (slot.clone(), 1..4usize).prop_map(|(slot, count)| Op::Append { slot, count }),
        1 => slot.prop_map(|slot| Op::Free { slot }),
    ]
}

fn groups(variant: usize) -> Vec<GroupSpec> {
    let full = |block_size| GroupSpec {
        kind: AttentionKind::Full,
        block_size,
    };
    let window = |block_size, window| GroupSpec {
        kind: AttentionKind::SlidingWindow { window },
        block_size,
    };
    let chunked = |block_size, chunk| GroupSpec {
        kind: AttentionKind::ChunkedLocal { chunk },
        block_size,
    };
    match variant {
        0 => vec![full(2), window(4, 6), chunked(2, 4)],
        1 => vec![full(4), window(2, 3)],
        2 => vec![window(2, 5), full(6), chunked(4, 8)],
        _ => vec![full(6), window(2, 5)],
    }
}

/// What the model knows of one request.
#[derive(Clone, Debug, Default)]
struct ModelRequest {
    tokens: Vec<u32>,
    num_tokens: usize,
    num_computed: usize,
    num_allocated: usize,
    pending_hit: usize,
}

struct Harness {
    coordinator: Coordinator,
    model: HashMap<u64, ModelRequest>,
    specs: Vec<GroupSpec>,
    alignment: usize,
    /// The token prefix (up to and including the block) each full block was last filled with.
    block_prefix: HashMap<u32, Vec<u32>>,
    /// Per request, the copy sources its hit holds until its next successful allocate.
    copy_sources: HashMap<u64, Vec<u32>>,
}

fn skipped(kind: AttentionKind, computed: usize) -> usize {
    match kind {
        AttentionKind::Full => 0,
        AttentionKind::SlidingWindow { window } => (computed + 1).saturating_sub(window),
        AttentionKind::ChunkedLocal { chunk } => computed / chunk * chunk,
    }
}

impl Harness {
    fn new(variant: usize, num_blocks: usize) -> Self {
        let specs = groups(variant);
        let config = CoordinatorConfig {
            num_blocks,
            groups: specs.clone(),
            max_num_reqs: MAX_REQUESTS,
            max_model_len: MAX_MODEL_LEN,
            max_num_batched_tokens: MAX_BATCHED,
            enable_prefix_caching: true,
            hash: HashAlgo::Xxh3,
            hash_seed: 7,
        };
        let alignment = config.hit_alignment().unwrap();
        Harness {
            coordinator: Coordinator::new(config).unwrap(),
            model: HashMap::new(),
            specs,
            alignment,
            block_prefix: HashMap::new(),
            copy_sources: HashMap::new(),
        }
    }

    /// The computed count the next allocate of `slot` uses, appending a token when every known
    /// token already has a slot (a decode step).
    fn next_computed(&mut self, slot: u64) -> Option<usize> {
        let request = self.model.get(&slot)?.clone();
        if request.num_allocated == 0 {
            return Some(request.pending_hit);
        }
        if request.num_allocated >= request.num_tokens {
            if request.num_tokens >= MAX_MODEL_LEN {
                return None;
            }
            self.coordinator.append_token_ids(slot, &[9]).unwrap();
            let request = self.model.get_mut(&slot).unwrap();
            request.num_tokens += 1;
            request.tokens.push(9);
        }
        Some(request.num_allocated)
    }

    fn step_for(&mut self, slot: u64, new: usize) -> Option<AllocateStep> {
        let computed = self.next_computed(slot)?;
        let room = MAX_MODEL_LEN - computed;
        let known_beyond = self.model[&slot].num_tokens - computed;
        let new = new.min(known_beyond.max(1)).min(room);
        (new > 0).then_some(AllocateStep {
            request_id: slot,
            num_computed_tokens: computed,
            num_new_tokens: new,
        })
    }

    fn applied(&mut self, step: AllocateStep) {
        let request = &self.model[&step.request_id];
        let total = step.num_computed_tokens + step.num_new_tokens;
        for (group, spec) in self.specs.iter().enumerate() {
            let blocks = self
                .coordinator
                .request_blocks(step.request_id, group)
                .unwrap();
            let known = total.min(request.tokens.len());
            let hit = request.pending_hit;
            for (index, &block) in blocks.iter().enumerate() {
                let start = index * spec.block_size;
                if block == NULL_BLOCK || start >= known {
                    continue;
                }
                let end = known.min(start + spec.block_size);
                let prefix = request.tokens[..end].to_vec();
                if request.num_allocated == 0 && hit > start {
                    // Blocks of a hit must hold exactly this prefix; a block the hit ends
                    // inside (taken from a freed request's tail) at least up to the hit.
                    let filled = self.block_prefix.get(&block);
                    if hit >= start + spec.block_size {
                        assert_eq!(
                            filled,
                            Some(&prefix),
                            "hit block {block} holds other tokens"
                        );
                    } else {
                        let filled = filled.expect("a taken block was filled before");
                        assert!(
                            filled.len() >= hit && filled[..hit] == request.tokens[..hit],
                            "taken block {block} holds other tokens"
                        );
                    }
                }
                self.block_prefix.insert(block, prefix);
            }
        }
        let request = self.model.get_mut(&step.request_id).unwrap();
        request.num_computed = step.num_computed_tokens;
        let total = step.num_computed_tokens + step.num_new_tokens;
        request.num_allocated = request.num_allocated.max(total);
        request.pending_hit = 0;
    }

    fn run(&mut self, op: &Op) {
        match op.clone() {
            Op::Add { slot, shared, own } => {
                let mut prompt: Vec<u32> = (0..shared as u32).collect();
                prompt.extend((0..own as u32).map(|i| 1000 * (slot as u32 + 1) + i));
                let result = self.coordinator.add_request(NewRequest {
                    request_id: slot,
                    prompt_token_ids: &prompt,
                    max_total_tokens: None,
                    extra: ExtraKeys::default(),
                });
                let fits = self.coordinator.max_blocks_needed(prompt.len())
                    < self.coordinator.config().num_blocks;
                let expected_ok =
                    fits && !self.model.contains_key(&slot) && self.model.len() < MAX_REQUESTS;
                assert_eq!(result.is_ok(), expected_ok, "{result:?}");
                if result.is_ok() {
                    let request = ModelRequest {
                        num_tokens: prompt.len(),
                        tokens: prompt.clone(),
                        ..ModelRequest::default()
                    };
                    self.model.insert(slot, request);
                }
            }
            Op::Hit { slot } => {
                let probed = self.model.get(&slot).map(|request| {
                    self.coordinator
                        .probe_cache_hit(&request.tokens, &ExtraKeys::default())
                        .unwrap()
                });
                let result = self.coordinator.find_cache_hit(slot);
                match self.model.get_mut(&slot) {
                    Some(request) if request.num_allocated == 0 => {
                        let hit = result.unwrap();
                        assert_eq!(probed, Some(hit), "a probe finds the hit the lookup finds");
                        assert!(
                            hit < request.num_tokens,
                            "a hit leaves one token to compute"
                        );
                        assert_eq!(hit % self.alignment, 0);
                        request.pending_hit = hit;
                    }
                    _ => assert!(result.is_err()),
                }
            }
            Op::Allocate { slot, new } => {
                let Some(step) = self.step_for(slot, new) else {
                    return;
                };
                let before = self.snapshot();
                if self.coordinator.allocate(step).unwrap() {
                    self.copied(&[step]);
                    self.applied(step);
                } else {
                    assert_eq!(
                        before,
                        self.snapshot(),
                        "a refused allocate changes nothing"
                    );
                    self.sync_pending_hit(slot);
                }
            }
            Op::Batch { mut slots, new } => {
                slots.sort_unstable();
                slots.dedup();
                let steps: Vec<AllocateStep> = slots
                    .into_iter()
                    .filter_map(|slot| self.step_for(slot, new))
                    .collect();
                let done = self.coordinator.allocate_batch(&steps).unwrap();
                self.copied(&steps[..done]);
                for &step in &steps[..done] {
                    self.applied(step);
                }
                if let Some(&refused) = steps.get(done) {
                    self.sync_pending_hit(refused.request_id);
                }
            }
            Op::Append { slot, count } => {
                let result = self.coordinator.append_token_ids(slot, &vec![5; count]);
                match self.model.get_mut(&slot) {
                    Some(request) if request.num_tokens + count <= MAX_MODEL_LEN => {
                        result.unwrap();
                        request.num_tokens += count;
                        request.tokens.extend(std::iter::repeat_n(5, count));
                    }
                    _ => assert!(result.is_err()),
                }
            }
            Op::Free { slot } => {
                let result = self.coordinator.free_request(slot);
                self.copy_sources.remove(&slot);
                assert_eq!(result.is_ok(), self.model.remove(&slot).is_some());
            }
        }
    }

    /// After successful allocates of `steps`: releases the copy sources those requests held
    /// and carries out the copies asked for now (the model's record of what each page holds),
    /// remembering their sources.
    fn copied(&mut self, steps: &[AllocateStep]) {
        for step in steps {
            self.copy_sources.remove(&step.request_id);
        }
        for copy in self.coordinator.take_block_copies() {
            let owner = copy.request_id;
            assert!(steps.iter().any(|step| step.request_id == owner));
            assert!((0..self.specs.len()).any(|group| self
                .coordinator
                .request_blocks(owner, group)
                .unwrap()
                .contains(&copy.dst)));
            let filled = self.block_prefix.get(&copy.src).cloned();
            let filled = filled.expect("a copy source was filled before");
            self.block_prefix.insert(copy.dst, filled);
            self.copy_sources.entry(owner).or_default().push(copy.src);
        }
    }

    /// A refused first allocate keeps its pending hit, or drops it when the hit was evicted.
    fn sync_pending_hit(&mut self, slot: u64) {
        let pending = self.coordinator.pending_hit_tokens(slot).unwrap();
        let request = self.model.get_mut(&slot).unwrap();
        assert!(pending == request.pending_hit || pending == 0);
        request.pending_hit = pending;
    }

    /// Rows of every request plus the free count.
    fn snapshot(&self) -> (Vec<Vec<u32>>, usize) {
        let mut rows = Vec::new();
        let mut ids: Vec<u64> = self.model.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            for group in 0..self.specs.len() {
                rows.push(self.coordinator.request_blocks(id, group).unwrap().to_vec());
            }
        }
        (rows, self.coordinator.pool().num_free_blocks())
    }

    fn check(&self) {
        let pool = self.coordinator.pool();
        let table = self.coordinator.table();
        let mut references: HashMap<u32, (usize, usize)> = HashMap::new();
        let mut used_rows = Vec::new();
        for (&id, request) in &self.model {
            let row = self.coordinator.row_of(id).unwrap();
            used_rows.push(row);
            for (group, spec) in self.specs.iter().enumerate() {
                let blocks = self.coordinator.request_blocks(id, group).unwrap();
                let expected_len = request.num_allocated.div_ceil(spec.block_size);
                assert_eq!(blocks.len(), expected_len, "request {id} group {group}");
                let num_null = skipped(spec.kind, request.num_computed) / spec.block_size;
                for (index, &block) in blocks.iter().enumerate() {
                    assert_eq!(
                        block == NULL_BLOCK,
                        index < num_null,
                        "request {id} group {group} entry {index}: {blocks:?}"
                    );
                    let at = RowRef { group, row };
                    assert_eq!(table.entry(at, index), block as i32, "table mirror");
                    if block != NULL_BLOCK {
                        let entry = references.entry(block).or_insert((group, 0));
                        assert_eq!(entry.0, group, "block {block} in two groups");
                        entry.1 += 1;
                    }
                }
                assert_eq!(table.row_len(RowRef { group, row }), blocks.len());
            }
        }
        for row in (0..MAX_REQUESTS).filter(|row| !used_rows.contains(row)) {
            for group in 0..self.specs.len() {
                let at = RowRef { group, row };
                assert_eq!(table.row_len(at), 0, "unused row {row}");
                assert_eq!(table.entry(at, 0), 0);
            }
        }
        let mut sources: HashMap<u32, usize> = HashMap::new();
        for &block in self.copy_sources.values().flatten() {
            *sources.entry(block).or_default() += 1;
        }
        for block in 1..pool.num_blocks() as u32 {
            let expected = references.get(&block).map_or(0, |entry| entry.1)
                + sources.get(&block).copied().unwrap_or(0);
            assert_eq!(
                pool.ref_count(block) as usize,
                expected,
                "ref count of {block}"
            );
        }
        let held = references
            .keys()
            .chain(sources.keys())
            .collect::<std::collections::HashSet<_>>();
        assert_eq!(pool.num_free_blocks(), pool.num_blocks() - 1 - held.len());
        assert_eq!(pool.ref_count(NULL_BLOCK), 0);
        let per_group: usize = self.coordinator.num_used_blocks_per_group().iter().sum();
        assert_eq!(
            per_group,
            references.values().map(|entry| entry.1).sum::<usize>()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: if cfg!(miri) { 4 } else { 256 }, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_every_block_accounted_for(
        variant in 0..4usize,
        num_blocks in 16..64usize,
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut harness = Harness::new(variant, num_blocks);
        for op in &ops {
            harness.run(op);
            harness.check();
        }
        let ids: Vec<u64> = harness.model.keys().copied().collect();
        for id in ids {
            harness.run(&Op::Free { slot: id });
            harness.check();
        }
        let pool = harness.coordinator.pool();
        prop_assert_eq!(pool.num_free_blocks(), pool.num_blocks() - 1);
        prop_assert!(harness.coordinator.num_used_blocks_per_group().iter().all(|&n| n == 0));
    }
}
