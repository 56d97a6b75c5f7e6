//! Harness for the coordinator fuzz target.
//!
//! The fuzzer's bytes choose a configuration (1-3 groups: full attention, sliding window,
//! chunked local, with block sizes 1-8; a pool of 2-48 blocks, so exhaustion is common; xxh3 or
//! sha256; prefix caching on or off) and then a sequence of [`Op`]s. A reference model tracks
//! what the public API promises about each request; after every operation [`Harness::check`]
//! asserts, through the public API only:
//!
//! - every block other than the null block is exactly one of free (in the free queue once, ref
//!   count 0) or used (ref count = number of table entries naming it, plus the copy sources
//!   a hit holds until its request's next allocate); the null block is never
//!   referenced, never free, never handed out;
//! - each row has the length and the null prefix the window/chunk arithmetic says, and the
//!   persistent block table mirrors it; unused rows are empty;
//! - a block is named by one group only, never twice in one row, and by two requests only when
//!   both hold the same full block (same index, same tokens of the whole prefix, same adapter,
//!   same salt): sharing happens only through a cache hit;
//! - shadow KV: the harness records the tokens each block holds (and carries out the block
//!   copies the coordinator asks for); a hit hands a request blocks whose recorded tokens equal
//!   its own, the block a hit ends inside (taken or copied) at least up to the hit, and a block
//!   handed out fresh was free before;
//! - LRU order: fresh blocks come from the front of the free queue (tier by tier); a freed
//!   request frees exactly its unshared blocks and keeps every free block free (the order it
//!   frees them in, by position across groups and per tier, is checked by the coordinator's
//!   vector tests);
//! - a refused `allocate` changes nothing (it may only drop an evicted pending hit), and is only
//!   refused when the pool really lacks blocks;
//! - errors are the documented ones and leave everything as it was;
//! - at the end every block is free, and each admitted request can run to completion alone
//!   (admission never lets in a request that could deadlock);
//! - with tail replay on (`run_replay_ops`): a replay's full-attention blocks up to its frontier
//!   hold the request's tokens, its windowed blocks are fresh, and the windowed blocks it
//!   computes from a partial window are recorded as holding nobody's tokens, so a hit that ever
//!   hands one out fails the content check;
//! - with token tails on (`run_tail_ops`, protected chains and replay too where allowed): the
//!   block a tail hit ends inside holds the request's tokens up to the hit (the same content
//!   check as any hit ending inside a block); protected chains and their demotions keep every
//!   check above (the LRU checks read the pool's own queue order).
//!
//! A violation panics (libFuzzer records it as a crash with the input).

use std::collections::{BTreeMap, HashMap, HashSet};

use arbitrary::{Arbitrary, Unstructured};
use hybrid_cache_core::coordinator::{HitStats, RowRef};
use hybrid_cache_core::{
    AllocateStep, AttentionKind, BlockAllocator, BlockId, Coordinator, CoordinatorConfig,
    CoreError, ExtraKeys, GroupSpec, HashAlgo, NewRequest, NULL_BLOCK,
};

/// Request ids the operations use (a few more than table rows, so "unknown id" and "too many
/// requests" both happen).
const NUM_IDS: u8 = 8;
const MAX_OPS: usize = 256;

/// One operation on the coordinator. Ids are taken modulo [`NUM_IDS`].
#[derive(Arbitrary, Clone, Debug)]
pub enum Op {
    /// `add_request`: `shared` tokens of prefix family `family`, then `own` tokens (a small
    /// alphabet, so prompts share blocks often); `extra_total` more tokens allowed than the
    /// prompt.
    Add {
        id: u8,
        family: u8,
        shared: u8,
        own: Vec<u8>,
        lora: Option<u8>,
        salt: Option<u8>,
        extra_total: u8,
    },
    /// `find_cache_hit`.
    FindHit { id: u8 },
    /// A well-formed `allocate` (prefill chunk of at most `new` tokens, or a decode step after
    /// appending a token); a request that reached its length is finished (freed) instead.
    Step { id: u8, new: u8 },
    /// `allocate` with arbitrary arguments: must either be refused with an error (nothing
    /// changed) or be valid.
    RawAllocate { id: u8, computed: u8, new: u8 },
    /// `allocate_batch` of well-formed steps.
    Batch { ids: Vec<u8>, new: u8 },
    /// `append_token_ids`.
    Append { id: u8, tokens: Vec<u8> },
    /// `append_token_ids_batch` (ids may repeat: then an error and no change).
    AppendBatch { ids: Vec<u8> },
    /// `free_request` on an arbitrary id (unknown ids must be refused).
    Free { id: u8 },
    /// `free_request` on a live request picked by index, wherever it is in its life.
    Abort { pick: u8 },
    /// Preemption by recompute: free a live request and add it back with every known token.
    Preempt { pick: u8 },
    /// `reset_prefix_cache`.
    Reset,
}

/// What the harness knows of one request.
#[derive(Clone, Debug)]
struct Tracked {
    tokens: Vec<u32>,
    extra: ExtraKeys,
    max_total: usize,
    num_computed: usize,
    num_allocated: usize,
    pending_hit: usize,
    /// The tail replay its hit took (`Coordinator::replay_frontier`; 0 without one) and where
    /// it started.
    replay_frontier: usize,
    replay_start: usize,
}

impl Tracked {
    /// Tokens with slots in a group: a replay's full-attention rows cover its frontier.
    fn slots(&self, kind: AttentionKind) -> usize {
        match kind {
            AttentionKind::Full => self.num_allocated.max(self.replay_frontier),
            _ => self.num_allocated,
        }
    }
}

/// What a full block holds: the whole prefix up to its end, plus the keys that change its KV.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Content {
    group: usize,
    index: usize,
    prefix: Vec<u32>,
    lora_id: Option<u64>,
    cache_salt: Option<String>,
}

/// Everything an operation may not change when it fails.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Snapshot {
    rows: Vec<(u64, usize, Vec<BlockId>)>,
    ref_counts: Vec<u32>,
    free_queue: Vec<BlockId>,
    num_cached: usize,
    num_tokens: Vec<usize>,
}

/// Runs one fuzz input against a coordinator over the pool `make_pool` builds.
pub fn run_ops<P: BlockAllocator>(data: &[u8], make_pool: impl Fn(usize) -> Result<P, CoreError>) {
    run_ops_in(data, make_pool, false, false);
}

/// `run_ops` with tail replay on wherever the configuration allows it (full-attention and
/// sliding-window groups, no chunked one): `R` is the smallest window's `W - 1` (one windowed
/// layer), the groups' `W - 1` summed, or twice that (two layers per group), chosen by the
/// input's first byte. Returns the
/// lookups that took a replay.
pub fn run_replay_ops<P: BlockAllocator>(
    data: &[u8],
    make_pool: impl Fn(usize) -> Result<P, CoreError>,
) -> u64 {
    run_ops_in(data, make_pool, true, false).replays
}

