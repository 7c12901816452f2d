// em_standin.h — what the stand-in's runtime half (em_standin_api.cpp) and its kernel half
// (em_standin_branch.cpp, one build per target branch) say to each other.
//
// Why this exists: the runtime half exports the HIP C entry points HipBackend binds and must not
// see HIP-CPU's own C++ declarations of the same names; the kernel half includes HIP-CPU and the
// project's unmodified .hip sources. They meet only through this table.
#ifndef EM_STANDIN_H
#define EM_STANDIN_H

#include <stddef.h>
#include <stdint.h>

// Launch one kernel: grid and block as hipModuleLaunchKernel got them, `params` the host array of
// host pointers to each by-value argument (every kernel here takes one argument block). Runs to
// completion (the stand-in's streams are synchronous); returns 0, or nonzero when HIP-CPU failed.
typedef int (*EmStandinLaunch)(uint32_t gx, uint32_t gy, uint32_t gz, uint32_t bx, uint32_t by, uint32_t bz,
                               void** params);

struct EmStandinKernel {
    const char* name;        // the kernel's C name (as hipModuleGetFunction asks for it)
    const char* family;      // which .hip file it comes from: activations, decode, prefill
    EmStandinLaunch launch;
    uint32_t max_threads;    // the kernel's __launch_bounds__
};

struct EmStandinBranch {
    const char* name;        // e.g. "gfx90a (mfma_i32_16x16x16i8)" or "generic wave64"
    const char* arch;        // the gfx target the device reports and whose code objects it takes
    uint32_t wave;
    const EmStandinKernel* kernels;
    size_t num_kernels;
};

// Defined by em_standin_branch.cpp.
const EmStandinBranch& em_standin_branch();

#endif  // EM_STANDIN_H
