/* simd.h: sixteen-lane vectors whose every operation is specified lane by lane, for three targets.
 *
 * The kernels (kernels.h, q4_matmul.c, int8_matmul.c, decode_step.c) are written once against these types,
 * and the library is built once per target (library.py):
 *
 *   KVG_ISA 2  AVX-512 F/BW/VL + VNNI + F16C + FMA   one register per vector       (x86-64-v4 + avx512vnni)
 *   KVG_ISA 1  AVX2 + FMA + F16C                     two 8-lane halves, lo and hi  (x86-64-v3)
 *   KVG_ISA 0  plain C                               arrays of 16, loops           (any CPU: the reference)
 *
 * Why one set of semantics: every float operation here is one IEEE-754 binary32 operation per lane, rounded
 * to nearest even (fmadd and fnmadd round once, as the FMA instructions and C's fmaf do), and the horizontal
 * sums take one fixed tree (hsum). Integer dot products are exact. So a kernel gives the same bits on every
 * CPU and with every target it runs on; tests/engine/test_native_kernels.py compares the targets bit for
 * bit wherever the CPU runs more than one. Nothing is left to the compiler: the library is built with
 * -ffp-contract=off and without -ffast-math, so no a * b + c is fused behind our back.
 *
 * Byte vectors (b64) hold 64 bytes; lane i of a 32-bit vector covers bytes 4i .. 4i + 3 (AVX2: lo holds
 * bytes 0..31 and lanes 0..7, hi bytes 32..63 and lanes 8..15).
 */
#ifndef KVG_SIMD_H
#define KVG_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef KVG_ISA
#error "KVG_ISA must be 0 (plain C), 1 (AVX2) or 2 (AVX-512 VNNI): library.py sets it"
#endif

#define KVG_INLINE static inline __attribute__((always_inline))

#if KVG_ISA == 2 /* ------------------------------------------------------------------------- AVX-512 */
#include <immintrin.h>

typedef __m512 f16;
typedef __m512i i16;
typedef __m512i b64;

KVG_INLINE f16 f_load(const float *p) { return _mm512_loadu_ps(p); }
KVG_INLINE void f_store(float *p, f16 a) { _mm512_storeu_ps(p, a); }
KVG_INLINE f16 f_set1(float x) { return _mm512_set1_ps(x); }
KVG_INLINE f16 f_zero(void) { return _mm512_setzero_ps(); }
KVG_INLINE f16 f_add(f16 a, f16 b) { return _mm512_add_ps(a, b); }
KVG_INLINE f16 f_sub(f16 a, f16 b) { return _mm512_sub_ps(a, b); }
KVG_INLINE f16 f_mul(f16 a, f16 b) { return _mm512_mul_ps(a, b); }
KVG_INLINE f16 f_div(f16 a, f16 b) { return _mm512_div_ps(a, b); }
KVG_INLINE f16 f_max(f16 a, f16 b) { return _mm512_max_ps(a, b); }
KVG_INLINE f16 f_min(f16 a, f16 b) { return _mm512_min_ps(a, b); }
KVG_INLINE f16 f_abs(f16 a) { return _mm512_abs_ps(a); }
KVG_INLINE f16 f_fmadd(f16 a, f16 b, f16 c) { return _mm512_fmadd_ps(a, b, c); }
KVG_INLINE f16 f_fnmadd(f16 a, f16 b, f16 c) { return _mm512_fnmadd_ps(a, b, c); }
KVG_INLINE f16 f_round(f16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* a * 2^n, n integral (|n| <= 152 here), rounded once */
KVG_INLINE f16 f_scale2(f16 a, f16 n) { return _mm512_scalef_ps(a, n); }
KVG_INLINE f16 f_from_i(i16 a) { return _mm512_cvtepi32_ps(a); }
KVG_INLINE i16 i_round(f16 a) { return _mm512_cvtps_epi32(a); } /* nearest even */
KVG_INLINE f16 f_from_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* lanes 0 .. n - 1 of p (0 < n < 16), the others 0; and their store */
KVG_INLINE f16 f_load_n(const float *p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
KVG_INLINE void f_store_n(float *p, f16 a, int n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), a); }
KVG_INLINE void f_lanes(float *out, f16 a) { _mm512_storeu_ps(out, a); }