/// `run_ops` with token tails on (`Coordinator::set_token_tails`), protected chains
/// (`set_protected_blocks`) and tail replay as in `run_replay_ops`. Returns the lookups whose
/// hit ended on token tails.
pub fn run_tail_ops<P: BlockAllocator>(
    data: &[u8],
    make_pool: impl Fn(usize) -> Result<P, CoreError>,
) -> u64 {
    run_ops_in(data, make_pool, true, true).tail_hits
}

/// Runs the input; returns the coordinator's hit counters.
fn run_ops_in<P: BlockAllocator>(
    data: &[u8],
    make_pool: impl Fn(usize) -> Result<P, CoreError>,
    replay: bool,
    tails: bool,
) -> HitStats {
    let mut input = Unstructured::new(data);
    let Ok(config) = arbitrary_config(&mut input) else {
        return HitStats::default();
    };
    let valid = config.validate().is_ok();
    let pool = match make_pool(config.num_blocks) {
        Ok(pool) => pool,
        Err(_) => {
            assert!(config.num_blocks < 2, "a pool of >= 2 blocks is valid");
            return HitStats::default();
        }
    };
    let mut coordinator = match Coordinator::with_pool(config.clone(), pool) {
        Ok(coordinator) => coordinator,
        Err(error) => {
            assert!(!valid, "a valid config was refused: {error}");
            return HitStats::default();
        }
    };
    coordinator.set_token_tails(tails);
    // Protected chains with token tails: half the pool (the input's second byte picks a
    // smaller budget sometimes, so both admission and demotion happen).
    if tails {
        let budget = config.num_blocks / (1 + usize::from(data.get(1).copied().unwrap_or(0) % 4));
        coordinator.set_protected_blocks(Some(budget));
    }
    assert!(valid, "an invalid config was accepted: {config:?}");
    let replay_tokens = if replay {
        replay_tokens(&config, data.first().copied().unwrap_or(0))
    } else {
        None
    };
    coordinator
        .set_tail_replay(replay_tokens)
        .expect("replay where the groups allow it");
    // `BlockPool::free_queue_order` drains and re-pushes its queue, which drops stale entries:
    // a quarter of the inputs never call it before the end, so stale entries pile up and
    // compaction runs as it would in production (the LRU checks are skipped then).
    // Read from the last byte without consuming it, so saved inputs keep their meaning.
    let observe_queue = data.last().is_none_or(|byte| byte % 4 != 0);
    let mut harness = Harness::new(coordinator, observe_queue, replay_tokens);
    harness.tails = tails;
    harness.check();
    let mut admitted: Vec<Tracked> = Vec::new();
    for _ in 0..MAX_OPS {
        let Ok(op) = Op::arbitrary(&mut input) else {
            break;
        };
        if let Some(request) = harness.run(&op) {
            admitted.push(request);
        }
        harness.check();
    }
    harness.free_all();
    let chunks: Vec<u8> = (0..8).map(|_| input.arbitrary().unwrap_or(0)).collect();
    if let Some(request) = admitted.last() {
        harness.run_alone(request, &chunks);
    }
    harness.free_all();
    assert!(
        harness.coordinator.reset_prefix_cache(),
        "all free: reset works"
    );
    let stats = harness.coordinator.stats();
    assert_eq!(stats.pool.num_cached_blocks, 0);
    stats.hits
}

fn arbitrary_config(input: &mut Unstructured<'_>) -> arbitrary::Result<CoordinatorConfig> {
    const BLOCK_SIZES: [usize; 5] = [1, 2, 3, 4, 8];
    let num_groups = input.int_in_range(1..=3usize)?;
    let mut groups = Vec::with_capacity(num_groups);
    for _ in 0..num_groups {
        let block_size = *input.choose(&BLOCK_SIZES)?;
        let kind = match input.int_in_range(0..=2u8)? {
            0 => AttentionKind::Full,
            1 => AttentionKind::SlidingWindow {
                window: input.int_in_range(1..=24usize)?,
            },
            _ => AttentionKind::ChunkedLocal {
                // Mostly a multiple of the block size; sometimes not, which must be refused.
                chunk: block_size * input.int_in_range(1..=4usize)? + input.ratio(1, 16)? as usize,
            },
        };
        groups.push(GroupSpec { kind, block_size });
    }
    Ok(CoordinatorConfig {
        num_blocks: input.int_in_range(1..=48usize)?,
        groups,
        max_num_reqs: input.int_in_range(1..=6usize)?,
        max_model_len: input.int_in_range(1..=96usize)?,
        max_num_batched_tokens: input.int_in_range(1..=32usize)?,
        enable_prefix_caching: !input.ratio(1, 8)?,
        hash: if input.arbitrary()? {
            HashAlgo::Sha256
        } else {
            HashAlgo::Xxh3
        },
        hash_seed: u64::from(input.arbitrary::<u8>()?),
    })
}

/// `R` for `run_replay_ops`, or `None` where the groups do not allow a replay.
fn replay_tokens(config: &CoordinatorConfig, byte: u8) -> Option<usize> {
    let kinds = || config.groups.iter().map(|spec| spec.kind);
    let has_full = kinds().any(|kind| kind == AttentionKind::Full);
    let has_chunk = kinds().any(|kind| matches!(kind, AttentionKind::ChunkedLocal { .. }));
    let windows: usize = kinds()
        .map(|kind| match kind {
            AttentionKind::SlidingWindow { window } => window - 1,
            _ => 0,
        })
        .sum();
    let smallest = kinds()
        .filter_map(|kind| match kind {
            AttentionKind::SlidingWindow { window } => Some(window - 1),
            _ => None,
        })
        .min();
    let tokens = match byte % 3 {
        0 => smallest?, // one windowed layer: short replays, taken often
        1 => windows,
        _ => 2 * windows,
    };
    (has_full && !has_chunk && windows > 0).then_some(tokens.max(1))
}

/// `R - (W_min - 1)`: where a replay from `S` has right windowed KV again (from `S` plus it).
fn replay_exact_offset(specs: &[GroupSpec], replay_tokens: usize) -> usize {
    let smallest = specs
        .iter()
        .filter_map(|spec| match spec.kind {
            AttentionKind::SlidingWindow { window } => Some(window),
            _ => None,
        })
        .min()
        .unwrap_or(1);
    replay_tokens.saturating_sub(smallest - 1)
}

/// What the harness records for a windowed block a replay computed from a partial window: no
/// request holds these "tokens", so a hit that hands the block out fails the content check.
fn poisoned_content(group: usize, index: usize) -> Content {
    Content {
        group,
        index,
        prefix: Vec::new(),
        lora_id: Some(u64::MAX),
        cache_salt: None,
    }
}

fn skipped_tokens(kind: AttentionKind, num_computed: usize) -> usize {
    match kind {
        AttentionKind::Full => 0,
        AttentionKind::SlidingWindow { window } => (num_computed + 1).saturating_sub(window),
        AttentionKind::ChunkedLocal { chunk } => num_computed / chunk * chunk,
    }
}

