// em_standin_api.cpp — the HIP runtime entry points HipBackend binds, implemented on the host: a
// test-only stand-in for libamdhip64 that runs the project's kernels through HIP-CPU.
//
// Why this exists: no machine here has an AMD GPU, yet HipBackend (hip-kernels/src/hip/) — weight
// upload and layout, argument blocks, launch geometry, stream order, result download, status word
// — should run, unchanged, in every test run. HipBackend opens its runtime with dlopen; pointed at
// this library (EXPERTMESH_HIP_LIBRARY or HipBackend::with_library) it gets:
//   * one device whose arch is the branch this library was built for (em_standin_branch.cpp);
//   * memory: host memory (device and pinned alike), every allocation tracked, and every copy or
//     memset checked to lie inside one allocation (a wrong size in the backend fails the call
//     instead of scribbling);
//   * modules: hipModuleLoadData takes the real AMDGPU code object the backend embeds, reads its
//     target from the ELF header (an object for another ISA is refused, as the real loader
//     does) and its kernel names from its symbols; a function is the branch's host build of the
//     kernel of that name;
//   * launches: the argument block handed to the kernel by value, the grid and block the backend
//     asked for (checked against the kernel's launch bounds), run to completion by HIP-CPU;
//   * streams: synchronous, hence in order.
// What it cannot show: the GPU memory model (x86 fences are stronger) and speed.
//
// Only the entry points HipBackend uses exist; the library is built by the tests
// (hip-kernels/tests/it/standin.rs), never shipped.
#include <stdint.h>
#include <string.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "em_standin.h"

typedef int hipError_t;
enum : int {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    hipErrorOutOfMemory = 2,
    hipErrorInvalidConfiguration = 9,
    hipErrorInvalidDevicePointer = 17,
    hipErrorInvalidDeviceFunction = 98,
    hipErrorInvalidDevice = 101,
    hipErrorInvalidImage = 200,
    hipErrorNoBinaryForGpu = 209,
    hipErrorInvalidHandle = 400,
    hipErrorNotFound = 500,
    hipErrorLaunchFailure = 719,
};

#define EM_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

struct Module {
    std::string target;
    std::vector<const EmStandinKernel*> kernels;
};

struct State {
    std::mutex mu;
    std::map<uintptr_t, size_t> allocations;  // base -> bytes (device and pinned host)
    std::vector<Module*> modules;
    int device = 0;
};

State& state() {
    static State s;
    return s;
}

// True when [p, p + n) lies inside one live allocation.
bool in_allocation(const void* p, size_t n) {
    State& s = state();
    std::lock_guard<std::mutex> g(s.mu);
    const uintptr_t a = (uintptr_t)p;
    auto it = s.allocations.upper_bound(a);
    if (it == s.allocations.begin()) return false;
    --it;
    return a >= it->first && a + n <= it->first + it->second && a + n >= a;
}

hipError_t alloc(void** ptr, size_t bytes) {
    if (!ptr) return hipErrorInvalidValue;
    const size_t n = bytes == 0 ? 256 : (bytes + 255) / 256 * 256;
    void* p = aligned_alloc(256, n);
    if (!p) return hipErrorOutOfMemory;
    memset(p, 0xA5, n);  // not zeroed: hipMalloc promises nothing, and a kernel reading unwritten memory should see garbage
    State& s = state();
    std::lock_guard<std::mutex> g(s.mu);
    s.allocations[(uintptr_t)p] = bytes;
    *ptr = p;
    return hipSuccess;
}

hipError_t release(void* p) {
    if (!p) return hipSuccess;
    State& s = state();
    {
        std::lock_guard<std::mutex> g(s.mu);
        auto it = s.allocations.find((uintptr_t)p);
        if (it == s.allocations.end()) return hipErrorInvalidDevicePointer;
        s.allocations.erase(it);
    }
    free(p);
    return hipSuccess;
}

// /proc/meminfo field in bytes, 0 when absent.
size_t meminfo(const char* field) {
    std::ifstream f("/proc/meminfo");
    std::string key;
    size_t kib = 0;
    std::string unit;
    while (f >> key >> kib >> unit) {
        if (key == field) return kib * 1024;
    }
    return 0;
}

// AMDGPU ELF e_flags machine numbers (LLVM's EF_AMDGPU_MACH_AMDGCN_*) of the targets the kernels
// are built for.
const char* amdgpu_mach_name(uint32_t mach) {
    switch (mach) {
        case 0x030: return "gfx908";
        case 0x03f: return "gfx90a";
        case 0x040: return "gfx940";
        case 0x04b: return "gfx941";
        case 0x04c: return "gfx942";
        case 0x036: return "gfx1030";
        case 0x041: return "gfx1100";
        case 0x042: return "gfx1101";
        case 0x043: return "gfx1102";
        default: return nullptr;
    }
}

