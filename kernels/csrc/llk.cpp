// llama-lite CPU kernels: fused dequantize + GEMM for int4 / fp8 / w4a8 / nvfp4 weights.
//
// Plain C ABI over raw pointers, loaded with ctypes (no torch headers: a few seconds to build).
// Needs AVX-512 F/BW/VL/DQ + AVX512_BF16 + AVX512_VBMI; AMX-BF16 when present. Python checks
// the CPU before loading and picks the path; every function here trusts its arguments.
//
// Ways to multiply, chosen per expert by the number of activation rows and per CPU (see cpu.py):
//  * gemv_*   (1-2 rows, decode): weights decoded straight to fp32 in registers and fed to FMAs.
//    On the Xeons we measured, vdpbf16ps runs at half the MAC rate of fp32 FMA, so fp32 it is.
//  * dp_*     (decode with activations exact in bf16, on AMD Zen 4): weights decoded to bf16
//    (exact) for vdpbf16ps; there it took 0.47-0.79x the fp32 GEMV's time (see cpu.py GEMV_DOT).
//  * amx_*    (more rows): 32 weight rows x 128-256 K values at a time are decoded to bf16
//    (exact for every format) into an L1 buffer, then AMX multiplies them with every 16-row
//    slice of the activations. Group scales that do not fold exactly into bf16 (int4) are
//    applied to the fp32 partial sum of each group ("flush"); w4a8's int4 x e4m3 and nvfp4's
//    e2m1 x e4m3 products are exact in bf16 and fold into the decoded weights.
//  * dequant_bf16 (no AMX, many rows): expand weight tiles to bf16 for a oneDNN GEMM.
//
// The weight bytes are used exactly as stored (no repacked copy). The decode of a block yields
// values in a fixed order that is not K order; the activations are permuted to match once per
// call (M x K, cheap) instead of shuffling weights (N x K) on every call. cpu.py computes the
// two orders ("gemv" and "tile") from the descriptions next to the decoders below.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "llk_common.h"


struct Tables {
    __m512 int4_f32;                           // nibble -> fp32 (vpermps uses the low 4 index bits)
    __m512i int4_bf16;                         // 5-bit index -> bf16 int4 value (vpermw; duplicated)
    __m512i fp8_hi[2], fp8_lo[2];              // 7-bit magnitude -> high/low byte of bf16 (vpermi2b)
    float e4m3[256];
    alignas(64) uint16_t fp4_times_e4m3[256][16];  // bf16(e2m1 value n * e4m3 code c) at [c][n], exact
    alignas(64) float fp4_times_e4m3_f32[256][16];  // the same products in fp32
    __m512i fp4_bf16;                          // nibble -> bf16 e2m1 value (vpermw; duplicated)
};

static Tables make_tables() {
    static const float fp4[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    alignas(64) float i4f[16], f4f[16];
    alignas(64) uint16_t i4b[32];
    alignas(64) uint8_t f8h[128], f8l[128];
    for (int n = 0; n < 16; n++) {
        i4f[n] = (float)(n < 8 ? n : n - 16);
        f4f[n] = n < 8 ? fp4[n] : -fp4[n - 8];
    }
    for (int n = 0; n < 32; n++) i4b[n] = bf16_bits(i4f[n % 16]);
    for (int b = 0; b < 128; b++) {
        const uint16_t v = bf16_bits(e4m3_value(b));
        f8h[b] = v >> 8;
        f8l[b] = v & 0xFF;
    }
    Tables t;
    t.int4_f32 = _mm512_load_ps(i4f);
    t.int4_bf16 = _mm512_load_si512(i4b);
    for (int i = 0; i < 2; i++) {
        t.fp8_hi[i] = _mm512_load_si512(f8h + 64 * i);
        t.fp8_lo[i] = _mm512_load_si512(f8l + 64 * i);
    }
    alignas(64) uint16_t f4b[32];
    for (int n = 0; n < 32; n++) f4b[n] = bf16_bits(f4f[n % 16]);
    t.fp4_bf16 = _mm512_load_si512(f4b);
    for (int b = 0; b < 256; b++) t.e4m3[b] = e4m3_value(b);
    for (int c = 0; c < 256; c++)
        for (int n = 0; n < 16; n++) {
            t.fp4_times_e4m3[c][n] = bf16_bits(f4f[n] * e4m3_value(c));
            t.fp4_times_e4m3_f32[c][n] = f4f[n] * e4m3_value(c);
        }
    return t;
}

static const Tables& tables() {
    static const Tables t = make_tables();
    return t;
}

static inline __mmask64 mask64(int64_t n) {
    return n >= 64 ? ~(__mmask64)0 : n <= 0 ? 0 : (((__mmask64)1 << n) - 1);
}
static inline __mmask16 mask16(int64_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
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

// Up to 16 consecutive e4m3 scales -> fp32 lanes 0..count-1. e4m3 -> fp16 bits (sign to bit 15,
// exponent and mantissa shifted into place) is the value times 2^-8, subnormals included;
// vcvtph2ps is exact and * 256 restores the value.
static inline __m512 load_e4m3(const uint8_t* s, int count) {
    const __m128i b = _mm_maskz_loadu_epi8((__mmask16)((1u << count) - 1), s);
    const __m256i w = _mm256_cvtepu8_epi16(b);
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}

// Up to 16 consecutive scales from index i -> fp32 lanes 0..count-1.
template <int SF>
static inline __m512 load_scales16(const void* s, int64_t i, int count) {
    if (SF == S_F32) return _mm512_maskz_loadu_ps(mask16(count), (const float*)s + i);
    if (SF == S_BF16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask16(count), (const uint16_t*)s + i)), 16));
    return load_e4m3((const uint8_t*)s + i, count);
}

// Software prefetch distance along a weight row (bytes): the hardware prefetcher alone left a
// single-stream GEMV at ~half the memory bandwidth; 4 KiB ahead measured best (2-8 KiB similar).
static const int kPrefetch = 4096;
static inline void prefetch(const uint8_t* p) { _mm_prefetch((const char*)p + kPrefetch, _MM_HINT_T0); }


// ------------------------------------------------------------------------------------------
// decoders to bf16 ("tile" order)
//
// 4-bit: per 16 bytes c (32 values), word j holds K position 32c + 4 (j % 8) + j / 8: the chunk
//   is broadcast to the four 128-bit lanes, each 16-bit word shifted right by 4 (j / 8)
//   (vpsrlvw) so its low 4 bits are one nibble, and vpermw looks that up in a 32-word table.
//   Bit 4 of the index selects the table half: unscaled int4 duplicates the table (no masking
//   needed); scaled tables put the scale of K [0, 16) of the chunk in the low half and of
//   [16, 32) in the high half (nvfp4's 16-value groups).
// fp8:   z[j] word 8L+t holds K position 16L+8j+t (of the 64-value block).

static inline __m512i nibble_words(const uint8_t* p, int64_t rem) {
    const __m512i shifts = _mm512_set_epi16(12, 12, 12, 12, 12, 12, 12, 12, 8, 8, 8, 8, 8, 8, 8, 8,
                                            4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128i v = rem >= 16 ? _mm_loadu_si128((const __m128i*)p) : _mm_maskz_loadu_epi8(mask16(rem), p);
    return _mm512_srlv_epi16(_mm512_broadcast_i32x4(v), shifts);
}

// K [16, 32) of a chunk: word lanes with j % 8 >= 4
static inline __m512i upper_half_bit() {
    return _mm512_set_epi16(16, 16, 16, 16, 0, 0, 0, 0, 16, 16, 16, 16, 0, 0, 0, 0,
                            16, 16, 16, 16, 0, 0, 0, 0, 16, 16, 16, 16, 0, 0, 0, 0);
}

static inline void decode8_bf16(const uint8_t* p, __mmask64 mask, const Tables& t, __m512i z[2]) {
    const __m512i b = _mm512_maskz_loadu_epi8(mask, p);
    __m512i h = _mm512_permutex2var_epi8(t.fp8_hi[0], b, t.fp8_hi[1]);  // uses the low 7 bits
    const __m512i l = _mm512_permutex2var_epi8(t.fp8_lo[0], b, t.fp8_lo[1]);
    h = _mm512_ternarylogic_epi32(h, b, _mm512_set1_epi8((char)0x80), 0xF8);  // h | (b & 0x80)
    z[0] = _mm512_unpacklo_epi8(l, h);
    z[1] = _mm512_unpackhi_epi8(l, h);
}

// One 64-byte block (128 values) of a 4-bit row -> 4 x 32 bf16 in tile order.
// SCALED: multiply the group scales in (exact for nvfp4: e2m1 x e4m3 has <= 6 significant bits;
// rounded to bf16 for int4, which only the no-AMX prefill path does).
template <int WF, int SF, bool SCALED>
static inline void decode4_block(const uint8_t* p, int64_t rem, const void* srow, int64_t blk, int gs,
                                 int64_t ngroups, const Tables& t, __m512i z[4]) {
    if (WF == W_FP4) {
        // 16-value groups: chunk c covers groups 8 blk + 2c and 2c + 1. The 32-word table is the
        // two groups' rows of the exact e2m1 x e4m3 product table, picked by their scale codes.
        const uint8_t* s8 = (const uint8_t*)srow;
        const __m512i gbit = upper_half_bit(), low4 = _mm512_set1_epi16(0x0F);
        for (int c = 0; c < 4; c++) {
            // groups past K (padding of the last block) hold zero weights: any valid scale will do
            const int64_t ga = std::min<int64_t>(8 * blk + 2 * c, ngroups - 1);
            const int64_t gb = std::min<int64_t>(8 * blk + 2 * c + 1, ngroups - 1);
            const __m512i table = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_load_si256((const __m256i*)t.fp4_times_e4m3[s8[ga]])),
                _mm256_load_si256((const __m256i*)t.fp4_times_e4m3[s8[gb]]), 1);
            const __m512i idx = _mm512_ternarylogic_epi32(nibble_words(p + 16 * c, rem - 16 * c), low4, gbit, 0xEA);
            z[c] = _mm512_permutexvar_epi16(idx, table);
        }
        return;
    }
    __m512i table = t.int4_bf16;
    for (int c = 0; c < 4; c++) {
        if (SCALED && (c == 0 || gs < 128)) {  // one scale per chunk (gs 32, 64) or per block
            const float sc = scale_at<SF>(srow, std::min<int64_t>((128 * blk + 32 * c) / gs, ngroups - 1), t);
            const __m512 v = _mm512_mul_ps(t.int4_f32, _mm512_set1_ps(sc));
            table = (__m512i)_mm512_cvtne2ps_pbh(v, v);
        }
        z[c] = _mm512_permutexvar_epi16(nibble_words(p + 16 * c, rem - 16 * c), table);
    }
}

