//! Conversions from Python values, each failure a typed `InvalidArgumentError`.

use std::ops::Range;

use hybrid_cache_core::{CoreError, PromptPrefix};
use pyo3::buffer::{Element, PyBuffer};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::errors::{invalid_argument, to_py};
use crate::ints::{self, exact_int, Layout};

/// A non-negative Python int as `usize`.
pub fn size(name: &str, value: i64) -> PyResult<usize> {
    usize::try_from(value)
        .map_err(|_| invalid_argument(format!("{name} must be non-negative, got {value}")))
}

/// A request id: a non-negative int below 2^63.
pub fn request_id(value: i64) -> PyResult<u64> {
    u64::try_from(value)
        .map_err(|_| invalid_argument(format!("request ids must be non-negative, got {value}")))
}

/// Integers from anything exposing an int64 buffer (numpy int64 arrays: one copy, no per-item
/// Python calls) or from any sequence of ints.
pub fn int64s(name: &str, values: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    // Lists and tuples first: asking them for a buffer would build a TypeError each call.
    if let Ok(list) = values.cast::<PyList>() {
        return match exact_ints::<i64>(list, Vec::with_capacity) {
            Ok(ints) => Ok(ints),
            Err(_) => ints_by_item(name, list.iter()),
        };
    }
    if let Ok(tuple) = values.cast::<PyTuple>() {
        return ints_by_item(name, tuple.iter());
    }
    if let Ok(buffer) = PyBuffer::<i64>::get(values) {
        if buffer.dimensions() <= 1 {
            return buffer.to_vec(values.py());
        }
    }
    values.extract::<Vec<i64>>().map_err(|_| not_ints(name))
}

/// The typed error for `name` when it is not a sequence of ints.
fn not_ints(name: &str) -> PyErr {
    invalid_argument(format!("{name} must be a 1-d sequence of ints"))
}

/// A sequence's items as ints, one `extract` each.
fn ints_by_item<'py>(
    name: &str,
    items: impl Iterator<Item = Bound<'py, PyAny>>,
) -> PyResult<Vec<i64>> {
    items
        .map(|item| item.extract::<i64>())
        .collect::<PyResult<_>>()
        .map_err(|_| not_ints(name))
}

/// How many items ahead of the one being read a list's item object is prefetched: a long prompt's
/// int objects (32 bytes each) are rarely in the caches when it is added, and reading them is
/// bound by memory (an 8192-token list: about 26 us cold, 8 us hot); 64 ahead reads it 0.93-0.95x
/// the time 16 ahead took (2048 and 128 tokens: 0.97x).
const PREFETCH_AHEAD: usize = 64;

/// Asks the CPU to start loading the object at `item` (a hint: reads nothing, cannot fault).
#[inline(always)]
fn prefetch(item: *const pyo3::ffi::PyObject) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing and cannot fault, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(item.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = item;
}

/// A list whose items are all exactly `int` and fit in a `T` (read as `i64`), read without a
/// reference count change per item, in one pass; for any other list `Err` with the storage
/// emptied again (the caller converts item by item, with its errors, and may reuse it).
/// The items are written into `storage(len)`, an empty vector (room for `len` items is made
/// if it lacks it).
fn exact_ints<T: TryFrom<i64>>(
    list: &Bound<'_, PyList>,
    storage: impl FnOnce(usize) -> Vec<T>,
) -> Result<Vec<T>, Vec<T>> {
    let items = list_items(list);
    let mut ints = storage(items.len());
    debug_assert!(ints.is_empty(), "storage hands out empty vectors");
    ints.clear();
    read_exact_ints(items, &mut ints, items.len());
    if ints.len() == items.len() {
        Ok(ints)
    } else {
        ints.clear();
        Err(ints)
    }
}

/// A list's items as a slice (borrowed references: valid while the list holds them, that is
/// while no Python code runs and the GIL is held).
pub(crate) fn list_items<'a>(list: &'a Bound<'_, PyList>) -> &'a [*mut pyo3::ffi::PyObject] {
    let len = list.len();
    if len == 0 {
        return &[]; // an empty list may have no item array at all (`ob_item` null)
    }
    // SAFETY: a non-empty list's `ob_item` points at its `len` items; the GIL is held (the
    // `Bound`), and the caller runs no Python code while it uses the slice.
    unsafe {
        let list = list.as_ptr().cast::<pyo3::ffi::PyListObject>();
        std::slice::from_raw_parts((*list).ob_item, len)
    }
}

