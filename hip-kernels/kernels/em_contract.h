// em_contract.h — the exact-mode (W4A8) contract's scalar building blocks, shared by the HIP
// kernels (AMD and NVIDIA device code) and the host-side scalar path (plain g++).
//
// Why this file exists: the Rust module `quant/src/contract.rs` specifies every
// floating-point operation of exact mode. The GPU kernels must reproduce it bit for bit, and on a
// machine without a GPU the only way to check the kernels' arithmetic is to compile the very same
// functions for the CPU and compare them with the Rust reference. So every piece of arithmetic the
// kernels perform lives here, in functions that compile as `__host__ __device__` under hipcc/nvcc
// and as ordinary inline C++ under g++: block quantization, exp/silu, scale widening, the block
// integer dot, the block term, the per-lane K loop, and the lane reduction tree (as an array
// butterfly for the host; the device runs the same butterfly with cross-lane shuffles).
//
// Rules for everything in this file (the contract's §0):
//   * IEEE binary32, round to nearest even, no FMA contraction (compile with -ffp-contract=off;
//     the only fused operations are explicit em_fma calls, used by accurate mode only), no
//     flushing of subnormals, IEEE-correct division.
//   * No libm calls: rounding uses rint with the default rounding mode (round half to even).
//   * Nothing here depends on HIP or CUDA headers, so `g++ -std=c++17` compiles it alone.
#ifndef EM_CONTRACT_H
#define EM_CONTRACT_H

#include <stdint.h>
#include <string.h>

// ---- host/device qualifiers -------------------------------------------------------------------
#if defined(__CUDACC__)
#define EM_HD __host__ __device__ __forceinline__
#elif defined(__HIP__)
#define EM_HD __attribute__((host, device)) inline __attribute__((always_inline))
#else
#define EM_HD inline
#endif

// Full unrolling of small constant-trip loops (register arrays stay in registers on the GPU).
#if defined(__CUDACC__) || defined(__clang__)
#define EM_UNROLL _Pragma("unroll")
#define EM_NOUNROLL _Pragma("unroll 1")
#else
#define EM_UNROLL
#define EM_NOUNROLL
#endif

// True while compiling device code for AMD (hip-clang) or NVIDIA (nvcc).
#if defined(__HIP_DEVICE_COMPILE__) && defined(__AMDGCN__)
#define EM_DEVICE_AMD 1
#elif defined(__CUDA_ARCH__)
#define EM_DEVICE_NV 1
#endif

// ---- constants of the contract (mirror quant/src/contract.rs and format.rs) -------------
#define EM_BLOCK 32          // elements per nibble block and per activation block
#define EM_BLOCK_BYTES 16    // packed bytes per block
#define EM_LANES 16          // lane partials of the fixed reduction (contract §3)
#define EM_GATE_UP_CHUNK 16  // W13 interleave chunk
#define EM_DEFAULT_ZERO 8

// f32 bit patterns of the contract's constants (exact, so no decimal-to-binary doubt).
// contract.rs MIN_BLOCK_AMAX = 2^-96 exactly (bits 0x0F800000).
#define EM_MIN_BLOCK_AMAX_BITS 0x0F800000u
#define EM_LOG2E_BITS 0x3FB8AA3Bu
#define EM_LN2_HI_BITS 0x3F318000u          // 0.693359375
#define EM_LN2_LO_BITS 0xB95E8083u          // -2.12194440e-4
#define EM_EXP_MIN (-87.0f)
#define EM_EXP_MAX 88.0f