// One 64-byte block of an int4 row (no scales) -> 4 x 32 bf16 in "dp" order: z[j] word w holds
// K 4 w + j. Word w of the block holds K 4w .. 4w + 3 in its four nibbles; shifting it right by 4j
// (an immediate shift) puts nibble j in the low bits, and vpermw reads the low 5 bits of each
// index word (the table is duplicated, so bit 4 does not matter): one lookup per 32 values.
// `table`: the 16 bf16 values, duplicated (t.int4_bf16, w4a8's values times their group scale, or
// t.fp4_bf16).
static inline void decode4_dp(const uint8_t* p, __m512i table, __m512i z[4]) {
    const __m512i v = _mm512_loadu_si512(p);
    z[0] = _mm512_permutexvar_epi16(v, table);
    z[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
    z[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table);
    z[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table);
}

// Decode `nrows` weight rows of expert e, starting at row n0, to bf16 rows of `ld` elements (tile
// order, K padded with zeros).
template <int WF, int SF, bool SCALED>
static void decode_rows_bf16(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n0, int64_t nrows, uint16_t* out,
                             int64_t ld, const Tables& t) {
    const int64_t row_bytes = WF == W_FP8 ? a.K : a.K / 2;
    const int64_t nblk = (row_bytes + 63) / 64;
    const int64_t ngroups = a.gs > 0 ? a.K / a.gs : 0;
    const int64_t el = SF == S_F32 ? 4 : SF == S_BF16 ? 2 : 1;
    for (int64_t r = 0; r < nrows; r++) {
        const int64_t n = n0 + r;
        uint16_t* o = out + r * ld;
        if (n >= a.N) {  // pad rows of the last tile
            memset(o, 0, ld * 2);
            continue;
        }
        const uint8_t* wrow = w.w + e * w.w_estride + n * w.w_ldn;
        const void* srow = SF == S_NONE ? nullptr : (const uint8_t*)w.s + (e * w.s_estride + n * w.s_ldn) * el;
        for (int64_t blk = 0; blk < nblk; blk++) {
            if (WF == W_FP8) {
                __m512i z[2];
                decode8_bf16(wrow + 64 * blk, mask64(row_bytes - 64 * blk), t, z);
                _mm512_storeu_si512(o + 64 * blk, z[0]);
                _mm512_storeu_si512(o + 64 * blk + 32, z[1]);
                continue;
            }
            __m512i z[4];
            decode4_block<WF, SF, SCALED>(wrow + 64 * blk, row_bytes - 64 * blk, srow, blk, a.gs, ngroups, t, z);
            for (int j = 0; j < 4; j++) _mm512_storeu_si512(o + 128 * blk + 32 * j, z[j]);
        }
        const int64_t done = nblk * (WF == W_FP8 ? 64 : 128);
        if (done < ld) memset(o + done, 0, (ld - done) * 2);
    }
}

// ------------------------------------------------------------------------------------------
// GEMV path: fp32 FMAs, weights decoded straight to fp32 ("gemv" order)
//
// 4-bit: per 16 bytes c (32 values): lo[i] = K 32c + 2 b(i), hi[i] = K 32c + 2 b(i) + 1 with
//        b(i) = 4 (i % 4) + i / 4 (the byte that lane i shifts down; see gemv_row).
// fp8:   per 64 bytes: z[j] split into even words (<< 16) and odd words (& 0xFFFF0000):
//        vectors z0.even, z0.odd, z1.even, z1.odd; word w of z[j] is K 16(w/8) + 8j + w%8.

// One weight row against MR activation rows -> res[m] (before alpha/rowscale/tokscale).
template <int WF, int SF, int MR>
static inline void gemv_row(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n, const float* x,
                            const Tables& t, float res[MR]) {
    const uint8_t* wrow = w.w + e * w.w_estride + n * w.w_ldn;
    const int64_t el = SF == S_F32 ? 4 : SF == S_BF16 ? 2 : 1;
    const void* srow = SF == S_NONE ? nullptr : (const uint8_t*)w.s + (e * w.s_estride + n * w.s_ldn) * el;
    __m512 acc[MR][4];
    for (int m = 0; m < MR; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = _mm512_setzero_ps();

    // 4-bit: each 16-byte chunk is broadcast to the 4 lanes; dword lane i shifts byte
    // b(i) = 4 (i % 4) + i / 4 down (vpsrlvd, off the shuffle port); vpermps reads the low 4 bits.
    const __m512i shift_lo = _mm512_set_epi32(24, 24, 24, 24, 16, 16, 16, 16, 8, 8, 8, 8, 0, 0, 0, 0);
    const __m512i shift_hi = _mm512_add_epi32(shift_lo, _mm512_set1_epi32(4));
    if (WF == W_FP8) {
        const int64_t nblk = (a.K + 63) / 64;
        for (int64_t blk = 0; blk < nblk; blk++) {
            __m512i z[2];
            prefetch(wrow + 64 * blk);
            decode8_bf16(wrow + 64 * blk, mask64(a.K - 64 * blk), t, z);
            const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000);
            const __m512 v[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(z[0], 16)),
                                 _mm512_castsi512_ps(_mm512_and_si512(z[0], hi_mask)),
                                 _mm512_castsi512_ps(_mm512_slli_epi32(z[1], 16)),
                                 _mm512_castsi512_ps(_mm512_and_si512(z[1], hi_mask))};
            for (int m = 0; m < MR; m++) {
                const float* xb = x + m * a.ldx + 64 * blk;
                for (int j = 0; j < 4; j++) acc[m][j] = _mm512_fmadd_ps(v[j], _mm512_loadu_ps(xb + 16 * j), acc[m][j]);
            }
        }
    } else if (WF == W_FP4) {
        // nvfp4, 16 values per scale: lane i holds byte b(i) = 4 (i % 4) + i / 4 of the chunk, so
        // lanes with i % 4 < 2 are group 2c and the others group 2c + 1. Each group's 16 values
        // times its scale come from the exact product table row of its scale code; vpermt2ps picks
        // between the two rows with index bit 4.
        const int64_t row_bytes = a.K / 2, nchunk = (row_bytes + 15) / 16;
        const int64_t ngroups = a.K / 16;
        const __m512i gbit = _mm512_set_epi32(16, 16, 0, 0, 16, 16, 0, 0, 16, 16, 0, 0, 16, 16, 0, 0);
        const __m512i low4 = _mm512_set1_epi32(0x0F);
        const uint8_t* s8 = (const uint8_t*)srow;
        auto step = [&](int64_t c, auto J) {
            constexpr int j = decltype(J)::value;
            const __m512i bytes = row_bytes - 16 * c >= 16
                ? _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(wrow + 16 * c)))
                : _mm512_broadcast_i32x4(_mm_maskz_loadu_epi8(mask16(row_bytes - 16 * c), wrow + 16 * c));
            const __m512 ta = _mm512_load_ps(t.fp4_times_e4m3_f32[s8[2 * c]]);
            const __m512 tb = _mm512_load_ps(t.fp4_times_e4m3_f32[s8[std::min<int64_t>(2 * c + 1, ngroups - 1)]]);
            const __m512i ilo = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(bytes, shift_lo), low4, gbit, 0xEA);
            const __m512i ihi = _mm512_ternarylogic_epi32(_mm512_srlv_epi32(bytes, shift_hi), low4, gbit, 0xEA);
            const __m512 lo = _mm512_permutex2var_ps(ta, ilo, tb);
            const __m512 hi = _mm512_permutex2var_ps(ta, ihi, tb);
            for (int m = 0; m < MR; m++) {
                const float* xb = x + m * a.ldx + 32 * c;
                acc[m][j] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[m][j]);
                acc[m][j + 1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[m][j + 1]);
            }
        };
        int64_t c = 0;
        for (; c + 1 < nchunk; c += 2) {
            prefetch(wrow + 16 * c);
            step(c, std::integral_constant<int, 0>{});
            step(c + 1, std::integral_constant<int, 2>{});
        }
        if (c < nchunk) step(c, std::integral_constant<int, 0>{});
    } else {
        // int4 / w4a8: the group scale is folded into the 16-entry table (q * s, as the reference)
        const int64_t row_bytes = a.K / 2, nchunk = row_bytes / 16;  // K % 32 == 0 here
        const int cpg = a.gs / 32;  // chunks per group
        auto step = [&](int64_t c, __m512 lut, auto J) {
            constexpr int j = decltype(J)::value;
            const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(wrow + 16 * c)));
            const __m512 lo = _mm512_permutexvar_ps(_mm512_srlv_epi32(bytes, shift_lo), lut);
            const __m512 hi = _mm512_permutexvar_ps(_mm512_srlv_epi32(bytes, shift_hi), lut);
            for (int m = 0; m < MR; m++) {
                const float* xb = x + m * a.ldx + 32 * c;
                acc[m][j] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xb), acc[m][j]);
                acc[m][j + 1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xb + 16), acc[m][j + 1]);
            }
        };
        if (MR == 1 && cpg % 4 == 0) {
            // batch 1, group size a multiple of 128 (the common case): 16 scales converted per load,
            // one lane broadcast (vpermps) per group, four chunks per loop with fixed accumulators
            const int64_t ngroups = a.K / a.gs;
            __m512 sv = _mm512_setzero_ps();
            for (int64_t g = 0; g < ngroups; g++) {
                if ((g & 15) == 0) sv = load_scales16<SF>(srow, g, (int)std::min<int64_t>(16, ngroups - g));
                const __m512 lut = _mm512_mul_ps(t.int4_f32, _mm512_permutexvar_ps(_mm512_set1_epi32((int)(g & 15)), sv));
                for (int64_t c = g * cpg; c < (g + 1) * cpg; c += 4) {
                    prefetch(wrow + 16 * c);
                    step(c, lut, std::integral_constant<int, 0>{});
                    step(c + 1, lut, std::integral_constant<int, 2>{});
                    step(c + 2, lut, std::integral_constant<int, 0>{});
                    step(c + 3, lut, std::integral_constant<int, 2>{});
                }
            }
            goto reduce;
        }
        auto lut_at = [&](int64_t c) { return _mm512_mul_ps(t.int4_f32, _mm512_set1_ps(scale_at<SF>(srow, c / cpg, t))); };
        __m512 lut = _mm512_setzero_ps();
        int64_t next = 0;  // first chunk of the next group
        int64_t c = 0;
        for (; c + 1 < nchunk; c += 2) {
            prefetch(wrow + 16 * c);
            if (c == next) lut = lut_at(c), next += cpg;
            step(c, lut, std::integral_constant<int, 0>{});
            if (c + 1 == next) lut = lut_at(c + 1), next += cpg;
            step(c + 1, lut, std::integral_constant<int, 2>{});
        }
        if (c < nchunk) {
            if (c == next) lut = lut_at(c);
            step(c, lut, std::integral_constant<int, 0>{});
        }
    }
reduce:
    for (int m = 0; m < MR; m++)
        res[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
}

static inline float factor(const LlkWeight& w, int64_t e, int64_t n) {
    return (w.alpha ? w.alpha[e] : 1.0f) * (w.rowscale ? w.rowscale[e * w.r_estride + n] : 1.0f);
}

static const int kGemvRows = 4;  // activation rows per register tile

template <int WF, int SF>
static void gemv_impl(const LlkArgs& a) {
    const Tables& t = tables();
    gemv_run<kGemvRows>(
        a, WF == W_FP8 ? a.K : a.K / 2,
        [&](auto R, const LlkWeight& w, int64_t e, int64_t n, int64_t r, float* res) {
            gemv_row<WF, SF, decltype(R)::value>(a, w, e, n, (const float*)a.x + r * a.ldx, t, res);
        },
        [](const LlkWeight& w, int64_t e, int64_t n) { return factor(w, e, n); });
}

// ------------------------------------------------------------------------------------------
// bf16 dot-product GEMV (the avx512 path with bf16 activations; see cpu.py GEMV_DOT)
//
// Weights decoded to bf16 (exact for every format: int4 and e2m1 values, fp8, int4 x e4m3) and
// multiplied with vdpbf16ps: a product of two bf16 is exact in fp32 and the sums are fp32. int4's
// bf16 / fp32 group scales, not exact in bf16, multiply each group's fp32 sum (FLUSH); nvfp4's
// e4m3 scales each block's lanes. x is bf16, kp = whole blocks, zero padded, in the "dp" order
// (decode4_dp: one shift and one vpermw per 32 values) for int4 / w4a8 with groups of a multiple
// of 128 and nvfp4 with K a multiple of 128 (cpu.py _dp_order), else in tile order.

// 64-byte blocks of a weight row
template <int WF>
static inline int64_t row_blocks(const LlkArgs& a) {
    return ((WF == W_FP8 ? a.K : a.K / 2) + 63) / 64;
}

// Where a row kernel's prefetches start (it adds each block's offset): in one pass kPrefetch bytes
// on along the row; in a K chunk the same bytes of the row one tile (kGemvTileN rows) on, which the
// next tile reads (see kDpChunkBytes).
template <bool CHUNKED>
static inline const char* prefetch_origin(const uint8_t* wrow, const LlkWeight& w) {
    return (const char*)wrow + (CHUNKED ? kGemvTileN * w.w_ldn : kPrefetch);
}

// The same for the row's scales (el bytes each) in a K chunk: the scales of the row one tile on.
// In one pass the row's scales are read in order and the hardware prefetcher keeps up; in K chunks
// each row's few scales a chunk reads went to memory on demand, every row. With this prefetch, on 2
// Zen 5 cores, a 65536 x 5120 layer, two libraries in one process, calls alternating: nvfp4 (a scale
// per 16 weights) at 8 rows 15.2 -> 11.8 and 19.4 -> 14.1 ms, at 4 rows 10.6 -> 7.5; w4a8 at 8 rows
// 13.2 -> 11.9; int4 1.5-2% (three runs). The integer GEMV (q8v_row) was 2.7% faster in one run and
// 5-9% slower in two, so it goes without.
static inline const char* scale_prefetch_origin(const void* srow, const LlkWeight& w, int64_t el) {
    return (const char*)srow + kGemvTileN * w.s_ldn * el;
}

// One activation row's 128 values in "dp" order (xb) against a decoded block z: the four dot
// products in two fresh chains, their sum (16 fp32 lanes).
static inline LLK_INLINE __m512 block_dot(const __m512i z[4], const uint16_t* xb) {
    __m512 d0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)z[0], (__m512bh)_mm512_loadu_si512(xb));
    __m512 d1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)z[1], (__m512bh)_mm512_loadu_si512(xb + 32));
    d0 = _mm512_dpbf16_ps(d0, (__m512bh)z[2], (__m512bh)_mm512_loadu_si512(xb + 64));
    d1 = _mm512_dpbf16_ps(d1, (__m512bh)z[3], (__m512bh)_mm512_loadu_si512(xb + 96));
    return _mm512_add_ps(d0, d1);
}

// dp_row for int4 in groups of 128 (the default; x in "dp" order), one block per group: per row the
// block's four dot products in two fresh chains, their sum times the group's scale into tot; nothing
// but tot stays live from block to block. A function of its own: inside dp_row, which holds every
// format's accumulators, GCC kept this loop's state on the stack around it (per call: per row and K
// chunk). On 2 Zen 5 cores, a 65536 x 5120 layer, three libraries in one process called in turn
// (min of 13): dp_row's shared accumulators (one chain per row at 5-8 rows, flushed per group) /
// this loop inside dp_row / this function: 8 rows 13.8 / 12.0 / 10.9 ms, 4 rows 7.4 / 6.5 / 6.4,
// 2 rows 4.5 / 4.0 / 4.1, batch 1 3.2 / 3.4 / 3.3 (noise); 202048 x 2048 at 8 rows 19.3 -> 15.5
// (first against last); x and weights in L2, 8 rows: 3.2 / 3.6 / 4.0 vdpbf16ps per ns.
//
// w4a8 (SF e4m3: the group's scale folded into the decode table, exact in bf16) takes it at batch 1
// only, each block's sum added to tot: against dp_row's two accumulators per row carried across the
// blocks, the same layer at 1 row 4.1 -> 3.6, 3.9 -> 3.2 and 3.9 -> 2.9 ms (three runs; 202048 x
// 2048: 5.1 -> 4.7), 2 rows the same, 4 rows 7.2 -> 8.1 and 6.9 -> 8.1, 8 rows 13.2 -> 13.8.
//
// The scales come 16 blocks at a time in one vector load and each block's is broadcast from it
// (vpermps), where a scalar load, a move into a vector register and a broadcast per block had the
// weight loads stall (perf: 49% of the loop's samples on them, against 12% for w4a8's table path).
// On 2 Zen 4 cores (family 25 model 17), int4 at batch 1, the two loops switched at run time in one
// process, calls alternating, best of 7 x 10 (not yet measured on a Zen 5): 65536 x 5120 1.14-1.46x
// the speed in three runs, 202048 x 2048 0.94-1.24x, 16384 x 5120 1.10-1.32x; 4 and 8 rows
// 0.99-1.06x; w4a8 0.93-1.09x (noise).
template <int SF, int MR, bool CHUNKED>
__attribute__((noinline)) static void dp_row_int4_g128(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n,
                                                       const uint16_t* x, const Tables& t, int64_t b0, int64_t b1,
                                                       float* sums, float res[MR]) {
    constexpr bool FOLD = SF == S_E4M3;
    const uint8_t* wrow = w.w + e * w.w_estride + n * w.w_ldn;
    const int64_t el = SF == S_F32 ? 4 : SF == S_BF16 ? 2 : 1;
    const void* srow = (const uint8_t*)w.s + (e * w.s_estride + n * w.s_ldn) * el;
    const int64_t nblk = a.K / 128;
    const char* ahead = prefetch_origin<CHUNKED>(wrow, w);
    const char* s_ahead = scale_prefetch_origin(srow, w, el);
    __m512 tot[MR];
    for (int m = 0; m < MR; m++) tot[m] = b0 > 0 ? _mm512_load_ps(sums + 16 * m) : _mm512_setzero_ps();
    __m512 sv = _mm512_setzero_ps();  // the scales of 16 blocks from blk - i on
    for (int64_t blk = b0; blk < b1; blk++) {
        __m512i z[4];
        _mm_prefetch(ahead + 64 * blk, _MM_HINT_T0);
        if (CHUNKED) _mm_prefetch(s_ahead + el * blk, _MM_HINT_T0);
        const int64_t i = (blk - b0) & 15;
        if (i == 0) sv = load_scales16<SF>(srow, blk, (int)std::min<int64_t>(16, b1 - blk));
        const __m512 sc = _mm512_permutexvar_ps(_mm512_set1_epi32((int)i), sv);
        __m512i table = t.int4_bf16;
        if constexpr (FOLD) {
            const __m512 v = _mm512_mul_ps(t.int4_f32, sc);
            table = (__m512i)_mm512_cvtne2ps_pbh(v, v);
        }
        decode4_dp(wrow + 64 * blk, table, z);
        for (int m = 0; m < MR; m++) {
            const __m512 d = block_dot(z, x + m * a.ldx + 128 * blk);
            tot[m] = FOLD ? _mm512_add_ps(tot[m], d) : _mm512_fmadd_ps(d, sc, tot[m]);
        }
    }
    for (int m = 0; m < MR; m++) {
        if (b1 < nblk) _mm512_store_ps(sums + 16 * m, tot[m]);
        else res[m] = _mm512_reduce_add_ps(tot[m]);
    }
}

