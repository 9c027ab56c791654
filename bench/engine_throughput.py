"""Offline throughput: the engine against Hugging Face ``transformers`` ``generate`` on the same requests.

The standard offline benchmark: 256 requests whose input and output lengths are uniform in [100, 1024],
``ignore_eos`` so every request produces exactly its output length, greedy decoding. Models with the shapes
of Qwen2.5-0.5B and Llama-3.2-1B and random weights (throughput does not depend on the values) are written
once with ``save_pretrained`` to a temporary directory, and both systems load that same checkpoint.

- engine: ``LLM`` with ``max_num_seqs=256`` and ``max_num_batched_tokens=8192``, after a warm-up that
  compiles the kernels and captures a CUDA graph for every decode batch size.
- transformers: the baseline a user would otherwise pick, ``generate`` on left-padded batches of
  ``--hf-batch-size`` requests, each batch running to its longest output; only the requested output
  tokens count.

Reported: output tokens/s for each, their ratio, and decode MBU: over the engine's decode-only steps, the
bytes they move (weights once, every context's K/V, the new K/V) per second of step time, over the
device's peak bandwidth (``engine.worker.bandwidth``), for all of them and for those of batch >= 64.

Where the engine's time goes, from the timed run itself (``bench/step_phases.py`` wraps the engine's
functions; its own cost is a few microseconds a step): each step's phases, averaged over the decode-only
steps of batch >= 64, the steps with a prefill chunk, and all steps; host work per step (every phase but
"model" and "sample"), "model" (on a GPU: kernel launches or a graph replay) and "sample" (on a GPU: the
wait for the device); and the time ``generate`` spent outside its steps. ``--kernel-profile N``: after a
model's timed runs, a fresh engine runs N decode-only steps at the largest batch, eagerly, under
``torch.profiler`` (``bench/kernel_profile.py``): the top 15 kernels (on a CPU: ops) by self time.

    .venv/bin/python bench/engine_throughput.py         # both models, on the GPU (bench/results/gpu/)
    .venv/bin/python bench/engine_throughput.py --kernel-profile 20   # and the kernels of 20 decode steps
    .venv/bin/python bench/engine_throughput.py --smoke          # toy shapes: checks that it runs
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from kernel_profile import format_kernels, profile_decode, sync
from run_info import device_report, print_preamble, write_report
from step_phases import PHASES_HEADER, StepPhases, format_phases, summarize

from engine import LLM, SamplingParams
from engine.core import EngineCore
from engine.sched.output import SchedulerOutput
from engine.worker.bandwidth import peak_bandwidth
from engine.worker.runner import StepResult

# Architecture hyperparameters of the two published models; weights are random.
SHAPES: dict[str, tuple[type[transformers.PretrainedConfig], dict]] = {
    "qwen2.5-0.5b": (
        transformers.Qwen2Config,
        {
            "vocab_size": 151936,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
    ),
    "llama-3.2-1b": (
        transformers.LlamaConfig,
        {
            "vocab_size": 128256,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
}
GPU_REPORT = Path(__file__).parent / "results" / "gpu" / "engine_throughput.json"
# --smoke: the same two architectures at toy size, so the whole pipeline runs on a CPU in seconds.
SMOKE_SIZES = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 16384,
}


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(slots=True)
class StepRecord:
    decode_only: bool
    batch: int
    bytes_moved: int
    duration_s: float


def write_checkpoint(
    name: str, smoke: bool, dtype: torch.dtype, device: torch.device, directory: Path
) -> int:
    """Save a random-weight model of shape ``name``; return its vocabulary size."""
    config_class, sizes = SHAPES[name]
    config = config_class(**{**sizes, **(SMOKE_SIZES if smoke else {})})
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of minutes for a 1B model
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(directory)
    del model
    release(device)
    return config.vocab_size


def make_workload(count: int, low: int, high: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(count):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(low, high))])
        output_lens.append(rng.randint(low, high))
    return Workload(prompts, output_lens)


def trace_steps(core: EngineCore) -> list[StepRecord]:
    """Record every engine step: decode-only or not, batch size, bytes moved, step time (from telemetry)."""
    steps: list[StepRecord] = []
    execute, on_step = core.runner.execute, core.stats.on_step
    # First in, first out: an engine that runs a step ahead executes the next step before this one reports.
    kinds: deque[tuple[bool, int]] = deque()

    def traced_execute(out: SchedulerOutput, *args, **kwargs) -> StepResult:
        kinds.append((all(s.num_new_tokens == 1 for s in out.scheduled), len(out.scheduled)))
        return execute(out, *args, **kwargs)

    def traced_on_step(duration_s: float, num_tokens: int, has_decode: bool, bytes_moved: int) -> None:
        decode_only, batch = kinds.popleft()
        steps.append(StepRecord(decode_only, batch, bytes_moved, duration_s))
        on_step(duration_s, num_tokens, has_decode, bytes_moved)

    core.runner.execute = traced_execute
    core.stats.on_step = traced_on_step
    return steps


def make_llm(
    directory: Path, work: Workload, args: argparse.Namespace, device: torch.device, async_scheduling: bool = False
) -> LLM:
    return LLM(
        str(directory),
        device=device.type,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max(map(len, work.prompts)) + max(work.output_lens),
        enable_prefix_caching=False,
        async_scheduling=async_scheduling,
    )


def run_engine(
    directory: Path, work: Workload, args: argparse.Namespace, device: torch.device, async_scheduling: bool = False
) -> dict:
    llm = make_llm(directory, work, args, device, async_scheduling)
    # Warm-up: short prompts whose outputs end one step apart, so the decode batch shrinks through every
    # size once (compiling each kernel variant and capturing each CUDA graph before the clock starts).
    # Whole prompts: their block tables are as wide as the timed run's, and Triton compiles a kernel again
    # for an argument (a table's row stride) that is 1, divisible by 16, or neither (first H200 run: 16-token
    # prompts left the timed run ~1.5 s of compiling in its first prefill steps).
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
        "token_ids": [o.outputs[0].token_ids for o in outputs],  # to compare modes; not reported
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


def run_kernel_profile(directory: Path, work: Workload, args: argparse.Namespace, device: torch.device) -> dict:
    """``--kernel-profile``, after the model's timed runs: a fresh engine on the same checkpoint whose CUDA
    graphs are set aside before any is captured (no graph ever meets the profiler: see kernel_profile.py),
    ``args.kernel_profile`` decode-only steps at the largest batch. A failure is reported, not raised: the
    timed figures stand without the profile."""
    try:
        llm = make_llm(directory, work, args, device)
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


def run_transformers(directory: Path, work: Workload, args: argparse.Namespace, device: torch.device) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every row runs to max_new_tokens
    model.generation_config.pad_token_id = 0

    hf_generate(model, work.prompts[:2], 4, device)  # warm-up: kernels, allocator
    sync(device)
    start = time.perf_counter()
    size = args.hf_batch_size
    for first in range(0, len(work.prompts), size):
        hf_generate(
            model, work.prompts[first : first + size], max(work.output_lens[first : first + size]), device
        )
    sync(device)
    elapsed = time.perf_counter() - start
    del model
    release(device)
    return {"tokens_per_s": work.output_tokens / elapsed, "elapsed_s": elapsed}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument(
        "--hf-batch-size", type=int, default=256, help="requests per transformers generate call"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-scheduling", choices=["off", "on", "both"], default="off",
                        help="the engine's run-ahead scheduling; both: the timed run without it, then with it")
    parser.add_argument("--phases", action=argparse.BooleanOptionalAction, default=True,
                        help="time each step's phases during the timed run (--no-phases: to measure their cost)")
    parser.add_argument("--kernel-profile", type=int, default=0, metavar="N",
                        help="after the timed run, profile N decode-only steps at the largest batch (0: off)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="toy shapes and 8 short requests: proves the script runs, measures nothing",
    )
    parser.add_argument("--json", type=Path,
                        help=f"write the raw report here (default on a GPU, without --smoke: {GPU_REPORT})")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if args.smoke:
        # Toy tensors gain nothing from intra-op threads; on a busy host their spin-waits cost ~10 ms an op.
        torch.set_num_threads(1)
        args.num_requests, args.min_len, args.max_len, args.max_num_seqs, args.hf_batch_size = 8, 4, 12, 8, 8
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    print_preamble(device, args.smoke, cpu_run="not a performance figure")
    print(
        f"requests: {args.num_requests}, input and output lengths uniform in "
        f"[{args.min_len}, {args.max_len}], "
        f"ignore_eos, greedy; engine max_num_seqs={args.max_num_seqs}, "
        f"max_num_batched_tokens={args.max_num_batched_tokens}; transformers batch {args.hf_batch_size}"
    )
    print(f"peak bandwidth: {peak_bandwidth(device) / 1e9:.0f} GB/s")
    header = (
        f"{'model':<28}{'engine tok/s':>14}{'hf tok/s':>12}{'ratio':>8}{'decode MBU':>12}"
        f"{'MBU b>=64':>11}  details"
    )
    rows, results, breakdowns = [], [], []
    path = args.json or (GPU_REPORT if device.type == "cuda" and not args.smoke else None)
    for name in args.models:
        with tempfile.TemporaryDirectory(prefix=f"kvguard-{name}-") as tmp:
            vocab = write_checkpoint(
                name,
                args.smoke,
                torch.bfloat16 if device.type == "cuda" else torch.float32,
                device,
                Path(tmp),
            )
            work = make_workload(args.num_requests, args.min_len, args.max_len, vocab, args.seed)
            ours = run_engine(Path(tmp), work, args, device, args.async_scheduling == "on")
            ahead = None
            if args.async_scheduling == "both":
                ahead = run_engine(Path(tmp), work, args, device, True)
            theirs = run_transformers(Path(tmp), work, args, device)
            if args.kernel_profile:
                ours["breakdown"].update(run_kernel_profile(Path(tmp), work, args, device))
        label = f"{name}{'-smoke' if args.smoke else ''}-shaped"
        rows.append(
            f"{label:<28}{ours['tokens_per_s']:>14,.0f}{theirs['tokens_per_s']:>12,.0f}"
            f"{ours['tokens_per_s'] / theirs['tokens_per_s']:>7.1f}x{percent(ours['mbu_all']):>12}"
            f"{percent(ours['mbu_64']):>11}"
            f"  {work.output_tokens} output tokens; engine {ours['elapsed_s']:.2f} s, {ours['steps']} steps "
            f"({ours['mbu_all_steps']} decode-only, {ours['mbu_64_steps']} of batch >= 64), {ours['dtype']}, "
            f"{ours['backend']} attention, {ours['num_blocks']} KV blocks; "
            f"transformers {theirs['elapsed_s']:.2f} s"
        )
        results.append({
            "model": label.removesuffix("-shaped"),
            "engine_tokens_per_s": ours["tokens_per_s"],
            "hf_tokens_per_s": theirs["tokens_per_s"],
            "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
            "decode_mbu": ours["mbu_all"],
            "decode_mbu_batch_ge_64": ours["mbu_64"],
            "output_tokens": work.output_tokens,
            "engine_elapsed_s": ours["elapsed_s"],
            "hf_elapsed_s": theirs["elapsed_s"],
            "steps": ours["steps"],
            "decode_only_steps": ours["mbu_all_steps"],
            "decode_steps_batch_ge_64": ours["mbu_64_steps"],
            "dtype": ours["dtype"],
            "attention_backend": ours["backend"],
            "num_blocks": ours["num_blocks"],
            "async_scheduling": args.async_scheduling == "on",
            **ours["breakdown"],
        })
        if ahead is not None:
            # The same requests with run-ahead scheduling, after the run above: its figures, and how many
            # requests got the very tokens they got there. Greedy, yet in bf16 not all: a batch's shape
            # (which sequences are still in it, the graph's padded size) moves logits by rounding, and
            # random weights leave near-ties (in fp32 every request matched, on the H200).
            identical = sum(a == b for a, b in zip(ahead["token_ids"], ours["token_ids"], strict=True))
            results[-1]["with_async_scheduling"] = {
                "engine_tokens_per_s": ahead["tokens_per_s"], "engine_elapsed_s": ahead["elapsed_s"],
                "steps": ahead["steps"], "decode_mbu": ahead["mbu_all"], "decode_mbu_batch_ge_64": ahead["mbu_64"],
                "identical_requests": identical, **ahead["breakdown"]}
            rows.append(
                f"{label + ' async':<28}{ahead['tokens_per_s']:>14,.0f}{'':>12}"
                f"{ahead['tokens_per_s'] / theirs['tokens_per_s']:>7.1f}x{percent(ahead['mbu_all']):>12}"
                f"{percent(ahead['mbu_64']):>11}  async_scheduling; engine {ahead['elapsed_s']:.2f} s, "
                f"{ahead['steps']} steps; {identical} of {len(ours['token_ids'])} requests token for token "
                f"as without")
        breakdowns += breakdown_lines(label.removesuffix("-shaped"), ours["breakdown"])
        if ahead is not None:
            breakdowns += breakdown_lines(label.removesuffix("-shaped") + "+async", ahead["breakdown"])
        if path is not None:  # after every model: a run cut short (out of memory, out of time) keeps its figures
            write_report(path, device_report(
                device, results, peak_bandwidth_gbps=peak_bandwidth(device) / 1e9,
                num_requests=args.num_requests, lengths=[args.min_len, args.max_len],
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                hf_batch_size=args.hf_batch_size))
    print(header)
    print("\n".join(rows))
    if breakdowns:
        print("\n".join(breakdowns))
    if path is not None:
        print(f"report: {path}")


if __name__ == "__main__":
    main()
