//! Zero-copy, read-only views of the coordinator's block table for numpy.
//!
//! A `TableView` holds a reference to the Python `Coordinator` object (so the Rust memory lives
//! as long as any view) and exports the table through the buffer protocol: C-contiguous int32
//! with the table's shape. `numpy.asarray(view)` wraps it without a copy; later allocations show
//! through the same array. Views are read-only: the table belongs to the Rust core.

use std::ffi::{c_int, c_void};
use std::ptr;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::coordinator::PyCoordinator;

#[pyclass(module = "hybrid_cache._core", frozen)]
pub struct TableView {
    /// Keeps the coordinator, and with it the table memory, alive.
    _owner: Py<PyCoordinator>,
    /// Start of the exported memory (an address inside the coordinator's boxed table).
    address: usize,
    shape: Box<[ffi::Py_ssize_t]>,
    strides: Box<[ffi::Py_ssize_t]>,
}

impl TableView {
    /// A view of `shape` int32 items at `data`, owned by `owner`.
    pub fn new(owner: Py<PyCoordinator>, data: *const i32, shape: &[usize]) -> Self {
        let item_size = std::mem::size_of::<i32>() as ffi::Py_ssize_t;
        let mut strides = vec![item_size; shape.len()];
        for axis in (0..shape.len().saturating_sub(1)).rev() {
            strides[axis] = strides[axis + 1] * shape[axis + 1] as ffi::Py_ssize_t;
        }
        TableView {
            _owner: owner,
            address: data as usize,
            shape: shape.iter().map(|&n| n as ffi::Py_ssize_t).collect(),
            strides: strides.into_boxed_slice(),
        }
    }
}

#[pymethods]
impl TableView {
    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("view is null"));
        }
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE {
            return Err(PyBufferError::new_err(
                "the block table is read-only: the Rust core owns it",
            ));
        }
        let this = slf.get();
        let num_items: ffi::Py_ssize_t = this.shape.iter().product();
        // SAFETY: `view` is non-null and CPython hands us a Py_buffer to fill. The pointers we
        // store (data, shape, strides, format) stay valid while `view.obj` (this object, which
        // keeps the coordinator alive) lives; the table is never reallocated.
        unsafe {
            (*view).buf = this.address as *mut c_void;
            (*view).len = num_items * std::mem::size_of::<i32>() as ffi::Py_ssize_t;
            (*view).readonly = 1;
            (*view).itemsize = std::mem::size_of::<i32>() as ffi::Py_ssize_t;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
                c"i".as_ptr().cast_mut()
            } else {
                ptr::null_mut()
            };
            (*view).ndim = this.shape.len() as c_int;
            (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
                this.shape.as_ptr().cast_mut()
            } else {
                ptr::null_mut()
            };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                this.strides.as_ptr().cast_mut()
            } else {
                ptr::null_mut()
            };
            (*view).suboffsets = ptr::null_mut();
            (*view).internal = ptr::null_mut();
            (*view).obj = slf.into_any().into_ptr();
        }
        Ok(())
    }

    /// # Safety
    /// Called by CPython; nothing was allocated per view.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}
