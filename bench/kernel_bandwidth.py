"""Achieved memory bandwidth of the Triton decode attention kernel, against a device-to-device copy.

Decode attention reads every cached K/V byte of the batch once and does little else, so its ceiling is the
bandwidth a plain copy achieves. For each batch size and context length: a paged cache with a random block
table per sequence (so reads really are scattered), one decode step through ``TritonAttentionBackend``
(the split-KV kernel and its reduce, with the split count the engine would choose), timed as the median of
many runs with the L2 cache flushed between them. Bytes = K/V read + queries read + outputs written;
the copy moves 2 x its size (a read and a write).

``--tiles`` sweeps the decode kernel's tile: each ``BLOCK_NxWARPS`` (keys per tile, warps per program) is
launched directly, with the split count the backend would choose, beside the engine's own launch, and must
compute what that launch does (to 16-bit rounding); one that does not is reported as wrong.

    .venv/bin/python bench/kernel_bandwidth.py            # on the GPU, both shapes (bench/results/gpu/)
    .venv/bin/python bench/kernel_bandwidth.py --tiles 32x4 64x4 64x8 128x8 --json sweep.json
    .venv/bin/python bench/kernel_bandwidth.py --smoke    # tiny sizes; without a GPU, interpreted Triton
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

# Off CUDA, Triton runs only interpreted, and that is decided when triton is first imported: by the imports
# below, which must therefore stay after this switch.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from run_info import device_report, print_preamble, write_report

from engine.kernels import AttentionMetadata
from engine.kernels.triton_backend import TritonAttentionBackend
from engine.kernels.triton_decode import choose_num_splits, decode_attention, default_tile

# (query heads, KV heads, head_dim) of the two benchmark models' attention.
SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.2-1b": (32, 8, 64)}
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (128, 512, 2048, 8192)
BLOCK_SIZE = 16
INTERPRETED = "interpreted Triton, not a performance figure"
GPU_REPORT = Path(__file__).parent / "results" / "gpu" / "kernel_bandwidth.json"


def timer(device: torch.device, repeats: int) -> Callable[[Callable[[], object]], float]:
    """Seconds per call of a function: the median of ``repeats`` runs, L2 flushed on CUDA."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, rep=repeats * 10, return_mode="median") / 1e3

    def host(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return host


def copy_bandwidth(device: torch.device, num_bytes: int, measure: Callable) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * num_bytes / measure(lambda: dst.copy_(src))


def decode_case(
    shape: tuple[int, int, int], batch: int, context: int, dtype: torch.dtype, device: torch.device
) -> tuple[Callable[[tuple[int, ...] | None], torch.Tensor], int]:
    """A decode step of ``batch`` sequences of ``context`` tokens each: its launch, which returns the
    output (with None through the engine's backend, with a tile, keys per tile x warps, the decode kernel
    launched directly), and the bytes it must move."""
    heads, kv_heads, head_dim = shape
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=device).to(dtype)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),  # unused: no store here
        block_tables=tables,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=lens,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch,
        max_query_len=1,
        max_seq_len=context,
    )
    query = torch.randn(batch, heads, head_dim, device=device).to(dtype)
    backend = TritonAttentionBackend()
    element = kv_cache.element_size()
    moved = (2 * batch * context * kv_heads * head_dim + 2 * batch * heads * head_dim) * element
    splits = choose_num_splits(batch, kv_heads, backend.num_sms(device))
    out = torch.empty_like(query)
    args = (query, kv_cache, tables, lens, meta.query_start_loc, out, head_dim**-0.5)

    def run(tile: tuple[int, ...] | None) -> torch.Tensor:
        if tile is None:
            return backend.forward(query, kv_cache, meta, head_dim**-0.5)
        decode_attention(*args, num_splits=splits, block_n=tile[0], num_warps=tile[1])
        return out

    return run, moved


def measure_tile(
    measure: Callable[[Callable[[], object]], float], run: Callable[[tuple[int, ...] | None], torch.Tensor],
    tile: tuple[int, ...] | None, expected: torch.Tensor,
) -> float | str:
    """Seconds per launch of ``run`` at ``tile`` (None: the engine's own launch, whose failure is raised),
    or why a swept tile is no candidate: it did not compile, run, or compute ``expected`` (to 16-bit
    rounding). A finding of the sweep, not an end to it."""
    try:
        seconds = measure(partial(run, tile))
        torch.testing.assert_close(run(tile), expected, atol=2e-2, rtol=2e-2)
    except Exception as exc:
        if tile is None:
            raise
        return f"{type(exc).__name__}: {exc}"
    return seconds


