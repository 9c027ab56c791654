"""Throughput of the Triton prefill attention kernel, at its default tile and at the tiles a sweep names.

Prefill attention is compute-bound (every query token meets every visible key), so it is measured in
TFLOP/s, not against a copy. A swept tile must also compute what the default does (to 16-bit rounding);
one that does not is reported as wrong, one that does not compile as failed. A case is ``seqs`` chunks of ``chunk`` new tokens each after ``prefix`` cached
ones, in a paged cache with random block tables, as one engine step would run them (the default cases
fill ``max_num_batched_tokens`` = 8192). FLOPs count both matmuls over the keys each query token may see:
``4 * head_dim * heads * seqs * (chunk * prefix + chunk * (chunk + 1) / 2)``. Timing as in
bench/kernel_bandwidth.py (median of many runs, L2 flushed on CUDA).

    .venv/bin/python bench/prefill_tiles.py --tiles 64x64x4 64x32x8 128x64x8    # on the GPU
    .venv/bin/python bench/prefill_tiles.py --smoke                            # interpreted, toy sizes
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

# Before anything imports triton: off CUDA, kernel_bandwidth switches Triton to its interpreter.
from kernel_bandwidth import BLOCK_SIZE, INTERPRETED, SHAPES, measure_tile, parse_tile, timer
from run_info import device_report, print_preamble, write_report

from engine.kernels.triton_prefill import NUM_WARPS, default_tiles, prefill_attention

# (seqs, chunk, prefix): one long prompt, several medium ones, chunks after a cached prefix, many short.
CASES = ((1, 8192, 0), (8, 1024, 0), (8, 1024, 4096), (32, 256, 0))
TILE_FORM = "BLOCK_MxBLOCK_NxWARPS"


def prefill_case(
    shape: tuple[int, int, int], seqs: int, chunk: int, prefix: int, dtype: torch.dtype, device: torch.device,
) -> tuple[Callable[[tuple[int, int, int] | None], torch.Tensor], float]:
    """One step's prefill of ``seqs`` chunks: the launch at a tile (None: the defaults), which returns its
    output, and the FLOPs it does."""
    heads, kv_heads, head_dim = shape
    context = prefix + chunk
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=device).to(dtype)
    tables = torch.randperm(num_blocks, device=device).view(seqs, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32, device=device)
    starts = torch.arange(0, (seqs + 1) * chunk, chunk, dtype=torch.int32, device=device)
    query = torch.randn(seqs * chunk, heads, head_dim, device=device).to(dtype)
    out = torch.empty_like(query)

    def run(tile: tuple[int, int, int] | None) -> torch.Tensor:
        block_m, block_n, warps = tile or (None, None, NUM_WARPS)
        prefill_attention(query, kv_cache, tables, seq_lens, starts, out, head_dim**-0.5, chunk,
                          block_m=block_m, block_n=block_n, num_warps=warps)
        return out

    flops = 4 * head_dim * heads * seqs * (chunk * prefix + chunk * (chunk + 1) / 2)
    return run, flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--tiles", nargs="+", type=lambda text: parse_tile(text, TILE_FORM), default=[],
                        help=f"prefill tiles to sweep beside the default, as {TILE_FORM} (e.g. 64x64x8)")
    parser.add_argument("--json", type=Path, help="write the raw report here")
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes (interpreted Triton without a GPU): proves the script runs")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype, cases, repeats = getattr(torch, args.dtype), CASES, 20
    if args.smoke:
        torch.set_num_threads(1)
        args.shapes, cases, repeats = ["qwen2.5-0.5b"], ((2, 8, 0), (1, 8, 24)), 2
    if device.type != "cuda":
        dtype = torch.float16  # the interpreter cannot run bfloat16 dots (triton-lang/triton#11584)

    print_preamble(device, args.smoke, cpu_run=INTERPRETED)
    measure = timer(device, repeats)
    print(f"{'shape':<14}{'seqs':>5}{'chunk':>7}{'prefix':>8}{'tile':>11}{'time (us)':>12}{'TFLOP/s':>9}")
    results = []
    for name in args.shapes:
        head_dim = SHAPES[name][2]
        engine_tile = (*default_tiles(head_dim, torch.empty(0, dtype=dtype).element_size()), NUM_WARPS)
        for seqs, chunk, prefix in cases:
            run, flops = prefill_case(SHAPES[name], seqs, chunk, prefix, dtype, device)
            expected = run(None).clone()
            for tile in (None, *(t for t in args.tiles if t != engine_tile)):
                label = "x".join(map(str, tile or engine_tile)) + ("" if tile else "*")
                head = f"{name:<14}{seqs:>5}{chunk:>7}{prefix:>8}{label:>11}"
                row = {"shape": name, "seqs": seqs, "chunk": chunk, "prefix": prefix,
                       "tile": list(tile or engine_tile), "engine_tile": tile is None}
                seconds = measure_tile(measure, run, tile, expected)
                if isinstance(seconds, str):
                    print(f"{head}  failed: {seconds.splitlines()[0]}")
                    results.append({**row, "error": seconds})
                    continue
                print(f"{head}{seconds * 1e6:>12,.1f}{flops / seconds / 1e12:>9.1f}")
                results.append({**row, "time_us": seconds * 1e6, "tflops": flops / seconds / 1e12})
            del run, expected
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"tile: {TILE_FORM}; * the engine's default")
    if args.json is not None:
        write_report(args.json, device_report(device, results, dtype=str(dtype).removeprefix("torch."),
                                              block_size=BLOCK_SIZE))
        print(f"report: {args.json}")


if __name__ == "__main__":
    main()
