"""Achieved memory bandwidth of the Triton decode attention kernel, against a device-to-device copy.

Decode attention reads every cached K/V byte of the batch once and does little else, so its ceiling is the
bandwidth a plain copy achieves. For each batch size and context length: a paged cache with a random block
table per sequence (so reads really are scattered), one decode step through ``TritonAttentionBackend``
(the split-KV kernel and, with several splits, its reduce, as the engine launches them). Bytes = K/V read +
queries read + outputs written; the copy moves 2 x its size (a read and a write).

Timing on a GPU is inside a CUDA graph, as the engine replays the kernel: a graph of ``copies`` launches,
each on its own cache (as many as make ~4x the L2 together, so no launch reads what the one before left in
L2), replayed with the L2 flushed before each replay; seconds per launch = the median replay / copies.
Timed eagerly from Python instead, a short launch also holds the host's launch latency (``eager_time_us``,
reported beside it). The workload cell (``--workload-cell``): the engine benchmark's own decode, batch 256 at
contexts uniform in [100, 1024] (``context`` is their mean, ``contexts`` the range).

``--tiles`` sweeps the decode kernel's tile: each ``BLOCK_NxWARPS`` (keys per tile, warps per program) is
launched directly, with the split count the backend would choose, beside the engine's own launch, and must
compute what that launch does (to 16-bit rounding); one that does not is reported as wrong. ``--splits``
sweeps the split policy alike: each ``SPLITSxMIN_SPLIT_KEYS`` (splits per sequence at most, fewest keys a
split covers) with the engine's tile.

    .venv/bin/python bench/kernel_bandwidth.py            # on the GPU, every shape (bench/results/gpu/)
    .venv/bin/python bench/kernel_bandwidth.py --tiles 32x4 64x4 64x8 128x8 --json sweep.json
    .venv/bin/python bench/kernel_bandwidth.py --splits 1x256 2x256 4x256 4x128 8x512 --json splits.json
    .venv/bin/python bench/kernel_bandwidth.py --smoke    # tiny sizes; without a GPU, interpreted Triton
"""

from __future__ import annotations

import argparse
import os
import random
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
from engine.kernels.triton_decode import MIN_SPLIT_KEYS, choose_num_splits, decode_attention, default_tile

# (query heads, KV heads, head_dim) of the benchmark models' attention (bench/model_shapes.py).
SHAPES = {"qwen2.5-0.5b": (14, 2, 64), "llama-3.2-1b": (32, 8, 64), "llama-3.1-8b": (32, 8, 128)}
BATCHES = (1, 4, 16, 64, 256)
CONTEXTS = (128, 512, 2048, 8192)
BLOCK_SIZE = 16
# The engine benchmark's decode (bench/engine_throughput.py): 256 sequences, contexts uniform in [100, 1024].
WORKLOAD_CELL = (256, (100, 1024))
SPLITS_FORM = "SPLITSxMIN_SPLIT_KEYS"
# Launches in one timed graph cover at least this many bytes (~4x an H100's or H200's L2), so that no launch
# finds its K/V in L2; at most MAX_COPIES launches.
ROTATE_BYTES, MAX_COPIES = 256 << 20, 16
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


