// activations.hip — activation quantization and the per-token pre-combine (one kernel family:
// everything of a batch that is not an expert FFN).
//
// Why this exists: exact mode quantizes each token's hidden vector once per batch (contract §1),
// shared by every expert the token chose; PreCombined output sums a token's expert outputs in
// output-row order (contract §5 restricted to one device). Both are tiny next to the FFN but must
// be bit-exact, so they call the shared contract functions.
#include "em_device.h"

// One thread per (token, 32-block). With x == null the codes are already in q (the caller passed
// pre-quantized activations) and only the code sums are computed. Threads i < counters_len also
// zero counters[i]: the FFN launch that follows in stream order starts from zeroed counters
// without a memset launch of its own.
EM_KERNEL void em_quantize_activations(EmQuantArgs a) {
    const uint32_t blocks = a.hidden / EM_BLOCK;
    const uint64_t i = (uint64_t)em_bid() * EM_WG_THREADS + em_tid();
    if (a.counters && i < a.counters_len) a.counters[i] = 0;
    if (i >= (uint64_t)a.tokens * blocks) return;
    int8_t* q = a.q + i * EM_BLOCK;
    if (a.x) {
        float x[EM_BLOCK];
        const float* src = a.x + i * EM_BLOCK;
        for (int j = 0; j < EM_BLOCK; ++j) x[j] = src[j];
        int8_t codes[EM_BLOCK];
        int32_t qsum;
        a.d[i] = em_quantize_block(x, codes, &qsum);
        a.qsum[i] = qsum;
        for (int j = 0; j < EM_BLOCK; ++j) q[j] = codes[j];
    } else {
        int32_t s = 0;
        for (int j = 0; j < EM_BLOCK; ++j) s += q[j];
        a.qsum[i] = s;
    }
}

// One thread per (token, hidden element): out[t][n] = Σ w·y over the token's pairs, in increasing
// output-row order, starting from +0.
EM_KERNEL void em_combine_slots(EmCombineArgs a) {
    const uint64_t i = (uint64_t)em_bid() * EM_WG_THREADS + em_tid();
    if (i >= (uint64_t)a.tokens * a.hidden) return;
    const uint32_t t = (uint32_t)(i / a.hidden);
    const uint32_t n = (uint32_t)(i % a.hidden);
    float acc = 0.0f;
    for (uint32_t k = a.tok_ptr[t]; k < a.tok_ptr[t + 1]; ++k) {
        acc = em_combine_step(acc, a.tok_weights[k], a.y[(uint64_t)a.tok_rows[k] * a.hidden + n]);
    }
    a.out[i] = acc;
}
