// em_abi.h — the argument blocks the host passes to the ExpertMesh kernels.
//
// Why this file exists: kernels are launched from Rust (hipModuleLaunchKernel with one argument:
// a struct passed by value) and from the C++ GPU harness. Both must agree on every byte of these
// structs. Rust mirrors them with #[repr(C)] in `src/hip/abi.rs`, and a test compiles this header
// with g++ (`harness/host_check.cpp --abi`) and compares every field offset with Rust's.
//
// Memory spaces: every pointer in these structs is a *device* pointer (device global memory,
// allocated once when experts are loaded), except where noted.
#ifndef EM_ABI_H
#define EM_ABI_H

#include <stdint.h>

#define EM_ABI_VERSION 2

// Threads per workgroup of the decode kernels, and the row tile each workgroup computes:
// 32 teams of 16 lanes, each team owning 2 rows (tile row = team + 32·r).
#define EM_WG_THREADS 512
#define EM_TILE_ROWS 64
#define EM_ROWS_PER_TEAM 2
#define EM_TEAMS (EM_TILE_ROWS / EM_ROWS_PER_TEAM)
// Tokens per pass of the decode kernel (larger groups take several passes over a cached tile).
// (Overridable only for experiments with gpu-check.sh's EM_GPU_VARIANTS: the runtime builds
// with 2, which `src/kernel_abi.rs` mirrors.)
#ifndef EM_DECODE_TOKENS
#define EM_DECODE_TOKENS 2
#endif
// Tokens per tile of the prefill kernel (one MFMA/WMMA N-dimension); its workgroups are 4 waves
// (256 threads on wave64 targets, 128 on wave32 targets and NVIDIA), one 16-row slice per wave.
#define EM_PREFILL_TOKENS 16
#define EM_PREFILL_WAVES 4

// Status bits the kernels set in counters[EM_COUNTER_STATUS].
#define EM_STATUS_WAIT_TIMEOUT 1u  // a phase-2 item gave up waiting for its phase-1 tiles

// Layout of the counters array (u32, zeroed before every batch).
#define EM_COUNTER_NEXT_ITEM 0
#define EM_COUNTER_STATUS 1
#define EM_COUNTER_GROUP_BASE 2  // + g: phase-1 tiles finished for group g

// Device pointers to one loaded expert's packed matrices (canonical layout, format.rs).
typedef struct EmExpertPtrs {
    const uint8_t* w13_nibbles;   // [2F][H/2]
    const uint16_t* w13_scales;   // [2F][H/g] u16 bits
    const uint8_t* w13_zeros;     // [2F][ceil((H/g)/2)] or null (symmetric)
    const uint8_t* w2_nibbles;    // [H][F/2]
    const uint16_t* w2_scales;    // [H][F/g]
    const uint8_t* w2_zeros;      // [H][ceil((F/g)/2)] or null
} EmExpertPtrs;

// One non-empty expert group of a batch: pairs pair_begin .. pair_begin + pair_count.
typedef struct EmGroup {
    uint32_t expert_slot;  // index into the experts table
    uint32_t pair_begin;
    uint32_t pair_count;
    uint32_t reserved;
} EmGroup;

// Shape shared by all experts of a backend.
typedef struct EmShape {
    uint32_t hidden;         // H, multiple of 32
    uint32_t inter;          // F, multiple of 32
    uint32_t group_shift;    // log2(group_size / 32)
    uint32_t scale_is_bf16;  // 1 = bf16 scales, 0 = f16
} EmShape;

// Arguments of the FFN kernels (decode and prefill, exact and accurate).
typedef struct EmFfnArgs {
    const EmExpertPtrs* experts;  // [loaded experts]
    const EmGroup* groups;        // [num_groups]
    const uint32_t* pair_token;   // [pairs] input row of each pair
    const uint32_t* pair_out;     // [pairs] output row of each pair
    const int8_t* xq;             // [T][H] activation codes (exact)
    const float* xd;              // [T][H/32] block scales (exact)
    const int32_t* xqsum;         // [T][H/32] block code sums (exact)
    const float* x;               // [T][H] f32 activations (accurate)
    int8_t* hq;                   // [pairs][F] intermediate codes (exact), indexed by pair
    float* hd;                    // [pairs][F/32]
    int32_t* hqsum;               // [pairs][F/32]
    float* hf;                    // [pairs][F] intermediate f32 (accurate)
    float* y;                     // [pairs][H] per-slot output, indexed by output row
    uint32_t* counters;           // [EM_COUNTER_GROUP_BASE + num_groups], zeroed per batch
    EmShape shape;
    uint32_t num_groups;
    uint32_t first_phase;  // 1 or 2
    uint32_t last_phase;   // 1 or 2 (first 1, last 2 = fused: phase-2 items wait per expert)
    uint32_t spin_limit;   // bound on a phase-2 item's wait, in polls
    const uint32_t* prefill_items;  // [num_prefill_items][2] = (group, first pair within group)
    uint32_t num_prefill_items;     // prefill only: grid.y
    uint32_t reserved;
} EmFfnArgs;

// Arguments of the activation quantization kernel: one thread per (token, 32-block).
typedef struct EmQuantArgs {
    const float* x;   // [T][H] input (f32 mode), or null when q is already filled (q8 mode)
    int8_t* q;        // [T][H]
    float* d;         // [T][H/32]
    int32_t* qsum;    // [T][H/32]
    uint32_t tokens;
    uint32_t hidden;
    uint32_t* counters;     // [counters_len] set to 0 by this launch (the FFN kernels' counters,
                            // so exact mode needs no separate reset); null: none
    uint32_t counters_len;  // the launch has at least this many threads
    uint32_t reserved;
} EmQuantArgs;

// Arguments of the pre-combine kernel: one thread per (token, hidden element).
typedef struct EmCombineArgs {
    const float* y;            // [pairs][H] per-slot output (by output row)
    const uint32_t* tok_ptr;   // [T + 1] CSR offsets into rows/weights
    const uint32_t* tok_rows;  // output rows of each token's pairs, ascending
    const float* tok_weights;  // routing weight of each of those pairs
    float* out;                // [T][H]
    uint32_t tokens;
    uint32_t hidden;
} EmCombineArgs;

#endif  // EM_ABI_H
