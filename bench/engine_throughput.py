"""Offline throughput: the engine against Hugging Face ``transformers`` ``generate`` on the same requests.

The standard offline benchmark: 256 requests whose input and output lengths are uniform in [100, 1024],
``ignore_eos`` so every request produces exactly its output length, greedy decoding. Models with the shapes
of published models and random weights (throughput does not depend on the values; ``model_shapes.py``) are
written once with ``save_pretrained``, and both systems load that same checkpoint.

- engine: ``LLM`` with ``max_num_seqs=256`` and ``max_num_batched_tokens=8192``, after a warm-up that
  compiles the kernels and captures a CUDA graph for every decode batch size. A row's top level is the
  engine as shipped (``EngineConfig``'s defaults); ``--async-scheduling both`` adds the other scheduling
  (run-ahead on or off) as ``other_scheduling`` and says which was faster; ``--unfused`` adds the timed run
  with the CUDA fusions off (``KVGUARD_CUDA_FUSION=0``'s path) and how many requests got the same tokens;
  ``--fusion-check N`` compares fused and unfused greedy tokens in fp32 on N requests.
- transformers: the baseline a user would otherwise pick, ``generate`` on left-padded batches of
  ``--hf-batch-size`` requests, each batch running to its longest output; only the requested output
  tokens count. It runs after every engine run (``--hf only`` in a later process, filling in the rows that
  ``--hf skip`` wrote), on the first ``--hf-requests`` requests of the same workload if given.

Reported: output tokens/s for each, their ratio, and decode MBU: over the engine's decode-only steps, the
bytes they move (weights once, every context's K/V, the new K/V) per second of step time, over the
device's datasheet bandwidth (``engine.worker.bandwidth``), for all of them and for those of batch >= 64.

Where the engine's time goes, from the timed run itself (``bench/step_phases.py`` wraps the engine's
functions; its own cost is a few microseconds a step): each step's phases, averaged over the decode-only
steps of batch >= 64, the steps with a prefill chunk, and all steps; host work per step (every phase but
"model" and "sample"), "model" (on a GPU: kernel launches or a graph replay) and "sample" (on a GPU: the
wait for the device); and the time ``generate`` spent outside its steps. ``--kernel-profile N``: after a
model's timed runs, a fresh engine runs N decode-only steps at the largest batch, eagerly, under
``torch.profiler`` (``bench/kernel_profile.py``): the top 15 kernels (on a CPU: ops) by self time.

    .venv/bin/python bench/engine_throughput.py         # both small models, on the GPU (bench/results/gpu/)
    .venv/bin/python bench/engine_throughput.py --async-scheduling both --unfused --kernel-profile 20
    .venv/bin/python bench/engine_throughput.py --smoke          # toy shapes: checks that it runs
    bash bench/gpu_round.sh                                      # the whole GPU round, one command
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import transformers
from kernel_profile import format_kernels, profile_decode, sync
from model_shapes import SHAPES, checkpoint
from run_info import command, device_report, print_preamble, write_report
from step_phases import PHASES_HEADER, StepPhases, format_phases, summarize

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.model import cuda_fusion
from engine.sched.output import SchedulerOutput
from engine.worker.bandwidth import peak_bandwidth
from engine.worker.runner import StepResult

GPU_REPORT = Path(__file__).parent / "results" / "gpu" / "engine_throughput.json"
DEFAULT_MODELS = ["qwen2.5-0.5b", "llama-3.2-1b"]


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, count: int) -> Workload:
        return Workload(self.prompts[:count], self.output_lens[:count])


@dataclass(slots=True)
class StepRecord:
    decode_only: bool
    batch: int
    bytes_moved: int
    duration_s: float


def shipped_async(device: torch.device) -> bool:
    """Whether the engine as shipped runs ahead on ``device`` (``EngineConfig.run_ahead``, unset)."""
    return EngineConfig().run_ahead(device)


def make_workload(count: int, inputs: tuple[int, int], outputs: tuple[int, int], vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(count):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(*inputs))])
        output_lens.append(rng.randint(*outputs))
    return Workload(prompts, output_lens)


def trace_steps(core: EngineCore) -> list[StepRecord]:
    """Record every engine step: decode-only or not, batch size, bytes moved, step time (from telemetry)."""
    steps: list[StepRecord] = []
    execute, on_step = core.runner.execute, core.stats.on_step
    # First in, first out: an engine that runs a step ahead executes the next step before this one reports.
    kinds: deque[tuple[bool, int]] = deque()

    def traced_execute(out: SchedulerOutput, *args, **kwargs) -> StepResult:
        kinds.append((len(out.token_ids) == len(out.seqs), len(out.seqs)))
        return execute(out, *args, **kwargs)

    def traced_on_step(duration_s: float, num_tokens: int, has_decode: bool, bytes_moved: int, num_seqs: int) -> None:
        decode_only, batch = kinds.popleft()
        steps.append(StepRecord(decode_only, batch, bytes_moved, duration_s))
        on_step(duration_s, num_tokens, has_decode, bytes_moved, num_seqs)

    core.runner.execute = traced_execute
    core.stats.on_step = traced_on_step
    return steps


@contextmanager
def cuda_fusion_enabled(enabled: bool) -> Iterator[None]:
    """The CUDA fusions on or off for the engines built inside (the model reads the switch at load time and
    at every call), as ``KVGUARD_CUDA_FUSION=0`` does for a whole process."""
    saved, cuda_fusion.ENABLED = cuda_fusion.ENABLED, enabled
    try:
        yield
    finally:
        cuda_fusion.ENABLED = saved


def make_llm(directory: Path, work: Workload, args: argparse.Namespace, device: torch.device,
             async_scheduling: bool, **options: object) -> LLM:
    return LLM(
        str(directory),
        device=device.type,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(map(len, work.prompts)) + max(work.output_lens),
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
        **options,
    )


def run_engine(directory: Path, work: Workload, args: argparse.Namespace, device: torch.device,
               async_scheduling: bool) -> dict:
    llm = make_llm(directory, work, args, device, async_scheduling)
    # Warm-up: whole prompts whose outputs end one step apart, so the decode batch shrinks through every
    # size once (compiling each kernel variant and capturing each CUDA graph before the clock starts).
    # Whole prompts: their block tables are as wide as the timed run's (first H200 run: 16-token prompts
    # left the timed run ~1.5 s of Triton compiles in its first prefill steps).
    warm = min(args.max_num_seqs, len(work.prompts))
    llm.generate(
        work.prompts[:warm],
        [SamplingParams(max_tokens=i + 1, temperature=0.0, ignore_eos=True) for i in range(warm)],
    )
    steps = trace_steps(llm.core)
    phases = StepPhases(llm.core) if args.phases else None
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
    sync(device)
    start = time.perf_counter()
    outputs = llm.generate(work.prompts, params)
    sync(device)
    elapsed = time.perf_counter() - start
    if phases is not None:
        phases.detach()
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != work.output_tokens:
        raise RuntimeError(f"engine produced {produced} output tokens, expected {work.output_tokens}")
    peak = llm.core.stats.peak_bandwidth_bytes_per_s
    result = {
        "tokens_per_s": produced / elapsed,
        "elapsed_s": elapsed,
        "steps": len(steps),
        "peak_bandwidth": peak,
        "num_blocks": llm.core.kv.pool.num_blocks,
        "dtype": str(llm.core.dtype).removeprefix("torch."),
        "backend": llm.core.loaded.model.attn_backend.name,
        "token_ids": [o.outputs[0].token_ids for o in outputs],  # to compare configurations; not reported
    }
    for label, min_batch in (("mbu_all", 1), ("mbu_64", 64)):
        chosen = [s for s in steps if s.decode_only and s.batch >= min_batch]
        busy = sum(s.duration_s for s in chosen)
        result[label] = sum(s.bytes_moved for s in chosen) / busy / peak if busy else None
        result[label + "_steps"] = len(chosen)
    breakdown = result["breakdown"] = {}  # reported as it is
    if phases is not None:
        breakdown["phases"] = phase_groups(steps, phases.rows)
        breakdown["outside_steps_s"] = elapsed - sum(map(sum, phases.rows))  # generate's own loop
    del llm
    release(device)
    return result


def greedy_tokens(directory: Path, work: Workload, args: argparse.Namespace, device: torch.device) -> list:
    """Every request's greedy tokens from a fresh fp32 engine (the shipped scheduling, no timing)."""
    llm = make_llm(directory, work, args, device, shipped_async(device), dtype="float32")
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens]
    tokens = [o.outputs[0].token_ids for o in llm.generate(work.prompts, params)]
    del llm
    release(device)
    return tokens


