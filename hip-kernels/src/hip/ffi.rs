//! The handful of HIP runtime calls the backend needs, bound at run time from `libamdhip64`.
//!
//! Why this exists (and why not `hip-sys` / `hip-runtime-sys` / `rocm-rs`): those crates link
//! `libamdhip64` when the binary is built, so a `--features hip` binary would not even start on a
//! host without ROCm, and the worker could not fall back to its CPU backend; `hip-runtime-sys`
//! also ships bindings generated for one ROCm release's struct layouts, and `rocm-rs` pulls in
//! MIOpen and other libraries. Here the library is opened with `dlopen` when a `HipBackend` is
//! created, only ABI-stable C entry points are used (no `hipDeviceProp_t` field access), and a
//! missing library or device becomes [`BackendError::NoDevice`](expertmesh_backend::BackendError).
//!
//! Memory spaces: in every signature below, `hipDeviceptr` arguments are device global memory
//! (from `hipMalloc`), `host` pointers are ordinary or pinned (`hipHostMalloc`) host memory.

use super::LIBRARY_ENV;
use libloading::Library;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

/// `hipError_t` (0 = success).
pub(crate) type HipError = c_int;
/// Opaque `hipStream_t`.
pub(crate) type HipStream = *mut c_void;
/// Opaque `hipModule_t`.
pub(crate) type HipModule = *mut c_void;
/// Opaque `hipFunction_t`.
pub(crate) type HipFunction = *mut c_void;

/// `hipDeviceAttributeMultiprocessorCount` (ROCm ≥ 5.0 numbering).
pub(crate) const ATTR_MULTIPROCESSOR_COUNT: c_int = 63;

