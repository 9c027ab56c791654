/* kernels.h: the primitives q4_matmul.c, int8_matmul.c and decode_step.c share: y = x W^T with W in 4 bits
 * and x in two int8 digits per group of 32 (like llama.cpp's Q4_1 x Q8_1), RMSNorm, e^x. Written once
 * against simd.h's sixteen-lane vectors, so every build target computes the same bits.
 *
 * Layout (q4.py packs it): W[n, k] = d[n, g] * q[n, k] + m[n, g], q in 0..15, g = k / 32; output rows in
 * tiles of 16.
 *
 *   qpack  uint8  [N/16, K/8, 64]:     qpack[t, o, 4j + b] = q[16t + j, 8o + b] | q[16t + j, 8o + 4 + b] << 4
 *   scales fp16   [N/16, K/32, 2, 16]: scales[t, g, 0, j] = d[16t + j, g], scales[t, g, 1, j] = m[16t + j, g]
 *
 * so one 64-byte load holds 8 inputs of 16 rows, and one dot4 adds 4 products into each row's lane: no
 * horizontal sums. Each row of x is quantized per group of 32 (xq = high + low / 254, dx = max|x| / 127;
 * quantize_row), and
 *
 *   y[r, n] = sum_g d[n, g] * dx[r, g] * sum_{k in g} q[n, k] * xq[r, k]  +  m[n, g] * sum_{k in g} x[r, k]
 *
 * (the zero term takes the exact float sum of x). The integer sums stay below 15 * 127 * 32 * 255 < 2^24.
 * A row's result never depends on the other rows, nor on which thread computes it.
 */
#ifndef KVG_KERNELS_H
#define KVG_KERNELS_H

#include <stdlib.h>

#include "simd.h"

/* 16 floats v / step, rounded to nearest even, into 16 int8 at out; returns what rounding left over:
 * v - step * round(v / step), in one rounding. */
KVG_INLINE f16 round_int8(f16 v, f16 inverse, f16 step, int8_t *out) {
    const i16 q = i_round(f_mul(v, inverse));
    i_store_i8(out, q);
    return f_fnmadd(f_from_i(q), step, v);
}

/* One row of x into two int8 digits per input (xq[0..K) high, xq[K..2K) low: x ~ dx * (high + low / 254)),
 * dx (step per group) and sx (float sum per group). The low digit takes what the high one's rounding left
 * (at most dx / 2, so it fits 127 steps of dx / 254): about 15 bits of precision per input, where one
 * int8 digit alone lost too much on SmolLM2's outlier channels (a group's other inputs keep 7 bits of the
 * outlier's magnitude). */
KVG_INLINE void quantize_row(const float *x, int K, int8_t *xq, float *dx, float *sx) {
    for (int g = 0; g < K / 32; g++) {
        const f16 a = f_load(x + 32 * g), b = f_load(x + 32 * g + 16);
        const float amax = hmax(f_max(f_abs(a), f_abs(b)));
        const float d = amax / 127.0f, inv = amax > 0 ? 127.0f / amax : 0.0f;
        const f16 step = f_set1(d), inverse = f_set1(inv);
        const f16 ra = round_int8(a, inverse, step, xq + 32 * g);
        const f16 rb = round_int8(b, inverse, step, xq + 32 * g + 16);
        const f16 low_step = f_set1(d / 254.0f), low_inverse = f_set1(inv * 254.0f);
        round_int8(ra, low_inverse, low_step, xq + K + 32 * g);
        round_int8(rb, low_inverse, low_step, xq + K + 32 * g + 16);
        dx[g] = d;
        sx[g] = hsum(f_add(a, b));
    }
}

/* ROWS rows of x against one tile of 16 output rows; ROWS is a constant at each call site, so the
 * accumulators stay in registers and the tile's unpacked weights are reused by every row. With ``res``
 * (laid out as ``out``), each result is ``res + x W^T``. */
