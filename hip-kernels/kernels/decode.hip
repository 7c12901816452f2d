// decode.hip — the fused expert FFN for decode batches (few tokens per expert).
//
// Why this exists: at decode, each expert sees one or two tokens, so the FFN is a pair of skinny
// matrix-vector products and the only cost that matters is streaming the expert's packed weights
// once. This kernel family does gate/up -> silu·mul -> down for every (expert, token list) of a
// grouped batch in one persistent launch:
//
//   * Work items: phase 1 = (group, Phase1Tiles 64-row tiles of W13), then phase 2 = (group,
//     tile of 32·Phase2Rows rows of W2), handed out in that order by an atomic counter. A workgroup that takes a phase-2 item of
//     group g waits (bounded) until all phase-1 tiles of g are done. Since items are dispensed in
//     order and phase-1 items never wait, every awaited tile belongs to a workgroup that is already
//     running: no deadlock whatever the occupancy. `first_phase == last_phase` runs one phase per
//     launch instead (two launches, no waiting): the same bits, for debugging and comparison.
//   * A workgroup is 32 teams of 16 lanes; a team owns 2 rows (tile row = team + 32·r). A 64-row
//     W13 tile holds the gate and up rows of 32 consecutive intermediate indices (two 16-row
//     interleave chunks), i.e. exactly one 32-element block of h: the epilogue applies silu·mul
//     and quantizes that block (exact mode) without another pass.
//   * Lane l of a team reads blocks l, l+16, ... of its rows with one 16-byte load per row per
//     block, so each expert's weights are read exactly once per batch (per EM_DECODE_TOKENS
//     tokens; larger groups re-read the tile from cache).
//   * Exact mode (W4A8): per block an integer dot (v_dot4_i32_i8 / v_dot4_i32_iu8 / dp4a), the
//     term (s·d)·isum, 16 lane partials and the xor tree: contract §2–§3 bit for bit, using the
//     very functions of em_contract.h that the host-side check runs on the CPU.
//   * Accurate mode (W4A16): f32 activations, explicit FMAs in a fixed order, f32 intermediate.
//
// What the first GPU runs taught (H200 through HIP's NVIDIA headers, BENCHMARKS.md): the K loop
// was waiting on memory it did not need to wait for — a block's scale was converted as soon as it
// was loaded (a DRAM round trip per row per block; em_contract.h now converts at use), activations
// came from L2 every block (now staged in LDS once per pass), a one-token pass did the arithmetic
// of two, each item began with a counter round trip, and items were too short to pay their fill,
// staging and epilogue (now two W13 tiles and 128 W2 rows per item on NVIDIA: EM_PHASE1_TILES,
// EM_PHASE2_ROWS_PER_TEAM; AMD targets keep the smaller items). Loading weights further ahead did not
// help (EM_PREFETCH_BLOCKS 2–4 measured no better). The switches below keep each change
// measurable (scripts/gpu-check.sh EM_GPU_VARIANTS); none changes a bit of the results.
#include "em_device.h"

// 1: a workgroup takes its next work item while running the current one (see decode_main).
#ifndef EM_ITEM_PREFETCH
#define EM_ITEM_PREFETCH 1
#endif
// 1: a pass with one real token runs the one-token K loop (see lane_pass).
#ifndef EM_SINGLE_TOKEN_PASS
#define EM_SINGLE_TOKEN_PASS 1
#endif
// 1: exact-mode passes read their activation rows from LDS (see DecodeShared), for rows of up to
// EM_STAGE_COLS elements.
#ifndef EM_STAGE_ACT
#define EM_STAGE_ACT 1
#endif
#define EM_STAGE_COLS 8192
// Work-item shapes measured on an NVIDIA GPU (BENCHMARKS.md); the HIP-CPU stand-in's generic
// wave-32 branch sets EM_NV_SHAPES too, so CI checks them bit for bit.
#if defined(__CUDACC__) && !defined(EM_NV_SHAPES)
#define EM_NV_SHAPES 1
#endif
// Rows of W2 per team in a phase-2 item (a multiple of EM_ROWS_PER_TEAM): more rows per item
// means fewer, longer phase-2 items and more bytes in flight per lane. 4 measured 9-14% faster
// than 2 on an H200 (BENCHMARKS.md); on AMD targets 4 spills VGPRs (gfx908, gfx1100:
// scripts/hip-isa-check.sh), so they keep 2 until an AMD GPU measures otherwise.
#ifndef EM_PHASE2_ROWS_PER_TEAM
#if EM_NV_SHAPES
#define EM_PHASE2_ROWS_PER_TEAM (2 * EM_ROWS_PER_TEAM)
#else
#define EM_PHASE2_ROWS_PER_TEAM EM_ROWS_PER_TEAM
#endif
#endif