/// The coordinator plus the reference model and the shadow KV contents.
pub struct Harness<P: BlockAllocator> {
    coordinator: Coordinator<P>,
    specs: Vec<GroupSpec>,
    alignment: usize,
    requests: BTreeMap<u64, Tracked>,
    /// Recorded contents of blocks that held a full block (kept while free: still hittable).
    contents: HashMap<BlockId, Content>,
    /// What a held block that is not full holds so far (a freed request's partial tail may be
    /// taken by a hit that ends inside it).
    partial: HashMap<BlockId, Content>,
    /// What a copy destination received (its source's contents), until the hit is checked.
    copied: HashMap<BlockId, Content>,
    /// Per request, the copy sources its hit holds until its next successful allocate.
    copy_sources: HashMap<u64, Vec<BlockId>>,
    /// Whether checks read `free_queue_order` (see `run_ops`).
    observe_queue: bool,
    /// `R` of the coordinator's tail replay, if on.
    replay_tokens: Option<usize>,
    /// Whether token tails are on (hits may end off the alignment).
    tails: bool,
    /// Windowed blocks a replay computed from a partial window (recorded as
    /// `poisoned_content` until handed out fresh).
    poisoned: HashSet<BlockId>,
}

impl<P: BlockAllocator> Harness<P> {
    fn new(coordinator: Coordinator<P>, observe_queue: bool, replay_tokens: Option<usize>) -> Self {
        let config = coordinator.config().clone();
        Harness {
            replay_tokens,
            tails: false,
            poisoned: HashSet::new(),
            specs: config.groups.clone(),
            alignment: config.hit_alignment().expect("validated"),
            coordinator,
            requests: BTreeMap::new(),
            contents: HashMap::new(),
            partial: HashMap::new(),
            copied: HashMap::new(),
            copy_sources: HashMap::new(),
            observe_queue,
        }
    }

    fn config(&self) -> &CoordinatorConfig {
        self.coordinator.config()
    }

    fn pick(&self, pick: u8) -> Option<u64> {
        if self.requests.is_empty() {
            return None;
        }
        self.requests
            .keys()
            .nth(usize::from(pick) % self.requests.len())
            .copied()
    }

    /// Runs one operation and checks its result; returns the request an `Add` admitted.
    fn run(&mut self, op: &Op) -> Option<Tracked> {
        match op {
            Op::Add {
                id,
                family,
                shared,
                own,
                lora,
                salt,
                extra_total,
            } => {
                let limit = self.config().max_model_len + 2;
                let mut tokens: Vec<u32> = (0..usize::from(*shared) % limit)
                    .map(|i| u32::from(*family % 3) * 100 + (i as u32 % 5))
                    .collect();
                tokens.extend(own.iter().map(|&t| u32::from(t % 4)));
                tokens.truncate(limit);
                let extra = ExtraKeys {
                    lora_id: lora.map(|l| u64::from(l % 3)),
                    cache_salt: salt.map(|s| format!("tenant-{}", s % 3)),
                    mm_items: Vec::new(),
                };
                let max_total = tokens.len() + usize::from(*extra_total % 16);
                return self.add(u64::from(id % NUM_IDS), tokens, extra, max_total);
            }
            Op::FindHit { id } => self.find_hit(u64::from(id % NUM_IDS)),
            Op::Step { id, new } => {
                // An id's high bit (ids are taken modulo `NUM_IDS`) asks `allocate_keeping` to
                // leave all but `new % 8` of the free blocks free (a reserve that binds).
                let reserve = if *id >= 128 {
                    let free = self.coordinator.pool().num_free_blocks();
                    free.saturating_sub(usize::from(*new % 8))
                } else {
                    0
                };
                let id = u64::from(id % NUM_IDS);
                if let Some(step) = self.well_formed_step(id, usize::from(*new)) {
                    self.allocate(step, reserve);
                } else if self.requests.contains_key(&id) {
                    self.free(id); // finished
                }
            }
            Op::RawAllocate { id, computed, new } => {
                let step = AllocateStep {
                    request_id: u64::from(id % NUM_IDS),
                    num_computed_tokens: usize::from(*computed),
                    num_new_tokens: usize::from(*new),
                };
                self.allocate(step, 0);
            }
            Op::Batch { ids, new } => self.batch(ids, usize::from(*new)),
            Op::Append { id, tokens } => {
                let tokens: Vec<u32> = tokens.iter().map(|&t| u32::from(t % 4)).collect();
                self.append(u64::from(id % NUM_IDS), &tokens);
            }
            Op::AppendBatch { ids } => self.append_batch(ids),
            Op::Free { id } => self.free(u64::from(id % NUM_IDS)),
            Op::Abort { pick } => {
                if let Some(id) = self.pick(*pick) {
                    self.free(id);
                }
            }
            Op::Preempt { pick } => {
                if let Some(id) = self.pick(*pick) {
                    let request = self.requests[&id].clone();
                    // Odd picks keep the request's tokens and hashes in the core and resume it
                    // from them; even ones free it and add it anew. Both must end alike.
                    let keep = pick % 2 == 1;
                    self.release(id, keep);
                    let max_total = request.max_total.max(request.tokens.len());
                    // `add` checks the result (refused only when it no longer fits).
                    self.add_or_resume(id, request.tokens, request.extra, max_total, keep);
                }
            }
            Op::Reset => self.reset(),
        }
        None
    }

    fn add(
        &mut self,
        id: u64,
        tokens: Vec<u32>,
        extra: ExtraKeys,
        max_total: usize,
    ) -> Option<Tracked> {
        self.add_or_resume(id, tokens, extra, max_total, false)
    }

    /// `add_request` (`add_request_read` for odd ids), or with `resume` `resume_request` of a
    /// request `preempt_request` kept with these tokens and keys: the same checks and outcomes
    /// every way.
    fn add_or_resume(
        &mut self,
        id: u64,
        tokens: Vec<u32>,
        extra: ExtraKeys,
        max_total: usize,
        resume: bool,
    ) -> Option<Tracked> {
        let before = self.snapshot();
        let result = if resume {
            self.coordinator
                .resume_request(id, Some(max_total), Some(tokens.len()))
        } else if id % 2 == 1 {
            // Read a piece at a time, hashed as read: the same checks and outcomes.
            let mut prompt = &tokens[..];
            self.coordinator
                .add_request_read(id, &mut prompt, Some(max_total), extra.clone())
        } else {
            self.coordinator.add_request(NewRequest {
                request_id: id,
                prompt_token_ids: &tokens,
                max_total_tokens: Some(max_total),
                extra: extra.clone(),
            })
        };
        let config = self.config();
        let empty = tokens.is_empty();
        let too_long = max_total > config.max_model_len;
        let too_big =
            !too_long && self.coordinator.max_blocks_needed(max_total) > config.num_blocks - 1;
        let duplicate = self.requests.contains_key(&id);
        let no_row = self.requests.len() >= config.max_num_reqs;
        match result {
            Ok(row) => {
                assert!(!(empty || too_long || too_big || duplicate || no_row));
                assert!(row < config.max_num_reqs);
                let request = Tracked {
                    tokens,
                    extra,
                    max_total,
                    num_computed: 0,
                    num_allocated: 0,
                    pending_hit: 0,
                    replay_frontier: 0,
                    replay_start: 0,
                };
                self.requests.insert(id, request.clone());
                Some(request)
            }
            Err(error) => {
                let explained = match &error {
                    CoreError::InvalidArgument(_) => empty,
                    CoreError::RequestTooLarge(_) => too_long || too_big,
                    CoreError::DuplicateRequest { request_id } => duplicate && *request_id == id,
                    CoreError::TooManyRequests { .. } => no_row,
                    _ => false,
                };
                assert!(explained, "add_request({id}) refused with {error:?}");
                assert_eq!(before, self.snapshot(), "a refused add changes nothing");
                if resume {
                    assert!(
                        self.coordinator.forget_request(id),
                        "a refused resume keeps it"
                    );
                }
                None
            }
        }
    }

