//! One HIP device: runtime handles, loaded modules, buffers allocated at load, batch execution.
//!
//! Why this exists: it is the only code that calls the HIP runtime (through [`super::ffi`]). It
//! owns every device and pinned host allocation and frees them on drop; `execute` allocates
//! nothing, writes the batch's work list into pinned staging, and runs on one stream:
//!
//! 1. upload input and work list; accurate mode: zero the counters;
//! 2. exact mode: `em_quantize_activations` (codes, scales and code sums of each 32-block; it
//!    zeroes the counters too, one launch fewer);
//! 3. `em_decode_{exact,accurate}` (persistent, fused or two-phase) — or, in exact mode when some
//!    expert has at least [`PREFILL_MIN_TOKENS`] tokens, `em_prefill_exact_w13` + `_w2`;
//! 4. PreCombined: `em_combine_slots`; download; check the kernels' status word.

use super::ffi::{ATTR_MULTIPROCESSOR_COUNT, Hip, HipFunction, HipModule, HipStream};
use super::objects::CODE_OBJECTS;
use crate::kernel_abi::*;
use expertmesh_backend::{
    Activations, BackendError, BatchLimits, ExpertKey, ExpertShape, ExpertSource, GroupedBatch,
    OutputLayout,
};
use expertmesh_quant::contract::ComputeMode;
use expertmesh_quant::format::{BLOCK, ExpertWeights, QuantSpec};
use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::ptr;

/// Exact-mode batches with an expert of at least this many tokens take the prefill kernels.
pub(crate) const PREFILL_MIN_TOKENS: usize = 8;
/// Bound on a fused phase-2 item's wait, in polls of its expert's counter.
const SPIN_LIMIT: u32 = 1 << 22;
/// Alignment of sub-allocations inside one device buffer.
const SUB_ALIGN: usize = 256;

const BACKEND: &str = "hip";

fn dev_err(detail: String) -> BackendError {
    BackendError::Device {
        backend: BACKEND,
        detail,
    }
}

/// The kernels of one loaded code-object set.
struct Kernels {
    modules: Vec<HipModule>,
    quantize: HipFunction,
    combine: HipFunction,
    decode_exact: HipFunction,
    decode_accurate: HipFunction,
    prefill_w13: HipFunction,
    prefill_w2: HipFunction,
}

/// Device buffers and pinned staging sized at load time.
struct Loaded {
    shape: EmShape,
    /// The packed format every expert shares (a gained expert must match it).
    spec: QuantSpec,
    slots: HashMap<ExpertKey, u32>,
    /// The device table's host copy, by slot (a released slot holds null pointers).
    table: Vec<EmExpertPtrs>,
    /// Entries the device table `d_experts` has room for.
    table_cap: usize,
    /// Slots released, reused first by gained experts.
    free_slots: Vec<u32>,
    /// Each expert's device allocation and its weight bytes (freed when it is released).
    weights: HashMap<ExpertKey, (*mut c_void, u64)>,
    limits: BatchLimits,
    bytes: u64,
    d_experts: *mut c_void,
    d_x: *mut c_void,
    d_xq: *mut c_void,
    d_xd: *mut c_void,
    d_xqsum: *mut c_void,
    d_groups: *mut c_void,
    d_pair_token: *mut c_void,
    d_pair_out: *mut c_void,
    d_items: *mut c_void,
    d_hq: *mut c_void,
    d_hd: *mut c_void,
    d_hqsum: *mut c_void,
    d_hf: *mut c_void,
    d_y: *mut c_void,
    d_out: *mut c_void,
    d_tok_ptr: *mut c_void,
    d_tok_rows: *mut c_void,
    d_tok_w: *mut c_void,
    d_counters: *mut c_void,
    h_in: *mut c_void,
    h_groups: *mut EmGroup,
    h_pair_token: *mut u32,
    h_pair_out: *mut u32,
    h_items: *mut u32,
    h_tok_ptr: *mut u32,
    h_tok_rows: *mut u32,
    h_tok_w: *mut f32,
    h_out: *mut f32,
    h_status: *mut u32,
    decode_grid: [u32; 2],
}

/// Experts uploaded by `load`: table entries by slot, slots and allocations by key, and the
/// device table.
struct Uploaded {
    table: Vec<EmExpertPtrs>,
    slots: HashMap<ExpertKey, u32>,
    weights: HashMap<ExpertKey, (*mut c_void, u64)>,
    d_experts: *mut c_void,
}

/// The table entry of a released slot: no kernel is handed its slot (the work list is built
/// from the slots of loaded keys), and a stray read would fault on null rather than read freed
/// memory.
const NO_EXPERT: EmExpertPtrs = EmExpertPtrs {
    w13_nibbles: ptr::null(),
    w13_scales: ptr::null(),
    w13_zeros: ptr::null(),
    w2_nibbles: ptr::null(),
    w2_scales: ptr::null(),
    w2_zeros: ptr::null(),
};

/// A HIP device with its modules, stream and (after `load`) buffers.
pub(crate) struct HipDevice {
    hip: Hip,
    device: i32,
    arch: &'static str,
    wave: u32,
    compute_units: u32,
    stream: HipStream,
    kernels: Kernels,
    device_allocs: Vec<*mut c_void>,
    host_allocs: Vec<*mut c_void>,
    loaded: Option<Loaded>,
    fused: bool,
    /// Output rows already claimed, for the allocation-free batch check.
    seen_rows: Vec<bool>,
}

// SAFETY: the device, its stream and its buffers are used from one thread at a time (`&mut self`
// for every operation); HIP handles may move between threads.
unsafe impl Send for HipDevice {}