/// Appends `items[ints.len()..end]` to `ints` while each is exactly an `int` that fits a `T`,
/// stopping before the first that is not; items further on are prefetched ahead. The int
/// layout is read once, each one's loop compiled on its own.
pub(crate) fn read_exact_ints<T: TryFrom<i64>>(
    items: &[*mut pyo3::ffi::PyObject],
    ints: &mut Vec<T>,
    end: usize,
) {
    ints.reserve(end.saturating_sub(ints.len()));
    match ints::current() {
        Layout::SignedSize => read_run(Layout::SignedSize, items, ints, end),
        Layout::Tag => read_run(Layout::Tag, items, ints, end),
        Layout::Call => read_run(Layout::Call, items, ints, end),
    }
}

/// `read_exact_ints` under one int layout.
#[inline(always)]
fn read_run<T: TryFrom<i64>>(
    layout: Layout,
    items: &[*mut pyo3::ffi::PyObject],
    ints: &mut Vec<T>,
    end: usize,
) {
    for index in ints.len()..end {
        if let Some(&ahead) = items.get(index + PREFETCH_AHEAD) {
            prefetch(ahead);
        }
        match ints::exact_int_in(layout, items[index]).and_then(|value| T::try_from(value).ok()) {
            Some(value) => ints.push(value),
            None => return,
        }
    }
}

/// Item `index` of `list` if it is exactly an `int` fitting an `i64` (`exact_int`), the item
/// `PREFETCH_AHEAD` further on prefetched.
///
/// # Safety
/// `list` is a list whose size is `len` now, `index < len`, and the GIL is held with no Python
/// code running since `len` was read (the list keeps its items: borrowed references, valid
/// while the list holds them).
#[inline(always)]
unsafe fn list_int(list: *mut pyo3::ffi::PyObject, index: usize, len: usize) -> Option<i64> {
    if index + PREFETCH_AHEAD < len {
        // SAFETY: (caller) the position is inside the list; the item is only prefetched.
        prefetch(unsafe { pyo3::ffi::PyList_GET_ITEM(list, (index + PREFETCH_AHEAD) as isize) });
    }
    // SAFETY: (caller) as above.
    exact_int(unsafe { pyo3::ffi::PyList_GET_ITEM(list, index as isize) })
}

