// prefill.hip — the expert FFN for batches with many tokens per expert, on matrix cores.
//
// Why this exists: once an expert sees more than a few tokens, re-streaming its weights per
// token pass (the decode kernel's strategy) wastes bandwidth and VALU. Here a workgroup computes a
// 64-row × 16-token tile with integer matrix instructions, so each weight block is loaded once per
// 16 tokens. It implements exact mode (W4A8) and matches the contract bit for bit, because integer
// matrix products are exact: each 32-element block's int32 dot comes out of the matrix unit, and
// the float part (term (s·d)·isum, 16 partials in block order, xor tree) is the same code as
// everywhere else (em_contract.h).
//
// Per target (selected at compile time):
//   * gfx908 / gfx90a: v_mfma_i32_16x16x16i8, two per 32-element block;
//   * gfx940 / gfx941 / gfx942 / gfx950: v_mfma_i32_16x16x32_i8, one per block;
//   * gfx11 (wave32): v_wmma_i32_16x16x16_iu8, two per block;
//   * everything else (gfx103x, NVIDIA): a portable path computing the same per-block integer dots
//     with em_block_isum (v_dot4 / dp4a).
// Launch: grid (row tiles, prefill items), EM_PREFILL_WAVES waves per workgroup; phase 1 (W13,
// epilogue silu·mul + quantization of h) and phase 2 (W2) are two launches.
#include "em_device.h"

#if defined(EM_DEVICE_AMD) && (defined(__gfx908__) || defined(__gfx90a__))
#define EM_MFMA_16X16X16 1
#elif defined(EM_DEVICE_AMD) && (defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || \
                                 defined(__gfx950__))
#define EM_MFMA_16X16X32 1
#elif defined(EM_DEVICE_AMD) && defined(__gfx11__)
#define EM_WMMA_IU8 1
#elif defined(EM_DEVICE_AMD) && (defined(__gfx1100__) || defined(__gfx1101__) || \
                                 defined(__gfx1102__) || defined(__gfx1103__) || \
                                 defined(__gfx1150__) || defined(__gfx1151__))
#define EM_WMMA_IU8 1
#endif

// Entries (row, token) of a wave's 16×16 tile held by each lane.
#if defined(EM_MFMA_16X16X16) || defined(EM_MFMA_16X16X32)
#define EM_ENTRIES 4  // wave64, C layout: row 4·(lane/16) + e, token lane % 16
#elif defined(EM_WMMA_IU8)
#define EM_ENTRIES 8  // wave32, C layout: row 2·e + lane/16, token lane % 16
#else
#define EM_ENTRIES (256 / EM_WAVE)  // portable: row EM_ENTRIES·(lane/16) + e, token lane % 16
#endif

