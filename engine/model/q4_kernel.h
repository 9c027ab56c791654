/* q4_kernel.h: y = x W^T, W in 4 bits, x in two int8 digits per group of 32: like llama.cpp's Q4_1 x Q8_1, AVX-512 VNNI.
 *
 * The primitives that q4_kernel.c (one matmul, RMSNorm) and decode_step.c (a whole decode step) share, all
 * static inline. Built and loaded by q4_native.py (plain C, no torch headers: it compiles in about a
 * second). Layout (q4_native.py packs it): W[n, k] = d[n, g] * q[n, k] + m[n, g], q in
 * 0..15, g = k / 32; output rows in tiles of 16.
 *
 *   qpack  uint8  [N/16, K/8, 64]:     qpack[t, o, 4j + b] = q[16t + j, 8o + b] | q[16t + j, 8o + 4 + b] << 4
 *   scales fp16   [N/16, K/32, 2, 16]: scales[t, g, 0, j] = d[16t + j, g], scales[t, g, 1, j] = m[16t + j, g]
 *
 * so one 64-byte load holds 8 inputs of 16 rows, and one vpdpbusd adds 4 products into each row's lane: no
 * horizontal sums. Each row of x is quantized per group of 32 (xq = high + low / 254, dx = max|x| / 127;
 * quantize_row), and
 *
 *   y[r, n] = sum_g d[n, g] * dx[r, g] * sum_{k in g} q[n, k] * xq[r, k]  +  m[n, g] * sum_{k in g} x[r, k]
 *
 * (the zero term takes the exact float sum of x). The integer sums stay below 15 * 127 * 32 * 255 < 2^24.
 * A row's result never depends on the other rows. Output tiles are shared among the OpenMP threads; the
 * process's OpenMP runtime is torch's own (the same libgomp.so.1), so torch.set_num_threads applies here too.
 */
#ifndef KVGUARD_Q4_KERNEL_H
#define KVGUARD_Q4_KERNEL_H

#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))


/* 16 floats v / step, rounded to nearest even (the default rounding mode), into 16 int8 at out; returns
 * what rounding left over: v - step * round(v / step). */
TARGET static inline __m512 round_int8(__m512 v, __m512 inverse, __m512 step, int8_t *out) {
    __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inverse));
    _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(q));
    return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(q), step, v);
}

/* One row of x into two int8 digits per input (xq[0..K) high, xq[K..2K) low: x ~ dx * (high + low / 254)),
 * dx (step per group) and sx (float sum per group). The low digit takes what the high one's rounding left
 * (at most dx / 2, so it fits 127 steps of dx / 254): about 15 bits of precision per input, where one
 * int8 digit alone lost too much on SmolLM2's outlier channels (a group's other inputs keep 7 bits of the
 * outlier's magnitude). */
