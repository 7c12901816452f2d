// em_amd_builtins.h — the AMD GPU builtins the kernels' AMD branches call, mapped onto HIP-CPU for
// a host build of those branches (clang++ on x86 with -DEM_DEVICE_AMD and a -D__gfxNNN__ define).
//
// Why this exists: the kernels' AMD branches (em_device.h, em_contract.h, prefill.hip) call clang's
// amdgcn builtins directly; on the host those do not exist. Each is defined here, as a macro of
// the same name, with the instruction's meaning on the wave HIP-CPU runs:
//   * ids, barrier, fences, agent-scope atomics: HIP-CPU's threadIdx / blockIdx, __syncthreads,
//     and the compiler's __atomic builtins (x86 is sequentially consistent for these, so a
//     missing agent-scope fence in a kernel cannot be seen here: scripts/gpu-check.sh on a real
//     GPU is the check for the memory model);
//   * ds_bpermute: a shuffle inside the AMD wave (wave 64, or wave 32 = half of HIP-CPU's fixed
//     64-lane warp; the absolute source lane is computed here, see HIP-CPU's ORIGIN.md for why);
//   * sdot4 / sudot4: the 4-way byte dot;
//   * MFMA / WMMA: the wave's registers gathered through block-shared scratch, then
//     em_matrix_emulate (em_matrix_emu.h, layouts tested against AMD's calculator);
//   * s_sleep: a real sleep, so a fused decode kernel's bounded wait is measured in time, not in
//     how fast this machine polls.
// Included only by em_standin_branch.cpp, after <hip/hip_runtime.h> (HIP-CPU).
#ifndef EM_AMD_BUILTINS_H
#define EM_AMD_BUILTINS_H

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "em_matrix_emu.h"

#ifndef __AMDGCN_WAVEFRONT_SIZE
#error "em_amd_builtins.h: define __AMDGCN_WAVEFRONT_SIZE (64 for gfx9, 32 for gfx10/gfx11)"
#endif
#define EM_STANDIN_WAVE __AMDGCN_WAVEFRONT_SIZE

#ifndef __HIP_MEMORY_SCOPE_AGENT
#define __HIP_MEMORY_SCOPE_WORKGROUP 3
#define __HIP_MEMORY_SCOPE_AGENT 4
#endif

typedef int em_standin_v4i __attribute__((ext_vector_type(4)));
typedef int em_standin_v8i __attribute__((ext_vector_type(8)));

[[noreturn]] inline void em_standin_unsupported(const char* what) {
    fprintf(stderr, "HIP-CPU stand-in: %s is not emulated\n", what);
    abort();
}

// Thread id inside the block (x only: every kernel here launches 1-D blocks).
inline unsigned em_standin_tid() { return threadIdx.x; }

// Lane of HIP-CPU's 64-wide warp where this AMD wave's lane 0 sits.
inline int em_standin_wave_base() { return (int)(em_standin_tid() % 64u) & ~(EM_STANDIN_WAVE - 1); }

// ds_bpermute_b32: this lane receives `v` of the lane (addr / 4) mod wave of its own wave.
inline int em_standin_bpermute(int addr, int v) {
    const int src = em_standin_wave_base() + ((addr >> 2) & (EM_STANDIN_WAVE - 1));
    return __shfl(v, src, 64);
}

inline int em_standin_dot4(int a, int b, int c, bool a_signed, bool b_signed, bool clamp) {
    if (clamp) em_standin_unsupported("a clamped dot4");
    int64_t s = c;
    for (int i = 0; i < 4; ++i) {
        const uint8_t x = (uint8_t)((uint32_t)a >> (8 * i));
        const uint8_t y = (uint8_t)((uint32_t)b >> (8 * i));
        s += (int64_t)(a_signed ? (int8_t)x : x) * (int64_t)(b_signed ? (int8_t)y : y);
    }
    return (int)(uint32_t)s;
}

inline void em_standin_sleep(int n) { std::this_thread::sleep_for(std::chrono::microseconds(10 * (n + 1))); }

// Block-shared scratch for the matrix emulation: one wave's operands per lane (HIP-CPU runs all
// fibers of a block on one OS thread, so thread_local storage is the block's shared memory, as
// HIP-CPU's own shuffles use it).
// The gathered wave (wa..wd) lives here too: HIP-CPU's fiber stacks are 7 KiB.
struct EmStandinMatrixScratch {
    uint8_t a[1024][16];
    uint8_t b[1024][16];
    int32_t c[1024][8];
    int32_t d[1024][8];
    uint8_t wa[64 * 16], wb[64 * 16];
    int32_t wc[64 * 8], wd[64 * 8];
};

inline EmStandinMatrixScratch& em_standin_matrix_scratch() {
    thread_local EmStandinMatrixScratch s;
    return s;
}