namespace {

typedef int v4i __attribute__((ext_vector_type(4)));
typedef int v8i __attribute__((ext_vector_type(8)));

__device__ inline uint32_t entry_row(uint32_t lane, int e) {
#if defined(EM_WMMA_IU8)
    return 2 * e + lane / 16;
#else
    return EM_ENTRIES * (lane / 16) + e;
#endif
}

// Integer dots of one 32-element block for this lane's entries: isum[e] = Σ_k u[row_e][k]·q[tok][k]
// (no zero point yet). `wrow` points at the 16-byte block of row (wave_row0 + lane%16) for the
// matrix paths; the portable path loads its entries' rows itself.
struct BlockOperands {
    const uint8_t* nib;    // matrix paths: block b of row 0 of the wave's 16-row slice;
                           // portable path: block b of matrix row 0
    uint64_t row_bytes;    // bytes per matrix row
    const int8_t* q;       // block b of the activation row of token lane%16
    const uint32_t* erow;  // portable path: this lane's entry rows (absolute, clamped)
};

__device__ inline void block_isums(const BlockOperands& op, uint32_t lane, int32_t* isum) {
#if defined(EM_MFMA_16X16X16)
    // A: lane holds row lane%16, k-slice 4·(lane/16)..+3; B: token lane%16, same k-slice.
    const uint32_t kg = lane / 16;
    const uint32_t w = *(const uint32_t*)(op.nib + (uint64_t)(lane % 16) * op.row_bytes + 4 * kg);
    const uint32_t qlo = *(const uint32_t*)(op.q + 4 * kg);
    const uint32_t qhi = *(const uint32_t*)(op.q + 16 + 4 * kg);
    v4i c = {0, 0, 0, 0};
    c = __builtin_amdgcn_mfma_i32_16x16x16i8((int)(w & 0x0F0F0F0Fu), (int)qlo, c, 0, 0, 0);
    c = __builtin_amdgcn_mfma_i32_16x16x16i8((int)((w >> 4) & 0x0F0F0F0Fu), (int)qhi, c, 0, 0, 0);
    for (int e = 0; e < 4; ++e) isum[e] = c[e];
#elif defined(EM_MFMA_16X16X32)
    // A: lane holds row lane%16, 8 k-values 8·(lane/16)..+7 (a 64-bit register); B likewise.
    // Any k order works as long as A and B agree: lane group kg supplies elements
    // {4kg..4kg+3, 16+4kg..16+4kg+3} (low then high nibbles of word kg) on both sides.
    const uint32_t kg = lane / 16;
    const uint32_t w = *(const uint32_t*)(op.nib + (uint64_t)(lane % 16) * op.row_bytes + 4 * kg);
    const uint32_t qlo = *(const uint32_t*)(op.q + 4 * kg);
    const uint32_t qhi = *(const uint32_t*)(op.q + 16 + 4 * kg);
    const long a = (long)(((uint64_t)((w >> 4) & 0x0F0F0F0Fu) << 32) | (w & 0x0F0F0F0Fu));
    const long bq = (long)(((uint64_t)qhi << 32) | qlo);
    v4i c = {0, 0, 0, 0};
    c = __builtin_amdgcn_mfma_i32_16x16x32_i8(a, bq, c, 0, 0, 0);
    for (int e = 0; e < 4; ++e) isum[e] = c[e];
#elif defined(EM_WMMA_IU8)
    // A: lane holds row lane%16, k 0..15 (lanes 16..31 repeat lanes 0..15); B: token lane%16.
    const em_u32x4 w = *(const em_u32x4*)(op.nib + (uint64_t)(lane % 16) * op.row_bytes);
    const em_u32x4 qlo = *(const em_u32x4*)op.q;
    const em_u32x4 qhi = *(const em_u32x4*)(op.q + 16);
    v4i alo, ahi, blo, bhi;
    for (int i = 0; i < 4; ++i) {
        alo[i] = (int)(w.v[i] & 0x0F0F0F0Fu);
        ahi[i] = (int)((w.v[i] >> 4) & 0x0F0F0F0Fu);
        blo[i] = (int)qlo.v[i];
        bhi[i] = (int)qhi.v[i];
    }
    v8i c = {0, 0, 0, 0, 0, 0, 0, 0};
    c = __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32(true, alo, true, blo, c, false);
    c = __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32(true, ahi, true, bhi, c, false);
    for (int e = 0; e < 8; ++e) isum[e] = c[e];
#else
    // Portable: each lane computes its own entries' block dots (token lane%16).
    uint32_t q[8];
    const em_u32x4 qlo = *(const em_u32x4*)op.q;
    const em_u32x4 qhi = *(const em_u32x4*)(op.q + 16);
    for (int i = 0; i < 4; ++i) {
        q[i] = qlo.v[i];
        q[4 + i] = qhi.v[i];
    }
    for (int e = 0; e < EM_ENTRIES; ++e) {
        const em_u32x4 w = *(const em_u32x4*)(op.nib + (uint64_t)op.erow[e] * op.row_bytes);
        isum[e] = em_block_isum(w, q, 0, 0);
    }
#endif
}

// One wave's 16-row × 16-token slice over the whole K: returns each entry's contract row result.
// `act_row` is the activation row of this lane's token (lane % 16), `row0` the first matrix row of
// the slice. A slice lies wholly inside the matrix or wholly past its end (rows are multiples of
// 32, slices of 16); past the end it reads clamped rows and the caller discards the results.
template <bool COHERENT>
__device__ void slice_exact(const EmMatView& m, uint32_t row0, const int8_t* aq, const float* ad,
                            const int32_t* aqsum, uint32_t act_row, uint32_t lane, float* result) {
    const uint32_t nblocks = m.cols / EM_BLOCK;
    const uint64_t row_bytes = m.cols / 2;
    // Row index of each entry (clamped to the matrix) and the slice's 16 rows for the A operand.
    uint32_t erow[EM_ENTRIES];
    for (int e = 0; e < EM_ENTRIES; ++e) {
        const uint32_t r = row0 + entry_row(lane, e);
        erow[e] = r < m.rows ? r : m.rows - 1;
    }
    // Row 0 of the slice for the matrix operand; a slice past the end reads the last full slice's
    // rows (results are discarded by the caller).
#if defined(EM_MFMA_16X16X16) || defined(EM_MFMA_16X16X32) || defined(EM_WMMA_IU8)
    const uint32_t slice_row0 = row0 + 16 <= m.rows ? row0 : m.rows - 16;
#endif
    const int8_t* qrow = aq + (uint64_t)act_row * m.cols;
    // Contract §3 with few registers: partial P[l] only ever receives blocks l, l+16, ... in
    // increasing order, so the partials are computed one after another in the post-order of the
    // halving tree (0, 8, 4, 12, 2, 10, 6, 14, 1, 9, ...) and combined on a 5-deep stack exactly as
    // the tree combines them: P[l] + P[l+8], then + the sibling of width 4, 2, 1.
    float stack[EM_ENTRIES][5];
    EM_UNROLL
    for (int i = 0; i < EM_LANES; ++i) {
        const uint32_t l = em_tree16_postorder_lane(i);
        float part[EM_ENTRIES];
        for (int e = 0; e < EM_ENTRIES; ++e) part[e] = 0.0f;
        EM_NOUNROLL
        for (uint32_t b = l; b < nblocks; b += EM_LANES) {
            BlockOperands op;
            op.row_bytes = row_bytes;
            op.q = qrow + (uint64_t)b * EM_BLOCK;
            op.erow = erow;
#if defined(EM_MFMA_16X16X16) || defined(EM_MFMA_16X16X32) || defined(EM_WMMA_IU8)
            op.nib = m.nibbles + (uint64_t)slice_row0 * row_bytes + (uint64_t)b * EM_BLOCK_BYTES;
#else
            op.nib = m.nibbles + (uint64_t)b * EM_BLOCK_BYTES;
#endif
            int32_t isum[EM_ENTRIES];
            block_isums(op, lane, isum);
            const uint64_t bi = (uint64_t)act_row * nblocks + b;
            const float d = COHERENT ? em_load_coherent_f32(ad + bi) : ad[bi];
            const int32_t qs = COHERENT ? em_load_coherent_i32(aqsum + bi) : aqsum[bi];
            const uint32_t g = b >> m.group_shift;
            for (int e = 0; e < EM_ENTRIES; ++e) {
                const float s = em_scale_to_f32(m.scales[(uint64_t)erow[e] * m.groups_per_row + g], m.scale_is_bf16);
                const int32_t z = em_zero_point(m, erow[e], g);
                part[e] = part[e] + em_block_term(s, d, isum[e] - z * qs);
            }
        }
        for (int e = 0; e < EM_ENTRIES; ++e) em_tree16_push(stack[e], i, part[e]);
    }
    for (int e = 0; e < EM_ENTRIES; ++e) result[e] = stack[e][0];
}

struct PrefillShared {
    float rows[EM_TILE_ROWS][EM_PREFILL_TOKENS];
    float h[EM_PREFILL_TOKENS][EM_BLOCK];
};

__device__ inline void item_of(const EmFfnArgs& a, EmGroup* grp, uint32_t* c0) {
    const uint32_t* it = a.prefill_items + 2 * (uint64_t)em_bid_y();
    *grp = a.groups[it[0]];
    *c0 = it[1];
}

}  // namespace

