// em_matrix_emu.h — host emulation of the integer matrix instructions the prefill kernel uses:
// v_mfma_i32_16x16x16i8 (CDNA1/2, wave64), v_mfma_i32_16x16x32_i8 (CDNA3, wave64) and
// v_wmma_i32_16x16x16_iu8 (RDNA3, wave32).
//
// Why this exists: the HIP-CPU stand-in (em_standin_branch.cpp) runs the prefill kernel's AMD
// branches on the host; there each matrix builtin becomes a call to one of these emulators over the
// registers of a whole wave. Where each matrix element lives (which lane, which byte or register)
// is written down once here, from AMD's ISA documents, in the `*_loc` functions; the emulator
// reads A and B and writes D only through them. The layouts are tested against AMD's matrix
// instruction calculator (../shared/third_party/amd-matrix-calculator) for every (row, k) and
// (row, col) coordinate by `matrix_emu_check.cpp` (hip-kernels/tests/it/standin.rs), so a layout
// error here cannot hide behind an emulator that agrees with itself.
//
// Plain C++17: no HIP, no AMD builtins.
#ifndef EM_MATRIX_EMU_H
#define EM_MATRIX_EMU_H

#include <stdint.h>

// Which instruction.
enum EmMatrixOp {
    EM_MFMA_I32_16X16X16I8 = 0,  // CDNA1/2: A, B 4 bytes per lane; C, D 4 registers per lane
    EM_MFMA_I32_16X16X32_I8 = 1,  // CDNA3: A, B 8 bytes per lane (a 64-bit register pair)
    EM_WMMA_I32_16X16X16_IU8 = 2,  // RDNA3: A, B 16 bytes per lane; C, D 8 registers per lane
};

// Where one element lives: `lane` of the wave and, for A and B, the byte of the lane's operand
// (byte 0 = bits 7:0 of its first register); for C and D, the register index.
struct EmMatrixLoc {
    int lane;
    int slot;
};

// Shape facts of an instruction.
struct EmMatrixShape {
    int wave;         // lanes
    int k;            // reduction depth
    int ab_bytes;     // operand bytes per lane for A and for B
    int cd_regs;      // 32-bit accumulator registers per lane
};

inline EmMatrixShape em_matrix_shape(EmMatrixOp op) {
    switch (op) {
        case EM_MFMA_I32_16X16X16I8: return {64, 16, 4, 4};
        case EM_MFMA_I32_16X16X32_I8: return {64, 32, 8, 4};
        default: return {32, 16, 16, 8};
    }
}

// A[i][k] (16 rows of M by K). CDNA (both): lane i + 16·(k / bytes), byte k % bytes: each group of
// 16 lanes holds the next `bytes` values of K for the 16 rows. RDNA3 WMMA: lane i, byte k (the 16
// values of K in 4 registers); lanes 16..31 hold a copy of lanes 0..15, and this returns the first.
inline EmMatrixLoc em_matrix_a_loc(EmMatrixOp op, int i, int k) {
    const EmMatrixShape s = em_matrix_shape(op);
    if (op == EM_WMMA_I32_16X16X16_IU8) return {i, k};
    return {i + 16 * (k / s.ab_bytes), k % s.ab_bytes};
}

// B[k][j] (K by 16 columns of N): the same layout as A with the column j in place of the row i.
inline EmMatrixLoc em_matrix_b_loc(EmMatrixOp op, int k, int j) { return em_matrix_a_loc(op, j, k); }

// D[i][j] and C[i][j]. CDNA 16x16 (both): lane j + 16·(i / 4), register i % 4. RDNA3 WMMA 32-bit
// results: lane j + 16·(i % 2), register i / 2.
inline EmMatrixLoc em_matrix_d_loc(EmMatrixOp op, int i, int j) {
    if (op == EM_WMMA_I32_16X16X16_IU8) return {j + 16 * (i % 2), i / 2};
    return {j + 16 * (i / 4), i % 4};
}

// One instruction over a whole wave. `a` and `b` hold each lane's operand bytes
// ([lane][ab_bytes], little-endian, as the lane's registers hold them), `c` and `d` each lane's
// accumulator registers ([lane][cd_regs]); `d` must not overlap the inputs. D = A·B + C in 32-bit
// two's complement (the instructions wrap; nothing in the kernels comes near). A and B are signed
// bytes, except for WMMA, whose `a_signed` / `b_signed` select signed or unsigned bytes as the
// instruction's NEG bits do. Uses no stack arrays: it runs on HIP-CPU's 7 KiB fiber stacks.
inline void em_matrix_emulate(EmMatrixOp op, const uint8_t* a, const uint8_t* b, const int32_t* c,
                              int32_t* d, bool a_signed = true, bool b_signed = true) {
    const EmMatrixShape s = em_matrix_shape(op);
    for (int i = 0; i < 16; ++i) {
        for (int j = 0; j < 16; ++j) {
            const EmMatrixLoc dl = em_matrix_d_loc(op, i, j);
            uint32_t acc = (uint32_t)c[dl.lane * s.cd_regs + dl.slot];
            for (int k = 0; k < s.k; ++k) {
                const EmMatrixLoc al = em_matrix_a_loc(op, i, k);
                const EmMatrixLoc bl = em_matrix_b_loc(op, k, j);
                const uint8_t ab = a[al.lane * s.ab_bytes + al.slot];
                const uint8_t bb = b[bl.lane * s.ab_bytes + bl.slot];
                const int32_t av = a_signed ? (int32_t)(int8_t)ab : (int32_t)ab;
                const int32_t bv = b_signed ? (int32_t)(int8_t)bb : (int32_t)bb;
                acc += (uint32_t)(av * bv);
            }
            d[dl.lane * s.cd_regs + dl.slot] = (int32_t)acc;
        }
    }
}

#endif  // EM_MATRIX_EMU_H