def in_graph(measure: Callable[[Callable[[], object]], float], launches: list[Callable[[], object]]) -> float:
    """Seconds per launch of ``launches`` (the same kernel on different data) captured in one CUDA graph and
    replayed under ``measure``. Each is run once first, outside the capture: nothing may compile inside one."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for launch in launches:
            launch()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    seconds = measure(graph.replay) / len(launches)
    del graph
    return seconds


def copy_bandwidth(device: torch.device, num_bytes: int, measure: Callable) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * num_bytes / measure(lambda: dst.copy_(src))


def decode_case(
    shape: tuple[int, int, int], lens: list[int], dtype: torch.dtype, device: torch.device
) -> tuple[Callable[[tuple[int, ...] | None], torch.Tensor], int, int]:
    """A decode step of ``len(lens)`` sequences of ``lens[i]`` tokens each: its launch, which returns the
    output (with None through the engine's backend; with a launch ``(block_n, num_warps, num_splits,
    min_split_keys)``, the decode kernel launched directly), the bytes it must move, and the split count the
    engine would choose."""
    heads, kv_heads, head_dim = shape
    batch, context = len(lens), max(lens)
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(blocks)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, kv_heads, head_dim, device=device).to(dtype)
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(batch, max(blocks), dtype=torch.int32, device=device)
    first = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = order[first : first + count]
        first += count
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device),  # unused: no store here
        block_tables=tables,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=seq_lens,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=list(lens),
        max_query_len=1,
        max_seq_len=context,
    )
    query = torch.randn(batch, heads, head_dim, device=device).to(dtype)
    backend = TritonAttentionBackend()
    element = kv_cache.element_size()
    moved = (2 * sum(lens) * kv_heads * head_dim + 2 * batch * heads * head_dim) * element
    splits = choose_num_splits(batch, kv_heads, backend.num_sms(device))
    out = torch.empty_like(query)
    args = (query, kv_cache, tables, seq_lens, meta.query_start_loc, out, head_dim**-0.5)

    def run(launch: tuple[int, ...] | None) -> torch.Tensor:
        if launch is None:
            return backend.forward(query, kv_cache, meta, head_dim**-0.5)
        block_n, num_warps, num_splits, min_split_keys = launch
        decode_attention(*args, num_splits=num_splits, block_n=block_n, num_warps=num_warps,
                         min_split_keys=min_split_keys)
        return out

    return run, moved, splits


def measure_tile(
    measure: Callable[[Callable[[], object]], float], run: Callable[[tuple[int, ...] | None], torch.Tensor],
    tile: tuple[int, ...] | None, expected: torch.Tensor,
) -> float | str:
    """Seconds per launch of ``run`` at ``tile``, launched eagerly (None: the engine's own launch, whose failure
    is raised), or why a swept tile is no candidate: it did not compile, run, or compute ``expected`` (to
    16-bit rounding). A finding of the sweep, not an end to it."""
    try:
        seconds = measure(partial(run, tile))
        torch.testing.assert_close(run(tile), expected, atol=2e-2, rtol=2e-2)
    except Exception as exc:
        if tile is None:
            raise
        return f"{type(exc).__name__}: {exc}"
    return seconds


def measure_in_graph(
    measure: Callable[[Callable[[], object]], float], runs: list[Callable[[tuple[int, ...] | None], torch.Tensor]],
    tile: tuple[int, ...] | None,
) -> float | str:
    """Seconds per launch of ``runs`` (copies of one case) at ``tile``, inside one CUDA graph; a capture or
    replay that fails gives its error instead (reported in the row, beside the eager figure)."""
    try:
        return in_graph(measure, [partial(run, tile) for run in runs])
    except Exception as exc:  # noqa: BLE001 - see the docstring
        return f"{type(exc).__name__}: {exc}"


def parse_tile(text: str, form: str = "BLOCK_NxWARPS") -> tuple[int, ...]:
    """A tile given as ``form`` says: powers of 2 joined by ``x`` (``"64x8"``: 64 keys per tile, 8 warps)."""
    try:
        values = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        values = ()
    if len(values) != form.count("x") + 1 or any(v < 1 or v & (v - 1) for v in values):
        raise argparse.ArgumentTypeError(f"a tile is {form}, powers of 2 joined by x, got {text!r}")
    return values


def cells(args: argparse.Namespace) -> list[tuple[int, list[int], tuple[int, int] | None]]:
    """``(batch, contexts, None)`` for every batch x context of the grid, then the workload cell, its
    contexts drawn from a fixed seed: ``(batch, contexts, (low, high))``."""
    grid = [(batch, [context] * batch, None) for batch in args.batches for context in args.contexts]
    if args.workload_cell:
        batch, (low, high) = WORKLOAD_CELL if not args.smoke else (2, (4, 40))
        rng = random.Random(0)
        grid.append((batch, [rng.randint(low, high) for _ in range(batch)], (low, high)))
    return grid


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    parser.add_argument("--workload-cell", action=argparse.BooleanOptionalAction, default=True,
                        help=f"also batch {WORKLOAD_CELL[0]} at contexts uniform in {list(WORKLOAD_CELL[1])}")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--tiles", nargs="+", type=parse_tile, default=[],
                        help="decode tiles to sweep beside the engine's launch, as BLOCK_NxWARPS (e.g. 64x8)")
    parser.add_argument("--splits", nargs="+", type=lambda text: parse_tile(text, SPLITS_FORM), default=[],
                        help=f"split policies to sweep beside the engine's launch, as {SPLITS_FORM} (e.g. 4x256)")
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
        args.shapes, args.batches, args.contexts = ["qwen2.5-0.5b"], [2], [16, 40]
        copy_bytes, repeats = 16 << 20, 1
    if device.type != "cuda":
        # The interpreter cannot run bfloat16 dots (triton-lang/triton#11584); fp16 takes the same path.
        dtype = torch.float16
    graphs = device.type == "cuda"

    print_preamble(device, args.smoke, cpu_run=INTERPRETED)
    measure = timer(device, repeats)
    copy = copy_bandwidth(device, copy_bytes, measure)
    cache_dtype = str(dtype).removeprefix("torch.")
    print(
        f"device-to-device copy of {copy_bytes >> 20} MiB: {copy / 1e9:,.0f} GB/s; "
        f"decode cache {cache_dtype}, block size {BLOCK_SIZE}; timed {'in a CUDA graph' if graphs else 'eagerly'}"
    )
    print(f"{'shape':<14}{'batch':>6}{'context':>9}{'tile':>8}{'splits':>9}{'copies':>7}{'time (us)':>12}{'GB/s':>10}"
          f"{'of copy':>9}{'eager us':>10}{'of copy':>9}")
    results = []
    for name in args.shapes:
        engine_tile = default_tile(SHAPES[name][2])
        for batch, lens, spread in cells(args):
            context = round(sum(lens) / batch)
            run, moved, splits = decode_case(SHAPES[name], lens, dtype, device)
            copies = min(MAX_COPIES, -(-ROTATE_BYTES // moved)) if graphs else 1
            runs = [run, *(decode_case(SHAPES[name], lens, dtype, device)[0] for _ in range(copies - 1))]
            expected = run(None).clone()
            engine = (*engine_tile, splits, MIN_SPLIT_KEYS)
            # None: the engine's own launch, through its backend (its tile and split policy: ``engine``).
            swept = [(*t, splits, MIN_SPLIT_KEYS) for t in args.tiles] + [(*engine_tile, *p) for p in args.splits]
            for tile in (None, *dict.fromkeys(t for t in swept if t != engine)):
                block_n, warps, num_splits, min_keys = tile or engine
                label = f"{block_n}x{warps}" + ("" if tile else "*")
                where = f"{name:<14}{batch:>6}{context:>9}{label:>8}{f'{num_splits}x{min_keys}':>9}{copies:>7}"
                row = {"shape": name, "batch": batch, "context": context, "block_n": block_n,
                       "num_warps": warps, "num_splits": num_splits, "min_split_keys": min_keys,
                       "engine_tile": tile is None, "timing": "cuda_graph" if graphs else "host",
                       "copies": copies, **({"contexts": list(spread), "workload_cell": True} if spread else {})}
                eager = measure_tile(measure, run, tile, expected)
                if isinstance(eager, str):
                    print(f"{where}  failed: {eager.splitlines()[0]}")
                    results.append({**row, "error": eager})
                    continue
                seconds = measure_in_graph(measure, runs, tile) if graphs else eager
                row |= {"eager_time_us": eager * 1e6, "eager_of_copy": moved / eager / copy}
                if isinstance(seconds, str):
                    print(f"{where}  graph failed: {seconds.splitlines()[0]}; eager {eager * 1e6:,.1f} us, "
                          f"{row['eager_of_copy']:.0%} of copy")
                    results.append({**row, "time_us": None, "of_copy": None, "graph_error": seconds})
                    continue
                bandwidth = moved / seconds
                print(f"{where}{seconds * 1e6:>12,.1f}{bandwidth / 1e9:>10,.2f}{bandwidth / copy:>9.0%}"
                      f"{eager * 1e6:>10,.1f}{row['eager_of_copy']:>9.0%}")
                results.append({**row, "time_us": seconds * 1e6, "gbps": bandwidth / 1e9, "of_copy": bandwidth / copy})
            del run, runs, expected
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print("tile: keys per tile x warps per program; * the engine's own launch; splits: at most x fewest keys per "
          "split; copies: launches per timed graph, each on its own cache; context: the mean where contexts "
          "differ (the workload cell)")
    path = args.json or (GPU_REPORT if device.type == "cuda" and not args.smoke else None)
    if path is not None:
        write_report(path, device_report(device, results, copy_gbps=copy / 1e9, copy_mib=copy_bytes >> 20,
                                         cache_dtype=cache_dtype, block_size=BLOCK_SIZE))
        print(f"report: {path}")


if __name__ == "__main__":
    main()
