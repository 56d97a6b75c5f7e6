//! The bounds within which an `allocate` changes no block, kept per request so that a decode
//! step checks three numbers instead of asking every group's manager.
//!
//! An `allocate` without a hit, to `total` tokens of which `computed` are computed and `known`
//! (at most `total`) have their ids, leaves a group's blocks as they are when
//!
//! ```text
//!   nothing to release   num_released_blocks(computed).min(len) <= num_released
//!   no new block         total <= len * B
//!   no block newly full  (known / B).min(len) <= num_cached        (caching on)
//! ```
//!
//! Each side grows with its count, so each holds below a threshold that only the group's
//! `len`, `num_released` and `num_cached` decide; those change only when an `allocate` does
//! more than move the counters, after which the bounds are computed again.

use crate::manager::{AttentionManager, GroupBlocks};

/// An `allocate` without a hit changes no block while `computed < release_at`,
/// `total <= cover_upto` and `known < fill_at` (the least bound over the groups). The default
/// (all zero) holds for nothing: the full path runs and computes the bounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QuietBounds {
    release_at: usize,
    cover_upto: usize,
    fill_at: usize,
}

impl QuietBounds {
    /// The bounds of the groups' blocks as they are now (`caching`: prefix caching on).
    pub fn of(
        managers: &[Box<dyn AttentionManager>],
        groups: &[GroupBlocks],
        caching: bool,
    ) -> Self {
        let mut bounds = QuietBounds {
            release_at: usize::MAX,
            cover_upto: usize::MAX,
            fill_at: usize::MAX,
        };
        for (manager, blocks) in managers.iter().zip(groups) {
            let block_size = manager.block_size();
            let len = blocks.blocks.len();
            if len > blocks.num_released {
                let next = (blocks.num_released + 1).saturating_mul(block_size);
                bounds.release_at = bounds.release_at.min(manager.first_skipping(next));
            }
            bounds.cover_upto = bounds.cover_upto.min(len.saturating_mul(block_size));
            if caching && len > blocks.num_cached {
                let next = (blocks.num_cached + 1).saturating_mul(block_size);
                bounds.fill_at = bounds.fill_at.min(next);
            }
        }
        bounds
    }

    /// Whether an `allocate` without a hit may release blocks at `computed` tokens (false:
    /// its window skips no held block).
    #[inline]
    pub fn may_release(&self, computed: usize) -> bool {
        computed >= self.release_at
    }

    /// Whether an `allocate` to `total` tokens needs new blocks (false: its rows cover them).
    #[inline]
    pub fn needs_blocks(&self, total: usize) -> bool {
        total > self.cover_upto
    }

    /// Whether some block is full once `known` tokens are computed (false: none to cache).
    #[inline]
    pub fn may_fill(&self, known: usize) -> bool {
        known >= self.fill_at
    }

    /// Whether an `allocate` without a hit with these counts changes no block.
    #[inline]
    pub fn hold(&self, computed: usize, total: usize, known: usize) -> bool {
        computed < self.release_at && total <= self.cover_upto && known < self.fill_at
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manager::{
        pending_release, ChunkedLocalManager, FullAttentionManager, SlidingWindowManager,
    };
    use crate::types::BlockId;

    /// The three conditions of the module docs, asked of the managers directly.
    fn unchanged(
        managers: &[Box<dyn AttentionManager>],
        groups: &[GroupBlocks],
        caching: bool,
        (computed, total, known): (usize, usize, usize),
    ) -> bool {
        managers.iter().zip(groups).all(|(manager, blocks)| {
            let len = blocks.blocks.len();
            pending_release(manager.as_ref(), blocks, computed).is_empty()
                && manager.num_new_blocks(len, total) == 0
                && (!caching || (known / manager.block_size()).min(len) <= blocks.num_cached)
        })
    }

    #[test]
    fn the_bounds_hold_exactly_where_no_group_would_change() {
        // Every count up to `max_total` tokens (cut down under Miri, which runs the loop about
        // a thousand times slower).
        let max_total = if cfg!(miri) { 8 } else { 30 };
        let mut checked = 0;
        for (first, second) in [(0, 1), (0, 2), (1, 2), (1, 1)] {
            let owned = [manager(first), manager(second)];
            for len in 0..6usize {
                for num_released in 0..=len {
                    for num_cached in 0..=len {
                        let group = GroupBlocks {
                            blocks: vec![1 as BlockId; len],
                            num_released,
                            num_cached,
                        };
                        let other = GroupBlocks {
                            blocks: vec![1; len + 1],
                            num_released: num_released.saturating_sub(1),
                            num_cached,
                        };
                        let groups = [group, other];
                        for caching in [false, true] {
                            let bounds = QuietBounds::of(&owned, &groups, caching);
                            for total in 0..max_total {
                                for computed in 0..=total {
                                    for known in computed..=total {
                                        let counts = (computed, total, known);
                                        assert_eq!(
                                            bounds.hold(computed, total, known),
                                            unchanged(&owned, &groups, caching, counts),
                                            "{owned:?} {groups:?} caching {caching} {counts:?}"
                                        );
                                        checked += 1;
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > if cfg!(miri) { 10_000 } else { 100_000 });
    }

    #[test]
    fn the_default_bounds_hold_for_nothing() {
        assert!(!QuietBounds::default().hold(0, 0, 0));
    }

    /// A full-attention, a sliding-window or a chunked-local manager.
    fn manager(kind: usize) -> Box<dyn AttentionManager> {
        match kind {
            0 => Box::new(FullAttentionManager::new(4)),
            1 => Box::new(SlidingWindowManager::new(2, 5)),
            _ => Box::new(ChunkedLocalManager::new(2, 6)),
        }
    }
}
