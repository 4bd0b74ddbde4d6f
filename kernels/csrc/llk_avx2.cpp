// llama-lite CPU kernels for x86-64 CPUs with AVX2 + FMA + F16C (no AVX-512 needed): laptops,
// AMD Zen 1-3, older Xeons. Same C ABI and numerics as llk.cpp, so cpu.py drives either library.
//
// Two ways to multiply, chosen per expert by the number of activation rows (see cpu.py):
//  * llk_gemv (decode, a few rows): weights decoded straight to fp32 in registers and fed to fp32
//    FMAs. Products are exact or rounded once in fp32, sums are fp32: the reference's numerics up
//    to fp32 summation order.
//  * llk_dequant_f32 (prefill, many rows): weight tiles expanded to fp32 (exact: the group scale is
//    multiplied in as the reference does) for PyTorch's fp32 GEMM, a tile at a time.
//
// Decoding, per 32 weight bytes (no shuffle across 128-bit lanes, no int -> float conversion):
//  * 4-bit (int4, e2m1): nibbles are split with and/shift, two vpshufb look up the low and high
//    bytes of each value's bf16 bits, vpunpck{l,h}bw pairs them into bf16 words, and a bf16 word
//    becomes an fp32 lane by a 16-bit left shift (even words) or masking (odd words).
//  * fp8 e4m3: each byte goes to the high half of a 16-bit word (unpack with zero); an arithmetic
//    shift right by one and a mask give the fp16 bits of the value times 2^-8, subnormals included;
//    vcvtph2ps is exact and the 2^8 joins the row's factor.
// The decoded K order of a 4-bit block is not K order: the activations are permuted to match once
// per call (M x K, cheap); llk_gemv_order says the order, and tiles from llk_dequant_f32 use it too.
// fp8 decodes in K order.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "llk_common.h"


struct Tables {
    __m256i int4_lo, int4_hi;  // nibble -> low / high byte of bf16(int4 value), both 128-bit lanes
    __m256i fp4_lo, fp4_hi;    // nibble -> low / high byte of bf16(e2m1 value)
    float e4m3[256];
};

static Tables make_tables() {
    static const float fp4[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    alignas(32) uint8_t il[32], ih[32], fl[32], fh[32];
    for (int n = 0; n < 32; n++) {
        const int c = n % 16;
        const uint16_t i4 = bf16_bits((float)(c < 8 ? c : c - 16));
        const uint16_t f4 = bf16_bits(c < 8 ? fp4[c] : -fp4[c - 8]);
        il[n] = i4 & 0xFF, ih[n] = i4 >> 8, fl[n] = f4 & 0xFF, fh[n] = f4 >> 8;
    }
    Tables t;
    t.int4_lo = _mm256_load_si256((const __m256i*)il);
    t.int4_hi = _mm256_load_si256((const __m256i*)ih);
    t.fp4_lo = _mm256_load_si256((const __m256i*)fl);
    t.fp4_hi = _mm256_load_si256((const __m256i*)fh);
    for (int b = 0; b < 256; b++) t.e4m3[b] = e4m3_value(b);
    return t;
}

static const Tables& tables() {
    static const Tables t = make_tables();
    return t;
}

template <int SF>
static inline float scale_at(const void* s, int64_t i, const Tables& t) {
    if (SF == S_BF16) {
        const uint32_t u = (uint32_t)((const uint16_t*)s)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    if (SF == S_F32) return ((const float*)s)[i];
    if (SF == S_E4M3) return t.e4m3[((const uint8_t*)s)[i]];
    return 1.0f;
}

// 32 weight bytes at p; a row's last, partial chunk is copied into zeros first.
static inline LLK_INLINE __m256i load_chunk(const uint8_t* p, int64_t rem) {
    if (rem >= 32) return _mm256_loadu_si256((const __m256i*)p);
    alignas(32) uint8_t buf[32] = {0};
    memcpy(buf, p, (size_t)std::max<int64_t>(rem, 0));
    return _mm256_load_si256((const __m256i*)buf);
}

// ------------------------------------------------------------------------------------------
// decoders (gemv order)
//
// 4-bit, per 32 bytes (64 values): vector j = 4 s + 2 h + p (s: 0 low nibbles, 1 high; h: 0 from
// vpunpcklbw, 1 from vpunpckhbw; p: 0 even words, 1 odd), lane d: word w = 2 d + p, byte
// i = (w < 8 ? w : w + 8) + 8 h, K position 2 i + s. Lanes 0-3 of a vector hold K in [16 h, 16 h
// + 16), lanes 4-7 K in [32 + 16 h, 48 + 16 h): a group scale of 16 or 32 values is one scale per
// half vector.

static int gemv_order(int wfmt, int32_t* out) {
    if (wfmt == W_FP8) {
        for (int k = 0; k < 32; k++) out[k] = k;
        return 32;
    }
    for (int j = 0; j < 8; j++)
        for (int d = 0; d < 8; d++) {
            const int s = j / 4, h = (j / 2) % 2, p = j % 2, w = 2 * d + p;
            const int i = (w < 8 ? w : w + 8) + 8 * h;
            out[8 * j + d] = 2 * i + s;
        }
    return 64;
}

// The nibbles of 32 bytes: s = 0 low, 1 high.
static inline __m256i nibbles(__m256i v, int s) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    return _mm256_and_si256(s ? _mm256_srli_epi16(v, 4) : v, m4);
}

// Vectors 4 s .. 4 s + 3 of a chunk from its nibbles ``nib`` (s's half).
static inline LLK_INLINE void decode4_half(__m256i nib, __m256i tlo, __m256i thi, __m256 d[4]) {
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000);
    const __m256i lo = _mm256_shuffle_epi8(tlo, nib), hi = _mm256_shuffle_epi8(thi, nib);
    const __m256i w0 = _mm256_unpacklo_epi8(lo, hi), w1 = _mm256_unpackhi_epi8(lo, hi);
    d[0] = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
    d[1] = _mm256_castsi256_ps(_mm256_and_si256(w0, hi_mask));
    d[2] = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    d[3] = _mm256_castsi256_ps(_mm256_and_si256(w1, hi_mask));
}

static inline LLK_INLINE void decode4(__m256i v, __m256i tlo, __m256i thi, __m256 d[8]) {
    decode4_half(nibbles(v, 0), tlo, thi, d);
    decode4_half(nibbles(v, 1), tlo, thi, d + 4);
}

// fp8, per 32 bytes: d[j] = K [8 j, 8 j + 8) times 2^-8.
static inline LLK_INLINE void decode8(__m256i v, __m256 d[4]) {
    const __m256i zero = _mm256_setzero_si256(), keep = _mm256_set1_epi16((short)0xBFFF);
    const __m256i h0 = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(zero, v), 1), keep);
    const __m256i h1 = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(zero, v), 1), keep);
    d[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h0));
    d[1] = _mm256_cvtph_ps(_mm256_castsi256_si128(h1));
    d[2] = _mm256_cvtph_ps(_mm256_extracti128_si256(h0, 1));
    d[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(h1, 1));
}

static const float kFp8Unit = 256.0f;  // decode8 yields values times 2^-8

// Group scales of 4-bit chunk c: sc[0] for vectors with h = 0, sc[1] for h = 1 (see decode4).
template <int SF>
static inline LLK_INLINE void chunk_scales(const void* srow, int64_t c, int gs, int64_t ngroups, const Tables& t, __m256 sc[2]) {
    auto at = [&](int64_t k) { return scale_at<SF>(srow, std::min<int64_t>(k / gs, ngroups - 1), t); };
    const int64_t k0 = 64 * c;
    if (gs >= 64) {
        sc[0] = sc[1] = _mm256_set1_ps(at(k0));
    } else if (gs == 32) {
        sc[0] = sc[1] = _mm256_setr_m128(_mm_set1_ps(at(k0)), _mm_set1_ps(at(k0 + 32)));
    } else {  // 16
        sc[0] = _mm256_setr_m128(_mm_set1_ps(at(k0)), _mm_set1_ps(at(k0 + 32)));
        sc[1] = _mm256_setr_m128(_mm_set1_ps(at(k0 + 16)), _mm_set1_ps(at(k0 + 48)));
    }
}

// ------------------------------------------------------------------------------------------
// GEMV: one weight row against MR activation rows -> res[m] (before alpha/rowscale/tokscale)

static inline float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// Batch-1 GEMVs prefetch the weight row's bytes this far ahead (a row or more on; one prefetch per
// 64-byte line). On 2 AMD EPYC cores: a bf16 202048 x 2048 layer 12-14 -> 14-17 GB/s (a streaming
// read: 16-21), int4 with int8 activations 18.5-20 -> 16.5-17.5 ms, int4 a few percent, in noise.
// Every weight loop prefetches: on a 2-core Xeon (16-expert stack, batch 1) the fp8 GEMV without
// it read 10.7 GB/s, with it 20.5-22 (a streaming read: 24), nvfp4 9 -> 13 GB/s.
static const int64_t kRowAhead = 4096;

// Accumulators per activation row: enough independent FMA chains to cover the FMA latency.
template <int MR>
struct Acc {
    static constexpr int NA = MR <= 2 ? 4 : MR <= 4 ? 2 : 1;
    __m256 v[MR][NA];
    Acc() {
        for (int m = 0; m < MR; m++)
            for (int j = 0; j < NA; j++) v[m][j] = _mm256_setzero_ps();
    }
    void sum(float res[MR]) const {
        for (int m = 0; m < MR; m++) {
            __m256 s = v[m][0];
            for (int j = 1; j < NA; j++) s = _mm256_add_ps(s, v[m][j]);
            res[m] = hsum(s);
        }
    }
};