/// Reads `N` lists of one length together into `rows` (emptied first, storage the caller
/// keeps), item `i` of each list handed to `row` as one array; the items must all be exactly
/// `int` and fit in an `i64`, and `row` must accept each array. `None` for anything else (the
/// caller converts list by list, with its errors).
pub fn int_rows<const N: usize, T>(
    lists: [&Bound<'_, PyAny>; N],
    row: impl Fn([i64; N]) -> Option<T>,
    rows: &mut Vec<T>,
) -> Option<()> {
    rows.clear();
    let mut pointers = [std::ptr::null_mut(); N];
    let mut len = None;
    for (pointer, list) in pointers.iter_mut().zip(lists) {
        let list = list.cast::<PyList>().ok()?;
        if *len.get_or_insert(list.len()) != list.len() {
            return None;
        }
        *pointer = list.as_ptr();
    }
    let len = len.unwrap_or(0);
    // The layout read once, each one's loop compiled on its own.
    match ints::current() {
        Layout::SignedSize => read_rows(Layout::SignedSize, pointers, len, row, rows),
        Layout::Tag => read_rows(Layout::Tag, pointers, len, row, rows),
        Layout::Call => read_rows(Layout::Call, pointers, len, row, rows),
    }
}

/// `int_rows` over lists of `len` items under one int layout.
#[inline(always)]
fn read_rows<const N: usize, T>(
    layout: Layout,
    lists: [*mut pyo3::ffi::PyObject; N],
    len: usize,
    row: impl Fn([i64; N]) -> Option<T>,
    rows: &mut Vec<T>,
) -> Option<()> {
    rows.reserve(len);
    for index in 0..len {
        let mut values = [0; N];
        for (value, &list) in values.iter_mut().zip(&lists) {
            // SAFETY: each list has `len > index` items and is held by the caller; the GIL is
            // held with no Python code running in between (borrowed items stay valid).
            let item = unsafe { pyo3::ffi::PyList_GET_ITEM(list, index as isize) };
            *value = ints::exact_int_in(layout, item)?;
        }
        rows.push(row(values)?);
    }
    Some(())
}

/// Request ids: non-negative ints. A list of ints in range is read in one pass.
pub fn request_ids(values: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(list) = values.cast::<PyList>() {
        if let Ok(ids) = exact_ints::<u64>(list, Vec::with_capacity) {
            return Ok(ids);
        }
    }
    int64s("request_ids", values)?
        .into_iter()
        .map(request_id)
        .collect()
}

/// Token ids: ints in `0..2^32`. A list of ints in range is read in one pass into the result
/// (no `i64` copy first).
pub fn token_ids(values: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
    token_ids_into(values, Vec::with_capacity)
}

/// `token_ids` written into `storage(len)`, an empty vector the caller provides for `len`
/// ids (room is made if it lacks it): storage it keeps growing without a copy, or reuses.
pub fn token_ids_into(
    values: &Bound<'_, PyAny>,
    mut storage: impl FnMut(usize) -> Vec<u32>,
) -> PyResult<Vec<u32>> {
    let mut declined = None;
    if let Ok(list) = values.cast::<PyList>() {
        match exact_ints::<u32>(list, &mut storage) {
            Ok(tokens) => return Ok(tokens),
            // The storage comes back (emptied) for the item-by-item read below.
            Err(kept) => declined = Some(kept),
        }
    }
    let ids = int64s("token ids", values)?;
    let mut tokens = match declined {
        Some(kept) => kept,
        None => storage(ids.len()),
    };
    tokens.clear();
    tokens.reserve(ids.len());
    for id in ids {
        tokens.push(token_id(id)?);
    }
    Ok(tokens)
}

/// One token id: an int in `0..2^32`.
fn token_id(token: i64) -> PyResult<u32> {
    u32::try_from(token)
        .map_err(|_| invalid_argument(format!("token id {token} is outside 0..2^32")))
}

/// A Python list of token ids converted only as far as the core reads it (`PromptPrefix`):
/// a probe that stops after a few blocks converts only those. Items past what was read are
/// not checked (a probe changes nothing; adding the request converts and checks them all).
pub struct ListTokens<'a, 'py> {
    list: &'a Bound<'py, PyList>,
    len: usize,
    converted: Vec<u32>,
}

impl<'a, 'py> ListTokens<'a, 'py> {
    pub fn new(list: &'a Bound<'py, PyList>) -> Self {
        Self {
            list,
            len: list.len(),
            converted: Vec::new(),
        }
    }

    fn token(&self, index: usize) -> Result<u32, ReadError> {
        list_token(self.list, index)
    }
}

/// Item `index` of `list` as a token id: an exact int read in place, anything else through
/// `extract` (which may run Python code: the list's length is read again each item).
pub(crate) fn list_token(list: &Bound<'_, PyList>, index: usize) -> Result<u32, ReadError> {
    let pointer = list.as_ptr();
    // SAFETY: the GIL is held; a list's size is a plain field.
    let current = unsafe { pyo3::ffi::PyList_GET_SIZE(pointer) } as usize;
    if index < current {
        // SAFETY: `index` is below the list's size read just above, the GIL held.
        let value = unsafe { list_int(pointer, index, current) };
        if let Some(token) = value.and_then(|value| u32::try_from(value).ok()) {
            return Ok(token);
        }
    }
    let item = list
        .get_item(index)
        .map_err(|_| ReadError(invalid_argument("the token ids changed while read".into())))?;
    let token = item.extract::<i64>().map_err(|_| {
        ReadError(invalid_argument(
            "token ids must be a 1-d sequence of ints".into(),
        ))
    })?;
    token_id(token).map_err(ReadError)
}

/// Why reading a prompt failed: a conversion (the Python error) or the core.
pub struct ReadError(pub PyErr);

impl From<CoreError> for ReadError {
    fn from(error: CoreError) -> Self {
        ReadError(to_py(error))
    }
}

impl PromptPrefix for ListTokens<'_, '_> {
    type Error = ReadError;

    fn len(&self) -> usize {
        self.len
    }

    fn prefix(&mut self, num_tokens: usize) -> Result<&[u32], ReadError> {
        self.converted
            .reserve(num_tokens.saturating_sub(self.converted.len()));
        for index in self.converted.len()..num_tokens {
            let token = self.token(index)?;
            self.converted.push(token);
        }
        Ok(&self.converted[..num_tokens])
    }
}

/// A 128-bit hash from any Python int: non-negative ints below 2^128 as they are, negative
/// ones (e.g. from `hash()`) by their two's-complement bits.
pub fn hash128(value: &Bound<'_, PyAny>) -> PyResult<u128> {
    if let Ok(unsigned) = value.extract::<u128>() {
        return Ok(unsigned);
    }
    value
        .extract::<i128>()
        .map(|signed| signed as u128)
        .map_err(|_| invalid_argument("hashes must be ints in -2^127..2^128".into()))
}

/// A buffer's items as a slice spanning every element its shape and strides reach, with the
/// strides in items. Refuses negative or unaligned strides.
pub struct Items<'b, T> {
    pub slice: &'b [T],
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl<'b, T: Element> Items<'b, T> {
    pub fn new(buffer: &'b PyBuffer<T>, name: &str, dims: usize) -> PyResult<Self> {
        if buffer.dimensions() != dims {
            return Err(invalid_argument(format!(
                "{name} must have {dims} dimensions, got {}",
                buffer.dimensions()
            )));
        }
        let item = std::mem::size_of::<T>() as isize;
        let mut strides = Vec::with_capacity(dims);
        for &stride in buffer.strides() {
            if stride < 0 || stride % item != 0 {
                return Err(invalid_argument(format!(
                    "{name} has a negative or unaligned stride ({stride} bytes)"
                )));
            }
            strides.push((stride / item) as usize);
        }
        let shape = buffer.shape().to_vec();
        let span = if shape.contains(&0) {
            0
        } else {
            1 + shape
                .iter()
                .zip(&strides)
                .map(|(n, s)| (n - 1) * s)
                .sum::<usize>()
        };
        // SAFETY: the exporter guarantees every element its shape and strides reach is valid
        // memory for as long as the buffer is held; `buffer` outlives `'b`. The GIL is held
        // for the whole call, so no Python code changes the memory meanwhile.
        let slice = unsafe { std::slice::from_raw_parts(buffer.buf_ptr() as *const T, span) };
        Ok(Items {
            slice,
            shape,
            strides,
        })
    }

    /// The addresses the slice covers (to check that buffers do not overlap).
    pub fn bytes(&self) -> Range<usize> {
        let start = self.slice.as_ptr() as usize;
        start..start + std::mem::size_of_val(self.slice)
    }
}

/// `Items` of a C-contiguous buffer.
pub fn contiguous_items<'b, T: Element>(
    buffer: &'b PyBuffer<T>,
    name: &str,
    dims: usize,
) -> PyResult<Items<'b, T>> {
    if !buffer.is_c_contiguous() {
        return Err(invalid_argument(format!("{name} must be C-contiguous")));
    }
    Items::new(buffer, name, dims)
}

