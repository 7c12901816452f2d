//! Borrowing a Python array's memory without copying it: 2-D, C-contiguous, CPU.
//!
//! Why this exists: the client sends hidden states straight from the caller's array into the
//! request buffer and writes answers straight into the caller's `out=` array. The package is an
//! abi3 wheel for Python ≥ 3.9, whose stable ABI has no buffer protocol (it came in 3.11), so
//! arrays are read through the two protocols that carry a data pointer:
//!
//! * **DLPack** (`__dlpack__()`, a `"dltensor"` capsule): NumPy ≥ 1.22 arrays (writable ones)
//!   and PyTorch tensors, CPU only. This is the fast path (~0.1 µs). The capsule is borrowed,
//!   not consumed: it is kept alive while the memory is used and its producer frees it.
//! * **`__array_interface__`** (NumPy's dict: data pointer, read-only flag, typestr, shape,
//!   strides): read-only NumPy arrays, which NumPy does not export through legacy DLPack, and
//!   other array types that expose only this.
//!
//! Both give the pointer, the element type, the shape and the strides; [`View`] checks that the
//! array is 2-D, C-contiguous and aligned for its element type and keeps the exporting object
//! alive. Nothing is copied.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyDict, PyTuple};
use std::ffi::c_void;

/// Element types the client handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Elem {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16 (a DLPack/torch bf16 tensor).
    Bf16,
    /// 16-bit unsigned integers: bf16 bit patterns for hidden states (NumPy has no bf16).
    U16,
    /// Anything else (described for the error message).
    Other,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F16 | Elem::Bf16 | Elem::U16 => 2,
            Elem::Other => 1,
        }
    }
}

/// A borrowed 2-D C-contiguous array.
pub(crate) struct View {
    ptr: *mut u8,
    /// Rows (tokens).
    pub(crate) rows: usize,
    /// Columns (hidden size, experts).
    pub(crate) cols: usize,
    /// Element type.
    pub(crate) elem: Elem,
    /// The array says it is read-only (DLPack exports are writable).
    pub(crate) readonly: bool,
    /// The object that owns the memory (the array, or the DLPack capsule that keeps it alive).
    _owner: Py<PyAny>,
}

/// A pointer and a length that may cross into [`Python::detach`]: the memory is owned by a
/// Python object kept alive by a [`View`] that outlives the call.
#[derive(Clone, Copy)]
pub(crate) struct Raw<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: a `Raw` is only created from a `View` that holds a strong reference to the owner of
// the memory for as long as the `Raw` is used (the call that made it), and the memory is only
// accessed from the one thread that runs that call.
unsafe impl<T> Send for Raw<T> {}
// SAFETY: as for `Send`: a `Raw` is a pointer handed to the one thread that runs the call.
unsafe impl<T> Sync for Raw<T> {}