// One activation row, int4 with a group size that is a multiple of 64 (whole chunks per group, no
// partial chunk): the products q * x are summed per group and the group's sum times its scale is
// added to the row's total, which saves the per-vector multiply of the general loop.
template <int SF>
static inline float gemv_row_int4_m1(const LlkArgs& a, const uint8_t* wrow, const void* srow, const float* x,
                                     const Tables& t) {
    const int64_t cpg = a.gs / 64, ngroups = a.K / a.gs;
    __m256 tot0 = _mm256_setzero_ps(), tot1 = _mm256_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {
            __m256 d[8];
            if ((c & 1) == 0) _mm_prefetch((const char*)(wrow + 32 * c + kRowAhead), _MM_HINT_T0);
            decode4(_mm256_loadu_si256((const __m256i*)(wrow + 32 * c)), t.int4_lo, t.int4_hi, d);
            const float* xc = x + 64 * c;
            for (int j = 0; j < 8; j++) acc[j % 4] = _mm256_fmadd_ps(d[j], _mm256_loadu_ps(xc + 8 * j), acc[j % 4]);
        }
        const __m256 s = _mm256_set1_ps(scale_at<SF>(srow, g, t));
        tot0 = _mm256_fmadd_ps(_mm256_add_ps(acc[0], acc[1]), s, tot0);
        tot1 = _mm256_fmadd_ps(_mm256_add_ps(acc[2], acc[3]), s, tot1);
    }
    return hsum(_mm256_add_ps(tot0, tot1));
}

// e4m3 scale bytes to fp32 times 2^-8 (see decode8): the low 8 bytes of b, one fp32 lane each.
static inline __m256 e4m3_scales8(__m128i b) {
    const __m128i h = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), b), 1), _mm_set1_epi16((short)0xBFFF));
    return _mm256_cvtph_ps(h);
}

// The four e4m3 scales s0..s3 of a 64-value nvfp4 chunk (lanes o..o+3 of v) as the two scale
// vectors of decode4's halves: sc[0] = [s0 x4, s2 x4], sc[1] = [s1 x4, s3 x4].
static inline void fp4_chunk_scales(__m256 v, int o, __m256 sc[2]) {
    sc[0] = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(o, o, o, o, o + 2, o + 2, o + 2, o + 2));
    sc[1] = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(o + 1, o + 1, o + 1, o + 1, o + 3, o + 3, o + 3, o + 3));
}

// One nvfp4 chunk's products with x, summed per half vector's group in two chains, then times the
// group scales into tot0 / tot1 (exact e2m1 x x products, one fp32 multiply per group sum instead of
// one per weight vector).
static inline void fp4_chunk_m1(const uint8_t* w, const float* xc, const __m256 sc[2], const Tables& t, __m256& tot0,
                                __m256& tot1) {
    __m256 d[8];
    decode4(_mm256_loadu_si256((const __m256i*)w), t.fp4_lo, t.fp4_hi, d);
    __m256 h0 = _mm256_mul_ps(d[0], _mm256_loadu_ps(xc)), h1 = _mm256_mul_ps(d[2], _mm256_loadu_ps(xc + 16));
    h0 = _mm256_fmadd_ps(d[1], _mm256_loadu_ps(xc + 8), h0);
    h1 = _mm256_fmadd_ps(d[3], _mm256_loadu_ps(xc + 24), h1);
    h0 = _mm256_fmadd_ps(d[4], _mm256_loadu_ps(xc + 32), h0);
    h1 = _mm256_fmadd_ps(d[6], _mm256_loadu_ps(xc + 48), h1);
    h0 = _mm256_fmadd_ps(d[5], _mm256_loadu_ps(xc + 40), h0);
    h1 = _mm256_fmadd_ps(d[7], _mm256_loadu_ps(xc + 56), h1);
    tot0 = _mm256_fmadd_ps(h0, sc[0], tot0);
    tot1 = _mm256_fmadd_ps(h1, sc[1], tot1);
}

// One activation row, nvfp4 with K a multiple of 64, two chunks per step (one scale conversion for
// both: 4 -> 2 chains per chunk and this took the 2-core Xeon's AVX2 GEMV from 14-15 to 16-17 GB/s).
// Returns the sum times 2^-8.
static inline float gemv_row_fp4_m1(const LlkArgs& a, const uint8_t* wrow, const uint8_t* srow, const float* x,
                                    const Tables& t) {
    const int64_t nchunk = a.K / 64;
    __m256 tot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t c = 0;
    for (; c + 2 <= nchunk; c += 2) {
        __m256 sc[4];
        _mm_prefetch((const char*)(wrow + 32 * c + kRowAhead), _MM_HINT_T0);
        if ((c & 15) == 0) _mm_prefetch((const char*)(srow + 4 * c + kRowAhead / 8), _MM_HINT_T0);
        const __m256 v = e4m3_scales8(_mm_loadl_epi64((const __m128i*)(srow + 4 * c)));
        fp4_chunk_scales(v, 0, sc);
        fp4_chunk_scales(v, 4, sc + 2);
        fp4_chunk_m1(wrow + 32 * c, x + 64 * c, sc, t, tot[0], tot[1]);
        fp4_chunk_m1(wrow + 32 * c + 32, x + 64 * c + 64, sc + 2, t, tot[2], tot[3]);
    }
    if (c < nchunk) {
        __m256 sc[2];
        int32_t word;
        memcpy(&word, srow + 4 * c, 4);
        fp4_chunk_scales(e4m3_scales8(_mm_cvtsi32_si128(word)), 0, sc);
        fp4_chunk_m1(wrow + 32 * c, x + 64 * c, sc, t, tot[0], tot[1]);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(tot[0], tot[1]), _mm256_add_ps(tot[2], tot[3])));
}

template <int WF, int SF, int MR>
static inline void gemv_row(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n, const float* x,
                            const Tables& t, float res[MR]) {
    const uint8_t* wrow = w.w + e * w.w_estride + n * w.w_ldn;
    const int64_t el = SF == S_F32 ? 4 : SF == S_BF16 ? 2 : 1;
    const void* srow = SF == S_NONE ? nullptr : (const uint8_t*)w.s + (e * w.s_estride + n * w.s_ldn) * el;
    if (WF == W_INT4 && MR == 1 && a.gs % 64 == 0) {
        res[0] = gemv_row_int4_m1<SF>(a, wrow, srow, x, t);
        return;
    }
    if (WF == W_FP4 && MR == 1 && a.K % 64 == 0) {
        res[0] = gemv_row_fp4_m1(a, wrow, (const uint8_t*)srow, x, t) * kFp8Unit;
        return;
    }
    const int64_t row_bytes = WF == W_FP8 ? a.K : a.K / 2;
    const int64_t nchunk = (row_bytes + 31) / 32;
    Acc<MR> acc;
    constexpr int NA = Acc<MR>::NA;
    if (WF == W_FP8) {
        for (int64_t c = 0; c < nchunk; c++) {
            __m256 d[4];
            if ((c & 1) == 0) _mm_prefetch((const char*)(wrow + 32 * c + kRowAhead), _MM_HINT_T0);
            decode8(load_chunk(wrow + 32 * c, row_bytes - 32 * c), d);
            for (int j = 0; j < 4; j++)
                for (int m = 0; m < MR; m++)
                    acc.v[m][j % NA] = _mm256_fmadd_ps(d[j], _mm256_loadu_ps(x + m * a.ldx + 32 * c + 8 * j), acc.v[m][j % NA]);
        }
    } else {
        const __m256i tlo = WF == W_FP4 ? t.fp4_lo : t.int4_lo, thi = WF == W_FP4 ? t.fp4_hi : t.int4_hi;
        const int64_t ngroups = a.K / a.gs;
        for (int64_t c = 0; c < nchunk; c++) {
            __m256 sc[2];
            if ((c & 1) == 0) _mm_prefetch((const char*)(wrow + 32 * c + kRowAhead), _MM_HINT_T0);
            const __m256i v = load_chunk(wrow + 32 * c, row_bytes - 32 * c);
            chunk_scales<SF>(srow, c, a.gs, ngroups, t, sc);
            for (int s = 0; s < 2; s++) {  // half a chunk at a time: fewer live registers with many rows
                __m256 d[4];
                decode4_half(nibbles(v, s), tlo, thi, d);
                for (int i = 0; i < 4; i++) {
                    const int j = 4 * s + i;
                    const __m256 wv = _mm256_mul_ps(d[i], sc[i / 2]);  // q * s, as the reference
                    for (int m = 0; m < MR; m++)
                        acc.v[m][j % NA] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * a.ldx + 64 * c + 8 * j), acc.v[m][j % NA]);
                }
            }
        }
    }
    acc.sum(res);
}

static inline float factor(const LlkWeight& w, int64_t e, int64_t n, int wfmt) {
    return (w.alpha ? w.alpha[e] : 1.0f) * (w.rowscale ? w.rowscale[e * w.r_estride + n] : 1.0f) *
           (wfmt == W_FP8 ? kFp8Unit : 1.0f);
}

