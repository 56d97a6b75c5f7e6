//! The hybrid coordinator: requests, the grouped block table, the fixed-point cache hit and
//! admission, over any number of groups of any attention type sharing one pool.
//!
//! Every call validates its input first and changes nothing when it returns an error;
//! `allocate` is all-or-nothing per request and reports "no space" as `Ok(false)`.
//!
//! Hit alignment `L`: the lcm of the groups' hit granularities. A windowed (or chunked) group
//! hits at its own block size; a full-attention group whose blocks are `k > 1` times the
//! smallest block size is keyed by sub-blocks of that size (`keys`) and hits at any multiple
//! of it, ending inside one of its blocks if need be (`cache_hit`). So Gemma-3's per-type layout
//! (windowed blocks of 16 tokens, full-attention blocks of 80) hits at multiples of 16, as
//! equal-size groups do. A freed request's last, partly filled block in such a group keeps a
//! partial key (its whole units), which the next turn of a conversation can take.
//!
//! Caching rule for windowed groups: a windowed block is cached only if some `L`-aligned hit
//! needs it, i.e. it lies in the tail of an `L`-aligned segment that the window still sees (see
//! [`crate::manager::AttentionManager::can_be_hit`]). Other blocks are never inserted in the
//! cache map and go back to the free queue as plain free blocks.
//!
//! Admission: `add_request` refuses a request whose worst case (all groups, see
//! `max_blocks_needed`) exceeds the pool: `cdiv(len, B)` for full attention and
//! `min(cdiv(len, B), cdiv(min(W - 1 + max_num_batched_tokens, len), B) + 1)` for a window `W`
//! (chunk `C` in place of `W` for chunked-local), `len` being the request's `max_total_tokens`.
//!
//! Life of a request:
//!
//! ```text
//!   add_request -> find_cache_hit -> allocate(c = hit, n = chunk) -> ... -> allocate(c, 1)
//!                  (optional)          ^ append_token_ids before each decode step
//!   free_request (finish, abort or preemption)
//! ```
//!
//! Tail replay (`set_tail_replay`, off by default): when the full-attention groups hit `F`
//! tokens but a windowed group's blocks for a hit point there are gone, a hit may instead start
//! the windowed groups over at `S = F - R` (rounded down to the hit alignment), `R` being the
//! tokens the windowed layers need recomputed to rebuild their windows at `F` exactly; the
//! full-attention groups keep their blocks up to `F`. See `cache_hit` for the rule and the
//! caller's duty (full-attention KV below `F` is read, never written).

mod allocate;
mod cache_hit;
mod config;
mod eviction_order;
mod free;
mod hit_stats;
mod keys;
mod protect;
mod quiet;
mod read_prompt;
mod request;
mod slab;
mod spares;
mod table;
mod tails;

pub use allocate::AllocateStep;
pub use config::{AttentionKind, CoordinatorConfig, GroupSpec};
pub use hit_stats::HitStats;
pub use table::{BlockTable, RowRef};

use std::collections::HashMap;

use crate::allocator::BlockAllocator;
use crate::error::CoreError;
use crate::hashing::{BlockHasher, ExtraKeys};
use crate::manager::{AdmissionLimits, AttentionManager};
use crate::types::{BlockHash, BlockId, CacheKey, PoolStats};
use crate::DefaultPool;
use hit_stats::EvictedKeys;
use keys::KeyLayout;
use request::RequestState;

/// Prefix-cache counters of the coordinator plus the pool's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CoordinatorStats {
    pub pool: PoolStats,
    /// Prompt tokens looked up by `find_cache_hit`.
    pub prefix_queries: u64,
    /// Tokens of those that were hits.
    pub prefix_hits: u64,
    /// Why the other looked-up tokens were not hits, and what each group alone would hit.
    pub hits: HitStats,
    /// Blocks of requests' hash chains hashed so far (prompts and sampled tokens; probes and
    /// token tails are not counted): what requests kept by `preempt_request` do not hash again.
    pub hashed_blocks: u64,
    /// Preempted requests whose tokens and hashes are kept (`preempt_request`).
    pub parked_requests: usize,
}

