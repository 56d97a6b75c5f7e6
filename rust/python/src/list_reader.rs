//! A Python list of token ids read into a request's storage a piece at a time
//! (`PromptReader`, for `Coordinator::add_request_read`): exact ints in place, the list's item
//! objects prefetched ahead (the core hashes one piece while the next one's objects load), any
//! other item through the interpreter with its errors.

use hybrid_cache_core::PromptReader;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::convert::{list_items, list_token, read_exact_ints, ReadError};
use crate::errors::invalid_argument;

/// See the module docs.
pub struct ListReader<'a, 'py> {
    list: &'a Bound<'py, PyList>,
    /// The length when reading started; a list that changes while read is refused.
    len: usize,
}

impl<'a, 'py> ListReader<'a, 'py> {
    pub fn new(list: &'a Bound<'py, PyList>) -> Self {
        Self {
            len: list.len(),
            list,
        }
    }

    /// The list's items, checked to be as many as when reading started (Python code run by a
    /// conversion may have changed the list).
    fn items(&self) -> Result<&[*mut pyo3::ffi::PyObject], ReadError> {
        let items = list_items(self.list);
        if items.len() != self.len {
            return Err(ReadError(invalid_argument(
                "the token ids changed while read".into(),
            )));
        }
        Ok(items)
    }
}

impl PromptReader for ListReader<'_, '_> {
    type Error = ReadError;

    fn len(&self) -> usize {
        self.len
    }

    fn read_to(&mut self, tokens: &mut Vec<u32>, end: usize) -> Result<(), ReadError> {
        while tokens.len() < end {
            read_exact_ints(self.items()?, tokens, end);
            if tokens.len() < end {
                // An item the in-place read declines (an int subclass, a big or negative value,
                // not an int): through the interpreter, with its error.
                let token = list_token(self.list, tokens.len())?;
                tokens.push(token);
            }
        }
        Ok(())
    }
}