impl HipDevice {
    pub(crate) fn open(
        device: usize,
        library: Option<&std::path::Path>,
    ) -> Result<Self, BackendError> {
        let no_device = |detail: String| BackendError::NoDevice {
            backend: BACKEND,
            detail,
        };
        let hip = Hip::open(library).map_err(no_device)?;
        let api = &hip.api;
        // SAFETY: plain runtime calls with valid out-pointers.
        unsafe {
            hip.check("hipInit", (api.hipInit)(0)).map_err(|e| {
                no_device(format!(
                    "the HIP runtime found no usable AMD GPU ({e}); check that /dev/kfd and /dev/dri are present \
                     and accessible"
                ))
            })?;
            let mut count = 0;
            let r = (api.hipGetDeviceCount)(&mut count);
            if r != 0 || count <= 0 {
                let why = hip
                    .check("hipGetDeviceCount", r)
                    .err()
                    .unwrap_or_else(|| "0 devices".into());
                return Err(no_device(format!(
                    "the HIP runtime sees no GPU ({why}); check that /dev/kfd and /dev/dri are accessible and \
                     HIP_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES"
                )));
            }
            if device >= count as usize {
                return Err(no_device(format!(
                    "device {device} requested but only {count} present"
                )));
            }
            let dev = device as i32;
            hip.check("hipSetDevice", (api.hipSetDevice)(dev))
                .map_err(no_device)?;
            let arch_name = device_arch(&hip, dev);
            let mut cus = 0;
            let cus_ok = (api.hipDeviceGetAttribute)(&mut cus, ATTR_MULTIPROCESSOR_COUNT, dev) == 0;
            let compute_units = if cus_ok && (1..=4096).contains(&cus) {
                cus as u32
            } else {
                64
            };
            let (arch, modules) = load_modules(&hip, &arch_name).map_err(no_device)?;
            let kernels = resolve_kernels(&hip, modules).map_err(dev_err)?;
            let mut stream = ptr::null_mut();
            hip.check("hipStreamCreate", (api.hipStreamCreate)(&mut stream))
                .map_err(dev_err)?;
            Ok(Self {
                wave: if arch.starts_with("gfx9") { 64 } else { 32 },
                hip,
                device: dev,
                arch,
                compute_units,
                stream,
                kernels,
                device_allocs: Vec::new(),
                host_allocs: Vec::new(),
                loaded: None,
                fused: true,
                seen_rows: Vec::new(),
            })
        }
    }

    pub(crate) fn name(&self) -> String {
        format!("hip-{}", self.arch)
    }

    pub(crate) fn set_fused(&mut self, fused: bool) {
        self.fused = fused;
    }

    pub(crate) fn loaded_bytes(&self) -> u64 {
        self.loaded.as_ref().map_or(0, |l| l.bytes)
    }

    fn call(&self, what: &str, r: i32) -> Result<(), BackendError> {
        self.hip.check(what, r).map_err(dev_err)
    }

    /// Make this device the calling thread's current one: HIP's current device is per
    /// thread, and allocations and launches go to it, so every entry point binds first (the
    /// backend may be moved to another thread after `open`).
    fn bind(&self) -> Result<(), BackendError> {
        // SAFETY: a plain runtime call; `self.device` was checked in `open`.
        self.call("hipSetDevice", unsafe {
            (self.hip.api.hipSetDevice)(self.device)
        })
    }

    fn dev_alloc(&mut self, bytes: usize) -> Result<*mut c_void, BackendError> {
        let mut p = ptr::null_mut();
        // SAFETY: valid out-pointer; the allocation is recorded and freed in `free_all`.
        let r = unsafe { (self.hip.api.hipMalloc)(&mut p, bytes.max(SUB_ALIGN)) };
        self.call(&format!("hipMalloc({bytes} bytes)"), r)?;
        self.device_allocs.push(p);
        Ok(p)
    }

    fn host_alloc(&mut self, bytes: usize) -> Result<*mut c_void, BackendError> {
        let mut p = ptr::null_mut();
        // SAFETY: valid out-pointer; flags 0 = hipHostMallocDefault (pinned, portable).
        let r = unsafe { (self.hip.api.hipHostMalloc)(&mut p, bytes.max(SUB_ALIGN), 0) };
        self.call(&format!("hipHostMalloc({bytes} bytes)"), r)?;
        self.host_allocs.push(p);
        Ok(p)
    }

    fn free_all(&mut self) {
        // SAFETY: every pointer came from hipMalloc / hipHostMalloc of this device and is freed
        // once; the stream is synchronized first so no kernel still uses them.
        unsafe {
            (self.hip.api.hipStreamSynchronize)(self.stream);
            for p in self.device_allocs.drain(..) {
                (self.hip.api.hipFree)(p);
            }
            for p in self.host_allocs.drain(..) {
                (self.hip.api.hipHostFree)(p);
            }
        }
        self.loaded = None;
    }

    fn upload(&self, dst: *mut c_void, src: &[u8]) -> Result<(), BackendError> {
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: dst is a device allocation of at least src.len() bytes (sized by the caller).
        let r = unsafe {
            (self.hip.api.hipMemcpyHtoDAsync)(dst, src.as_ptr().cast(), src.len(), self.stream)
        };
        self.call("hipMemcpyHtoDAsync", r)?;
        // Pageable source: wait before the slice can go away.
        // SAFETY: valid stream.
        self.call("hipStreamSynchronize", unsafe {
            (self.hip.api.hipStreamSynchronize)(self.stream)
        })
    }