#define EM_PREFILL_KERNEL extern "C" __global__ __launch_bounds__(EM_PREFILL_WAVES * EM_WAVE)

// Phase 1: grid.x = W13 tile (64 rows = one 32-block of h), grid.y = prefill item.
EM_PREFILL_KERNEL void em_prefill_exact_w13(EmFfnArgs a) {
    __shared__ PrefillShared sh;
    const uint32_t tid = em_tid();
    const uint32_t wave = tid / EM_WAVE;
    const uint32_t lane = tid % EM_WAVE;
    const uint32_t tile = em_bid();
    EmGroup grp;
    uint32_t c0;
    item_of(a, &grp, &c0);
    const uint32_t F = a.shape.inter;
    const EmMatView m = em_view(a.shape, a.experts[grp.expert_slot], 0);
    const uint32_t tok = lane % 16;
    const uint32_t c = c0 + tok < grp.pair_count ? c0 + tok : grp.pair_count - 1;
    const uint32_t act_row = a.pair_token[grp.pair_begin + c];
    float res[EM_ENTRIES];
    const uint32_t row0 = tile * EM_TILE_ROWS + 16 * wave;
    slice_exact<false>(m, row0, a.xq, a.xd, a.xqsum, act_row, lane, res);
    for (int e = 0; e < EM_ENTRIES; ++e) sh.rows[16 * wave + entry_row(lane, e)][tok] = res[e];
    em_sync();
    for (uint32_t i = tid; i < EM_PREFILL_TOKENS * EM_BLOCK; i += EM_PREFILL_WAVES * EM_WAVE) {
        const uint32_t t = i / EM_BLOCK;
        const uint32_t j = i % EM_BLOCK;
        sh.h[t][j] = em_swiglu(sh.rows[em_w13_row(0, j)][t], sh.rows[em_w13_row(1, j)][t]);
    }
    em_sync();
    if (tid < EM_PREFILL_TOKENS && c0 + tid < grp.pair_count) {
        const uint64_t p = grp.pair_begin + c0 + tid;
        int8_t q[EM_BLOCK];
        int32_t qs;
        const float d = em_quantize_block(sh.h[tid], q, &qs);
        em_u32x4 lo, hi;
        memcpy(&lo, q, 16);
        memcpy(&hi, q + 16, 16);
        int8_t* dst = a.hq + p * F + (uint64_t)tile * EM_BLOCK;
        *(em_u32x4*)dst = lo;
        *(em_u32x4*)(dst + 16) = hi;
        a.hd[p * (F / EM_BLOCK) + tile] = d;
        a.hqsum[p * (F / EM_BLOCK) + tile] = qs;
    }
}