    fn find_hit(&mut self, id: u64) {
        let probed = self.requests.get(&id).map(|request| {
            self.coordinator
                .probe_cache_hit(&request.tokens, &request.extra)
                .expect("a probe of an added request's tokens works")
        });
        let result = self.coordinator.find_cache_hit(id);
        let caching = self.config().enable_prefix_caching;
        match self.requests.get_mut(&id) {
            Some(request) if request.num_allocated == 0 => {
                let hit = result.expect("a hit lookup before the first allocate works");
                assert_eq!(probed, Some(hit), "a probe finds the hit the lookup finds");
                assert!(
                    hit < request.tokens.len(),
                    "a hit leaves one token to compute"
                );
                // A token-tail hit may end anywhere; the content checks at its allocate cover it.
                assert!(
                    hit.is_multiple_of(self.alignment) || self.tails,
                    "hits are aligned to the lcm"
                );
                assert!(caching || hit == 0, "no hits with prefix caching off");
                request.pending_hit = hit;
            }
            Some(_) => assert!(matches!(result, Err(CoreError::InvalidArgument(_)))),
            None => assert!(matches!(result, Err(CoreError::UnknownRequest { .. }))),
        }
    }

    /// The next step a well-behaved engine would take for `id`, appending a sampled token when
    /// every known token already has a slot. `None` when the request is unknown or done.
    fn well_formed_step(&mut self, id: u64, new: usize) -> Option<AllocateStep> {
        let request = self.requests.get(&id)?.clone();
        let computed = if request.num_allocated == 0 {
            request.pending_hit
        } else {
            request.num_allocated
        };
        if computed >= request.max_total {
            return None;
        }
        if computed >= request.tokens.len() {
            self.append(id, &[1]);
        }
        if computed > self.requests[&id].tokens.len() {
            return None; // slots given beyond the known tokens by a raw allocate
        }
        let known_beyond = self.requests[&id].tokens.len() - computed;
        let new = new
            .clamp(1, self.config().max_num_batched_tokens)
            .min(known_beyond)
            .min(request.max_total - computed);
        Some(AllocateStep {
            request_id: id,
            num_computed_tokens: computed,
            num_new_tokens: new,
        })
    }

    /// Whether `allocate(step)` must be refused with an error (the documented rules).
    fn step_is_invalid(&self, step: &AllocateStep) -> bool {
        let Some(request) = self.requests.get(&step.request_id) else {
            return true;
        };
        let config = self.config();
        let (computed, new) = (step.num_computed_tokens, step.num_new_tokens);
        let first_ok = computed == 0 || computed == request.pending_hit;
        new > config.max_num_batched_tokens
            || computed + new > config.max_model_len
            || computed > request.tokens.len()
            || computed < request.num_computed
            || (request.num_allocated == 0 && !first_ok)
            || (request.num_allocated > 0 && computed > request.num_allocated)
    }

    /// `allocate_keeping(step, reserve)` (`allocate` when `reserve` is 0): an accepted step
    /// leaves `reserve` blocks free, or took none (its releases cover it).
    fn allocate(&mut self, step: AllocateStep, reserve: usize) {
        let before = self.snapshot();
        let invalid = self.step_is_invalid(&step);
        let free_before = self.coordinator.pool().num_free_blocks();
        let result = self.coordinator.allocate_keeping(step, reserve);
        match result {
            Err(error) => {
                assert!(invalid, "allocate({step:?}) refused with {error:?}");
                assert_eq!(before, self.snapshot(), "a failed allocate changes nothing");
            }
            Ok(done) => {
                assert!(!invalid, "allocate({step:?}) accepted invalid arguments");
                if done {
                    let free = self.coordinator.pool().num_free_blocks();
                    assert!(
                        free >= reserve.min(free_before),
                        "allocate_keeping({step:?}, {reserve}) left {free} of {free_before} free"
                    );
                    self.after_allocated(&[step]);
                    let hit_blocks = self.applied(step, &before, true);
                    self.check_lru_after_allocate(step.request_id, &before, &hit_blocks);
                } else {
                    self.refused(step, &before, reserve);
                }
            }
        }
    }

    fn batch(&mut self, ids: &[u8], new: usize) {
        let mut unique: Vec<u64> = ids.iter().map(|&id| u64::from(id % NUM_IDS)).collect();
        unique.sort_unstable();
        unique.dedup();
        let steps: Vec<AllocateStep> = unique
            .into_iter()
            .filter_map(|id| self.well_formed_step(id, new))
            .collect();
        let before = self.snapshot();
        let done = self
            .coordinator
            .allocate_batch(&steps)
            .expect("well-formed steps are accepted");
        assert!(done <= steps.len());
        self.after_allocated(&steps[..done]);
        for &step in &steps[..done] {
            // An earlier step of the batch may release a block a later one takes fresh, so the
            // fresh blocks' ref counts before the batch prove nothing; `check` still does.
            self.applied(step, &before, false);
        }
        if let Some(&refused) = steps.get(done) {
            self.sync_pending_hit(refused.request_id);
        }
    }

    /// After successful allocates of `steps`: their requests' earlier copy sources are released,
    /// and the copies asked for now are carried out on the recorded contents (the step runs),
    /// their sources remembered.
    fn after_allocated(&mut self, steps: &[AllocateStep]) {
        for step in steps {
            self.copy_sources.remove(&step.request_id);
        }
        for copy in self.coordinator.take_block_copies() {
            let owner = copy.request_id;
            assert!(
                steps.iter().any(|step| step.request_id == owner),
                "a copy is for a request just allocated"
            );
            let source = self.contents.get(&copy.src).cloned();
            let source = source.expect("a copy source is a full block seen before");
            self.copied.insert(copy.dst, source);
            self.copy_sources.entry(owner).or_default().push(copy.src);
        }
    }

