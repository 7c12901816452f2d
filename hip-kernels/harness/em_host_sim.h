// em_host_sim.h — the decode and prefill kernels' work decomposition, executed sequentially on
// the host with the kernels' own arithmetic (em_contract.h).
//
// Why this exists: no machine here has a GPU, so the kernels' numerics are verified by running
// the same functions the kernels call, in the same decomposition (64-row tiles, 32 teams of 16
// lanes with 2 rows each, token passes of EM_DECODE_TOKENS with clamped padding, the xor tree;
// the prefill kernel's post-order partials), and comparing with the Rust reference bit for bit.
// The GPU harness reuses it to localize a mismatch (host simulation vs device).
#ifndef EM_HOST_SIM_H
#define EM_HOST_SIM_H

#include <vector>

#include "../kernels/em_abi.h"
#include "../kernels/em_contract.h"
#include "em_vectors.h"

// Activations for the lane accumulators, reading host arrays.
template <int T>
struct EmHostActQ8 {
    const int8_t* q;
    const float* d;
    const int32_t* qsum;
    uint32_t cols;
    uint32_t rows[T];
    EM_HD void load(int t, uint32_t b, uint32_t* out, float* dd, int32_t* qs) const {
        memcpy(out, q + (uint64_t)rows[t] * cols + (uint64_t)b * EM_BLOCK, 32);
        *dd = d[(uint64_t)rows[t] * (cols / EM_BLOCK) + b];
        *qs = qsum[(uint64_t)rows[t] * (cols / EM_BLOCK) + b];
    }
};

template <int T>
struct EmHostActF32 {
    const float* x;
    uint32_t cols;
    uint32_t rows[T];
    EM_HD void load_f32x4(int t, uint32_t b, int c, float* out) const {
        memcpy(out, x + (uint64_t)rows[t] * cols + (uint64_t)b * EM_BLOCK + 4 * c, 16);
    }
};

// Quantize [rows][cols] f32 per contract §1 into codes, scales and code sums.
inline void em_host_quantize(const float* x, size_t rows, size_t cols, std::vector<int8_t>& q,
                             std::vector<float>& d, std::vector<int32_t>& qs) {
    q.assign(rows * cols, 0);
    d.assign(rows * cols / EM_BLOCK, 0.0f);
    qs.assign(rows * cols / EM_BLOCK, 0);
    for (size_t i = 0; i < rows * cols / EM_BLOCK; ++i)
        d[i] = em_quantize_block(x + i * EM_BLOCK, q.data() + i * EM_BLOCK, &qs[i]);
}

// One matrix pass of the decode kernel for one group: rows of `m` × the group's tokens, in the
// kernel's decomposition. act_rows[c] = activation row of the group's c-th pair. Results go to
// out[c][row].
template <bool EXACT>
inline void em_host_decode_matrix(const EmMatView& m, const std::vector<uint32_t>& act_rows,
                                  const int8_t* q, const float* d, const int32_t* qs, const float* x,
                                  std::vector<std::vector<float>>& out) {
    constexpr int TT = EM_DECODE_TOKENS;
    const uint32_t count = (uint32_t)act_rows.size();
    out.assign(count, std::vector<float>(m.rows, 0.0f));
    const uint32_t tiles = (m.rows + EM_TILE_ROWS - 1) / EM_TILE_ROWS;
    for (uint32_t tile = 0; tile < tiles; ++tile) {
        for (uint32_t c0 = 0; c0 < count; c0 += TT) {
            for (uint32_t team = 0; team < EM_TEAMS; ++team) {
                uint32_t rows[EM_ROWS_PER_TEAM];
                bool valid[EM_ROWS_PER_TEAM];
                for (int r = 0; r < EM_ROWS_PER_TEAM; ++r) {
                    const uint32_t row = tile * EM_TILE_ROWS + team + EM_TEAMS * r;
                    valid[r] = row < m.rows;
                    rows[r] = valid[r] ? row : m.rows - 1;
                }
                float lanes[EM_LANES][EM_ROWS_PER_TEAM][TT];
                for (uint32_t lane = 0; lane < EM_LANES; ++lane) {
                    float(*P)[TT] = lanes[lane];
                    for (int r = 0; r < EM_ROWS_PER_TEAM; ++r)
                        for (int t = 0; t < TT; ++t) P[r][t] = 0.0f;
                    if (EXACT) {
                        EmHostActQ8<TT> act{q, d, qs, m.cols, {}};
                        for (int t = 0; t < TT; ++t) act.rows[t] = act_rows[c0 + t < count ? c0 + t : count - 1];
                        em_exact_lane_accumulate<EM_ROWS_PER_TEAM, TT>(m, rows, lane, act, P);
                    } else {
                        EmHostActF32<TT> act{x, m.cols, {}};
                        for (int t = 0; t < TT; ++t) act.rows[t] = act_rows[c0 + t < count ? c0 + t : count - 1];
                        em_accurate_lane_accumulate<EM_ROWS_PER_TEAM, TT>(m, rows, lane, act, P);
                    }
                }
                for (int r = 0; r < EM_ROWS_PER_TEAM; ++r) {
                    for (int t = 0; t < TT; ++t) {
                        float part[EM_LANES];
                        for (int l = 0; l < EM_LANES; ++l) part[l] = lanes[l][r][t];
                        if (valid[r] && c0 + t < count) out[c0 + t][rows[r]] = em_tree16_host(part);
                    }
                }
            }
        }
    }
}

