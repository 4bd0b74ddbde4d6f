// Shared by llk.cpp (AVX-512 / AMX) and llk_avx2.cpp (AVX2): the C ABI's structures and formats,
// and the scalar helpers both libraries build their tables with.
#pragma once

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

// For a lambda of a kernel's inner loop that GCC leaves out of line (one called at several
// places): the register accumulators it touches then live in memory. dp_row's group flush was out
// of line for 2, 3 and 5 activation rows: those int4 GEMVs ran 2.0-2.2x slower (AMD EPYC Zen 5).
// Only where measured: forcing dp_row's dot inline too made 4 and 6 rows 1.3x slower.
#define LLK_INLINE __attribute__((always_inline))

// A std::vector whose storage starts on a 64-byte line, for the activations the kernels read with
// 256- and 512-bit loads: a plain vector's storage is 16-byte aligned, so from one process to the
// next x rows started at a random offset in a line and every wide load across two lines cost two.
// On 2 AMD EPYC Zen 5 cores, a 65536 x 5120 int4 layer with x 16 bytes off a line took 24.5 against
// 12.1 ms at 8 rows, nvfp4 22.5 against 15.7, int4 at 1 row 4.3 against 3.9.
template <class T>
struct LineAlloc {
    using value_type = T;
    LineAlloc() = default;
    template <class U>
    LineAlloc(const LineAlloc<U>&) {}
    T* allocate(size_t n) {
        void* p = aligned_alloc(64, std::max<size_t>(64, (n * sizeof(T) + 63) / 64 * 64));
        if (!p) throw std::bad_alloc();
        return (T*)p;
    }
    void deallocate(T* p, size_t) { free(p); }
    template <class U>
    bool operator==(const LineAlloc<U>&) const { return true; }
    template <class U>
    bool operator!=(const LineAlloc<U>&) const { return false; }
};
template <class T>
using LineVec = std::vector<T, LineAlloc<T>>;

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
    uint16_t* out16;           // tile paths: non-null, the results rounded to bf16 here (row stride ldo), not in out
};

// FN<SF>(...) for an int4 weight's scale format (bf16, fp32 or e4m3), `a` the LlkArgs pointer
#define LLK_INT4_SCALES(FN, ...)                                 \
    do {                                                         \
        if (a->sfmt == S_BF16) FN<S_BF16>(__VA_ARGS__);          \
        else if (a->sfmt == S_F32) FN<S_F32>(__VA_ARGS__);       \
        else FN<S_E4M3>(__VA_ARGS__);                            \
    } while (0)

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
// the GEMVs' work split and output, shared by every GEMV of both libraries

static inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

static const int kGemvTileN = 16;  // weight rows per work item

// f(std::integral_constant<int, rows>) for a runtime rows in [R, MAXR] (MAXR for anything above).
template <int R, int MAXR, class F>
static inline void with_rows(int64_t rows, F&& f) {
    if constexpr (R == MAXR) f(std::integral_constant<int, R>{});
    else if (rows == R) f(std::integral_constant<int, R>{});
    else with_rows<R + 1, MAXR>(rows, f);
}

// tile(e, n0, n1, r, rows) for each kGemvTileN-row tile [n0, n1) of every expert with rows and
// each run of up to MAXR of its activation rows from r. The tiles are shared out with
// schedule(guided): each thread first takes a long run of consecutive rows (half of them, then a
// shrinking share), so its read is one long stream the prefetch keeps ahead of, and the small last
// pieces still balance a late thread. Against schedule(dynamic, 4) (64 KiB of int4 weights per
// take), on 2 AMD EPYC Zen 3 cores, one process alternating the two 15 times: int4 expert GEMVs
// 0.84-0.96x the time, a 512 x 2048 layer 0.78-0.81x, a bf16 512 x 2048 layer 0.83-0.86x (larger
// bf16 layers unchanged); a whole decode step of the bench preset 0.97x (int4_all) and 0.95x
// (int4_all_a8), medians of 72 steps.
template <int MAXR, class Tile>
static void gemv_tiles(const LlkArgs& a, int64_t row_bytes, Tile tile) {
    std::vector<std::pair<int64_t, int64_t>> items;  // (expert, first row); empty experts: none
    for (int64_t e = 0; e < a.E; e++)
        if (a.row_end[e] > a.row_start[e])
            for (int64_t n = 0; n < a.N; n += kGemvTileN) items.emplace_back(e, n);
    const int64_t n_items = (int64_t)items.size();
    const int nt = threads_for(n_items * kGemvTileN * row_bytes * (a.w3.w ? 2 : 1), a.nthreads);
#pragma omp parallel for schedule(guided) num_threads(nt)
    for (int64_t i = 0; i < n_items; i++) {
        const int64_t e = items[i].first, n0 = items[i].second, n1 = std::min<int64_t>(n0 + kGemvTileN, a.N);
        for (int64_t r = a.row_start[e]; r < a.row_end[e]; r += MAXR) tile(e, n0, n1, r, std::min<int64_t>(MAXR, a.row_end[e] - r));
    }
}