/// A new request for `add_request`.
#[derive(Clone, Debug, Default)]
pub struct NewRequest<'a> {
    pub request_id: u64,
    pub prompt_token_ids: &'a [u32],
    /// Tokens the request may reach (admission); `None` means the prompt length.
    pub max_total_tokens: Option<usize>,
    pub extra: ExtraKeys,
}

/// See the module docs.
#[derive(Debug)]
pub struct Coordinator<P: BlockAllocator = DefaultPool> {
    pool: P,
    config: CoordinatorConfig,
    /// One manager per group, in group order.
    managers: Vec<Box<dyn AttentionManager>>,
    /// Groups in the order the fixed-point hit asks them: full attention first.
    hit_order: Vec<usize>,
    /// The full-attention groups, in group order (the probe's stop test, the limiting group,
    /// a tail replay's frontier).
    full_groups: Vec<usize>,
    hasher: BlockHasher,
    /// Hit lengths are multiples of it (`CoordinatorConfig::hit_alignment`).
    hit_alignment: usize,
    /// The hash chains and which keys each group's blocks carry.
    keys: KeyLayout,
    table: BlockTable,
    /// Unused rows; popped from the end, so the lowest rows are handed out first.
    free_rows: Vec<usize>,
    requests: slab::RequestSlab,
    /// Scratch: the rows of a batch call's requests (`RequestSlab::rows_of`).
    rows_scratch: Vec<usize>,
    /// Non-null table entries per group (a block shared by two requests counts twice).
    num_references: Vec<usize>,
    /// Prefix-cache counters (`hit_stats`).
    hit_stats: HitStats,
    /// The keys that left the cache so far (a Bloom filter), to tell evicted from
    /// never-cached misses.
    evicted_keys: EvictedKeys,
    /// Keys the pool reported leaving the cache in the current call, for `evicted_keys`.
    evicted_scratch: Vec<CacheKey>,
    /// Number of the current `allocate_batch` call (duplicate-id detection).
    batch_number: u64,
    /// Scratch list of blocks, reused to avoid allocating per call.
    scratch: Vec<BlockId>,
    /// Scratch: a freed request's blocks with the token position each ends at.
    order_scratch: Vec<(usize, BlockId)>,
    /// Scratch: window-released blocks that join the `Low` free tier.
    low_scratch: Vec<BlockId>,
    /// Released blocks of a shared hit point's window, with their keys (`allocate`).
    shared_scratch: Vec<(BlockId, CacheKey)>,
    /// Scratch: a freed request's blocks with the keys they are cached under (protection).
    keyed_scratch: Vec<(BlockId, CacheKey)>,
    /// Page copies hits asked for since the caller last took them (`take_block_copies`).
    block_copies: Vec<BlockCopy>,
    /// Keys of cached full blocks in groups keyed by sub-blocks, partial and full: `key ->
    /// entry`, so a hit can end inside a block that keeps serving others (by a copy). Entries
    /// go stale when their block is evicted (checked at lookup: the full key must still map to
    /// the block) and are swept when they outnumber `prefix_index_limit`.
    prefix_index: HashMap<CacheKey, PrefixEntry>,
    prefix_index_limit: usize,
    /// Bumped by every `take_block_copies` (once per step in an engine): blocks cached in the
    /// current epoch are computed by the step being scheduled, after the copies run, so they
    /// are no copy source yet.
    copy_epoch: u64,
    /// `R` of a tail replay (`set_tail_replay`); `None`: hits never replay.
    tail_replay_tokens: Option<usize>,
    /// `R - (W_min - 1)`: a replay from `S` recomputes right windowed KV from `S` plus this on
    /// (cached from there; below it never).
    replay_exact_after: usize,
    /// The token tails cached so far (`set_token_tails`); `None`: tails are off.
    tails: Option<tails::TailIndex>,
    /// The protected free blocks (`set_protected_blocks`); `None`: none are.
    protected: Option<protect::Protected>,
    /// Preempted requests' tokens and hashes, kept for `resume_request` (`preempt_request`).
    parked: request::ParkedRequests,
    /// Blocks of requests' hash chains hashed so far (`CoordinatorStats::hashed_blocks`).
    num_hashed: u64,
    /// Freed requests' emptied vectors, for the next requests (`spares`).
    spares: spares::Spares,
}