// Blocks [b0, b1) of the row only (a K chunk, see dp_tile): `sums` carries each activation row's
// running fp32 sums (16 lanes) from one chunk to the next; the last chunk reduces them into res.
template <int WF, int SF, int MR, bool CHUNKED>
static inline void dp_row(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n, const uint16_t* x,
                          const Tables& t, int64_t b0, int64_t b1, float* sums, float res[MR]) {
    constexpr bool FOLD = WF == W_FP4 || (WF == W_INT4 && SF == S_E4M3);
    constexpr bool FLUSH = WF == W_INT4 && !FOLD;
    if constexpr (FLUSH || (WF == W_INT4 && MR == 1)) {
        if (a.gs == 128) return dp_row_int4_g128<SF, MR, CHUNKED>(a, w, e, n, x, t, b0, b1, sums, res);
    }
    // accumulators per row: enough independent chains, no spills. vdpbf16ps has ~6 cycles of latency
    // and two pipes on Zen 5: one accumulator per row at 8 rows kept fp8 there at ~60% of the speed
    // of two (a 65536 x 5120 layer, 8 rows, alternating: 33-35 -> 20-21 ms); for int4, whose group
    // sums (tot) take 8 more registers, a second one changed nothing measurable at 6 and 8 rows
    constexpr int NA = MR >= 5 ? 2 - FLUSH : 2;
    const uint8_t* wrow = w.w + e * w.w_estride + n * w.w_ldn;
    const int64_t el = SF == S_F32 ? 4 : SF == S_BF16 ? 2 : 1;
    const void* srow = SF == S_NONE ? nullptr : (const uint8_t*)w.s + (e * w.s_estride + n * w.s_ldn) * el;
    const int64_t row_bytes = WF == W_FP8 ? a.K : a.K / 2;
    const int64_t nblk = row_blocks<WF>(a);
    const int64_t ngroups = a.gs > 0 ? a.K / a.gs : 0;
    const char* ahead = prefetch_origin<CHUNKED>(wrow, w);
    const char* s_ahead = SF == S_NONE ? nullptr : scale_prefetch_origin(srow, w, el);
    __m512 acc[MR][NA], tot[MR];
    for (int m = 0; m < MR; m++) {
        for (int j = 0; j < NA; j++) acc[m][j] = _mm512_setzero_ps();
        tot[m] = b0 > 0 ? _mm512_load_ps(sums + 16 * m) : _mm512_setzero_ps();
    }
    auto dot = [&](int64_t off, __m512i z, int j) {  // x columns [off, off + 32) against z
        for (int m = 0; m < MR; m++)
            acc[m][j % NA] = _mm512_dpbf16_ps(acc[m][j % NA], (__m512bh)z, (__m512bh)_mm512_loadu_si512(x + m * a.ldx + off));
    };
    auto flush = [&](int64_t g) LLK_INLINE {  // tot += (this group's sum) * its scale
        const __m512 sc = _mm512_set1_ps(scale_at<SF>(srow, std::min<int64_t>(g, ngroups - 1), t));
        for (int m = 0; m < MR; m++) {
            __m512 sum = acc[m][0];
            for (int j = 1; j < NA; j++) sum = _mm512_add_ps(sum, acc[m][j]);
            tot[m] = _mm512_fmadd_ps(sum, sc, tot[m]);
            for (int j = 0; j < NA; j++) acc[m][j] = _mm512_setzero_ps();
        }
    };
    if (WF == W_FP8) {
        for (int64_t blk = b0; blk < b1; blk++) {
            __m512i z[2];
            _mm_prefetch(ahead + 64 * blk, _MM_HINT_T0);
            decode8_bf16(wrow + 64 * blk, mask64(row_bytes - 64 * blk), t, z);
            dot(64 * blk, z[0], 0);
            dot(64 * blk + 32, z[1], 1);
        }
    } else if (WF == W_INT4 && a.gs % 128 == 0) {
        // whole blocks per group; x in "dp" order. int4: one flush per group; w4a8: the group's
        // e4m3 scale folded into the table (exact in bf16)
        const int64_t bpg = a.gs / 128;
        __m512i table = t.int4_bf16;
        for (int64_t g = b0 / bpg; g < b1 / bpg; g++) {
            if (CHUNKED) _mm_prefetch(s_ahead + el * g, _MM_HINT_T0);
            if (FOLD) {
                const __m512 v = _mm512_mul_ps(t.int4_f32, _mm512_set1_ps(scale_at<SF>(srow, g, t)));
                table = (__m512i)_mm512_cvtne2ps_pbh(v, v);
            }
            for (int64_t blk = g * bpg; blk < (g + 1) * bpg; blk++) {
                __m512i z[4];
                _mm_prefetch(ahead + 64 * blk, _MM_HINT_T0);
                decode4_dp(wrow + 64 * blk, table, z);
                for (int c = 0; c < 4; c++) dot(128 * blk + 32 * c, z[c], c);
            }
            if (FLUSH) flush(g);
        }
    } else if (WF == W_FP4 && a.K % 128 == 0) {
        // nvfp4, "dp" order: e2m1 values to bf16 unscaled; fp32 lane i of a dot product sums words
        // 2i, 2i + 1, i.e. K values of group 8 blk + i / 2 only, so each block's products are
        // summed in fresh registers and multiplied by a vector of the groups' scales (lane i:
        // group i / 2), the way int4's group sums are
        const uint8_t* s8 = (const uint8_t*)srow;
        const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        for (int64_t blk = b0; blk < b1; blk++) {
            __m512i z[4];
            _mm_prefetch(ahead + 64 * blk, _MM_HINT_T0);
            if (CHUNKED) _mm_prefetch(s_ahead + 8 * blk, _MM_HINT_T0);
            decode4_dp(wrow + 64 * blk, t.fp4_bf16, z);
            const __m512 sv = _mm512_permutexvar_ps(pairs, load_e4m3(s8 + 8 * blk, 8));
            for (int m = 0; m < MR; m++) tot[m] = _mm512_fmadd_ps(block_dot(z, x + m * a.ldx + 128 * blk), sv, tot[m]);
        }
    } else {  // (never split into K chunks: dp_chunk_blocks)
        const int64_t kc = (a.K + 31) / 32;  // chunks holding K values
        const int64_t cpg = FLUSH ? a.gs / 32 : kc;
        int64_t left = cpg;                  // chunks before the current group ends
        for (int64_t blk = 0; blk < nblk; blk++) {
            __m512i z[4];
            _mm_prefetch(ahead + 64 * blk, _MM_HINT_T0);
            decode4_block<WF, SF, FOLD>(wrow + 64 * blk, row_bytes - 64 * blk, srow, blk, a.gs, ngroups, t, z);
            for (int c = 0; c < 4; c++) {
                const int64_t cg = 4 * blk + c;
                if (cg >= kc) break;
                dot(32 * cg, z[c], c);
                if (FLUSH && (--left == 0 || cg + 1 == kc)) flush(cg / cpg), left = cpg;
            }
        }
    }
    for (int m = 0; m < MR; m++) {  // (tot holds the scaled sums, acc the unscaled ones: one is zero)
        __m512 sum = tot[m];
        for (int j = 0; j < NA; j++) sum = _mm512_add_ps(sum, acc[m][j]);
        if (b1 < nblk) _mm512_store_ps(sums + 16 * m, sum);
        else res[m] = _mm512_reduce_add_ps(sum);
    }
}

static const int kDpRows = 8;  // activation rows per register tile (one decode feeds them all)

// K chunks. Each dot product loads its 32 activations, so MR rows of x are read once per weight
// row: at 8 rows of K 5120 (80 KiB, more than L1) from L2 (on a 2-core AMD EPYC Zen 5, a loop of
// the int4 kernel with its weights in L2 issued 2.6 vdpbf16ps/ns so, 3.5-5 with x in L1). Above
// kDpChunkBytes of x (fp8: twice that), a tile's weight rows run chunk by chunk of K, each chunk of
// x staying in L1 for all of them; each row's running fp32 sums (MR x 16 lanes) wait in memory
// between chunks (int4's and nvfp4's scaled sums in the same order as in one pass; w4a8's and
// fp8's lanes are added at chunk ends: another fp32 summation order, fixed for a shape). A chunk
// reads only a short piece of each weight row, too short for the prefetch along the row, so while
// a tile runs its chunks each block prefetches the same block of the row one tile on (dp_row
// CHUNKED): the next tile's weights arrive in cache over the time of this one. On that Zen 5, a
// 65536 x 5120 layer at 8 rows, 2 threads, each variant a separate library in one process, calls
// alternating: chunks with the prefetch along the row against chunks with the next tile's, min of
// 11-15 calls: int4 17.0 -> 14.5 ms, w4a8 17.4 -> 13.9, nvfp4 21.4 -> 17.4; fp8 in one pass 21.5 ->
// chunked 14.3 (chunked with the prefetch along the row it had been 1.6x slower than one pass). At 4
// rows int4 10.8 -> 8.2, w4a8 9.8 -> 7.3. fp8 at 2 rows (20 KiB of x) was slower chunked (11.5
// against 8.7 ms), so its threshold is twice the 4-bit one.
static const int64_t kDpChunkBytes = 16 << 10;

// Blocks (64 bytes of a weight row: 128 4-bit values, 64 fp8 ones) per K chunk for MR activation
// rows, or all of them (one pass).
template <int WF>
static int64_t dp_chunk_blocks(const LlkArgs& a, int mr) {
    const int64_t nblk = row_blocks<WF>(a);
    const int64_t x_bytes = (int64_t)mr * a.K * 2;
    if (WF == W_FP8 ? x_bytes <= 2 * kDpChunkBytes
                    : !((WF == W_INT4 && a.gs % 128 == 0) || (WF == W_FP4 && a.K % 128 == 0)) || x_bytes <= kDpChunkBytes)
        return nblk;  // one pass (the 4-bit formats' other layouts always)
    const int64_t values = WF == W_FP8 ? 64 : 128;  // K values per block
    int64_t cb = std::max<int64_t>(1, kDpChunkBytes / (2 * mr * values));
    if (WF == W_INT4) cb = (cb + a.gs / 128 - 1) / (a.gs / 128) * (a.gs / 128);  // whole groups
    return std::min(cb, nblk);
}

// A tile's weight rows [n0, n1) against MR activation rows from r, in K chunks of cb of the row's
// nblk blocks (one pass where cb >= nblk; see kDpChunkBytes): row(chunked, w, n, b0, b1, sums, res)
// runs blocks [b0, b1) of weight row n, `chunked` a std::bool_constant (see dp_row).
template <int MR, class Row>
static void chunked_tile(const LlkArgs& a, int64_t e, int64_t n0, int64_t n1, int64_t r, int64_t nblk, int64_t cb,
                         Row row) {
    auto fac = [&](const LlkWeight& w, int64_t n) { return factor(w, e, n); };
    if (cb >= nblk) {
        gemv_tile_out<MR>(a, n0, n1, r, [&](const LlkWeight& w, int64_t n, float* res) {
            row(std::false_type{}, w, n, 0, nblk, nullptr, res);
        }, fac);  // fmt: skip
        return;
    }
    const bool swiglu = a.w3.w != nullptr;
    alignas(64) float sums[2][kGemvTileN][MR * 16];
    float res[2][kGemvTileN][MR];
    for (int64_t b0 = 0; b0 < nblk; b0 += cb) {
        const int64_t b1 = std::min(b0 + cb, nblk);
        for (int64_t n = n0; n < n1; n++) {
            row(std::true_type{}, a.w1, n, b0, b1, sums[0][n - n0], res[0][n - n0]);
            if (swiglu) row(std::true_type{}, a.w3, n, b0, b1, sums[1][n - n0], res[1][n - n0]);
        }
    }
    gemv_tile_out<MR>(a, n0, n1, r, [&](const LlkWeight& w, int64_t n, float* out) {
        memcpy(out, res[&w == &a.w1 ? 0 : 1][n - n0], MR * sizeof(float));
    }, fac);  // fmt: skip
}

template <int WF, int SF, int MR>
static void dp_tile(const LlkArgs& a, const Tables& t, int64_t e, int64_t n0, int64_t n1, int64_t r) {
    const uint16_t* x = (const uint16_t*)a.x + r * a.ldx;
    chunked_tile<MR>(a, e, n0, n1, r, row_blocks<WF>(a), dp_chunk_blocks<WF>(a, MR),
                     [&](auto chunked, const LlkWeight& w, int64_t n, int64_t b0, int64_t b1, float* sums, float* res) {
                         dp_row<WF, SF, MR, decltype(chunked)::value>(a, w, e, n, x, t, b0, b1, sums, res);
                     });  // fmt: skip
}

template <int WF, int SF>
static void dp_impl(const LlkArgs& a) {
    const Tables& t = tables();
    gemv_tiles<kDpRows>(a, WF == W_FP8 ? a.K : a.K / 2, [&](int64_t e, int64_t n0, int64_t n1, int64_t r, int64_t rows) {
        with_rows<1, kDpRows>(rows, [&](auto R) { dp_tile<WF, SF, decltype(R)::value>(a, t, e, n0, n1, r); });
    });  // fmt: skip
}

// ------------------------------------------------------------------------------------------
// int4 weights times int8 activations, few rows per expert: AVX-512 VNNI in registers
//
// The activations are quantized per 32 values as the reference does (q8_quant32) and laid out per
// 128-value step of a row (kQ8vStep bytes): the step's even K (64 int8), its odd K (64), 16 int32
// lanes with -8 * the sum of 32-value block j at lane 4j (zero elsewhere), and 16 fp32 lanes with
// block j's scale at lanes 4j .. 4j + 3. A 64-byte weight block (128 values; byte b holds K 2b and
// 2b + 1) gives its low nibbles (the even K) and high nibbles (the odd K) as unsigned u = q + 8;
// two vpdpbusd started from the -8 sums leave in lane i the exact int32 sum of q * a over K 8i ..
// 8i + 7 (block i / 4). Converted to fp32, times the block scales, summed over the weight group,
// times the group scale: the AVX2 library's integer GEMV's operations (llk_avx2.cpp q8_row) in
// 512-bit lanes, with under a third of its vector instructions per weight and activation row.

// x[0, 32) -> q (the even K, then the odd K, int8), the scale amax / 127 and the values' sum: the
// reference's operations (kernels/reference.py quantize_int8_blocks), a = 0 where the scale is 0.
static inline void q8_quant32(const float* xb, int8_t q[32], float* scale, int32_t* sum) {
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    const float sc = amax / 127.0f;
    *scale = sc;
    *sum = 0;
    if (sc > 0.0f) {
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        const __m512 s = _mm512_set1_ps(sc), lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
        auto quant = [&](__m512 v) {
            __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            return _mm512_cvtps_epi32(_mm512_min_ps(lim, _mm512_max_ps(nlim, r)));
        };
        const __m512i qe = quant(_mm512_permutex2var_ps(x0, even, x1)), qo = quant(_mm512_permutex2var_ps(x0, odd, x1));
        _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(qe));
        _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(qo));
        *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qe, qo));
    } else {
        memset(q, 0, 32);
    }
}

static const int64_t kQ8vStep = 256;  // bytes of one row's activations per 128 K values

