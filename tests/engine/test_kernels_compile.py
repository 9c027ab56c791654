"""The Triton kernels compile for Hopper (bf16) and Ampere (fp16) GPUs, checked here without a GPU.

See ``support/triton_aot.py``: a subprocess, because the kernels must be imported without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import sys

import pytest
from support import ROOT
from support.processes import run_command

pytest.importorskip("triton")


@pytest.mark.parametrize(("arch", "dtype"), [(90, "bfloat16"), (80, "float16")])
def test_kernels_compile_for_gpu(arch: int, dtype: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    result = run_command(sys.executable, ROOT / "tests" / "support" / "triton_aot.py", str(arch), dtype, env=env,
                         timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": ok") == 20


# The decode kernel with one split writes the output itself (no partial buffer, no reduce): a variant of its
# own, compiled here with the launcher's tile and warps for both attention shapes of support/triton_aot.py.
ONE_SPLIT = """
import sys

import triton
from support.triton_aot import SHAPES, TRITON_DTYPES, kernels, signature, spilled_bytes
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

arch, (dtype, size) = int(sys.argv[1]), TRITON_DTYPES[sys.argv[2]]
for shape in SHAPES:
    kernel, constexprs, warps = kernels(shape, size)["decode_partial"]
    constexprs = {**constexprs, "NUM_SPLITS": 1}
    source = ASTSource(fn=kernel, signature=signature(kernel, constexprs, dtype), constexprs=constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps}).asm["ptx"]
    print(shape, "mma" in ptx, spilled_bytes(ptx, arch))
"""


@pytest.mark.parametrize(("arch", "dtype"), [(90, "bfloat16"), (80, "float16")])
def test_the_one_split_decode_kernel_compiles_for_gpu(arch: int, dtype: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    result = run_command(sys.executable, "-c", ONE_SPLIT, str(arch), dtype, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(line.endswith(" True 0") for line in lines), result.stdout  # mma, no spills