KVG_INLINE i16 i_zero(void) { return _mm512_setzero_si512(); }
KVG_INLINE i16 i_set1(int32_t x) { return _mm512_set1_epi32(x); }
KVG_INLINE i16 i_add(i16 a, i16 b) { return _mm512_add_epi32(a, b); }
KVG_INLINE i16 i_sub(i16 a, i16 b) { return _mm512_sub_epi32(a, b); }
KVG_INLINE i16 i_mullo(i16 a, i16 b) { return _mm512_mullo_epi32(a, b); }
/* lane i, saturated to int8, into out[i] */
KVG_INLINE void i_store_i8(int8_t *out, i16 a) { _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(a)); }

KVG_INLINE b64 b_load(const void *p) { return _mm512_loadu_si512(p); }
KVG_INLINE b64 b_set4(int32_t four_bytes) { return _mm512_set1_epi32(four_bytes); }
KVG_INLINE b64 b_nibble_lo(b64 a) { return _mm512_and_si512(a, _mm512_set1_epi8(0x0F)); }
KVG_INLINE b64 b_nibble_hi(b64 a) { return _mm512_and_si512(_mm512_srli_epi16(a, 4), _mm512_set1_epi8(0x0F)); }
/* acc[i] + sum_{b < 4} u[4i + b] * s[4i + b]: u unsigned bytes, s signed; exact. dot4_u4s8 asks u < 16
 * (the AVX2 target sums pairs in int16, which then cannot saturate); dot4_u8s8 takes any u. */
KVG_INLINE i16 dot4_u8s8(i16 acc, b64 u, b64 s) { return _mm512_dpbusd_epi32(acc, u, s); }
KVG_INLINE i16 dot4_u4s8(i16 acc, b64 u, b64 s) { return _mm512_dpbusd_epi32(acc, u, s); }

/* hsum's tree (below the three targets) from the 8 sums of lanes i and i + 8. */
KVG_INLINE float hsum8(__m256 t) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 pairs = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(pairs) + _mm_cvtss_f32(_mm_shuffle_ps(pairs, pairs, _MM_SHUFFLE(1, 1, 1, 1)));
}
KVG_INLINE float hsum(f16 a) {
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a), high));
}
KVG_INLINE float hmax(f16 a) { return _mm512_reduce_max_ps(a); }

#elif KVG_ISA == 1 /* ------------------------------------------------------------------------- AVX2 */
#include <immintrin.h>

typedef struct { __m256 lo, hi; } f16;
typedef struct { __m256i lo, hi; } i16;
typedef struct { __m256i lo, hi; } b64;

