//! Preempted requests keep their tokens and block hashes (`preempt_request`) and come back
//! without hashing again (`resume_request`).

mod common;

use common::{add, allocate, full_and_window};
use hybrid_cache_core::{BlockAllocator, CoreError};

#[test]
fn a_resumed_request_finds_the_same_hit_without_hashing_again() {
    let mut c = full_and_window(8, 64);
    let prompt: Vec<u32> = (1..=22).collect();
    add(&mut c, 7, &prompt);
    assert!(allocate(&mut c, 7, 0, 22));
    c.append_token_ids(7, &[500, 501]).unwrap();
    assert!(allocate(&mut c, 7, 22, 2));
    let usable = c.pool().num_blocks() - 1;
    c.preempt_request(7).unwrap();
    assert_eq!(c.pool().num_free_blocks(), usable, "every block comes back");
    assert_eq!(c.stats().parked_requests, 1);
    let hashed = c.stats().hashed_blocks;
    assert!(hashed >= 6, "the 24 tokens' blocks were hashed: {hashed}");

    let row = c.resume_request(7, Some(40), Some(24)).unwrap();
    assert_eq!(c.row_of(7).unwrap(), row);
    assert_eq!(c.num_tokens(7).unwrap(), 24, "the appended tokens are kept");
    let hit = c.find_cache_hit(7).unwrap();
    assert_eq!(hit, 20, "the same hit as a fresh add of the same tokens");
    assert_eq!(c.stats().hashed_blocks, hashed, "no block hashed again");
    assert_eq!(c.stats().parked_requests, 0);
    assert!(allocate(&mut c, 7, hit, 4));

    // A fresh add of the same tokens hashes them.
    let mut same = prompt.clone();
    same.extend([500, 501]);
    add(&mut c, 8, &same);
    assert_eq!(c.find_cache_hit(8).unwrap(), 20);
    assert!(c.stats().hashed_blocks >= hashed + 6);
}

#[test]
fn a_resume_that_fails_keeps_the_request_and_forget_drops_it() {
    let mut c = full_and_window(8, 64);
    add(&mut c, 1, &[1, 2, 3, 4, 5]);
    assert!(allocate(&mut c, 1, 0, 5));
    c.preempt_request(1).unwrap();
    let wrong = c.resume_request(1, None, Some(6)).unwrap_err();
    assert!(matches!(wrong, CoreError::InvalidArgument(ref m) if m.contains("not 6")));
    let too_long = c.resume_request(1, Some(100_000), None).unwrap_err();
    assert!(matches!(too_long, CoreError::RequestTooLarge(_)));
    assert_eq!(c.stats().parked_requests, 1, "still kept");
    assert!(c.forget_request(1));
    assert!(!c.forget_request(1));
    assert!(matches!(
        c.resume_request(1, None, None),
        Err(CoreError::UnknownRequest { request_id: 1 })
    ));
    assert_eq!(c.num_requests(), 0);
}

#[test]
fn adding_the_id_anew_forgets_the_kept_request_and_the_oldest_go_beyond_the_limit() {
    let mut c = full_and_window(8, 256);
    add(&mut c, 1, &[1, 2, 3]);
    c.preempt_request(1).unwrap();
    add(&mut c, 1, &[9, 9]);
    c.free_request(1).unwrap();
    assert!(
        c.resume_request(1, None, None).is_err(),
        "the new add replaced it"
    );
    // The common config has 4 rows: 16 requests are kept at most.
    for id in 10..27u64 {
        add(&mut c, id, &[id as u32, 1, 2]);
        c.preempt_request(id).unwrap();
    }
    assert_eq!(c.stats().parked_requests, 16);
    assert!(c.resume_request(10, None, None).is_err(), "the oldest went");
    // Kept twice: the later keep counts, so the id survives the eviction of its first entry.
    assert_eq!(c.resume_request(11, None, None).unwrap(), 0);
    c.preempt_request(11).unwrap();
    add(&mut c, 30, &[5]);
    c.preempt_request(30).unwrap();
    assert!(c.resume_request(11, None, None).is_ok());
    assert!(
        c.resume_request(12, None, None).is_err(),
        "12 was the oldest then"
    );
}

#[test]
fn a_request_freed_before_computing_anything_hashes_nothing() {
    let mut c = full_and_window(8, 64);
    let prompt: Vec<u32> = (1..=40).collect();
    add(&mut c, 1, &prompt);
    c.free_request(1).unwrap();
    assert_eq!(c.stats().hashed_blocks, 0);
    add(&mut c, 2, &prompt);
    assert!(allocate(&mut c, 2, 0, 20));
    c.free_request(2).unwrap();
    // Its computed 20 tokens: 5 blocks in each of the two groups' chain (one chain: same size).
    assert_eq!(c.stats().hashed_blocks, 5);
}