/// A cached full block one of whose keys a hit may end at (see `Coordinator::prefix_index`).
#[derive(Clone, Copy, Debug)]
struct PrefixEntry {
    block: BlockId,
    /// The key the block is cached under.
    full: CacheKey,
    /// The copy epoch in which it was cached.
    epoch: u64,
}

/// A page the caller copies before the step that allocated `dst` runs: `src`'s KV (every
/// layer slot) into `dst`, for the hit of request `request_id`. See
/// `Coordinator::take_block_copies`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub request_id: u64,
    pub src: BlockId,
    pub dst: BlockId,
}

impl Coordinator<DefaultPool> {
    /// A coordinator over a new default pool of `config.num_blocks` blocks.
    pub fn new(config: CoordinatorConfig) -> Result<Self, CoreError> {
        config.validate()?;
        let pool = DefaultPool::new(config.num_blocks)?;
        Self::with_pool(config, pool)
    }
}

impl<P: BlockAllocator> Coordinator<P> {
    /// A coordinator over `pool`, which must have `config.num_blocks` blocks, all free.
    pub fn with_pool(config: CoordinatorConfig, pool: P) -> Result<Self, CoreError> {
        config.validate()?;
        if pool.num_blocks() != config.num_blocks || pool.num_free_blocks() + 1 != pool.num_blocks()
        {
            return Err(CoreError::InvalidArgument(format!(
                "the pool must have num_blocks = {} blocks, all free",
                config.num_blocks
            )));
        }
        let managers: Vec<_> = config.groups.iter().map(GroupSpec::manager).collect();
        let mut hit_order: Vec<usize> = (0..config.groups.len()).collect();
        hit_order.sort_by_key(|&group| config.groups[group].kind != AttentionKind::Full);
        let full_groups: Vec<usize> = (0..config.groups.len())
            .filter(|&group| config.groups[group].kind == AttentionKind::Full)
            .collect();
        let max_units = (0..config.groups.len())
            .map(|group| config.units_per_block(group))
            .max()
            .unwrap_or(1);
        let prefix_index_limit = 2 * config.num_blocks * max_units;
        let num_groups = config.groups.len();
        let evicted_keys = EvictedKeys::new(config.num_blocks * max_units);
        // Preempted requests kept at most: at least 16, so a configuration with few rows still
        // keeps some.
        let parked_limit = 4 * config.max_num_reqs.max(4);
        let max_num_reqs = config.max_num_reqs;
        let table = BlockTable::new(
            config.groups.len(),
            config.max_num_reqs,
            config.max_blocks_per_req(),
        );
        Ok(Coordinator {
            hasher: BlockHasher::new(config.hash, config.hash_seed),
            hit_alignment: config.hit_alignment().expect("validated"),
            free_rows: (0..config.max_num_reqs).rev().collect(),
            requests: slab::RequestSlab::new(config.max_num_reqs),
            rows_scratch: Vec::new(),
            num_references: vec![0; config.groups.len()],
            managers,
            hit_order,
            full_groups,
            keys: KeyLayout::new(&config),
            table,
            pool,
            config,
            hit_stats: HitStats::new(num_groups),
            evicted_keys,
            evicted_scratch: Vec::new(),
            batch_number: 0,
            scratch: Vec::new(),
            order_scratch: Vec::new(),
            low_scratch: Vec::new(),
            shared_scratch: Vec::new(),
            keyed_scratch: Vec::new(),
            block_copies: Vec::new(),
            prefix_index: HashMap::new(),
            prefix_index_limit,
            copy_epoch: 0,
            tail_replay_tokens: None,
            replay_exact_after: 0,
            tails: None,
            protected: None,
            parked: request::ParkedRequests::new(parked_limit),
            num_hashed: 0,
            spares: spares::Spares::new(max_num_reqs),
        })
    }

