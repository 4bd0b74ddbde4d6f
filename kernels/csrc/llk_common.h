// Shared by llk.cpp (AVX-512 / AMX) and llk_avx2.cpp (AVX2): the C ABI's structures and formats,
// and the scalar helpers both libraries build their tables with.
#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

enum WeightFormat { W_INT4 = 0, W_FP4 = 1, W_FP8 = 2 };
enum ScaleFormat { S_NONE = 0, S_BF16 = 1, S_F32 = 2, S_E4M3 = 3 };

// One expert-stacked weight: out[m, n] = sum_k x[m, k] * W_e[n, k] * groupscale[e, n, k / gs]
// * alpha[e] * rowscale[e, n] (* tokscale[m]).
struct LlkWeight {
    const uint8_t* w;       // [E, N, row_bytes]
    int64_t w_estride;      // bytes between experts
    int64_t w_ldn;          // bytes between rows
    const void* s;          // group scales [E, N, K / gs] (S_NONE: unused)
    int64_t s_estride;      // elements
    int64_t s_ldn;          // elements
    const float* rowscale;  // [E, N] or null
    int64_t r_estride;      // elements
    const float* alpha;     // [E] or null
};

struct LlkArgs {
    int32_t wfmt, sfmt, gs, nthreads;
    int64_t N, K, E;
    const int64_t* row_start;  // [E]: rows [row_start[e], row_end[e]) of x go to expert e
    const int64_t* row_end;    // [E]; an expert without rows costs nothing
    const void* x;             // activations in the order the kernel reads (see each library)
    int64_t ldx;               // elements
    const float* tokscale;     // [rows] or null
    float* out;                // [rows, ldo] fp32
    int64_t ldo;
    LlkWeight w1;
    LlkWeight w3;              // SwiGLU: w3.w != null and out = silu(x W1^T) * (x W3^T)
};

// ------------------------------------------------------------------------------------------
// table helpers

static inline float e4m3_value(int b) {
    const int e = (b >> 3) & 0xF, m = b & 7;
    float v;
    if (e == 15 && m == 7) v = NAN;
    else if (e == 0) v = std::ldexp((float)m, -9);
    else v = std::ldexp(1.0f + m / 8.0f, e - 7);
    return (b & 0x80) ? -v : v;
}

static inline uint16_t bf16_bits(float f) {  // exact for every value used in the tables
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

// Threads worth waking for `bytes` of weights: a fork/join costs little on an idle machine, but
// on a loaded one the second thread may wait a whole scheduler slice (~10 ms) to run, so tiny
// jobs stay on the calling thread. 256 KiB per thread: one core's int4 GEMV cannot keep up with
// the memory alone, and a 512 x 2048 layer (wk / wv of the bench preset, 512 KiB) took 106 us on
// one thread and 73 on two (2 AMD EPYC cores; with int8 activations 68 -> 37 us).
static inline int threads_for(int64_t bytes, int nthreads) {
    const int64_t per_thread = 1 << 18;
    return (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, bytes / per_thread));
}

// ------------------------------------------------------------------------------------------
// decode entry: bf16 activations in K order in, bf16 results out

static inline float bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t round_bf16(float f) {  // round to nearest even, as PyTorch's conversion
    uint32_t u;
    memcpy(&u, &f, 4);
    if (std::isnan(f)) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// `rows` bf16 rows of x (row stride ldx, K order) through `gemv` (a library's llk_gemv, which
// reads fp32 activations in its own order): x is widened into that order by `perm` ([kp]; an
// entry >= K is a zero pad), the GEMV writes fp32, and the results are rounded to bf16 into out
// (row stride ldo). Every row must belong to an expert of a (row_start / row_end cover [0, rows)).
// One call replaces the conversion, gather, GEMV and rounding the caller would otherwise make.
template <class Gemv>
static int gemv_bf16_io(const LlkArgs* a, const int32_t* perm, int64_t kp, int64_t rows, const uint16_t* x,
                        int64_t ldx, uint16_t* out, int64_t ldo, Gemv gemv) {
    thread_local std::vector<float> xf, of;
    xf.resize((size_t)(rows * kp));
    of.resize((size_t)(rows * a->N));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < kp; j++) xf[r * kp + j] = perm[j] < a->K ? bf16_value(x[r * ldx + perm[j]]) : 0.0f;
    LlkArgs b = *a;
    b.x = xf.data(), b.ldx = kp, b.out = of.data(), b.ldo = a->N;
    const int rc = gemv(&b);
    if (rc) return rc;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t n = 0; n < a->N; n++) out[r * ldo + n] = round_bf16(of[r * a->N + n]);
    return 0;
}