// out[r0 + m, n] for n in [n0, n1), m < MR: row(w, n, res) gives one weight row against the MR
// activation rows (unscaled), fac(w, n) its alpha * rowscale; times the token scales, and for a
// SwiGLU (a.w3.w set) silu(x W1^T) * (x W3^T).
template <int MR, class Row, class Fac>
static inline void gemv_tile_out(const LlkArgs& a, int64_t n0, int64_t n1, int64_t r0, Row row, Fac fac) {
    const bool swiglu = a.w3.w != nullptr;
    for (int64_t n = n0; n < n1; n++) {
        float r1[MR], r3[MR];
        row(a.w1, n, r1);
        const float f1 = fac(a.w1, n);
        if (swiglu) row(a.w3, n, r3);
        const float f3 = swiglu ? fac(a.w3, n) : 0.0f;
        for (int m = 0; m < MR; m++) {
            const float ts = a.tokscale ? a.tokscale[r0 + m] : 1.0f;
            float v = r1[m] * f1 * ts;
            if (swiglu) v = silu(v) * (r3[m] * f3 * ts);
            a.out[(r0 + m) * a.ldo + n] = v;
        }
    }
}

// A whole GEMV: row(R, w, e, n, r, res) is one weight row n of expert e against the R activation
// rows from r (R an std::integral_constant <= MAXR), fac(w, e, n) its alpha * rowscale.
template <int MAXR, class Row, class Fac>
static void gemv_run(const LlkArgs& a, int64_t row_bytes, Row row, Fac fac) {
    gemv_tiles<MAXR>(a, row_bytes, [&](int64_t e, int64_t n0, int64_t n1, int64_t r, int64_t rows) {
        with_rows<1, MAXR>(rows, [&](auto R) {
            gemv_tile_out<decltype(R)::value>(
                a, n0, n1, r, [&](const LlkWeight& w, int64_t n, float* res) { row(R, w, e, n, r, res); },
                [&](const LlkWeight& w, int64_t n) { return fac(w, e, n); });
        });
    });
}

// ------------------------------------------------------------------------------------------
// activations into a kernel's order: out[r, j] = x[r, perm[j]] (0 where perm[j] >= k), for 2- or
// 4-byte elements (bf16 / fp32), rows shared among threads when there are enough of them (what it
// saves over PyTorch's index_select: cpu.py _permute).

#if defined(__AVX512BW__)
// gather_cols for 2-byte values, 32 outputs at a time: the kernels' orders take each run of 32 from
// a window of at most 128 values of x (4 apart, or shuffled within 64), so each run is one or two
// vpermt2w over that window, merged and masked (pads, values past K). A run spread wider is copied
// one value at a time.
static void gather_cols_bf16(const uint16_t* x, int64_t ldx, int64_t rows, int64_t k, const int32_t* perm, int64_t kp,
                             uint16_t* out, int nt) {
    const int64_t runs = kp / 32;
    LineVec<uint16_t> idx((size_t)kp);
    std::vector<int64_t> base((size_t)runs);
    std::vector<uint32_t> valid((size_t)runs), upper((size_t)runs);
    std::vector<char> wide((size_t)runs);
    for (int64_t c = 0; c < runs; c++) {
        int64_t lo = k, hi = -1;
        uint32_t v = 0;
        for (int j = 0; j < 32; j++) {
            const int64_t p = perm[32 * c + j];
            if (p < k) v |= 1u << j, lo = std::min(lo, p), hi = std::max(hi, p);
        }
        base[c] = v ? lo : 0;
        valid[c] = v;
        wide[c] = v && hi - lo >= 128;
        uint32_t u = 0;
        for (int j = 0; j < 32; j++) {
            const int64_t d = (valid[c] >> j & 1) && !wide[c] ? perm[32 * c + j] - lo : 0;
            idx[32 * c + j] = (uint16_t)(d & 63);
            if (d >= 64) u |= 1u << j;
        }
        upper[c] = u;
    }
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * ldx;
        uint16_t* o = out + r * kp;
        for (int64_t c = 0; c < runs; c++) {
            if (wide[c]) {
                for (int j = 0; j < 32; j++) o[32 * c + j] = perm[32 * c + j] < k ? xr[perm[32 * c + j]] : 0;
                continue;
            }
            const int64_t b0 = base[c];
            auto window = [&](int64_t at) {  // x[at, at + 32) of this row, zeros past K
                return _mm512_maskz_loadu_epi16(at >= k ? 0 : at + 32 <= k ? 0xFFFFFFFFu : (__mmask32)((1u << (k - at)) - 1), xr + at);
            };
            const __m512i ix = _mm512_loadu_si512(idx.data() + 32 * c);
            __m512i v = _mm512_permutex2var_epi16(window(b0), ix, window(b0 + 32));
            if (upper[c]) v = _mm512_mask_blend_epi16(upper[c], v, _mm512_permutex2var_epi16(window(b0 + 64), ix, window(b0 + 96)));
            _mm512_storeu_si512(o + 32 * c, _mm512_maskz_mov_epi16(valid[c], v));
        }
    }
}
#endif