def fusion_check(directory: Path, work: Workload, args: argparse.Namespace, device: torch.device) -> dict:
    """``--fusion-check N``: the first N requests (outputs cut to 32 tokens) in fp32, fused and unfused. The
    fused kernels round as the separate ops do up to the order of a sum (tests/engine/test_cuda_fusion.py),
    so in fp32 every request should get the same tokens; a near-tie of the random weights may flip one."""
    if not cuda_fusion.ENABLED:
        return {"skipped": "KVGUARD_CUDA_FUSION=0: the fused kernels are off for this whole run"}
    short = Workload(work.prompts[: args.fusion_check], [min(n, 32) for n in work.output_lens[: args.fusion_check]])
    try:
        fused = greedy_tokens(directory, short, args, device)
        with cuda_fusion_enabled(False):
            unfused = greedy_tokens(directory, short, args, device)
    except Exception as error:  # noqa: BLE001 - reported; the timed figures stand without the check
        release(device)
        return {"error": f"{type(error).__name__}: {error}"}
    return {"dtype": "float32", "requests": len(short.prompts), "output_tokens": short.output_tokens,
            "identical_requests": sum(a == b for a, b in zip(fused, unfused, strict=True)),
            "applies": device.type == "cuda"}  # off CUDA both runs take the separate ops


