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
    assert result.stdout.count(": ok") == 18