template <class T>
static void gather_cols(const T* x, int64_t ldx, int64_t rows, int64_t k, const int32_t* perm, int64_t kp, T* out,
                        int nthreads) {
    const int nt = threads_for(rows * kp * (int64_t)sizeof(T), nthreads);
#if defined(__AVX512BW__)
    if (std::is_same_v<T, uint16_t> && rows >= 4 && kp % 32 == 0) {
        gather_cols_bf16((const uint16_t*)x, ldx, rows, k, perm, kp, (uint16_t*)out, nt);
        return;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const T* xr = x + r * ldx;
        T* o = out + r * kp;
        for (int64_t j = 0; j < kp; j++) o[j] = perm[j] < k ? xr[perm[j]] : T(0);
    }
}

// x [rows, k] (row stride ldx) -> out [rows, kp] (contiguous) in the order perm gives; elsize 2
// (bf16) or 4 (fp32). Exported by both libraries (each includes this header once).
extern "C" int llk_gather_cols(const void* x, int64_t ldx, int64_t rows, int64_t k, const int32_t* perm, int64_t kp,
                               void* out, int elsize, int nthreads) {
    if (elsize == 2) gather_cols((const uint16_t*)x, ldx, rows, k, perm, kp, (uint16_t*)out, nthreads);
    else if (elsize == 4) gather_cols((const uint32_t*)x, ldx, rows, k, perm, kp, (uint32_t*)out, nthreads);
    else return -1;
    return 0;
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

// `rows` bf16 rows of x (row stride ldx, K order) through `gemv` (a library's GEMV entry, which
// reads activations of type XT in its own order): x is put into that order by `perm` ([kp]; an
// entry >= K is a zero pad), widened to fp32 (XT = float) or kept as bf16 (XT = uint16_t), the GEMV
// writes fp32, and the results are rounded to bf16 into out (row stride ldo). Every row must
// belong to an expert of a (row_start / row_end cover [0, rows)). One call replaces the
// conversion, gather, GEMV and rounding the caller would otherwise make.
template <class XT, class Gemv>
static int gemv_bf16_io(const LlkArgs* a, const int32_t* perm, int64_t kp, int64_t rows, const uint16_t* x,
                        int64_t ldx, uint16_t* out, int64_t ldo, Gemv gemv) {
    thread_local LineVec<XT> xp;
    thread_local LineVec<float> of;
    xp.resize((size_t)(rows * kp));
    of.resize((size_t)(rows * a->N));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < kp; j++) {
            const uint16_t v = perm[j] < a->K ? x[r * ldx + perm[j]] : 0;
            if constexpr (std::is_same_v<XT, float>) xp[r * kp + j] = bf16_value(v);
            else xp[r * kp + j] = v;
        }
    LlkArgs b = *a;
    b.x = xp.data(), b.ldx = kp, b.out = of.data(), b.ldo = a->N;
    const int rc = gemv(&b);
    if (rc) return rc;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t n = 0; n < a->N; n++) out[r * ldo + n] = round_bf16(of[r * a->N + n]);
    return 0;
}