TARGET static inline void quantize_row(const float *x, int K, int8_t *xq, float *dx, float *sx) {
    for (int g = 0; g < K / 32; g++) {
        __m512 a = _mm512_loadu_ps(x + 32 * g), b = _mm512_loadu_ps(x + 32 * g + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
        __m512 step = _mm512_set1_ps(d), inverse = _mm512_set1_ps(inv);
        __m512 ra = round_int8(a, inverse, step, xq + 32 * g);
        __m512 rb = round_int8(b, inverse, step, xq + 32 * g + 16);
        __m512 low_step = _mm512_set1_ps(d / 254.0f), low_inverse = _mm512_set1_ps(inv * 254.0f);
        round_int8(ra, low_inverse, low_step, xq + K + 32 * g);
        round_int8(rb, low_inverse, low_step, xq + K + 32 * g + 16);
        dx[g] = d;
        sx[g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
}

/* ROWS rows of x against one tile of 16 output rows; ROWS is a constant at each call site, so the
 * accumulators stay in registers and the tile's unpacked weights are reused by every row. With ``res``
 * (laid out as ``out``), each result is ``res + x W^T``. */
TARGET static inline __attribute__((always_inline)) void tile_rows(
    const uint8_t *qt, const uint16_t *st, const int8_t *xq, const float *dx, const float *sx, int K,
    float *out, int ldo, const float *res, const int ROWS) {
    const int G = K / 32;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        __m512i w[8];
        for (int o = 0; o < 4; o++) {
            __m512i v = _mm512_loadu_si512(qt + (size_t)(4 * g + o) * 64);
            w[2 * o] = _mm512_and_si512(v, low);
            w[2 * o + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + 32 * g)));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(st + 32 * g + 16)));
        for (int r = 0; r < ROWS; r++) {
            const int8_t *xr = xq + (size_t)r * 2 * K + 32 * g;
            __m512i high = _mm512_setzero_si512(), low_sum = _mm512_setzero_si512();
            for (int o = 0; o < 4; o++) {
                const int32_t *x4 = (const int32_t *)(xr + 8 * o);  /* inputs 8o..8o+3, 8o+4..8o+7 */
                const int32_t *l4 = (const int32_t *)(xr + K + 8 * o);  /* their low digits */
                high = _mm512_dpbusd_epi32(high, w[2 * o], _mm512_set1_epi32(x4[0]));
                high = _mm512_dpbusd_epi32(high, w[2 * o + 1], _mm512_set1_epi32(x4[1]));
                low_sum = _mm512_dpbusd_epi32(low_sum, w[2 * o], _mm512_set1_epi32(l4[0]));
                low_sum = _mm512_dpbusd_epi32(low_sum, w[2 * o + 1], _mm512_set1_epi32(l4[1]));
            }
            /* high * 254 + low: below 2^24, so exact in int32 and in the float conversion */
            __m512i sum = _mm512_add_epi32(_mm512_mullo_epi32(high, _mm512_set1_epi32(254)), low_sum);
            __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(dx[r * G + g] / 254.0f));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) {  /* res + acc: the same sum as torch's ``hidden + projection`` */
        if (res) acc[r] = _mm512_add_ps(_mm512_loadu_ps(res + (size_t)r * ldo), acc[r]);
        _mm512_storeu_ps(out + (size_t)r * ldo, acc[r]);
    }
}

/* Tiles t0 .. t1 - 1 of out [M, N] (= res + x W^T with res, which may be out itself) from x already
 * quantized (xq, dx, sx as quantize_row leaves them, M rows). */
TARGET static inline void q4_tile_range(const int8_t *xq, const float *dx, const float *sx, int M, int K,
                                        const uint8_t *qpack, const uint16_t *scales, int N, float *out,
                                        const float *res, int t0, int t1) {
    const int G = K / 32;
    for (int t = t0; t < t1; t++) {
        const uint8_t *qt = qpack + (size_t)t * K * 8;
        const uint16_t *st = scales + (size_t)t * G * 32;
        const size_t at = 16 * (size_t)t;
        int r = 0;
        for (; r + 4 <= M; r += 4)
            tile_rows(qt, st, xq + (size_t)r * 2 * K, dx + r * G, sx + r * G, K, out + r * (size_t)N + at, N,
                      res ? res + r * (size_t)N + at : NULL, 4);
        for (; r < M; r++)
            tile_rows(qt, st, xq + (size_t)r * 2 * K, dx + r * G, sx + r * G, K, out + r * (size_t)N + at, N,
                      res ? res + r * (size_t)N + at : NULL, 1);
    }
}

/* One row: out[K] = x * w / sqrt(mean(x^2) + eps) (RMSNorm, as Hugging Face computes it in float32). */
TARGET static inline void rms_norm_row(const float *xr, const float *w, float eps, int K, float *o) {
    __m512 squares = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 v = _mm512_loadu_ps(xr + k);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    float sum = _mm512_reduce_add_ps(squares);
    for (int j = k; j < K; j++) sum += xr[j] * xr[j];
    const float inv = 1.0f / sqrtf(sum / K + eps);
    const __m512 s = _mm512_set1_ps(inv);
    for (k = 0; k + 16 <= K; k += 16) {
        __m512 normed = _mm512_mul_ps(_mm512_loadu_ps(xr + k), s);
        _mm512_storeu_ps(o + k, _mm512_mul_ps(normed, _mm512_loadu_ps(w + k)));
    }
    for (int j = k; j < K; j++) o[j] = xr[j] * inv * w[j];
}

#endif
