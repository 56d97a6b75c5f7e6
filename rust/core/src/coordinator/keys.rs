//! The cache key of each block of a request, from its hash chains.
//!
//! A group with one key unit per block keys block `i` with entry `i` of the chain of its own
//! block size. A group keyed by sub-blocks (`k` units per block, see
//! [`super::CoordinatorConfig::units_per_block`]) uses the unit-sized chain: entry `j` names
//! the prefix up to the end of unit `j`, so
//!
//! ```text
//!   full block i                     -> entry (i + 1) k - 1
//!   block i holding its first m < k -> entry i k + m - 1      (a partial key)
//!   k = 5:  block 0 = units 0..5: full key = entry 4; first 3 units only = entry 2
//! ```
//!
//! A full key and a partial key never coincide: they name prefixes of different lengths.

use crate::allocator::BlockAllocator;
use crate::error::CoreError;
use crate::manager::GroupBlocks;
use crate::types::{BlockHash, CacheKey, GroupId, NULL_BLOCK};

/// One group's view of a request's hash chain.
#[derive(Clone, Copy, Debug)]
pub(super) struct GroupKeys<'a> {
    pub group: usize,
    pub hashes: &'a [BlockHash],
    /// Key units per block (1 unless keyed by sub-blocks).
    pub units: usize,
}

impl GroupKeys<'_> {
    fn key(&self, entry: usize) -> CacheKey {
        CacheKey {
            group: self.group as GroupId,
            hash: self.hashes[entry],
        }
    }

    /// Blocks whose every unit is hashed.
    pub fn num_full(&self) -> usize {
        self.hashes.len() / self.units
    }

    /// The key of full block `index` (it must be hashed: `index < num_full()`).
    pub fn full(&self, index: usize) -> CacheKey {
        self.key((index + 1) * self.units - 1)
    }

    /// The chain entries that key unit `unit` when cached: its block's keys that cover it (the
    /// full key, and the partial keys of at least `unit`'s units), those the request has.
    pub fn covering(&self, unit: usize) -> &[BlockHash] {
        let block_end = (unit / self.units + 1) * self.units;
        let end = block_end.min(self.hashes.len());
        self.hashes.get(unit..end).unwrap_or(&[])
    }

    /// The key of block `index` holding its first `filled` units (`1..=units`; `units` is the
    /// full key), if the request has that many units hashed.
    pub fn partial(&self, index: usize, filled: usize) -> Option<CacheKey> {
        debug_assert!((1..=self.units).contains(&filled));
        let entry = index * self.units + filled - 1;
        (entry < self.hashes.len()).then(|| self.key(entry))
    }
}

/// Which hash chain each group's keys come from, and its units per block.
#[derive(Debug)]
pub(super) struct KeyLayout {
    /// Distinct chain block sizes; a request keeps one chain per entry.
    pub chain_block_sizes: Vec<usize>,
    chain_of_group: Vec<usize>,
    units: Vec<usize>,
}

impl KeyLayout {
    pub fn new(config: &super::CoordinatorConfig) -> Self {
        let mut chain_block_sizes: Vec<usize> = Vec::new();
        let mut chain_of_group = Vec::with_capacity(config.groups.len());
        let mut units = Vec::with_capacity(config.groups.len());
        for group in 0..config.groups.len() {
            let size = config.chain_block_size(group);
            let chain = match chain_block_sizes.iter().position(|&b| b == size) {
                Some(chain) => chain,
                None => {
                    chain_block_sizes.push(size);
                    chain_block_sizes.len() - 1
                }
            };
            chain_of_group.push(chain);
            units.push(config.units_per_block(group));
        }
        KeyLayout {
            chain_block_sizes,
            chain_of_group,
            units,
        }
    }

    /// Group `group`'s view of a request's chains.
    pub fn keys<'a>(&self, chains: &'a [Vec<BlockHash>], group: usize) -> GroupKeys<'a> {
        GroupKeys {
            group,
            hashes: &chains[self.chain_of_group[group]],
            units: self.units[group],
        }
    }
}

/// When a request is freed: in a group keyed by sub-blocks, caches the block its computed
/// tokens end inside under the partial key of its whole units, so the next turn of a
/// conversation can take it (`BlockAllocator::take_cached`) and hit up to that unit instead of
/// the last block boundary. Nothing happens in other groups or when no whole unit is there.
pub(super) fn cache_partial_tail<P: BlockAllocator>(
    pool: &P,
    keys: GroupKeys<'_>,
    blocks: &GroupBlocks,
    block_size: usize,
    num_computed: usize,
) -> Result<(), CoreError> {
    if keys.units == 1 {
        return Ok(());
    }
    let index = num_computed / block_size;
    let filled = num_computed % block_size / (block_size / keys.units);
    let block = blocks.blocks.get(index).copied().unwrap_or(NULL_BLOCK);
    if filled == 0 || block == NULL_BLOCK {
        return Ok(());
    }
    let Some(key) = keys.partial(index, filled) else {
        return Ok(());
    };
    pool.cache_block(block, key).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_unit_is_covered_by_its_block_keys_from_its_own_on() {
        let hashes: Vec<BlockHash> = (0..7u128).map(BlockHash).collect();
        let keys = GroupKeys {
            group: 0,
            hashes: &hashes,
            units: 3,
        };
        // Block 0 = entries 0..3 (full key 2), block 1 = 3..6 (full key 5), block 2 = 6 only.
        assert_eq!(keys.covering(0), &hashes[0..3]);
        assert_eq!(keys.covering(1), &hashes[1..3]);
        assert_eq!(keys.covering(2), &hashes[2..3]);
        assert_eq!(keys.covering(3), &hashes[3..6]);
        assert_eq!(keys.covering(6), &hashes[6..7]);
        assert!(keys.covering(7).is_empty() && keys.covering(9).is_empty());
        let one = GroupKeys { units: 1, ..keys };
        assert_eq!(one.covering(4), &hashes[4..5]);
    }
}
