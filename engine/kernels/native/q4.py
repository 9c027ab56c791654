"""The native int4 layout (kernels.h): ``W[n, k] = d[n, g] * q[n, k] + m[n, g]`` with ``q`` in 0..15 and
``d``, ``m`` float16 per group of 32 inputs, output rows in tiles of 16. Pure torch: packing needs no
library."""

from __future__ import annotations

import torch

TILE = 16  # output rows per tile (sixteen float32 lanes)
GROUP = 32  # inputs per scale and zero


def fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE == 0 and in_features % GROUP == 0


def pack(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.h's layout from ``W[n, k] = scale[n, g] * q[n, k] + low[n, g]`` (``q`` integers 0..15
    ``[N, K]``; ``scale``, ``low`` ``[N, K / 32]``): ``(qpack uint8 [N/16, K/8, 64], scales fp16 [N/16,
    K/32, 2, 16])``."""
    n, k = q.shape
    q = q.to(torch.uint8).view(n // TILE, TILE, k // 8, 2, 4)  # (tile, row, octet, half, byte)
    qpack = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    scales = torch.stack((scale, low), dim=1).to(torch.float16)  # [N, 2, G]
    scales = scales.view(n // TILE, TILE, 2, k // GROUP).permute(0, 3, 2, 1).contiguous()
    return qpack.view(n // TILE, k // 8, 64), scales


def unpack(qpack: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``W [N, K]`` in ``dtype``: ``pack``'s inverse."""
    tiles, octets, _ = qpack.shape
    nibbles = qpack.view(tiles, octets, TILE, 4)
    q = torch.stack((nibbles & 15, nibbles >> 4), dim=3)  # (tile, octet, row, half, byte)
    q = q.permute(0, 2, 1, 3, 4).reshape(tiles * TILE, octets * 8 // GROUP, GROUP).to(dtype)
    sz = scales.to(dtype).permute(0, 3, 2, 1).reshape(tiles * TILE, 2, -1)  # [N, 2, G]
    return torch.addcmul(sz[:, 1, :, None], q, sz[:, 0, :, None]).reshape(tiles * TILE, octets * 8)