    /// Updates the model after a successful allocate and checks the new entries: hit entries
    /// hold this request's own tokens; other new entries were free before (when `strict`).
    /// Returns the hit blocks that were free before (touched out of the free queue).
    fn applied(&mut self, step: AllocateStep, before: &Snapshot, strict: bool) -> HashSet<BlockId> {
        let mut touched_free = HashSet::new();
        let id = step.request_id;
        let request = self.requests.get_mut(&id).expect("validated");
        let first = request.num_allocated == 0;
        let hit_tokens = if first && step.num_computed_tokens > 0 {
            step.num_computed_tokens
        } else {
            0
        };
        if first {
            request.replay_frontier = match hit_tokens {
                0 => 0,
                _ => self.coordinator.replay_frontier(id).unwrap(),
            };
            request.replay_start = hit_tokens;
        }
        let frontier = request.replay_frontier;
        let replay_start = request.replay_start;
        let old_rows: Vec<Vec<BlockId>> = (0..self.specs.len())
            .map(|group| before.row(id, group).to_vec())
            .collect();
        request.num_computed = step.num_computed_tokens;
        let total = step.num_computed_tokens + step.num_new_tokens;
        request.num_allocated = request.num_allocated.max(total);
        request.pending_hit = 0;
        let request = request.clone();
        // A replay's windowed blocks before this index hold KV from a partial window.
        let exact_from = match (frontier, self.replay_tokens) {
            (1.., Some(tokens)) => Some(replay_start + replay_exact_offset(&self.specs, tokens)),
            _ => None,
        };
        let mut poison = Vec::new();
        for (group, spec) in self.specs.iter().enumerate() {
            let row = self.coordinator.request_blocks(id, group).unwrap().to_vec();
            // Where this group's hit ends: a replay keeps the full-attention blocks up to its
            // frontier and hands the windowed groups new blocks only.
            let hit_tokens = match (frontier, spec.kind) {
                (0, _) => hit_tokens,
                (_, _) if hit_tokens == 0 => 0,
                (_, AttentionKind::Full) => frontier,
                _ => 0,
            };
            for (index, &block) in row.iter().enumerate() {
                if block == NULL_BLOCK || old_rows[group].get(index) == Some(&block) {
                    continue;
                }
                if let (Some(exact), AttentionKind::SlidingWindow { .. }) = (exact_from, spec.kind)
                {
                    if index < exact.div_ceil(spec.block_size) {
                        // Checked below as a fresh block, then poisoned.
                        poison.push((block, group, index));
                    }
                }
                assert!(
                    index >= old_rows[group].len(),
                    "allocate replaced entry {index} of group {group} with another block"
                );
                if (index + 1) * spec.block_size <= hit_tokens {
                    let expected = content_of(&request, group, index, spec.block_size);
                    assert_eq!(
                        self.contents.get(&block),
                        Some(&expected),
                        "request {id} group {group} hit block {block} at {index} holds other tokens"
                    );
                    if before.ref_counts[block as usize] == 0 {
                        touched_free.insert(block);
                    }
                } else if index * spec.block_size < hit_tokens {
                    // The hit ends inside this block: a copy of a cached block, or a taken free
                    // one (a full block or a freed request's partial tail). It must hold this
                    // request's tokens up to the hit; the request overwrites the rest.
                    let copy = self.copied.remove(&block);
                    let was_copied = copy.is_some();
                    let source = copy
                        .or_else(|| self.contents.remove(&block))
                        .or_else(|| self.partial.remove(&block));
                    let expected = content_of(&request, group, index, spec.block_size);
                    let holds = source.as_ref().is_some_and(|source| {
                        source.group == group
                            && source.index == index
                            && source.lora_id == expected.lora_id
                            && source.cache_salt == expected.cache_salt
                            && source.prefix.len() >= hit_tokens
                            && source.prefix[..hit_tokens] == expected.prefix[..hit_tokens]
                    });
                    assert!(
                        holds,
                        "request {id} group {group}: the block {block} its hit ends inside \
                         holds other tokens ({source:?})"
                    );
                    self.contents.remove(&block);
                    self.partial.remove(&block);
                    self.poisoned.remove(&block);
                    if !was_copied && before.ref_counts[block as usize] == 0 {
                        touched_free.insert(block);
                    }
                } else {
                    // Free before, or released by this very step's window and taken again.
                    let released_here = (0..self.specs.len()).any(|g| {
                        let now = self.coordinator.request_blocks(id, g).unwrap();
                        old_rows[g]
                            .iter()
                            .enumerate()
                            .any(|(i, &b)| b == block && now.get(i) == Some(&NULL_BLOCK))
                    });
                    assert!(
                        !strict || before.ref_counts[block as usize] == 0 || released_here,
                        "fresh block {block} (request {id} group {group}) was in use"
                    );
                    self.contents.remove(&block);
                    self.partial.remove(&block);
                    self.poisoned.remove(&block);
                }
            }
        }
        for (block, group, index) in poison {
            self.contents.insert(block, poisoned_content(group, index));
            self.poisoned.insert(block);
        }
        for &source in self.copy_sources.get(&id).into_iter().flatten() {
            if before.ref_counts[source as usize] == 0 {
                touched_free.insert(source);
            }
        }
        touched_free
    }

    /// Fresh blocks come from the front of the free queue (after the hit's touched blocks left
    /// it and the window's released blocks joined its tail).
    fn check_lru_after_allocate(&self, id: u64, before: &Snapshot, hit_blocks: &HashSet<BlockId>) {
        if !self.observe_queue {
            return;
        }
        let after = self.snapshot();
        let now_used: HashSet<BlockId> = before
            .free_queue
            .iter()
            .copied()
            .filter(|&block| after.ref_counts[block as usize] > 0)
            .collect();
        let queue_after: Vec<BlockId> = after
            .free_queue
            .iter()
            .copied()
            .filter(|block| before.free_queue.contains(block))
            .collect();
        let expected: Vec<BlockId> = before
            .free_queue
            .iter()
            .copied()
            .filter(|block| !now_used.contains(block))
            .collect();
        assert_eq!(
            queue_after, expected,
            "request {id}: blocks that stayed free keep their order"
        );
        // The blocks taken from the old queue are the hit's blocks and then its front; a fresh
        // block taken while an older free block stays behind would break LRU order.
        let fresh_from_old: Vec<BlockId> = before
            .free_queue
            .iter()
            .copied()
            .filter(|block| now_used.contains(block) && !hit_blocks.contains(block))
            .collect();
        let front: Vec<BlockId> = before
            .free_queue
            .iter()
            .copied()
            .filter(|block| !hit_blocks.contains(block))
            .take(fresh_from_old.len())
            .collect();
        assert_eq!(
            fresh_from_old, front,
            "request {id}: fresh blocks come from the front of the free queue"
        );
    }

