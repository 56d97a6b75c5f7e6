//! A Python list of token ids read into a request's storage a piece at a time
//! (`PromptReader`, for `Coordinator::add_request_read`): exact ints in place, the list's item
//! objects prefetched ahead (the core hashes one piece while the next one's objects load), any
//! other item through the interpreter with its errors.

use hybrid_cache_core::PromptReader;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::convert::{list_token, prefetch, ReadError, PREFETCH_AHEAD};
use crate::errors::invalid_argument;
use crate::ints::{self, Layout};

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
        let list = self.list.as_ptr();
        // SAFETY: the GIL is held; a list's size is a plain field.
        if unsafe { pyo3::ffi::PyList_GET_SIZE(list) } as usize != self.len {
            return Err(ReadError(invalid_argument(
                "the token ids changed while read".into(),
            )));
        }
        if self.len == 0 {
            return Ok(&[]); // an empty list may have no item array at all
        }
        // SAFETY: a non-empty list's `ob_item` points at its `len` items; the GIL is held and no
        // Python code runs while the slice is used (borrowed items stay valid).
        Ok(unsafe {
            let list = list.cast::<pyo3::ffi::PyListObject>();
            std::slice::from_raw_parts((*list).ob_item, self.len)
        })
    }
}

impl PromptReader for ListReader<'_, '_> {
    type Error = ReadError;

    fn len(&self) -> usize {
        self.len
    }

    fn read_to(&mut self, tokens: &mut Vec<u32>, end: usize) -> Result<(), ReadError> {
        tokens.reserve(end.saturating_sub(tokens.len()));
        while tokens.len() < end {
            let items = self.items()?;
            // The layout read once per run of in-place reads, each one's loop compiled alone.
            match ints::current() {
                Layout::SignedSize => read_run(Layout::SignedSize, items, tokens, end),
                Layout::Tag => read_run(Layout::Tag, items, tokens, end),
                Layout::Call => read_run(Layout::Call, items, tokens, end),
            }
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

/// Appends `items[tokens.len()..end]` to `tokens` while each is an exact int in `0..2^32`,
/// stopping before the first that is not.
#[inline(always)]
fn read_run(layout: Layout, items: &[*mut pyo3::ffi::PyObject], tokens: &mut Vec<u32>, end: usize) {
    for index in tokens.len()..end {
        if let Some(&ahead) = items.get(index + PREFETCH_AHEAD) {
            prefetch(ahead);
        }
        let value = ints::exact_int_in(layout, items[index]);
        match value.and_then(|value| u32::try_from(value).ok()) {
            Some(token) => tokens.push(token),
            None => return,
        }
    }
}