// fp32 rows x [rows, K] (row stride ldx, K % 128 == 0) -> out [rows][K / 128][kQ8vStep].
static void q8v_pack_rows(const float* x, int64_t ldx, int64_t rows, int64_t K, uint8_t* out) {
    const int64_t nsteps = K / 128;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t st = 0; st < nsteps; st++) {
            uint8_t* o = out + (r * nsteps + st) * kQ8vStep;
            int32_t* corr = (int32_t*)(o + 128);
            float* scales = (float*)(o + 192);
            memset(corr, 0, 64);
            for (int j = 0; j < 4; j++) {
                alignas(16) int8_t q[32];
                float sc;
                int32_t sum;
                q8_quant32(x + r * ldx + 128 * st + 32 * j, q, &sc, &sum);
                memcpy(o + 16 * j, q, 16);
                memcpy(o + 64 + 16 * j, q + 16, 16);
                corr[4 * j] = -8 * sum;
                for (int l = 0; l < 4; l++) scales[4 * j + l] = sc;
            }
        }
}

// Steps [s0, s1) of weight row n against MR packed activation rows (xq, xstride bytes apart), sums
// and res as dp_row's (CHUNKED: a K chunk, prefetching the next tile's rows).
template <int SF, int MR, bool CHUNKED>
static inline void q8v_row(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n, const uint8_t* xq,
                           int64_t xstride, const Tables& t, int64_t s0, int64_t s1, float* sums, float res[MR]) {
    const int64_t el = SF == S_F32 ? 4 : SF == S_BF16 ? 2 : 1;
    const uint8_t* wrow = w.w + e * w.w_estride + n * w.w_ldn;
    const void* srow = (const uint8_t*)w.s + (e * w.s_estride + n * w.s_ldn) * el;
    const char* ahead = prefetch_origin<CHUNKED>(wrow, w);
    const int64_t nsteps = a.K / 128, sps = a.gs / 128;  // steps per group
    const __m512i m4 = _mm512_set1_epi8(0x0F), x88 = _mm512_set1_epi8((char)0x88);
    __m512 tot[MR];
    for (int m = 0; m < MR; m++) tot[m] = s0 > 0 ? _mm512_load_ps(sums + 16 * m) : _mm512_setzero_ps();
    for (int64_t g = s0 / sps; g < s1 / sps; g++) {
        __m512 acc[MR];
        for (int m = 0; m < MR; m++) acc[m] = _mm512_setzero_ps();
        for (int64_t st = g * sps; st < (g + 1) * sps; st++) {
            _mm_prefetch(ahead + 64 * st, _MM_HINT_T0);
            const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(wrow + 64 * st), x88);
            const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            for (int m = 0; m < MR; m++) {
                const uint8_t* p = xq + m * xstride + kQ8vStep * st;
                __m512i i32 = _mm512_load_si512(p + 128);
                i32 = _mm512_dpbusd_epi32(i32, lo, _mm512_load_si512(p));
                i32 = _mm512_dpbusd_epi32(i32, hi, _mm512_load_si512(p + 64));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i32), _mm512_load_ps((const float*)(p + 192)), acc[m]);
            }
        }
        const __m512 sc = _mm512_set1_ps(scale_at<SF>(srow, g, t));
        for (int m = 0; m < MR; m++) tot[m] = _mm512_fmadd_ps(acc[m], sc, tot[m]);
    }
    for (int m = 0; m < MR; m++) {
        if (s1 < nsteps) _mm512_store_ps(sums + 16 * m, tot[m]);
        else res[m] = _mm512_reduce_add_ps(tot[m]);
    }
}

template <int SF>
static void q8v_impl(const LlkArgs& a) {
    const Tables& t = tables();
    int64_t first = INT64_MAX, last = 0;
    for (int64_t e = 0; e < a.E; e++)
        if (a.row_end[e] > a.row_start[e]) first = std::min(first, a.row_start[e]), last = std::max(last, a.row_end[e]);
    if (first >= last) return;
    const int64_t nsteps = a.K / 128, xstride = nsteps * kQ8vStep, sps = a.gs / 128;
    thread_local LineVec<uint8_t> buf;  // read with aligned loads (q8v_row)
    buf.resize((size_t)((last - first) * xstride));
    uint8_t* xq = (uint8_t*)buf.data();
    q8v_pack_rows((const float*)a.x + first * a.ldx, a.ldx, last - first, a.K, xq);
    gemv_tiles<kDpRows>(a, a.K / 2, [&](int64_t e, int64_t n0, int64_t n1, int64_t r, int64_t rows) {
        with_rows<1, kDpRows>(rows, [&](auto R) {
            constexpr int MR = decltype(R)::value;
            // one pass, or K chunks as the dot-product GEMV's: kDpChunkBytes of packed activations,
            // rounded up to whole groups
            int64_t cb = nsteps;
            if (MR * xstride > kDpChunkBytes) {
                const int64_t steps = std::max<int64_t>(1, kDpChunkBytes / (MR * kQ8vStep));
                cb = std::min(nsteps, (steps + sps - 1) / sps * sps);
            }
            const uint8_t* x = xq + (r - first) * xstride;
            chunked_tile<MR>(a, e, n0, n1, r, nsteps, cb,
                             [&](auto chunked, const LlkWeight& w, int64_t n, int64_t s0, int64_t s1, float* sums, float* res) {
                                 q8v_row<SF, MR, decltype(chunked)::value>(a, w, e, n, x, xstride, t, s0, s1, sums, res);
                             });  // fmt: skip
        });
    });
}

// ------------------------------------------------------------------------------------------
// AMX path
//
// C[n][m] (16 x 16 fp32) += A[n][k] (16 weight rows x 32 bf16) * B[k][m] (x, VNNI: row i holds
// the 16 pairs x[m][2i], x[m][2i+1]). Tiles: 0-3 accumulators (2 weight halves x 2 row slices),
// 4-5 weights, 6-7 activations.

static const int kAmxTileN = 32;  // weight rows per work item (two A tiles)

// Row pointers (weights, scales) of the kAmxTileN weight rows from n0 of expert e; rows past N
// repeat the last row, and their outputs are dropped.
template <int SF>
static inline void tile_row_pointers(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n0,
                                     const uint8_t* wrows[kAmxTileN], const void* srows[kAmxTileN]) {
    const int64_t el = SF == S_F32 ? 4 : SF == S_BF16 ? 2 : 1;
    for (int r = 0; r < kAmxTileN; r++) {
        const int64_t n = std::min<int64_t>(n0 + r, a.N - 1);
        wrows[r] = w.w + e * w.w_estride + n * w.w_ldn;
        srows[r] = SF == S_NONE ? nullptr : (const uint8_t*)w.s + (e * w.s_estride + n * w.s_ldn) * el;
    }
}

struct TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static bool g_amx_ok = false;

// ldtilecfg of `cfg`. The barrier keeps the stores that fill it: GCC 12 does not count the
// instruction's read of memory, and where the function that fills `cfg` was not inlined it dropped
// them as dead, loading a palette-1 configuration without tiles (tile instructions then #UD).
static inline void tile_loadconfig(const TileConfig* cfg) {
    __asm__ __volatile__("" : : "r"(cfg) : "memory");
    _tile_loadconfig(cfg);
}

// Per-thread scratch buffer `slot`, at least `bytes` long, 64-byte aligned, reused across calls.
static void* scratch(int slot, size_t bytes) {
    struct Buf {
        void* p = nullptr;
        size_t n = 0;
        ~Buf() { free(p); }
    };
    static thread_local Buf bufs[4];
    Buf& b = bufs[slot];
    if (b.n < bytes) {
        free(b.p);
        b.n = (bytes + 4095) & ~(size_t)4095;
        b.p = aligned_alloc(64, b.n);
    }
    return b.p;
}

// Tiles 0-3 (accumulators) 16 x 64 bytes, 4-5 (A) 16 x a_colsb, 6-7 (B) b_rows x 64 bytes.
static void tile_config(int a_colsb, int b_rows) {
    alignas(64) TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = i == 4 || i == 5 ? a_colsb : 64;
        cfg.rows[i] = i >= 6 ? b_rows : 16;
    }
    tile_loadconfig(&cfg);
}

static void amx_thread_init() { tile_config(64, 16); }  // bf16: 16 x 32 values everywhere

// Transpose a 16 x 16 matrix of 32-bit elements held in r[0..15] (rows) in place.
static inline void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    // r[4i + j]: in 128-bit lane L, rows 4i..4i+3 of column 4L + j
    const __m512i lo = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int j = 0; j < 4; j++) {
        // a0 lanes: (col j rows 0-3, col j rows 4-7, col 4+j rows 0-3, col 4+j rows 4-7); a1: cols 8+j, 12+j
        const __m512i a0 = _mm512_permutex2var_epi64(r[j], lo, r[4 + j]), a1 = _mm512_permutex2var_epi64(r[j], hi, r[4 + j]);
        const __m512i b0 = _mm512_permutex2var_epi64(r[8 + j], lo, r[12 + j]), b1 = _mm512_permutex2var_epi64(r[8 + j], hi, r[12 + j]);
        t[j] = _mm512_shuffle_i64x2(a0, b0, 0x44);       // column j, rows 0-15
        t[4 + j] = _mm512_shuffle_i64x2(a0, b0, 0xEE);   // column 4 + j
        t[8 + j] = _mm512_shuffle_i64x2(a1, b1, 0x44);   // column 8 + j
        t[12 + j] = _mm512_shuffle_i64x2(a1, b1, 0xEE);  // column 12 + j
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

// 16 fp32 values rounded to bf16 as round_bf16 (and PyTorch's conversion) does: to nearest, ties to
// even; a NaN stays a NaN of the same sign.
static inline __m256i round_bf16x16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), hi, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

// e^x in 16 lanes: x = n ln2 + r (|r| <= ln2 / 2, ln2 in two parts), e^r by its Taylor polynomial
// of degree 7 (truncation < 1e-8 relative), times 2^n by vscalefps. Within 1 ulp of the C library's
// expf (what the scalar epilogue called, one value at a time) on normal results in [-104, 89],
// sampled every ~10^4th float.
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 silu16(__m512 v) {
    return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), v))));
}

// out rows of expert e, columns [n0, n0 + kAmxTileN) from acc1 (and acc3: SwiGLU), [nn][m] with
// row stride mpad: times each row's factor and each token's scale. 16 x 16 blocks: the epilogue in
// 16 token lanes per weight row, then transposed to rows of the output. On the AMX Xeon the scalar
// form (libm expf per value) took ~a third of an int4 MoE layer's time at 512 rows.
static inline void tile_out(const LlkArgs& a, int64_t e, int64_t n0, int64_t rows, const float* acc1,
                            const float* acc3, int64_t mpad) {
    const int64_t n1 = std::min<int64_t>(n0 + kAmxTileN, a.N);
    for (int64_t m0 = 0; m0 < rows; m0 += 16) {
        const int64_t mrows = std::min<int64_t>(16, rows - m0);
        const __m512 ts = a.tokscale ? _mm512_maskz_loadu_ps(mask16(mrows), a.tokscale + a.row_start[e] + m0)
                                     : _mm512_set1_ps(1.0f);
        for (int64_t nb = n0; nb < n1; nb += 16) {
            __m512i blk[16];
            for (int i = 0; i < 16; i++) {
                const int64_t n = std::min<int64_t>(nb + i, a.N - 1), nn = nb + i - n0;  // past N: not stored
                __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(acc1 + nn * mpad + m0), _mm512_set1_ps(factor(a.w1, e, n))), ts);
                if (acc3) {
                    const __m512 v3 = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(acc3 + nn * mpad + m0),
                                                                  _mm512_set1_ps(factor(a.w3, e, n))), ts);
                    v = _mm512_mul_ps(silu16(v), v3);
                }
                blk[i] = _mm512_castps_si512(v);
            }
            transpose16(blk);  // blk[m]: token m0 + m, lanes the columns nb ..
            const __mmask16 nm = mask16(n1 - nb);
            const int64_t at = (a.row_start[e] + m0) * a.ldo + nb;
            if (a.out16)
                for (int64_t m = 0; m < mrows; m++)
                    _mm256_mask_storeu_epi16(a.out16 + at + m * a.ldo, nm, round_bf16x16(_mm512_castsi512_ps(blk[m])));
            else
                for (int64_t m = 0; m < mrows; m++)
                    _mm512_mask_storeu_ps(a.out + at + m * a.ldo, nm, _mm512_castsi512_ps(blk[m]));
        }
    }
}

// The tile paths' work split: items of kAmxTileN weight rows of expert e, handed out one at a time
// to nt threads, each with its scratch kept across calls (a fresh large allocation would page-fault
// every call): slot 0, `buf_bytes`, for the decoded weights; 1 and 2 the fp32 accumulators of W1
// and W3 (32 x mpad). rows_fn(w, n0, acc, buf, tmp) fills acc for one weight's 32 rows from n0;
// tile_out writes the item. `config` (AMX): each thread loads its tile configuration first and
// releases the tiles at the end. Threads: as many as the weight bytes (`row_bytes` a row) times
// the activation tiles are worth. `prologue` runs in the parallel region first (an omp for in it
// shares its work out, its barrier ends it): one fork and join per call, not two.
template <class Rows, class Prologue>
static void tile_items(const LlkArgs& a, int64_t e, int64_t row_bytes, size_t buf_bytes, void (*config)(), Rows rows_fn,
                       Prologue prologue) {
    const int64_t rows = a.row_end[e] - a.row_start[e], mt = (rows + 15) / 16, mpad = mt * 16;
    const int64_t n_items = (a.N + kAmxTileN - 1) / kAmxTileN;
    const bool swiglu = a.w3.w != nullptr;
    const int nt = (int)std::min<int64_t>(n_items, threads_for(a.N * row_bytes * (swiglu ? 2 : 1) * (1 + mt), a.nthreads));
#pragma omp parallel num_threads(nt)
    {
        prologue();
        if (config) config();
        void* buf = scratch(0, buf_bytes);
        float* acc1 = (float*)scratch(1, kAmxTileN * mpad * 4);
        float* acc3 = swiglu ? (float*)scratch(2, kAmxTileN * mpad * 4) : nullptr;
        alignas(64) float tmp[1024];
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++) {
            const int64_t n0 = i * kAmxTileN;
            rows_fn(a.w1, n0, acc1, buf, tmp);
            if (swiglu) rows_fn(a.w3, n0, acc3, buf, tmp);
            tile_out(a, e, n0, rows, acc1, acc3, mpad);
        }
        if (config) _tile_release();
    }
}

// Activations [rows, ldx] bf16 (tile order) -> VNNI tiles [mt][kc][16 pairs][16 rows] of 32 bits.
static void pack_b(const uint16_t* x, int64_t ldx, int64_t rows, int64_t kp, uint32_t* b) {
    const int64_t mt = (rows + 15) / 16, kc = kp / 32;
    for (int64_t t = 0; t < mt; t++)
        for (int64_t c = 0; c < kc; c++) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t m = 16 * t + i;
                r[i] = m < rows ? _mm512_loadu_si512(x + m * ldx + 32 * c) : _mm512_setzero_si512();
            }
            transpose16(r);
            uint32_t* dst = b + (t * kc + c) * 256;
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(dst + 16 * i, r[i]);
        }
}