def parse_tile(text: str, form: str = "BLOCK_NxWARPS") -> tuple[int, ...]:
    """A tile given as ``form`` says: powers of 2 joined by ``x`` (``"64x8"``: 64 keys per tile, 8 warps)."""
    try:
        values = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        values = ()
    if len(values) != form.count("x") + 1 or any(v < 1 or v & (v - 1) for v in values):
        raise argparse.ArgumentTypeError(f"a tile is {form}, powers of 2 joined by x, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--tiles", nargs="+", type=parse_tile, default=[],
                        help="decode tiles to sweep beside the engine's launch, as BLOCK_NxWARPS (e.g. 64x8)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes (interpreted Triton without a GPU): proves the script runs, measures nothing",
    )
    parser.add_argument("--json", type=Path,
                        help=f"write the raw report here (default on a GPU, without --smoke: {GPU_REPORT})")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    copy_bytes, repeats = 1 << 30, 20
    if args.smoke:
        # Toy tensors gain nothing from intra-op threads; on a busy host their spin-waits cost ~10 ms an op.
        torch.set_num_threads(1)
        args.shapes, args.batches, args.contexts = ["qwen2.5-0.5b"], [1, 2], [16, 40]
        copy_bytes, repeats = 16 << 20, 2
    if device.type != "cuda":
        # The interpreter cannot run bfloat16 dots (triton-lang/triton#11584); fp16 takes the same path.
        dtype = torch.float16

    print_preamble(device, args.smoke, cpu_run=INTERPRETED)
    measure = timer(device, repeats)
    copy = copy_bandwidth(device, copy_bytes, measure)
    cache_dtype = str(dtype).removeprefix("torch.")
    print(
        f"device-to-device copy of {copy_bytes >> 20} MiB: {copy / 1e9:,.0f} GB/s; "
        f"decode cache {cache_dtype}, block size {BLOCK_SIZE}"
    )
    print(f"{'shape':<14}{'batch':>6}{'context':>9}{'tile':>8}{'time (us)':>12}{'GB/s':>10}{'of copy':>9}")
    results = []
    for name in args.shapes:
        engine_tile = default_tile(SHAPES[name][2])
        for batch in args.batches:
            for context in args.contexts:
                run, moved = decode_case(SHAPES[name], batch, context, dtype, device)
                expected = run(None).clone()
                # None: the engine's own launch, through its backend (its tile, engine_tile).
                for tile in (None, *(t for t in args.tiles if t != engine_tile)):
                    block_n, warps = tile or engine_tile
                    label = f"{block_n}x{warps}" + ("" if tile else "*")
                    row = {"shape": name, "batch": batch, "context": context, "block_n": block_n,
                           "num_warps": warps, "engine_tile": tile is None}
                    seconds = measure_tile(measure, run, tile, expected)
                    if isinstance(seconds, str):
                        print(f"{name:<14}{batch:>6}{context:>9}{label:>8}  failed: {seconds.splitlines()[0]}")
                        results.append({**row, "error": seconds})
                        continue
                    bandwidth = moved / seconds
                    print(
                        f"{name:<14}{batch:>6}{context:>9}{label:>8}{seconds * 1e6:>12,.1f}"
                        f"{bandwidth / 1e9:>10,.2f}{bandwidth / copy:>9.0%}"
                    )
                    results.append({**row, "time_us": seconds * 1e6, "gbps": bandwidth / 1e9,
                                    "of_copy": bandwidth / copy})
                del run, expected
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    print("tile: keys per tile x warps per program; * the engine's own launch")
    path = args.json or (GPU_REPORT if device.type == "cuda" and not args.smoke else None)
    if path is not None:
        write_report(path, device_report(device, results, copy_gbps=copy / 1e9, copy_mib=copy_bytes >> 20,
                                         cache_dtype=cache_dtype, block_size=BLOCK_SIZE))
        print(f"report: {path}")


if __name__ == "__main__":
    main()