impl<T> Raw<T> {
    /// The values.
    ///
    /// # Safety
    /// The [`View`] this was made from is alive, and nothing writes the memory while the slice
    /// is used (the documented contract: callers do not mutate an array during a call on it).
    pub(crate) unsafe fn slice<'a>(self) -> &'a [T] {
        // SAFETY: `ptr` is non-null and aligned for `len` values of `T` (checked by `View`),
        // the owner is alive (the caller's contract), and nothing writes it meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The values, writable.
    ///
    /// # Safety
    /// As [`Raw::slice`], and no other slice of this memory is alive while this one is used.
    pub(crate) unsafe fn slice_mut<'a>(self) -> &'a mut [T] {
        // SAFETY: as in `slice`, plus exclusivity (the caller's contract); the view was checked
        // writable.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl View {
    /// Values in the array.
    pub(crate) fn len(&self) -> usize {
        self.rows * self.cols
    }

    /// The memory as `T` values; `elem` must have `T`'s size (checked by the caller).
    pub(crate) fn raw<T>(&self) -> Raw<T> {
        debug_assert_eq!(std::mem::size_of::<T>(), self.elem.size());
        Raw {
            ptr: self.ptr.cast::<T>(),
            len: self.len(),
        }
    }
}

/// Borrow `obj` as a 2-D C-contiguous CPU array; `arg` names the argument in errors.
pub(crate) fn view(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<View> {
    let py = obj.py();
    if let Ok(export) = obj.getattr(intern!(py, "__dlpack__")) {
        match export.call0() {
            Ok(capsule) => return from_dlpack(obj, capsule, arg),
            // NumPy refuses read-only arrays (and other byte orders) through legacy DLPack:
            // its array interface describes them.
            Err(_) if has_array_interface(obj) => {}
            // Nothing else describes it: the exporter's reason is the answer (torch: a tensor
            // that requires grad, a conjugate or sparse one).
            Err(e) => {
                let err = PyTypeError::new_err(format!(
                    "{arg}: cannot borrow the {} through DLPack: {e}",
                    type_name(obj)
                ));
                err.set_cause(py, Some(e));
                return Err(err);
            }
        }
    }
    if has_array_interface(obj) {
        return from_array_interface(obj, arg);
    }
    Err(PyTypeError::new_err(format!(
        "{arg}: expected a 2-D numpy array or CPU torch tensor, got {}",
        type_name(obj)
    )))
}

fn has_array_interface(obj: &Bound<'_, PyAny>) -> bool {
    obj.hasattr(intern!(obj.py(), "__array_interface__"))
        .unwrap_or(false)
}

/// `numpy.ndarray`, `torch.Tensor`, `list`, ...
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    let t = obj.get_type();
    let module = t
        .getattr(intern!(obj.py(), "__module__"))
        .and_then(|m| m.extract::<String>())
        .unwrap_or_default();
    let name = t
        .getattr(intern!(obj.py(), "__qualname__"))
        .and_then(|m| m.extract::<String>())
        .unwrap_or_else(|_| "object".into());
    if module.is_empty() || module == "builtins" {
        name
    } else {
        format!("{module}.{name}")
    }
}

/// The array's dtype as its library names it (`float64`, `torch.int32`), for error messages.
pub(crate) fn dtype_name(obj: &Bound<'_, PyAny>) -> String {
    obj.getattr(intern!(obj.py(), "dtype"))
        .and_then(|d| d.str().map(|s| s.to_string()))
        .unwrap_or_else(|_| "an unknown dtype".into())
}

// DLPack's C structs (dlpack.h, ABI stable since v0.3); a `DLManagedTensor` starts with its
// `DLTensor`.
#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

const DL_CPU: i32 = 1;
const DL_CUDA_HOST: i32 = 3;
const DL_CUDA_MANAGED: i32 = 13;
const DL_UINT: u8 = 1;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;

fn from_dlpack(obj: &Bound<'_, PyAny>, capsule: Bound<'_, PyAny>, arg: &str) -> PyResult<View> {
    let not_a_capsule = || {
        PyTypeError::new_err(format!(
            "{arg}: {}.__dlpack__() did not return a \"dltensor\" capsule",
            type_name(obj)
        ))
    };
    let cap = capsule.cast::<PyCapsule>().map_err(|_| not_a_capsule())?;
    // SAFETY: `cap` is a live capsule object; PyCapsule_IsValid only reads it.
    let valid = unsafe { pyo3::ffi::PyCapsule_IsValid(cap.as_ptr(), c"dltensor".as_ptr()) };
    if valid != 1 {
        return Err(not_a_capsule());
    }
    // SAFETY: the capsule is valid with this name, so the pointer is its DLManagedTensor,
    // which begins with a DLTensor and lives as long as the capsule.
    let t = unsafe {
        &*(pyo3::ffi::PyCapsule_GetPointer(cap.as_ptr(), c"dltensor".as_ptr()) as *const DlTensor)
    };
    if !matches!(
        t.device.device_type,
        DL_CPU | DL_CUDA_HOST | DL_CUDA_MANAGED
    ) {
        return Err(PyValueError::new_err(format!(
            "{arg}: the tensor is on a device (DLPack device type {}, index {}); move it to the CPU first (x.cpu())",
            t.device.device_type, t.device.device_id
        )));
    }
    let elem = match (t.dtype.code, t.dtype.bits, t.dtype.lanes) {
        (DL_FLOAT, 32, 1) => Elem::F32,
        (DL_FLOAT, 16, 1) => Elem::F16,
        (DL_BFLOAT, 16, 1) => Elem::Bf16,
        (DL_UINT, 16, 1) => Elem::U16,
        _ => Elem::Other,
    };
    let ndim = usize::try_from(t.ndim).unwrap_or(0);
    let shape: Vec<i64> = if ndim == 0 || t.shape.is_null() {
        Vec::new()
    } else {
        // SAFETY: DLPack: `shape` points to `ndim` values.
        unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec()
    };
    let strides: Option<Vec<i64>> = if ndim == 0 || t.strides.is_null() {
        None // compact row-major
    } else {
        // SAFETY: DLPack: `strides` (in elements), when non-null, points to `ndim` values.
        Some(unsafe { std::slice::from_raw_parts(t.strides, ndim) }.to_vec())
    };
    let shape: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
    let strides = strides.map(|s| s.iter().map(|&v| v * elem.size() as i64).collect());
    let ptr = (t.data as *mut u8).wrapping_add(t.byte_offset as usize);
    finish(
        capsule.clone().unbind(),
        arg,
        ptr,
        &shape,
        strides,
        elem,
        false,
    )
}

fn from_array_interface(obj: &Bound<'_, PyAny>, arg: &str) -> PyResult<View> {
    let py = obj.py();
    let bad = |what: &str| {
        PyTypeError::new_err(format!(
            "{arg}: the {}'s __array_interface__ {what}",
            type_name(obj)
        ))
    };
    let ai = obj.getattr(intern!(py, "__array_interface__"))?;
    let ai = ai.cast::<PyDict>().map_err(|_| bad("is not a dict"))?;
    let item = |k: &str| ai.get_item(k).ok().flatten();
    let data = item("data").ok_or_else(|| bad("has no data"))?;
    let data = data
        .cast::<PyTuple>()
        .map_err(|_| bad("data is not a (pointer, read-only) pair"))?;
    let ptr: usize = data.get_item(0)?.extract()?;
    let readonly: bool = data.get_item(1)?.extract()?;
    let typestr: String = item("typestr")
        .ok_or_else(|| bad("has no typestr"))?
        .extract()?;
    let shape: Vec<usize> = item("shape")
        .ok_or_else(|| bad("has no shape"))?
        .extract()?;
    let strides: Option<Vec<i64>> = match item("strides") {
        Some(s) if !s.is_none() => Some(s.extract()?),
        _ => None,
    };
    let native = cfg!(target_endian = "little");
    let elem = match typestr.as_str() {
        "<f4" if native => Elem::F32,
        "<f2" if native => Elem::F16,
        "<u2" if native => Elem::U16,
        _ => Elem::Other,
    };
    let ptr = ptr as *mut u8;
    finish(
        obj.clone().unbind(),
        arg,
        ptr,
        &shape,
        strides,
        elem,
        readonly,
    )
}

/// Shape, layout and alignment checks common to both protocols. `strides` in bytes (`None`:
/// C-contiguous).
#[allow(clippy::too_many_arguments)]
fn finish(
    owner: Py<PyAny>,
    arg: &str,
    ptr: *mut u8,
    shape: &[usize],
    strides: Option<Vec<i64>>,
    elem: Elem,
    readonly: bool,
) -> PyResult<View> {
    if shape.len() != 2 {
        return Err(PyValueError::new_err(format!(
            "{arg}: expected a 2-D array [tokens, {}], got shape {}",
            if arg == "logits" { "experts" } else { "hidden" },
            shape_str(shape)
        )));
    }
    let (rows, cols) = (shape[0], shape[1]);
    if let Some(s) = strides {
        // A hand-made `__array_interface__` may give strides that do not match its shape.
        if s.len() != 2 {
            return Err(PyValueError::new_err(format!(
                "{arg}: its strides {s:?} do not match its shape {} (one stride per dimension)",
                shape_str(shape)
            )));
        }
        let item = elem.size() as i64;
        let row_ok = rows <= 1 || s[0] == cols as i64 * item;
        let col_ok = cols <= 1 || s[1] == item;
        if !(row_ok && col_ok) {
            return Err(PyValueError::new_err(format!(
                "{arg}: the array is not C-contiguous (strides {:?} bytes for shape {}); pass np.ascontiguousarray({arg}) or {arg}.contiguous()",
                s,
                shape_str(shape)
            )));
        }
    }
    if elem != Elem::Other
        && rows * cols > 0
        && (ptr.is_null() || !(ptr as usize).is_multiple_of(elem.size()))
    {
        return Err(PyValueError::new_err(format!(
            "{arg}: the array's data is not aligned to its {}-byte elements; pass a copy ({arg}.copy())",
            elem.size()
        )));
    }
    Ok(View {
        ptr,
        rows,
        cols,
        elem,
        readonly,
        _owner: owner,
    })
}

fn shape_str(shape: &[usize]) -> String {
    let parts: Vec<String> = shape.iter().map(usize::to_string).collect();
    if parts.len() == 1 {
        format!("({},)", parts[0])
    } else {
        format!("({})", parts.join(", "))
    }
}