def run_kernel_profile(directory: Path, work: Workload, args: argparse.Namespace, device: torch.device) -> dict:
    """``--kernel-profile``, after the model's timed runs: a fresh engine on the same checkpoint whose CUDA
    graphs are set aside before any is captured (no graph ever meets the profiler: see kernel_profile.py),
    ``args.kernel_profile`` decode-only steps at the largest batch. A failure is reported, not raised: the
    timed figures stand without the profile."""
    try:
        llm = make_llm(directory, work, args, device, shipped_async(device))
        try:
            llm.core.runner.graphs = None
            return profile_decode(llm.core, work.prompts[: args.max_num_seqs], args.kernel_profile)
        finally:  # its blocks and memory go back even when the profile fails
            del llm
            release(device)
    except Exception as error:  # noqa: BLE001 - see the docstring
        return {"kernel_profile_error": f"{type(error).__name__}: {error}"}


def phase_groups(steps: list[StepRecord], rows: list[tuple[float, ...]]) -> dict[str, dict | None]:
    """Mean ms per step of each phase (``step_phases.summarize``) over the decode-only steps of batch >= 64,
    the steps with a prefill chunk, and all steps; a group without steps is None."""
    if len(rows) != len(steps):
        raise RuntimeError(f"{len(rows)} steps timed by phase, {len(steps)} traced: the two must be the same")
    pairs = list(zip(steps, rows, strict=True))
    return {"decode_batch_ge_64": summarize([r for s, r in pairs if s.decode_only and s.batch >= 64]),
            "with_prefill": summarize([r for s, r in pairs if not s.decode_only]),
            "all": summarize(rows)}


def breakdown_lines(label: str, breakdown: dict) -> list[str]:
    """The printed form of a model's phases and kernel profile."""
    lines = []
    if "phases" in breakdown:
        title = ("ms per step by phase, from the timed run (host: every phase but model and sample; on a GPU, "
                 "model is launches or a graph replay, sample holds the wait for the device)")
        lines += ["", title, PHASES_HEADER, *format_phases(label, breakdown["phases"]),
                  f"{label}: {breakdown['outside_steps_s'] * 1e3:.1f} ms of the timed run outside engine steps"]
    if "kernels" in breakdown:
        lines += ["", *format_kernels(label, breakdown)]
    if "kernel_profile_error" in breakdown:
        lines += ["", f"{label}: kernel profile failed: {breakdown['kernel_profile_error']}"]
    return lines