#define KVG_F2(expr_lo, expr_hi) ((f16){expr_lo, expr_hi})
KVG_INLINE f16 f_load(const float *p) { return KVG_F2(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
KVG_INLINE void f_store(float *p, f16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
KVG_INLINE f16 f_set1(float x) { return KVG_F2(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
KVG_INLINE f16 f_zero(void) { return KVG_F2(_mm256_setzero_ps(), _mm256_setzero_ps()); }
KVG_INLINE f16 f_add(f16 a, f16 b) { return KVG_F2(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
KVG_INLINE f16 f_sub(f16 a, f16 b) { return KVG_F2(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
KVG_INLINE f16 f_mul(f16 a, f16 b) { return KVG_F2(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
KVG_INLINE f16 f_div(f16 a, f16 b) { return KVG_F2(_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)); }
KVG_INLINE f16 f_max(f16 a, f16 b) { return KVG_F2(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
KVG_INLINE f16 f_min(f16 a, f16 b) { return KVG_F2(_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)); }
KVG_INLINE f16 f_abs(f16 a) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    return KVG_F2(_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude));
}
KVG_INLINE f16 f_fmadd(f16 a, f16 b, f16 c) {
    return KVG_F2(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
KVG_INLINE f16 f_fnmadd(f16 a, f16 b, f16 c) {
    return KVG_F2(_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi));
}
KVG_INLINE f16 f_round(f16 a) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return KVG_F2(_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode));
}
/* 2^e for integral e in [-126, 127], built in the exponent field */
KVG_INLINE __m256 pow2_8(__m256 e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23));
}
/* a * 2^n in two exact steps and one rounding, as scalef: a * 2^n1 stays normal (n1 = clamp(n, -125, 127)),
 * then * 2^(n - n1), whose exponent is in [-27, 1], rounds the exact product once (to a subnormal too). */
KVG_INLINE __m256 scale2_8(__m256 a, __m256 n) {
    const __m256 n1 = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-125.0f)), _mm256_set1_ps(127.0f));
    return _mm256_mul_ps(_mm256_mul_ps(a, pow2_8(n1)), pow2_8(_mm256_sub_ps(n, n1)));
}
KVG_INLINE f16 f_scale2(f16 a, f16 n) { return KVG_F2(scale2_8(a.lo, n.lo), scale2_8(a.hi, n.hi)); }
KVG_INLINE f16 f_from_i(i16 a) { return KVG_F2(_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)); }
KVG_INLINE i16 i_round(f16 a) { return (i16){_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
KVG_INLINE f16 f_from_half(const uint16_t *p) {
    return KVG_F2(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                  _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8))));
}
KVG_INLINE f16 f_load_n(const float *p, int n) {
    float lanes[16] = {0};
    memcpy(lanes, p, sizeof(float) * (size_t)n);
    return f_load(lanes);
}
KVG_INLINE void f_store_n(float *p, f16 a, int n) {
    float lanes[16];
    f_store(lanes, a);
    memcpy(p, lanes, sizeof(float) * (size_t)n);
}
KVG_INLINE void f_lanes(float *out, f16 a) { f_store(out, a); }

KVG_INLINE i16 i_zero(void) { return (i16){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
KVG_INLINE i16 i_set1(int32_t x) { return (i16){_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
KVG_INLINE i16 i_add(i16 a, i16 b) { return (i16){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
KVG_INLINE i16 i_sub(i16 a, i16 b) { return (i16){_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
KVG_INLINE i16 i_mullo(i16 a, i16 b) { return (i16){_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
KVG_INLINE void i_store_i8(int8_t *out, i16 a) {
    /* int32 -> int16 -> int8, each saturating; packs work within 128-bit halves, the permute puts the
     * sixteen results in lane order */
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128((__m128i *)out, bytes);
}

KVG_INLINE b64 b_load(const void *p) {
    return (b64){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)p + 1)};
}
KVG_INLINE b64 b_set4(int32_t four_bytes) { return (b64){_mm256_set1_epi32(four_bytes), _mm256_set1_epi32(four_bytes)}; }
KVG_INLINE b64 b_nibble_lo(b64 a) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    return (b64){_mm256_and_si256(a.lo, low), _mm256_and_si256(a.hi, low)};
}
KVG_INLINE b64 b_nibble_hi(b64 a) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    return (b64){_mm256_and_si256(_mm256_srli_epi16(a.lo, 4), low), _mm256_and_si256(_mm256_srli_epi16(a.hi, 4), low)};
}
/* pairs in int16 (maddubs), then pairs of pairs in int32 (madd): exact while a pair stays below 2^15,
 * which u < 16 guarantees (2 * 15 * 128) */
KVG_INLINE __m256i dot4_small_8(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
KVG_INLINE i16 dot4_u4s8(i16 acc, b64 u, b64 s) {
    return (i16){dot4_small_8(acc.lo, u.lo, s.lo), dot4_small_8(acc.hi, u.hi, s.hi)};
}
/* any u: u = 16 * high nibble + low nibble, each a small product, the high one scaled after the sum */
KVG_INLINE __m256i dot4_any_8(__m256i acc, __m256i u, __m256i s) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i lo = dot4_small_8(_mm256_setzero_si256(), _mm256_and_si256(u, low), s);
    const __m256i hi = dot4_small_8(_mm256_setzero_si256(), _mm256_and_si256(_mm256_srli_epi16(u, 4), low), s);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_slli_epi32(hi, 4), lo));
}
KVG_INLINE i16 dot4_u8s8(i16 acc, b64 u, b64 s) {
    return (i16){dot4_any_8(acc.lo, u.lo, s.lo), dot4_any_8(acc.hi, u.hi, s.hi)};
}

KVG_INLINE float hsum8(__m256 t) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 pairs = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(pairs) + _mm_cvtss_f32(_mm_shuffle_ps(pairs, pairs, _MM_SHUFFLE(1, 1, 1, 1)));
}
KVG_INLINE float hsum(f16 a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
KVG_INLINE float hmax(f16 a) {
    const __m256 t = _mm256_max_ps(a.lo, a.hi);
    const __m128 q = _mm_max_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 pairs = _mm_max_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
    return fmaxf(_mm_cvtss_f32(pairs), _mm_cvtss_f32(_mm_shuffle_ps(pairs, pairs, _MM_SHUFFLE(1, 1, 1, 1))));
}

#else /* ------------------------------------------------------------------------------------- plain C */

typedef struct { float v[16]; } f16;
typedef struct { int32_t v[16]; } i16;
typedef struct { uint8_t v[64]; } b64;

#define KVG_LANES(type, expr) do { type r_; for (int i = 0; i < 16; i++) r_.v[i] = (expr); return r_; } while (0)
KVG_INLINE f16 f_load(const float *p) { f16 r; memcpy(r.v, p, sizeof r.v); return r; }
KVG_INLINE void f_store(float *p, f16 a) { memcpy(p, a.v, sizeof a.v); }
KVG_INLINE f16 f_set1(float x) { KVG_LANES(f16, x); }
KVG_INLINE f16 f_zero(void) { KVG_LANES(f16, 0.0f); }
KVG_INLINE f16 f_add(f16 a, f16 b) { KVG_LANES(f16, a.v[i] + b.v[i]); }
KVG_INLINE f16 f_sub(f16 a, f16 b) { KVG_LANES(f16, a.v[i] - b.v[i]); }
KVG_INLINE f16 f_mul(f16 a, f16 b) { KVG_LANES(f16, a.v[i] * b.v[i]); }
KVG_INLINE f16 f_div(f16 a, f16 b) { KVG_LANES(f16, a.v[i] / b.v[i]); }
/* as the instructions: the second operand when either is NaN or both are zero */
KVG_INLINE f16 f_max(f16 a, f16 b) { KVG_LANES(f16, a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
KVG_INLINE f16 f_min(f16 a, f16 b) { KVG_LANES(f16, a.v[i] < b.v[i] ? a.v[i] : b.v[i]); }
KVG_INLINE f16 f_abs(f16 a) { KVG_LANES(f16, fabsf(a.v[i])); }
KVG_INLINE f16 f_fmadd(f16 a, f16 b, f16 c) { KVG_LANES(f16, fmaf(a.v[i], b.v[i], c.v[i])); }
KVG_INLINE f16 f_fnmadd(f16 a, f16 b, f16 c) { KVG_LANES(f16, fmaf(-a.v[i], b.v[i], c.v[i])); }
KVG_INLINE f16 f_round(f16 a) { KVG_LANES(f16, nearbyintf(a.v[i])); }
KVG_INLINE f16 f_scale2(f16 a, f16 n) { KVG_LANES(f16, ldexpf(a.v[i], (int)n.v[i])); }
KVG_INLINE f16 f_from_i(i16 a) { KVG_LANES(f16, (float)a.v[i]); }
KVG_INLINE i16 i_round(f16 a) { KVG_LANES(i16, (int32_t)lrintf(a.v[i])); }
/* IEEE binary16 to binary32: exact (subnormals, infinities and NaN included) */
KVG_INLINE float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    float magnitude;
    if (exponent == 0) magnitude = ldexpf((float)mantissa, -24);
    else if (exponent == 31) magnitude = mantissa ? NAN : INFINITY;
    else magnitude = ldexpf((float)(mantissa | 0x400), (int)exponent - 25);
    uint32_t bits;
    memcpy(&bits, &magnitude, sizeof bits);
    bits |= sign;
    memcpy(&magnitude, &bits, sizeof bits);
    return magnitude;
}
KVG_INLINE f16 f_from_half(const uint16_t *p) { KVG_LANES(f16, half_to_float(p[i])); }
KVG_INLINE f16 f_load_n(const float *p, int n) { KVG_LANES(f16, i < n ? p[i] : 0.0f); }
KVG_INLINE void f_store_n(float *p, f16 a, int n) { memcpy(p, a.v, sizeof(float) * (size_t)n); }
KVG_INLINE void f_lanes(float *out, f16 a) { f_store(out, a); }

KVG_INLINE i16 i_zero(void) { KVG_LANES(i16, 0); }
KVG_INLINE i16 i_set1(int32_t x) { KVG_LANES(i16, x); }
KVG_INLINE i16 i_add(i16 a, i16 b) { KVG_LANES(i16, a.v[i] + b.v[i]); }
KVG_INLINE i16 i_sub(i16 a, i16 b) { KVG_LANES(i16, a.v[i] - b.v[i]); }
KVG_INLINE i16 i_mullo(i16 a, i16 b) { KVG_LANES(i16, a.v[i] * b.v[i]); }
KVG_INLINE void i_store_i8(int8_t *out, i16 a) {
    for (int i = 0; i < 16; i++) out[i] = (int8_t)(a.v[i] > 127 ? 127 : a.v[i] < -128 ? -128 : a.v[i]);
}

KVG_INLINE b64 b_load(const void *p) { b64 r; memcpy(r.v, p, sizeof r.v); return r; }
KVG_INLINE b64 b_set4(int32_t four_bytes) {
    b64 r;
    for (int i = 0; i < 16; i++) memcpy(r.v + 4 * i, &four_bytes, 4);
    return r;
}
KVG_INLINE b64 b_nibble_lo(b64 a) { b64 r; for (int i = 0; i < 64; i++) r.v[i] = a.v[i] & 15; return r; }
KVG_INLINE b64 b_nibble_hi(b64 a) { b64 r; for (int i = 0; i < 64; i++) r.v[i] = a.v[i] >> 4; return r; }
KVG_INLINE i16 dot4_u8s8(i16 acc, b64 u, b64 s) {
    KVG_LANES(i16, acc.v[i] + u.v[4 * i] * (int8_t)s.v[4 * i] + u.v[4 * i + 1] * (int8_t)s.v[4 * i + 1] +
                       u.v[4 * i + 2] * (int8_t)s.v[4 * i + 2] + u.v[4 * i + 3] * (int8_t)s.v[4 * i + 3]);
}
KVG_INLINE i16 dot4_u4s8(i16 acc, b64 u, b64 s) { return dot4_u8s8(acc, u, s); }

KVG_INLINE float hsum(f16 a) {
    float h[8], q[4];
    for (int i = 0; i < 8; i++) h[i] = a.v[i] + a.v[i + 8];
    for (int i = 0; i < 4; i++) q[i] = h[i] + h[i + 4];
    return (q[0] + q[2]) + (q[1] + q[3]);
}
KVG_INLINE float hmax(f16 a) {
    float top = a.v[0];
    for (int i = 1; i < 16; i++) top = a.v[i] > top ? a.v[i] : top;
    return top;
}

#endif

/* Every target's hsum takes one tree: lanes i and i + 8, then i and i + 4, then (0 + 2) + (1 + 3): the
 * tree of GCC's _mm512_reduce_add_ps, written out so that no compiler picks another. hmax: any order gives
 * the same value (no NaN reaches it). */

#endif