    pub(crate) fn load(
        &mut self,
        experts: Vec<(ExpertKey, ExpertWeights)>,
        limits: BatchLimits,
    ) -> Result<(), BackendError> {
        self.bind()?;
        self.free_all();
        let (hidden, inter, spec) = uniform_shape(&experts)?;
        let group_shift = (spec.group() / BLOCK).trailing_zeros();
        let shape = EmShape {
            hidden: hidden as u32,
            inter: inter as u32,
            group_shift,
            scale_is_bf16: (spec.scale_dtype.flag() == 1) as u32,
        };
        let weight_bytes: u64 = experts.iter().map(|(_, w)| w.bytes() as u64).sum();
        let (t, p) = (limits.max_tokens.max(1), limits.max_pairs.max(1));
        let (h, f) = (hidden, inter);
        let scratch =
            p * f * (1 + 4) + p * (f / BLOCK) * 8 + p * h * 4 + t * h * 9 + t * (h / BLOCK) * 8;
        let mut free = 0usize;
        let mut total = 0usize;
        // SAFETY: valid out-pointers.
        self.call("hipMemGetInfo", unsafe {
            (self.hip.api.hipMemGetInfo)(&mut free, &mut total)
        })?;
        let need = weight_bytes + scratch as u64 + (experts.len() * 8 * SUB_ALIGN) as u64;
        if need > free as u64 {
            return Err(BackendError::OutOfMemory {
                need,
                have: free as u64,
            });
        }
        let uploaded = self.upload_experts(&experts)?;
        let loaded = self.alloc_buffers(shape, spec, uploaded, limits, weight_bytes)?;
        self.loaded = Some(loaded);
        Ok(())
    }

    /// Load step 1: upload the weights (one allocation per expert, arrays at 256-byte aligned
    /// offsets) and their pointer table.
    fn upload_experts(
        &mut self,
        experts: &[(ExpertKey, ExpertWeights)],
    ) -> Result<Uploaded, BackendError> {
        let mut up = Uploaded {
            table: Vec::with_capacity(experts.len()),
            slots: HashMap::with_capacity(experts.len()),
            weights: HashMap::with_capacity(experts.len()),
            d_experts: ptr::null_mut(),
        };
        for (i, (key, w)) in experts.iter().enumerate() {
            let (base, ptrs) = self.upload_expert(w)?;
            up.table.push(ptrs);
            up.weights.insert(*key, (base, w.bytes() as u64));
            if up.slots.insert(*key, i as u32).is_some() {
                return Err(BackendError::Shape(format!("{key} is listed twice")));
            }
        }
        up.d_experts = self.write_table(&up.table, up.table.len())?;
        Ok(up)
    }

    /// One expert's weights in one device allocation (arrays at 256-byte aligned offsets):
    /// the allocation and the expert's table entry.
    fn upload_expert(
        &mut self,
        w: &ExpertWeights,
    ) -> Result<(*mut c_void, EmExpertPtrs), BackendError> {
        let parts: [&[u8]; 6] = [
            w.w13().nibbles(),
            u16_bytes(w.w13().scales()),
            w.w13().zeros().unwrap_or(&[]),
            w.w2().nibbles(),
            u16_bytes(w.w2().scales()),
            w.w2().zeros().unwrap_or(&[]),
        ];
        let size: usize = parts
            .iter()
            .map(|s| s.len().next_multiple_of(SUB_ALIGN))
            .sum();
        let base = self.dev_alloc(size)?;
        let mut ptrs = [ptr::null::<u8>(); 6];
        let mut off = 0;
        for (j, part) in parts.iter().enumerate() {
            // SAFETY: off < size, inside the allocation just made.
            let dst = unsafe { base.cast::<u8>().add(off) };
            if let Err(e) = self.upload(dst.cast(), part) {
                self.dev_free(base);
                return Err(e);
            }
            ptrs[j] = if part.is_empty() { ptr::null() } else { dst };
            off += part.len().next_multiple_of(SUB_ALIGN);
        }
        Ok((
            base,
            EmExpertPtrs {
                w13_nibbles: ptrs[0],
                w13_scales: ptrs[1].cast(),
                w13_zeros: ptrs[2],
                w2_nibbles: ptrs[3],
                w2_scales: ptrs[4].cast(),
                w2_zeros: ptrs[5],
            },
        ))
    }

    /// A device table with room for `cap` entries holding `table`.
    fn write_table(
        &mut self,
        table: &[EmExpertPtrs],
        cap: usize,
    ) -> Result<*mut c_void, BackendError> {
        let d = self.dev_alloc(cap.max(1) * size_of::<EmExpertPtrs>())?;
        // SAFETY: EmExpertPtrs is plain data; viewing the table as bytes for the copy.
        let bytes =
            unsafe { std::slice::from_raw_parts(table.as_ptr().cast::<u8>(), size_of_val(table)) };
        if let Err(e) = self.upload(d, bytes) {
            self.dev_free(d);
            return Err(e);
        }
        Ok(d)
    }

    /// Frees one device allocation of this device (after the stream is idle).
    fn dev_free(&mut self, p: *mut c_void) {
        self.device_allocs.retain(|&q| q != p);
        // SAFETY: p came from hipMalloc of this device and is no longer listed, so it is freed
        // once; callers synchronize the stream first when a kernel may have used it.
        unsafe {
            (self.hip.api.hipStreamSynchronize)(self.stream);
            (self.hip.api.hipFree)(p);
        }
    }

    /// A live placement change: pin the experts of `source` next to those loaded, each in an
    /// allocation of its own, in free table slots first. Between batches (the backend is
    /// `&mut`, and each batch ends with its download), so no kernel reads the table while it is
    /// rewritten. All or nothing: on any error (a key loaded already or listed twice, another
    /// shape or format, no device memory, a source that fails, or fails its `finish` check) the
    /// experts uploaded so far are freed and the set is as before.
    pub(crate) fn add_experts(
        &mut self,
        source: &mut dyn ExpertSource,
    ) -> Result<(), BackendError> {
        self.bind()?;
        let mut l = self.loaded.take().ok_or(BackendError::NotLoaded)?;
        let r = self.add_into(&mut l, source);
        self.loaded = Some(l);
        r
    }

