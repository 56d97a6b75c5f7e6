//! `add_request_read`: a prompt read a piece at a time, hashed as it lands, ends as the same
//! request `add_request` makes; a reader that fails adds nothing.

mod common;

use common::{add, allocate, full_and_window, tokens};
use hybrid_cache_core::{BlockAllocator, CoreError, ExtraKeys, PromptReader};

/// A prompt that fails after handing out `good` tokens.
struct Failing<'a> {
    tokens: &'a [u32],
    good: usize,
}

impl PromptReader for Failing<'_> {
    type Error = CoreError;

    fn len(&self) -> usize {
        self.tokens.len()
    }

    fn read_to(&mut self, out: &mut Vec<u32>, end: usize) -> Result<(), CoreError> {
        if end > self.good {
            out.extend_from_slice(&self.tokens[out.len()..self.good]);
            return Err(CoreError::InvalidArgument("a bad token".into()));
        }
        out.extend_from_slice(&self.tokens[out.len()..end]);
        Ok(())
    }
}

#[test]
fn a_prompt_read_in_pieces_is_the_request_a_whole_add_makes() {
    let prompt = tokens(100, 203); // several pieces, a partial last block
    let mut whole = full_and_window(8, 256);
    add(&mut whole, 1, &prompt);
    assert_eq!(whole.find_cache_hit(1).unwrap(), 0);
    let mut read = full_and_window(8, 256);
    read.add_request_read(1, &mut &prompt[..], None, ExtraKeys::default())
        .unwrap();
    assert_eq!(read.stats().hashed_blocks, 203 / 4, "hashed while read");
    assert_eq!(read.find_cache_hit(1).unwrap(), 0);
    assert_eq!(
        read.stats().hashed_blocks,
        whole.stats().hashed_blocks,
        "not again"
    );
    assert_eq!(read.num_tokens(1).unwrap(), 203);
    for c in [&mut whole, &mut read] {
        assert!(allocate(c, 1, 0, 64));
        assert!(allocate(c, 1, 64, 64));
        assert!(allocate(c, 1, 128, 64));
        assert!(allocate(c, 1, 192, 11));
    }
    let keys = |c: &hybrid_cache_core::Coordinator| {
        let mut keys: Vec<_> = c.cached_blocks().into_iter().map(|(_, key)| key).collect();
        keys.sort_by_key(|key| (key.group, key.hash.0));
        keys
    };
    assert_eq!(keys(&read), keys(&whole));
    // The next request with the same prompt hits it.
    read.free_request(1).unwrap();
    read.add_request_read(2, &mut &prompt[..], None, ExtraKeys::default())
        .unwrap();
    assert_eq!(read.find_cache_hit(2).unwrap(), 200);
}

#[test]
fn a_reader_that_fails_adds_nothing_and_the_checks_come_first() {
    let prompt = tokens(1, 120);
    let mut c = full_and_window(8, 64);
    let free = c.pool().num_free_blocks();
    let mut failing = Failing {
        tokens: &prompt,
        good: 70,
    };
    let error = c.add_request_read(5, &mut failing, None, ExtraKeys::default());
    assert!(matches!(error, Err(CoreError::InvalidArgument(_))));
    assert!(c.num_tokens(5).is_err(), "no request was added");
    assert_eq!(
        c.stats().hashed_blocks,
        48 / 4,
        "the pieces before the failure"
    );
    assert_eq!(c.pool().num_free_blocks(), free);
    // A length the coordinator refuses is refused before anything is read.
    let mut never = Failing {
        tokens: &[7; 300],
        good: 0,
    };
    let error = c.add_request_read(6, &mut never, None, ExtraKeys::default());
    assert!(
        matches!(error, Err(CoreError::RequestTooLarge(_))),
        "{error:?}"
    );
    // The id is free and the row too.
    c.add_request_read(5, &mut &prompt[..], None, ExtraKeys::default())
        .unwrap();
    assert_eq!(c.num_tokens(5).unwrap(), 120);
}

#[test]
fn without_prefix_caching_a_read_hashes_nothing() {
    let mut config = common::config(
        vec![hybrid_cache_core::GroupSpec {
            kind: hybrid_cache_core::AttentionKind::Full,
            block_size: 4,
        }],
        64,
    );
    config.enable_prefix_caching = false;
    let mut c = hybrid_cache_core::Coordinator::new(config).unwrap();
    let prompt = tokens(1, 100);
    c.add_request_read(1, &mut &prompt[..], None, ExtraKeys::default())
        .unwrap();
    assert_eq!(c.stats().hashed_blocks, 0);
    assert_eq!(c.num_tokens(1).unwrap(), 100);
}