    pub fn config(&self) -> &CoordinatorConfig {
        &self.config
    }

    pub fn pool(&self) -> &P {
        &self.pool
    }

    pub fn table(&self) -> &BlockTable {
        &self.table
    }

    pub fn num_groups(&self) -> usize {
        self.config.groups.len()
    }

    pub fn max_blocks_per_req(&self) -> usize {
        self.table.shape()[2]
    }

    pub fn num_requests(&self) -> usize {
        self.requests.len()
    }

    /// Worst-case blocks (all groups) a request of `num_tokens` total tokens holds at once.
    pub fn max_blocks_needed(&self, num_tokens: usize) -> usize {
        let limits = AdmissionLimits {
            max_total_tokens: num_tokens,
            max_num_batched_tokens: self.config.max_num_batched_tokens,
        };
        self.managers
            .iter()
            .map(|manager| manager.max_live_blocks(limits))
            .sum()
    }

    /// Adds a request and returns its table row. Refuses a request that could never fit. A
    /// request preempted under the same id (`preempt_request`) is forgotten: this one starts
    /// over from its own tokens.
    pub fn add_request(&mut self, request: NewRequest<'_>) -> Result<usize, CoreError> {
        let prompt = request.prompt_token_ids;
        let max_total = request.max_total_tokens;
        self.check_new(request.request_id, prompt.len(), max_total, &request.extra)?;
        let mut tokens = self
            .spares
            .tokens(Self::token_capacity(prompt.len(), max_total));
        tokens.extend_from_slice(prompt);
        Ok(self.add_checked(request.request_id, tokens, max_total, request.extra))
    }

    /// An empty token vector with room for `capacity` tokens: a freed request's storage when
    /// one is kept (`spares`), else a new one. A caller converting a prompt for
    /// `add_request_owned` fills it, so the request reuses memory a finished one left warm.
    pub fn token_storage(&mut self, capacity: usize) -> Vec<u32> {
        self.spares.tokens(capacity)
    }

    /// `add_request` keeping `prompt`'s storage as the request's: no copy when it has room for
    /// `token_capacity(prompt.len(), max_total_tokens)` tokens (a caller converting a prompt
    /// from another representation allocates that much up front), else it grows once.
    pub fn add_request_owned(
        &mut self,
        request_id: u64,
        prompt: Vec<u32>,
        max_total_tokens: Option<usize>,
        extra: ExtraKeys,
    ) -> Result<usize, CoreError> {
        self.check_new(request_id, prompt.len(), max_total_tokens, &extra)?;
        let mut tokens = prompt;
        let capacity = Self::token_capacity(tokens.len(), max_total_tokens);
        tokens.reserve_exact(capacity - tokens.len());
        Ok(self.add_checked(request_id, tokens, max_total_tokens, extra))
    }

    /// The token storage a request of `prompt_len` tokens that may reach `max_total_tokens`
    /// gets: room for every token it may reach, so decode appends without copying what is
    /// there, and one more (the last sampled token is appended though never computed).
    pub fn token_capacity(prompt_len: usize, max_total_tokens: Option<usize>) -> usize {
        max_total_tokens.unwrap_or(prompt_len).max(prompt_len) + 1
    }

    /// Adds a request `check_new` accepted, its tokens in storage of `token_capacity`.
    fn add_checked(
        &mut self,
        request_id: u64,
        tokens: Vec<u32>,
        max_total_tokens: Option<usize>,
        extra: ExtraKeys,
    ) -> usize {
        self.parked.take(request_id);
        // Room for every block hash too.
        let max_len = max_total_tokens.unwrap_or(tokens.len());
        let chains = self
            .spares
            .hash_chains(&self.keys.chain_block_sizes, max_len);
        self.insert_request(request_id, tokens, extra, chains)
    }

