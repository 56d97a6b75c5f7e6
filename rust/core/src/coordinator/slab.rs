//! The running requests, stored by block-table row, with the ids of the last batch remembered.
//!
//! A decode step asks about the same requests, in the same order, in every call
//! (`allocate_batch`, then `append_token_ids_batch`) and again the next step: `rows_of`
//! compares the ids with the last batch's (a memory compare) and, while no request was added or
//! removed since, hands back the rows found then instead of hashing every id again.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::request::RequestState;
use crate::error::CoreError;

/// See the module docs.
#[derive(Debug)]
pub(super) struct RequestSlab {
    rows: HashMap<u64, usize, BuildHasherDefault<RequestIdHasher>>,
    /// `states[row]`: the request in that row.
    states: Vec<Option<RequestState>>,
    /// Bumped by every insert and remove: the memo below is for one version.
    version: u64,
    memo_version: u64,
    memo_ids: Vec<u64>,
    memo_rows: Vec<usize>,
}

impl RequestSlab {
    pub fn new(max_num_reqs: usize) -> Self {
        RequestSlab {
            rows: HashMap::with_capacity_and_hasher(max_num_reqs, Default::default()),
            states: (0..max_num_reqs).map(|_| None).collect(),
            version: 1,
            memo_version: 0,
            memo_ids: Vec::new(),
            memo_rows: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn contains_key(&self, request_id: &u64) -> bool {
        self.rows.contains_key(request_id)
    }

    pub fn get(&self, request_id: &u64) -> Option<&RequestState> {
        let row = *self.rows.get(request_id)?;
        self.states[row].as_ref()
    }

    pub fn get_mut(&mut self, request_id: &u64) -> Option<&mut RequestState> {
        let row = *self.rows.get(request_id)?;
        self.states[row].as_mut()
    }

    /// The request in `row` (one `rows_of` returned).
    pub fn at_mut(&mut self, row: usize) -> &mut RequestState {
        self.states[row]
            .as_mut()
            .expect("a row of a present request")
    }

    /// Adds a request in its row (`state.row`, which must be free).
    pub fn insert(&mut self, request_id: u64, state: RequestState) {
        let row = state.row;
        debug_assert!(self.states[row].is_none(), "row {row} is taken");
        self.states[row] = Some(state);
        self.rows.insert(request_id, row);
        self.version += 1;
    }

    pub fn remove(&mut self, request_id: &u64) -> Option<RequestState> {
        let row = self.rows.remove(request_id)?;
        self.version += 1;
        self.states[row].take()
    }

    /// Writes into `out` the row of each id, in order; the first unknown id is an error.
    pub fn rows_of(
        &mut self,
        ids: impl ExactSizeIterator<Item = u64> + Clone,
        out: &mut Vec<usize>,
    ) -> Result<(), CoreError> {
        out.clear();
        let same = self.memo_version == self.version
            && self.memo_ids.len() == ids.len()
            && ids
                .clone()
                .zip(&self.memo_ids)
                .all(|(id, &memo)| id == memo);
        if !same {
            self.memo_version = 0;
            self.memo_ids.clear();
            self.memo_rows.clear();
            for request_id in ids {
                let row = *self
                    .rows
                    .get(&request_id)
                    .ok_or(CoreError::UnknownRequest { request_id })?;
                self.memo_ids.push(request_id);
                self.memo_rows.push(row);
            }
            self.memo_version = self.version;
        }
        out.extend_from_slice(&self.memo_rows);
        Ok(())
    }
}

/// Hasher for request ids: ids are chosen by the engine (not by users), so a multiplicative
/// mix is enough and much cheaper than SipHash on the per-step path.
#[derive(Default)]
pub(super) struct RequestIdHasher(u64);

impl Hasher for RequestIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(byte)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = (value ^ (value >> 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}