template <int WF, int SF, int MR>
static void gemv_tile(const LlkArgs& a, int64_t e, int64_t n0, int64_t n1, int64_t r0, const Tables& t) {
    const float* x = (const float*)a.x + r0 * a.ldx;
    const bool swiglu = a.w3.w != nullptr;
    for (int64_t n = n0; n < n1; n++) {
        float r1[MR], r3[MR];
        gemv_row<WF, SF, MR>(a, a.w1, e, n, x, t, r1);
        const float f1 = factor(a.w1, e, n, WF);
        if (swiglu) gemv_row<WF, SF, MR>(a, a.w3, e, n, x, t, r3);
        const float f3 = swiglu ? factor(a.w3, e, n, WF) : 0.0f;
        for (int m = 0; m < MR; m++) {
            const float ts = a.tokscale ? a.tokscale[r0 + m] : 1.0f;
            float v = r1[m] * f1 * ts;
            if (swiglu) v = silu(v) * (r3[m] * f3 * ts);
            a.out[(r0 + m) * a.ldo + n] = v;
        }
    }
}

static const int kGemvRows = 8;  // activation rows per register tile (one decode feeds them all)

// Its own tile loop rather than llk_common.h's gemv_run (same split, same schedule): through those
// lambdas the 8-row GEMV took 1.1-1.25x the time on AMD EPYC Zen 4 (int4 and fp8, batch 8), and
// the integer GEMV (q8_impl, which keeps its loop too) 1.05-1.1x.
template <int WF, int SF>
static void gemv_impl(const LlkArgs& a) {
    const Tables& t = tables();
    std::vector<std::pair<int64_t, int64_t>> items;  // (expert, first row); empty experts: none
    for (int64_t e = 0; e < a.E; e++)
        if (a.row_end[e] > a.row_start[e])
            for (int64_t n = 0; n < a.N; n += kGemvTileN) items.emplace_back(e, n);
    const int64_t n_items = (int64_t)items.size();
    const int64_t row_bytes = WF == W_FP8 ? a.K : a.K / 2;
    const int nt = threads_for(n_items * kGemvTileN * row_bytes * (a.w3.w ? 2 : 1), a.nthreads);
#pragma omp parallel for schedule(guided) num_threads(nt)
    for (int64_t i = 0; i < n_items; i++) {
        const int64_t e = items[i].first, n0 = items[i].second, n1 = std::min<int64_t>(n0 + kGemvTileN, a.N);
        for (int64_t r = a.row_start[e]; r < a.row_end[e]; r += kGemvRows) {
            switch ((int)std::min<int64_t>(kGemvRows, a.row_end[e] - r)) {
                case 1: gemv_tile<WF, SF, 1>(a, e, n0, n1, r, t); break;
                case 2: gemv_tile<WF, SF, 2>(a, e, n0, n1, r, t); break;
                case 3: gemv_tile<WF, SF, 3>(a, e, n0, n1, r, t); break;
                case 4: gemv_tile<WF, SF, 4>(a, e, n0, n1, r, t); break;
                case 5: gemv_tile<WF, SF, 5>(a, e, n0, n1, r, t); break;
                case 6: gemv_tile<WF, SF, 6>(a, e, n0, n1, r, t); break;
                case 7: gemv_tile<WF, SF, 7>(a, e, n0, n1, r, t); break;
                default: gemv_tile<WF, SF, 8>(a, e, n0, n1, r, t); break;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// fp32 weight tiles for the prefill GEMM (gemv order, group scales multiplied in)

template <int WF, int SF>
static void dequant_rows(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n, float* o, int64_t ld,
                         const Tables& t) {
    const uint8_t* wrow = w.w + e * w.w_estride + n * w.w_ldn;
    const int64_t el = SF == S_F32 ? 4 : SF == S_BF16 ? 2 : 1;
    const void* srow = SF == S_NONE ? nullptr : (const uint8_t*)w.s + (e * w.s_estride + n * w.s_ldn) * el;
    const int64_t row_bytes = WF == W_FP8 ? a.K : a.K / 2;
    const int64_t nchunk = (row_bytes + 31) / 32;
    int64_t done;
    if (WF == W_FP8) {
        const __m256 unit = _mm256_set1_ps(kFp8Unit);
        for (int64_t c = 0; c < nchunk; c++) {
            __m256 d[4];
            decode8(load_chunk(wrow + 32 * c, row_bytes - 32 * c), d);
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(o + 32 * c + 8 * j, _mm256_mul_ps(d[j], unit));
        }
        done = 32 * nchunk;
    } else {
        const __m256i tlo = WF == W_FP4 ? t.fp4_lo : t.int4_lo, thi = WF == W_FP4 ? t.fp4_hi : t.int4_hi;
        const int64_t ngroups = a.K / a.gs;
        for (int64_t c = 0; c < nchunk; c++) {
            __m256 d[8], sc[2];
            decode4(load_chunk(wrow + 32 * c, row_bytes - 32 * c), tlo, thi, d);
            chunk_scales<SF>(srow, c, a.gs, ngroups, t, sc);
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + 64 * c + 8 * j, _mm256_mul_ps(d[j], sc[(j / 2) % 2]));
        }
        done = 64 * nchunk;
    }
    if (done < ld) memset(o + done, 0, (ld - done) * 4);
}

template <int WF, int SF>
static void dequant_call(const LlkArgs& a, int64_t e, int64_t n0, int64_t n1, float* out, int64_t ld) {
    const Tables& t = tables();
    const int64_t row_bytes = WF == W_FP8 ? a.K : a.K / 2;
    const int nt = threads_for((n1 - n0) * row_bytes * 4, a.nthreads);
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t n = n0; n < n1; n++) {
        float* o = out + (n - n0) * ld;
        if (n >= a.N) memset(o, 0, ld * 4);
        else dequant_rows<WF, SF>(a, a.w1, e, n, o, ld, t);
    }
}

// ------------------------------------------------------------------------------------------
// activation quantization: the same fp32 operations, in the same order, as kernels/reference.py,
// so the quantized values are bit-identical (built with -ffp-contract=off). Scalar: at decode a
// row is a few thousand values; in prefill this is far below the GEMM's time.

// Round fp32 in [-448, 448] to the nearest e4m3 value (ties to even).
static inline float round_e4m3(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    const uint32_t sign = u & 0x80000000u, a = u & 0x7FFFFFFFu;
    float af;
    memcpy(&af, &a, 4);
    float r;
    if (af < 0.015625f) {  // subnormal range: multiples of 2^-9
        r = std::nearbyint(af * 512.0f) / 512.0f;
    } else {  // keep 3 mantissa bits, round half to even (a carry bumps the exponent)
        const uint32_t rb = (a + 0x7FFFFu + ((a >> 20) & 1u)) & 0xFFF00000u;
        memcpy(&r, &rb, 4);
    }
    uint32_t ru;
    memcpy(&ru, &r, 4);
    ru |= sign;
    memcpy(&r, &ru, 4);
    return r;
}

static inline float round_e2m1(float q) {
    const float aq = std::fabs(q);
    float r = 0.0f;  // ties to even: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    if (aq > 0.25f) r = 0.5f;
    if (aq >= 0.75f) r = 1.0f;
    if (aq > 1.25f) r = 1.5f;
    if (aq >= 1.75f) r = 2.0f;
    if (aq > 2.5f) r = 3.0f;
    if (aq >= 3.5f) r = 4.0f;
    if (aq > 5.0f) r = 6.0f;
    return std::signbit(q) ? -r : r;
}

static void quant_fp8_rows(const float* x, int64_t rows, int64_t K, int64_t ldx, float ub, float* out32,
                           int64_t ldo, float* scales, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * ldx;
        float s = 0.0f;
        for (int64_t k = 0; k < K; k++) s = std::max(s, std::fabs(xr[k]));
        if (ub > 0) s = std::min(s, ub);
        s = std::max(s, 1e-12f) / 448.0f;
        scales[r] = s;
        float* o = out32 + r * ldo;
        for (int64_t k = 0; k < K; k++) o[k] = round_e4m3(std::min(std::max(xr[k] / s, -448.0f), 448.0f));
    }
}

static void quant_nvfp4_rows(const float* x, int64_t rows, int64_t K, int64_t ldx, const float* g_rows, float* out,
                             int64_t ldo, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const float g = g_rows[r];
        for (int64_t k0 = 0; k0 < K; k0 += 16) {
            const float* v = x + r * ldx + k0;
            float* o = out + r * ldo + k0;
            float amax = 0.0f;
            for (int i = 0; i < 16; i++) amax = std::max(amax, std::fabs(v[i]));
            const float local = round_e4m3(std::min(amax / 6.0f * g, 448.0f));
            if (!(local > 0.0f)) {
                for (int i = 0; i < 16; i++) o[i] = 0.0f;
                continue;
            }
            const float scale = local / g;
            for (int i = 0; i < 16; i++) o[i] = round_e2m1(v[i] / scale) * local;
        }
    }
}

// ------------------------------------------------------------------------------------------
// bf16 GEMV (layers left in bf16: attention, output, and every layer in mode none)
//
// out[m, n] = sum_k x[m, k] W[n, k] for a few bf16 rows of x, fp32 FMAs (a product of two bf16
// is exact in fp32), written as bf16 (round to nearest even). A bf16 word becomes an fp32 lane by
// a shift or a mask, so a core decodes far faster than memory delivers. x is converted once per
// call into fp32 in the same even / odd order per 16 values.