// 64-row W13 tiles per phase-1 item (1 or 2): fewer items, each paying its staging and epilogue
// once for more weights. 2 measured 15-21% faster than 1 on an H200; AMD targets keep 1 until
// measured there (4 rows per team spilled VGPRs in phase 2, see EM_PHASE2_ROWS_PER_TEAM).
#ifndef EM_PHASE1_TILES
#if EM_NV_SHAPES
#define EM_PHASE1_TILES 2
#else
#define EM_PHASE1_TILES 1
#endif
#endif
// The item shapes above are exact mode's; accurate mode keeps one tile and two rows per team
// unless these say otherwise (its f32 loop holds more registers: with exact mode's NVIDIA
// shapes it spilled 776 bytes on sm_90, scripts/nvcc-local.sh).
#ifndef EM_PHASE1_TILES_ACCURATE
#define EM_PHASE1_TILES_ACCURATE 1
#endif
#ifndef EM_PHASE2_ROWS_PER_TEAM_ACCURATE
#define EM_PHASE2_ROWS_PER_TEAM_ACCURATE EM_ROWS_PER_TEAM
#endif
#define EM_PHASE1_TILES_MAX \
    (EM_PHASE1_TILES > EM_PHASE1_TILES_ACCURATE ? EM_PHASE1_TILES : EM_PHASE1_TILES_ACCURATE)

namespace {

// The work-item shapes of each mode (see EM_PHASE1_TILES and EM_PHASE2_ROWS_PER_TEAM).
template <bool EXACT>
struct Phase1Tiles {
    static constexpr int value = EXACT ? EM_PHASE1_TILES : EM_PHASE1_TILES_ACCURATE;
};
template <bool EXACT>
struct Phase2Rows {
    static constexpr int value = EXACT ? EM_PHASE2_ROWS_PER_TEAM : EM_PHASE2_ROWS_PER_TEAM_ACCURATE;
};

// Activations in exact mode: codes [rows][cols], scales and code sums [rows][cols/32]. `rows[t]`
// is the activation row of token slot t (input row in phase 1, pair index in phase 2).
template <bool COHERENT>
struct ActQ8 {
    const int8_t* q;
    const float* d;
    const int32_t* qsum;
    uint32_t cols;
    uint32_t rows[EM_DECODE_TOKENS];

    // rows[t] for a run-time t, without indexing (which would put the array in scratch memory).
    __device__ uint32_t row_of(uint32_t t) const {
        uint32_t row = rows[0];
        EM_UNROLL
        for (int j = 1; j < EM_DECODE_TOKENS; ++j) row = t == (uint32_t)j ? rows[j] : row;
        return row;
    }

    __device__ void load(int t, uint32_t b, uint32_t* out, float* dd, int32_t* qs) const {
        const uint64_t row = rows[t];
        const int8_t* p = q + row * cols + (uint64_t)b * EM_BLOCK;
        const uint64_t bi = row * (cols / EM_BLOCK) + b;
        em_u32x4 lo, hi;
        if (COHERENT) {
            lo = em_load_coherent16(p);
            hi = em_load_coherent16(p + 16);
            *dd = em_load_coherent_f32(d + bi);
            *qs = em_load_coherent_i32(qsum + bi);
        } else {
            lo = *(const em_u32x4*)p;
            hi = *(const em_u32x4*)(p + 16);
            *dd = d[bi];
            *qs = qsum[bi];
        }
        for (int i = 0; i < 4; ++i) {
            out[i] = lo.v[i];
            out[4 + i] = hi.v[i];
        }
    }
};

// Activations in accurate mode: f32 [rows][cols].
template <bool COHERENT>
struct ActF32 {
    const float* x;
    uint32_t cols;
    uint32_t rows[EM_DECODE_TOKENS];

