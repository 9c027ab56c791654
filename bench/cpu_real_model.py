"""SmolLM2 on the CPU: the engine against ``transformers`` ``generate``, side by side in one run.

Issue 13's benchmark: what the default model of ``make run`` costs on a CPU. Both systems load the one
file ``make setup`` installs (SmolLM2-135M-Instruct, Q4_1 GGUF): the engine as ``LLM("smollm2")``,
transformers as ``from_pretrained(directory, gguf_file=name)``; both dequantize it to float32 and run with
the same number of torch threads (``--threads``, 1 by default: a figure of what the code costs, not of how
many cores the host has; the engine's ``cpu_threads`` default is 1 too).

- batch: ``--requests`` prompts of 32 to 256 random token ids, outputs of 16 to 128 tokens (seeded),
  ``ignore_eos`` and greedy, so that both produce exactly the requested tokens. The engine gets them all at
  once through ``LLM.generate``; transformers left-padded batches of ``--hf-batch-size`` requests (all of
  them by default), each running to its longest output. Reported: useful output tokens per second (the
  requested tokens only, not the padding rows' extra ones).
- single stream: one 64-token prompt; decode tokens/s = ``N / (T(1 + N) - T(1))``, where ``T(k)`` is the
  time to generate ``k`` tokens (prefill and the first token cancel out), median of ``--repeats``.
- profile: the engine's batch run once more under cProfile: where its step time goes (model forward,
  attention, LM head, sampling, step inputs, scheduler, outputs), and the functions with the most self time
  (torch operators show as ``{built-in method ...}``; Python frames are the per-op overhead). cProfile
  slows Python frames, so the shares overstate Python overhead somewhat; the wall time is printed with it.

    .venv/bin/python bench/cpu_real_model.py            # a few minutes on one core
    .venv/bin/python bench/cpu_real_model.py --smoke    # tiny sizes: checks that it runs, measures nothing
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from run_info import command, describe

from engine import LLM, SamplingParams
from engine.core import EngineCore
from engine.kernels.torch_ref import TorchAttentionBackend
from engine.model.llama import LlamaForCausalLM
from engine.model.sources import SMOLLM2, smollm2_path
from engine.output_processor import OutputProcessor
from engine.sched.scheduler import Scheduler
from engine.worker import sampler
from engine.worker.batch import HostBatch

BLOCK_SIZE = 16
# The parts of an engine step the profile reports, by the functions that do them. Indented parts are inside
# the part above them; "rest of the step" is the step less the unindented parts.
PARTS: list[tuple[str, list[Callable[..., object]]]] = [
    ("model forward (embeddings, 30 layers, norm)", [LlamaForCausalLM.forward]),
    ("  attention (torch reference: per layer, a loop over sequences)", [TorchAttentionBackend.forward]),
    ("  KV store", [TorchAttentionBackend.store_kv]),
    ("LM head (logits of the sampled rows)", [LlamaForCausalLM.compute_logits]),
    ("sampling", [sampler.sample]),
    ("step inputs (host batch, input tensors, attention metadata)",
     [HostBatch.build, HostBatch.to_device]),
    ("scheduler (schedule, commit)", [Scheduler.schedule, Scheduler.advance, Scheduler.settle]),
    ("request outputs", [OutputProcessor.output]),
]


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    stream_prompt: list[int]  # the single stream's

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(slots=True)
class Sizes:
    requests: int
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int]
    stream_prompt: int
    stream_tokens: int


FULL = Sizes(32, (32, 256), (16, 128), 64, 128)
SMOKE = Sizes(4, (8, 16), (4, 8), 8, 8)


def make_workload(sizes: Sizes, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*sizes.prompt_lens))]
               for _ in range(sizes.requests)]
    output_lens = [rng.randint(*sizes.output_lens) for _ in prompts]
    return Workload(prompts, output_lens, [rng.randrange(vocab) for _ in range(sizes.stream_prompt)])


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


# -- the engine --------------------------------------------------------------------------------------------
def load_engine(sizes: Sizes, threads: int) -> tuple[LLM, float]:
    """The engine on SmolLM2, its pool sized so that the batch never preempts (preemption is not what is
    measured here), prefix caching off so that no run reuses another's prompt; and its load time."""
    longest = sizes.prompt_lens[1] + sizes.output_lens[1]
    start = time.perf_counter()
    llm = LLM(SMOLLM2, device="cpu", cpu_threads=threads, block_size=BLOCK_SIZE,
              num_blocks=sizes.requests * -(-longest // BLOCK_SIZE), max_num_seqs=sizes.requests,
              enable_prefix_caching=False)
    return llm, time.perf_counter() - start


def engine_batch(llm: LLM, work: Workload) -> tuple[float, int]:
    """Seconds for the whole batch, and the engine steps it took."""
    steps = llm.telemetry().step
    start = time.perf_counter()
    outputs = llm.generate(work.prompts, [greedy(n) for n in work.output_lens])
    elapsed = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    if produced != work.output_lens:
        raise RuntimeError(f"the engine produced {produced} tokens, expected {work.output_lens}")
    return elapsed, llm.telemetry().step - steps


def engine_generate(llm: LLM, prompt: list[int], tokens: int) -> float:
    start = time.perf_counter()
    llm.generate([prompt], greedy(tokens))
    return time.perf_counter() - start


# -- transformers ------------------------------------------------------------------------------------------
def load_transformers(path: Path) -> tuple[transformers.PreTrainedModel, float]:
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every row runs to max_new_tokens
    model.generation_config.pad_token_id = 0
    return model, time.perf_counter() - start


def hf_generate(model: transformers.PreTrainedModel, prompts: list[list[int]], tokens: int) -> float:
    """One left-padded batch through ``generate``, every row producing exactly ``tokens``; its seconds."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False)
    elapsed = time.perf_counter() - start
    if out.shape[1] != width + tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {tokens}")
    return elapsed


def hf_batch(model: transformers.PreTrainedModel, work: Workload, batch_size: int) -> float:
    return sum(hf_generate(model, work.prompts[first:first + batch_size],
                           max(work.output_lens[first:first + batch_size]))
               for first in range(0, len(work.prompts), batch_size))


# -- measurements ------------------------------------------------------------------------------------------
def decode_rate(generate: Callable[[int], float], tokens: int, repeats: int) -> float:
    """Decode tokens/s of one stream: ``tokens`` more tokens over the time they add to a 1-token run."""
    rates = []
    for _ in range(repeats):
        first = generate(1)
        rates.append(tokens / max(generate(1 + tokens) - first, 1e-9))
    return statistics.median(rates)


def profile(llm: LLM, work: Workload) -> tuple[pstats.Stats, float]:
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(llm.generate, work.prompts, [greedy(n) for n in work.output_lens])
    return pstats.Stats(profiler), time.perf_counter() - start


def cumulative(stats: pstats.Stats, functions: list[Callable[..., object]]) -> float:
    """Seconds spent in ``functions`` and everything they called (pstats keys them by their code)."""
    table = stats.stats  # type: ignore[attr-defined]
    total = 0.0
    for function in functions:
        code = function.__code__
        entry = table.get((code.co_filename, code.co_firstlineno, code.co_name))
        total += entry[3] if entry else 0.0
    return total


def profile_report(stats: pstats.Stats, wall_s: float, top: int) -> list[str]:
    step_s = cumulative(stats, [EngineCore.step])
    lines = [f"engine batch under cProfile: {wall_s:.2f} s wall, {step_s:.2f} s in EngineCore.step",
             f"  {'part of the step':<66}{'seconds':>9}{'share':>8}"]
    outer = 0.0
    for label, functions in PARTS:
        seconds = cumulative(stats, functions)
        if not label.startswith(" "):
            outer += seconds
        lines.append(f"  {label:<66}{seconds:>9.2f}{seconds / step_s:>8.1%}")
    rest = step_s - outer
    lines.append(f"  {'rest of the step (loop, telemetry)':<66}{rest:>9.2f}{rest / step_s:>8.1%}")
    table = stats.stats  # type: ignore[attr-defined]
    builtin = sum(row[2] for (path, _, _), row in table.items() if path == "~")
    python = sum(row[2] for (path, _, _), row in table.items() if path != "~")
    lines.append(f"self time: {builtin:.2f} s in built-ins (torch operators and C calls), "
                 f"{python:.2f} s in Python frames")
    lines.append(f"  {'function (most self time first)':<84}{'calls':>9}{'self s':>8}{'cum s':>8}")
    rows = sorted(table.items(), key=lambda item: item[1][2], reverse=True)[:top]
    for (path, line, name), (_, calls, own, cum, _) in rows:
        where = name if path == "~" else f"{Path(path).name}:{line}({name})"
        lines.append(f"  {where[:84]:<84}{calls:>9}{own:>8.2f}{cum:>8.2f}")
    return lines


@dataclass(slots=True)
class Result:
    load_s: float
    batch_s: float
    stream_tokens_per_s: float


def run_engine(sizes: Sizes, args: argparse.Namespace) -> tuple[Workload, Result, int, pstats.Stats, float]:
    """The workload (its token ids drawn from the model's vocabulary), the engine's figures, the steps of
    its batch run, and the profile of a second batch run with its wall time."""
    llm, load_s = load_engine(sizes, args.threads)
    work = make_workload(sizes, llm.core.loaded.config.vocab_size, args.seed)
    llm.generate([p[:16] for p in work.prompts[:4]], greedy(4))  # warm-up: allocator, first-call paths
    batch_s, steps = engine_batch(llm, work)
    stream = decode_rate(lambda n: engine_generate(llm, work.stream_prompt, n), sizes.stream_tokens,
                         args.repeats)
    stats, profiled_s = profile(llm, work)
    return work, Result(load_s, batch_s, stream), steps, stats, profiled_s


def run_transformers(path: Path, work: Workload, sizes: Sizes, args: argparse.Namespace) -> Result:
    model, load_s = load_transformers(path)
    hf_generate(model, [p[:16] for p in work.prompts[:2]], 4)  # warm-up
    batch_s = hf_batch(model, work, args.hf_batch_size)
    stream = decode_rate(lambda n: hf_generate(model, [work.stream_prompt], n), sizes.stream_tokens,
                         args.repeats)
    return Result(load_s, batch_s, stream)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads, for both systems")
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help="requests per transformers generate call (default: all of them)")
    parser.add_argument("--repeats", type=int, default=3, help="single-stream runs (the median is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=15, help="functions listed by self time in the profile")
    parser.add_argument("--smoke", action="store_true",
                        help="4 short requests, an 8-token stream: proves that it runs, measures nothing")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    if args.smoke:
        args.repeats = 1
    args.hf_batch_size = args.hf_batch_size or sizes.requests
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    print(f"machine: {describe(torch.device('cpu'))}")
    print(f"command: {command()}")
    if args.smoke:
        print("SMOKE RUN: tiny sizes, not a performance figure")
    path = smollm2_path()
    print(f"model: {SMOLLM2} ({path.name}, dequantized to float32), torch threads {args.threads}", flush=True)
    work, ours, steps, stats, profiled_s = run_engine(sizes, args)
    theirs = run_transformers(path, work, sizes, args)

    useful = work.output_tokens
    print(f"batch: {len(work.prompts)} requests, prompts of {sizes.prompt_lens[0]}-{sizes.prompt_lens[1]} "
          f"random token ids ({sum(map(len, work.prompts))} in all), outputs of {sizes.output_lens[0]}-"
          f"{sizes.output_lens[1]} tokens ({useful} useful), ignore_eos, greedy, seed {args.seed}; "
          f"transformers batches of {args.hf_batch_size}")
    print(f"single stream: a {sizes.stream_prompt}-token prompt, {sizes.stream_tokens} decoded tokens, "
          f"median of {args.repeats}")
    print(f"{'':<34}{'engine':>12}{'transformers':>14}{'ratio':>8}")
    print(f"{'batch, useful output tokens/s':<34}{useful / ours.batch_s:>12.1f}"
          f"{useful / theirs.batch_s:>14.1f}{theirs.batch_s / ours.batch_s:>7.2f}x")
    ours_stream, theirs_stream = ours.stream_tokens_per_s, theirs.stream_tokens_per_s
    print(f"{'single-stream decode tokens/s':<34}{ours_stream:>12.1f}{theirs_stream:>14.1f}"
          f"{ours_stream / theirs_stream:>7.2f}x")
    print(f"{'batch seconds':<34}{ours.batch_s:>12.2f}{theirs.batch_s:>14.2f}")
    print(f"{'load seconds':<34}{ours.load_s:>12.2f}{theirs.load_s:>14.2f}")
    print(f"engine batch: {steps} steps, {ours.batch_s / steps * 1e3:.1f} ms a step")
    print("\n".join(profile_report(stats, profiled_s, args.top)))


if __name__ == "__main__":
    main()
