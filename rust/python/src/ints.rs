//! Exact Python ints read in place.
//!
//! Token ids, request ids and counts arrive as Python ints, thousands per call; asking the
//! interpreter for each value (`PyLong_AsLongLong`, a call and its checks) costs more than the
//! rest of a decode step's conversion. A non-negative int below 2^30 is stored by CPython as
//! one 30-bit digit right after a size word, so its value can be read from the object, the
//! way Cython reads small ints. Where that word sits and what it holds depends on the
//! interpreter:
//! - CPython 3.9-3.11: a signed digit count (`ob_size`): 0 for zero, 1 for one digit;
//! - CPython 3.12-3.13: a tag, digit count << 3 | sign bits: 1 for zero, 8 for one positive
//!   digit.
//!
//! The module picks the layout from the running interpreter (CPython only), its version and
//! digit size at import and then checks it against `PyLong_AsLongLong` on sample values
//! (one-digit values must read back exactly, others must be declined); any mismatch (another
//! version, a free-threaded build's larger object header, 15-bit digits) leaves every read on
//! the interpreter's call. The digit is read only once the size word says there is one.
//! Values the in-place read declines (negative, two digits or more) always take the call.

use std::sync::atomic::{AtomicU8, Ordering};

use pyo3::prelude::*;

/// How exact ints are read: by calling the interpreter, or in place under one of two layouts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Layout {
    Call = 0,
    SignedSize = 1,
    Tag = 2,
}

/// The layout in use; `Call` until `detect` has checked one.
static LAYOUT: AtomicU8 = AtomicU8::new(Layout::Call as u8);

/// Byte offsets of the size word and of the first digit in an int object (after the object
/// header: a reference count and a type pointer).
const SIZE_OFFSET: usize = 2 * std::mem::size_of::<usize>();
const DIGIT_OFFSET: usize = 3 * std::mem::size_of::<usize>();

/// Picks the in-place layout for this interpreter if the sample values confirm it.
pub fn detect(py: Python<'_>) -> PyResult<()> {
    let version = py.version_info();
    let sys = py.import("sys")?;
    let implementation: String = sys.getattr("implementation")?.getattr("name")?.extract()?;
    let int_info = sys.getattr("int_info")?;
    let bits: u32 = int_info.getattr("bits_per_digit")?.extract()?;
    let digit_bytes: u32 = int_info.getattr("sizeof_digit")?.extract()?;
    let candidate = match (implementation.as_str(), version.minor, bits, digit_bytes) {
        _ if version.major != 3 => Layout::Call,
        ("cpython", 9..=11, 30, 4) => Layout::SignedSize,
        ("cpython", 12..=13, 30, 4) => Layout::Tag,
        _ => Layout::Call,
    };
    let layout = if candidate != Layout::Call && confirmed(py, candidate)? {
        candidate
    } else {
        Layout::Call
    };
    LAYOUT.store(layout as u8, Ordering::Relaxed);
    Ok(())
}

/// Whether `layout` reads every one-digit sample exactly and declines every other sample.
fn confirmed(py: Python<'_>, layout: Layout) -> PyResult<bool> {
    const ONE_DIGIT: [i64; 8] = [0, 1, 2, 255, 256, 1000, 123_456_789, (1 << 30) - 1];
    const OTHERS: [i64; 5] = [1 << 30, 1 << 45, -1, -5, -(1 << 40)];
    for value in ONE_DIGIT.into_iter().chain(OTHERS) {
        let object = value.into_pyobject(py)?;
        // SAFETY: an int object we hold; only its first 4 words are read, and every int
        // object of these interpreters is at least that large.
        let read = unsafe { read_in_place(layout, object.as_ptr()) };
        let expected = ONE_DIGIT.contains(&value).then_some(value);
        if read != expected {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The value of an int in place under `layout`, or `None` when the layout is `Call` or the
/// value is not a one-digit non-negative int.
///
/// # Safety
/// `item` points to a live `int` object (its type checked by the caller) and the GIL is held.
#[inline(always)]
unsafe fn read_in_place(layout: Layout, item: *const pyo3::ffi::PyObject) -> Option<i64> {
    let bytes = item.cast::<u8>();
    // SAFETY: (caller) `item` is an int object, whose size word follows the object header
    // under both layouts.
    let size_word = unsafe { bytes.add(SIZE_OFFSET).cast::<usize>().read() };
    match (layout, size_word) {
        (Layout::SignedSize, 0) | (Layout::Tag, 1) => Some(0),
        // SAFETY: a one-digit int: its first digit follows the size word.
        (Layout::SignedSize, 1) | (Layout::Tag, 8) => Some(i64::from(unsafe {
            bytes.add(DIGIT_OFFSET).cast::<u32>().read()
        })),
        _ => None,
    }
}

/// An exactly-`int` object's value if it fits in an `i64`; `None` otherwise (no error left set).
#[inline(always)]
pub fn exact_int(item: *mut pyo3::ffi::PyObject) -> Option<i64> {
    exact_int_in(current(), item)
}

/// `exact_int` under `layout` (`current()`, read once by a caller converting many items, so
/// that each layout's loop is compiled on its own).
#[inline(always)]
pub fn exact_int_in(layout: Layout, item: *mut pyo3::ffi::PyObject) -> Option<i64> {
    // SAFETY: callers pass a valid object pointer and hold the GIL.
    if unsafe { pyo3::ffi::PyLong_CheckExact(item) } == 0 {
        return None;
    }
    // SAFETY: `item` is an exact int (checked above) and the GIL is held.
    if let Some(value) = unsafe { read_in_place(layout, item) } {
        return Some(value);
    }
    called(item)
}

/// `exact_int` through the interpreter.
#[cold]
fn called(item: *mut pyo3::ffi::PyObject) -> Option<i64> {
    // SAFETY: `item` is an `int`; an overflow sets an error, cleared below.
    let value = unsafe { pyo3::ffi::PyLong_AsLongLong(item) };
    // SAFETY: the GIL is held.
    if value == -1 && !unsafe { pyo3::ffi::PyErr_Occurred() }.is_null() {
        // SAFETY: the GIL is held; the error is ours (set just above).
        unsafe { pyo3::ffi::PyErr_Clear() };
        return None;
    }
    Some(value)
}

/// The layout `detect` chose.
#[inline(always)]
pub fn current() -> Layout {
    match LAYOUT.load(Ordering::Relaxed) {
        1 => Layout::SignedSize,
        2 => Layout::Tag,
        _ => Layout::Call,
    }
}

/// Which layout `detect` chose: "call", "signed-size" or "tag" (for tests and diagnostics).
pub fn layout_name() -> &'static str {
    match current() {
        Layout::SignedSize => "signed-size",
        Layout::Tag => "tag",
        Layout::Call => "call",
    }
}
