"""The CPU torch path's decode attention for one step, by gather budget, against the per-sequence loop.

engine/kernels/torch_ref.py gathers a step's decodes into padded K/V in groups of similar context length
whose padded K and V fit ``GATHER_BUDGET_BYTES``. This times the attention of one decode step (every
layer; fresh metadata each step, so the groups are built as the engine builds them) for ragged batches of
two head shapes: SmolLM2-135M's (15 query heads, 5 KV heads of 64) and the built-in ``tiny`` model's (4 and 2
of 16), under several budgets, one group (no budget) and the per-sequence loop. One torch thread; the median
of ``--steps`` steps per figure; the cache holds 8,192 blocks of 16 in a random order. Every case runs once
untimed before the timed pass: the first large gathers of a process are page-faulted in afresh (glibc serves
them by mmap until a free raises its threshold), which a running engine has long done (8 contexts of 100-191,
one group: 104 ms timed first, 17 ms after a larger case).

    flock /tmp/kvguard-bench.lock .venv/bin/python bench/decode_groups.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from run_info import command, describe

from engine.kernels import AttentionMetadata, TorchAttentionBackend, torch_ref

BLOCK_SIZE, NUM_BLOCKS = 16, 8192
BUDGETS = {"one group": 1 << 40, "8 MiB": 8 << 20, "4 MiB": 4 << 20, "2 MiB": 2 << 20, "1 MiB": 1 << 20}
# (name, KV heads, head_dim, query heads, layers, context lengths)
_R = random.Random(1)
CASES = [
    ("SmolLM2 heads, 8 contexts of 100-191", 5, 64, 15, 30, [100 + 13 * i for i in range(8)]),
    ("SmolLM2 heads, 16 contexts of 300", 5, 64, 15, 30, [300] * 16),
    ("SmolLM2 heads, 32 contexts of 100-503", 5, 64, 15, 30, [100 + 13 * i for i in range(32)]),
    ("SmolLM2 heads, 64 contexts of 50-1000", 5, 64, 15, 30, [_R.randint(50, 1000) for _ in range(64)]),
    ("tiny heads, 10 contexts of 70-500", 2, 16, 4, 4, [86] * 5 + [_R.randint(70, 500) for _ in range(5)]),
    ("tiny heads, 64 contexts of 64-384", 2, 16, 4, 4, [_R.randint(64, 384) for _ in range(64)]),
]


def step_ms(attend, query: torch.Tensor, kv_cache: torch.Tensor, lens: list[int], tables: list[list[int]],
            slots: list[int], layers: int, steps: int) -> float:
    """The median time of ``steps`` decode steps of ``layers`` calls of ``attend`` (a backend's method)."""
    times = []
    scale = query.shape[-1] ** -0.5
    for _ in range(steps):
        meta = AttentionMetadata.from_host(slots, tables, [1] * len(lens), lens)
        began = time.perf_counter()
        for _ in range(layers):
            attend(query, kv_cache, meta, scale)
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {describe(torch.device('cpu'))}\ncommand: {command()}")
    backend = TorchAttentionBackend()
    kept = torch_ref.GATHER_BUDGET_BYTES
    print(f"decode attention of one step, ms (the engine's budget: {kept >> 20} MiB)")
    print(f"{'case':40} {'loop':>8} " + " ".join(f"{name:>10}" for name in BUDGETS))
    for timed, (name, kv_heads, head_dim, heads, layers, lens) in [(t, c) for t in (False, True) for c in CASES]:
        order = list(range(NUM_BLOCKS))
        random.Random(0).shuffle(order)
        tables = [[order.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in lens]
        slots = [t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for t, n in zip(tables, lens)]
        kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
        query = torch.randn(len(lens), heads, head_dim)
        shape = (query, kv_cache, lens, tables, slots, layers, args.steps if timed else 1)
        row = [step_ms(backend._forward_per_sequence, *shape)]
        for budget in BUDGETS.values():
            torch_ref.GATHER_BUDGET_BYTES = budget
            row.append(step_ms(backend.forward, *shape))
        torch_ref.GATHER_BUDGET_BYTES = kept
        if timed:
            print(f"{name:40} " + " ".join(f"{ms:>8.1f}" if i == 0 else f"{ms:>10.1f}" for i, ms in enumerate(row)))


if __name__ == "__main__":
    main()