    fn add_into(
        &mut self,
        l: &mut Loaded,
        source: &mut dyn ExpertSource,
    ) -> Result<(), BackendError> {
        let shapes = source.shapes().to_vec();
        let mut seen = std::collections::HashSet::new();
        for s in &shapes {
            if l.slots.contains_key(&s.key) || !seen.insert(s.key) {
                return Err(BackendError::Shape(format!(
                    "{} is loaded already or listed twice; nothing was added",
                    s.key
                )));
            }
            if (s.hidden, s.inter, s.quant)
                != (l.shape.hidden as usize, l.shape.inter as usize, l.spec)
            {
                return Err(BackendError::Shape(format!(
                    "{} is {}x{} {}, the loaded experts {}x{} {}: one backend holds experts of \
                     one shape; nothing was added",
                    s.key, s.hidden, s.inter, s.quant, l.shape.hidden, l.shape.inter, l.spec
                )));
            }
        }
        let mut added: Vec<(ExpertKey, *mut c_void, EmExpertPtrs, u64)> = Vec::new();
        let r = self.upload_source(source, &shapes, &mut added);
        if let Err(e) = r {
            for (_, base, _, _) in added {
                self.dev_free(base);
            }
            return Err(e);
        }
        // Commit: slots (freed ones first), the table (a larger device table when it is full).
        let mut table = l.table.clone();
        let mut free = l.free_slots.clone();
        let mut slots = Vec::with_capacity(added.len());
        for &(_, _, ptrs, _) in &added {
            let slot = free.pop().unwrap_or_else(|| {
                table.push(NO_EXPERT);
                (table.len() - 1) as u32
            });
            table[slot as usize] = ptrs;
            slots.push(slot);
        }
        let written = if table.len() > l.table_cap {
            let cap = table.len().max(2 * l.table_cap);
            self.write_table(&table, cap).map(|d| (d, cap))
        } else {
            // SAFETY: EmExpertPtrs is plain data; the table fits the allocation (cap entries).
            let bytes = unsafe {
                std::slice::from_raw_parts(table.as_ptr().cast::<u8>(), size_of_val(&table[..]))
            };
            self.upload(l.d_experts, bytes)
                .map(|()| (l.d_experts, l.table_cap))
        };
        let (d_table, cap) = match written {
            Ok(w) => w,
            Err(e) => {
                for (_, base, _, _) in added {
                    self.dev_free(base);
                }
                return Err(e);
            }
        };
        if d_table != l.d_experts {
            self.dev_free(l.d_experts);
        }
        for ((key, base, _, bytes), slot) in added.into_iter().zip(slots) {
            l.slots.insert(key, slot);
            l.weights.insert(key, (base, bytes));
            l.bytes += bytes;
        }
        l.table = table;
        l.free_slots = free;
        l.table_cap = cap;
        l.d_experts = d_table;
        Ok(())
    }

    /// Upload each expert of `source` as it is handed over (one in host memory at a time),
    /// recording each in `added`, then the source's own check.
    fn upload_source(
        &mut self,
        source: &mut dyn ExpertSource,
        shapes: &[ExpertShape],
        added: &mut Vec<(ExpertKey, *mut c_void, EmExpertPtrs, u64)>,
    ) -> Result<(), BackendError> {
        for (i, s) in shapes.iter().enumerate() {
            let w = source.expert(i)?;
            // The declared shapes were checked against the loaded experts above.
            super::as_declared(s, &w, "added")?;
            let need = w.bytes() as u64 + 6 * SUB_ALIGN as u64;
            let (mut free, mut total) = (0usize, 0usize);
            // SAFETY: valid out-pointers.
            self.call("hipMemGetInfo", unsafe {
                (self.hip.api.hipMemGetInfo)(&mut free, &mut total)
            })?;
            if need > free as u64 {
                return Err(BackendError::OutOfMemory {
                    need,
                    have: free as u64,
                });
            }
            let (base, ptrs) = self.upload_expert(&w)?;
            added.push((s.key, base, ptrs, w.bytes() as u64));
        }
        source.finish()
    }

    /// A live placement change: release `keys` and free their device memory. A key not
    /// loaded is an error and nothing is released.
    pub(crate) fn release_experts(&mut self, keys: &[ExpertKey]) -> Result<(), BackendError> {
        self.bind()?;
        let mut l = self.loaded.take().ok_or(BackendError::NotLoaded)?;
        let r = self.release_from(&mut l, keys);
        self.loaded = Some(l);
        r
    }

    fn release_from(&mut self, l: &mut Loaded, keys: &[ExpertKey]) -> Result<(), BackendError> {
        if let Some(k) = keys.iter().find(|k| !l.slots.contains_key(k)) {
            return Err(BackendError::UnknownExpert(*k));
        }
        // The device table without them first: if that upload fails, nothing is released.
        let mut table = l.table.clone();
        for key in keys {
            table[l.slots[key] as usize] = NO_EXPERT;
        }
        // SAFETY: EmExpertPtrs is plain data; the table fits the allocation (table_cap entries).
        let bytes = unsafe {
            std::slice::from_raw_parts(table.as_ptr().cast::<u8>(), size_of_val(&table[..]))
        };
        self.upload(l.d_experts, bytes)?;
        l.table = table;
        for key in keys {
            let Some(slot) = l.slots.remove(key) else {
                continue; // listed twice
            };
            l.free_slots.push(slot);
            if let Some((base, bytes)) = l.weights.remove(key) {
                self.dev_free(base);
                l.bytes -= bytes;
            }
        }
        Ok(())
    }

