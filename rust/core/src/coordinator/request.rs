//! What the coordinator knows about one request.

use std::collections::{HashMap, VecDeque};

use super::quiet::QuietBounds;
use super::HitStats;
use crate::hashing::ExtraKeys;
use crate::manager::GroupBlocks;
use crate::types::{BlockHash, BlockId, CacheKey};

#[derive(Debug)]
pub struct RequestState {
    /// The request's rows in the block table (the same row index in every group).
    pub row: usize,
    /// Prompt plus appended (sampled) token ids.
    pub tokens: Vec<u32>,
    pub extra: ExtraKeys,
    /// Tokens computed as of the last `allocate`; never decreases.
    pub num_computed: usize,
    /// Tokens with slots: the largest `num_computed + num_new` allocated so far.
    pub num_allocated: usize,
    /// Chained hashes of the full blocks, one chain per distinct block size.
    pub hash_chains: Vec<Vec<BlockHash>>,
    /// The request's blocks, one entry per group.
    pub groups: Vec<GroupBlocks>,
    /// A hit found by `find_cache_hit`, applied by the first `allocate`.
    pub pending_hit: Option<PendingHit>,
    /// Tokens of the hit the first `allocate` took (0 without one).
    pub hit_tokens: usize,
    /// Marks the request as seen in the `allocate_batch` call with this number.
    pub last_batch: u64,
    /// Sources of the block copies its hit asked for, held until its next `allocate` (the
    /// step that needed the copies has run by then) or its free.
    pub copy_sources: Vec<BlockId>,
    /// The full-attention hit point of the tail replay its hit took (0 without one).
    pub replay_frontier: usize,
    /// Its last `find_cache_hit`'s figures, added to the counters when an `allocate` first
    /// gives it slots beyond its hit (dropped if it is freed before).
    pub pending_lookup: Option<HitStats>,
    /// Counts within which an `allocate` without a hit changes no block, as of its last
    /// `allocate` that changed some (zero before the first: nothing holds).
    pub quiet: QuietBounds,
}

impl RequestState {
    /// A request just added in `row`: nothing computed, allocated or looked up yet.
    pub fn new(
        row: usize,
        tokens: Vec<u32>,
        extra: ExtraKeys,
        hash_chains: Vec<Vec<BlockHash>>,
        groups: Vec<GroupBlocks>,
    ) -> Self {
        RequestState {
            row,
            tokens,
            extra,
            num_computed: 0,
            num_allocated: 0,
            hash_chains,
            groups,
            pending_hit: None,
            hit_tokens: 0,
            last_batch: 0,
            copy_sources: Vec::new(),
            replay_frontier: 0,
            pending_lookup: None,
            quiet: QuietBounds::default(),
        }
    }
}

/// A cache hit found but not yet taken.
#[derive(Debug, Clone)]
pub struct PendingHit {
    pub num_tokens: usize,
    /// Per group, the table prefix of the hit (null entries, then the cached blocks).
    pub rows: Vec<Vec<BlockId>>,
    /// Per group, how the hit ends when it ends inside a block (groups keyed by sub-blocks).
    pub ends: Vec<Option<HitEnd>>,
    /// A tail replay's full-attention hit point `F > num_tokens` (0 for a plain hit): the
    /// full-attention rows hold `F` tokens, the windowed rows start over at `num_tokens`.
    pub frontier: usize,
}

impl PendingHit {
    /// Whether group `group`'s hit ends in a block the request takes (its row's last entry).
    pub fn takes(&self, group: usize) -> bool {
        matches!(self.ends[group], Some(HitEnd::Take { .. }))
    }

    /// The key block `index` of group `group`'s row is taken under, when it is the block the
    /// hit ends inside and the request takes it (`None` for a shared block).
    pub fn taken_key(&self, group: usize, index: usize) -> Option<CacheKey> {
        match self.ends[group] {
            Some(HitEnd::Take { key, .. }) if index + 1 == self.rows[group].len() => Some(key),
            _ => None,
        }
    }
}

/// The block a hit ends inside: the request writes its remaining slots, so it cannot share it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HitEnd {
    /// A free block cached under `key` (a freed request's tail, or a full block nobody uses):
    /// the request takes it for itself; it is the row's last entry.
    Take {
        block: BlockId,
        key: CacheKey,
        filled: usize,
    },
    /// `src`, cached under its full key `key`, holds the hit's first `filled` units but cannot
    /// be taken (another request holds it, or it holds more than the hit and stays cached for
    /// others): the request gets a new block for the entry after the row, and the caller copies
    /// `src`'s page into it before the step runs (`Coordinator::take_block_copies`).
    Copy {
        src: BlockId,
        key: CacheKey,
        filled: usize,
    },
}

impl HitEnd {
    /// Units of the block the hit may use.
    pub fn filled(&self) -> usize {
        match *self {
            HitEnd::Take { filled, .. } | HitEnd::Copy { filled, .. } => filled,
        }
    }
}

/// What `Coordinator::resume_request` needs of a preempted request.
#[derive(Debug)]
pub struct ParkedRequest {
    pub tokens: Vec<u32>,
    pub extra: ExtraKeys,
    pub hash_chains: Vec<Vec<BlockHash>>,
}

/// Preempted requests kept for `resume_request`, at most `limit`, the oldest forgotten first.
#[derive(Debug)]
pub struct ParkedRequests {
    /// Each kept request with the number it was kept under.
    requests: HashMap<u64, (u64, ParkedRequest)>,
    /// `(id, number)` in the order they were kept; entries whose request was taken (or kept
    /// again under a later number) are skipped when met.
    order: VecDeque<(u64, u64)>,
    next_number: u64,
    limit: usize,
}

impl ParkedRequests {
    pub fn new(limit: usize) -> Self {
        ParkedRequests {
            requests: HashMap::new(),
            order: VecDeque::new(),
            next_number: 0,
            limit: limit.max(1),
        }
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn get(&self, request_id: u64) -> Option<&ParkedRequest> {
        self.requests.get(&request_id).map(|(_, parked)| parked)
    }

    pub fn take(&mut self, request_id: u64) -> Option<ParkedRequest> {
        self.requests.remove(&request_id).map(|(_, parked)| parked)
    }

    /// Keeps `parked` under `request_id`, forgetting the oldest kept request beyond the limit.
    pub fn keep(&mut self, request_id: u64, parked: ParkedRequest) {
        let number = self.next_number;
        self.next_number += 1;
        self.requests.insert(request_id, (number, parked));
        self.order.push_back((request_id, number));
        while self.requests.len() > self.limit {
            let (oldest, number) = self.order.pop_front().expect("every kept id is queued");
            if self
                .requests
                .get(&oldest)
                .is_some_and(|(kept, _)| *kept == number)
            {
                self.requests.remove(&oldest);
            }
        }
        // Entries of requests taken since stay queued until met: bound them too.
        if self.order.len() > 2 * self.limit {
            let requests = &self.requests;
            self.order
                .retain(|(id, number)| requests.get(id).is_some_and(|(kept, _)| kept == number));
        }
    }
}
