// matrix_emu_check.cpp — checks em_matrix_emu.h against AMD's own register layouts.
//
// Why this exists: the stand-in runs the prefill kernel's MFMA / WMMA branches through
// em_matrix_emulate; if its idea of where an element lives were wrong, a kernel with the same
// mistake would pass. Here the layouts come from AMD's matrix instruction calculator (the test
// hip-kernels/tests/it/standin.rs runs it and writes what it printed to stdin, one element per
// line), never from the emulator:
//
//   <op> <A|B|C|D> <row> <col> <lane> <slot>      (op: 0, 1, 2 = EmMatrixOp; slot: byte of the
//                                                  lane's operand for A/B, register for C/D;
//                                                  an element held by several lanes has a line each)
//
// For each instruction it checks (1) every coordinate's em_matrix_*_loc is a place the calculator
// names for it, and (2) with random A, B, C placed in the registers where the calculator puts them,
// the emulated D read back from where the calculator puts it equals A·B + C computed directly.
// Prints one PASS/FAIL line per instruction; exit 0 iff all pass and every instruction was given.
#include <stdint.h>

#include <cstdio>
#include <set>
#include <tuple>
#include <vector>

#include "em_matrix_emu.h"

struct Place {
    int lane, slot;
};

struct Layout {
    std::vector<Place> a[16][32], b[32][16], c[16][16], d[16][16];
    int entries = 0;
};

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t next_u32() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static bool has(const std::vector<Place>& ps, EmMatrixLoc l) {
    for (const Place& p : ps)
        if (p.lane == l.lane && p.slot == l.slot) return true;
    return false;
}

static int check(EmMatrixOp op, const Layout& L, const char* name) {
    const EmMatrixShape s = em_matrix_shape(op);
    int bad = 0;
    // (1) The emulator's layout functions name a place the calculator names.
    for (int i = 0; i < 16; ++i)
        for (int k = 0; k < s.k; ++k) {
            if (!has(L.a[i][k], em_matrix_a_loc(op, i, k))) {
                if (bad++ < 5) printf("  %s: A[%d][%d] not where the calculator puts it\n", name, i, k);
            }
            if (!has(L.b[k][i], em_matrix_b_loc(op, k, i))) {
                if (bad++ < 5) printf("  %s: B[%d][%d] not where the calculator puts it\n", name, k, i);
            }
        }
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 16; ++j) {
            if (!has(L.d[i][j], em_matrix_d_loc(op, i, j)) || !has(L.c[i][j], em_matrix_d_loc(op, i, j))) {
                if (bad++ < 5) printf("  %s: C/D[%d][%d] not where the calculator puts it\n", name, i, j);
            }
        }
    // (2) Registers filled per the calculator, D read per the calculator, against a direct product.
    for (int trial = 0; trial < 20; ++trial) {
        int8_t A[16][32], B[32][16];
        int32_t C[16][16];
        std::vector<uint8_t> ra(64 * 16, 0), rb(64 * 16, 0);
        std::vector<int32_t> rc(64 * 8, 0), rd(64 * 8, 0);
        for (int i = 0; i < 16; ++i)
            for (int k = 0; k < s.k; ++k) {
                A[i][k] = (int8_t)next_u32();
                B[k][i] = (int8_t)next_u32();
                for (const Place& p : L.a[i][k]) ra[p.lane * s.ab_bytes + p.slot] = (uint8_t)A[i][k];
                for (const Place& p : L.b[k][i]) rb[p.lane * s.ab_bytes + p.slot] = (uint8_t)B[k][i];
            }
        for (int i = 0; i < 16; ++i)
            for (int j = 0; j < 16; ++j) {
                C[i][j] = (int32_t)(next_u32() % 2000001) - 1000000;
                for (const Place& p : L.c[i][j]) rc[p.lane * s.cd_regs + p.slot] = C[i][j];
            }
        em_matrix_emulate(op, ra.data(), rb.data(), rc.data(), rd.data());
        for (int i = 0; i < 16; ++i)
            for (int j = 0; j < 16; ++j) {
                int64_t want = C[i][j];
                for (int k = 0; k < s.k; ++k) want += (int64_t)A[i][k] * B[k][j];
                for (const Place& p : L.d[i][j]) {
                    if (rd[p.lane * s.cd_regs + p.slot] != (int32_t)want) {
                        if (bad++ < 5)
                            printf("  %s: D[%d][%d] at lane %d reg %d is %d, A·B+C is %lld\n", name, i, j, p.lane,
                                   p.slot, rd[p.lane * s.cd_regs + p.slot], (long long)want);
                    }
                }
            }
    }
    printf("%s %s (%d layout entries from the calculator)\n", bad ? "FAIL" : "PASS", name, L.entries);
    return bad;
}

int main() {
    Layout layouts[3];
    int op, row, col, lane, slot;
    char m;
    while (scanf("%d %c %d %d %d %d", &op, &m, &row, &col, &lane, &slot) == 6) {
        if (op < 0 || op > 2 || row < 0 || col < 0 || row >= 32 || col >= 32 || lane < 0 || lane >= 64 || slot < 0 ||
            slot >= 16) {
            fprintf(stderr, "matrix_emu_check: bad line %d %c %d %d %d %d\n", op, m, row, col, lane, slot);
            return 2;
        }
        Layout& L = layouts[op];
        const Place p{lane, slot};
        switch (m) {
            case 'A': if (row < 16) L.a[row][col].push_back(p); break;
            case 'B': if (col < 16) L.b[row][col].push_back(p); break;
            case 'C': if (row < 16 && col < 16) L.c[row][col].push_back(p); break;
            case 'D': if (row < 16 && col < 16) L.d[row][col].push_back(p); break;
            default: fprintf(stderr, "matrix_emu_check: unknown matrix %c\n", m); return 2;
        }
        ++L.entries;
    }
    const char* names[3] = {"v_mfma_i32_16x16x16i8", "v_mfma_i32_16x16x32_i8", "v_wmma_i32_16x16x16_iu8"};
    int failed = 0;
    for (int o = 0; o < 3; ++o) {
        if (layouts[o].entries == 0) {
            printf("FAIL %s (no layout given)\n", names[o]);
            ++failed;
            continue;
        }
        failed += check((EmMatrixOp)o, layouts[o], names[o]) != 0;
    }
    return failed == 0 ? 0 : 1;
}