    /// Load step 2: allocate every device buffer and pinned staging buffer for the limits.
    fn alloc_buffers(
        &mut self,
        shape: EmShape,
        spec: QuantSpec,
        uploaded: Uploaded,
        limits: BatchLimits,
        weight_bytes: u64,
    ) -> Result<Loaded, BackendError> {
        let (t, p) = (limits.max_tokens.max(1), limits.max_pairs.max(1));
        let (h, f) = (shape.hidden as usize, shape.inter as usize);
        let items_cap = 2 * (p + p / PREFILL_TOKENS as usize + 1);
        Ok(Loaded {
            shape,
            spec,
            slots: uploaded.slots,
            table_cap: uploaded.table.len(),
            table: uploaded.table,
            free_slots: Vec::new(),
            weights: uploaded.weights,
            limits,
            bytes: weight_bytes,
            d_experts: uploaded.d_experts,
            d_x: self.dev_alloc(t * h * 4)?,
            d_xq: self.dev_alloc(t * h)?,
            d_xd: self.dev_alloc(t * h / BLOCK * 4)?,
            d_xqsum: self.dev_alloc(t * h / BLOCK * 4)?,
            d_groups: self.dev_alloc(p * size_of::<EmGroup>())?,
            d_pair_token: self.dev_alloc(p * 4)?,
            d_pair_out: self.dev_alloc(p * 4)?,
            d_items: self.dev_alloc(items_cap * 4)?,
            d_hq: self.dev_alloc(p * f)?,
            d_hd: self.dev_alloc(p * f / BLOCK * 4)?,
            d_hqsum: self.dev_alloc(p * f / BLOCK * 4)?,
            d_hf: self.dev_alloc(p * f * 4)?,
            d_y: self.dev_alloc(p * h * 4)?,
            d_out: self.dev_alloc(t * h * 4)?,
            d_tok_ptr: self.dev_alloc((t + 1) * 4)?,
            d_tok_rows: self.dev_alloc(p * 4)?,
            d_tok_w: self.dev_alloc(p * 4)?,
            d_counters: self.dev_alloc((COUNTER_GROUP_BASE + p) * 4)?,
            h_in: self.host_alloc(t * h * 4 + t * (h / BLOCK) * 4)?,
            h_groups: self.host_alloc(p * size_of::<EmGroup>())?.cast(),
            h_pair_token: self.host_alloc(p * 4)?.cast(),
            h_pair_out: self.host_alloc(p * 4)?.cast(),
            h_items: self.host_alloc(items_cap * 4)?.cast(),
            h_tok_ptr: self.host_alloc((t + 1) * 4)?.cast(),
            h_tok_rows: self.host_alloc(p * 4)?.cast(),
            h_tok_w: self.host_alloc(p * 4)?.cast(),
            h_out: self.host_alloc(p.max(t) * h * 4)?.cast(),
            h_status: self.host_alloc(4)?.cast(),
            decode_grid: [
                self.persistent_grid(self.kernels.decode_exact),
                self.persistent_grid(self.kernels.decode_accurate),
            ],
        })
    }

    /// Workgroups of a persistent decode launch: resident workgroups per CU × CUs.
    fn persistent_grid(&self, f: HipFunction) -> u32 {
        let mut per_cu = 0;
        // SAFETY: valid out-pointer and function handle.
        let r = unsafe {
            (self
                .hip
                .api
                .hipModuleOccupancyMaxActiveBlocksPerMultiprocessor)(
                &mut per_cu,
                f,
                WG_THREADS as i32,
                0,
            )
        };
        let per_cu = if r == 0 && (1..=64).contains(&per_cu) {
            per_cu as u32
        } else {
            2
        };
        per_cu * self.compute_units
    }

    fn launch<T>(
        &self,
        f: HipFunction,
        grid: [u32; 2],
        block: u32,
        args: &mut T,
    ) -> Result<(), BackendError> {
        if grid[0] == 0 || grid[1] == 0 {
            return Ok(());
        }
        let mut params = [arg_ptr(args)];
        // SAFETY: `args` is the #[repr(C)] mirror of the kernel's single by-value parameter
        // (layout tested against em_abi.h); every pointer inside it is a live device allocation
        // sized for the batch limits checked by `validate`.
        let r = unsafe {
            (self.hip.api.hipModuleLaunchKernel)(
                f,
                grid[0],
                grid[1],
                1,
                block,
                1,
                1,
                0,
                self.stream,
                params.as_mut_ptr(),
                ptr::null_mut(),
            )
        };
        self.call("hipModuleLaunchKernel", r)
    }

    pub(crate) fn execute(
        &mut self,
        batch: &GroupedBatch<'_>,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        self.bind()?;
        let l = self.loaded.as_ref().ok_or(BackendError::NotLoaded)?;
        batch.validate_with(&l.limits, out.len(), &mut self.seen_rows)?;
        if batch.hidden != l.shape.hidden as usize {
            return Err(BackendError::Shape(format!(
                "batch hidden size {} but the loaded experts have {}",
                batch.hidden, l.shape.hidden
            )));
        }
        let work = stage_work_list(l, batch)?;
        self.upload_batch(l, batch, &work)?;
        self.launch_ffn(l, batch, &work)?;
        self.finish_batch(l, batch, &work, out)
    }

    /// Execute step 1: upload the input and the staged work list; zero the counters unless the
    /// quantization launch will (exact mode).
    fn upload_batch(
        &self,
        l: &Loaded,
        batch: &GroupedBatch<'_>,
        work: &WorkList,
    ) -> Result<(), BackendError> {
        let (ng, np, ni, t) = (work.groups, work.pairs, work.items, batch.tokens);
        match batch.input {
            Activations::F32(x) => {
                // SAFETY: h_in holds max_tokens·H f32 (+ scales); x.len() == t·h (validated).
                unsafe { ptr::copy_nonoverlapping(x.as_ptr(), l.h_in.cast::<f32>(), x.len()) };
                self.up(l.d_x, l.h_in, x.len() * 4)?;
            }
            Activations::Q8 { q, d } => {
                // SAFETY: as above: q has t·h bytes and d t·h/32 f32, both within h_in.
                unsafe {
                    ptr::copy_nonoverlapping(q.as_ptr(), l.h_in.cast::<i8>(), q.len());
                    ptr::copy_nonoverlapping(
                        d.as_ptr(),
                        l.h_in.cast::<u8>().add(q.len()).cast::<f32>(),
                        d.len(),
                    );
                    self.up(l.d_xq, l.h_in, q.len())?;
                    self.up(l.d_xd, l.h_in.cast::<u8>().add(q.len()).cast(), d.len() * 4)?;
                }
            }
        }
        self.up(l.d_groups, l.h_groups.cast(), ng * size_of::<EmGroup>())?;
        self.up(l.d_pair_token, l.h_pair_token.cast(), np * 4)?;
        self.up(l.d_pair_out, l.h_pair_out.cast(), np * 4)?;
        self.up(l.d_items, l.h_items.cast(), ni * 8)?;
        if batch.layout == OutputLayout::PreCombined {
            self.up(l.d_tok_ptr, l.h_tok_ptr.cast(), (t + 1) * 4)?;
            self.up(l.d_tok_rows, l.h_tok_rows.cast(), np * 4)?;
            self.up(l.d_tok_w, l.h_tok_w.cast(), np * 4)?;
        }
        if batch.mode == ComputeMode::Exact {
            // The quantization launch zeroes the counters (launch_ffn): one launch fewer.
            return Ok(());
        }
        // SAFETY: counters buffer holds COUNTER_GROUP_BASE + max_pairs u32 ≥ 2 + ng.
        self.call("hipMemsetAsync", unsafe {
            (self.hip.api.hipMemsetAsync)(
                l.d_counters,
                0,
                (COUNTER_GROUP_BASE + ng) * 4,
                self.stream,
            )
        })
    }