    /// After `allocate` returned false: nothing changed but (maybe) the pending hit, and the
    /// pool really lacked blocks unless the hit was evicted.
    fn refused(&mut self, step: AllocateStep, before: &Snapshot, reserve: usize) {
        assert_eq!(
            before,
            &self.snapshot(),
            "a refused allocate changes nothing"
        );
        let id = step.request_id;
        let pending_before = self.requests[&id].pending_hit;
        self.sync_pending_hit(id);
        let hit_dropped = pending_before > 0 && self.requests[&id].pending_hit == 0;
        let total = step.num_computed_tokens + step.num_new_tokens;
        // A replay's first allocate covers its frontier (below the prompt's end) in the
        // full-attention groups.
        let replaying = self.replay_tokens.is_some() && self.requests[&id].num_allocated == 0;
        let prompt = self.requests[&id].tokens.len();
        // Plus one per group for a copy source the hit touches out of the free queue.
        let most_needed: usize = self
            .specs
            .iter()
            .map(|spec| match spec.kind {
                AttentionKind::Full if replaying => total.max(prompt),
                _ => total,
            })
            .zip(&self.specs)
            .map(|(tokens, spec)| tokens.div_ceil(spec.block_size) + 1)
            .sum();
        let free = self.coordinator.pool().num_free_blocks();
        assert!(
            hit_dropped || free < most_needed + reserve,
            "allocate({step:?}) refused with {free} free blocks, at most {most_needed} needed \
             and {reserve} kept"
        );
    }

    fn sync_pending_hit(&mut self, id: u64) {
        let pending = self.coordinator.pending_hit_tokens(id).unwrap();
        let request = self.requests.get_mut(&id).unwrap();
        assert!(
            pending == request.pending_hit || pending == 0,
            "pending hit changed from {} to {pending}",
            request.pending_hit
        );
        request.pending_hit = pending;
    }

    fn append(&mut self, id: u64, tokens: &[u32]) {
        let before = self.snapshot();
        let result = self.coordinator.append_token_ids(id, tokens);
        let max_model_len = self.config().max_model_len;
        match self.requests.get_mut(&id) {
            Some(request) if request.tokens.len() + tokens.len() <= max_model_len => {
                result.expect("append within max_model_len works");
                request.tokens.extend_from_slice(tokens);
            }
            _ => {
                assert!(result.is_err(), "append to {id} should fail");
                assert_eq!(before, self.snapshot(), "a failed append changes nothing");
            }
        }
    }

    fn append_batch(&mut self, ids: &[u8]) {
        let ids: Vec<u64> = ids.iter().map(|&id| u64::from(id % NUM_IDS)).collect();
        let tokens: Vec<u32> = ids.iter().map(|&id| (id % 4) as u32).collect();
        let before = self.snapshot();
        let result = self.coordinator.append_token_ids_batch(&ids, &tokens);
        let max_model_len = self.config().max_model_len;
        let unique: HashSet<u64> = ids.iter().copied().collect();
        let valid = unique.len() == ids.len()
            && ids.iter().all(|id| {
                self.requests
                    .get(id)
                    .is_some_and(|request| request.tokens.len() < max_model_len)
            });
        if valid {
            result.expect("a valid batch append works");
            for (id, token) in ids.iter().zip(tokens) {
                self.requests.get_mut(id).unwrap().tokens.push(token);
            }
        } else {
            assert!(result.is_err(), "invalid batch append {ids:?} accepted");
            assert_eq!(
                before,
                self.snapshot(),
                "a failed batch append changes nothing"
            );
        }
    }

    /// `free_request`; for a live request also checks where its blocks went in the queue.
    fn free(&mut self, id: u64) {
        self.release(id, false);
    }

    /// `free_request`, or with `keep` `preempt_request` (the same release, the request's tokens
    /// and hashes kept for `resume_request`).
    fn release(&mut self, id: u64, keep: bool) {
        let before = self.snapshot();
        let result = if keep {
            self.coordinator.preempt_request(id)
        } else {
            self.coordinator.free_request(id)
        };
        let sources = self.copy_sources.remove(&id).unwrap_or_default();
        if self.requests.remove(&id).is_none() {
            assert!(matches!(result, Err(CoreError::UnknownRequest { .. })));
            assert_eq!(before, self.snapshot(), "a failed free changes nothing");
            return;
        }
        result.expect("freeing a live request works");
        if !self.observe_queue {
            return;
        }
        let after = self.snapshot();
        // Blocks free before stay free (a free takes nothing); some may move to the tail (the
        // windows of the request's hit points are re-queued with it), so only the set is checked.
        let mut old_after: Vec<BlockId> = after
            .free_queue
            .iter()
            .copied()
            .filter(|block| before.free_queue.contains(block))
            .collect();
        old_after.sort_unstable();
        let mut old_before = before.free_queue.clone();
        old_before.sort_unstable();
        assert_eq!(old_after, old_before, "freeing keeps every free block free");
        let mut expected_set: Vec<BlockId> = sources
            .iter()
            .copied()
            .filter(|&b| before.ref_counts[b as usize] == 1)
            .collect();
        for group in 0..self.specs.len() {
            let row = before.row(id, group);
            expected_set.extend(
                row.iter()
                    .copied()
                    .filter(|&b| b != NULL_BLOCK && before.ref_counts[b as usize] == 1),
            );
        }
        expected_set.sort_unstable();
        let mut appended_set: Vec<BlockId> = after
            .free_queue
            .iter()
            .copied()
            .filter(|block| !before.free_queue.contains(block))
            .collect();
        appended_set.sort_unstable();
        assert_eq!(
            appended_set, expected_set,
            "exactly the unshared blocks are freed"
        );
    }

    fn reset(&mut self) {
        let before = self.snapshot();
        let all_free = before.ref_counts.iter().all(|&count| count == 0);
        let done = self.coordinator.reset_prefix_cache();
        assert_eq!(done, all_free, "reset works iff no block is in use");
        if done {
            assert_eq!(self.coordinator.stats().pool.num_cached_blocks, 0);
            self.contents.clear();
            self.partial.clear();
        } else {
            assert_eq!(before, self.snapshot(), "a refused reset changes nothing");
        }
    }

    fn free_all(&mut self) {
        let ids: Vec<u64> = self.requests.keys().copied().collect();
        for id in ids {
            self.free(id);
            self.check();
        }
        let pool = self.coordinator.pool();
        assert_eq!(
            pool.num_free_blocks(),
            pool.num_blocks() - 1,
            "every block is free"
        );
        assert_eq!(pool.free_queue_order().len(), pool.num_blocks() - 1);
        assert!(self
            .coordinator
            .num_used_blocks_per_group()
            .iter()
            .all(|&n| n == 0));
        assert_eq!(self.coordinator.num_requests(), 0);
    }

    /// Admission: a request that was admitted runs to completion when it is alone.
    fn run_alone(&mut self, request: &Tracked, chunks: &[u8]) {
        let id = 0;
        let admitted = self.add(
            id,
            request.tokens.clone(),
            request.extra.clone(),
            request.max_total,
        );
        assert!(admitted.is_some(), "an admitted request is admitted again");
        self.find_hit(id);
        self.check();
        let mut chunk_sizes = chunks.iter().cycle();
        while let Some(step) =
            self.well_formed_step(id, usize::from(*chunk_sizes.next().unwrap_or(&0)))
        {
            let before = self.snapshot();
            assert!(
                self.coordinator.allocate(step).expect("well-formed step"),
                "an admitted request alone in the pool was refused at {step:?}"
            );
            self.after_allocated(&[step]);
            self.applied(step, &before, true);
            self.check();
        }
    }