def engine_figures(run: dict) -> dict:
    """The reported figures of one timed engine run."""
    return {"engine_tokens_per_s": run["tokens_per_s"], "engine_elapsed_s": run["elapsed_s"], "steps": run["steps"],
            "decode_only_steps": run["mbu_all_steps"], "decode_steps_batch_ge_64": run["mbu_64_steps"],
            "decode_mbu": run["mbu_all"], "decode_mbu_batch_ge_64": run["mbu_64"], **run["breakdown"]}


def identical(a: dict, b: dict) -> int:
    """How many requests got the very same tokens in two runs. Greedy, yet in bf16 not all: a batch's shape
    (which sequences are still in it, the graph's padded size) moves logits by rounding, and random weights
    leave near-ties (in fp32 every request matched, on the H200)."""
    return sum(x == y for x, y in zip(a["token_ids"], b["token_ids"], strict=True))


def engine_row(name: str, directory: Path, work: Workload, args: argparse.Namespace, device: torch.device,
               publish: Callable[[dict], None]) -> None:
    """One model's engine figures: the engine as shipped at the top level, the other configurations nested;
    ``publish``ed after each part, most telling first, so that a run cut short keeps what it measured."""
    label = name + ("-smoke" if args.smoke else "")
    ahead = shipped_async(device)
    shipped = run_engine(directory, work, args, device, ahead)
    row = {
        "model": label, **engine_figures(shipped),
        "hf_tokens_per_s": None, "ratio": None,  # transformers runs last (run_hf), and fills these in
        "output_tokens": work.output_tokens, "dtype": shipped["dtype"], "attention_backend": shipped["backend"],
        "num_blocks": shipped["num_blocks"], "peak_bandwidth_gbps": shipped["peak_bandwidth"] / 1e9,
        "async_scheduling": ahead, "cuda_fusion": cuda_fusion.ENABLED and device.type == "cuda",
        "workload": {"num_requests": len(work.prompts), "input_lens": list(args.input_len),
                     "output_lens": list(args.output_len), "max_num_seqs": args.max_num_seqs,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed},
        "command": command(),  # rows of several runs share one report (--merge)
    }
    publish(row)
    print("\n".join(breakdown_lines(label, shipped["breakdown"])))
    if args.async_scheduling == "both":
        other = run_engine(directory, work, args, device, not ahead)
        row["other_scheduling"] = {"async_scheduling": not ahead, **engine_figures(other),
                                   "identical_requests": identical(other, shipped)}
        by_setting = {ahead: shipped, not ahead: other}
        row["async_speedup"] = by_setting[True]["tokens_per_s"] / by_setting[False]["tokens_per_s"]
        row["faster_async_scheduling"] = row["async_speedup"] > 1  # the evidence for the default (issue 46)
        publish(row)
        print("\n".join(breakdown_lines(label + ("+async" if not ahead else "-async"), other["breakdown"])))
    if args.unfused:
        with cuda_fusion_enabled(False):
            unfused = run_engine(directory, work, args, device, ahead)
        row["unfused"] = {**engine_figures(unfused), "identical_requests": identical(unfused, shipped)}
        publish(row)
        print("\n".join(breakdown_lines(label + "-unfused", unfused["breakdown"])))
    if args.fusion_check:
        row["fusion_fp32"] = fusion_check(directory, work, args, device)
        publish(row)
    if args.kernel_profile:
        row.update(run_kernel_profile(directory, work, args, device))
        publish(row)
        print("\n".join(breakdown_lines(label, {k: v for k, v in row.items() if k.startswith("kernel")})))


def run_hf(directory: Path, work: Workload, args: argparse.Namespace, device: torch.device) -> dict:
    """transformers on the first ``--hf-requests`` requests (all by default), in batches of ``--hf-batch-size``."""
    subset = work.head(args.hf_requests or len(work.prompts))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every row runs to max_new_tokens
    model.generation_config.pad_token_id = 0

    hf_generate(model, subset.prompts[:2], 4, device)  # warm-up: kernels, allocator
    sync(device)
    start = time.perf_counter()
    size = args.hf_batch_size
    for first in range(0, len(subset.prompts), size):
        hf_generate(model, subset.prompts[first : first + size], max(subset.output_lens[first : first + size]),
                    device)
    sync(device)
    elapsed = time.perf_counter() - start
    del model
    release(device)
    return {"hf_tokens_per_s": subset.output_tokens / elapsed, "hf_elapsed_s": elapsed,
            "hf_requests": len(subset.prompts), "hf_output_tokens": subset.output_tokens,
            "hf_batch_size": min(size, len(subset.prompts)), "hf_command": command()}