template <int MR>
static void bf16_tile(const uint16_t* w, int64_t ldw, int64_t n0, int64_t n1, int64_t K, const float* xf,
                      int64_t ldxf, const uint16_t* x, int64_t ldx, uint16_t* out, int64_t ldo) {
    const __m256i hi_mask = _mm256_set1_epi32((int)0xFFFF0000);
    const int64_t kv = K / 16 * 16;
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t* wr = w + n * ldw;
        Acc<MR> acc;
        constexpr int NA = Acc<MR>::NA;
        int64_t k = 0;
        int j = 0;
        for (; k < kv; k += 16, j = (j + 2) % NA) {
            if ((k & 31) == 0) _mm_prefetch((const char*)(wr + k) + kRowAhead, _MM_HINT_T0);
            const __m256i wv = _mm256_loadu_si256((const __m256i*)(wr + k));
            const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
            const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, hi_mask));
            for (int m = 0; m < MR; m++) {
                acc.v[m][j] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xf + m * ldxf + k), acc.v[m][j]);
                acc.v[m][j + 1] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xf + m * ldxf + k + 8), acc.v[m][j + 1]);
            }
        }
        float res[MR];
        acc.sum(res);
        for (int m = 0; m < MR; m++) {
            for (int64_t kk = kv; kk < K; kk++) res[m] += bf16_value(wr[kk]) * bf16_value(x[m * ldx + kk]);
            out[m * ldo + n] = round_bf16(res[m]);
        }
    }
}

static void gemv_bf16(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, const uint16_t* x, int64_t ldx, int64_t M,
                      uint16_t* out, int64_t ldo, int nthreads) {
    // x -> fp32, even positions of each 16 first, then odd ones (the order the weight decodes in)
    const int64_t kv = K / 16 * 16;
    LineVec<float> xf((size_t)std::max<int64_t>(M * kv, 1));
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < kv; k += 16)
            for (int i = 0; i < 8; i++) {
                xf[m * kv + k + i] = bf16_value(x[m * ldx + k + 2 * i]);
                xf[m * kv + k + 8 + i] = bf16_value(x[m * ldx + k + 2 * i + 1]);
            }
    const int64_t tile = 16, n_items = (N + tile - 1) / tile;
    const int nt = threads_for(N * K * 2, nthreads);
#pragma omp parallel for schedule(guided) num_threads(nt)
    for (int64_t i = 0; i < n_items; i++) {
        const int64_t n0 = i * tile, n1 = std::min<int64_t>(n0 + tile, N);
        for (int64_t r = 0; r < M; r += 4) {
            const float* xr = xf.data() + r * kv;
            const uint16_t* xb = x + r * ldx;
            uint16_t* orow = out + r * ldo;
            switch ((int)std::min<int64_t>(4, M - r)) {
                case 1: bf16_tile<1>(w, ldw, n0, n1, K, xr, kv, xb, ldx, orow, ldo); break;
                case 2: bf16_tile<2>(w, ldw, n0, n1, K, xr, kv, xb, ldx, orow, ldo); break;
                case 3: bf16_tile<3>(w, ldw, n0, n1, K, xr, kv, xb, ldx, orow, ldo); break;
                default: bf16_tile<4>(w, ldw, n0, n1, K, xr, kv, xb, ldx, orow, ldo); break;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// int4 weights times int8 activations (the explicit int8-activation option, see cpu.py)
//
// Activations are quantized per 32 values along K, as kernels/reference.py does it (the same fp32
// operations, so the same int8 values): s = amax / 127, a = round_half_even(x / s), a = 0 where
// s = 0. Per 64-value chunk of a weight row the products are integer dot products: vpmaddubsw of
// the unsigned nibbles u = q + 8 with a, pairs summed by vpmaddwd, minus 8 * sum(a) for the + 8:
// exact int32 per 32-value block. Each block's sum is multiplied by its activation scale in fp32,
// summed over the weight group, multiplied by the group scale. About a third of the vector
// operations of the fp32 GEMV per weight byte.

struct Q8Rows {
    int64_t nchunk;
    LineVec<int8_t> a;   // [rows][nchunk][64]: the chunk's even K (32 values), then its odd K
    LineVec<float> s;    // [rows][nchunk][8]: lanes 0-3 the first block's scale, 4-7 the second's
    LineVec<int32_t> c;  // [rows][nchunk][8]: lane 0 8 * sum(a) of the first block, lane 4 of the second
};

static void q8_quantize(const float* x, int64_t rows, int64_t K, int64_t ldx, Q8Rows& q) {
    q.nchunk = K / 64;
    q.a.assign((size_t)(rows * q.nchunk * 64), 0);
    q.s.assign((size_t)(rows * q.nchunk * 8), 0.0f);
    q.c.assign((size_t)(rows * q.nchunk * 8), 0);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < K / 32; b++) {
            const float* xb = x + r * ldx + 32 * b;
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(xb[i]));
            const float sc = amax / 127.0f;
            const int64_t c = b / 2, half = b % 2, base = (r * q.nchunk + c);
            int32_t sum = 0;
            for (int i = 0; i < 32; i++) {
                const float v = sc > 0.0f ? std::nearbyint(xb[i] / sc) : 0.0f;
                const int8_t ai = (int8_t)std::min(127.0f, std::max(-127.0f, v));
                const int kk = 32 * (int)half + i;  // K within the chunk
                q.a[base * 64 + (kk % 2) * 32 + kk / 2] = ai;
                sum += ai;
            }
            for (int l = 0; l < 4; l++) q.s[base * 8 + 4 * half + l] = sc;
            q.c[base * 8 + 4 * half] = 8 * sum;
        }
}

// One weight row against MR activation rows, the row's pointers and the activations' set up once,
// outside the chunk loop. Two to four weight rows per pass, sharing the activation loads, measured
// 1.3-2x slower on 2 AMD EPYC cores at batch 1: interleaved row streams read memory more slowly
// than one row after the other.
template <int SF, int MR>
static inline void q8_row(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n, const Q8Rows& q, int64_t r0,
                          const Tables& t, float res[MR]) {
    const int64_t el = SF == S_F32 ? 4 : SF == S_BF16 ? 2 : 1;
    const uint8_t* wrow = w.w + e * w.w_estride + n * w.w_ldn;
    const uint8_t* srow = (const uint8_t*)w.s + (e * w.s_estride + n * w.s_ldn) * el;
    const int8_t* am[MR];
    const int32_t* cm[MR];
    const float* sm[MR];
    for (int m = 0; m < MR; m++) {
        const int64_t base = (r0 + m) * q.nchunk;
        am[m] = q.a.data() + base * 64, cm[m] = q.c.data() + base * 8, sm[m] = q.s.data() + base * 8;
    }
    const __m256i m4 = _mm256_set1_epi8(0x0F), x88 = _mm256_set1_epi8((char)0x88), ones = _mm256_set1_epi16(1);
    const int64_t cpg = a.gs / 64, ngroups = a.K / a.gs;
    __m256 tot[MR];
    for (int m = 0; m < MR; m++) tot[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < ngroups; g++) {
        __m256 acc[MR];
        for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
        for (int64_t c = g * cpg; c < (g + 1) * cpg; c++) {
            if ((c & 1) == 0) _mm_prefetch((const char*)(wrow + 32 * c + kRowAhead), _MM_HINT_T0);
            const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(wrow + 32 * c)), x88);
            const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            for (int m = 0; m < MR; m++) {
                const __m256i p = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)(am[m] + 64 * c))),
                    _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(am[m] + 64 * c + 32))));
                const __m256i i32 = _mm256_sub_epi32(_mm256_madd_epi16(p, ones),
                                                     _mm256_loadu_si256((const __m256i*)(cm[m] + 8 * c)));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), _mm256_loadu_ps(sm[m] + 8 * c), acc[m]);
            }
        }
        const __m256 sv = _mm256_set1_ps(scale_at<SF>(srow, g, t));
        for (int m = 0; m < MR; m++) tot[m] = _mm256_fmadd_ps(acc[m], sv, tot[m]);
    }
    for (int m = 0; m < MR; m++) res[m] = hsum(tot[m]);
}

template <int SF, int MR>
static void q8_tile(const LlkArgs& a, int64_t e, int64_t n0, int64_t n1, int64_t r0, const Q8Rows& q, int64_t q0,
                    const Tables& t) {
    const bool swiglu = a.w3.w != nullptr;
    for (int64_t n = n0; n < n1; n++) {
        float r1[MR], r3[MR];
        q8_row<SF, MR>(a, a.w1, e, n, q, r0 - q0, t, r1);
        if (swiglu) q8_row<SF, MR>(a, a.w3, e, n, q, r0 - q0, t, r3);
        const float f1 = factor(a.w1, e, n, W_INT4), f3 = swiglu ? factor(a.w3, e, n, W_INT4) : 0.0f;
        for (int m = 0; m < MR; m++) {
            float v = r1[m] * f1;
            if (swiglu) v = silu(v) * (r3[m] * f3);
            a.out[(r0 + m) * a.ldo + n] = v;
        }
    }
}