// acc[nn][0 .. 16 or 32) += C tiles (partial sums) * the group-g scale of row nn (1 without
// srows); zero the tiles.
template <int SF>
static inline void flush_tiles(int64_t g, const void* const* srows, bool two, float* acc, int64_t mpad, float* tmp,
                               const Tables& t) {
    _tile_stored(0, tmp, 128);
    _tile_stored(2, tmp + 512, 128);
    if (two) {
        _tile_stored(1, tmp + 16, 128);
        _tile_stored(3, tmp + 512 + 16, 128);
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int nn = 0; nn < kAmxTileN; nn++) {
        const __m512 s = _mm512_set1_ps(srows ? scale_at<SF>(srows[nn], g, t) : 1.0f);
        const float* src = tmp + (nn / 16) * 512 + (nn % 16) * 32;
        float* dst = acc + nn * mpad;
        _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_loadu_ps(src), s, _mm512_loadu_ps(dst)));
        if (two) _mm512_storeu_ps(dst + 16, _mm512_fmadd_ps(_mm512_loadu_ps(src + 16), s, _mm512_loadu_ps(dst + 16)));
    }
}

// Decode step `st` (128 K values) of the 32 rows into `out` laid out chunk-major,
// [4 chunks][32 rows][32 bf16], so each A tile (16 rows of one chunk) is 1 KiB contiguous.
// `ahead`: how far along each row to prefetch (bytes). DP (int4 / w4a8 with groups of a multiple
// of 128 values): the shuffle-free decoder of the bf16 GEMV (decode4_dp), x in its "dp" order;
// chunk c of a step then holds K 128 st + 4 w + c, so a 128-value group is still 4 whole chunks.
template <int WF, int SF, bool FOLD, bool DP>
static inline void decode_step(const uint8_t* const* wrows, const void* const* srows, int64_t st, int64_t row_bytes,
                               int gs, int64_t ngroups, uint16_t* out, int64_t ahead, const Tables& t) {
    for (int r = 0; r < kAmxTileN; r++) {
        __m512i z[4];
        if (WF == W_FP8) {
            _mm_prefetch((const char*)wrows[r] + 128 * st + ahead, _MM_HINT_T0);
            _mm_prefetch((const char*)wrows[r] + 128 * st + ahead + 64, _MM_HINT_T0);
            decode8_bf16(wrows[r] + 128 * st, mask64(row_bytes - 128 * st), t, z);
            decode8_bf16(wrows[r] + 128 * st + 64, mask64(row_bytes - 128 * st - 64), t, z + 2);
        } else if (DP) {
            _mm_prefetch((const char*)wrows[r] + 64 * st + ahead, _MM_HINT_T0);
            __m512i table = t.int4_bf16;
            if (FOLD) {  // w4a8: the group's e4m3 scale times the int4 values, exact in bf16
                const __m512 v = _mm512_mul_ps(t.int4_f32, _mm512_set1_ps(scale_at<SF>(srows[r], 128 * st / gs, t)));
                table = (__m512i)_mm512_cvtne2ps_pbh(v, v);
            }
            decode4_dp(wrows[r] + 64 * st, table, z);
        } else {
            _mm_prefetch((const char*)wrows[r] + 64 * st + ahead, _MM_HINT_T0);
            decode4_block<WF, SF, FOLD>(wrows[r] + 64 * st, row_bytes - 64 * st, srows[r], st, gs, ngroups, t, z);
        }
        for (int c = 0; c < 4; c++) _mm512_store_si512(out + (c * kAmxTileN + r) * 32, z[c]);
    }
}

static const int kAmxBlockSteps = 2;  // 128-value steps per decoded block when many row tiles share it
// Prefetch distance of the tile decoder when the accumulators stay in tiles (few activation rows:
// batch decode), where decoding is most of the work: 32 rows are read side by side, so a fixed
// distance along each row, not kPrefetch (which lands a row or two further on). On the AMX Xeon,
// [131072, 5120] at 8 rows, the two builds alternating in one process: 256 bytes took 0.69-0.78x
// the time of kPrefetch (int4, w4a8, fp8, nvfp4); 128 and 512 close to 256, 1024 worse. With many
// rows (prefill) kPrefetch stays: 256 was no faster there and fp8 slower.
static const int kAmxAheadResident = 256;

// acc[nn][m] (32 x mpad fp32) = weight rows [n0, n0 + 32) of expert e times the B tiles (mt tiles
// of 16 activation rows), group scales included.
// K is walked in blocks: a block of the 32 rows is decoded into an L1 buffer (double-buffered,
// so tile loads never wait on the stores just issued, and the decode of the next block overlaps
// the AMX work on this one), then multiplied with every tile of activation rows.
// * up to 2 row tiles: the accumulators stay in tile registers across K (1-step blocks);
// * more: each (block, pair of row tiles) is added into acc (2-step blocks).
// FLUSH (int4): each group's partial sums are scaled into acc (q * scale is not exact in bf16).
template <int WF, int SF, bool FLUSH, bool FOLD, bool DP>
static void amx_rows(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n0, int64_t kp, const uint32_t* b,
                     int64_t mt, float* acc, int64_t mpad, uint16_t* buf, float* tmp, const Tables& t) {
    const int64_t row_bytes = WF == W_FP8 ? a.K : a.K / 2;
    const int64_t kc = kp / 32, steps = (kc + 3) / 4;
    const int64_t ngroups = a.gs > 0 ? a.K / a.gs : 0;
    const int64_t cpg = FLUSH ? a.gs / 32 : kc;  // 32-value chunks per group (tile order keeps them whole)
    const bool resident = mt <= 2;               // accumulators stay in tiles across K
    const int64_t bsteps = resident ? 1 : kAmxBlockSteps;
    const int64_t bchunks = 4 * bsteps, nblocks = (steps + bsteps - 1) / bsteps;
    const uint8_t* wrows[kAmxTileN];
    const void* srows[kAmxTileN];
    tile_row_pointers<SF>(a, w, e, n0, wrows, srows);
    auto decode_block = [&](int64_t blk, uint16_t* out) {
        for (int64_t st = blk * bsteps; st < std::min(steps, (blk + 1) * bsteps); st++)
            decode_step<WF, SF, FOLD, DP>(wrows, srows, st, row_bytes, a.gs, ngroups, out + (st - blk * bsteps) * 4096,
                                      resident ? kAmxAheadResident : kPrefetch, t);
    };
    if (FLUSH || !resident) memset(acc, 0, sizeof(float) * kAmxTileN * mpad);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    decode_block(0, buf);
    for (int64_t blk = 0; blk < nblocks; blk++) {
        uint16_t* cur = buf + (blk & 1) * bchunks * 1024;
        if (blk + 1 < nblocks) decode_block(blk + 1, buf + ((blk + 1) & 1) * bchunks * 1024);
        const int64_t c0 = blk * bchunks, c1 = std::min(kc, c0 + bchunks);
        for (int64_t t0 = 0; t0 < mt; t0 += 2) {
            const bool two = t0 + 1 < mt;
            for (int64_t cg = c0; cg < c1; cg++) {
                const uint16_t* ab = cur + (cg - c0) * 1024;
                _tile_loadd(4, ab, 64);
                _tile_loadd(5, ab + 512, 64);
                _tile_loadd(6, b + (t0 * kc + cg) * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
                if (two) {
                    _tile_loadd(7, b + ((t0 + 1) * kc + cg) * 256, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(3, 5, 7);
                }
                const bool group_end = FLUSH && ((cg + 1) % cpg == 0 || cg + 1 == kc);
                if (group_end || (!resident && cg + 1 == c1))  // (a group cut by the block: same scale twice)
                    flush_tiles<SF>(std::min<int64_t>(cg / cpg, ngroups - 1), FLUSH ? srows : nullptr, two,
                                    acc + 16 * t0, mpad, tmp, t);
            }
        }
    }
    if (resident && !FLUSH) {
        const bool two = mt == 2;
        _tile_stored(0, acc, mpad * 4);
        _tile_stored(2, acc + 16 * mpad, mpad * 4);
        if (two) {
            _tile_stored(1, acc + 16, mpad * 4);
            _tile_stored(3, acc + 16 * mpad + 16, mpad * 4);
        }
    }
}

template <int WF, int SF>
static void amx_impl(const LlkArgs& a, int64_t e, const uint32_t* b, int64_t kp) {
    const Tables& t = tables();
    const int64_t rows = a.row_end[e] - a.row_start[e];
    const int64_t mt = (rows + 15) / 16, mpad = mt * 16;
    // int4's bf16 / fp32 group scales do not fold exactly into bf16 weights: flush per group.
    // w4a8 (int4 x e4m3: <= 7 significant bits) and nvfp4 (e2m1 x e4m3: <= 6) fold exactly.
    constexpr bool FOLD = WF == W_FP4 || (WF == W_INT4 && SF == S_E4M3);
    constexpr bool FLUSH = WF == W_INT4 && !FOLD;
    const bool dp = WF == W_INT4 && a.gs % 128 == 0;  // x in "dp" order (cpu.py _amx_order)
    tile_items(a, e, WF == W_FP8 ? a.K : a.K / 2, 2 * kAmxBlockSteps * 4096 * 2, amx_thread_init,
               [&](const LlkWeight& w, int64_t n0, float* acc, void* buf, float* tmp) {
                   if (dp) amx_rows<WF, SF, FLUSH, FOLD, WF == W_INT4>(a, w, e, n0, kp, b, mt, acc, mpad, (uint16_t*)buf, tmp, t);
                   else amx_rows<WF, SF, FLUSH, FOLD, false>(a, w, e, n0, kp, b, mt, acc, mpad, (uint16_t*)buf, tmp, t);
               },
               [] {});
}

// ------------------------------------------------------------------------------------------
// int4 weights times int8 activations on AMX (TDPBSSD; the explicit int8-activation option)
//
// Activations are quantized per 32 values along K as kernels/reference.py does it (the same fp32
// operations as the AVX2 library's q8_quantize, so the same int8 values): s = amax / 127,
// a = round_half_even(x / s), 0 where s = 0. Each 32-value block thus has a scale of its own per
// row, so a tile product covers one block: C (16 weight rows x 16 activation rows, int32) =
// A (16 weight rows x 32 int8: the int4 values) times B (8 rows of 4-value quads x 16 activation
// rows), an exact integer sum, read out after every block into fp32:
// acc[n][m] += float(C[n][m]) * (s_x[m, block] * s_w[n, group]).
// Tile order: per 16 weight bytes (32 values) the low nibbles (K even) then the high ones (K odd);
// the activations are quantized in K order and written to B in that order.

static const int kQ8BlockChunks = 8;  // 32-value chunks per decoded block: 32 rows x 256 int8
static const int kQ8Ahead = 256;      // prefetch distance along each weight row (bytes)

static void amx_q8_thread_init() { tile_config(32, 8); }  // int8: A 16 rows x 32, B 8 quads x 16 rows

// One 32-value block of fp32 activations -> row m of a B tile (8 quads x 16 rows x 4 int8, tile
// order), its scale and 8 x the sum of its int8 values (llk_dpq8's correction).
static inline void q8_pack_block(const float* xb, int8_t* tile, float* scale, int32_t* sum8, int m) {
    alignas(16) int8_t q[32];
    int32_t sum;
    q8_quant32(xb, q, scale, &sum);
    for (int i = 0; i < 8; i++) memcpy(tile + 64 * i + 4 * m, q + 4 * i, 4);
    *sum8 = 8 * sum;
}

// fp32 rows x [rows, K] (K order, row stride ldx) -> B tiles bq [mt][K / 32][8][16][4], scales
// sx [mt][K / 32][16] and 8 * the sum of each block's values cs (same layout), zero past the rows.
// Called inside a parallel region: its omp for shares the blocks out among the threads, and its
// barrier ends it.
static void q8_pack_rows(const float* x, int64_t ldx, int64_t rows, int64_t K, int8_t* bq, float* sx, int32_t* cs) {
    const int64_t nkb = K / 32, mt = (rows + 15) / 16;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < mt * nkb; i++) {
        const int64_t tt = i / nkb, kb = i % nkb;
        int8_t* tile = bq + i * 512;
        for (int m = 0; m < 16; m++) {
            const int64_t r = 16 * tt + m;
            if (r < rows) {
                q8_pack_block(x + r * ldx + 32 * kb, tile, sx + i * 16 + m, cs + i * 16 + m, m);
            } else {
                for (int j = 0; j < 8; j++) memset(tile + 64 * j + 4 * m, 0, 4);
                sx[i * 16 + m] = 0.0f;
                cs[i * 16 + m] = 0;
            }
        }
    }
}

// Chunks [c0, c1) of the 32 weight rows (int4) -> buf [chunk][32 rows][32 bytes] in tile order (per
// chunk the even K, then the odd K). SIGNED: the int4 values q (AMX's signed tiles), else the
// unsigned nibbles q + 8 (vpdpbusd's unsigned operand). c1 - c0 is even (groups of 64k values).
template <bool SIGNED>
static inline void q8_decode_block(const uint8_t* const* wrows, int64_t c0, int64_t c1, uint8_t* buf) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), x88 = _mm512_set1_epi8((char)0x88), e8 = _mm512_set1_epi8(8);
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (int r = 0; r < kAmxTileN; r++) {
        _mm_prefetch((const char*)wrows[r] + 16 * c0 + kQ8Ahead, _MM_HINT_T0);
        _mm_prefetch((const char*)wrows[r] + 16 * c0 + kQ8Ahead + 64, _MM_HINT_T0);
        for (int64_t c = c0; c < c1; c += 4) {  // 64 bytes: chunks c .. c + 3 (c .. c + 1 at the end)
            const __mmask64 mk = c + 4 <= c1 ? ~0ULL : 0xFFFFFFFFULL;
            // nibble u = q + 8 after the xor; lo / hi: the even / odd K of each chunk
            const __m512i v = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mk, wrows[r] + 16 * c), x88);
            __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            if (SIGNED) lo = _mm512_sub_epi8(lo, e8), hi = _mm512_sub_epi8(hi, e8);
            uint8_t* o = buf + ((c - c0) * kAmxTileN + r) * 32;
            const __m512i p01 = _mm512_permutex2var_epi64(lo, first, hi);  // chunk c, chunk c + 1
            _mm256_store_si256((__m256i*)o, _mm512_castsi512_si256(p01));
            _mm256_store_si256((__m256i*)(o + kAmxTileN * 32), _mm512_extracti64x4_epi64(p01, 1));
            if (c + 4 <= c1) {
                const __m512i p23 = _mm512_permutex2var_epi64(lo, second, hi);
                _mm256_store_si256((__m256i*)(o + 2 * kAmxTileN * 32), _mm512_castsi512_si256(p23));
                _mm256_store_si256((__m256i*)(o + 3 * kAmxTileN * 32), _mm512_extracti64x4_epi64(p23, 1));
            }
        }
    }
}

