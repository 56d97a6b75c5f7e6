//! The storage of finished requests, kept for the next ones.
//!
//! A request owns a few vectors sized for every token it may reach (its tokens, its hash
//! chains, one table row per group). Freeing one used to hand them back to the allocator, and
//! adding the next one asked for them anew: for a long request that is a few large frees and
//! allocations per request, and fresh memory the first writes fault in or find cold. A freed
//! request's vectors are kept here instead, emptied, and the next request added takes them
//! (the most recently freed first: the warmest).
//!
//! Bound: at most `limit` (the coordinator's `max_num_reqs`) of each kind are kept, and a kept
//! vector is never larger than the request it came from, so what is kept is at most what
//! `max_num_reqs` requests held at once; a vector too small for the request that takes it is
//! dropped and a new one allocated. A preempted request's vectors go with it
//! (`ParkedRequests`), not here.

use crate::manager::GroupBlocks;
use crate::types::BlockHash;

use super::request::RequestState;

/// Emptied vectors of freed requests (module docs).
#[derive(Debug)]
pub(super) struct Spares {
    tokens: Vec<Vec<u32>>,
    hash_chains: Vec<Vec<Vec<BlockHash>>>,
    groups: Vec<Vec<GroupBlocks>>,
    /// Most vectors of each kind kept.
    limit: usize,
}

impl Spares {
    pub(super) fn new(limit: usize) -> Self {
        Spares {
            tokens: Vec::new(),
            hash_chains: Vec::new(),
            groups: Vec::new(),
            limit,
        }
    }

    /// Keeps the vectors of a freed request (its blocks already released), emptied.
    pub(super) fn keep(&mut self, state: RequestState) {
        let RequestState {
            tokens,
            hash_chains,
            mut groups,
            ..
        } = state;
        self.keep_storage(tokens, hash_chains);
        if self.groups.len() < self.limit {
            for group in &mut groups {
                let mut blocks = std::mem::take(&mut group.blocks);
                blocks.clear();
                *group = GroupBlocks {
                    blocks,
                    ..GroupBlocks::default()
                };
            }
            self.groups.push(groups);
        }
    }

    /// Keeps a token vector and hash chains (a freed request's, or those of a request whose
    /// add failed while its prompt was read), emptied.
    pub(super) fn keep_storage(
        &mut self,
        mut tokens: Vec<u32>,
        mut hash_chains: Vec<Vec<BlockHash>>,
    ) {
        if self.tokens.len() < self.limit {
            tokens.clear();
            self.tokens.push(tokens);
        }
        if self.hash_chains.len() < self.limit {
            hash_chains.iter_mut().for_each(Vec::clear);
            self.hash_chains.push(hash_chains);
        }
    }

    /// An empty token vector with room for `capacity` tokens.
    pub(super) fn tokens(&mut self, capacity: usize) -> Vec<u32> {
        match self.tokens.pop() {
            Some(tokens) if tokens.capacity() >= capacity => tokens,
            _ => Vec::with_capacity(capacity),
        }
    }

    /// Empty hash chains, one per block size in `block_sizes`, each with room for the hashes
    /// of `max_tokens` tokens.
    pub(super) fn hash_chains(
        &mut self,
        block_sizes: &[usize],
        max_tokens: usize,
    ) -> Vec<Vec<BlockHash>> {
        match self.hash_chains.pop() {
            Some(chains)
                if chains.len() == block_sizes.len()
                    && (chains.iter().zip(block_sizes))
                        .all(|(chain, &size)| chain.capacity() >= max_tokens / size) =>
            {
                chains
            }
            _ => block_sizes
                .iter()
                .map(|&size| Vec::with_capacity(max_tokens / size))
                .collect(),
        }
    }

    /// `num_groups` empty table rows.
    pub(super) fn groups(&mut self, num_groups: usize) -> Vec<GroupBlocks> {
        match self.groups.pop() {
            Some(groups) if groups.len() == num_groups => groups,
            _ => vec![GroupBlocks::default(); num_groups],
        }
    }

    /// Vectors kept, of each kind (tokens, hash chains, rows).
    #[cfg(test)]
    pub(super) fn len(&self) -> [usize; 3] {
        [self.tokens.len(), self.hash_chains.len(), self.groups.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::ExtraKeys;

    fn state(tokens: usize, hashes: usize, blocks: usize) -> RequestState {
        let row = GroupBlocks {
            blocks: vec![3; blocks],
            num_released: 1,
            num_cached: 2,
        };
        let chains = vec![vec![BlockHash(9); hashes]];
        let extra = ExtraKeys::default();
        RequestState::new(0, vec![7; tokens], extra, chains, vec![row; 2])
    }

    #[test]
    fn a_kept_request_hands_its_vectors_over_empty() {
        let mut spares = Spares::new(4);
        let freed = state(100, 6, 5);
        let token_storage = freed.tokens.as_ptr();
        spares.keep(freed);
        assert_eq!(spares.len(), [1, 1, 1]);
        let tokens = spares.tokens(80);
        assert_eq!(
            tokens.as_ptr(),
            token_storage,
            "the freed request's storage"
        );
        assert!(tokens.is_empty() && tokens.capacity() >= 100);
        let chains = spares.hash_chains(&[16], 6 * 16);
        assert_eq!(chains.len(), 1);
        assert!(chains[0].is_empty() && chains[0].capacity() >= 6);
        let groups = spares.groups(2);
        assert!(groups.iter().all(|group| group.blocks.is_empty()
            && group.num_released == 0
            && group.num_cached == 0));
        assert_eq!(spares.len(), [0, 0, 0]);
    }

    #[test]
    fn vectors_too_small_or_shaped_otherwise_are_replaced() {
        let mut spares = Spares::new(4);
        spares.keep(state(10, 1, 1));
        let tokens = spares.tokens(500);
        assert!(
            tokens.capacity() >= 500,
            "a new vector with the room asked for"
        );
        let chains = spares.hash_chains(&[16, 32], 64);
        assert_eq!(chains.len(), 2, "one chain per block size");
        assert!(chains[0].capacity() >= 4 && chains[1].capacity() >= 2);
        assert_eq!(spares.groups(3).len(), 3);
        assert_eq!(spares.len(), [0, 0, 0], "the unsuitable ones are dropped");
    }

    #[test]
    fn at_most_the_limit_is_kept() {
        let mut spares = Spares::new(2);
        for _ in 0..5 {
            spares.keep(state(8, 1, 1));
        }
        assert_eq!(spares.len(), [2, 2, 2]);
        assert!(Spares::new(0).tokens(3).capacity() >= 3);
    }
}