// One matrix instruction executed by every lane of the wave (as on the GPU, all lanes must call
// it): each lane deposits its registers, lane 0 of the wave computes, each lane takes its D.
template <typename CD>
inline CD em_standin_matrix(EmMatrixOp op, const void* a, const void* b, CD c, bool a_signed, bool b_signed) {
    const EmMatrixShape s = em_matrix_shape(op);
    if (s.wave != EM_STANDIN_WAVE) em_standin_unsupported("a matrix instruction of another wave size");
    EmStandinMatrixScratch& m = em_standin_matrix_scratch();
    const unsigned t = em_standin_tid();
    memcpy(m.a[t], a, (size_t)s.ab_bytes);
    memcpy(m.b[t], b, (size_t)s.ab_bytes);
    for (int r = 0; r < s.cd_regs; ++r) m.c[t][r] = c[r];
    __syncthreads();
    if (t % (unsigned)s.wave == 0) {
        uint8_t* wa = m.wa;
        uint8_t* wb = m.wb;
        int32_t* wc = m.wc;
        int32_t* wd = m.wd;
        for (int l = 0; l < s.wave; ++l) {
            memcpy(wa + l * s.ab_bytes, m.a[t + l], (size_t)s.ab_bytes);
            memcpy(wb + l * s.ab_bytes, m.b[t + l], (size_t)s.ab_bytes);
            memcpy(wc + l * s.cd_regs, m.c[t + l], sizeof(int32_t) * (size_t)s.cd_regs);
        }
        em_matrix_emulate(op, wa, wb, wc, wd, a_signed, b_signed);
        for (int l = 0; l < s.wave; ++l) memcpy(m.d[t + l], wd + l * s.cd_regs, sizeof(int32_t) * (size_t)s.cd_regs);
    }
    __syncthreads();
    CD d;
    for (int r = 0; r < s.cd_regs; ++r) d[r] = m.d[t][r];
    return d;
}

inline em_standin_v4i em_standin_mfma_16x16x16i8(int a, int b, em_standin_v4i c, int cbsz, int abid, int blgp) {
    if (cbsz || abid || blgp) em_standin_unsupported("MFMA broadcast controls (cbsz/abid/blgp)");
    return em_standin_matrix(EM_MFMA_I32_16X16X16I8, &a, &b, c, true, true);
}

inline em_standin_v4i em_standin_mfma_16x16x32i8(long a, long b, em_standin_v4i c, int cbsz, int abid, int blgp) {
    if (cbsz || abid || blgp) em_standin_unsupported("MFMA broadcast controls (cbsz/abid/blgp)");
    return em_standin_matrix(EM_MFMA_I32_16X16X32_I8, &a, &b, c, true, true);
}

// The builtin's boolean operands are the NEG bits: true = signed bytes.
inline em_standin_v8i em_standin_wmma_iu8(bool a_signed, em_standin_v4i a, bool b_signed, em_standin_v4i b,
                                          em_standin_v8i c, bool clamp) {
    if (clamp) em_standin_unsupported("a clamped WMMA");
    int av[4], bv[4];
    for (int i = 0; i < 4; ++i) {
        av[i] = a[i];
        bv[i] = b[i];
    }
    return em_standin_matrix(EM_WMMA_I32_16X16X16_IU8, av, bv, c, a_signed, b_signed);
}

#define __builtin_amdgcn_workitem_id_x() (threadIdx.x)
#define __builtin_amdgcn_workgroup_id_x() (blockIdx.x)
#define __builtin_amdgcn_workgroup_id_y() (blockIdx.y)
#define __builtin_amdgcn_fence(order, scope) __atomic_thread_fence(order)
#define __builtin_amdgcn_s_barrier() __syncthreads()
#define __builtin_amdgcn_s_sleep(n) em_standin_sleep(n)
#define __hip_atomic_fetch_add(p, v, order, scope) __atomic_fetch_add((p), (v), (order))
#define __hip_atomic_fetch_or(p, v, order, scope) __atomic_fetch_or((p), (v), (order))
#define __hip_atomic_load(p, order, scope) __atomic_load_n((p), (order))
#define __builtin_amdgcn_ds_bpermute(addr, v) em_standin_bpermute((addr), (v))
#define __builtin_amdgcn_sdot4(a, b, c, clamp) em_standin_dot4((a), (b), (c), true, true, (clamp))
#define __builtin_amdgcn_sudot4(as, a, bs, b, c, clamp) em_standin_dot4((a), (b), (c), (as), (bs), (clamp))
#define __builtin_amdgcn_mfma_i32_16x16x16i8(a, b, c, cbsz, abid, blgp) \
    em_standin_mfma_16x16x16i8((a), (b), (c), (cbsz), (abid), (blgp))
#define __builtin_amdgcn_mfma_i32_16x16x32_i8(a, b, c, cbsz, abid, blgp) \
    em_standin_mfma_16x16x32i8((a), (b), (c), (cbsz), (abid), (blgp))
#define __builtin_amdgcn_wmma_i32_16x16x16_iu8_w32(as, a, bs, b, c, clamp) \
    em_standin_wmma_iu8((as), (a), (bs), (b), (c), (clamp))

#endif  // EM_AMD_BUILTINS_H