    __device__ void load_f32x4(int t, uint32_t b, int c, float* out) const {
        const float* p = x + (uint64_t)rows[t] * cols + (uint64_t)b * EM_BLOCK + 4 * c;
        const em_u32x4 v = COHERENT ? em_load_coherent16(p) : *(const em_u32x4*)p;
        for (int j = 0; j < 4; ++j) out[j] = em_bits_f32(v.v[j]);
    }
};

// One pass of a lane's K loop over the EM_DECODE_TOKENS token slots of a group. With
// EM_SINGLE_TOKEN_PASS, a pass holding one real token (the common decode case: one token per
// expert) runs the one-token loop, half the arithmetic, and copies its partials into the clamped
// slot: the same bits, since a row's result does not depend on T (em_contract.h).
template <bool EXACT, int R, class Act>
__device__ void lane_pass(const EmMatView& m, const uint32_t* rows, uint32_t lane, const Act& act, uint32_t real,
                          float (*P)[EM_DECODE_TOKENS]) {
#if EM_SINGLE_TOKEN_PASS
    if (real == 1) {
        float P1[R][1];
        for (int r = 0; r < R; ++r) P1[r][0] = 0.0f;
        if constexpr (EXACT)
            em_exact_lane_accumulate<R, 1>(m, rows, lane, act, P1);
        else
            em_accurate_lane_accumulate<R, 1>(m, rows, lane, act, P1);
        for (int r = 0; r < R; ++r)
            for (int t = 0; t < EM_DECODE_TOKENS; ++t) P[r][t] = P[r][t] + P1[r][0];
        return;
    }
#else
    (void)real;
#endif
    if constexpr (EXACT)
        em_exact_lane_accumulate<R, EM_DECODE_TOKENS>(m, rows, lane, act, P);
    else
        em_accurate_lane_accumulate<R, EM_DECODE_TOKENS>(m, rows, lane, act, P);
}

struct DecodeShared {
    uint32_t item;
    float rows[EM_TILE_ROWS * EM_PHASE1_TILES_MAX][EM_DECODE_TOKENS];  // phase-1 row results of the item
    float h[EM_DECODE_TOKENS][EM_BLOCK * EM_PHASE1_TILES_MAX];
#if EM_STAGE_ACT
    // Exact mode: the pass's activation rows (x in phase 1, h in phase 2), copied once per pass so
    // the K loop reads them from LDS instead of waiting on L2 every block.
    em_u32x4 xq[EM_DECODE_TOKENS][EM_STAGE_COLS / 16];
    float xd[EM_DECODE_TOKENS][EM_STAGE_COLS / EM_BLOCK];
    int32_t xqsum[EM_DECODE_TOKENS][EM_STAGE_COLS / EM_BLOCK];
#endif
};

#if EM_STAGE_ACT
// The activations of a pass, read from DecodeShared (filled by stage_act).
struct ActQ8Staged {
    const DecodeShared* sh;