// Phase 2: grid.x = W2 tile of 64 rows, grid.y = prefill item.
EM_PREFILL_KERNEL void em_prefill_exact_w2(EmFfnArgs a) {
    const uint32_t tid = em_tid();
    const uint32_t wave = tid / EM_WAVE;
    const uint32_t lane = tid % EM_WAVE;
    const uint32_t tile = em_bid();
    EmGroup grp;
    uint32_t c0;
    item_of(a, &grp, &c0);
    const uint32_t H = a.shape.hidden;
    const EmMatView m = em_view(a.shape, a.experts[grp.expert_slot], 1);
    const uint32_t tok = lane % 16;
    const uint32_t c = c0 + tok < grp.pair_count ? c0 + tok : grp.pair_count - 1;
    const uint32_t pair = grp.pair_begin + c;
    float res[EM_ENTRIES];
    const uint32_t row0 = tile * EM_TILE_ROWS + 16 * wave;
    slice_exact<false>(m, row0, a.hq, a.hd, a.hqsum, pair, lane, res);
    if (c0 + tok < grp.pair_count) {
        const uint64_t out_row = a.pair_out[pair];
        for (int e = 0; e < EM_ENTRIES; ++e) {
            const uint32_t row = row0 + entry_row(lane, e);
            if (row < H) a.y[out_row * H + row] = res[e];
        }
    }
}
