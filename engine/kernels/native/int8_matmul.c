/* y = x W^T * scale for an int8 weight in Int8Linear's own layout (weights.py: qweight int8 [N, K] row-major,
 * one float32 scale per output row), x in two int8 digits per group of 32 (kernels.h's quantize_row):
 * SmolLM2's tied LM head (49152 x 576, Q8_0 in the file) at a few decoding rows, where it is a third of a
 * step on torch's weight-only kernel.
 *
 * dot4_u8s8 multiplies unsigned bytes by signed ones, so the activation digits go in offset by 128 (h + 128,
 * l + 128, both in 1..255) and the offset comes back out with the weights' own sums (a third dot4, by
 * ones, shared by every row of x):
 *
 *   254 sum h w + sum l w  =  254 sum (h + 128) w + sum (l + 128) w - 128 * 255 * sum w
 *
 * One 64-byte load holds 64 inputs of one output row; lane i of a dot4 sums inputs 4i .. 4i + 3, so
 * lanes 0-7 are the chunk's first group of 32 and lanes 8-15 its second, each scaled by its group's step
 * before the float sum. Per lane the integer stays below 4 * 127 * 127 * 255 < 2^24: exact in float32.
 */
#include "kernels.h"

int native_threads(void); /* decode_step.c: one thread while the machine's other cores are taken */

#define INT8_MAX_ROWS 8 /* rows of x per call: their weights stay in registers across the rows */

/* out [M, N] = (x [M, K] W^T) * scales[N]; M <= INT8_MAX_ROWS, K % 64 == 0, K <= 1024 (the caller checks).
 * Returns -1 (nothing computed) when its scratch cannot be allocated. */
int int8_matmul(const float *x, int M, int K, const int8_t *w, const float *scales, int N, float *out) {
    const int G = K / 32, chunks = K / 64;
    uint8_t *xu = malloc((size_t)M * 2 * K);  /* each row's high digits + 128, then its low digits + 128 */
    float *steps = malloc(sizeof(float) * (size_t)M * chunks * 16);  /* per row, chunk and lane: dx / 254 */
    float *dx = malloc(sizeof(float) * (size_t)M * G), *sx = malloc(sizeof(float) * (size_t)M * G);
    if (!xu || !steps || !dx || !sx || M > INT8_MAX_ROWS || K > 1024 || K % 64) {
        free(xu), free(steps), free(dx), free(sx);
        return -1;
    }
    for (int r = 0; r < M; r++) {
        int8_t *digits = (int8_t *)xu + (size_t)r * 2 * K;
        quantize_row(x + (size_t)r * K, K, digits, dx + (size_t)r * G, sx + (size_t)r * G);
        for (int k = 0; k < 2 * K; k++) xu[(size_t)r * 2 * K + k] = (uint8_t)(digits[k] + 128);
        for (int c = 0; c < chunks; c++)
            for (int i = 0; i < 16; i++) steps[((size_t)r * chunks + c) * 16 + i] = dx[r * G + 2 * c + i / 8] / 254.0f;
    }
#pragma omp parallel for schedule(static) num_threads(native_threads())
    for (int n = 0; n < N; n++) {
        b64 weights[16];
        i16 sums[16];
        const b64 ones = b_set4(0x01010101);
        for (int c = 0; c < chunks; c++) {
            weights[c] = b_load(w + (size_t)n * K + 64 * c);
            sums[c] = i_mullo(dot4_u8s8(i_zero(), ones, weights[c]), i_set1(128 * 255));
        }
        for (int r = 0; r < M; r++) {
            const uint8_t *high = xu + (size_t)r * 2 * K, *low = high + K;
            f16 acc = f_zero();
            for (int c = 0; c < chunks; c++) {
                const i16 h = dot4_u8s8(i_zero(), b_load(high + 64 * c), weights[c]);
                const i16 l = dot4_u8s8(i_zero(), b_load(low + 64 * c), weights[c]);
                const i16 sum = i_sub(i_add(i_mullo(h, i_set1(254)), l), sums[c]);
                acc = f_fmadd(f_from_i(sum), f_load(steps + ((size_t)r * chunks + c) * 16), acc);
            }
            out[(size_t)r * N + n] = hsum(acc) * scales[n];
        }
    }
    free(xu), free(steps), free(dx), free(sx);
    return 0;
}
