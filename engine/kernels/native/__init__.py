"""The native CPU kernels: the int4 and int8 matmuls, RMSNorm and a whole decode step, in C written once
against sixteen-lane vectors (simd.h) and built per target (library.py: AVX-512 VNNI, AVX2, plain C), all
computing the same bits. ``library.status()`` names the path in use and why."""
