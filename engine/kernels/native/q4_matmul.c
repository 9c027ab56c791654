/* The int4 matmul and RMSNorm, called one at a time from Python (q4.py, library.py); the maths and the
 * weight layout are in kernels.h. Output tiles are shared among the OpenMP threads; the process's OpenMP
 * runtime is torch's own (the same libgomp.so.1), so torch.set_num_threads applies here too. */
#include "kernels.h"

/* out [M, N] = x [M, K] W^T; float32, row-major, contiguous; N % 16 == 0, K % 32 == 0 (the caller checks).
 * Returns -1 (nothing computed) when its scratch cannot be allocated. */
int q4_matmul(const float *x, int M, int K, const uint8_t *qpack, const uint16_t *scales, int N, float *out) {
    const int G = K / 32;
    int8_t *xq = malloc((size_t)M * 2 * K);
    float *dx = malloc(sizeof(float) * (size_t)M * G), *sx = malloc(sizeof(float) * (size_t)M * G);
    if (!xq || !dx || !sx) {
        free(xq), free(dx), free(sx);
        return -1;
    }
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int r = 0; r < M; r++)
            quantize_row(x + (size_t)r * K, K, xq + (size_t)r * 2 * K, dx + (size_t)r * G, sx + (size_t)r * G);
#pragma omp for schedule(static)
        for (int t = 0; t < N / 16; t++) q4_tile_range(xq, dx, sx, M, K, qpack, scales, N, out, NULL, t, t + 1);
    }
    free(xq), free(dx), free(sx);
    return 0;
}

/* out [M, K] = RMSNorm of each row of x: one call in place of torch's ~8 small ops a norm, which at one
 * decoding row cost more than the arithmetic. */
void rms_norm(const float *x, const float *w, float eps, int M, int K, float *out) {
    for (int r = 0; r < M; r++) rms_norm_row(x + (size_t)r * K, w, eps, K, out + (size_t)r * K);
}
