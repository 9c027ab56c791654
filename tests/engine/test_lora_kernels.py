"""The batched LoRA delta: the torch path (one segmented matmul over the step's adapters) and the Triton
BGMV kernel (interpreted on CPU, see test_kernels_triton.py) against a per-token loop, on a step mixing
base tokens and three adapters of different ranks; the torch path leaves base tokens bit for bit alone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # before the import below: the kernel module imports triton

from engine.kernels.triton_lora import lora_bgmv
from engine.model.lora_slots import lora_segmented

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SLOTS, RANK, FAN_IN, FAN_OUT = 4, 8, 48, 80
TOKEN_SLOTS = [-1, 2, 2, 0, -1, 3, 0, 2, -1]  # slot 1 is resident but unused by this step


def _inputs(dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(SLOTS, RANK, FAN_IN, generator=generator)
    b = torch.randn(SLOTS, RANK, FAN_OUT, generator=generator)
    a[3, 5:] = 0  # slot 3 holds a rank-5 adapter: zero padding
    b[3, 5:] = 0
    x = torch.randn(len(TOKEN_SLOTS), FAN_IN, generator=generator)
    out = torch.randn(len(TOKEN_SLOTS), FAN_OUT, generator=generator)
    scales = torch.tensor([2.0, 0.5, 1.0, 0.25])
    return [t.to(DEVICE, dtype) for t in (x, out, a, b)] + [scales.to(DEVICE)]


def _per_token(x, out, a, b, scales):
    expected = out.float().clone()
    for t, s in enumerate(TOKEN_SLOTS):
        if s >= 0:
            expected[t] += scales[s] * (b[s].float().t() @ (a[s].float() @ x[t].float()))
    return expected


def _segmented(x, out, a, b, scales):
    """The torch path as the slots lay a step out: the step's slots in first-use order, a scaling mask."""
    active = list(dict.fromkeys(s for s in TOKEN_SLOTS if s >= 0))
    mask = torch.zeros(len(TOKEN_SLOTS), len(active) * RANK, device=DEVICE)
    for t, s in enumerate(TOKEN_SLOTS):
        if s >= 0:
            j = active.index(s)
            mask[t, j * RANK:(j + 1) * RANK] = scales[s]
    return lora_segmented(x, out, a, b, torch.tensor(active, device=DEVICE), mask.to(x.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_path_and_triton_kernel_match_a_per_token_loop(dtype: torch.dtype) -> None:
    x, out, a, b, scales = _inputs(dtype)
    expected = _per_token(x, out, a, b, scales)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    triton_result = lora_bgmv(x, out, a, b, torch.tensor(TOKEN_SLOTS, dtype=torch.int32, device=DEVICE), scales)
    torch_result = _segmented(x, out, a, b, scales)
    for result in (triton_result, torch_result):
        assert result.dtype == dtype
        assert (result.float() - expected).abs().max().item() < tolerance * expected.abs().max().item()
    base = [t for t, s in enumerate(TOKEN_SLOTS) if s < 0]
    assert torch.equal(torch_result[base], out[base]) and torch.equal(triton_result[base], out[base])
