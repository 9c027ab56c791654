"""Peak memory bandwidth of the device, the denominator of memory-bandwidth utilization (MBU).

Known GPUs come from their data sheets; anything else (the CPU included) is measured once with a large
device-to-device copy, which is what a bandwidth-bound decode step can at best achieve.
"""

from __future__ import annotations

import time

import torch

# Substrings of torch.cuda.get_device_name(), most specific first; bytes per second.
KNOWN_GPUS: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 8.64e11),
    ("L4", 3.0e11),
    ("A10", 6.0e11),
    ("RTX 4090", 1.008e12),
    ("RTX 3090", 9.36e11),
    ("T4", 3.2e11),
)


def peak_bandwidth(device: torch.device) -> float:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, bandwidth in KNOWN_GPUS:
            if key in name:
                return bandwidth
    return measure_copy_bandwidth(device)


def measure_copy_bandwidth(device: torch.device, num_bytes: int = 64 << 20, repeats: int = 5) -> float:
    """Best of ``repeats`` copies of ``num_bytes``; a copy reads and writes, so it moves twice the size."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best
