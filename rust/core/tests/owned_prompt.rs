//! `add_request_owned`: a prompt handed over in its own storage behaves as `add_request`.

mod common;

use common::{add, allocate, full_and_window, tokens};
use hybrid_cache_core::{Coordinator, CoreError, ExtraKeys};

#[test]
fn an_owned_prompt_is_added_and_hit_as_a_copied_one() {
    let mut c = full_and_window(8, 64);
    let prompt: Vec<u32> = (1..=40).collect();
    add(&mut c, 1, &prompt);
    assert!(allocate(&mut c, 1, 0, 40));
    let mut owned = Vec::with_capacity(<Coordinator>::token_capacity(40, Some(48)));
    owned.extend_from_slice(&prompt);
    let row = c
        .add_request_owned(2, owned, Some(48), ExtraKeys::default())
        .unwrap();
    assert_eq!(c.row_of(2).unwrap(), row);
    assert_eq!(c.num_tokens(2).unwrap(), 40);
    assert_eq!(
        c.find_cache_hit(2).unwrap(),
        36,
        "the same hit as a copied prompt finds"
    );
    assert!(allocate(&mut c, 2, 36, 4));
    c.append_token_ids(2, &[7; 8]).unwrap();
    assert_eq!(c.num_tokens(2).unwrap(), 48);

    // Storage without room is grown, not refused.
    let row = c
        .add_request_owned(3, prompt.clone(), Some(60), ExtraKeys::default())
        .unwrap();
    assert_eq!(c.row_of(3).unwrap(), row);
    assert_eq!(c.find_cache_hit(3).unwrap(), 36);
}

#[test]
fn a_refused_owned_prompt_changes_nothing() {
    let mut c = full_and_window(8, 64);
    add(&mut c, 1, &[1, 2, 3]);
    let before = c.stats();
    let refusals = [
        (1, vec![4, 5], None),
        (2, vec![], None),
        (3, vec![1, 2, 3], Some(2)),
        (4, vec![9; 8], Some(1 << 30)),
    ];
    for (id, prompt, max_total) in refusals {
        let copied = c.add_request(hybrid_cache_core::NewRequest {
            request_id: id,
            prompt_token_ids: &prompt,
            max_total_tokens: max_total,
            extra: ExtraKeys::default(),
        });
        let owned = c.add_request_owned(id, prompt.clone(), max_total, ExtraKeys::default());
        let (Err(copied), Err(owned)) = (copied, owned) else {
            panic!("request {id} must be refused");
        };
        assert_eq!(owned.to_string(), copied.to_string());
        assert_eq!(id == 1, matches!(owned, CoreError::DuplicateRequest { .. }));
    }
    assert_eq!(c.stats(), before);
    assert_eq!(c.num_tokens(1).unwrap(), 3);
}

#[test]
fn token_capacity_has_room_for_every_token_and_the_last_sampled_one() {
    type C = Coordinator;
    assert_eq!(C::token_capacity(10, None), 11);
    assert_eq!(C::token_capacity(10, Some(30)), 31);
    assert_eq!(C::token_capacity(10, Some(4)), 11, "never below the prompt");
}

#[test]
fn a_request_added_after_a_free_reuses_its_storage_and_nothing_of_its_contents() {
    let mut c = full_and_window(8, 64);
    add(&mut c, 1, &tokens(1, 40));
    assert!(allocate(&mut c, 1, 0, 40));
    c.append_token_ids(1, &[3, 4]).unwrap();
    c.free_request(1).unwrap();
    // Request 2 takes request 1's vectors: none of its tokens, hashes or blocks come along.
    add(&mut c, 2, &tokens(500, 24));
    assert_eq!(c.num_tokens(2).unwrap(), 24);
    assert_eq!(
        c.find_cache_hit(2).unwrap(),
        0,
        "no hash of request 1 is left"
    );
    assert!(allocate(&mut c, 2, 0, 24));
    for group in 0..2 {
        let row = c.request_blocks(2, group).unwrap();
        assert_eq!(
            row.len(),
            6,
            "a row of its own 6 blocks, nothing of request 1's"
        );
    }
    c.free_request(2).unwrap();
    // Both prompts hit what their own computation cached.
    add(&mut c, 3, &tokens(500, 24));
    assert_eq!(c.find_cache_hit(3).unwrap(), 20);
    add(&mut c, 4, &tokens(1, 40));
    assert_eq!(c.find_cache_hit(4).unwrap(), 36);
    // A caller converting a prompt gets a freed request's storage, empty.
    c.free_request(3).unwrap();
    let storage = c.token_storage(10);
    assert!(storage.is_empty() && storage.capacity() >= 24);
}