    __device__ void load(int t, uint32_t b, uint32_t* out, float* dd, int32_t* qs) const {
        const em_u32x4 lo = sh->xq[t][2 * b], hi = sh->xq[t][2 * b + 1];
        for (int i = 0; i < 4; ++i) {
            out[i] = lo.v[i];
            out[4 + i] = hi.v[i];
        }
        *dd = sh->xd[t][b];
        *qs = sh->xqsum[t][b];
    }
};

// Copies the first `tokens` activation rows of `act` into `sh` (the whole workgroup; barriers
// before, so the previous pass's readers are done, and after). Needs act.cols <= EM_STAGE_COLS.
template <bool COHERENT>
__device__ void stage_act(DecodeShared& sh, const ActQ8<COHERENT>& act, uint32_t tokens) {
    const uint32_t tid = em_tid();
    const uint32_t chunks = act.cols / 16;
    const uint32_t nb = act.cols / EM_BLOCK;
    em_sync();
    for (uint32_t i = tid; i < tokens * chunks; i += EM_WG_THREADS) {
        const uint32_t t = i / chunks, k = i % chunks;
        const int8_t* p = act.q + (uint64_t)act.row_of(t) * act.cols + (uint64_t)k * 16;
        sh.xq[t][k] = COHERENT ? em_load_coherent16(p) : *(const em_u32x4*)p;
    }
    for (uint32_t i = tid; i < tokens * nb; i += EM_WG_THREADS) {
        const uint32_t t = i / nb, b = i % nb;
        const uint64_t bi = (uint64_t)act.row_of(t) * nb + b;
        sh.xd[t][b] = COHERENT ? em_load_coherent_f32(act.d + bi) : act.d[bi];
        sh.xqsum[t][b] = COHERENT ? em_load_coherent_i32(act.qsum + bi) : act.qsum[bi];
    }
    em_sync();
}
#endif

// An exact-mode pass: from LDS when the rows fit (EM_STAGE_ACT), else straight from memory.
template <int R, bool COHERENT>
__device__ void exact_pass(DecodeShared& sh, const EmMatView& m, const uint32_t* rows, uint32_t lane,
                           const ActQ8<COHERENT>& act, uint32_t real, float (*P)[EM_DECODE_TOKENS]) {
#if EM_STAGE_ACT
    if (act.cols <= EM_STAGE_COLS) {
        stage_act(sh, act, EM_SINGLE_TOKEN_PASS && real == 1 ? 1u : (uint32_t)EM_DECODE_TOKENS);
        lane_pass<true, R>(m, rows, lane, ActQ8Staged{&sh}, real, P);
        return;
    }
#else
    (void)sh;
#endif
    lane_pass<true, R>(m, rows, lane, act, real, P);
}

// Phase 1: W13 tile `tile` of group g -> one 32-block of h for every token of the group.
template <bool EXACT>
__device__ void phase1(const EmFfnArgs& a, DecodeShared& sh, uint32_t g, uint32_t item_tile) {
    constexpr int TT = EM_DECODE_TOKENS;
    constexpr int K = Phase1Tiles<EXACT>::value;
    constexpr int R = EM_ROWS_PER_TEAM * K;
    const uint32_t tid = em_tid();
    const uint32_t team = tid / EM_LANES;
    const uint32_t lane = tid % EM_LANES;
    const EmGroup grp = a.groups[g];
    const EmMatView m = em_view(a.shape, a.experts[grp.expert_slot], 0);
    const uint32_t F = a.shape.inter;
    const uint32_t tiles1 = F / EM_BLOCK;
    const uint32_t first = item_tile * K;  // this item's first 64-row tile
    const uint32_t ntiles = tiles1 - first < (uint32_t)K ? tiles1 - first : (uint32_t)K;
    // Row r of a team lies in the item's tile r / EM_ROWS_PER_TEAM; rows of a tile past the end
    // (odd tile counts) read the last row and their results are dropped.
    uint32_t rows[R];
    for (int r = 0; r < R; ++r) {
        const uint32_t row = first * EM_TILE_ROWS + team + EM_TEAMS * r;
        rows[r] = row < 2 * F ? row : 2 * F - 1;
    }

    for (uint32_t c0 = 0; c0 < grp.pair_count; c0 += TT) {
        float P[R][TT];
        for (int r = 0; r < R; ++r)
            for (int t = 0; t < TT; ++t) P[r][t] = 0.0f;
        uint32_t act_rows[TT];
        for (int t = 0; t < TT; ++t) {
            const uint32_t c = c0 + t < grp.pair_count ? c0 + t : grp.pair_count - 1;
            act_rows[t] = a.pair_token[grp.pair_begin + c];
        }
        const uint32_t real = grp.pair_count - c0 < (uint32_t)TT ? grp.pair_count - c0 : (uint32_t)TT;
        if (EXACT) {
            ActQ8<false> act{a.xq, a.xd, a.xqsum, a.shape.hidden, {}};
            for (int t = 0; t < TT; ++t) act.rows[t] = act_rows[t];
            exact_pass<R>(sh, m, rows, lane, act, real, P);
        } else {
            ActF32<false> act{a.x, a.shape.hidden, {}};
            for (int t = 0; t < TT; ++t) act.rows[t] = act_rows[t];
            lane_pass<false, R>(m, rows, lane, act, real, P);
        }
        for (int r = 0; r < R; ++r)
            for (int t = 0; t < TT; ++t) P[r][t] = em_tree16(P[r][t]);
        if (lane == 0) {
            for (int r = 0; r < R; ++r)
                for (int t = 0; t < TT; ++t) sh.rows[team + EM_TEAMS * r][t] = P[r][t];
        }
        em_sync();
        // Tile k's local h index j (0..31) has its gate row at k·64 + em_w13_row(0, j) and its up
        // row at k·64 + em_w13_row(1, j) (every tile starts on a chunk boundary).
        for (uint32_t i = tid; i < (uint32_t)(TT * K * EM_BLOCK); i += EM_WG_THREADS) {
            const uint32_t t = i / (K * EM_BLOCK);
            const uint32_t kj = i % (K * EM_BLOCK);
            const uint32_t k = kj / EM_BLOCK, j = kj % EM_BLOCK;
            if (k < ntiles)
                sh.h[t][kj] = em_swiglu(sh.rows[k * EM_TILE_ROWS + em_w13_row(0, j)][t],
                                        sh.rows[k * EM_TILE_ROWS + em_w13_row(1, j)][t]);
        }
        em_sync();
        if (EXACT) {
            const uint32_t t = tid / K, k = tid % K;
            if (tid < (uint32_t)(TT * K) && c0 + t < grp.pair_count && k < ntiles) {
                const uint64_t p = grp.pair_begin + c0 + t;
                const uint32_t blk = first + k;
                int8_t q[EM_BLOCK];
                int32_t qs;
                const float d = em_quantize_block(sh.h[t] + k * EM_BLOCK, q, &qs);
                em_u32x4 lo, hi;
                memcpy(&lo, q, 16);
                memcpy(&hi, q + 16, 16);
                int8_t* dst = a.hq + p * F + (uint64_t)blk * EM_BLOCK;
                *(em_u32x4*)dst = lo;
                *(em_u32x4*)(dst + 16) = hi;
                a.hd[p * (F / EM_BLOCK) + blk] = d;
                a.hqsum[p * (F / EM_BLOCK) + blk] = qs;
            }
        } else {
            for (uint32_t i = tid; i < (uint32_t)(TT * K * EM_BLOCK); i += EM_WG_THREADS) {
                const uint32_t t = i / (K * EM_BLOCK);
                const uint32_t kj = i % (K * EM_BLOCK);
                if (c0 + t < grp.pair_count && kj / EM_BLOCK < ntiles) {
                    const uint64_t p = grp.pair_begin + c0 + t;
                    a.hf[p * F + (uint64_t)first * EM_BLOCK + kj] = sh.h[t][kj];
                }
            }
        }
        em_sync();
    }
    // Release this item's h blocks to phase-2 workgroups: every writer fences, then one counter
    // bump per 64-row tile.
    em_fence_agent();
    em_sync();
    if (tid == 0) {
        em_fence_agent();
        em_atomic_add_agent(&a.counters[EM_COUNTER_GROUP_BASE + g], ntiles);
    }
}
template <bool EXACT>
__device__ void phase2(const EmFfnArgs& a, DecodeShared& sh, uint32_t g, uint32_t tile, bool wait) {
    constexpr int TT = EM_DECODE_TOKENS;
    const uint32_t tid = em_tid();
    const uint32_t team = tid / EM_LANES;
    const uint32_t lane = tid % EM_LANES;
    const uint32_t H = a.shape.hidden;
    const uint32_t F = a.shape.inter;
    if (wait) {
        if (tid == 0) {
            const uint32_t tiles1 = F / EM_BLOCK;
            uint32_t polls = 0;
            while (em_load_relaxed_agent(&a.counters[EM_COUNTER_GROUP_BASE + g]) < tiles1) {
                if (++polls > a.spin_limit) {
                    em_atomic_or_agent(&a.counters[EM_COUNTER_STATUS], EM_STATUS_WAIT_TIMEOUT);
                    break;
                }
                em_sleep();
            }
            em_fence_agent();
        }
        em_sync();
        em_fence_agent();
    }
    const EmGroup grp = a.groups[g];
    const EmMatView m = em_view(a.shape, a.experts[grp.expert_slot], 1);
    constexpr int R = Phase2Rows<EXACT>::value;
    uint32_t rows[R];
    bool valid[R];
    for (int r = 0; r < R; ++r) {
        const uint32_t row = tile * (EM_TEAMS * R) + team + EM_TEAMS * r;
        valid[r] = row < H;
        rows[r] = valid[r] ? row : H - 1;
    }
    for (uint32_t c0 = 0; c0 < grp.pair_count; c0 += TT) {
        float P[R][TT];
        for (int r = 0; r < R; ++r)
            for (int t = 0; t < TT; ++t) P[r][t] = 0.0f;
        uint32_t pairs[TT];
        for (int t = 0; t < TT; ++t) {
            const uint32_t c = c0 + t < grp.pair_count ? c0 + t : grp.pair_count - 1;
            pairs[t] = grp.pair_begin + c;
        }
        const uint32_t real = grp.pair_count - c0 < (uint32_t)TT ? grp.pair_count - c0 : (uint32_t)TT;
        if (EXACT) {
            ActQ8<true> act{a.hq, a.hd, a.hqsum, F, {}};
            for (int t = 0; t < TT; ++t) act.rows[t] = pairs[t];
            exact_pass<R>(sh, m, rows, lane, act, real, P);
        } else {
            ActF32<true> act{a.hf, F, {}};
            for (int t = 0; t < TT; ++t) act.rows[t] = pairs[t];
            lane_pass<false, R>(m, rows, lane, act, real, P);
        }
        for (int r = 0; r < R; ++r)
            for (int t = 0; t < TT; ++t) P[r][t] = em_tree16(P[r][t]);
        if (lane == 0) {
            for (int t = 0; t < TT; ++t) {
                if (c0 + t >= grp.pair_count) continue;
                const uint64_t out_row = a.pair_out[pairs[t]];
                for (int r = 0; r < R; ++r)
                    if (valid[r]) a.y[out_row * H + rows[r]] = P[r][t];
            }
        }
    }
}

template <bool EXACT>
__device__ void decode_main(const EmFfnArgs& a) {
    __shared__ DecodeShared sh;
    const uint32_t tid = em_tid();
    constexpr uint32_t K = Phase1Tiles<EXACT>::value, rows2 = EM_TEAMS * Phase2Rows<EXACT>::value;
    const uint32_t per_group1 = (a.shape.inter / EM_BLOCK + K - 1) / K;
    const uint32_t tiles2 = (a.shape.hidden + rows2 - 1) / rows2;
    const uint32_t items1 = a.first_phase == 1 ? a.num_groups * per_group1 : 0;
    const uint32_t items2 = a.last_phase == 2 ? a.num_groups * tiles2 : 0;
    const bool wait = a.first_phase == 1 && a.last_phase == 2;
#if EM_ITEM_PREFETCH
    // The next item is taken while this one runs, so the counter's round trip is off the
    // critical path. Still deadlock-free: a prefetched phase-1 item is held by a workgroup whose
    // current item is earlier, hence phase 1, which never waits.
    if (tid == 0) sh.item = em_atomic_add_agent(&a.counters[EM_COUNTER_NEXT_ITEM], 1);
    em_sync();
#endif
    for (;;) {
#if !EM_ITEM_PREFETCH
        if (tid == 0) sh.item = em_atomic_add_agent(&a.counters[EM_COUNTER_NEXT_ITEM], 1);
        em_sync();
#endif
        const uint32_t item = sh.item;
        em_sync();
        if (item >= items1 + items2) return;
#if EM_ITEM_PREFETCH
        uint32_t next = 0;
        if (tid == 0) next = em_atomic_add_agent(&a.counters[EM_COUNTER_NEXT_ITEM], 1);
#endif
        if (item < items1) {
            phase1<EXACT>(a, sh, item / per_group1, item % per_group1);
        } else {
            const uint32_t i2 = item - items1;
            phase2<EXACT>(a, sh, i2 / tiles2, i2 % tiles2, wait);
        }
#if EM_ITEM_PREFETCH
        if (tid == 0) sh.item = next;
        em_sync();
#endif
    }
}

}  // namespace

EM_KERNEL void em_decode_exact(EmFfnArgs a) { decode_main<true>(a); }

EM_KERNEL void em_decode_accurate(EmFfnArgs a) { decode_main<false>(a); }
