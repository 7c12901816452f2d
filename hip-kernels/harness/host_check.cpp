// host_check.cpp — the kernels' arithmetic on the CPU, checked bit for bit against the Rust
// reference's test vectors. Built with plain g++ by `cargo test` (hip-kernels/tests/kernel_host.rs).
//
// Why this exists: it is the only verification of the HIP kernels' numerics available on machines
// without a GPU. It compiles em_contract.h (the functions the kernels call) and em_host_sim.h (the
// kernels' decomposition) for the host and checks, per case of an EMTV file:
//   quant     contract §1 codes and scales of x        == Rust (bits)
//   decode    exact decode-kernel decomposition        == Rust expert_ffn_exact (bits)
//   prefill   exact prefill-kernel decomposition        == Rust expert_ffn_exact (bits)
//   combine   pre-combined output                       == Rust (bits)
//   accurate  accurate decode decomposition within EM_ACCURATE_REL_TOL of the f64 reference
// plus the post-order tree against the butterfly on random partials.
//
// Usage: host_check FILE.emtv     (exit 0 iff every check passes)
//        host_check --abi         (prints the argument-block layout for the Rust ABI test)
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "em_host_sim.h"

#define ABI_FIELD(S, F) printf("%s %s %zu\n", #S, #F, offsetof(S, F))
#define ABI_SIZE(S) printf("%s sizeof %zu\n", #S, sizeof(S))

static void print_abi() {
    ABI_FIELD(EmExpertPtrs, w13_nibbles); ABI_FIELD(EmExpertPtrs, w13_scales);
    ABI_FIELD(EmExpertPtrs, w13_zeros); ABI_FIELD(EmExpertPtrs, w2_nibbles);
    ABI_FIELD(EmExpertPtrs, w2_scales); ABI_FIELD(EmExpertPtrs, w2_zeros); ABI_SIZE(EmExpertPtrs);
    ABI_FIELD(EmGroup, expert_slot); ABI_FIELD(EmGroup, pair_begin); ABI_FIELD(EmGroup, pair_count);
    ABI_FIELD(EmGroup, reserved); ABI_SIZE(EmGroup);
    ABI_FIELD(EmShape, hidden); ABI_FIELD(EmShape, inter); ABI_FIELD(EmShape, group_shift);
    ABI_FIELD(EmShape, scale_is_bf16); ABI_SIZE(EmShape);
    ABI_FIELD(EmFfnArgs, experts); ABI_FIELD(EmFfnArgs, groups); ABI_FIELD(EmFfnArgs, pair_token);
    ABI_FIELD(EmFfnArgs, pair_out); ABI_FIELD(EmFfnArgs, xq); ABI_FIELD(EmFfnArgs, xd);
    ABI_FIELD(EmFfnArgs, xqsum); ABI_FIELD(EmFfnArgs, x); ABI_FIELD(EmFfnArgs, hq);
    ABI_FIELD(EmFfnArgs, hd); ABI_FIELD(EmFfnArgs, hqsum); ABI_FIELD(EmFfnArgs, hf);
    ABI_FIELD(EmFfnArgs, y); ABI_FIELD(EmFfnArgs, counters); ABI_FIELD(EmFfnArgs, shape);
    ABI_FIELD(EmFfnArgs, num_groups); ABI_FIELD(EmFfnArgs, first_phase);
    ABI_FIELD(EmFfnArgs, last_phase); ABI_FIELD(EmFfnArgs, spin_limit);
    ABI_FIELD(EmFfnArgs, prefill_items); ABI_FIELD(EmFfnArgs, num_prefill_items);
    ABI_FIELD(EmFfnArgs, reserved); ABI_SIZE(EmFfnArgs);
    ABI_FIELD(EmQuantArgs, x); ABI_FIELD(EmQuantArgs, q); ABI_FIELD(EmQuantArgs, d);
    ABI_FIELD(EmQuantArgs, qsum); ABI_FIELD(EmQuantArgs, tokens); ABI_FIELD(EmQuantArgs, hidden);
    ABI_FIELD(EmQuantArgs, counters); ABI_FIELD(EmQuantArgs, counters_len); ABI_FIELD(EmQuantArgs, reserved);
    ABI_SIZE(EmQuantArgs);
    ABI_FIELD(EmCombineArgs, y); ABI_FIELD(EmCombineArgs, tok_ptr); ABI_FIELD(EmCombineArgs, tok_rows);
    ABI_FIELD(EmCombineArgs, tok_weights); ABI_FIELD(EmCombineArgs, out); ABI_FIELD(EmCombineArgs, tokens);
    ABI_FIELD(EmCombineArgs, hidden); ABI_SIZE(EmCombineArgs);
}