macro_rules! hip_api {
    ($( $(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*); )*) => {
        /// Entry points resolved from `libamdhip64`.
        #[allow(non_snake_case)]
        pub(crate) struct HipApi {
            _lib: Library,
            $( $(#[$doc])* pub(crate) $name: unsafe extern "C" fn($($ty),*) -> HipError, )*
        }

        impl HipApi {
            #[allow(non_snake_case)]
            fn resolve(lib: Library) -> Result<Self, String> {
                // SAFETY: each symbol is looked up by its C name and given the C signature of the
                // HIP runtime API (ROCm 5.x/6.x, unchanged across them); the Library is kept alive
                // in the struct for as long as the function pointers are.
                unsafe {
                    $( let $name = *lib
                        .get::<unsafe extern "C" fn($($ty),*) -> HipError>(concat!(stringify!($name), "\0").as_bytes())
                        .map_err(|e| format!("libamdhip64 lacks {}: {e}", stringify!($name)))?; )*
                    Ok(Self { _lib: lib, $( $name, )* })
                }
            }
        }
    };
}

hip_api! {
    /// `hipInit(flags)`.
    fn hipInit(flags: c_uint);
    /// `hipGetDeviceCount(host out count)`.
    fn hipGetDeviceCount(count: *mut c_int);
    /// `hipSetDevice(device)`.
    fn hipSetDevice(device: c_int);
    /// `hipDeviceGetAttribute(host out value, attribute, device)`.
    fn hipDeviceGetAttribute(value: *mut c_int, attr: c_int, device: c_int);
    /// `hipGetDeviceProperties(host out struct, device)`: only scanned for the arch name (the
    /// struct layout differs between ROCm releases; the caller passes an oversized buffer).
    fn hipGetDeviceProperties(props: *mut c_void, device: c_int);
    /// `hipMemGetInfo(host out free bytes, host out total bytes)`.
    fn hipMemGetInfo(free: *mut usize, total: *mut usize);
    /// `hipMalloc(host out device pointer, bytes)`.
    fn hipMalloc(ptr: *mut *mut c_void, bytes: usize);
    /// `hipFree(device pointer)`.
    fn hipFree(ptr: *mut c_void);
    /// `hipHostMalloc(host out pinned host pointer, bytes, flags)`.
    fn hipHostMalloc(ptr: *mut *mut c_void, bytes: usize, flags: c_uint);
    /// `hipHostFree(pinned host pointer)`.
    fn hipHostFree(ptr: *mut c_void);
    /// `hipMemcpyHtoDAsync(device dst, host src, bytes, stream)`.
    fn hipMemcpyHtoDAsync(dst: *mut c_void, src: *const c_void, bytes: usize, stream: HipStream);
    /// `hipMemcpyDtoHAsync(host dst, device src, bytes, stream)`.
    fn hipMemcpyDtoHAsync(dst: *mut c_void, src: *const c_void, bytes: usize, stream: HipStream);
    /// `hipMemsetAsync(device dst, byte value, bytes, stream)`.
    fn hipMemsetAsync(dst: *mut c_void, value: c_int, bytes: usize, stream: HipStream);
    /// `hipStreamCreate(host out stream)`.
    fn hipStreamCreate(stream: *mut HipStream);
    /// `hipStreamDestroy(stream)`.
    fn hipStreamDestroy(stream: HipStream);
    /// `hipStreamSynchronize(stream)`.
    fn hipStreamSynchronize(stream: HipStream);
    /// `hipModuleLoadData(host out module, host code object image)`.
    fn hipModuleLoadData(module: *mut HipModule, image: *const c_void);
    /// `hipModuleUnload(module)`.
    fn hipModuleUnload(module: HipModule);
    /// `hipModuleGetFunction(host out function, module, host C string name)`.
    fn hipModuleGetFunction(func: *mut HipFunction, module: HipModule, name: *const c_char);
    /// `hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(host out blocks, function, threads per
    /// block, dynamic LDS bytes)`.
    fn hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(blocks: *mut c_int, func: HipFunction, block: c_int, lds: usize);
    /// `hipModuleLaunchKernel(function, grid x/y/z, block x/y/z, dynamic LDS bytes, stream,
    /// host array of host pointers to each argument, extra = null)`.
    fn hipModuleLaunchKernel(f: HipFunction, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, lds: c_uint, stream: HipStream, params: *mut *mut c_void, extra: *mut *mut c_void);
}

/// `hipGetErrorString` has a different return type, so it is resolved separately.
type ErrorStringFn = unsafe extern "C" fn(HipError) -> *const c_char;

/// The loaded runtime: the entry points plus `hipGetErrorString`.
pub(crate) struct Hip {
    pub(crate) api: HipApi,
    error_string: Option<ErrorStringFn>,
}

// SAFETY: the HIP runtime API is thread-safe; the struct holds only function pointers and the
// library handle.
unsafe impl Send for Hip {}
// SAFETY: as above.
unsafe impl Sync for Hip {}

/// Library names tried in order (the unversioned name needs the -dev package).
const LIBRARY_NAMES: [&str; 4] = [
    "libamdhip64.so",
    "libamdhip64.so.6",
    "libamdhip64.so.5",
    "libamdhip64.so.7",
];

impl Hip {
    /// Open the runtime: `library` when given, else the file named by [`LIBRARY_ENV`], else
    /// `libamdhip64` from `$HIP_PATH`, `$ROCM_PATH`, `/opt/rocm` and the loader's path. An
    /// explicitly named library is the only one tried. Err carries a message for
    /// [`BackendError::NoDevice`](expertmesh_backend::BackendError::NoDevice).
    pub(crate) fn open(library: Option<&std::path::Path>) -> Result<Self, String> {
        let mut tried = Vec::new();
        let mut candidates: Vec<std::path::PathBuf> = Vec::new();
        let named = library
            .map(std::path::Path::to_path_buf)
            .or_else(|| std::env::var_os(LIBRARY_ENV).map(std::path::PathBuf::from));
        if let Some(path) = &named {
            candidates.push(path.clone());
        } else {
            for var in ["HIP_PATH", "ROCM_PATH"] {
                if let Some(root) = std::env::var_os(var) {
                    candidates.push(std::path::Path::new(&root).join("lib/libamdhip64.so"));
                }
            }
            candidates.push("/opt/rocm/lib/libamdhip64.so".into());
            candidates.extend(LIBRARY_NAMES.iter().map(std::path::PathBuf::from));
        }
        for name in candidates {
            // SAFETY: loading the HIP runtime runs its initializers, which is what using HIP
            // requires; no other code is loaded.
            match unsafe { Library::new(&name) } {
                Ok(lib) => {
                    // SAFETY: hipGetErrorString has this C signature in every ROCm release.
                    let error_string = unsafe {
                        lib.get::<ErrorStringFn>(b"hipGetErrorString\0")
                            .ok()
                            .map(|s| *s)
                    };
                    let api =
                        HipApi::resolve(lib).map_err(|e| format!("{}: {e}", name.display()))?;
                    return Ok(Self { api, error_string });
                }
                Err(e) => tried.push(format!("{}: {e}", name.display())),
            }
        }
        if named.is_some() {
            return Err(format!(
                "the HIP runtime library named by the caller or {LIBRARY_ENV} could not be loaded: {}",
                tried.join("; ")
            ));
        }
        Err(format!(
            "the HIP runtime library could not be loaded (install ROCm's libamdhip64, or set ROCM_PATH or \
             {LIBRARY_ENV}); tried {}",
            tried.join("; ")
        ))
    }

    /// `Ok(())` for hipSuccess, else a message naming the call and the HIP error.
    pub(crate) fn check(&self, call: &str, err: HipError) -> Result<(), String> {
        if err == 0 {
            return Ok(());
        }
        let text = self
            .error_string
            .map(|f| {
                // SAFETY: hipGetErrorString returns a static NUL-terminated string for any code.
                unsafe { CStr::from_ptr(f(err)) }
                    .to_string_lossy()
                    .into_owned()
            })
            .unwrap_or_else(|| "unknown error".into());
        Err(format!("{call} failed: {text} (hipError {err})"))
    }
}
