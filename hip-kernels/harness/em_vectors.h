// em_vectors.h — reader for the EMTV test-vector files written by the Rust reference
// (hip-kernels/src/testvec.rs documents the format). Host-only C++17.
//
// Why this exists: both C++ harnesses (the g++ host check run by `cargo test` and the GPU harness
// run by scripts/gpu-check.sh) compare kernel arithmetic against the Rust oracle's answers, which
// reach them through these files. Every length is checked; a bad file yields a message, never a
// crash.
#ifndef EM_VECTORS_H
#define EM_VECTORS_H

#include <stdint.h>
#include <string.h>

#include <cstdio>
#include <string>
#include <vector>

#include "../kernels/em_contract.h"

struct EmVecMatrix {
    uint32_t rows = 0, cols = 0;
    std::vector<uint8_t> nibbles;
    std::vector<uint16_t> scales;
    std::vector<uint8_t> zeros;  // empty when symmetric
};

struct EmVecExpert {
    EmVecMatrix w13, w2;
};

struct EmVecGroup {
    uint32_t expert, count;
};

struct EmVecCase {
    uint32_t hidden = 0, inter = 0, group_size = 0, scale_bf16 = 0, zero_points = 0;
    uint32_t tokens = 0, pairs = 0;
    std::vector<EmVecExpert> experts;
    std::vector<float> x;
    std::vector<EmVecGroup> groups;
    std::vector<uint32_t> pair_token, pair_out;
    std::vector<float> pair_weight;
    std::vector<int8_t> xq;
    std::vector<float> xd;
    std::vector<float> y_exact, y_combined, y_accurate;
    std::vector<double> y_f64;

    uint32_t group_shift() const { return group_size == 128 ? 2 : group_size == 64 ? 1 : 0; }
    // First pair of group g.
    uint32_t pair_begin(size_t g) const {
        uint32_t b = 0;
        for (size_t i = 0; i < g; ++i) b += groups[i].count;
        return b;
    }
};

inline EmMatView em_host_view(const EmVecCase& c, const EmVecMatrix& m) {
    EmMatView v;
    v.nibbles = m.nibbles.data();
    v.scales = m.scales.data();
    v.zeros = m.zeros.empty() ? nullptr : m.zeros.data();
    v.rows = m.rows;
    v.cols = m.cols;
    v.groups_per_row = m.cols / c.group_size;
    v.group_shift = c.group_shift();
    v.zero_bytes_per_row = (v.groups_per_row + 1) / 2;
    v.scale_is_bf16 = c.scale_bf16;
    return v;
}

namespace em_vectors_detail {

struct Reader {
    const std::vector<uint8_t>& b;
    size_t pos;
    size_t end;
    std::string* err;

    bool take(void* dst, size_t n, const char* what) {
        if (n > end - pos) {
            char msg[200];
            snprintf(msg, sizeof msg, "truncated while reading %s: need %zu bytes at offset %zu, %zu left", what,
                     n, pos, end - pos);
            *err = msg;
            return false;
        }
        if (n) memcpy(dst, b.data() + pos, n);
        pos += n;
        return true;
    }
    bool u32(uint32_t* v, const char* what) { return take(v, 4, what); }
    template <class T>
    bool vec(std::vector<T>& v, size_t n, const char* what) {
        v.resize(n);
        return take(v.data(), n * sizeof(T), what);
    }
    bool matrix(EmVecMatrix& m, uint32_t rows, uint32_t cols, uint32_t gs, bool zp) {
        m.rows = rows;
        m.cols = cols;
        const size_t groups = cols / gs;
        if (!vec(m.nibbles, (size_t)rows * cols / 2, "nibbles")) return false;
        if (!vec(m.scales, (size_t)rows * groups, "scales")) return false;
        if (zp && !vec(m.zeros, (size_t)rows * ((groups + 1) / 2), "zero points")) return false;
        return true;
    }
};

inline uint64_t fnv1a(const uint8_t* p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; ++i) {
        h ^= p[i];
        h *= 0x100000001b3ull;
    }
    return h;
}

}  // namespace em_vectors_detail

