/* What this build is and what the CPU runs: library.py asks the plain C build (which loads on any CPU)
 * which target to load, and each build which target it was compiled for. */
#include "simd.h"

/* The target this library was compiled for (simd.h's KVG_ISA). */
int kvg_isa(void) { return KVG_ISA; }

/* The best target this CPU (and its OS: AVX state saved on context switches) runs: 2 AVX-512 F/BW/VL + VNNI,
 * 1 AVX2 + FMA + F16C, 0 neither (x86-64 without AVX2, or another architecture). */
int kvg_cpu_best_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return avx2 && avx512 ? 2 : avx2 ? 1 : 0;
#else
    return 0;
#endif
}