    fn snapshot(&self) -> Snapshot {
        let pool = self.coordinator.pool();
        let mut rows = Vec::new();
        let mut num_tokens = Vec::new();
        for &id in self.requests.keys() {
            for group in 0..self.specs.len() {
                let row = self.coordinator.request_blocks(id, group).unwrap();
                rows.push((id, group, row.to_vec()));
            }
            num_tokens.push(self.coordinator.num_tokens(id).unwrap());
        }
        Snapshot {
            rows,
            ref_counts: (0..pool.num_blocks() as BlockId)
                .map(|block| pool.ref_count(block))
                .collect(),
            free_queue: if self.observe_queue {
                pool.free_queue_order()
            } else {
                Vec::new()
            },
            num_cached: pool.stats().num_cached_blocks,
            num_tokens,
        }
    }

    /// Every invariant of the module docs that holds between operations.
    pub fn check(&mut self) {
        let pool = self.coordinator.pool();
        let table = self.coordinator.table();
        let num_blocks = pool.num_blocks();
        assert_eq!(num_blocks, self.config().num_blocks);
        // block -> (group, index, holders)
        let mut holders: HashMap<BlockId, (usize, usize, Vec<u64>)> = HashMap::new();
        let mut used_rows = HashSet::new();
        let mut references_per_group = vec![0usize; self.specs.len()];
        assert_eq!(self.coordinator.num_requests(), self.requests.len());
        for (&id, request) in &self.requests {
            let row = self.coordinator.row_of(id).unwrap();
            assert!(used_rows.insert(row), "row {row} given to two requests");
            assert_eq!(
                self.coordinator.num_tokens(id).unwrap(),
                request.tokens.len()
            );
            assert_eq!(
                self.coordinator.pending_hit_tokens(id).unwrap(),
                request.pending_hit
            );
            for (group, spec) in self.specs.iter().enumerate() {
                let blocks = self.coordinator.request_blocks(id, group).unwrap();
                let expected_len = request.slots(spec.kind).div_ceil(spec.block_size);
                assert_eq!(
                    blocks.len(),
                    expected_len,
                    "request {id} group {group} length"
                );
                let num_null = (skipped_tokens(spec.kind, request.num_computed) / spec.block_size)
                    .min(expected_len);
                let at = RowRef { group, row };
                assert_eq!(table.row_len(at), blocks.len(), "table length mirror");
                let mut seen_in_row = HashSet::new();
                for (index, &block) in blocks.iter().enumerate() {
                    assert_eq!(
                        block == NULL_BLOCK,
                        index < num_null,
                        "request {id} group {group} entry {index}: {blocks:?}"
                    );
                    assert_eq!(table.entry(at, index), block as i32, "table mirror");
                    if block == NULL_BLOCK {
                        continue;
                    }
                    assert!((block as usize) < num_blocks, "block {block} out of range");
                    assert!(seen_in_row.insert(block), "block {block} twice in one row");
                    references_per_group[group] += 1;
                    let entry = holders.entry(block).or_insert((group, index, Vec::new()));
                    assert_eq!(entry.0, group, "block {block} in two groups");
                    assert_eq!(entry.1, index, "block {block} at two positions");
                    entry.2.push(id);
                }
            }
        }
        for row in (0..self.config().max_num_reqs).filter(|row| !used_rows.contains(row)) {
            for group in 0..self.specs.len() {
                let at = RowRef { group, row };
                assert_eq!(table.row_len(at), 0, "unused row {row} has entries");
                assert_eq!(table.entry(at, 0), NULL_BLOCK as i32);
            }
        }
        // Free or used, exactly once.
        assert_eq!(
            pool.ref_count(NULL_BLOCK),
            0,
            "the null block is never referenced"
        );
        let free_queue = if self.observe_queue {
            pool.free_queue_order()
        } else {
            (1..num_blocks as BlockId)
                .filter(|&block| pool.ref_count(block) == 0)
                .collect()
        };
        let free_set: HashSet<BlockId> = free_queue.iter().copied().collect();
        assert_eq!(
            free_set.len(),
            free_queue.len(),
            "a block twice in the free queue"
        );
        assert!(
            !free_set.contains(&NULL_BLOCK),
            "the null block is in the free queue"
        );
        let mut source_refs: HashMap<BlockId, usize> = HashMap::new();
        for &block in self.copy_sources.values().flatten() {
            *source_refs.entry(block).or_default() += 1;
        }
        for block in 1..num_blocks as BlockId {
            let references = holders.get(&block).map_or(0, |entry| entry.2.len())
                + source_refs.get(&block).copied().unwrap_or(0);
            assert_eq!(
                pool.ref_count(block) as usize,
                references,
                "ref count of {block}"
            );
            assert_eq!(
                free_set.contains(&block),
                references == 0,
                "block {block}: free iff unreferenced"
            );
        }
        assert_eq!(pool.num_free_blocks(), free_queue.len());
        let stats = pool.stats();
        assert_eq!(stats.num_blocks, num_blocks);
        assert_eq!(stats.num_free_blocks, free_queue.len());
        assert!(
            stats.num_cached_blocks < num_blocks,
            "more cached than blocks"
        );
        assert_eq!(
            self.coordinator.num_used_blocks_per_group(),
            &references_per_group[..]
        );
        // Sharing only through a hit: every holder of a shared block holds the same content.
        for (&block, (group, index, ids)) in &holders {
            let block_size = self.specs[*group].block_size;
            let kind = self.specs[*group].kind;
            let contents: Vec<Content> = ids
                .iter()
                .map(|id| content_of(&self.requests[id], *group, *index, block_size))
                .collect();
            let full: Vec<bool> = ids
                .iter()
                .map(|id| is_full(&self.requests[id], kind, *index, block_size))
                .collect();
            if ids.len() > 1 {
                assert!(
                    full.iter().all(|&f| f) && contents.windows(2).all(|w| w[0] == w[1]),
                    "block {block} shared by requests {ids:?} that hold different tokens"
                );
            }
            if self.poisoned.contains(&block) {
                continue; // a replay's partial-window KV: recorded as such, never as tokens
            }
            if !full[0] {
                let request = &self.requests[&ids[0]];
                let known = request.slots(kind).min(request.tokens.len());
                let mut content = content_of(request, *group, *index, block_size);
                content.prefix.truncate(known);
                self.partial.insert(block, content);
            }
            if full[0] {
                match self.contents.get(&block) {
                    Some(recorded) => assert_eq!(
                        recorded, &contents[0],
                        "block {block}: the tokens it holds changed"
                    ),
                    None => {
                        self.contents.insert(block, contents[0].clone());
                    }
                }
            }
        }
    }
}

impl Snapshot {
    fn row(&self, id: u64, group: usize) -> &[BlockId] {
        self.rows
            .iter()
            .find(|(row_id, row_group, _)| *row_id == id && *row_group == group)
            .map_or(&[], |(_, _, row)| row.as_slice())
    }
}

