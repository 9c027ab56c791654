"""The Triton kernels compile for Hopper (bf16) and Ampere (fp16) GPUs, checked here without a GPU.

See ``triton_aot.py``: a subprocess, because the kernels must be imported without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(("arch", "dtype"), [(90, "bfloat16"), (80, "float16")])
def test_kernels_compile_for_gpu(arch: int, dtype: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_aot.py"), str(arch), dtype],
                            capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": ok") == 8