// ---- bit casts ---------------------------------------------------------------------------------
EM_HD float em_bits_f32(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

EM_HD uint32_t em_f32_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

// ---- IEEE primitives without libm --------------------------------------------------------------
// Round to nearest, ties to even (the default rounding mode; the contract's round_half_even).
EM_HD float em_rint(float x) {
#if defined(EM_DEVICE_NV)
    return rintf(x);
#else
    return __builtin_rintf(x);
#endif
}

EM_HD float em_fabs(float x) { return em_bits_f32(em_f32_bits(x) & 0x7FFFFFFFu); }

// max/min for finite, non-NaN operands (the contract forbids NaN inputs): a plain comparison, so
// no libm and no dependence on fmaxf's signed-zero choice (callers never pass -0 vs +0 ties that
// matter: |x| >= +0 and the exp clamp bounds are non-zero).
EM_HD float em_max(float a, float b) { return a < b ? b : a; }
EM_HD float em_min(float a, float b) { return b < a ? b : a; }

// Fused multiply-add, used only by accurate mode (exact mode never fuses).
EM_HD float em_fma(float a, float b, float c) {
#if defined(EM_DEVICE_NV)
    return fmaf(a, b, c);
#else
    return __builtin_fmaf(a, b, c);
#endif
}

// ---- 16-bit scales (format.rs ScaleDtype): exact widening to f32 -------------------------------
EM_HD float em_bf16_to_f32(uint16_t h) { return em_bits_f32((uint32_t)h << 16); }

EM_HD float em_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    if (exp == 0) {
        if (man == 0) return em_bits_f32(sign);
        // Subnormal f16: man * 2^-24, exact in f32 (man < 2^10, power-of-two product).
        float mag = (float)man * em_bits_f32(0x33800000u);
        return em_bits_f32(em_f32_bits(mag) | sign);
    }
    if (exp == 31) return em_bits_f32(sign | 0x7F800000u | (man << 13));
    return em_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

EM_HD float em_scale_to_f32(uint16_t bits, uint32_t scale_is_bf16) {
    return scale_is_bf16 ? em_bf16_to_f32(bits) : em_f16_to_f32(bits);
}

// ---- contract §1: activation block quantization -------------------------------------------------
// Quantizes x[0..32] into q[0..32]; returns the block scale d and writes the code sum (used by the
// integer dot to apply the zero point: Σ(u - z)·q = Σ u·q - z·Σ q, exact in i32).
EM_HD float em_quantize_block(const float* x, int8_t* q, int32_t* qsum) {
    float amax = 0.0f;
    for (int i = 0; i < EM_BLOCK; ++i) amax = em_max(amax, em_fabs(x[i]));
    // `!(amax >= MIN)` also catches NaN.
    if (!(amax >= em_bits_f32(EM_MIN_BLOCK_AMAX_BITS))) {
        for (int i = 0; i < EM_BLOCK; ++i) q[i] = 0;
        *qsum = 0;
        return 0.0f;
    }
    float d = amax / 127.0f;
    float inv = 127.0f / amax;
    int32_t s = 0;
    for (int i = 0; i < EM_BLOCK; ++i) {
        float r = em_rint(x[i] * inv);
        r = em_min(em_max(r, -127.0f), 127.0f);
        // A NaN code (an infinite element of a block whose amax is infinite: inv = 0) is 0, as
        // Rust's `NaN as i8` in the contract; a plain cast of NaN is undefined behaviour.
        int32_t v = (r == r) ? (int32_t)r : 0;
        q[i] = (int8_t)v;
        s += v;
    }
    *qsum = s;
    return d;
}

// ---- contract §4: exp, silu, swiglu -------------------------------------------------------------
EM_HD float em_exp_contract(float v) {
    v = em_min(em_max(v, EM_EXP_MIN), EM_EXP_MAX);
    const float n = em_rint(v * em_bits_f32(EM_LOG2E_BITS));
    float r = v - n * em_bits_f32(EM_LN2_HI_BITS);
    r = r - n * em_bits_f32(EM_LN2_LO_BITS);
    const float z = r * r;
    // EXP_POLY of contract.rs, highest degree first, as exact bit patterns.
    float p = em_bits_f32(0x39506967u);
    p = p * r + em_bits_f32(0x3AB743CEu);
    p = p * r + em_bits_f32(0x3C088908u);
    p = p * r + em_bits_f32(0x3D2AA9C1u);
    p = p * r + em_bits_f32(0x3E2AAAAAu);
    p = p * r + em_bits_f32(0x3F000000u);
    p = p * z;
    p = p + r;
    p = p + 1.0f;
    const float pow2 = em_bits_f32((uint32_t)((int32_t)n + 127) << 23);
    return p * pow2;
}

EM_HD float em_silu(float g) { return g / (1.0f + em_exp_contract(-g)); }

EM_HD float em_swiglu(float g, float u) { return em_silu(g) * u; }

// ---- contract §2–3: block dot and block term ----------------------------------------------------
// Signed 4×int8 dot product accumulate: Σ a_i·b_i + c. Device builds map this to v_dot4 /
// v_dot4_i32_iu8 / dp4a (see em_device.h); the host and the portable fallback use this loop.
EM_HD int32_t em_dot4_scalar(uint32_t a, uint32_t b, int32_t c) {
    for (int i = 0; i < 4; ++i) {
        c += (int32_t)(int8_t)(uint8_t)(a >> (8 * i)) * (int32_t)(int8_t)(uint8_t)(b >> (8 * i));
    }
    return c;
}

// Which integer dot instruction an AMD target has (LLVM feature names in brackets):
//   EM_AMD_SDOT4  v_dot4_i32_i8 / v_dot4c_i32_i8 [dot1-insts]: gfx906, gfx908, gfx90a, gfx94x,
//                 gfx950, gfx1011, gfx1012, gfx103x (not gfx90c: no dot1-insts, checked
//                 with clang -mcpu=gfx90c; it takes em_dot4_scalar)
//   EM_AMD_SUDOT4 v_dot4_i32_iu8 [dot8-insts]: gfx11xx, gfx12xx (no dot1 there)
#if defined(EM_DEVICE_AMD)
#if defined(__gfx906__) || defined(__gfx908__) || defined(__gfx90a__) || \
    defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || defined(__gfx950__) || \
    defined(__gfx1011__) || defined(__gfx1012__) || defined(__gfx1030__) || defined(__gfx1031__) || \
    defined(__gfx1032__) || defined(__gfx1033__) || defined(__gfx1034__) || defined(__gfx1035__) || \
    defined(__gfx1036__)
#define EM_AMD_SDOT4 1
#elif defined(__gfx1100__) || defined(__gfx1101__) || defined(__gfx1102__) || \
    defined(__gfx1103__) || defined(__gfx1150__) || defined(__gfx1151__) || defined(__gfx1200__) || \
    defined(__gfx1201__)
#define EM_AMD_SUDOT4 1
#endif
#endif

// The dot used by every exact kernel: a single integer dot instruction where the target has one,
// the scalar loop otherwise (exact either way: 4 products of |x| <= 127·15 summed in i32).
EM_HD int32_t em_dot4(uint32_t a, uint32_t b, int32_t c) {
#if defined(EM_AMD_SDOT4)
    return __builtin_amdgcn_sdot4((int)a, (int)b, c, false);
#elif defined(EM_AMD_SUDOT4)
    return __builtin_amdgcn_sudot4(true, (int)a, true, (int)b, c, false);
#elif defined(EM_DEVICE_NV) && (__CUDA_ARCH__ >= 610)
    return __dp4a((int)a, (int)b, c);
#else
    return em_dot4_scalar(a, b, c);
#endif
}
#define EM_DOT4(a, b, c) em_dot4((a), (b), (c))

// One 16-byte packed block as four little-endian words: word i holds bytes 4i..4i+3, so
// `w & 0x0F0F0F0F` gives elements 4i..4i+3 and `(w >> 4) & 0x0F0F0F0F` elements 16+4i..16+4i+3.
struct alignas(16) em_u32x4 {
    uint32_t v[4];
};

// Exact integer block dot (contract §2): Σ_j (u_j - z)·q_j, with q as 8 little-endian words
// (q[0..4] = elements 0..15, q[4..8] = elements 16..31) and qsum = Σ_j q_j.
EM_HD int32_t em_block_isum(const em_u32x4& w, const uint32_t* q, int32_t qsum, int32_t z) {
    int32_t s = 0;
    EM_UNROLL
    for (int i = 0; i < 4; ++i) {
        s = EM_DOT4(w.v[i] & 0x0F0F0F0Fu, q[i], s);
        s = EM_DOT4((w.v[i] >> 4) & 0x0F0F0F0Fu, q[4 + i], s);
    }
    return s - z * qsum;
}

// Contract §3 block term: (s · d) · f32(isum), two roundings in this order.
EM_HD float em_block_term(float scale, float d, int32_t isum) { return (scale * d) * (float)isum; }

// The halving tree of contract §3 as an xor butterfly over 16 lane partials (the device runs the
// same butterfly with shuffles; IEEE addition commutes, so every lane ends with P[0]'s bits).
EM_HD float em_tree16_host(const float* partials) {
    float p[EM_LANES];
    for (int l = 0; l < EM_LANES; ++l) p[l] = partials[l];
    for (int w = EM_LANES / 2; w > 0; w /= 2) {
        float n[EM_LANES];
        for (int l = 0; l < EM_LANES; ++l) n[l] = p[l] + p[l ^ w];
        for (int l = 0; l < EM_LANES; ++l) p[l] = n[l];
    }
    return p[0];
}

// The same tree evaluated in post-order, for kernels that compute the 16 partials one after
// another instead of side by side: the i-th partial computed (i = 0..15) is partial
// em_tree16_postorder_lane(i) (the 4-bit reversal of i: 0, 8, 4, 12, 2, 10, ...), and
// em_tree16_push folds it into a 5-entry stack exactly as the halving tree combines it
// (P[l] + P[l+8], then the width-4, 2, 1 siblings). After i = 15, stack[0] is the row result.
EM_HD uint32_t em_tree16_postorder_lane(int i) {
    return ((i & 1) << 3) | ((i & 2) << 1) | ((i & 4) >> 1) | ((i & 8) >> 3);
}

EM_HD void em_tree16_push(float* stack, int i, float v) {
    int sp = 0;  // completed subtrees on the stack before this push = popcount(i)
    for (int n = i; n; n >>= 1) sp += n & 1;
    for (int n = i; n & 1; n >>= 1) v = stack[--sp] + v;
    stack[sp] = v;
}

// ---- packed matrix view --------------------------------------------------------------------------
// A view of one packed matrix in the canonical layout (format.rs): nibbles [rows][cols/2], scales
// [rows][cols/g] (u16 bits), optional zero points [rows][ceil(G/2)] (low nibble = even group).
struct EmMatView {
    const uint8_t* nibbles;
    const uint16_t* scales;
    const uint8_t* zeros;  // null when symmetric (zero point 8)
    uint32_t rows;
    uint32_t cols;
    uint32_t groups_per_row;
    uint32_t group_shift;  // log2(group_size / 32): block b is in group b >> group_shift
    uint32_t zero_bytes_per_row;
    uint32_t scale_is_bf16;
};

// One 16-byte weight load (the pointer is 16-byte aligned: rows are multiples of 16 bytes and
// buffers are 256-byte aligned). Weights are streamed once per batch, so device loads are
// non-temporal (AMD `nt`) / evict-first (NVIDIA `ld.global.cs`) and do not displace activations.
EM_HD em_u32x4 em_load_weights16(const uint8_t* p) {
#if defined(EM_DEVICE_AMD)
    typedef uint32_t v4u __attribute__((ext_vector_type(4)));
    const v4u v = __builtin_nontemporal_load((const v4u*)p);
    em_u32x4 w;
    w.v[0] = v.x;
    w.v[1] = v.y;
    w.v[2] = v.z;
    w.v[3] = v.w;
    return w;
#elif defined(EM_DEVICE_NV)
    const uint4 v = __ldcs((const uint4*)p);
    em_u32x4 w;
    w.v[0] = v.x;
    w.v[1] = v.y;
    w.v[2] = v.z;
    w.v[3] = v.w;
    return w;
#else
    em_u32x4 w;
    memcpy(&w, p, sizeof w);
    return w;
#endif
}
#define EM_LOAD_WEIGHTS16(p) em_load_weights16(p)

// The zero point of `group` from the byte holding its nibble (EM_DEFAULT_ZERO without zeros).
EM_HD int32_t em_zero_in_byte(const EmMatView& m, uint32_t byte, uint32_t group) {
    if (!m.zeros) return EM_DEFAULT_ZERO;
    return (int32_t)((group & 1u) ? (byte >> 4) : (byte & 0x0Fu));
}

EM_HD int32_t em_zero_point(const EmMatView& m, uint32_t row, uint32_t group) {
    if (!m.zeros) return EM_DEFAULT_ZERO;
    return em_zero_in_byte(m, m.zeros[(uint64_t)row * m.zero_bytes_per_row + (group >> 1)], group);
}

// ---- the per-lane K loop ------------------------------------------------------------------------
// Lane `lane` (0..15) of the 16 lanes that own a row adds the terms of blocks lane, lane+16, ...
// in increasing order into its partial P[r][t] for R rows × T tokens. This is the code every FFN
// kernel runs per lane and the host path runs per (lane, row, token); the result depends only on
// (row, token), never on R or T, because each accumulator sees the same operation sequence.
// The weights of the lane's next EM_PREFETCH_BLOCKS blocks are in flight while a block is
// computed (EmRowPipe): how far ahead a lane loads changes how many bytes are in flight per lane,
// never the bits, so a target chooses it (scripts/gpu-check.sh measures the choices on a GPU).
#ifndef EM_PREFETCH_BLOCKS
#define EM_PREFETCH_BLOCKS 1
#endif

// The packed block of one row at one block, with its scale and zero-point bytes as loaded: the
// loads are issued here, and turned into numbers (em_row_terms) only when the block is computed,
// so a block loaded ahead does not wait for its scale's memory latency at load time.
struct EmRowBlock {
    em_u32x4 w;
    uint32_t scale_bits;  // the raw bf16/f16 scale
    uint32_t zero_byte;   // the byte holding the zero-point nibble (0 without zero points)
};

struct EmRowTerms {
    float s;
    int32_t z;
};

EM_HD EmRowBlock em_load_row_block(const EmMatView& m, uint32_t row, uint32_t b) {
    const uint32_t g = b >> m.group_shift;
    EmRowBlock rb;
    rb.w = EM_LOAD_WEIGHTS16(m.nibbles + (uint64_t)row * (m.cols / 2) + (uint64_t)b * EM_BLOCK_BYTES);
    rb.scale_bits = m.scales[(uint64_t)row * m.groups_per_row + g];
    rb.zero_byte = m.zeros ? m.zeros[(uint64_t)row * m.zero_bytes_per_row + (g >> 1)] : 0u;
    return rb;
}

// The scale and zero point of block `b` loaded in `rb`.
EM_HD EmRowTerms em_row_terms(const EmMatView& m, const EmRowBlock& rb, uint32_t b) {
    const uint32_t g = b >> m.group_shift;
    EmRowTerms t;
    t.s = em_scale_to_f32((uint16_t)rb.scale_bits, m.scale_is_bf16);
    t.z = em_zero_in_byte(m, rb.zero_byte, g);
    return t;
}

// The row blocks of one lane's K loop: blk[0] is the block being computed, blk[k] the lane's block
// k steps ahead (in flight). `issue(b)` starts the load of block b + D·16 (block b again past the
// end: a re-read that hits the cache) before block b is computed; `shift()` moves up one step.
template <int R>
struct EmRowPipe {
    static constexpr int D = EM_PREFETCH_BLOCKS;
    EmRowBlock blk[D + 1][R];

    EM_HD void start(const EmMatView& m, const uint32_t* rows, uint32_t lane, uint32_t nblocks) {
        EM_UNROLL
        for (int k = 0; k < D; ++k) {
            const uint32_t bk = lane + k * EM_LANES < nblocks ? lane + k * EM_LANES : lane;
            EM_UNROLL
            for (int r = 0; r < R; ++r) blk[k][r] = em_load_row_block(m, rows[r], bk);
        }
    }
    EM_HD void issue(const EmMatView& m, const uint32_t* rows, uint32_t b, uint32_t nblocks) {
        const uint32_t bn = b + D * EM_LANES < nblocks ? b + D * EM_LANES : b;
        EM_UNROLL
        for (int r = 0; r < R; ++r) blk[D][r] = em_load_row_block(m, rows[r], bn);
    }
    EM_HD void shift() {
        EM_UNROLL
        for (int k = 0; k < D; ++k) {
            EM_UNROLL
            for (int r = 0; r < R; ++r) blk[k][r] = blk[k + 1][r];
        }
    }
};

// Exact mode (contract §2–§3). Act must provide
// `void load(int t, uint32_t b, uint32_t q[8], float* d, int32_t* qsum) const`.
struct EmActBlock {
    uint32_t q[8];
    float d;
    int32_t qsum;
};
template <int R, int T, class Act>
EM_HD void em_exact_lane_accumulate(const EmMatView& m, const uint32_t* rows, uint32_t lane,
                                    const Act& act, float (*P)[T]) {
    const uint32_t nblocks = m.cols / EM_BLOCK;
    if (lane >= nblocks) return;
    EmRowPipe<R> pipe;
    pipe.start(m, rows, lane, nblocks);
    EM_NOUNROLL
    for (uint32_t b = lane; b < nblocks; b += EM_LANES) {
        pipe.issue(m, rows, b, nblocks);
        EmActBlock x[T];
        EM_UNROLL
        for (int t = 0; t < T; ++t) act.load(t, b, x[t].q, &x[t].d, &x[t].qsum);
        EmRowTerms rt[R];
        EM_UNROLL
        for (int r = 0; r < R; ++r) rt[r] = em_row_terms(m, pipe.blk[0][r], b);
        EM_UNROLL
        for (int t = 0; t < T; ++t) {
            EM_UNROLL
            for (int r = 0; r < R; ++r) {
                const int32_t isum = em_block_isum(pipe.blk[0][r].w, x[t].q, x[t].qsum, rt[r].z);
                P[r][t] = P[r][t] + em_block_term(rt[r].s, x[t].d, isum);
            }
        }
        pipe.shift();
    }
}

// Accurate mode (W4A16): the same lane/block assignment; per block the exact integer weights
// (u - z) are multiplied with f32 activations by explicit FMAs in element order, then scaled once
// per block (the factored form: the scale is applied after the block dot, which the research
// notes recommend for accuracy). Act must provide
// `void load_f32x4(int t, uint32_t b, int c, float x[4]) const` (elements 32b+4c .. 32b+4c+3).
template <int R, int T, class Act>
EM_HD void em_accurate_lane_accumulate(const EmMatView& m, const uint32_t* rows, uint32_t lane,
                                       const Act& act, float (*P)[T]) {
    const uint32_t nblocks = m.cols / EM_BLOCK;
    if (lane >= nblocks) return;
    EmRowPipe<R> pipe;
    pipe.start(m, rows, lane, nblocks);
    EM_NOUNROLL
    for (uint32_t b = lane; b < nblocks; b += EM_LANES) {
        pipe.issue(m, rows, b, nblocks);
        EmRowTerms rt[R];
        EM_UNROLL
        for (int r = 0; r < R; ++r) rt[r] = em_row_terms(m, pipe.blk[0][r], b);
        EM_UNROLL
        for (int t = 0; t < T; ++t) {
            float acc[R];
            EM_UNROLL
            for (int r = 0; r < R; ++r) acc[r] = 0.0f;
            EM_UNROLL
            for (int c = 0; c < 8; ++c) {  // element chunk 4c..4c+3: word c%4, nibble half c/4
                float x[4];
                act.load_f32x4(t, b, c, x);
                EM_UNROLL
                for (int j = 0; j < 4; ++j) {
                    EM_UNROLL
                    for (int r = 0; r < R; ++r) {
                        const int32_t u = (int32_t)((pipe.blk[0][r].w.v[c % 4] >> (8 * j + 4 * (c / 4))) & 0x0Fu);
                        acc[r] = em_fma((float)(u - rt[r].z), x[j], acc[r]);
                    }
                }
            }
            EM_UNROLL
            for (int r = 0; r < R; ++r) P[r][t] = em_fma(rt[r].s, acc[r], P[r][t]);
        }
        pipe.shift();
    }
}

// ---- W13 interleave (format.rs w13_row) ----------------------------------------------------------
EM_HD uint32_t em_w13_row(int up, uint32_t f) {
    const uint32_t chunk = f / EM_GATE_UP_CHUNK;
    const uint32_t within = f % EM_GATE_UP_CHUNK;
    return chunk * 2 * EM_GATE_UP_CHUNK + within + (up ? EM_GATE_UP_CHUNK : 0);
}

// ---- contract §5 restricted to one device: pre-combined output ------------------------------------
// acc = +0; for each of the token's pairs in increasing output-row order: acc = acc + (w · y).
EM_HD float em_combine_step(float acc, float weight, float y) { return acc + weight * y; }

#endif  // EM_CONTRACT_H