template <int SF>
static void q8_impl(const LlkArgs& a) {
    const Tables& t = tables();
    int64_t first = INT64_MAX, last = 0;
    std::vector<std::pair<int64_t, int64_t>> items;
    for (int64_t e = 0; e < a.E; e++)
        if (a.row_end[e] > a.row_start[e]) {
            first = std::min(first, a.row_start[e]), last = std::max(last, a.row_end[e]);
            for (int64_t n = 0; n < a.N; n += kGemvTileN) items.emplace_back(e, n);
        }
    if (items.empty()) return;
    thread_local Q8Rows q;
    q8_quantize((const float*)a.x + first * a.ldx, last - first, a.K, a.ldx, q);
    const int64_t n_items = (int64_t)items.size();
    const int nt = threads_for(n_items * kGemvTileN * (a.K / 2) * (a.w3.w ? 2 : 1), a.nthreads);
    const Q8Rows& qs = q;
#pragma omp parallel for schedule(guided) num_threads(nt)
    for (int64_t i = 0; i < n_items; i++) {
        const int64_t e = items[i].first, n0 = items[i].second, n1 = std::min<int64_t>(n0 + kGemvTileN, a.N);
        for (int64_t r = a.row_start[e]; r < a.row_end[e]; r += 4) {
            switch ((int)std::min<int64_t>(4, a.row_end[e] - r)) {
                case 1: q8_tile<SF, 1>(a, e, n0, n1, r, qs, first, t); break;
                case 2: q8_tile<SF, 2>(a, e, n0, n1, r, qs, first, t); break;
                case 3: q8_tile<SF, 3>(a, e, n0, n1, r, qs, first, t); break;
                default: q8_tile<SF, 4>(a, e, n0, n1, r, qs, first, t); break;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// decode attention: one query token per row over its KV cache (the core's decode step)
//
// Row b, query head h (KV head h / G, G = H / Hkv): s_j = scale * (q . k_j) over the slots j its
// mask allows, p = softmax(s), out = sum_j p_j v_j / sum_j p_j. fp32 throughout (a product of two
// bf16 is exact in fp32; sums in fp32), the result rounded to bf16 once or kept in fp32. K and V
// are bf16 [B, slots, Hkv, D] with any strides; one work item per (row, KV head) reads its keys
// and values once for all G queries of the group. PyTorch's CPU SDPA takes 10-25x longer than
// reading the cache on a CPU without AVX-512 BF16 (measured on an AMD EPYC, 40 to 8192 slots).

static inline __m256 bf16x8(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

static inline __m256 widen_bf16x8(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 fp32 lanes to bf16, as round_bf16: nearest even, NaN kept quiet.
static inline __m128i round_bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// e^x for fp32 lanes: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so that n ln2 is exact
// enough), e^r by the usual degree-6 minimax polynomial, times 2^n put in the exponent bits. A few
// ulp from expf on [-87, 88] (the test measures it); 0 below -87, where e^x leaves fp32's normals.
static inline __m256 exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

struct AttnArgs {
    const uint16_t* q;  // [B, H, D] contiguous
    const uint16_t *k, *v;
    int64_t k_sb, k_sj, k_sh, v_sb, v_sj, v_sh;  // strides in elements (D contiguous)
    const uint8_t* mask;                         // [B, n]: 1 = may attend
    int64_t B, H, Hkv, D, n;
    float scale;
};

// Rows of the cache are D values of one head, a cache's row stride apart: the hardware
// prefetcher does not run ahead of such a walk, so the kernel asks for rows it reads soon.
static const int64_t kAhead = 16;  // keys ahead, ~4 KB at D = 128

static inline void prefetch_row(const uint16_t* p, int64_t D) {
    for (int64_t i = 0; i < D; i += 32) _mm_prefetch((const char*)(p + i), _MM_HINT_T0);
}

// Scores of GN queries (qf: fp32 [GN, D]) against every slot: s[g * n + j] (-inf where masked).
// Two accumulators per query (even / odd chunks of D) halve the FMA latency chain; GN is a
// template parameter so that the accumulators stay in registers. The first group of queries
// prefetches the key rows ahead (later groups find them in cache).
template <int GN>
static void scores(const AttnArgs& a, const uint16_t* kb, const uint8_t* mask, const float* qf, bool first, float* s) {
    const int64_t n = a.n, D = a.D, nc = D / 8;
    for (int64_t j = 0; j < n; j++) {
        if (first && j + kAhead < n) prefetch_row(kb + (j + kAhead) * a.k_sj, D);
        if (!mask[j]) {
            for (int g = 0; g < GN; g++) s[g * n + j] = -INFINITY;
            continue;
        }
        __m256 acc[GN][2];
        for (int g = 0; g < GN; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
        const uint16_t* kr = kb + j * a.k_sj;
        int64_t c = 0;
        for (; c + 1 < nc; c += 2) {
            const __m256 k0 = bf16x8(kr + 8 * c), k1 = bf16x8(kr + 8 * c + 8);
            for (int g = 0; g < GN; g++) {
                acc[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + 8 * c), k0, acc[g][0]);
                acc[g][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + 8 * c + 8), k1, acc[g][1]);
            }
        }
        if (c < nc) {
            const __m256 k0 = bf16x8(kr + 8 * c);
            for (int g = 0; g < GN; g++) acc[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + g * D + 8 * c), k0, acc[g][0]);
        }
        for (int g = 0; g < GN; g++) s[g * n + j] = hsum(_mm256_add_ps(acc[g][0], acc[g][1])) * a.scale;
    }
}

// out[g] += sum over slots [j0, j1) of p[g * n + j] v_j for GN queries, 16 values of D at a time
// (accumulators in registers); the first group prefetches the next block's value rows.
template <int GN>
static void weighted(const AttnArgs& a, const uint16_t* vb, const uint8_t* mask, const float* p, int64_t j0,
                     int64_t j1, bool first, float* out) {
    const int64_t n = a.n, D = a.D, nc = D / 8;
    for (int64_t c = 0; c < nc; c += 2) {
        const bool two = c + 1 < nc;
        __m256 acc[GN][2];
        for (int g = 0; g < GN; g++) {
            acc[g][0] = _mm256_loadu_ps(out + g * D + 8 * c);
            acc[g][1] = two ? _mm256_loadu_ps(out + g * D + 8 * c + 8) : _mm256_setzero_ps();
        }
        for (int64_t j = j0; j < j1; j++) {
            if (first && c == 0 && j + 64 < n) prefetch_row(vb + (j + 64) * a.v_sj, D);  // the next block
            if (!mask[j]) continue;
            const uint16_t* vr = vb + j * a.v_sj + 8 * c;
            const __m256 v0 = bf16x8(vr), v1 = two ? bf16x8(vr + 8) : _mm256_setzero_ps();
            for (int g = 0; g < GN; g++) {
                const __m256 pg = _mm256_set1_ps(p[g * n + j]);
                acc[g][0] = _mm256_fmadd_ps(pg, v0, acc[g][0]);
                acc[g][1] = _mm256_fmadd_ps(pg, v1, acc[g][1]);
            }
        }
        for (int g = 0; g < GN; g++) {
            _mm256_storeu_ps(out + g * D + 8 * c, acc[g][0]);
            if (two) _mm256_storeu_ps(out + g * D + 8 * c + 8, acc[g][1]);
        }
    }
}

// Work item (b, hk): queries h = hk G .. hk G + G - 1 into out (fp32 [G, D]).
static void attend_item(const AttnArgs& a, int64_t b, int64_t hk, float* out, LineVec<float>& buf) {
    const int64_t G = a.H / a.Hkv, D = a.D, n = a.n;
    buf.resize((size_t)(G * D + G * n));
    float* qf = buf.data();
    float* s = qf + G * D;
    const uint16_t* qb = a.q + (b * a.H + hk * G) * D;
    for (int64_t i = 0; i < G * D; i++) qf[i] = bf16_value(qb[i]);
    const uint16_t* kb = a.k + b * a.k_sb + hk * a.k_sh;
    const uint16_t* vb = a.v + b * a.v_sb + hk * a.v_sh;
    const uint8_t* mask = a.mask + b * n;
    const float ninf = -INFINITY;
    for (int64_t g0 = 0; g0 < G; g0 += 4) {
        switch ((int)std::min<int64_t>(4, G - g0)) {
            case 1: scores<1>(a, kb, mask, qf + g0 * D, g0 == 0, s + g0 * n); break;
            case 2: scores<2>(a, kb, mask, qf + g0 * D, g0 == 0, s + g0 * n); break;
            case 3: scores<3>(a, kb, mask, qf + g0 * D, g0 == 0, s + g0 * n); break;
            default: scores<4>(a, kb, mask, qf + g0 * D, g0 == 0, s + g0 * n); break;
        }
    }
    // softmax numerators in place: p_j = e^(s_j - max); masked slots give exactly 0
    std::vector<float> denom((size_t)G);
    const int64_t nv = n / 8 * 8;
    for (int64_t g = 0; g < G; g++) {
        float* sg = s + g * n;
        float m = ninf;
        for (int64_t j = 0; j < n; j++) m = std::max(m, sg[j]);
        if (m == ninf) {  // no slot to attend to: zeros (SDPA would give NaN)
            for (int64_t j = 0; j < n; j++) sg[j] = 0.0f;
            denom[g] = 1.0f;
            continue;
        }
        const __m256 mv = _mm256_set1_ps(m);
        __m256 l = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j < nv; j += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mv));
            _mm256_storeu_ps(sg + j, e);
            l = _mm256_add_ps(l, e);
        }
        alignas(32) float tail[8] = {ninf, ninf, ninf, ninf, ninf, ninf, ninf, ninf};
        for (int64_t t = j; t < n; t++) tail[t - j] = sg[t];
        const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(tail), mv));
        _mm256_store_ps(tail, e);
        for (int64_t t = j; t < n; t++) sg[t] = tail[t - j];
        denom[g] = hsum(_mm256_add_ps(l, e));
    }
    // out = sum_j p_j v_j: blocks of 64 slots (their values stay in cache across the passes over
    // D), 4 queries x 16 dims of accumulators in registers
    for (int64_t i = 0; i < G * D; i++) out[i] = 0.0f;
    for (int64_t j0 = 0; j0 < n; j0 += 64) {
        const int64_t j1 = std::min<int64_t>(j0 + 64, n);
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            switch ((int)std::min<int64_t>(4, G - g0)) {
                case 1: weighted<1>(a, vb, mask, s + g0 * n, j0, j1, g0 == 0, out + g0 * D); break;
                case 2: weighted<2>(a, vb, mask, s + g0 * n, j0, j1, g0 == 0, out + g0 * D); break;
                case 3: weighted<3>(a, vb, mask, s + g0 * n, j0, j1, g0 == 0, out + g0 * D); break;
                default: weighted<4>(a, vb, mask, s + g0 * n, j0, j1, g0 == 0, out + g0 * D); break;
            }
        }
    }
    for (int64_t g = 0; g < G; g++)
        for (int64_t d = 0; d < D; d++) out[g * D + d] /= denom[g];
}