    /// Frees a request's blocks and row as `free_request` does, and keeps its tokens (prompt
    /// and those appended), extra keys and block hashes, so `resume_request` re-adds it without
    /// copying or hashing them again (a preemption, or an admission that found no room). At
    /// most `4 * max(max_num_reqs, 4)` requests are kept; the oldest is forgotten beyond that (its
    /// `resume_request` then fails with `UnknownRequest` and the caller adds it anew).
    pub fn preempt_request(&mut self, request_id: u64) -> Result<(), CoreError> {
        let state = self.release_request(request_id)?;
        self.parked.keep(
            request_id,
            request::ParkedRequest {
                tokens: state.tokens,
                extra: state.extra,
                hash_chains: state.hash_chains,
            },
        );
        Ok(())
    }

    /// Re-adds a request `preempt_request` kept, with its kept tokens and hashes, and returns
    /// its row; the checks of `add_request` apply (`max_total_tokens` as there). `num_tokens`,
    /// when given, must equal the kept token count (a caller's check that nothing was appended
    /// meanwhile). On error nothing changes: the request stays kept.
    pub fn resume_request(
        &mut self,
        request_id: u64,
        max_total_tokens: Option<usize>,
        num_tokens: Option<usize>,
    ) -> Result<usize, CoreError> {
        let parked = self
            .parked
            .get(request_id)
            .ok_or(CoreError::UnknownRequest { request_id })?;
        if let Some(expected) = num_tokens.filter(|&count| count != parked.tokens.len()) {
            return Err(CoreError::InvalidArgument(format!(
                "request {request_id} was kept with {} tokens, not {expected}; add it anew",
                parked.tokens.len()
            )));
        }
        self.check_new(
            request_id,
            parked.tokens.len(),
            max_total_tokens,
            &parked.extra,
        )?;
        let parked = self.parked.take(request_id).expect("checked above");
        Ok(self.insert_request(request_id, parked.tokens, parked.extra, parked.hash_chains))
    }

    /// Forgets a request `preempt_request` kept (it finished or was aborted while waiting);
    /// false when none is kept under that id.
    pub fn forget_request(&mut self, request_id: u64) -> bool {
        self.parked.take(request_id).is_some()
    }

    /// `add_request`'s checks of a new request, nothing changed.
    fn check_new(
        &self,
        request_id: u64,
        prompt_len: usize,
        max_total_tokens: Option<usize>,
        extra: &ExtraKeys,
    ) -> Result<(), CoreError> {
        if prompt_len == 0 {
            return Err(CoreError::InvalidArgument(
                "the prompt must have at least one token".into(),
            ));
        }
        let max_total = max_total_tokens.unwrap_or(prompt_len);
        if max_total < prompt_len {
            return Err(CoreError::InvalidArgument(format!(
                "max_total_tokens ({max_total}) is below the prompt length ({prompt_len})"
            )));
        }
        if max_total > self.config.max_model_len {
            return Err(CoreError::RequestTooLarge(format!(
                "the request may reach {max_total} tokens but max_model_len is {}; shorten it \
                 or raise max_model_len",
                self.config.max_model_len
            )));
        }
        let needed = self.max_blocks_needed(max_total);
        let usable = self.config.num_blocks - 1;
        if needed > usable {
            return Err(CoreError::RequestTooLarge(format!(
                "a request of {max_total} tokens may hold {needed} blocks at once but the pool \
                 has {usable}; shorten it or give the pool more blocks"
            )));
        }
        extra.validate(prompt_len)?;
        if self.requests.contains_key(&request_id) {
            return Err(CoreError::DuplicateRequest { request_id });
        }
        if self.free_rows.is_empty() {
            return Err(CoreError::TooManyRequests {
                max_num_reqs: self.config.max_num_reqs,
            });
        }
        Ok(())
    }