/// Whether block `index` of the request holds only tokens that are known and have slots.
fn is_full(request: &Tracked, kind: AttentionKind, index: usize, block_size: usize) -> bool {
    (index + 1) * block_size <= request.slots(kind).min(request.tokens.len())
}

fn content_of(request: &Tracked, group: usize, index: usize, block_size: usize) -> Content {
    let end = ((index + 1) * block_size).min(request.tokens.len());
    Content {
        group,
        index,
        prefix: request.tokens[..end].to_vec(),
        lora_id: request.extra.lora_id,
        cache_salt: request.extra.cache_salt.clone(),
    }
}

/// The harness must catch broken pools: each faulty wrapper below breaks one promise, and some
/// pseudo-random input must make `run_ops` panic on it (while the real pools pass the same
/// inputs).
#[cfg(test)]
mod tests {
    use std::panic::{catch_unwind, AssertUnwindSafe};

    use hybrid_cache_core::{BlockPool, CacheKey, FreeTier, MutexPool, PoolStats};

    use super::*;

    /// Which promise the wrapped pool breaks.
    #[derive(Clone, Copy, Debug)]
    enum Fault {
        /// `free_blocks` of three or more blocks forgets the last one (a leak).
        LeakOnLargeFree,
        /// Cache lookups ignore the group tag (one group's block served to another group).
        IgnoreGroupTag,
        /// `get_new_blocks` hands out the most recently freed block first (not LRU).
        MostRecentFirst,
    }

    struct Faulty {
        inner: MutexPool,
        fault: Fault,
    }

    impl BlockAllocator for Faulty {
        fn num_blocks(&self) -> usize {
            self.inner.num_blocks()
        }
        fn num_free_blocks(&self) -> usize {
            self.inner.num_free_blocks()
        }
        fn get_new_blocks_noting(
            &self,
            count: usize,
            out: &mut Vec<BlockId>,
            evicted: &mut Vec<CacheKey>,
        ) -> Result<(), CoreError> {
            if let Fault::MostRecentFirst = self.fault {
                let order = self.inner.free_queue_order();
                if count == 1 && order.len() > 1 {
                    // Take everything, keep the newest, give the rest back in order.
                    let mut all = Vec::new();
                    self.inner
                        .get_new_blocks_noting(order.len(), &mut all, evicted)?;
                    let newest = all.pop().unwrap();
                    self.inner.free_blocks(&all)?;
                    out.push(newest);
                    return Ok(());
                }
            }
            self.inner.get_new_blocks_noting(count, out, evicted)
        }
        fn free_blocks_to(&self, blocks: &[BlockId], tier: FreeTier) -> Result<(), CoreError> {
            match self.fault {
                Fault::LeakOnLargeFree if blocks.len() >= 3 => {
                    self.inner.free_blocks_to(&blocks[..blocks.len() - 1], tier)
                }
                _ => self.inner.free_blocks_to(blocks, tier),
            }
        }
        fn cached_block(&self, key: CacheKey) -> Option<BlockId> {
            match self.fault {
                Fault::IgnoreGroupTag => {
                    (0..3).find_map(|group| self.inner.cached_block(CacheKey { group, ..key }))
                }
                _ => self.inner.cached_block(key),
            }
        }
        fn touch_cached(&self, block: BlockId, key: CacheKey) -> bool {
            match self.fault {
                Fault::IgnoreGroupTag => {
                    (0..3).any(|group| self.inner.touch_cached(block, CacheKey { group, ..key }))
                }
                _ => self.inner.touch_cached(block, key),
            }
        }
        fn take_cached(&self, block: BlockId, key: CacheKey) -> bool {
            match self.fault {
                Fault::IgnoreGroupTag => {
                    (0..3).any(|group| self.inner.take_cached(block, CacheKey { group, ..key }))
                }
                _ => self.inner.take_cached(block, key),
            }
        }
        fn cache_block(&self, block: BlockId, key: CacheKey) -> Result<bool, CoreError> {
            self.inner.cache_block(block, key)
        }
        fn reset_prefix_cache_noting(&self, forgotten: &mut Vec<CacheKey>) -> bool {
            self.inner.reset_prefix_cache_noting(forgotten)
        }
        fn ref_count(&self, block: BlockId) -> u32 {
            self.inner.ref_count(block)
        }
        fn cached_blocks(&self) -> Vec<(BlockId, CacheKey)> {
            self.inner.cached_blocks()
        }
        fn free_queue_order(&self) -> Vec<BlockId> {
            self.inner.free_queue_order()
        }
        fn stats(&self) -> PoolStats {
            self.inner.stats()
        }
    }

    fn inputs(count: usize) -> impl Iterator<Item = Vec<u8>> {
        let mut state = 0x1234_5678_9abc_def1u64;
        (0..count).map(move |_| {
            (0..600)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 24) as u8
                })
                .collect()
        })
    }

    fn caught(fault: Fault) -> bool {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let found = inputs(3000).any(|data| {
            catch_unwind(AssertUnwindSafe(|| {
                run_ops(&data, |num_blocks| {
                    Ok(Faulty {
                        inner: MutexPool::new(num_blocks)?,
                        fault,
                    })
                })
            }))
            .is_err()
        });
        std::panic::set_hook(previous);
        found
    }

    #[test]
    fn the_real_pools_pass_the_inputs() {
        for data in inputs(300) {
            run_ops(&data, BlockPool::new);
            run_ops(&data, MutexPool::new);
        }
    }

    #[test]
    fn the_real_pools_pass_the_inputs_with_tail_replay() {
        // Random inputs rarely reach a replay (a window's blocks evicted while the
        // full-attention prefix stays cached): the committed seeds include inputs that do.
        let seeds = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/seeds"))
            .expect("the committed seeds")
            .map(|entry| std::fs::read(entry.expect("a seed").path()).expect("a seed file"));
        let mut replays = 0;
        for data in seeds.chain(inputs(300)) {
            replays += run_replay_ops(&data, BlockPool::new);
            run_replay_ops(&data, MutexPool::new);
        }
        assert!(
            replays > 0,
            "no input took a replay: the harness never checked one"
        );
    }

    #[test]
    fn the_real_pools_pass_the_inputs_with_token_tails() {
        let seeds = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/seeds"))
            .expect("the committed seeds")
            .map(|entry| std::fs::read(entry.expect("a seed").path()).expect("a seed file"));
        let mut tail_hits = 0;
        for data in seeds.chain(inputs(300)) {
            tail_hits += run_tail_ops(&data, BlockPool::new);
            run_tail_ops(&data, MutexPool::new);
        }
        assert!(
            tail_hits > 0,
            "no input hit a token tail: the harness never checked one"
        );
    }

    #[test]
    fn a_leak_is_caught() {
        assert!(caught(Fault::LeakOnLargeFree));
    }

    #[test]
    fn serving_another_groups_block_is_caught() {
        assert!(caught(Fault::IgnoreGroupTag));
    }

    #[test]
    fn a_non_lru_free_queue_is_caught() {
        assert!(caught(Fault::MostRecentFirst));
    }
}