KVG_INLINE void tile_rows(const uint8_t *qt, const uint16_t *st, const int8_t *xq, const float *dx,
                          const float *sx, int K, float *out, int ldo, const float *res, const int ROWS) {
    const int G = K / 32;
    f16 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = f_zero();
    for (int g = 0; g < G; g++) {
        b64 w[8];
        for (int o = 0; o < 4; o++) {
            const b64 v = b_load(qt + (size_t)(4 * g + o) * 64);
            w[2 * o] = b_nibble_lo(v);
            w[2 * o + 1] = b_nibble_hi(v);
        }
        const f16 d = f_from_half(st + 32 * g), m = f_from_half(st + 32 * g + 16);
        for (int r = 0; r < ROWS; r++) {
            const int8_t *xr = xq + (size_t)r * 2 * K + 32 * g;
            i16 high = i_zero(), low_sum = i_zero();
            for (int o = 0; o < 4; o++) {
                int32_t x4[2], l4[2]; /* inputs 8o..8o+3, 8o+4..8o+7, and their low digits */
                memcpy(x4, xr + 8 * o, sizeof x4);
                memcpy(l4, xr + K + 8 * o, sizeof l4);
                high = dot4_u4s8(high, w[2 * o], b_set4(x4[0]));
                high = dot4_u4s8(high, w[2 * o + 1], b_set4(x4[1]));
                low_sum = dot4_u4s8(low_sum, w[2 * o], b_set4(l4[0]));
                low_sum = dot4_u4s8(low_sum, w[2 * o + 1], b_set4(l4[1]));
            }
            /* high * 254 + low: below 2^24, so exact in int32 and in the float conversion */
            const i16 sum = i_add(i_mullo(high, i_set1(254)), low_sum);
            const f16 scale = f_mul(d, f_set1(dx[r * G + g] / 254.0f));
            acc[r] = f_fmadd(f_from_i(sum), scale, acc[r]);
            acc[r] = f_fmadd(m, f_set1(sx[r * G + g]), acc[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) { /* res + acc: the same sum as torch's ``hidden + projection`` */
        if (res) acc[r] = f_add(f_load(res + (size_t)r * ldo), acc[r]);
        f_store(out + (size_t)r * ldo, acc[r]);
    }
}

/* Tiles t0 .. t1 - 1 of out [M, N] (= res + x W^T with res, which may be out itself) from x already
 * quantized (xq, dx, sx as quantize_row leaves them, M rows). */
KVG_INLINE void q4_tile_range(const int8_t *xq, const float *dx, const float *sx, int M, int K,
                              const uint8_t *qpack, const uint16_t *scales, int N, float *out, const float *res,
                              int t0, int t1) {
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
KVG_INLINE void rms_norm_row(const float *xr, const float *w, float eps, int K, float *o) {
    f16 squares = f_zero();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        const f16 v = f_load(xr + k);
        squares = f_fmadd(v, v, squares);
    }
    float sum = hsum(squares);
    for (int j = k; j < K; j++) sum += xr[j] * xr[j];
    const float inv = 1.0f / sqrtf(sum / K + eps);
    const f16 s = f_set1(inv);
    for (k = 0; k + 16 <= K; k += 16) f_store(o + k, f_mul(f_mul(f_load(xr + k), s), f_load(w + k)));
    for (int j = k; j < K; j++) o[j] = xr[j] * inv * w[j];
}

/* e^x for 16 floats (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-7 polynomial in r, scaled by
 * 2^n): within 2 ulp; very negative x gives 0, as the softmax's masked scores need. */
KVG_INLINE f16 exp16(f16 x) {
    x = f_max(f_min(x, f_set1(88.72f)), f_set1(-104.0f));
    const f16 n = f_round(f_mul(x, f_set1(1.44269504088896341f)));
    f16 r = f_fnmadd(n, f_set1(0.693359375f), x);
    r = f_fnmadd(n, f_set1(-2.12194440e-4f), r);
    f16 p = f_set1(1.9875691500e-4f);
    p = f_fmadd(p, r, f_set1(1.3981999507e-3f));
    p = f_fmadd(p, r, f_set1(8.3334519073e-3f));
    p = f_fmadd(p, r, f_set1(4.1665795894e-2f));
    p = f_fmadd(p, r, f_set1(1.6666665459e-1f));
    p = f_fmadd(p, r, f_set1(5.0000001201e-1f));
    p = f_fmadd(p, f_mul(r, r), f_add(r, f_set1(1.0f)));
    return f_scale2(p, n);
}

/* sum a[i] * b[i] over D floats (D % 16 == 0): sixteen lanes of fmadd, then hsum. */
KVG_INLINE float dot(const float *a, const float *b, int D) {
    f16 sum = f_zero();
    for (int i = 0; i < D; i += 16) sum = f_fmadd(f_load(a + i), f_load(b + i), sum);
    return hsum(sum);
}

#endif