    /// An asynchronous upload of `bytes` from pinned staging `src` to device buffer `dst`.
    fn up(&self, dst: *mut c_void, src: *const c_void, bytes: usize) -> Result<(), BackendError> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: dst is a device buffer and src a pinned staging buffer, both sized for the
        // validated batch.
        self.call("hipMemcpyHtoDAsync", unsafe {
            (self.hip.api.hipMemcpyHtoDAsync)(dst, src, bytes, self.stream)
        })
    }

    /// Execute step 3: exact mode's input quantization, then the expert FFN (prefill kernels,
    /// or the fused or two-phase persistent decode kernel).
    fn launch_ffn(
        &self,
        l: &Loaded,
        batch: &GroupedBatch<'_>,
        work: &WorkList,
    ) -> Result<(), BackendError> {
        let (ng, ni) = (work.groups, work.items);
        let (t, h, f) = (batch.tokens, batch.hidden, l.shape.inter as usize);
        let exact = batch.mode == ComputeMode::Exact;
        if exact {
            let mut qa = EmQuantArgs {
                x: match batch.input {
                    Activations::F32(_) => l.d_x.cast(),
                    Activations::Q8 { .. } => ptr::null(),
                },
                q: l.d_xq.cast(),
                d: l.d_xd.cast(),
                qsum: l.d_xqsum.cast(),
                tokens: t as u32,
                hidden: h as u32,
                counters: l.d_counters.cast(),
                counters_len: (COUNTER_GROUP_BASE + ng) as u32,
                reserved: 0,
            };
            // One thread per (token, block) and at least one per counter to zero.
            let grid = [wg_blocks((t * h / BLOCK).max(COUNTER_GROUP_BASE + ng)), 1];
            self.launch(self.kernels.quantize, grid, WG_THREADS, &mut qa)?;
        }
        let mut args = EmFfnArgs {
            experts: l.d_experts.cast(),
            groups: l.d_groups.cast(),
            pair_token: l.d_pair_token.cast(),
            pair_out: l.d_pair_out.cast(),
            xq: l.d_xq.cast(),
            xd: l.d_xd.cast(),
            xqsum: l.d_xqsum.cast(),
            x: l.d_x.cast(),
            hq: l.d_hq.cast(),
            hd: l.d_hd.cast(),
            hqsum: l.d_hqsum.cast(),
            hf: l.d_hf.cast(),
            y: l.d_y.cast(),
            counters: l.d_counters.cast(),
            shape: l.shape,
            num_groups: ng as u32,
            first_phase: 1,
            last_phase: 2,
            spin_limit: SPIN_LIMIT,
            prefill_items: l.d_items.cast(),
            num_prefill_items: ni as u32,
            reserved: 0,
        };
        if ng == 0 {
            return Ok(());
        }
        if exact && work.max_count >= PREFILL_MIN_TOKENS {
            let block = PREFILL_WAVES * self.wave;
            let tiles2 = (h as u32).div_ceil(TILE_ROWS);
            let grid13 = [(f / BLOCK) as u32, ni as u32];
            self.launch(self.kernels.prefill_w13, grid13, block, &mut args)?;
            self.launch(
                self.kernels.prefill_w2,
                [tiles2, ni as u32],
                block,
                &mut args,
            )
        } else {
            self.launch_decode(
                l,
                &mut args,
                exact,
                ng as u32 * ((f / BLOCK) as u32 + (h as u32).div_ceil(TILE_ROWS)),
            )
        }
    }

    /// Execute step 3b: the persistent decode kernel over `items` work items, fused (one
    /// launch) or as two phases with the work-item counter reset between them.
    fn launch_decode(
        &self,
        l: &Loaded,
        args: &mut EmFfnArgs,
        exact: bool,
        items: u32,
    ) -> Result<(), BackendError> {
        let (func, grid) = if exact {
            (self.kernels.decode_exact, l.decode_grid[0])
        } else {
            (self.kernels.decode_accurate, l.decode_grid[1])
        };
        if self.fused {
            self.launch(func, [grid.min(items), 1], WG_THREADS, args)
        } else {
            args.last_phase = 1;
            self.launch(func, [grid.min(items), 1], WG_THREADS, args)?;
            // SAFETY: resets the work-item counter between the two launches.
            self.call("hipMemsetAsync", unsafe {
                (self.hip.api.hipMemsetAsync)(l.d_counters, 0, 4, self.stream)
            })?;
            args.first_phase = 2;
            args.last_phase = 2;
            self.launch(func, [grid.min(items), 1], WG_THREADS, args)
        }
    }

    /// Execute step 4: pre-combine (PreCombined), download the output and the kernels' status
    /// word, and check it.
    fn finish_batch(
        &self,
        l: &Loaded,
        batch: &GroupedBatch<'_>,
        work: &WorkList,
        out: &mut [f32],
    ) -> Result<(), BackendError> {
        let (t, h) = (batch.tokens, batch.hidden);
        let (api, s) = (&self.hip.api, self.stream);
        let (src, n) = match batch.layout {
            OutputLayout::PerSlot => (l.d_y, work.pairs * h),
            OutputLayout::PreCombined => {
                let mut ca = EmCombineArgs {
                    y: l.d_y.cast(),
                    tok_ptr: l.d_tok_ptr.cast(),
                    tok_rows: l.d_tok_rows.cast(),
                    tok_weights: l.d_tok_w.cast(),
                    out: l.d_out.cast(),
                    tokens: t as u32,
                    hidden: h as u32,
                };
                let grid = [wg_blocks(t * h), 1];
                self.launch(self.kernels.combine, grid, WG_THREADS, &mut ca)?;
                (l.d_out, t * h)
            }
        };
        // SAFETY: h_out holds max(max_pairs, max_tokens)·H f32 ≥ n; h_status one u32.
        unsafe {
            if n > 0 {
                self.call(
                    "hipMemcpyDtoHAsync",
                    (api.hipMemcpyDtoHAsync)(l.h_out.cast(), src, n * 4, s),
                )?;
            }
            self.call(
                "hipMemcpyDtoHAsync",
                (api.hipMemcpyDtoHAsync)(
                    l.h_status.cast(),
                    l.d_counters.cast::<u32>().add(COUNTER_STATUS).cast(),
                    4,
                    s,
                ),
            )?;
            self.call("hipStreamSynchronize", (api.hipStreamSynchronize)(s))?;
            if *l.h_status & STATUS_WAIT_TIMEOUT != 0 {
                return Err(dev_err(format!(
                    "decode kernel on device {}: a phase-2 tile timed out waiting for its expert's phase-1 tiles; \
                     results discarded (retry with set_fused_decode(false))",
                    self.device
                )));
            }
            if n > 0 {
                ptr::copy_nonoverlapping(l.h_out, out.as_mut_ptr(), n);
            }
        }
        Ok(())
    }
}