static void decode_attention(const AttnArgs& a, void* out, int out_bf16, int nthreads) {
    const int64_t G = a.H / a.Hkv, items = a.B * a.Hkv;
    const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(std::min<int64_t>(nthreads, items),
                                                               items * a.n * a.D * 4 / (64 * 1024) + 1));
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < items; i++) {
        thread_local LineVec<float> buf, of;
        const int64_t b = i / a.Hkv, hk = i % a.Hkv;
        of.resize((size_t)(G * a.D));
        attend_item(a, b, hk, of.data(), buf);
        const int64_t base = (b * a.H + hk * G) * a.D;
        if (out_bf16)
            for (int64_t t = 0; t < G * a.D; t++) ((uint16_t*)out)[base + t] = round_bf16(of[t]);
        else
            memcpy((float*)out + base, of.data(), (size_t)(G * a.D) * 4);
    }
}

// ------------------------------------------------------------------------------------------
// C ABI

// Supported combinations (cpu.py checks them first; anything else returns -1):
//   int4 (w4a16 / w4a8): bf16, fp32 or e4m3 group scales, group size 32 or a multiple of 64
//   e2m1 (nvfp4):        e4m3 scales per 16 values
//   e4m3 (fp8 rowwise):  no group scales
static int supported(const LlkArgs* a) {
    if (a->wfmt == W_INT4)
        return a->sfmt != S_NONE && (a->gs == 32 || (a->gs > 0 && a->gs % 64 == 0)) && a->K % a->gs == 0;
    if (a->wfmt == W_FP4) return a->sfmt == S_E4M3 && a->gs == 16 && a->K % 16 == 0;
    return a->wfmt == W_FP8 && a->sfmt == S_NONE;
}

#define LLK_DISPATCH(FN, ...)                                                \
    do {                                                                     \
        if (a->wfmt == W_FP8) FN<W_FP8, S_NONE>(__VA_ARGS__);                \
        else if (a->wfmt == W_FP4) FN<W_FP4, S_E4M3>(__VA_ARGS__);           \
        else if (a->sfmt == S_BF16) FN<W_INT4, S_BF16>(__VA_ARGS__);         \
        else if (a->sfmt == S_F32) FN<W_INT4, S_F32>(__VA_ARGS__);           \
        else FN<W_INT4, S_E4M3>(__VA_ARGS__);                                \
    } while (0)

extern "C" {

int llk_abi_version() { return 5; }

// K positions of one block of a row, in the order the kernels read x (and write tiles); returns
// the block length (64 for 4-bit formats, 32 for fp8). `out` holds at least 64 entries.
int llk_gemv_order(int wfmt, int32_t* out) { return gemv_order(wfmt, out); }

// Few rows per expert: x is fp32 in gemv order.
int llk_gemv(const LlkArgs* a) {
    if (!supported(a)) return -1;
    LLK_DISPATCH(gemv_impl, *a);
    return 0;
}

// int4 weights (group size a multiple of 64) times int8 activations quantized here per 32 values
// (see q8_impl); x is fp32 in K order, rows [row_start, row_end) of each expert.
int llk_gemv_q8(const LlkArgs* a) {
    if (a->wfmt != W_INT4 || a->sfmt == S_NONE || a->gs <= 0 || a->gs % 64 || a->K % a->gs) return -1;
    LLK_INT4_SCALES(q8_impl, *a);
    return 0;
}

// llk_gemv_q8 for bf16 x and bf16 results (gemv_bf16_io with perm = 0..K-1).
int llk_gemv_q8_bf16io(const LlkArgs* a, const int32_t* perm, int64_t kp, int64_t rows, const uint16_t* x,
                       int64_t ldx, uint16_t* out, int64_t ldo) {
    return gemv_bf16_io<float>(a, perm, kp, rows, x, ldx, out, ldo, llk_gemv_q8);
}

// llk_gemv for bf16 x in K order and bf16 results (see gemv_bf16_io): decode in one call.
int llk_gemv_bf16io(const LlkArgs* a, const int32_t* perm, int64_t kp, int64_t rows, const uint16_t* x, int64_t ldx,
                    uint16_t* out, int64_t ldo) {
    return gemv_bf16_io<float>(a, perm, kp, rows, x, ldx, out, ldo, llk_gemv);
}

// Weight rows [n0, n1) of expert e as fp32 in gemv order, group scales multiplied in (rows past N
// and K past the weight are zero). Row scales, alpha and token scales are the caller's.
int llk_dequant_f32(const LlkArgs* a, int64_t e, int64_t n0, int64_t n1, float* out, int64_t ld) {
    if (!supported(a)) return -1;
    LLK_DISPATCH(dequant_call, *a, e, n0, n1, out, ld);
    return 0;
}

// bf16 W [N, K] (row stride ldw) times M bf16 rows of x (row stride ldx) -> bf16 out (row stride ldo).
void llk_gemv_bf16(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, const uint16_t* x, int64_t ldx, int64_t M,
                   uint16_t* out, int64_t ldo, int nthreads) {
    gemv_bf16(w, ldw, N, K, x, ldx, M, out, ldo, nthreads);
}

// Per token: s = clamp(amax, max=ub, min=1e-12) / 448, q = e4m3(clamp(x / s, +-448)) as fp32.
// out16 must be null here (no bf16 tiles in this library).
void llk_quant_fp8_rows(const float* x, int64_t rows, int64_t K, int64_t ldx, float ub, float* out32,
                        uint16_t* out16, int64_t ldo, float* scales, int nthreads) {
    (void)out16;
    quant_fp8_rows(x, rows, K, ldx, ub, out32, ldo, scales, nthreads);
}

// Per token and 16 values: local = e4m3(min(amax / 6 * g, 448)), q = e2m1(x / (local / g));
// out = q * local (exact; the caller divides by g in fp32).
int llk_quant_nvfp4_rows(const float* x, int64_t rows, int64_t K, int64_t ldx, const float* g_rows, float* out,
                         int64_t ldo, int nthreads) {
    if (K % 16) return -1;
    quant_nvfp4_rows(x, rows, K, ldx, g_rows, out, ldo, nthreads);
    return 0;
}

// One query per row attending over a bf16 KV cache (see decode_attention): q [B, H, D] bf16
// contiguous, k / v with strides (row, slot, head; D contiguous), mask [B, n] bytes. Writes
// [B, H, D] as bf16 (out_bf16 = 1) or fp32. Returns -1 unless D % 8 == 0 and Hkv divides H.
int llk_decode_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* strides,
                         const uint8_t* mask, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t n, float scale,
                         void* out, int out_bf16, int nthreads) {
    if (D % 8 || Hkv <= 0 || H % Hkv || n < 0) return -1;
    AttnArgs a{q, k, v, strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], mask, B, H, Hkv, D, n, scale};
    decode_attention(a, out, out_bf16, nthreads);
    return 0;
}

// A whole decode step of one layer: row b stores its new key and value (Hkv x D bf16 each, at
// k_new / v_new with strides new_strides = (k row, k head, v row, v head)) in cache slot slot[b],
// then attends as llk_decode_attention over slots [lo[b], slot[b]] of its row, n = the furthest
// row's slot + 1 (the rest of [0, n) masked). The cache's strides are ``strides``' six. Returns -1
// as llk_decode_attention, or when some row has lo > slot or slot >= slots (the cache's length).
int llk_decode_step(const uint16_t* q, const uint16_t* k_new, const uint16_t* v_new, const int64_t* new_strides,
                    uint16_t* k, uint16_t* v, const int64_t* strides, int64_t slots, const int64_t* slot,
                    const int64_t* lo, int64_t B, int64_t H, int64_t Hkv, int64_t D, float scale, void* out,
                    int out_bf16, int nthreads) {
    if (D % 8 || Hkv <= 0 || H % Hkv || B <= 0) return -1;
    int64_t n = 0;
    for (int64_t b = 0; b < B; b++) {
        if (lo[b] < 0 || lo[b] > slot[b] || slot[b] >= slots) return -1;
        n = std::max(n, slot[b] + 1);
    }
    std::vector<uint8_t> mask((size_t)(B * n), 0);
    for (int64_t b = 0; b < B; b++) {
        for (int64_t h = 0; h < Hkv; h++) {
            memcpy(k + b * strides[0] + slot[b] * strides[1] + h * strides[2], k_new + b * new_strides[0] + h * new_strides[1],
                   (size_t)D * 2);
            memcpy(v + b * strides[3] + slot[b] * strides[4] + h * strides[5], v_new + b * new_strides[2] + h * new_strides[3],
                   (size_t)D * 2);
        }
        memset(mask.data() + b * n + lo[b], 1, (size_t)(slot[b] - lo[b] + 1));
    }
    AttnArgs a{q, k, v, strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], mask.data(), B, H, Hkv, D, n, scale};
    decode_attention(a, out, out_bf16, nthreads);
    return 0;
}