def hf_generate(
    model: transformers.PreTrainedModel, prompts: list[list[int]], new_tokens: int, device: torch.device
) -> None:
    """One left-padded batch through ``generate``, every row producing exactly ``new_tokens`` tokens."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
        )
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {new_tokens}")


def percent(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction:.1%}"


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def table(rows: list[dict]) -> list[str]:
    """The printed summary: one line per model (the engine as shipped), one per nested configuration."""
    header = f"{'model':<28}{'engine tok/s':>14}{'hf tok/s':>12}{'ratio':>8}{'decode MBU':>12}{'MBU b>=64':>11}"
    lines = [header + "  details"]
    for row in rows:
        hf, ratio = row.get("hf_tokens_per_s"), row.get("ratio")
        hf_text = "" if hf is None else f"transformers {row['hf_elapsed_s']:.2f} s on {row['hf_requests']} requests"
        lines.append(
            f"{row['model']:<28}{row['engine_tokens_per_s']:>14,.0f}{'-' if hf is None else f'{hf:,.0f}':>12}"
            f"{'-' if ratio is None else f'{ratio:.1f}x':>8}{percent(row['decode_mbu']):>12}"
            f"{percent(row['decode_mbu_batch_ge_64']):>11}  as shipped (async_scheduling "
            f"{'on' if row['async_scheduling'] else 'off'}); {row['output_tokens']} output tokens; engine "
            f"{row['engine_elapsed_s']:.2f} s, {row['steps']} steps ({row['decode_only_steps']} decode-only, "
            f"{row['decode_steps_batch_ge_64']} of batch >= 64), {row['dtype']}, {row['attention_backend']} "
            f"attention, {row['num_blocks']} KV blocks; {hf_text}")
        nested = [("other_scheduling", f"async_scheduling {'on' if not row['async_scheduling'] else 'off'}"),
                  ("unfused", "CUDA fusions off")]
        for key, what in nested:
            if key in row:
                other = row[key]
                lines.append(f"{'  ' + what:<28}{other['engine_tokens_per_s']:>14,.0f}{'':>12}{'':>8}"
                             f"{percent(other['decode_mbu']):>12}{percent(other['decode_mbu_batch_ge_64']):>11}"
                             f"  engine {other['engine_elapsed_s']:.2f} s; {other['identical_requests']} of "
                             f"{row['workload']['num_requests']} requests token for token as shipped")
        if "faster_async_scheduling" in row:
            lines.append(f"  faster: async_scheduling {'on' if row['faster_async_scheduling'] else 'off'} "
                         f"(on / off = {row['async_speedup']:.3f})")
        if "identical_requests" in row.get("fusion_fp32", {}):
            check = row["fusion_fp32"]
            lines.append(f"  fused vs unfused greedy tokens, fp32: {check['identical_requests']} of {check['requests']}"
                         f" requests identical{'' if check['applies'] else ' (no CUDA: both unfused)'}")
        elif "fusion_fp32" in row:
            lines.append(f"  fused vs unfused greedy tokens, fp32: {row['fusion_fp32']}")
    return lines


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=DEFAULT_MODELS)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100, help="shortest input and output")
    parser.add_argument("--max-len", type=int, default=1024, help="longest input and output")
    parser.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help="output lengths apart from the inputs' (default: --min-len, --max-len)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-scheduling", choices=["shipped", "both"], default="shipped",
                        help="both: also the other run-ahead setting than the shipped one (on CUDA only), nested")
    parser.add_argument("--unfused", action="store_true", help="also the timed run with the CUDA fusions off, nested")
    parser.add_argument("--fusion-check", type=int, default=0, metavar="N",
                        help="greedy tokens fused vs unfused in fp32 on the first N requests (0: off)")
    parser.add_argument("--phases", action=argparse.BooleanOptionalAction, default=True,
                        help="time each step's phases during the timed run (--no-phases: to measure their cost)")
    parser.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                        help="after the timed run, profile N decode-only steps at the largest batch (0: off)")
    parser.add_argument("--hf", choices=["run", "skip", "only"], default="run",
                        help="transformers after the engine; only: fill in the rows an earlier --hf skip wrote")
    parser.add_argument("--hf-requests", type=int, help="transformers on the first N requests (default: all)")
    parser.add_argument("--hf-batch-size", type=int, default=256, help="requests per transformers generate call")
    parser.add_argument("--checkpoint-dir", type=Path,
                        help="keep the random-weight checkpoints here and reuse them (default: a temporary one)")
    parser.add_argument("--smoke", action="store_true",
                        help="toy shapes and 8 short requests: proves the script runs, measures nothing")
    parser.add_argument("--json", type=Path,
                        help=f"write the raw report here (default on a GPU, without --smoke: {GPU_REPORT})")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of other models already in the --json report (one report, several runs)")
    args = parser.parse_args()
    if args.smoke:
        args.num_requests, args.min_len, args.max_len, args.max_num_seqs, args.hf_batch_size = 8, 4, 12, 8, 8
        args.output_len = None
    args.input_len = (args.min_len, args.max_len)
    args.output_len = tuple(args.output_len or args.input_len)
    return args


def main() -> None:
    args = parse_args()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if args.smoke:
        # Toy tensors gain nothing from intra-op threads; on a busy host their spin-waits cost ~10 ms an op.
        torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    print_preamble(device, args.smoke, cpu_run="not a performance figure")
    print(f"requests: {args.num_requests}, input lengths uniform in {list(args.input_len)}, output lengths in "
          f"{list(args.output_len)}, ignore_eos, greedy; engine max_num_seqs={args.max_num_seqs}, "
          f"max_num_batched_tokens={args.max_num_batched_tokens}; transformers ({args.hf}) on "
          f"{args.hf_requests or 'all'} requests, batch {args.hf_batch_size}")
    print(f"peak bandwidth (datasheet, or a measured copy): {peak_bandwidth(device) / 1e9:.0f} GB/s")
    path = args.json or (GPU_REPORT if device.type == "cuda" and not args.smoke else None)
    rows: dict[str, dict] = {}
    if path is not None and (args.merge or args.hf == "only") and path.is_file():
        rows = {row["model"]: row for row in json.loads(path.read_text())["results"]}
    ran: list[str] = []

    def save() -> None:  # after every part: a run cut short (out of memory, out of time) keeps its figures
        if path is not None:
            write_report(path, device_report(device, list(rows.values()),
                                             peak_bandwidth_gbps=peak_bandwidth(device) / 1e9))

    def publish(label: str, row: dict) -> None:
        rows[label] = row
        save()

    with tempfile.TemporaryDirectory(prefix="kvguard-checkpoints-") as tmp:
        root = args.checkpoint_dir or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        workloads = {}
        for name in args.models:  # every engine run first, transformers last
            directory, vocab = checkpoint(name, args.smoke, dtype, device, root)
            label = name + ("-smoke" if args.smoke else "")
            work = workloads[name] = make_workload(args.num_requests, args.input_len, args.output_len, vocab,
                                                   args.seed)
            if args.hf != "only":
                ran.append(label)
                engine_row(name, directory, work, args, device, partial(publish, label))
        for name in args.models if args.hf != "skip" else []:
            label = name + ("-smoke" if args.smoke else "")
            if label not in rows:
                print(f"transformers: no engine row for {label} in {path} to fill in (its engine run failed?)")
                continue
            directory, _ = checkpoint(name, args.smoke, dtype, device, root)
            rows[label].update(run_hf(directory, workloads[name], args, device))
            rows[label]["ratio"] = rows[label]["engine_tokens_per_s"] / rows[label]["hf_tokens_per_s"]
            ran.append(label)
            save()
    print("\n".join(table([rows[label] for label in dict.fromkeys(ran)])))
    if path is not None:
        print(f"report: {path}")


if __name__ == "__main__":
    main()