// acc[nn][m] (32 x mpad fp32) = weight rows [n0, n0 + 32) of expert e times the activation tiles
// bq / their scales sx (mt tiles of 16 rows, [mt][K / 32] each), group scales included. K is
// walked in blocks of kQ8BlockChunks chunks, decoded to int8 into `buf` ([chunk][32 rows][32]),
// then, per activation tile and half of the weight rows, each group's run of chunks is multiplied
// two chunks at a time (two accumulator tiles; the next two chunks take the other two, so their
// products need not wait for this pair's read-out), each read out into 16 fp32 registers: sum over
// the group's blocks of C * s_x, then times s_w into acc.
template <int SF>
static void amx_q8_rows(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n0, const int8_t* bq, const float* sx,
                        int64_t mt, float* acc, int64_t mpad, int8_t* buf, int32_t* tmp, const Tables& t) {
    const int64_t nkb = a.K / 32, cpg = a.gs / 32;  // both even (groups of a multiple of 64 values)
    const uint8_t* wrows[kAmxTileN];
    const void* srows[kAmxTileN];
    tile_row_pointers<SF>(a, w, e, n0, wrows, srows);
    memset(acc, 0, sizeof(float) * kAmxTileN * mpad);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t c0 = 0; c0 < nkb; c0 += kQ8BlockChunks) {
        const int64_t c1 = std::min(nkb, c0 + kQ8BlockChunks);
        q8_decode_block<true>(wrows, c0, c1, (uint8_t*)buf);
        for (int64_t tt = 0; tt < mt; tt++) {
            const int8_t* bt = bq + tt * nkb * 512;
            const float* st = sx + tt * nkb * 16;
            for (int h = 0; h < 2; h++) {
                const int8_t* ah = buf + 16 * h * 32;
                for (int64_t g0 = c0; g0 < c1;) {  // the chunks of one group in this block
                    const int64_t g = g0 / cpg, g1 = std::min(c1, (g + 1) * cpg);
                    __m512 ag[16];
#pragma GCC unroll 16
                    for (int r = 0; r < 16; r++) ag[r] = _mm512_setzero_ps();
                    for (int64_t c = g0; c < g1; c += 2) {
                        _tile_loadd(4, ah + (c - c0) * kAmxTileN * 32, 32);
                        _tile_loadd(6, bt + c * 512, 64);
                        _tile_loadd(5, ah + (c + 1 - c0) * kAmxTileN * 32, 32);
                        _tile_loadd(7, bt + (c + 1) * 512, 64);
                        // accumulator pairs alternate: no wait on the last read-out. Spelled out twice: GCC's
                        // tile intrinsics paste their tile numbers into the instruction text, so no
                        // template parameter or variable can stand for them.
                        if (c % 4 == 0) {
                            _tile_dpbssd(0, 4, 6);
                            _tile_dpbssd(1, 5, 7);
                            _tile_stored(0, tmp, 64);
                            _tile_stored(1, tmp + 256, 64);
                            _tile_zero(0);
                            _tile_zero(1);
                        } else {
                            _tile_dpbssd(2, 4, 6);
                            _tile_dpbssd(3, 5, 7);
                            _tile_stored(2, tmp + 512, 64);
                            _tile_stored(3, tmp + 768, 64);
                            _tile_zero(2);
                            _tile_zero(3);
                        }
                        const __m512 s0 = _mm512_loadu_ps(st + c * 16), s1 = _mm512_loadu_ps(st + (c + 1) * 16);
                        const int32_t* rd = tmp + (c % 4 == 0 ? 0 : 512);
#pragma GCC unroll 16
                        for (int r = 0; r < 16; r++) {
                            ag[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(rd + 16 * r)), s0, ag[r]);
                            ag[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(rd + 256 + 16 * r)), s1, ag[r]);
                        }
                    }
#pragma GCC unroll 16
                    for (int r = 0; r < 16; r++) {
                        float* dst = acc + (16 * h + r) * mpad + 16 * tt;
                        const __m512 sw = _mm512_set1_ps(scale_at<SF>(srows[16 * h + r], g, t));
                        _mm512_storeu_ps(dst, _mm512_fmadd_ps(ag[r], sw, _mm512_loadu_ps(dst)));
                    }
                    g0 = g1;
                }
            }
        }
    }
}

// acc[nn][m] (32 x mpad fp32) = weight rows [n0, n0 + 32) of expert e times the int8 activations
// (bq / sx / cs of q8_pack_rows; mt tiles of 16 rows) without AMX: vpdpbusd in zmm registers
// (AVX-512 VNNI). It multiplies unsigned bytes by signed ones, so the weights enter as their
// nibbles u = q + 8 and each 32-value block's sum is sum(u a) - 8 sum(a), exact in int32, scaled
// as llk_amx_q8 scales it: sum over the group's blocks of sum * s_x, then times s_w. Register
// blocks of 4 weight rows x V tiles of 16 activation rows (each weight quad broadcast).
template <int SF, int V>
static inline void dpq8_block(const uint8_t* buf, int64_t c0, int64_t g0, int64_t g1, int64_t nkb, int64_t t0, int r0,
                              const int8_t* bq, const float* sx, const int32_t* cs, const float sw[4], float* acc,
                              int64_t mpad) {
    __m512 f[4][V];
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < V; v++) f[r][v] = _mm512_setzero_ps();
    for (int64_t c = g0; c < g1; c++) {
        const int32_t* wq = (const int32_t*)(buf + ((c - c0) * kAmxTileN + r0) * 32);  // row r: wq + 8 r
        __m512i d[4][V];
        for (int r = 0; r < 4; r++)
            for (int v = 0; v < V; v++) d[r][v] = _mm512_setzero_si512();
        for (int i = 0; i < 8; i++) {
            __m512i xv[V];
            for (int v = 0; v < V; v++) xv[v] = _mm512_loadu_si512(bq + ((t0 + v) * nkb + c) * 512 + 64 * i);
            for (int r = 0; r < 4; r++) {
                const __m512i wb = _mm512_set1_epi32(wq[8 * r + i]);
                for (int v = 0; v < V; v++) d[r][v] = _mm512_dpbusd_epi32(d[r][v], wb, xv[v]);
            }
        }
        for (int v = 0; v < V; v++) {
            const int64_t blk = ((t0 + v) * nkb + c) * 16;
            const __m512 sc = _mm512_loadu_ps(sx + blk);
            const __m512i k = _mm512_loadu_si512(cs + blk);
            for (int r = 0; r < 4; r++)
                f[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(d[r][v], k)), sc, f[r][v]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int v = 0; v < V; v++) {
            float* dst = acc + (r0 + r) * mpad + 16 * (t0 + v);
            _mm512_storeu_ps(dst, _mm512_fmadd_ps(f[r][v], _mm512_set1_ps(sw[r]), _mm512_loadu_ps(dst)));
        }
}

template <int SF>
static void dpq8_rows(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n0, const int8_t* bq, const float* sx,
                      const int32_t* cs, int64_t mt, float* acc, int64_t mpad, uint8_t* buf, const Tables& t) {
    const int64_t nkb = a.K / 32, cpg = a.gs / 32;
    const uint8_t* wrows[kAmxTileN];
    const void* srows[kAmxTileN];
    tile_row_pointers<SF>(a, w, e, n0, wrows, srows);
    memset(acc, 0, sizeof(float) * kAmxTileN * mpad);
    for (int64_t c0 = 0; c0 < nkb; c0 += kQ8BlockChunks) {
        const int64_t c1 = std::min(nkb, c0 + kQ8BlockChunks);
        q8_decode_block<false>(wrows, c0, c1, buf);
        for (int64_t g0 = c0; g0 < c1;) {  // the chunks of one group in this block
            const int64_t g = g0 / cpg, g1 = std::min(c1, (g + 1) * cpg);
            for (int r0 = 0; r0 < kAmxTileN; r0 += 4) {
                float sw[4];
                for (int r = 0; r < 4; r++) sw[r] = scale_at<SF>(srows[r0 + r], g, t);
                for (int64_t t0 = 0; t0 < mt; t0 += 2) {
                    if (t0 + 1 < mt) dpq8_block<SF, 2>(buf, c0, g0, g1, nkb, t0, r0, bq, sx, cs, sw, acc, mpad);
                    else dpq8_block<SF, 1>(buf, c0, g0, g1, nkb, t0, r0, bq, sx, cs, sw, acc, mpad);
                }
            }
            g0 = g1;
        }
    }
}

// Rows of expert e times int8 activations: the rows packed (q8_pack_rows), then each item of
// weight rows multiplied by AMX int8 tiles (amx_q8_rows) or, without AMX, vpdpbusd (dpq8_rows).
template <int SF, bool AMX>
static void q8_gemm_impl(const LlkArgs& a, int64_t e, int8_t* bq, float* sx, int32_t* cs) {
    const Tables& t = tables();
    const int64_t rows = a.row_end[e] - a.row_start[e];
    const int64_t mt = (rows + 15) / 16, mpad = mt * 16;
    const float* x = (const float*)a.x + a.row_start[e] * a.ldx;
    tile_items(a, e, a.K / 2, kQ8BlockChunks * kAmxTileN * 32, AMX ? amx_q8_thread_init : nullptr,
               [&](const LlkWeight& w, int64_t n0, float* acc, void* buf, float* tmp) {
                   if constexpr (AMX) amx_q8_rows<SF>(a, w, e, n0, bq, sx, mt, acc, mpad, (int8_t*)buf, (int32_t*)tmp, t);
                   else dpq8_rows<SF>(a, w, e, n0, bq, sx, cs, mt, acc, mpad, (uint8_t*)buf, t);
               },
               [&] { q8_pack_rows(x, a.ldx, rows, a.K, bq, sx, cs); });
}

// ------------------------------------------------------------------------------------------
// Many rows without AMX (AVX-512 BF16: AMD Zen 4/5): the AMX path's work split, weight decoder and
// activation tiles, multiplied with vdpbf16ps in zmm registers instead of tiles. The same pairs
// of exact bf16 products summed in fp32 (lane m of a B-tile row is x[m] at a K pair, a weight
// row's dword i is that row at the same pair), int4's group scales applied to each group's fp32
// sums: the numbers of llk_amx up to fp32 summation order.

static const int kDpgVec = 3;   // 16-row activation vectors per register block
static const int kDpgRows = 8;  // weight rows per register block (each pair broadcast)

// acc[r0 + r][16 t0 ...] (row stride mpad) += s[r] * (weight rows r0 + r, r < R, of the decoded
// block wdec [chunk][kAmxTileN rows][32 bf16] times activation tiles t0 .. t0 + MV over chunks
// [c0, c1)); s null: unscaled.
template <int MV, int R = kDpgRows>
static inline void dpg_block(const uint16_t* wdec, const uint32_t* b, int64_t kc, int64_t t0, int64_t r0, int64_t c0,
                             int64_t c1, const float* s, float* acc, int64_t mpad) {
    __m512 c[MV][R];
    for (int v = 0; v < MV; v++)
        for (int r = 0; r < R; r++) c[v][r] = _mm512_setzero_ps();
    for (int64_t cg = c0; cg < c1; cg++) {
        const uint32_t* wc = (const uint32_t*)(wdec + (cg * kAmxTileN + r0) * 32);  // row r at wc + 16 r
        const uint32_t* bc = b + (t0 * kc + cg) * 256;                              // tile t0 + v at bc + v kc 256
        for (int i = 0; i < 16; i++) {
            __m512bh xv[MV];
            for (int v = 0; v < MV; v++) xv[v] = (__m512bh)_mm512_loadu_si512(bc + v * kc * 256 + 16 * i);
            for (int r = 0; r < R; r++) {
                const __m512bh wb = (__m512bh)_mm512_set1_epi32((int)wc[16 * r + i]);
                for (int v = 0; v < MV; v++) c[v][r] = _mm512_dpbf16_ps(c[v][r], xv[v], wb);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const __m512 sc = _mm512_set1_ps(s ? s[r] : 1.0f);
        for (int v = 0; v < MV; v++) {
            float* dst = acc + (r0 + r) * mpad + 16 * (t0 + v);
            _mm512_storeu_ps(dst, _mm512_fmadd_ps(c[v][r], sc, _mm512_loadu_ps(dst)));
        }
    }
}

// Activation vectors of the register block at tile t0 of mt: kDpgVec, but two and two for the last
// four rather than three and one, and a tile alone with twice the weight rows (dpg_rows). A block
// keeps MV x R independent sums in flight, and vdpbf16ps runs at its rate with ~12 or more: with
// 8 (MV 1, R 8) one 8192 x 5120 int4 expert took 1.2x the time at 16 rows, 1.1x at 64 (Zen 5).
static inline int64_t dpg_vectors(int64_t mt, int64_t t0) {
    const int64_t left = mt - t0;
    return left == 4 ? 2 : std::min<int64_t>(kDpgVec, left);
}

// acc[nn][m] (kAmxTileN x mpad fp32) = weight rows [n0, n0 + 32) of expert e times the mt B tiles,
// group scales included (amx_rows' result). The 32 rows are decoded over all of K once into
// wdec (L2: 64 bytes per row and K chunk), then multiplied with every block of activation tiles.
template <int WF, int SF, bool FLUSH, bool FOLD, bool DP>
static void dpg_rows(const LlkArgs& a, const LlkWeight& w, int64_t e, int64_t n0, int64_t kp, const uint32_t* b,
                     int64_t mt, float* acc, int64_t mpad, uint16_t* wdec, const Tables& t) {
    const int64_t row_bytes = WF == W_FP8 ? a.K : a.K / 2;
    const int64_t kc = kp / 32, steps = (kc + 3) / 4;
    const int64_t ngroups = a.gs > 0 ? a.K / a.gs : 0;
    const int64_t cpg = FLUSH ? a.gs / 32 : kc;  // 32-value chunks per group (both orders keep them whole)
    const uint8_t* wrows[kAmxTileN];
    const void* srows[kAmxTileN];
    tile_row_pointers<SF>(a, w, e, n0, wrows, srows);
    for (int64_t st = 0; st < steps; st++)
        decode_step<WF, SF, FOLD, DP>(wrows, srows, st, row_bytes, a.gs, ngroups, wdec + st * 4096, kPrefetch, t);
    memset(acc, 0, sizeof(float) * kAmxTileN * mpad);
    for (int64_t t0 = 0, mv; t0 < mt; t0 += mv) {
        mv = dpg_vectors(mt, t0);
        const int rows = mv == 1 ? 2 * kDpgRows : kDpgRows;
        for (int64_t r0 = 0; r0 < kAmxTileN; r0 += rows) {
            for (int64_t c0 = 0; c0 < kc; c0 += cpg) {
                float s[2 * kDpgRows];
                if (FLUSH)
                    for (int r = 0; r < rows; r++)
                        s[r] = scale_at<SF>(srows[r0 + r], std::min<int64_t>(c0 / cpg, ngroups - 1), t);
                const int64_t c1 = std::min(kc, c0 + cpg);
                const float* sp = FLUSH ? s : nullptr;
                switch (mv) {
                    case 1: dpg_block<1, 2 * kDpgRows>(wdec, b, kc, t0, r0, c0, c1, sp, acc, mpad); break;
                    case 2: dpg_block<2>(wdec, b, kc, t0, r0, c0, c1, sp, acc, mpad); break;
                    default: dpg_block<kDpgVec>(wdec, b, kc, t0, r0, c0, c1, sp, acc, mpad); break;
                }
            }
        }
    }
}

template <int WF, int SF>
static void dpg_impl(const LlkArgs& a, int64_t e, const uint32_t* b, int64_t kp) {
    const Tables& t = tables();
    const int64_t rows = a.row_end[e] - a.row_start[e];
    const int64_t mt = (rows + 15) / 16, mpad = mt * 16;
    constexpr bool FOLD = WF == W_FP4 || (WF == W_INT4 && SF == S_E4M3);  // as amx_impl
    constexpr bool FLUSH = WF == W_INT4 && !FOLD;
    const bool dp = WF == W_INT4 && a.gs % 128 == 0;  // x in "dp" order (cpu.py _amx_order)
    const int64_t steps = (kp / 32 + 3) / 4;
    tile_items(a, e, WF == W_FP8 ? a.K : a.K / 2, steps * 4096 * 2, nullptr, [&](const LlkWeight& w, int64_t n0, float* acc, void* buf, float*) {
        if (dp) dpg_rows<WF, SF, FLUSH, FOLD, WF == W_INT4>(a, w, e, n0, kp, b, mt, acc, mpad, (uint16_t*)buf, t);
        else dpg_rows<WF, SF, FLUSH, FOLD, false>(a, w, e, n0, kp, b, mt, acc, mpad, (uint16_t*)buf, t);
    }, [] {});
}

// ------------------------------------------------------------------------------------------
// Prefill attention (many queries per row over its keys), AVX-512 BF16: scores by vdpbf16ps (the
// exact products of bf16 q and k summed in fp32), the softmax in fp32 (exp16), the weighted sum of
// fp32 probabilities and values (bf16 widened exactly) with fp32 FMAs: kernels.reference's
// decode_attention numbers up to fp32 summation order and e^x's few ulp. Keys are first packed
// per (row, KV head) with 16 keys in a register's lanes, pair i of the head dimension at dword
// i of each lane; each query's dword i is broadcast against them. Each query attends to the keys
// its mask row allows; only the span between its first and last allowed key is computed (a causal
// mask: half the square).

static const int kPaQ = 6;   // query vectors per block (scores and weighted sum)
static const int kPaKB = 4;  // 16-key blocks per register block of scores
static const int kPaDV = 4;  // 16-value vectors of the head dimension per register block of the sum
static const int64_t kPaPos = 16;  // query positions per work item

// sc[r][16 (jb + c) ...] = scale * (query r . keys of 16-key blocks jb + c, c < NB), r < NQ
template <int NQ, int NB>
static inline void pa_scores(const uint32_t* const* qd, const uint32_t* kp, int64_t jb, int64_t half, float scale,
                             float* sc, int64_t ldsc) {
    __m512 acc[NQ][NB];
    for (int r = 0; r < NQ; r++)
        for (int c = 0; c < NB; c++) acc[r][c] = _mm512_setzero_ps();
    const uint32_t* kb = kp + jb * half * 16;
    for (int64_t i = 0; i < half; i++) {
        __m512bh kv[NB];
        for (int c = 0; c < NB; c++) kv[c] = (__m512bh)_mm512_loadu_si512(kb + (c * half + i) * 16);
        for (int r = 0; r < NQ; r++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qd[r][i]);
            for (int c = 0; c < NB; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], kv[c], qb);
        }
    }
    const __m512 vs = _mm512_set1_ps(scale);
    for (int r = 0; r < NQ; r++)
        for (int c = 0; c < NB; c++) _mm512_storeu_ps(sc + r * ldsc + 16 * (jb + c), _mm512_mul_ps(acc[r][c], vs));
}