    /// Inserts a checked request (`check_new`) and returns its row.
    fn insert_request(
        &mut self,
        request_id: u64,
        tokens: Vec<u32>,
        extra: ExtraKeys,
        hash_chains: Vec<Vec<BlockHash>>,
    ) -> usize {
        let row = self.free_rows.pop().expect("checked by check_new");
        let groups = self.spares.groups(self.managers.len());
        let state = RequestState::new(row, tokens, extra, hash_chains, groups);
        self.requests.insert(request_id, state);
        row
    }

    /// Appends sampled tokens so their blocks can be hashed and cached once full.
    pub fn append_token_ids(
        &mut self,
        request_id: u64,
        token_ids: &[u32],
    ) -> Result<(), CoreError> {
        let max_model_len = self.config.max_model_len;
        let state = self.request_mut(request_id)?;
        if state.tokens.len() + token_ids.len() > max_model_len {
            return Err(CoreError::InvalidArgument(format!(
                "request {request_id} would reach {} tokens, above max_model_len {max_model_len}",
                state.tokens.len() + token_ids.len()
            )));
        }
        state.tokens.extend_from_slice(token_ids);
        Ok(())
    }

    /// Appends one sampled token to each request (a decode step): `token_ids[i]` to
    /// `request_ids[i]`. Every entry is validated first (known id, no id twice, room below
    /// max_model_len), so an error changes nothing.
    pub fn append_token_ids_batch(
        &mut self,
        request_ids: &[u64],
        token_ids: &[u32],
    ) -> Result<(), CoreError> {
        if request_ids.len() != token_ids.len() {
            return Err(CoreError::InvalidArgument(format!(
                "{} request ids but {} token ids; give one token per request",
                request_ids.len(),
                token_ids.len()
            )));
        }
        let mut rows = std::mem::take(&mut self.rows_scratch);
        let found = self
            .requests
            .rows_of(request_ids.iter().copied(), &mut rows);
        let checked = found.and_then(|()| self.check_appends(request_ids, &rows));
        if checked.is_ok() {
            for (&row, &token) in rows.iter().zip(token_ids) {
                self.requests.at_mut(row).tokens.push(token);
            }
        }
        self.rows_scratch = rows;
        checked
    }

    /// `append_token_ids_batch`'s checks of the requests in `rows` (in the order of `ids`).
    fn check_appends(&mut self, request_ids: &[u64], rows: &[usize]) -> Result<(), CoreError> {
        self.batch_number += 1;
        let (batch_number, max_model_len) = (self.batch_number, self.config.max_model_len);
        for (&request_id, &row) in request_ids.iter().zip(rows) {
            let state = self.requests.at_mut(row);
            if state.last_batch == batch_number {
                return Err(CoreError::InvalidArgument(format!(
                    "request {request_id} appears twice in one append_token_ids_batch call"
                )));
            }
            if state.tokens.len() >= max_model_len {
                return Err(CoreError::InvalidArgument(format!(
                    "request {request_id} already has max_model_len ({max_model_len}) tokens"
                )));
            }
            state.last_batch = batch_number;
        }
        Ok(())
    }

    /// Tokens known for a request: prompt plus appended.
    pub fn num_tokens(&self, request_id: u64) -> Result<usize, CoreError> {
        Ok(self.request(request_id)?.tokens.len())
    }

    /// The table row of a request.
    pub fn row_of(&self, request_id: u64) -> Result<usize, CoreError> {
        Ok(self.request(request_id)?.row)
    }

    /// A request's blocks in one group (its table row).
    pub fn request_blocks(&self, request_id: u64, group: usize) -> Result<&[BlockId], CoreError> {
        let state = self.request(request_id)?;
        let blocks = state.groups.get(group).ok_or(CoreError::InvalidGroup {
            group: group as u32,
            num_groups: self.num_groups(),
        })?;
        Ok(&blocks.blocks)
    }

    /// Non-null table entries per group (a block shared by two requests counts twice).
    pub fn num_used_blocks_per_group(&self) -> &[usize] {
        &self.num_references
    }

