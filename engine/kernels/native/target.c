/* What this build is and what the CPU runs: library.py asks the plain C build (which loads on any CPU)
 * which target to load, and each build which target it was compiled for. */
#include "simd.h"

/* The target this library was compiled for (simd.h's KVG_ISA). */
int kvg_isa(void) { return KVG_ISA; }

/* The best target this CPU (and its OS: AVX state saved on context switches) runs: 2 x86-64-v4 + VNNI, 1
 * x86-64-v3, 0 neither (an older x86-64, or another architecture). Every feature the target's -march
 * level lets the compiler use is asked for, not only those the source names: a hypervisor may hide some. */
int kvg_cpu_best_isa(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi") &&
                     __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("movbe") &&
                     __builtin_cpu_supports("lzcnt");
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                       __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512vnni");
    return avx2 && avx512 ? 2 : avx2 ? 1 : 0;
#else
    return 0;
#endif
}
