//! Python buffer-protocol objects as byte slices: the legacy tensor path (`batch_set` /
//! `batch_get` with whole flat pages) hands kvtier CPU tensors viewed as uint8 numpy arrays.
//!
//! Invariant: a slice is made only from a buffer that is C-contiguous (and writable, for a
//! destination), and only while the `PyUntypedBuffer` that pins the exporter is alive.
// A named unsafe module (issue 16 lints): views of Python buffer-protocol memory.
#![allow(unsafe_code)]

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// A held buffer export, checked once when it is taken.
pub struct HeldBuffer {
    buffer: PyUntypedBuffer,
}

impl HeldBuffer {
    /// Take a buffer export of `obj`; a non-contiguous buffer is an error naming `what`.
    pub fn take(obj: &Bound<'_, PyAny>, writable: bool, what: &str) -> PyResult<HeldBuffer> {
        let buffer = PyUntypedBuffer::get(obj)?;
        if !buffer.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{what}: buffer is not C-contiguous"
            )));
        }
        if writable && buffer.readonly() {
            return Err(PyValueError::new_err(format!(
                "{what}: buffer is read-only"
            )));
        }
        Ok(HeldBuffer { buffer })
    }

    pub fn len(&self) -> usize {
        self.buffer.len_bytes()
    }

    pub fn as_bytes(&self) -> &[u8] {
        let len = self.len();
        if len == 0 {
            return &[];
        }
        // SAFETY: the export is held for &self's lifetime, is C-contiguous (checked in take)
        // and spans len_bytes() bytes from buf_ptr().
        unsafe { std::slice::from_raw_parts(self.buffer.buf_ptr() as *const u8, len) }
    }

    /// Mutable view; only for buffers taken with `writable = true`.
    #[allow(clippy::mut_from_ref)]
    pub fn as_bytes_mut(&self) -> &mut [u8] {
        let len = self.len();
        if len == 0 || self.buffer.readonly() {
            return &mut [];
        }
        // SAFETY: as in as_bytes, and the export is writable (checked in take). Each
        // HeldBuffer is used by one copy at a time inside a batch call.
        unsafe { std::slice::from_raw_parts_mut(self.buffer.buf_ptr() as *mut u8, len) }
    }
}