/// The addresses of `buffer`'s items (to check that buffers do not overlap).
pub fn buffer_bytes<T: Element>(buffer: &PyBuffer<T>) -> Range<usize> {
    let start = buffer.buf_ptr() as usize;
    start..start + buffer.item_count() * std::mem::size_of::<T>()
}

/// `out` as a mutable slice: a writable, C-contiguous buffer of `shape` that overlaps none of
/// the `inputs` (address ranges).
pub fn output<'b, T: Element>(
    out: &'b mut PyBuffer<T>,
    name: &str,
    shape: &[usize],
    inputs: &[Range<usize>],
) -> PyResult<&'b mut [T]> {
    if !out.is_c_contiguous() || out.readonly() || out.shape() != shape {
        return Err(invalid_argument(format!(
            "{name} must be a writable C-contiguous array of shape {shape:?}, got shape {:?}",
            out.shape()
        )));
    }
    let len = out.item_count();
    let written = buffer_bytes(out);
    if inputs
        .iter()
        .any(|range| range.start < written.end && written.start < range.end)
    {
        return Err(invalid_argument(format!(
            "{name} overlaps an input; pass a separate output array"
        )));
    }
    // SAFETY: `out` is a writable, C-contiguous buffer of exactly `len` items that overlaps no
    // input (checked above), held by the caller for the whole call under the GIL.
    Ok(unsafe { std::slice::from_raw_parts_mut(out.buf_ptr() as *mut T, len) })
}