// The prefill kernel's order for one (row, activation row): partials computed one after another
// in tree post-order and folded on a stack.
inline float em_host_prefill_row(const EmMatView& m, uint32_t row, const int8_t* q, const float* d,
                                 const int32_t* qs, uint32_t act_row) {
    const uint32_t nblocks = m.cols / EM_BLOCK;
    float stack[5];
    for (int i = 0; i < EM_LANES; ++i) {
        const uint32_t l = em_tree16_postorder_lane(i);
        float part = 0.0f;
        for (uint32_t b = l; b < nblocks; b += EM_LANES) {
            const EmRowBlock rb = em_load_row_block(m, row, b);
            const EmRowTerms rt = em_row_terms(m, rb, b);
            uint32_t qw[8];
            memcpy(qw, q + (uint64_t)act_row * m.cols + (uint64_t)b * EM_BLOCK, 32);
            const uint64_t bi = (uint64_t)act_row * nblocks + b;
            // The matrix unit computes Σ u·q; the zero point is applied afterwards, as here.
            const int32_t isum = em_block_isum(rb.w, qw, 0, 0) - rt.z * qs[bi];
            part = part + em_block_term(rt.s, d[bi], isum);
        }
        em_tree16_push(stack, i, part);
    }
    return stack[0];
}

enum class EmPath { Decode, Prefill };

// Runs a whole case through the simulated kernels. Exact mode fills y (per slot, by output
// row); accurate mode (decode path only) fills y too.
inline void em_host_run_case(const EmVecCase& c, bool exact, EmPath path, std::vector<float>& y) {
    const uint32_t H = c.hidden, F = c.inter;
    y.assign((size_t)c.pairs * H, 0.0f);
    std::vector<int8_t> xq;
    std::vector<float> xd;
    std::vector<int32_t> xqs;
    em_host_quantize(c.x.data(), c.tokens, H, xq, xd, xqs);
    for (size_t g = 0; g < c.groups.size(); ++g) {
        const EmVecGroup grp = c.groups[g];
        if (grp.count == 0) continue;
        const uint32_t begin = c.pair_begin(g);
        const EmVecExpert& e = c.experts[grp.expert];
        const EmMatView w13 = em_host_view(c, e.w13), w2 = em_host_view(c, e.w2);
        std::vector<uint32_t> tok(grp.count), local(grp.count);
        for (uint32_t i = 0; i < grp.count; ++i) {
            tok[i] = c.pair_token[begin + i];
            local[i] = i;
        }
        // Phase 1: W13 row results, then silu·mul per the interleave.
        std::vector<std::vector<float>> r13(grp.count, std::vector<float>(2 * F));
        if (path == EmPath::Decode) {
            if (exact)
                em_host_decode_matrix<true>(w13, tok, xq.data(), xd.data(), xqs.data(), nullptr, r13);
            else
                em_host_decode_matrix<false>(w13, tok, nullptr, nullptr, nullptr, c.x.data(), r13);
        } else {
            for (uint32_t i = 0; i < grp.count; ++i)
                for (uint32_t row = 0; row < 2 * F; ++row)
                    r13[i][row] = em_host_prefill_row(w13, row, xq.data(), xd.data(), xqs.data(), tok[i]);
        }
        std::vector<float> h((size_t)grp.count * F);
        for (uint32_t i = 0; i < grp.count; ++i)
            for (uint32_t f = 0; f < F; ++f)
                h[(size_t)i * F + f] = em_swiglu(r13[i][em_w13_row(0, f)], r13[i][em_w13_row(1, f)]);
        // Phase 2.
        std::vector<std::vector<float>> r2;
        if (exact) {
            std::vector<int8_t> hq;
            std::vector<float> hd;
            std::vector<int32_t> hqs;
            em_host_quantize(h.data(), grp.count, F, hq, hd, hqs);
            if (path == EmPath::Decode) {
                em_host_decode_matrix<true>(w2, local, hq.data(), hd.data(), hqs.data(), nullptr, r2);
            } else {
                r2.assign(grp.count, std::vector<float>(H));
                for (uint32_t i = 0; i < grp.count; ++i)
                    for (uint32_t row = 0; row < H; ++row)
                        r2[i][row] = em_host_prefill_row(w2, row, hq.data(), hd.data(), hqs.data(), i);
            }
        } else {
            em_host_decode_matrix<false>(w2, local, nullptr, nullptr, nullptr, h.data(), r2);
        }
        for (uint32_t i = 0; i < grp.count; ++i) {
            const uint32_t out_row = c.pair_out[begin + i];
            for (uint32_t n = 0; n < H; ++n) y[(size_t)out_row * H + n] = r2[i][n];
        }
    }
}

// Contract §5 on one device: each token's pairs in increasing output row, from +0.
inline void em_host_combine(const EmVecCase& c, const std::vector<float>& y, std::vector<float>& out) {
    const uint32_t H = c.hidden;
    out.assign((size_t)c.tokens * H, 0.0f);
    for (uint32_t t = 0; t < c.tokens; ++t) {
        std::vector<std::pair<uint32_t, float>> list;
        for (uint32_t p = 0; p < c.pairs; ++p)
            if (c.pair_token[p] == t) list.push_back({c.pair_out[p], c.pair_weight[p]});
        for (size_t i = 1; i < list.size(); ++i)  // insertion sort by output row
            for (size_t j = i; j > 0 && list[j - 1].first > list[j].first; --j) std::swap(list[j - 1], list[j]);
        for (uint32_t n = 0; n < H; ++n) {
            float acc = 0.0f;
            for (auto& pr : list) acc = em_combine_step(acc, pr.second, y[(size_t)pr.first * H + n]);
            out[(size_t)t * H + n] = acc;
        }
    }
}

#endif  // EM_HOST_SIM_H
