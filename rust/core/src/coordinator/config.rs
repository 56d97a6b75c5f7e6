//! Coordinator configuration: the groups and the limits, validated once at construction.

use crate::error::CoreError;
use crate::hashing::HashAlgo;
use crate::manager::{
    AttentionManager, ChunkedLocalManager, FullAttentionManager, SlidingWindowManager,
};

/// The attention type of a group's layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    Full,
    /// Each query sees the last `window` tokens, itself included.
    SlidingWindow {
        window: usize,
    },
    /// Each query sees the tokens of its own chunk of `chunk` tokens.
    ChunkedLocal {
        chunk: usize,
    },
}

/// One KV-cache group: layers of one attention kind sharing one block table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupSpec {
    pub kind: AttentionKind,
    /// Tokens per block.
    pub block_size: usize,
}

impl GroupSpec {
    /// Checks the sizes; `group` only names the group in the message.
    pub fn validate(&self, group: usize) -> Result<(), CoreError> {
        let invalid = |message: String| Err(CoreError::InvalidArgument(message));
        if self.block_size == 0 {
            return invalid(format!("group {group}: block_size must be at least 1"));
        }
        match self.kind {
            AttentionKind::Full => Ok(()),
            AttentionKind::SlidingWindow { window: 0 } => invalid(format!(
                "group {group}: the sliding window must be at least 1 token"
            )),
            AttentionKind::ChunkedLocal { chunk } if chunk == 0 || chunk % self.block_size != 0 => {
                invalid(format!(
                    "group {group}: the chunk ({chunk}) must be a positive multiple of the \
                     block size ({})",
                    self.block_size
                ))
            }
            _ => Ok(()),
        }
    }

    pub(crate) fn manager(&self) -> Box<dyn AttentionManager> {
        match self.kind {
            AttentionKind::Full => Box::new(FullAttentionManager::new(self.block_size)),
            AttentionKind::SlidingWindow { window } => {
                Box::new(SlidingWindowManager::new(self.block_size, window))
            }
            AttentionKind::ChunkedLocal { chunk } => {
                Box::new(ChunkedLocalManager::new(self.block_size, chunk))
            }
        }
    }
}

/// Everything a coordinator is built from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// Blocks in the pool, the null block included.
    pub num_blocks: usize,
    pub groups: Vec<GroupSpec>,
    /// Rows of the block table: most requests added at once.
    pub max_num_reqs: usize,
    /// Most tokens (prompt plus output) of one request.
    pub max_model_len: usize,
    /// Most tokens computed for one request in one step.
    pub max_num_batched_tokens: usize,
    pub enable_prefix_caching: bool,
    pub hash: HashAlgo,
    pub hash_seed: u64,
}

/// Most entries of the block table (groups x rows x blocks per row), so it stays addressable
/// by Python and kernels with 32-bit offsets.
const MAX_TABLE_ENTRIES: usize = 1 << 31;

impl CoordinatorConfig {
    /// Checks every field; the pool checks `num_blocks`.
    pub fn validate(&self) -> Result<(), CoreError> {
        let invalid = |message: &str| Err(CoreError::InvalidArgument(message.to_string()));
        if self.groups.is_empty() {
            return invalid("give at least one group");
        }
        if self.groups.len() > u32::MAX as usize {
            return invalid("too many groups");
        }
        for (group, spec) in self.groups.iter().enumerate() {
            spec.validate(group)?;
        }
        if self.max_num_reqs == 0 {
            return invalid("max_num_reqs must be at least 1");
        }
        if self.max_model_len == 0 {
            return invalid("max_model_len must be at least 1");
        }
        if self.max_num_batched_tokens == 0 {
            return invalid("max_num_batched_tokens must be at least 1");
        }
        if self.hit_alignment().is_none() {
            return invalid("the lcm of the group block sizes overflows; use block sizes that divide each other");
        }
        let entries = self
            .groups
            .len()
            .checked_mul(self.max_num_reqs)
            .and_then(|rows| rows.checked_mul(self.max_blocks_per_req()));
        if !matches!(entries, Some(entries) if entries <= MAX_TABLE_ENTRIES) {
            return invalid(
                "the block table (groups x max_num_reqs x max blocks per request) exceeds 2^31 \
                 entries; lower max_num_reqs or max_model_len, or use larger blocks",
            );
        }
        Ok(())
    }

    /// Hit lengths are multiples of this: the lcm of the groups' hit granularities (their block
    /// sizes, or the key unit for groups keyed by sub-blocks, see `units_per_block`).
    pub fn hit_alignment(&self) -> Option<usize> {
        (0..self.groups.len()).try_fold(1usize, |lcm, group| {
            let granularity = self.hit_granularity(group);
            (lcm / gcd(lcm, granularity)).checked_mul(granularity)
        })
    }

    /// Tokens per entry of the hash chain that keys sub-blocks: the smallest block size.
    pub fn key_unit(&self) -> usize {
        self.groups
            .iter()
            .map(|spec| spec.block_size)
            .min()
            .unwrap_or(1)
            .max(1)
    }

    /// Key units one block of `group` spans. A full-attention group whose block size is a
    /// multiple `k > 1` of the key unit is keyed by sub-blocks: its blocks carry keys of the
    /// unit-sized chain, and a hit may end inside one of its blocks, at any multiple of the
    /// unit (the per-type layout's long full-attention blocks then hit as finely as the
    /// windowed ones). Every other group: 1 (keyed by a chain of its own block size).
    pub fn units_per_block(&self, group: usize) -> usize {
        let spec = &self.groups[group];
        let unit = self.key_unit();
        match spec.kind {
            AttentionKind::Full if spec.block_size.is_multiple_of(unit) => spec.block_size / unit,
            _ => 1,
        }
    }

    /// Tokens a hit length must be a multiple of for `group`.
    pub fn hit_granularity(&self, group: usize) -> usize {
        match self.units_per_block(group) {
            1 => self.groups[group].block_size,
            _ => self.key_unit(),
        }
    }

    /// Tokens per entry of the hash chain `group`'s keys come from.
    pub fn chain_block_size(&self, group: usize) -> usize {
        self.groups[group].block_size / self.units_per_block(group)
    }

    /// Width of a table row: enough blocks of the smallest size for `max_model_len` tokens.
    pub fn max_blocks_per_req(&self) -> usize {
        self.max_model_len.div_ceil(self.key_unit())
    }
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}