// RMSNorm of bf16 rows, as the core's ``rmsnorm(x) * weight``: per row r = 1 / sqrt(sum(x^2) / dim
// + eps) in fp32 (each x^2 is exact: x has 8 significant bits), y = bf16(x * r), and with a weight
// (w non-null) bf16(y * w). Only the sum's order is this kernel's (8 lanes, 4 accumulators).
int llk_rmsnorm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out, int64_t ldo, int64_t rows,
                     int64_t dim, float eps, int nthreads) {
    if (rows < 0 || dim <= 0) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t* xr = x + r * ldx;
        uint16_t* o = out + r * ldo;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        int64_t k = 0;
        for (; k + 32 <= dim; k += 32) {
            for (int j = 0; j < 4; j++) {
                const __m256 v = bf16x8(xr + k + 8 * j);
                acc[j] = _mm256_fmadd_ps(v, v, acc[j]);
            }
        }
        for (; k + 8 <= dim; k += 8) {
            const __m256 v = bf16x8(xr + k);
            acc[0] = _mm256_fmadd_ps(v, v, acc[0]);
        }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        for (; k < dim; k++) {
            const float v = bf16_value(xr[k]);
            sum += v * v;
        }
        const float scale = 1.0f / std::sqrt(sum / (float)dim + eps);
        const __m256 vscale = _mm256_set1_ps(scale);
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            __m128i y = round_bf16x8(_mm256_mul_ps(bf16x8(xr + i), vscale));
            if (w) y = round_bf16x8(_mm256_mul_ps(widen_bf16x8(y), bf16x8(w + i)));
            _mm_storeu_si128((__m128i*)(o + i), y);
        }
        for (; i < dim; i++) {
            const uint16_t y = round_bf16(bf16_value(xr[i]) * scale);
            o[i] = w ? round_bf16(bf16_value(y) * bf16_value(w[i])) : y;
        }
    }
    return 0;
}

// ------------------------------------------------------------------------------------------
// A MoE layer for one token with top-1 routing (decode at batch 1), in one call: the router, the
// routed expert's SwiGLU and the shared expert's, and their sum. The four GEMVs are the bf16-in,
// bf16-out GEMVs Python would call (function pointers into whichever library the path uses, with
// the argument blocks Python built), so their bits are those of the separate calls; what this adds
// is the glue, with PyTorch's roundings: logits = bf16(router . x) with fp32 sums (their order is
// this kernel's), the first expert of the largest logit, score = bf16(sigmoid(logit)), the routed
// input bf16(x * score), and out = bf16(shared + routed). It saves ~15 PyTorch ops and Python
// between them per layer, each slower right after a GEMV has streamed its weights.

typedef int (*LlkGemvIO)(const LlkArgs*, const int32_t*, int64_t, int64_t, const uint16_t*, int64_t, uint16_t*,
                         int64_t);

typedef void (*LlkGemvBf16)(const uint16_t*, int64_t, int64_t, int64_t, const uint16_t*, int64_t, int64_t, uint16_t*,
                            int64_t, int);

struct LlkGemvCall {
    LlkGemvIO fn;
    const LlkArgs* args;  // its row_start / row_end: the plan's, for the routed calls
    const int32_t* perm;
    int64_t kp;
};

struct LlkMoePlan {
    int64_t E, D, F_routed, F_shared;
    const float* router;  // [E, D] fp32
    int64_t* row_start;   // [E], what the routed calls' arguments point to
    int64_t* row_end;
    LlkGemvCall routed13, routed2, shared13, shared2;
};

static float dot_bf16_f32(const uint16_t* x, const float* w, int64_t n) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t k = 0;
    for (; k + 32 <= n; k += 32)
        for (int j = 0; j < 4; j++)
            acc[j] = _mm256_fmadd_ps(bf16x8(x + k + 8 * j), _mm256_loadu_ps(w + k + 8 * j), acc[j]);
    for (; k + 8 <= n; k += 8) acc[0] = _mm256_fmadd_ps(bf16x8(x + k), _mm256_loadu_ps(w + k), acc[0]);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (; k < n; k++) sum += bf16_value(x[k]) * w[k];
    return sum;
}

static int call_io(const LlkGemvCall& c, const uint16_t* x, int64_t ldx, uint16_t* out) {
    return c.fn(c.args, c.perm, c.kp, 1, x, ldx, out, c.args->N);
}

// The top-1 route of x (bf16 [D]) by an fp32 router [E, D]: its expert, and the score as a bf16 value.
static int64_t route_top1(const float* router, int64_t E, int64_t D, const uint16_t* x, float* score) {
    int64_t best = 0;
    float best_logit = -INFINITY;
    for (int64_t e = 0; e < E; e++) {
        const float logit = bf16_value(round_bf16(dot_bf16_f32(x, router + e * D, D)));
        if (logit > best_logit || e == 0) best = e, best_logit = logit;
    }
    *score = bf16_value(round_bf16(1.0f / (1.0f + std::exp(-best_logit))));
    return best;
}

// x, out: bf16 [D]; expert (may be null): the chosen expert. Returns 0, or the failing GEMV's code.
int llk_moe_one_token(const LlkMoePlan* p, const uint16_t* x, uint16_t* out, int64_t* expert) {
    if (p->E <= 0 || p->D <= 0) return -1;
    float score;
    const int64_t best = route_top1(p->router, p->E, p->D, x, &score);
    thread_local LineVec<uint16_t> buf;
    buf.resize((size_t)(p->D * 3 + p->F_routed + p->F_shared));
    uint16_t* xs = buf.data();
    uint16_t* routed = xs + p->D;
    uint16_t* shared = routed + p->D;
    uint16_t* h_routed = shared + p->D;
    uint16_t* h_shared = h_routed + p->F_routed;
    for (int64_t d = 0; d < p->D; d++) xs[d] = round_bf16(bf16_value(x[d]) * score);
    for (int64_t e = 0; e < p->E; e++) p->row_start[e] = p->row_end[e] = 0;
    p->row_end[best] = 1;
    int rc = call_io(p->routed13, xs, p->D, h_routed);
    if (!rc) rc = call_io(p->routed2, h_routed, p->F_routed, routed);
    if (!rc) rc = call_io(p->shared13, x, p->D, h_shared);
    if (!rc) rc = call_io(p->shared2, h_shared, p->F_shared, shared);
    if (rc) return rc;
    for (int64_t d = 0; d < p->D; d++) out[d] = round_bf16(bf16_value(shared[d]) + bf16_value(routed[d]));
    if (expert) *expert = best;
    return 0;
}

// The same layer with bf16 weights (mode none, the core's numbers): each SwiGLU as the core's bf16
// FeedForward computes it, h1 = x W1.T and h3 = x W3.T rounded to bf16, silu(h1) = h1 / (1 + e^-h1)
// in fp32 rounded to bf16, times h3 rounded to bf16, then W2 (every GEMV the path's llk_gemv_bf16,
// by function pointer). PyTorch's silu takes e^x from its vector math library, this one from the C
// library; the two differ in the last bit of e^x for a few hundred bf16 inputs, but silu rounded to
// bf16 came out equal for every finite bf16 input (checked exhaustively against torch 2.13's).
struct LlkMoeBf16Plan {
    int64_t E, D, F_routed, F_shared;
    const float* router;  // [E, D] fp32
    const uint16_t *w1, *w3, *w2;  // routed: w1 / w3 [E, F, D], w2 [E, D, F], contiguous
    const uint16_t *s1, *s3, *s2;  // shared: s1 / s3 [Fs, D], s2 [D, Fs], contiguous
    LlkGemvBf16 gemv;
    int64_t nthreads;
};

static void swiglu_bf16(const LlkMoeBf16Plan* p, const uint16_t* x, const uint16_t* w1, const uint16_t* w3,
                        const uint16_t* w2, int64_t F, uint16_t* h1, uint16_t* h3, uint16_t* out) {
    const int nt = (int)p->nthreads;
    p->gemv(w1, p->D, F, p->D, x, p->D, 1, h1, F, nt);
    p->gemv(w3, p->D, F, p->D, x, p->D, 1, h3, F, nt);
    for (int64_t f = 0; f < F; f++) {
        const float a = bf16_value(h1[f]);
        const float silu = bf16_value(round_bf16(a / (1.0f + std::exp(-a))));
        h1[f] = round_bf16(silu * bf16_value(h3[f]));
    }
    p->gemv(w2, F, p->D, F, h1, F, 1, out, p->D, nt);
}

