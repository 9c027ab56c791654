"""Compile every Triton kernel for an NVIDIA GPU target ahead of time, on a machine with no GPU.

The interpreter runs the kernels' maths but skips everything a GPU compile checks: tile shapes the tensor
cores accept, types, the lowering to PTX, and ptxas. Triton compiles to a cubin without a device, so this
catches what only the GPU path would hit, with the tiles and warps the launchers really use. For 16-bit
caches it also requires tensor-core instructions in the attention kernels and no register spills anywhere.

Run as a script without ``TRITON_INTERPRET`` (compiled kernels only exist then), e.g.
``python tests/triton_aot.py 90 bfloat16``; one line per kernel, non-zero exit on the first failure.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from engine.kernels import (
    triton_decode,
    triton_lora,
    triton_norm,
    triton_prefill,
    triton_rope,
    triton_rope_store,
    triton_silu,
    triton_store,
)

TRITON_DTYPES = {"bfloat16": ("bf16", 2), "float16": ("fp16", 2), "float32": ("fp32", 4)}
# Pointer element types by argument name; the activation and cache pointers take the dtype under test.
INDEX_POINTERS = {"block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32",
                  "slot_ptr": "*i64", "partial_ptr": "*fp32", "lse_ptr": "*fp32",
                  "positions_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",  # RoPE's fp32 tables
                  "slots_ptr": "*i32", "scales_ptr": "*fp32", "y_ptr": "*fp32"}  # the LoRA kernels'


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int = 16

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


# Qwen2.5-0.5B (group 7, head_dim 64) and a Llama-3-8B-like shape (group 4, head_dim 128).
SHAPES = (Shape(14, 2, 64), Shape(32, 8, 128))


def kernels(shape: Shape, element_size: int) -> dict[str, tuple[triton.JITFunction, dict[str, int], int]]:
    """Each kernel with the constexprs and warps its launcher passes for ``shape``."""
    block_d = max(16, triton.next_power_of_2(shape.head_dim))
    block_g = triton.next_power_of_2(shape.group)
    block_m, block_n = triton_prefill.default_tiles(shape.head_dim, element_size)
    decode_n, decode_warps = triton_decode.default_tile(shape.head_dim)
    splits = 16
    return {
        "store_kv": (
            triton_store._store_kv_kernel,
            {"NUM_KV_HEADS": shape.kv_heads, "HEAD_DIM": shape.head_dim, "BLOCK_SIZE": shape.block_size,
             "BLOCK_H": triton.next_power_of_2(shape.kv_heads), "BLOCK_D": block_d},
            4,
        ),
        "decode_partial": (
            triton_decode._decode_partial_kernel,
            {"GROUP": shape.group, "BLOCK_H": max(triton_decode.MIN_HEAD_ROWS, block_g),
             "HEAD_DIM": shape.head_dim, "BLOCK_D": block_d, "BLOCK_SIZE": shape.block_size,
             "BLOCK_N": decode_n, "NUM_SPLITS": splits},
            decode_warps,
        ),
        "decode_reduce": (
            triton_decode._decode_reduce_kernel,
            {"HEAD_DIM": shape.head_dim, "BLOCK_D": block_d, "BLOCK_N": decode_n,
             "NUM_SPLITS": splits},
            4,
        ),
        "prefill": (
            triton_prefill._prefill_kernel,
            {"GROUP": shape.group, "BLOCK_G": block_g, "HEAD_DIM": shape.head_dim, "BLOCK_D": block_d,
             "BLOCK_SIZE": shape.block_size, "BLOCK_Q": max(1, block_m // block_g), "BLOCK_N": block_n},
            triton_prefill.NUM_WARPS,
        ),
        # RMSNorm after the residual add, over a hidden size of heads x head_dim, as rms_norm launches it.
        "rms_norm": (triton_norm._rms_norm_kernel,
                     {"HAS_RESIDUAL": 1, "BLOCK": triton.next_power_of_2(shape.heads * shape.head_dim)},
                     4 if shape.heads * shape.head_dim <= 2048 else 8),
        # RoPE over a fused q/k view (heads + kv_heads), and the MLP gate, as rope and silu_mul launch them.
        "rope": (triton_rope._rope_kernel,
                 {"HEAD_DIM": shape.head_dim, "BLOCK_H": triton.next_power_of_2(shape.heads + shape.kv_heads)}, 4),
        # RoPE with the K/V store over a fused q/k/v view, as rope_store_kv launches it.
        "rope_store": (triton_rope_store._rope_store_kernel,
                       {"NUM_HEADS": shape.heads, "NUM_KV_HEADS": shape.kv_heads, "HEAD_DIM": shape.head_dim,
                        "BLOCK_SIZE": shape.block_size, "BLOCK_Q": triton.next_power_of_2(shape.heads),
                        "BLOCK_KV": triton.next_power_of_2(shape.kv_heads)}, 4),
        "silu_mul": (triton_silu._silu_mul_kernel, {"BLOCK": triton_silu.BLOCK}, 4),
        # The LoRA BGMV pair at the default --max-lora-rank (16), with the tiles lora_bgmv launches.
        "lora_shrink": (triton_lora._shrink_kernel, {"BLOCK_R": 16, "BLOCK_K": 64}, 4),
        "lora_expand": (triton_lora._expand_kernel, {"BLOCK_R": 16, "BLOCK_N": 64}, 4),
    }


def signature(kernel: triton.JITFunction, constexprs: dict[str, int], dtype: str) -> dict[str, str]:
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = INDEX_POINTERS.get(name, f"*{dtype}")
        else:
            types[name] = "fp32" if name in ("scale_log2", "eps") else "i32"
    return types


def spilled_bytes(ptx: str, arch: int) -> int:
    """Register spill stores reported by ptxas for ``ptx`` (Triton keeps its own ptxas report to itself)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as source:
        source.write(ptx)
        source.flush()
        report = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}", source.name,
             "-o", "/dev/null"],
            capture_output=True, text=True, check=True,
        ).stderr
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", report))


def main(arch: int, dtype_name: str) -> None:
    dtype, element_size = TRITON_DTYPES[dtype_name]
    target = GPUTarget("cuda", arch, 32)
    for shape in SHAPES:
        for name, (kernel, constexprs, warps) in kernels(shape, element_size).items():
            types = signature(kernel, constexprs, dtype)
            source = ASTSource(fn=kernel, signature=types, constexprs=constexprs)
            ptx = triton.compile(source, target=target, options={"num_warps": warps}).asm["ptx"]
            heads = f"heads {shape.heads}/{shape.kv_heads}, d {shape.head_dim}"
            where = f"sm_{arch} {dtype_name} {name} ({heads})"
            if element_size == 2:
                if name in ("decode_partial", "prefill") and "mma" not in ptx:
                    raise SystemExit(f"{where}: no tensor-core mma in the PTX")
                if spills := spilled_bytes(ptx, arch):
                    raise SystemExit(f"{where}: ptxas spills {spills} bytes of registers")
            print(f"{where}: ok")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
