//! Rust mirrors of the kernels' argument blocks (`kernels/em_abi.h`).
//!
//! Why this exists: the HIP runtime passes each kernel one struct by value, so Rust and C must
//! agree on every field offset. These `#[repr(C)]` types are the Rust side; a test compiles the
//! header with g++ and compares every offset (`tests/it/kernel_host.rs`), so a drift fails in CI
//! even on machines without a GPU. Every pointer is a device pointer into buffers allocated when
//! experts are loaded (see the header for each array's shape).

use std::ffi::c_void;

/// Version of the argument layout (`EM_ABI_VERSION`).
pub const ABI_VERSION: u32 = 2;
/// Threads per decode workgroup (`EM_WG_THREADS`); also used by the small kernels.
pub const WG_THREADS: u32 = 512;
/// Rows per decode/prefill row tile (`EM_TILE_ROWS`).
pub const TILE_ROWS: u32 = 64;
/// Tokens per decode pass (`EM_DECODE_TOKENS`).
pub const DECODE_TOKENS: u32 = 2;
/// Tokens per prefill tile (`EM_PREFILL_TOKENS`).
pub const PREFILL_TOKENS: u32 = 16;
/// Waves per prefill workgroup (`EM_PREFILL_WAVES`).
pub const PREFILL_WAVES: u32 = 4;
/// Status bit: a phase-2 item gave up waiting (`EM_STATUS_WAIT_TIMEOUT`).
pub const STATUS_WAIT_TIMEOUT: u32 = 1;
/// Index of the work-item counter (`EM_COUNTER_NEXT_ITEM`).
pub const COUNTER_NEXT_ITEM: usize = 0;
/// Index of the status word (`EM_COUNTER_STATUS`).
pub const COUNTER_STATUS: usize = 1;
/// First per-group counter (`EM_COUNTER_GROUP_BASE`).
pub const COUNTER_GROUP_BASE: usize = 2;

/// `EmExpertPtrs`: one loaded expert's packed matrices in device memory.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EmExpertPtrs {
    /// W13 nibbles `[2F][H/2]`.
    pub w13_nibbles: *const u8,
    /// W13 scales `[2F][H/g]`.
    pub w13_scales: *const u16,
    /// W13 zero points or null.
    pub w13_zeros: *const u8,
    /// W2 nibbles `[H][F/2]`.
    pub w2_nibbles: *const u8,
    /// W2 scales `[H][F/g]`.
    pub w2_scales: *const u16,
    /// W2 zero points or null.
    pub w2_zeros: *const u8,
}

/// `EmGroup`: one non-empty expert group of a batch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EmGroup {
    /// Index into the experts table.
    pub expert_slot: u32,
    /// First pair of the group.
    pub pair_begin: u32,
    /// Pairs in the group.
    pub pair_count: u32,
    /// Zero.
    pub reserved: u32,
}

/// `EmShape`: shape shared by every expert of a backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EmShape {
    /// H.
    pub hidden: u32,
    /// F.
    pub inter: u32,
    /// log2(group_size / 32).
    pub group_shift: u32,
    /// 1 = bf16 scales.
    pub scale_is_bf16: u32,
}

/// `EmFfnArgs`: arguments of the FFN kernels.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(missing_docs)] // field meanings and shapes are documented in kernels/em_abi.h
pub struct EmFfnArgs {
    pub experts: *const EmExpertPtrs,
    pub groups: *const EmGroup,
    pub pair_token: *const u32,
    pub pair_out: *const u32,
    pub xq: *const i8,
    pub xd: *const f32,
    pub xqsum: *const i32,
    pub x: *const f32,
    pub hq: *mut i8,
    pub hd: *mut f32,
    pub hqsum: *mut i32,
    pub hf: *mut f32,
    pub y: *mut f32,
    pub counters: *mut u32,
    pub shape: EmShape,
    pub num_groups: u32,
    pub first_phase: u32,
    pub last_phase: u32,
    pub spin_limit: u32,
    pub prefill_items: *const u32,
    pub num_prefill_items: u32,
    pub reserved: u32,
}

/// `EmQuantArgs`: arguments of `em_quantize_activations`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(missing_docs)] // see kernels/em_abi.h
pub struct EmQuantArgs {
    pub x: *const f32,
    pub q: *mut i8,
    pub d: *mut f32,
    pub qsum: *mut i32,
    pub tokens: u32,
    pub hidden: u32,
    pub counters: *mut u32,
    pub counters_len: u32,
    pub reserved: u32,
}

/// `EmCombineArgs`: arguments of `em_combine_slots`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
#[allow(missing_docs)] // see kernels/em_abi.h
pub struct EmCombineArgs {
    pub y: *const f32,
    pub tok_ptr: *const u32,
    pub tok_rows: *const u32,
    pub tok_weights: *const f32,
    pub out: *mut f32,
    pub tokens: u32,
    pub hidden: u32,
}

/// Every (struct, field, offset) of the ABI, plus `(struct, "sizeof", size)`, in the order the C++
/// side prints them (`host_check --abi`).
pub fn layout() -> Vec<(&'static str, &'static str, usize)> {
    use std::mem::{offset_of, size_of};
    macro_rules! fields {
        ($v:ident, $t:ident: $($f:ident),*) => {{
            $( $v.push((stringify!($t), stringify!($f), offset_of!($t, $f))); )*
            $v.push((stringify!($t), "sizeof", size_of::<$t>()));
        }};
    }
    let mut v = Vec::new();
    fields!(v, EmExpertPtrs: w13_nibbles, w13_scales, w13_zeros, w2_nibbles, w2_scales, w2_zeros);
    fields!(v, EmGroup: expert_slot, pair_begin, pair_count, reserved);
    fields!(v, EmShape: hidden, inter, group_shift, scale_is_bf16);
    fields!(v, EmFfnArgs: experts, groups, pair_token, pair_out, xq, xd, xqsum, x, hq, hd, hqsum,
        hf, y, counters, shape, num_groups, first_phase, last_phase, spin_limit, prefill_items,
        num_prefill_items, reserved);
    fields!(v, EmQuantArgs: x, q, d, qsum, tokens, hidden, counters, counters_len, reserved);
    fields!(v, EmCombineArgs: y, tok_ptr, tok_rows, tok_weights, out, tokens, hidden);
    v
}

/// A kernel argument block as the `kernelParams` array entry hipModuleLaunchKernel expects.
pub fn arg_ptr<T>(args: &mut T) -> *mut c_void {
    (args as *mut T).cast()
}