// Reads `path` into `cases`. On failure returns false and sets `err` to a message naming the
// problem. (Little-endian hosts only, like every GPU host this runs on.)
inline bool em_read_vectors(const char* path, std::vector<EmVecCase>& cases, std::string& err) {
    FILE* f = fopen(path, "rb");
    if (!f) {
        err = std::string("cannot open ") + path;
        return false;
    }
    std::vector<uint8_t> b;
    uint8_t buf[1 << 16];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) b.insert(b.end(), buf, buf + n);
    fclose(f);
    if (b.size() < 24 || memcmp(b.data(), "EMTV", 4) != 0) {
        err = std::string(path) + " is not an EMTV test-vector file";
        return false;
    }
    uint64_t stored;
    memcpy(&stored, b.data() + b.size() - 8, 8);
    em_vectors_detail::Reader r{b, 4, b.size() - 8, &err};
    uint32_t version, count, reserved;
    if (!r.u32(&version, "version")) return false;
    if (version != 1) {
        err = "unsupported EMTV version " + std::to_string(version) + " (this harness reads 1)";
        return false;
    }
    if (em_vectors_detail::fnv1a(b.data(), b.size() - 8) != stored) {
        err = "EMTV checksum mismatch: the file is corrupt";
        return false;
    }
    if (!r.u32(&count, "case count") || !r.u32(&reserved, "reserved")) return false;
    for (uint32_t ci = 0; ci < count; ++ci) {
        EmVecCase c;
        uint32_t hdr[9];
        for (int i = 0; i < 9; ++i)
            if (!r.u32(&hdr[i], "case header")) return false;
        c.hidden = hdr[0];
        c.inter = hdr[1];
        c.group_size = hdr[2];
        c.scale_bf16 = hdr[3];
        c.zero_points = hdr[4];
        const uint32_t experts = hdr[5];
        c.tokens = hdr[6];
        const uint32_t groups = hdr[7];
        c.pairs = hdr[8];
        for (int i = 0; i < 9; ++i) {
            if (hdr[i] > (1u << 24)) {
                err = "case " + std::to_string(ci) + ": header field out of range";
                return false;
            }
        }
        if ((c.group_size != 32 && c.group_size != 64 && c.group_size != 128) || c.hidden == 0 ||
            c.inter == 0 || c.hidden % c.group_size || c.inter % c.group_size || c.scale_bf16 > 1 ||
            c.zero_points > 1) {
            err = "case " + std::to_string(ci) + ": bad shape or quantization header";
            return false;
        }
        c.experts.resize(experts);
        for (auto& e : c.experts) {
            if (!r.matrix(e.w13, 2 * c.inter, c.hidden, c.group_size, c.zero_points)) return false;
            if (!r.matrix(e.w2, c.hidden, c.inter, c.group_size, c.zero_points)) return false;
        }
        const size_t th = (size_t)c.tokens * c.hidden, ph = (size_t)c.pairs * c.hidden;
        if (!r.vec(c.x, th, "x")) return false;
        std::vector<uint32_t> g;
        if (!r.vec(g, 2 * (size_t)groups, "groups")) return false;
        uint64_t total = 0;
        for (uint32_t i = 0; i < groups; ++i) {
            c.groups.push_back({g[2 * i], g[2 * i + 1]});
            total += g[2 * i + 1];
            if (g[2 * i] >= experts) {
                err = "case " + std::to_string(ci) + ": group names a missing expert";
                return false;
            }
        }
        if (total != c.pairs) {
            err = "case " + std::to_string(ci) + ": group counts do not add up to the pair count";
            return false;
        }
        if (!r.vec(c.pair_token, c.pairs, "pair tokens") || !r.vec(c.pair_out, c.pairs, "pair rows") ||
            !r.vec(c.pair_weight, c.pairs, "pair weights"))
            return false;
        for (uint32_t p = 0; p < c.pairs; ++p) {
            if (c.pair_token[p] >= c.tokens || c.pair_out[p] >= c.pairs) {
                err = "case " + std::to_string(ci) + ": pair index out of range";
                return false;
            }
        }
        if (!r.vec(c.xq, th, "xq") || !r.vec(c.xd, th / 32, "xd") || !r.vec(c.y_exact, ph, "y_exact") ||
            !r.vec(c.y_combined, th, "y_combined") || !r.vec(c.y_accurate, ph, "y_accurate") ||
            !r.vec(c.y_f64, ph, "y_f64"))
            return false;
        cases.push_back(std::move(c));
    }
    if (r.pos != r.end) {
        err = "trailing bytes after the last case";
        return false;
    }
    return true;
}

// Accurate-mode criterion shared with Rust (testvec::ACCURATE_REL_TOL): per output row,
// max |y - y64| <= tol · max(rms(y64), 1e-30). Returns the worst normalized error.
#define EM_ACCURATE_REL_TOL 5e-5
inline double em_accurate_error(const float* y, const double* y64, size_t rows, size_t hidden) {
    double worst = 0;
    for (size_t r = 0; r < rows; ++r) {
        double ss = 0, err = 0;
        for (size_t n = 0; n < hidden; ++n) {
            const double v = y64[r * hidden + n];
            ss += v * v;
            const double e = (double)y[r * hidden + n] - v;
            err = e < 0 ? (-e > err ? -e : err) : (e > err ? e : err);
        }
        double rms = ss / hidden;
        // sqrt without libm dependence issues: Newton on a positive double is fine, but libm is
        // available on every host that runs this; use it.
        rms = __builtin_sqrt(rms);
        const double norm = err / (rms > 1e-30 ? rms : 1e-30);
        if (norm > worst) worst = norm;
    }
    return worst;
}

#endif  // EM_VECTORS_H