// The image's ELF size, from its section header table's end (the image pointer comes with no
// size, as with the real loader); 0 when it is not a 64-bit little-endian AMDGPU ELF.
size_t elf_size(const unsigned char* img) {
    if (memcmp(img, "\x7f" "ELF", 4) != 0 || img[4] != 2 || img[5] != 1) return 0;
    uint16_t machine;
    memcpy(&machine, img + 18, 2);
    if (machine != 224) return 0;  // EM_AMDGPU
    uint64_t shoff;
    uint16_t shentsize, shnum;
    memcpy(&shoff, img + 40, 8);
    memcpy(&shentsize, img + 58, 2);
    memcpy(&shnum, img + 60, 2);
    return (size_t)(shoff + (uint64_t)shentsize * shnum);
}

bool image_has_string(const unsigned char* img, size_t n, const char* s) {
    const size_t len = strlen(s) + 1;  // with its NUL: a whole symbol name
    for (size_t i = 0; i + len <= n; ++i) {
        if (img[i] == (unsigned char)s[0] && memcmp(img + i, s, len) == 0 && (i == 0 || img[i - 1] == 0)) return true;
    }
    return false;
}

}  // namespace

EM_EXPORT const char* hipGetErrorString(hipError_t e) {
    switch (e) {
        case hipSuccess: return "hipSuccess";
        case hipErrorInvalidValue: return "hipErrorInvalidValue";
        case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
        case hipErrorInvalidConfiguration: return "hipErrorInvalidConfiguration";
        case hipErrorInvalidDevicePointer: return "hipErrorInvalidDevicePointer";
        case hipErrorInvalidDeviceFunction: return "hipErrorInvalidDeviceFunction";
        case hipErrorInvalidDevice: return "hipErrorInvalidDevice";
        case hipErrorInvalidImage: return "hipErrorInvalidImage";
        case hipErrorNoBinaryForGpu: return "hipErrorNoBinaryForGpu";
        case hipErrorInvalidHandle: return "hipErrorInvalidHandle";
        case hipErrorNotFound: return "hipErrorNotFound";
        case hipErrorLaunchFailure: return "hipErrorLaunchFailure";
        default: return "unknown hipError (HIP-CPU stand-in)";
    }
}

EM_EXPORT hipError_t hipInit(unsigned flags) { return flags == 0 ? hipSuccess : hipErrorInvalidValue; }

EM_EXPORT hipError_t hipGetDeviceCount(int* count) {
    if (!count) return hipErrorInvalidValue;
    *count = 1;
    return hipSuccess;
}

EM_EXPORT hipError_t hipSetDevice(int device) {
    if (device != 0) return hipErrorInvalidDevice;
    state().device = device;
    return hipSuccess;
}

EM_EXPORT hipError_t hipDeviceGetAttribute(int* value, int attr, int device) {
    if (!value || device != 0) return hipErrorInvalidValue;
    if (attr != 63) return hipErrorInvalidValue;  // hipDeviceAttributeMultiprocessorCount
    const unsigned n = std::thread::hardware_concurrency();
    *value = n == 0 ? 1 : (int)n;
    return hipSuccess;
}

// The name at offset 0 (hipDeviceProp_t.name) and the arch string (gcnArchName) after it, within
// the first 512 bytes: HipBackend scans the struct for the arch rather than trusting a layout.
EM_EXPORT hipError_t hipGetDeviceProperties(void* props, int device) {
    if (!props || device != 0) return hipErrorInvalidValue;
    const EmStandinBranch& b = em_standin_branch();
    char* p = (char*)props;
    memset(p, 0, 512);
    snprintf(p, 256, "HIP-CPU stand-in");
    snprintf(p + 256, 256, "%s:sramecc+:xnack-", b.arch);
    return hipSuccess;
}

EM_EXPORT hipError_t hipMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
    if (!free_bytes || !total_bytes) return hipErrorInvalidValue;
    *free_bytes = meminfo("MemAvailable:");
    *total_bytes = meminfo("MemTotal:");
    return hipSuccess;
}

EM_EXPORT hipError_t hipMalloc(void** ptr, size_t bytes) { return alloc(ptr, bytes); }
EM_EXPORT hipError_t hipFree(void* ptr) { return release(ptr); }
EM_EXPORT hipError_t hipHostMalloc(void** ptr, size_t bytes, unsigned flags) {
    return flags == 0 ? alloc(ptr, bytes) : hipErrorInvalidValue;
}
EM_EXPORT hipError_t hipHostFree(void* ptr) { return release(ptr); }

EM_EXPORT hipError_t hipMemcpyHtoDAsync(void* dst, const void* src, size_t bytes, void* stream) {
    (void)stream;
    if (!in_allocation(dst, bytes)) return hipErrorInvalidValue;
    memcpy(dst, src, bytes);
    return hipSuccess;
}

EM_EXPORT hipError_t hipMemcpyDtoHAsync(void* dst, const void* src, size_t bytes, void* stream) {
    (void)stream;
    if (!in_allocation(src, bytes)) return hipErrorInvalidValue;
    memcpy(dst, src, bytes);
    return hipSuccess;
}