/// Counts of the work list staged for one batch.
struct WorkList {
    /// Non-empty groups.
    groups: usize,
    /// Pairs.
    pairs: usize,
    /// Prefill work items.
    items: usize,
    /// Most tokens in one group.
    max_count: usize,
}

/// Workgroups covering `n` threads.
fn wg_blocks(n: usize) -> u32 {
    n.div_ceil(WG_THREADS as usize) as u32
}

/// The shape and quantization every expert shares (one backend holds experts of one shape).
fn uniform_shape(
    experts: &[(ExpertKey, ExpertWeights)],
) -> Result<(usize, usize, QuantSpec), BackendError> {
    let Some((_, first)) = experts.first() else {
        return Err(BackendError::Shape("no experts to load".into()));
    };
    let (hidden, inter, spec) = (first.hidden(), first.inter(), first.spec());
    if let Some((k, _)) = experts
        .iter()
        .find(|(_, w)| w.hidden() != hidden || w.inter() != inter || w.spec() != spec)
    {
        return Err(BackendError::Shape(format!(
            "{k} has a different shape or quantization than the first expert ({hidden}x{inter}, {spec}); \
             one backend holds experts of one shape"
        )));
    }
    Ok((hidden, inter, spec))
}

/// Execute step 1: write the batch's work list (groups, pairs, prefill items and the
/// per-token CSR for PreCombined) into pinned staging; allocates nothing.
fn stage_work_list(l: &Loaded, batch: &GroupedBatch<'_>) -> Result<WorkList, BackendError> {
    let t = batch.tokens;
    // Work list into pinned staging (sizes bounded by the limits validated above).
    // SAFETY: each staging buffer was allocated for max_pairs / max_tokens elements.
    let (groups, pair_token, pair_out, items, tok_ptr, tok_rows, tok_w) = unsafe {
        let p = l.limits.max_pairs.max(1);
        (
            std::slice::from_raw_parts_mut(l.h_groups, p),
            std::slice::from_raw_parts_mut(l.h_pair_token, p),
            std::slice::from_raw_parts_mut(l.h_pair_out, p),
            std::slice::from_raw_parts_mut(l.h_items, 2 * (p + p / PREFILL_TOKENS as usize + 1)),
            std::slice::from_raw_parts_mut(l.h_tok_ptr, l.limits.max_tokens.max(1) + 1),
            std::slice::from_raw_parts_mut(l.h_tok_rows, p),
            std::slice::from_raw_parts_mut(l.h_tok_w, p),
        )
    };
    let (mut ng, mut np, mut ni, mut max_count) = (0usize, 0usize, 0usize, 0usize);
    for g in batch.groups {
        let slot = *l
            .slots
            .get(&g.key)
            .ok_or(BackendError::UnknownExpert(g.key))?;
        if g.tokens.is_empty() {
            continue;
        }
        groups[ng] = EmGroup {
            expert_slot: slot,
            pair_begin: np as u32,
            pair_count: g.tokens.len() as u32,
            reserved: 0,
        };
        for c0 in (0..g.tokens.len()).step_by(PREFILL_TOKENS as usize) {
            items[2 * ni] = ng as u32;
            items[2 * ni + 1] = c0 as u32;
            ni += 1;
        }
        ng += 1;
        max_count = max_count.max(g.tokens.len());
        for (&tok, &row) in g.tokens.iter().zip(g.out_rows) {
            pair_token[np] = tok;
            pair_out[np] = row;
            np += 1;
        }
    }
    // Per-token pair lists (CSR) in increasing output row, for PreCombined.
    tok_ptr[..=t].fill(0);
    for g in batch.groups {
        for &tok in g.tokens {
            tok_ptr[tok as usize + 1] += 1;
        }
    }
    for i in 0..t {
        tok_ptr[i + 1] += tok_ptr[i];
    }
    fill_sorted_csr(batch, t, tok_ptr, tok_rows, tok_w);
    Ok(WorkList {
        groups: ng,
        pairs: np,
        items: ni,
        max_count,
    })
}