// out[r][d0, d0 + 16 DV) = sum over keys j in [j0, j1) of p[r][j] * v[j] (fp32), r < NQ
template <int NQ, int DV>
static inline void pa_sum(const float* p, int64_t ldp, const uint16_t* v, int64_t vn, int64_t j0, int64_t j1,
                          int64_t d0, float* out, int64_t ldo) {
    __m512 acc[NQ][DV];
    for (int r = 0; r < NQ; r++)
        for (int c = 0; c < DV; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = j0; j < j1; j++) {
        __m512 vv[DV];
        for (int c = 0; c < DV; c++)
            vv[c] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256((const __m256i*)(v + j * vn + d0 + 16 * c)));
        for (int r = 0; r < NQ; r++) {
            const __m512 pr = _mm512_set1_ps(p[r * ldp + j]);
            for (int c = 0; c < DV; c++) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < NQ; r++)
        for (int c = 0; c < DV; c++) _mm512_storeu_ps(out + r * ldo + d0 + 16 * c, acc[r][c]);
}

template <int NQ>
static void pa_block(const uint32_t* const* qd, const uint32_t* kp, int64_t half, int64_t jb0, int64_t jb1, float scale,
                     float* sc, int64_t ldsc) {
    for (int64_t jb = jb0; jb < jb1; jb += kPaKB)
        with_rows<1, kPaKB>(jb1 - jb, [&](auto B) { pa_scores<NQ, decltype(B)::value>(qd, kp, jb, half, scale, sc, ldsc); });
}

template <int NQ>
static void pa_weighted(const float* p, int64_t ldp, const uint16_t* v, int64_t vn, int64_t j0, int64_t j1, int64_t D,
                        float* out, int64_t ldo) {
    for (int64_t d0 = 0; d0 < D; d0 += 16 * kPaDV)
        with_rows<1, kPaDV>((D - d0) / 16, [&](auto V) { pa_sum<NQ, decltype(V)::value>(p, ldp, v, vn, j0, j1, d0, out, ldo); });
}

// First allowed key and one past the last of a mask row (0, 0: none), 64 bytes at a time.
static inline void mask_span(const uint8_t* m, int64_t L, int64_t* lo, int64_t* hi) {
    int64_t a = L, b = 0;
    for (int64_t j = 0; j < L; j += 64) {
        const __mmask64 in = j + 64 <= L ? ~0ull : (1ull << (L - j)) - 1;
        const uint64_t set = _mm512_test_epi8_mask(_mm512_maskz_loadu_epi8(in, m + j), _mm512_set1_epi8(-1));
        if (set) {
            a = j + __builtin_ctzll(set);
            break;
        }
    }
    for (int64_t j = (L - 1) / 64 * 64; a < L && j + 64 > a; j -= 64) {
        const __mmask64 in = j + 64 <= L ? ~0ull : (1ull << (L - j)) - 1;
        const uint64_t set = _mm512_test_epi8_mask(_mm512_maskz_loadu_epi8(in, m + j), _mm512_set1_epi8(-1));
        if (set) {
            b = j + 64 - __builtin_clzll(set);
            break;
        }
    }
    *lo = a < b ? a : 0;
    *hi = a < b ? b : 0;
}

// ------------------------------------------------------------------------------------------
// activation quantization: the same fp32 operations, in the same order, as kernels/reference.py,
// so the quantized values are bit-identical (built with -ffp-contract=off).

// Round fp32 in [-448, 448] to the nearest e4m3 value (ties to even), returned as fp32.
static inline __m512 round_e4m3(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i sign = _mm512_and_si512(u, _mm512_set1_epi32((int)0x80000000));
    const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
    // normal range: keep 3 mantissa bits, round half to even (a carry bumps the exponent)
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
    const __m512i normal = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7FFFF)), lsb),
                                            _mm512_set1_epi32((int)0xFFF00000));
    // subnormal range (< 2^-6): multiples of 2^-9
    const __m512 af = _mm512_castsi512_ps(a);
    const __m512 sub = _mm512_mul_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(af, _mm512_set1_ps(512.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
        _mm512_set1_ps(1.0f / 512.0f));
    const __mmask16 is_sub = _mm512_cmp_ps_mask(af, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
    const __m512i r = _mm512_mask_mov_epi32(normal, is_sub, _mm512_castps_si512(sub));
    return _mm512_castsi512_ps(_mm512_or_si512(r, sign));
}

static inline float round_e4m3_scalar(float v) {
    return _mm512_cvtss_f32(round_e4m3(_mm512_set1_ps(v)));
}

// Per token: s = clamp(amax, max=ub, min=1e-12) / 448, q = e4m3(clamp(x / s, +-448)).
// Writes q as fp32 (gemv path) or bf16 (tile path); both are exact.
static void quant_fp8_rows(const float* x, int64_t rows, int64_t K, int64_t ldx, float ub, float* out32,
                           uint16_t* out16, int64_t ldo, float* scales, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * ldx;
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16)
            amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(mask16(K - k), xr + k)));
        float s = _mm512_reduce_max_ps(amax);
        if (ub > 0) s = std::min(s, ub);
        s = std::max(s, 1e-12f) / 448.0f;
        scales[r] = s;
        const __m512 vs = _mm512_set1_ps(s), lim = _mm512_set1_ps(448.0f), nlim = _mm512_set1_ps(-448.0f);
        for (int64_t k = 0; k < K; k += 16) {
            const __mmask16 m = mask16(K - k);
            __m512 v = _mm512_div_ps(_mm512_maskz_loadu_ps(m, xr + k), vs);
            v = round_e4m3(_mm512_min_ps(_mm512_max_ps(v, nlim), lim));
            if (out32) _mm512_mask_storeu_ps(out32 + r * ldo + k, m, v);
            if (out16)
                _mm256_mask_storeu_epi16(out16 + r * ldo + k, m,
                                         _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
        }
    }
}

// Per token and 16 values: local = e4m3(min(amax / 6 * g, 448)), scale = local / g,
// q = e2m1(x / scale); out = q * local (exact in bf16; the caller divides by g in fp32).
static void quant_nvfp4_rows(const float* x, int64_t rows, int64_t K, int64_t ldx, const float* g_rows, float* out,
                             int64_t ldo, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 8)
    for (int64_t r = 0; r < rows; r++) {
        const float g = g_rows[r];
        for (int64_t k = 0; k < K; k += 16) {
            const __m512 v = _mm512_loadu_ps(x + r * ldx + k);
            const float amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
            const float local = round_e4m3_scalar(std::min(amax / 6.0f * g, 448.0f));
            float* o = out + r * ldo + k;
            if (!(local > 0.0f)) {
                _mm512_storeu_ps(o, _mm512_setzero_ps());
                continue;
            }
            const float scale = local / g;
            const __m512 q = _mm512_div_ps(v, _mm512_set1_ps(scale));
            const __m512 aq = _mm512_abs_ps(q);
            __m512 rr = _mm512_setzero_ps();
            // ties to even: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
            rr = _mm512_mask_mov_ps(rr, _mm512_cmp_ps_mask(aq, _mm512_set1_ps(0.25f), _CMP_GT_OQ), _mm512_set1_ps(0.5f));
            rr = _mm512_mask_mov_ps(rr, _mm512_cmp_ps_mask(aq, _mm512_set1_ps(0.75f), _CMP_GE_OQ), _mm512_set1_ps(1.0f));
            rr = _mm512_mask_mov_ps(rr, _mm512_cmp_ps_mask(aq, _mm512_set1_ps(1.25f), _CMP_GT_OQ), _mm512_set1_ps(1.5f));
            rr = _mm512_mask_mov_ps(rr, _mm512_cmp_ps_mask(aq, _mm512_set1_ps(1.75f), _CMP_GE_OQ), _mm512_set1_ps(2.0f));
            rr = _mm512_mask_mov_ps(rr, _mm512_cmp_ps_mask(aq, _mm512_set1_ps(2.5f), _CMP_GT_OQ), _mm512_set1_ps(3.0f));
            rr = _mm512_mask_mov_ps(rr, _mm512_cmp_ps_mask(aq, _mm512_set1_ps(3.5f), _CMP_GE_OQ), _mm512_set1_ps(4.0f));
            rr = _mm512_mask_mov_ps(rr, _mm512_cmp_ps_mask(aq, _mm512_set1_ps(5.0f), _CMP_GT_OQ), _mm512_set1_ps(6.0f));
            const __m512i sign = _mm512_and_si512(_mm512_castps_si512(q), _mm512_set1_epi32((int)0x80000000));
            rr = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(rr), sign));
            _mm512_storeu_ps(o, _mm512_mul_ps(rr, _mm512_set1_ps(local)));
        }
    }
}


// ------------------------------------------------------------------------------------------
// bf16 GEMV (layers left in bf16 by a quantization mode: attention, output)
//
// out[m, n] = sum_k x[m, k] W[n, k] for up to 4 bf16 activation rows, accumulated in fp32 with
// vdpbf16ps (products of two bf16 are exact in fp32), written as bf16 (round to nearest even).
// No decode at all: two loads and two dot products per 64 weights, so a core pulls weights far
// faster than memory delivers them and the call runs at the memory roofline.

template <int MR>
static void bf16_tile(const uint16_t* w, int64_t ldw, int64_t n0, int64_t n1, int64_t K, const uint16_t* x,
                      int64_t ldx, uint16_t* out, int64_t ldo) {
    float res[MR][16];
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t* wr = w + n * ldw;
        __m512 acc[MR][2];
        for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            _mm_prefetch((const char*)(wr + k) + kPrefetch, _MM_HINT_T0);
            _mm_prefetch((const char*)(wr + k) + kPrefetch + 64, _MM_HINT_T0);
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k), w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
            for (int m = 0; m < MR; m++) {
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_loadu_si512(x + m * ldx + k));
                acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, (__m512bh)_mm512_loadu_si512(x + m * ldx + k + 32));
            }
        }
        for (; k < K; k += 32) {
            const __mmask32 mk = K - k >= 32 ? 0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(mk, wr + k);
            for (int m = 0; m < MR; m++)
                acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, (__m512bh)_mm512_maskz_loadu_epi16(mk, x + m * ldx + k));
        }
        for (int m = 0; m < MR; m++) res[m][n - n0] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
    }
    const __mmask16 mn = (__mmask16)((1u << (n1 - n0)) - 1);
    for (int m = 0; m < MR; m++)
        _mm256_mask_storeu_epi16(out + m * ldo + n0, mn, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mn, res[m])));
}

static void gemv_bf16(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, const uint16_t* x, int64_t ldx, int64_t M,
                      uint16_t* out, int64_t ldo, int nthreads) {
    const int64_t tile = 16, n_items = (N + tile - 1) / tile;
    const int nt = threads_for(N * K * 2, nthreads);
#pragma omp parallel for schedule(guided) num_threads(nt)
    for (int64_t i = 0; i < n_items; i++) {
        const int64_t n0 = i * tile, n1 = std::min<int64_t>(n0 + tile, N);
        for (int64_t r = 0; r < M; r += 4) {
            const uint16_t* xr = x + r * ldx;
            uint16_t* orow = out + r * ldo;
            switch ((int)std::min<int64_t>(4, M - r)) {
                case 1: bf16_tile<1>(w, ldw, n0, n1, K, xr, ldx, orow, ldo); break;
                case 2: bf16_tile<2>(w, ldw, n0, n1, K, xr, ldx, orow, ldo); break;
                case 3: bf16_tile<3>(w, ldw, n0, n1, K, xr, ldx, orow, ldo); break;
                default: bf16_tile<4>(w, ldw, n0, n1, K, xr, ldx, orow, ldo); break;
            }
        }
    }
}

// ------------------------------------------------------------------------------------------
// C ABI