    /// Forgets every cached block; refused (false) while any block is in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        // The keys a reset drops left the cache.
        let reset = (self.pool).reset_prefix_cache_noting(&mut self.evicted_scratch);
        self.evicted_keys.insert_all(&mut self.evicted_scratch);
        if reset {
            self.prefix_index.clear();
            if let Some(tails) = &mut self.tails {
                tails.clear();
            }
            if let Some(protected) = &mut self.protected {
                protected.clear();
            }
        }
        reset
    }

    /// The page copies `allocate` calls asked for since the last call, which the caller must
    /// carry out (every layer slot's page `src` into page `dst`) before running the step those
    /// allocations were for. A hit that ends inside a block another request uses (or that
    /// stays cached for others) gets a new block holding a copy; the source stays held until
    /// the request's next `allocate` or its free. A caller that never takes them loses nothing
    /// but the copied KV (the list keeps at most one step's worth).
    pub fn take_block_copies(&mut self) -> Vec<BlockCopy> {
        self.copy_epoch += 1;
        std::mem::take(&mut self.block_copies)
    }

    /// Lets cache hits replay a lost window tail: `replay_tokens` is `R`, the tokens before the
    /// full-attention hit point that the windowed layers must recompute to rebuild their
    /// windows there (for sliding windows `W_l` of the windowed layers in model order, the sum
    /// of `W_l - 1`); `None` turns replay off. A replay from `S` caches its windowed blocks
    /// that start at `S + R - (W_min - 1)` or later (every windowed layer's KV is right there:
    /// layer l's from `S` plus the `W_j - 1` of the windowed layers below it). Refused for a model without both a
    /// full-attention and a sliding-window group, or with a chunked-local group (its layers
    /// would need a different rule).
    pub fn set_tail_replay(&mut self, replay_tokens: Option<usize>) -> Result<(), CoreError> {
        if let Some(tokens) = replay_tokens {
            let kinds = || self.config.groups.iter().map(|spec| spec.kind);
            let has_full = kinds().any(|kind| kind == AttentionKind::Full);
            let has_window =
                kinds().any(|kind| matches!(kind, AttentionKind::SlidingWindow { .. }));
            let has_chunk = kinds().any(|kind| matches!(kind, AttentionKind::ChunkedLocal { .. }));
            if !has_full || !has_window || has_chunk {
                return Err(CoreError::InvalidArgument(
                    "tail replay needs full-attention and sliding-window groups and no \
                     chunked-local group; turn it off for this model"
                        .into(),
                ));
            }
            if tokens == 0 {
                return Err(CoreError::InvalidArgument(
                    "tail replay tokens must be at least 1 (the windows' W - 1 summed)".into(),
                ));
            }
            let smallest_window = kinds()
                .filter_map(|kind| match kind {
                    AttentionKind::SlidingWindow { window } => Some(window),
                    _ => None,
                })
                .min()
                .expect("checked above");
            self.replay_exact_after = tokens.saturating_sub(smallest_window - 1);
        }
        self.tail_replay_tokens = replay_tokens;
        Ok(())
    }

    /// Token tails on or off (off by default): when on, a freed request's last, partly filled
    /// block in each group is cached under a key of exactly the tokens it holds, and a hit may
    /// end there, inside a block, when every group has it (see `tails`): the next turn of a
    /// conversation then hits every token the previous turn computed, not only up to the last
    /// multiple of the hit alignment. In a group keyed by sub-blocks the tail key takes the
    /// place of the partial key of the tail's whole units. Turning them off forgets the tails
    /// recorded (their blocks stay cached until evicted).
    pub fn set_token_tails(&mut self, on: bool) {
        self.tails = on.then(|| {
            self.tails
                .take()
                .unwrap_or_else(|| tails::TailIndex::new(self.config.num_blocks))
        });
    }

    /// Protects freed chains against cyclic reuse (see `protect`): a freed request whose blocks
    /// fit under `budget` protected free blocks joins the `High` free tier, evicted after every
    /// other free block. `None` (the default): every freed request joins `Normal` (plain LRU).
    pub fn set_protected_blocks(&mut self, budget: Option<usize>) {
        self.protected =
            budget.map(|budget| protect::Protected::new(self.config.num_blocks, budget));
    }

    /// Free blocks currently protected (`set_protected_blocks`), as the coordinator counts them.
    pub fn num_protected_blocks(&self) -> usize {
        self.protected.as_ref().map_or(0, protect::Protected::count)
    }

    /// The full-attention hit point of the tail replay the request's hit took (0 without one):
    /// until its computed tokens reach it, the caller must not write full-attention KV for
    /// positions below it (those slots hold the cached KV the replay reads).
    pub fn replay_frontier(&self, request_id: u64) -> Result<usize, CoreError> {
        Ok(self.request(request_id)?.replay_frontier)
    }

    /// Every cached block of the pool with its key (group and hash), by block id: a read-only
    /// view for tests and debugging (reads every block).
    pub fn cached_blocks(&self) -> Vec<(BlockId, CacheKey)> {
        self.pool.cached_blocks()
    }

    /// The pool's free blocks in eviction order (first evicted first): a read-only view for
    /// tests and debugging, meant for a pool no other thread changes meanwhile.
    pub fn free_queue_order(&self) -> Vec<BlockId> {
        self.pool.free_queue_order()
    }

    /// Prompt tokens looked up in the prefix cache so far (`stats().prefix_queries`, without
    /// the rest of the figures): every prefix-cache counter moves only when this one does.
    pub fn num_prefix_queries(&self) -> u64 {
        self.hit_stats.queries
    }

    pub fn stats(&self) -> CoordinatorStats {
        CoordinatorStats {
            pool: self.pool.stats(),
            prefix_queries: self.hit_stats.queries,
            prefix_hits: self.hit_stats.hits,
            hits: self.hit_stats.clone(),
            hashed_blocks: self.num_hashed,
            parked_requests: self.parked.len(),
        }
    }

    fn request(&self, request_id: u64) -> Result<&RequestState, CoreError> {
        self.requests
            .get(&request_id)
            .ok_or(CoreError::UnknownRequest { request_id })
    }

    fn request_mut(&mut self, request_id: u64) -> Result<&mut RequestState, CoreError> {
        self.requests
            .get_mut(&request_id)
            .ok_or(CoreError::UnknownRequest { request_id })
    }

    /// Extends the request's hash chains to every full block of its known tokens; returns how
    /// many blocks it hashed.
    fn extend_hashes(
        hasher: &BlockHasher,
        chain_block_sizes: &[usize],
        state: &mut RequestState,
    ) -> u64 {
        Self::extend_hashes_within(hasher, chain_block_sizes, state, usize::MAX)
    }

    /// `extend_hashes` over the first `limit` tokens only.
    fn extend_hashes_within(
        hasher: &BlockHasher,
        chain_block_sizes: &[usize],
        state: &mut RequestState,
        limit: usize,
    ) -> u64 {
        let chains = &mut state.hash_chains;
        let before: usize = chains.iter().map(Vec::len).sum();
        let tokens = &state.tokens[..limit.min(state.tokens.len())];
        extend_chains(hasher, chain_block_sizes, tokens, &state.extra, chains);
        (chains.iter().map(Vec::len).sum::<usize>() - before) as u64
    }
}

/// Extends `chains[c]` (blocks of `chain_block_sizes[c]` tokens) to every full block of `tokens`.
fn extend_chains(
    hasher: &BlockHasher,
    chain_block_sizes: &[usize],
    tokens: &[u32],
    extra: &ExtraKeys,
    chains: &mut [Vec<BlockHash>],
) {
    for (chain, &block_size) in chains.iter_mut().zip(chain_block_sizes) {
        hasher.extend_chain(tokens, block_size, extra, chain);
    }
}