int llk_moe_one_token_bf16(const LlkMoeBf16Plan* p, const uint16_t* x, uint16_t* out, int64_t* expert) {
    if (p->E <= 0 || p->D <= 0) return -1;
    float score;
    const int64_t e = route_top1(p->router, p->E, p->D, x, &score);
    const int64_t D = p->D, F = p->F_routed, Fs = p->F_shared, Fmax = std::max(F, Fs);
    thread_local LineVec<uint16_t> buf;
    buf.resize((size_t)(D * 3 + 2 * Fmax));
    uint16_t* xs = buf.data();
    uint16_t* routed = xs + D;
    uint16_t* shared = routed + D;
    uint16_t* h1 = shared + D;
    uint16_t* h3 = h1 + Fmax;
    for (int64_t d = 0; d < D; d++) xs[d] = round_bf16(bf16_value(x[d]) * score);
    swiglu_bf16(p, xs, p->w1 + e * F * D, p->w3 + e * F * D, p->w2 + e * D * F, F, h1, h3, routed);
    swiglu_bf16(p, x, p->s1, p->s3, p->s2, Fs, h1, h3, shared);
    for (int64_t d = 0; d < D; d++) out[d] = round_bf16(bf16_value(shared[d]) + bf16_value(routed[d]));
    if (expert) *expert = e;
    return 0;
}

// ------------------------------------------------------------------------------------------
// A decode step's attention for one token (batch 1) in one call: the q / k / v GEMVs, RoPE, the
// heads' RMSNorm, the temperature scale of q, the cache write and attention (``llk_decode_step``)
// and the output GEMV. Each GEMV is the one Python would call (a quantized form's bf16-in, bf16-out
// GEMV, or a bf16 weight's ``llk_gemv_bf16``, by function pointer into the path's library), and
// the glue has the core's roundings: RoPE as x * cos + swap(x) * sin in fp32 with each product and
// the sum rounded to fp32 (no FMA: the library is built with -ffp-contract=off), then bf16; the
// norm is ``llk_rmsnorm_bf16``'s; q * scale in fp32, then bf16. ~25 PyTorch operators and 5 kernel
// dispatches fewer per layer.

struct LlkLinearCall {  // io.fn set: a quantized form's GEMV; else bf16_fn on the bf16 weight w [N, K]
    LlkGemvCall io;
    LlkGemvBf16 bf16_fn;
    const uint16_t* w;
    int64_t ldw, N, K;
};

struct LlkAttnPlan {
    int64_t D, H, Hkv, hd;
    LlkLinearCall wq, wk, wv, wo;
    int64_t qk_norm;  // RMSNorm of each q / k head (after RoPE), with eps
    float eps, scale;  // scale: of the scores, hd^-0.5
    uint16_t* cache_k;
    uint16_t* cache_v;
    int64_t strides[6];  // of cache_k [B, slots, Hkv, hd] then cache_v, in elements
    int64_t slots, chunk, ring, nthreads;
};

static int call_linear(const LlkLinearCall& c, const uint16_t* x, int64_t ldx, uint16_t* out, int64_t nthreads) {
    if (c.io.fn) return call_io(c.io, x, ldx, out);  // its threads: in its argument block
    c.bf16_fn(c.w, c.ldw, c.N, c.K, x, ldx, 1, out, c.N, (int)nthreads);
    return 0;
}

// x: bf16 [D], normed; pos: its position; cos / sin: fp32 [hd] as the core's rope_at lays them out
// (null: no RoPE); q_scale: multiplies q where use_q_scale; out: bf16 [D] (wo's, before any
// reduction across ranks). Returns 0, a GEMV's code, or -1 for a position outside the cache.
int llk_attention_one_token(const LlkAttnPlan* p, const uint16_t* x, int64_t pos, const float* cos, const float* sin,
                            int use_q_scale, float q_scale, uint16_t* out) {
    const int64_t hd = p->hd, nq = p->H * hd, nkv = p->Hkv * hd;
    if (pos < 0 || hd % 2) return -1;
    const int64_t slot = p->ring ? pos % p->chunk : pos;
    const int64_t lo = p->chunk && !p->ring ? pos - pos % p->chunk : 0;
    if (slot >= p->slots) return -1;
    thread_local LineVec<uint16_t> buf;
    buf.resize((size_t)(2 * nq + 2 * nkv));
    uint16_t* q = buf.data();  // q, k, v side by side, as the core's cat of q and k
    uint16_t* k = q + nq;
    uint16_t* v = k + nkv;
    uint16_t* attn = v + nkv;
    int rc = call_linear(p->wq, x, p->D, q, p->nthreads);
    if (!rc) rc = call_linear(p->wk, x, p->D, k, p->nthreads);
    if (!rc) rc = call_linear(p->wv, x, p->D, v, p->nthreads);
    if (rc) return rc;
    const int64_t heads = p->H + p->Hkv;
    if (cos) {
        for (int64_t r = 0; r < heads; r++) {
            uint16_t* h = q + r * hd;
            for (int64_t i = 0; i < hd; i += 2) {
                const float a = bf16_value(h[i]), b = bf16_value(h[i + 1]);
                const float a_cos = a * cos[i], b_sin = b * sin[i], b_cos = b * cos[i + 1], a_sin = a * sin[i + 1];
                h[i] = round_bf16(a_cos + b_sin);
                h[i + 1] = round_bf16(b_cos + a_sin);
            }
        }
    }
    if (p->qk_norm) llk_rmsnorm_bf16(q, hd, nullptr, q, hd, heads, hd, p->eps, 1);
    if (use_q_scale)
        for (int64_t i = 0; i < nq; i++) q[i] = round_bf16(bf16_value(q[i]) * q_scale);
    const int64_t new_strides[4] = {nkv, hd, nkv, hd};
    rc = llk_decode_step(q, k, v, new_strides, p->cache_k, p->cache_v, p->strides, p->slots, &slot, &lo, 1, p->H,
                         p->Hkv, hd, p->scale, attn, 1, (int)p->nthreads);
    if (rc) return -1;
    return call_linear(p->wo, attn, nq, out, p->nthreads);
}

// ------------------------------------------------------------------------------------------
// A decoder block for one token (batch-1 decode) in one call:
//   h = x + attention(rmsnorm(x) * norm1);  out = h + moe(rmsnorm(h) * norm2)
// with the very functions the separate calls run (llk_rmsnorm_bf16, llk_attention_one_token,
// llk_moe_one_token[_bf16]) and the core's bf16 residual adds (fp32 sum rounded once), so the result
// has the bits of the separate calls. Why: between those calls the interpreter's code and data come
// back from L3 after each weight stream, which made the Python of a block cost ~0.2 ms.

struct LlkBlockPlan {
    const LlkAttnPlan* attn;
    const void* moe;  // LlkMoePlan, or LlkMoeBf16Plan when moe_bf16
    int64_t moe_bf16;
    const uint16_t* norm1;
    const uint16_t* norm2;
    float eps1, eps2;
    int64_t D, nthreads;
};

int llk_block_one_token(const LlkBlockPlan* p, const uint16_t* x, int64_t pos, const float* cos, const float* sin,
                        int use_q_scale, float q_scale, uint16_t* out) {
    const int64_t D = p->D;
    thread_local LineVec<uint16_t> buf;
    buf.resize((size_t)(3 * D));
    uint16_t* a = buf.data();  // a norm's output, then the MoE's
    uint16_t* o = a + D;       // the attention's output
    uint16_t* h = o + D;       // the residual stream after attention
    int rc = llk_rmsnorm_bf16(x, D, p->norm1, a, D, 1, D, p->eps1, (int)p->nthreads);
    if (!rc) rc = llk_attention_one_token(p->attn, a, pos, cos, sin, use_q_scale, q_scale, o);
    if (rc) return rc;
    for (int64_t i = 0; i < D; i++) h[i] = round_bf16(bf16_value(x[i]) + bf16_value(o[i]));
    rc = llk_rmsnorm_bf16(h, D, p->norm2, a, D, 1, D, p->eps2, (int)p->nthreads);
    if (rc) return rc;
    rc = p->moe_bf16 ? llk_moe_one_token_bf16((const LlkMoeBf16Plan*)p->moe, a, o, nullptr)
                     : llk_moe_one_token((const LlkMoePlan*)p->moe, a, o, nullptr);
    if (rc) return -2;
    for (int64_t i = 0; i < D; i++) out[i] = round_bf16(bf16_value(h[i]) + bf16_value(o[i]));
    return 0;
}

// Blocks plans[0..n) in turn, one token: x through each llk_block_one_token into out (D values), so
// a decode step's Python runs once instead of once per block. Block i takes the position's RoPE
// (cos, sin) where rope[i] (none on a layer without RoPE), and the temperature q_scale[i] where
// use_q_scale[i]. A block reads its input before it writes its output, so each works in place on
// out. A non-zero return code is the failing block's, *failed its index (the blocks before it have
// written their caches).
int llk_blocks_one_token(const LlkBlockPlan* const* plans, int64_t n, const uint16_t* x, int64_t pos,
                         const float* cos, const float* sin, const int8_t* rope, const int8_t* use_q_scale,
                         const float* q_scale, uint16_t* out, int64_t* failed) {
    if (n <= 0) return 0;
    memcpy(out, x, (size_t)plans[0]->D * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++) {
        const int rc = llk_block_one_token(plans[i], out, pos, rope[i] ? cos : nullptr, rope[i] ? sin : nullptr,
                                           use_q_scale[i], q_scale[i], out);
        if (rc) {
            *failed = i;
            return rc;
        }
    }
    return 0;
}

}  // extern "C"