// Supported combinations (cpu.py checks them first; anything else returns -1):
//   int4 (w4a16 / w4a8): bf16, fp32 or e4m3 group scales, group size 32, 64 or a multiple of 128
//   e2m1 (nvfp4):        e4m3 scales per 16 values
//   e4m3 (fp8 rowwise):  no group scales
static int supported(const LlkArgs* a) {
    if (a->wfmt == W_INT4)
        return a->sfmt != S_NONE && (a->gs == 32 || a->gs == 64 || (a->gs > 0 && a->gs % 128 == 0)) && a->K % a->gs == 0;
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

template <int WF, int SF>
static void dequant_call(const LlkArgs& a, int64_t e, int64_t n0, int64_t n1, uint16_t* out, int64_t ld) {
    const Tables& t = tables();
    const int64_t chunk = 16;
#pragma omp parallel for schedule(static) num_threads(a.nthreads)
    for (int64_t n = n0; n < n1; n += chunk) {
        const int64_t cnt = std::min<int64_t>(chunk, n1 - n);
        decode_rows_bf16<WF, SF, WF != W_FP8>(a, a.w1, e, n, cnt, out + (n - n0) * ld, ld, t);
    }
}

// The int8-activation GEMMs' common entry: checks, the packed activations' buffer (the calling
// thread's scratch), and the scale format as an integral constant for impl(S, bq, sx, cs).
template <class Impl>
static int q8_call(const LlkArgs* a, int64_t e, Impl impl) {
    if (!supported(a) || a->wfmt != W_INT4 || a->gs % 64) return -1;
    const int64_t rows = a->row_end[e] - a->row_start[e];
    if (rows <= 0) return 0;
    const int64_t blocks = (rows + 15) / 16 * (a->K / 32);
    int8_t* bq = (int8_t*)scratch(3, blocks * (512 + 64 + 64));
    float* sx = (float*)(bq + blocks * 512);
    int32_t* cs = (int32_t*)(sx + blocks * 16);
    if (a->sfmt == S_BF16) impl(std::integral_constant<int, S_BF16>{}, bq, sx, cs);
    else if (a->sfmt == S_F32) impl(std::integral_constant<int, S_F32>{}, bq, sx, cs);
    else impl(std::integral_constant<int, S_E4M3>{}, bq, sx, cs);
    return 0;
}

extern "C" {

int llk_abi_version() { return 5; }

// 1 if AMX tiles are usable in this process (asks the kernel for the tile state once).
int llk_amx_init() {
    static int state = -1;
    if (state < 0) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : 0;
        g_amx_ok = state == 1;
    }
    return state;
}

// Few rows per expert: x is fp32 in gemv order.
int llk_gemv(const LlkArgs* a) {
    if (!supported(a)) return -1;
    LLK_DISPATCH(gemv_impl, *a);
    return 0;
}

// llk_gemv for bf16 x in K order and bf16 results (see gemv_bf16_io): decode in one call.
int llk_gemv_bf16io(const LlkArgs* a, const int32_t* perm, int64_t kp, int64_t rows, const uint16_t* x, int64_t ldx,
                    uint16_t* out, int64_t ldo) {
    return gemv_bf16_io<float>(a, perm, kp, rows, x, ldx, out, ldo, llk_gemv);
}

// Few rows per expert, bf16 x in dp or tile order (kp wide; see dp_row): the bf16 dot-product GEMV.
int llk_gemv_dp(const LlkArgs* a) {
    if (!supported(a)) return -1;
    LLK_DISPATCH(dp_impl, *a);
    return 0;
}

// llk_gemv_dp for bf16 x in K order and bf16 results (see gemv_bf16_io).
int llk_gemv_dp_bf16io(const LlkArgs* a, const int32_t* perm, int64_t kp, int64_t rows, const uint16_t* x,
                       int64_t ldx, uint16_t* out, int64_t ldo) {
    return gemv_bf16_io<uint16_t>(a, perm, kp, rows, x, ldx, out, ldo, llk_gemv_dp);
}

// int4 weights with int8 activations (fp32 x in K order, quantized here per 32 values), few rows
// per expert: AVX-512 VNNI (q8v_row). -1 where K or the group size is not a multiple of 128.
int llk_gemv_q8(const LlkArgs* a) {
    if (!supported(a) || a->wfmt != W_INT4 || a->K % 128 || a->gs % 128) return -1;
    LLK_INT4_SCALES(q8v_impl, *a);
    return 0;
}

// llk_gemv_q8 for bf16 x and bf16 results (gemv_bf16_io with perm = 0..K-1).
int llk_gemv_q8_bf16io(const LlkArgs* a, const int32_t* perm, int64_t kp, int64_t rows, const uint16_t* x,
                       int64_t ldx, uint16_t* out, int64_t ldo) {
    return gemv_bf16_io<float>(a, perm, kp, rows, x, ldx, out, ldo, llk_gemv_q8);
}

// Rows of one expert e with AMX: x is bf16 in tile order, `kp` (a multiple of 32) wide.
int llk_amx(const LlkArgs* a, int64_t e, int64_t kp) {
    if (!supported(a) || !g_amx_ok || kp % 32) return -1;
    const int64_t rows = a->row_end[e] - a->row_start[e];
    if (rows <= 0) return 0;
    uint32_t* b = (uint32_t*)scratch(3, ((rows + 15) / 16) * 16 * (kp / 2) * 4);
    pack_b((const uint16_t*)a->x + a->row_start[e] * a->ldx, a->ldx, rows, kp, b);
    LLK_DISPATCH(amx_impl, *a, e, b, kp);
    return 0;
}

// int4 weights (groups of a multiple of 64 values) times int8 activations, rows of expert e with
// AMX: x is fp32 in K order, quantized here per 32 values (see amx_q8_rows).
int llk_amx_q8(const LlkArgs* a, int64_t e) {
    if (!g_amx_ok) return -1;
    return q8_call(a, e, [&](auto S, int8_t* bq, float* sx, int32_t* cs) { q8_gemm_impl<S.value, true>(*a, e, bq, sx, cs); });
}

// llk_amx_q8 without AMX: vpdpbusd in registers (AVX-512 VNNI), same arguments.
int llk_dpq8(const LlkArgs* a, int64_t e) {
    return q8_call(a, e, [&](auto S, int8_t* bq, float* sx, int32_t* cs) { q8_gemm_impl<S.value, false>(*a, e, bq, sx, cs); });
}

// llk_amx without AMX: vdpbf16ps in registers (AVX-512 BF16), same arguments and x order.
int llk_dpgemm(const LlkArgs* a, int64_t e, int64_t kp) {
    if (!supported(a) || kp % 32) return -1;
    const int64_t rows = a->row_end[e] - a->row_start[e];
    if (rows <= 0) return 0;
    uint32_t* b = (uint32_t*)scratch(3, ((rows + 15) / 16) * 16 * (kp / 2) * 4);
    pack_b((const uint16_t*)a->x + a->row_start[e] * a->ldx, a->ldx, rows, kp, b);
    LLK_DISPATCH(dpg_impl, *a, e, b, kp);
    return 0;
}

// Weight rows [n0, n1) of expert e as bf16 in tile order (group scales multiplied in and rounded).
int llk_dequant_bf16(const LlkArgs* a, int64_t e, int64_t n0, int64_t n1, uint16_t* out, int64_t ld) {
    if (!supported(a)) return -1;
    LLK_DISPATCH(dequant_call, *a, e, n0, n1, out, ld);
    return 0;
}

// bf16 W [N, K] (row stride ldw) times M bf16 rows of x (row stride ldx) -> bf16 out (row stride ldo).
void llk_gemv_bf16(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, const uint16_t* x, int64_t ldx, int64_t M,
                   uint16_t* out, int64_t ldo, int nthreads) {
    gemv_bf16(w, ldw, N, K, x, ldx, M, out, ldo, nthreads);
}

void llk_quant_fp8_rows(const float* x, int64_t rows, int64_t K, int64_t ldx, float ub, float* out32,
                        uint16_t* out16, int64_t ldo, float* scales, int nthreads) {
    quant_fp8_rows(x, rows, K, ldx, ub, out32, out16, ldo, scales, nthreads);
}

int llk_quant_nvfp4_rows(const float* x, int64_t rows, int64_t K, int64_t ldx, const float* g_rows, float* out,
                         int64_t ldo, int nthreads) {
    if (K % 16) return -1;
    quant_nvfp4_rows(x, rows, K, ldx, g_rows, out, ldo, nthreads);
    return 0;
}

// Attention of S queries per row over L keys (a prefill): q [B, S, H, D] bf16 with strides qs
// (row, position, head; D contiguous), keys / values [B, L, Hkv, D] bf16 with strides kvs (keys'
// row, slot, head, then values'), mask [B, S, L] bytes (nonzero: may attend), query head h reads KV
// head h / (H / Hkv). out [B, S, H, D] contiguous, bf16 (out_bf16) or fp32; a query with no key to
// attend to gives zeros. -1 where D is not a multiple of 16 or above 512.
int llk_prefill_attention(const uint16_t* q, const int64_t* qs, const uint16_t* k, const uint16_t* v,
                          const int64_t* kvs, const uint8_t* mask, int64_t B, int64_t S, int64_t H, int64_t Hkv,
                          int64_t D, int64_t L, float scale, void* out, int out_bf16, int nthreads) {
    if (D % 16 || D > 512 || H % Hkv || B <= 0 || S <= 0 || L <= 0) return -1;
    const int64_t G = H / Hkv, half = D / 2, nkb = (L + 15) / 16;
    const int64_t ldsc = nkb * 16;
    LineVec<uint32_t> kp((size_t)(B * Hkv * nkb * half * 16));
    const int nt = std::max(1, nthreads);
#pragma omp parallel num_threads(nt)
    {
#pragma omp for schedule(static) collapse(2)
        for (int64_t bg = 0; bg < B * Hkv; bg++)
            for (int64_t jb = 0; jb < nkb; jb++) {
                const int64_t b = bg / Hkv, g = bg % Hkv;
                uint32_t* dst = kp.data() + (bg * nkb + jb) * half * 16;
                for (int lane = 0; lane < 16; lane++) {
                    const int64_t j = jb * 16 + lane;
                    const uint32_t* src = j < L ? (const uint32_t*)(k + b * kvs[0] + j * kvs[1] + g * kvs[2]) : nullptr;
                    for (int64_t i = 0; i < half; i++) dst[i * 16 + lane] = src ? src[i] : 0u;
                }
            }
        LineVec<float> sc((size_t)(kPaQ * ldsc)), acc((size_t)(kPaQ * D));
        const int64_t npb = (S + kPaPos - 1) / kPaPos;
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t bg = 0; bg < B * Hkv; bg++)
            for (int64_t pb = 0; pb < npb; pb++) {
                const int64_t b = bg / Hkv, g = bg % Hkv;
                const uint32_t* kbg = kp.data() + bg * nkb * half * 16;
                const uint16_t* vbg = v + b * kvs[3] + g * kvs[5];
                const int64_t s0 = pb * kPaPos, s1 = std::min(S, s0 + kPaPos);
                const int64_t nvec = (s1 - s0) * G;
                int64_t plo[kPaPos], phi[kPaPos];
                for (int64_t sp = s0; sp < s1; sp++) mask_span(mask + (b * S + sp) * L, L, &plo[sp - s0], &phi[sp - s0]);
                for (int64_t r0 = 0; r0 < nvec; r0 += kPaQ) {
                    const int nq = (int)std::min<int64_t>(kPaQ, nvec - r0);
                    const uint32_t* qd[kPaQ];
                    const uint8_t* mrow[kPaQ];
                    int64_t pos[kPaQ], head[kPaQ];
                    float sums[kPaQ];
                    int64_t j0 = L, j1 = 0;
                    for (int r = 0; r < nq; r++) {
                        pos[r] = s0 + (r0 + r) / G, head[r] = g * G + (r0 + r) % G;
                        qd[r] = (const uint32_t*)(q + b * qs[0] + pos[r] * qs[1] + head[r] * qs[2]);
                        mrow[r] = mask + (b * S + pos[r]) * L;
                        const int64_t lo = plo[pos[r] - s0], hi = phi[pos[r] - s0];
                        if (hi > lo) j0 = std::min(j0, lo), j1 = std::max(j1, hi);
                    }
                    if (j1 > j0) {
                        const int64_t jb0 = j0 / 16, jb1 = (j1 + 15) / 16;
                        with_rows<1, kPaQ>(nq, [&](auto Q) { pa_block<decltype(Q)::value>(qd, kbg, half, jb0, jb1, scale, sc.data(), ldsc); });
                        for (int r = 0; r < nq; r++) {  // softmax under the row's own mask; masked keys weigh 0
                            float* pr = sc.data() + r * ldsc;
                            __m512 mx = _mm512_set1_ps(-INFINITY);
                            for (int64_t j = j0; j < j1; j += 16) {
                                const __mmask16 in = mask16(j1 - j);
                                const __mmask16 ok = _mm_mask_test_epi8_mask(in, _mm_maskz_loadu_epi8(in, mrow[r] + j),
                                                                             _mm_set1_epi8(-1));
                                mx = _mm512_mask_max_ps(mx, ok, mx, _mm512_loadu_ps(pr + j));
                            }
                            const float top = _mm512_reduce_max_ps(mx);
                            const __m512 vm = _mm512_set1_ps(top == -INFINITY ? 0.0f : top);
                            __m512 sum = _mm512_setzero_ps();
                            for (int64_t j = j0; j < j1; j += 16) {
                                const __mmask16 in = mask16(j1 - j);
                                const __mmask16 ok = _mm_mask_test_epi8_mask(in, _mm_maskz_loadu_epi8(in, mrow[r] + j),
                                                                             _mm_set1_epi8(-1));
                                const __m512 e = _mm512_maskz_mov_ps(ok, exp16(_mm512_sub_ps(_mm512_loadu_ps(pr + j), vm)));
                                sum = _mm512_add_ps(sum, e);
                                _mm512_mask_storeu_ps(pr + j, in, e);
                            }
                            sums[r] = _mm512_reduce_add_ps(sum);
                        }
                        with_rows<1, kPaQ>(nq, [&](auto Q) {
                            pa_weighted<decltype(Q)::value>(sc.data(), ldsc, vbg, kvs[4], j0, j1, D, acc.data(), D);
                        });
                    }
                    for (int r = 0; r < nq; r++) {  // a query with no key to attend to: zeros
                        const bool any = j1 > j0 && sums[r] > 0.0f;
                        const __m512 inv = _mm512_set1_ps(any ? 1.0f / sums[r] : 0.0f);
                        for (int64_t d = 0; d < D; d += 16) {
                            const __m512 o = any ? _mm512_mul_ps(_mm512_loadu_ps(acc.data() + r * D + d), inv) : _mm512_setzero_ps();
                            const int64_t at = ((b * S + pos[r]) * H + head[r]) * D + d;
                            if (out_bf16) _mm256_storeu_si256((__m256i*)((uint16_t*)out + at), (__m256i)_mm512_cvtneps_pbh(o));
                            else _mm512_storeu_ps((float*)out + at, o);
                        }
                    }
                }
            }
    }
    return 0;
}

}  // extern "C"