/// Fill the per-token CSR (rows ascending) from the batch's groups; `tok_ptr` holds the prefix
/// sums already. Each pair goes to its token's first free slot, then each token's short slice
/// (one entry per chosen expert) is insertion-sorted by output row. Allocates nothing.
fn fill_sorted_csr(
    batch: &GroupedBatch<'_>,
    t: usize,
    tok_ptr: &[u32],
    tok_rows: &mut [u32],
    tok_w: &mut [f32],
) {
    // Arrival order per token: walk groups, place each pair at the first free slot of its token.
    for i in 0..t {
        for j in tok_ptr[i]..tok_ptr[i + 1] {
            tok_rows[j as usize] = u32::MAX;
        }
    }
    for g in batch.groups {
        for ((&tok, &row), &w) in g.tokens.iter().zip(g.out_rows).zip(g.weights) {
            let (a, b) = (
                tok_ptr[tok as usize] as usize,
                tok_ptr[tok as usize + 1] as usize,
            );
            if let Some(j) = (a..b).find(|&j| tok_rows[j] == u32::MAX) {
                tok_rows[j] = row;
                tok_w[j] = w;
            }
        }
    }
    for i in 0..t {
        let (a, b) = (tok_ptr[i] as usize, tok_ptr[i + 1] as usize);
        for x in a + 1..b {
            let mut y = x;
            while y > a && tok_rows[y - 1] > tok_rows[y] {
                tok_rows.swap(y - 1, y);
                tok_w.swap(y - 1, y);
                y -= 1;
            }
        }
    }
}

impl Drop for HipDevice {
    fn drop(&mut self) {
        // Freed on the device they belong to, whichever thread drops this.
        let _ = self.bind();
        self.free_all();
        // SAFETY: modules and stream were created by this device and are released once.
        unsafe {
            for m in self.kernels.modules.drain(..) {
                (self.hip.api.hipModuleUnload)(m);
            }
            (self.hip.api.hipStreamDestroy)(self.stream);
        }
    }
}

fn u16_bytes(v: &[u16]) -> &[u8] {
    // SAFETY: u16 has no padding; the byte view covers exactly the slice (little-endian hosts,
    // like every HIP host).
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// The device's gfx name, scanned from `hipGetDeviceProperties` (layout-independent: the buffer
/// is oversized and searched for the `gcnArchName` string). Empty when not found.
fn device_arch(hip: &Hip, dev: i32) -> String {
    let mut buf = vec![0u8; 16384];
    // SAFETY: the buffer is larger than hipDeviceProp_t of any ROCm release (< 2 KiB).
    if unsafe { (hip.api.hipGetDeviceProperties)(buf.as_mut_ptr().cast(), dev) } != 0 {
        return String::new();
    }
    buf.windows(3)
        .position(|w| w == b"gfx")
        .map(|i| {
            let end = buf[i..]
                .iter()
                .position(|&c| c == 0 || c == b':')
                .map_or(buf.len(), |e| i + e);
            String::from_utf8_lossy(&buf[i..end]).into_owned()
        })
        .unwrap_or_default()
}

/// Load the code objects of one target for all families: the device's own arch first, then every
/// other embedded target (the loader rejects objects for a different ISA).
/// The loaded modules of one target: (family, module).
type TargetModules = (&'static str, Vec<(&'static str, HipModule)>);

fn load_modules(hip: &Hip, arch_name: &str) -> Result<TargetModules, String> {
    let mut targets: Vec<&'static str> = CODE_OBJECTS.iter().map(|(t, _, _)| *t).collect();
    targets.dedup();
    targets.sort_by_key(|t| *t != arch_name);
    let mut errors = Vec::new();
    for target in &targets {
        let mut mods = Vec::new();
        let mut ok = true;
        for (t, family, image) in CODE_OBJECTS.iter().filter(|(t, _, _)| t == target) {
            let mut m = ptr::null_mut();
            // SAFETY: image is an embedded AMDGPU code object (ELF) kept alive for the program.
            let r = unsafe { (hip.api.hipModuleLoadData)(&mut m, image.as_ptr().cast()) };
            if r != 0 {
                errors.push(format!(
                    "{t}/{family}: {}",
                    hip.check("hipModuleLoadData", r).err().unwrap_or_default()
                ));
                ok = false;
                break;
            }
            mods.push((*family, m));
        }
        if ok && mods.len() == 3 {
            return Ok((target, mods));
        }
        for (_, m) in mods {
            // SAFETY: unloading a module this function loaded.
            unsafe { (hip.api.hipModuleUnload)(m) };
        }
    }
    Err(format!(
        "no embedded code object runs on this device (device arch {:?}; built for {:?}; skipped at build time {:?}); \
         rebuild with EXPERTMESH_HIP_TARGETS including the device's gfx target. Loader said: {}",
        arch_name,
        targets,
        super::objects::SKIPPED_TARGETS,
        errors.join("; ")
    ))
}

fn resolve_kernels(hip: &Hip, modules: Vec<(&'static str, HipModule)>) -> Result<Kernels, String> {
    let find = |family: &str, name: &str| -> Result<HipFunction, String> {
        let m = modules
            .iter()
            .find(|(f, _)| *f == family)
            .map(|(_, m)| *m)
            .ok_or_else(|| format!("module {family} missing"))?;
        let cname = CString::new(name).map_err(|e| e.to_string())?;
        let mut func = ptr::null_mut();
        // SAFETY: valid module handle and NUL-terminated name.
        hip.check(&format!("hipModuleGetFunction({name})"), unsafe {
            (hip.api.hipModuleGetFunction)(&mut func, m, cname.as_ptr())
        })?;
        Ok(func)
    };
    Ok(Kernels {
        quantize: find("activations", "em_quantize_activations")?,
        combine: find("activations", "em_combine_slots")?,
        decode_exact: find("decode", "em_decode_exact")?,
        decode_accurate: find("decode", "em_decode_accurate")?,
        prefill_w13: find("prefill", "em_prefill_exact_w13")?,
        prefill_w2: find("prefill", "em_prefill_exact_w2")?,
        modules: modules.iter().map(|(_, m)| *m).collect(),
    })
}