EM_EXPORT hipError_t hipMemsetAsync(void* dst, int value, size_t bytes, void* stream) {
    (void)stream;
    if (!in_allocation(dst, bytes)) return hipErrorInvalidValue;
    memset(dst, value, bytes);
    return hipSuccess;
}

namespace {
struct Stream {
    uint32_t magic = 0x5354524d;
};
bool valid_stream(void* s) { return s == nullptr || ((Stream*)s)->magic == 0x5354524d; }
}  // namespace

EM_EXPORT hipError_t hipStreamCreate(void** stream) {
    if (!stream) return hipErrorInvalidValue;
    *stream = new Stream;
    return hipSuccess;
}

EM_EXPORT hipError_t hipStreamDestroy(void* stream) {
    if (!stream || !valid_stream(stream)) return hipErrorInvalidHandle;
    ((Stream*)stream)->magic = 0;
    delete (Stream*)stream;
    return hipSuccess;
}

EM_EXPORT hipError_t hipStreamSynchronize(void* stream) { return valid_stream(stream) ? hipSuccess : hipErrorInvalidHandle; }

EM_EXPORT hipError_t hipModuleLoadData(void** module, const void* image) {
    if (!module || !image) return hipErrorInvalidValue;
    const unsigned char* img = (const unsigned char*)image;
    const size_t n = elf_size(img);
    if (n == 0) return hipErrorInvalidImage;
    uint32_t flags;
    memcpy(&flags, img + 48, 4);
    const char* target = amdgpu_mach_name(flags & 0xff);
    const EmStandinBranch& b = em_standin_branch();
    if (!target || strcmp(target, b.arch) != 0) return hipErrorNoBinaryForGpu;
    Module* m = new Module;
    m->target = target;
    for (size_t i = 0; i < b.num_kernels; ++i) {
        if (image_has_string(img, n, b.kernels[i].name)) m->kernels.push_back(&b.kernels[i]);
    }
    if (m->kernels.empty()) {
        delete m;
        return hipErrorInvalidImage;
    }
    State& s = state();
    std::lock_guard<std::mutex> g(s.mu);
    s.modules.push_back(m);
    *module = m;
    return hipSuccess;
}

EM_EXPORT hipError_t hipModuleUnload(void* module) {
    State& s = state();
    std::lock_guard<std::mutex> g(s.mu);
    for (size_t i = 0; i < s.modules.size(); ++i) {
        if (s.modules[i] == module) {
            delete s.modules[i];
            s.modules.erase(s.modules.begin() + (long)i);
            return hipSuccess;
        }
    }
    return hipErrorInvalidHandle;
}

EM_EXPORT hipError_t hipModuleGetFunction(void** func, void* module, const char* name) {
    if (!func || !name) return hipErrorInvalidValue;
    State& s = state();
    std::lock_guard<std::mutex> g(s.mu);
    for (Module* m : s.modules) {
        if (m != module) continue;
        for (const EmStandinKernel* k : m->kernels) {
            if (strcmp(k->name, name) == 0) {
                *func = (void*)k;
                return hipSuccess;
            }
        }
        return hipErrorNotFound;
    }
    return hipErrorInvalidHandle;
}

// One resident workgroup per "compute unit" (a CPU thread runs one block at a time).
EM_EXPORT hipError_t hipModuleOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, void* func, int block,
                                                                         size_t lds) {
    (void)lds;
    if (!blocks || !func) return hipErrorInvalidValue;
    if (block <= 0 || (uint32_t)block > ((const EmStandinKernel*)func)->max_threads) {
        *blocks = 0;
        return hipSuccess;
    }
    *blocks = 1;
    return hipSuccess;
}

EM_EXPORT hipError_t hipModuleLaunchKernel(void* func, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                           unsigned by, unsigned bz, unsigned lds, void* stream, void** params,
                                           void** extra) {
    if (!func || !params || extra) return hipErrorInvalidValue;
    if (!valid_stream(stream)) return hipErrorInvalidHandle;
    const EmStandinKernel* k = (const EmStandinKernel*)func;
    bool known = false;
    {
        State& s = state();
        std::lock_guard<std::mutex> g(s.mu);
        for (Module* m : s.modules)
            for (const EmStandinKernel* mk : m->kernels) known = known || mk == k;
    }
    if (!known) return hipErrorInvalidDeviceFunction;
    // The kernels are 1-D blocks with static LDS only, and never launched with a block past their
    // __launch_bounds__ (the GPU would refuse it).
    if (gx == 0 || gy == 0 || gz == 0 || bx == 0 || by != 1 || bz != 1 || lds != 0 || bx > k->max_threads ||
        gy > 65535 || gz > 65535)
        return hipErrorInvalidConfiguration;
    return k->launch(gx, gy, gz, bx, by, bz, params) == 0 ? hipSuccess : hipErrorLaunchFailure;
}