// Number of elements whose bits differ; reports the first.
static size_t bit_mismatches(const char* what, size_t ci, const float* got, const float* want, size_t n) {
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
        if (em_f32_bits(got[i]) != em_f32_bits(want[i])) {
            if (bad == 0)
                printf("  case %zu %s: first mismatch at %zu: got %.9g (0x%08x) want %.9g (0x%08x)\n", ci, what, i,
                       got[i], em_f32_bits(got[i]), want[i], em_f32_bits(want[i]));
            ++bad;
        }
    }
    return bad;
}

static bool tree_selftest() {
    uint64_t s = 12345;
    for (int trial = 0; trial < 1000; ++trial) {
        float p[EM_LANES];
        for (int l = 0; l < EM_LANES; ++l) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            // Mixed magnitudes so that association order changes the result.
            const float mag = (s >> 40) & 1 ? 1e8f : 1.0f;
            p[l] = mag * (float)((int32_t)(s >> 33) % 100000) * 1e-3f;
        }
        float stack[5];
        for (int i = 0; i < EM_LANES; ++i) em_tree16_push(stack, i, p[em_tree16_postorder_lane(i)]);
        if (em_f32_bits(stack[0]) != em_f32_bits(em_tree16_host(p))) return false;
    }
    return true;
}

int main(int argc, char** argv) {
    if (argc == 2 && strcmp(argv[1], "--abi") == 0) {
        print_abi();
        return 0;
    }
    if (argc != 2) {
        fprintf(stderr, "usage: host_check FILE.emtv | --abi\n");
        return 2;
    }
    std::vector<EmVecCase> cases;
    std::string err;
    if (!em_read_vectors(argv[1], cases, err)) {
        fprintf(stderr, "host_check: %s\n", err.c_str());
        return 2;
    }
    int passed = 0, failed = 0;
    auto report = [&](bool ok, const char* what, size_t ci, const char* detail) {
        printf("%s %-9s case %zu %s\n", ok ? "PASS" : "FAIL", what, ci, detail);
        (ok ? passed : failed)++;
    };
    report(tree_selftest(), "tree", 0, "post-order stack == butterfly (1000 random trials)");
    for (size_t ci = 0; ci < cases.size(); ++ci) {
        const EmVecCase& c = cases[ci];
        char detail[256];
        snprintf(detail, sizeof detail, "(H %u, F %u, g%u %s%s, %zu experts, %u tokens, %u pairs)", c.hidden, c.inter,
                 c.group_size, c.scale_bf16 ? "bf16" : "f16", c.zero_points ? " zp" : "", c.experts.size(), c.tokens,
                 c.pairs);
        std::vector<int8_t> q;
        std::vector<float> d;
        std::vector<int32_t> qs;
        em_host_quantize(c.x.data(), c.tokens, c.hidden, q, d, qs);
        bool ok = q == c.xq && bit_mismatches("quant d", ci, d.data(), c.xd.data(), d.size()) == 0;
        report(ok, "quant", ci, detail);

        std::vector<float> y;
        em_host_run_case(c, true, EmPath::Decode, y);
        report(bit_mismatches("decode", ci, y.data(), c.y_exact.data(), y.size()) == 0, "decode", ci, detail);

        std::vector<float> combined;
        em_host_combine(c, y, combined);
        report(bit_mismatches("combine", ci, combined.data(), c.y_combined.data(), combined.size()) == 0, "combine",
               ci, detail);

        std::vector<float> yp;
        em_host_run_case(c, true, EmPath::Prefill, yp);
        report(bit_mismatches("prefill", ci, yp.data(), c.y_exact.data(), yp.size()) == 0, "prefill", ci, detail);

        std::vector<float> ya;
        em_host_run_case(c, false, EmPath::Decode, ya);
        const double e = em_accurate_error(ya.data(), c.y_f64.data(), c.pairs, c.hidden);
        char adetail[320];
        snprintf(adetail, sizeof adetail, "%s err %.3g (tol %.1g)", detail, e, EM_ACCURATE_REL_TOL);
        report(e <= EM_ACCURATE_REL_TOL, "accurate", ci, adetail);
    }
    printf("host-check: %d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
