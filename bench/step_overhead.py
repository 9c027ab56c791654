"""The engine's host work per decode step, phase by phase: what a GPU would wait on between its kernels.

A decode step of a small model on an H100 takes about a millisecond of device time at batch 256
(Qwen2.5-0.5B: 1 GB of weights and a few hundred MB of KV at ~3 TB/s), so every millisecond the host spends
scheduling, building inputs and committing tokens is throughput lost: the step loop is synchronous, the
device idles while the host works. This benchmark measures that host work with the ``tiny`` model on CPU,
where the model itself costs little, so the bookkeeping shows.

``batch`` sequences are prefilled with ``context``-token prompts, then ``steps`` decode-only steps are
timed, each phase separately, by ``bench/step_phases.py`` (schedule, inputs, model, sample, commit, outputs,
rest: see there). "host" here is every phase but "model": with the tiny model on a CPU, sampling is host
work; on a GPU "sample" also holds the wait for the device (``bench/engine_throughput.py`` reports it apart).

Python's garbage collections run inside whichever phase allocates when they fall due; their count and time
by generation are reported on their own, with the longest step (a full collection shows there).

    .venv/bin/python bench/step_overhead.py                        # batches 64 and 256, context 512
    .venv/bin/python bench/step_overhead.py --batch 256 --json out.json
    .venv/bin/python bench/step_overhead.py --model-stubbed         # the step's Python alone (hot caches)
    .venv/bin/python bench/step_overhead.py --smoke                 # a few steps: checks that it runs
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from pathlib import Path

import torch
from run_info import device_report, print_preamble, write_report
from step_phases import PHASES, StepPhases, summarize

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core import EngineCore


def build_core(batch: int, context: int, steps: int, device: str) -> EngineCore:
    block_size = 16
    blocks_per_seq = -(-(context + steps + 64) // block_size)
    config = EngineConfig(model="tiny", device=device, max_num_seqs=batch, max_num_batched_tokens=8192,
                          num_blocks=batch * blocks_per_seq + 16, block_size=block_size,
                          cpu_threads=1)
    core = EngineCore(config)
    rng = random.Random(0)
    for _ in range(batch):
        prompt = [rng.randrange(256) for _ in range(context)]
        core.add(core.make_request(prompt, SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)))
    return core


def stub_model(core: EngineCore) -> None:
    """Replace the model's forward and LM head with constant outputs (zeros: every draw is token 0, and the
    sequences ignore EOS), so that a step is its host work alone. With no forward between two steps to evict
    the host's data from the caches, this is the Python of a step with hot caches: a floor, not a figure of
    the real step."""
    config = core.loaded.config
    logits = torch.zeros(core.config.max_num_seqs, config.vocab_size)
    model = core.runner.model
    model.forward = lambda input_ids, *_: torch.zeros(len(input_ids), config.hidden_size)
    model.compute_logits = lambda hidden: logits[:len(hidden)]


def measure(batch: int, context: int, steps: int, device: str, stubbed: bool = False) -> dict:
    core = build_core(batch, context, steps, device)
    while core.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in core.scheduler.running):
        core.step()  # prefill every prompt
    if stubbed:
        stub_model(core)
    for _ in range(5):
        core.step()  # settle: every sequence decoding
    collections = {generation: [0, 0.0] for generation in range(3)}  # generation -> [count, seconds]
    collecting_since = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collecting_since[0] = time.perf_counter()
        else:
            record = collections[info["generation"]]
            record[0] += 1
            record[1] += time.perf_counter() - collecting_since[0]

    phases = StepPhases(core)
    gc.callbacks.append(on_gc)
    for _ in range(steps):
        if len(core.scheduler.running) != batch:
            raise RuntimeError(f"the decode batch shrank to {len(core.scheduler.running)}: raise --steps' margin")
        core.step()
    gc.callbacks.remove(on_gc)
    phases.detach()
    durations = [sum(row) for row in phases.rows]  # each step's wall time
    total = sum(durations)
    per_step_ms = summarize(phases.rows)["phases_ms"]
    host_ms = sum(ms for name, ms in per_step_ms.items() if name != "model")  # on a CPU, sampling is host work
    return {"batch": batch, "context": context, "steps": steps, "model_stubbed": stubbed, "step_ms": total / steps * 1e3,
            "host_ms": host_ms, "host_us_per_seq": host_ms * 1e3 / batch, "phases_ms": per_step_ms,
            "longest_step_ms": max(durations) * 1e3, "frozen_objects": gc.get_freeze_count(),
            "gc": {f"gen{generation}": {"collections": count, "ms": seconds * 1e3}
                   for generation, (count, seconds) in collections.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--model-stubbed", action="store_true",
                        help="the model's forward and LM head return constants: the step's host work alone, hot caches")
    parser.add_argument("--smoke", action="store_true", help="batch 4, 3 steps: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.context, args.steps = [4], 16, 3
    torch.manual_seed(0)
    results = [measure(batch, args.context, args.steps, args.device, args.model_stubbed) for batch in args.batch]
    print_preamble(torch.device(args.device), args.smoke)
    print(f"tiny model{' (stubbed: host work alone)' if args.model_stubbed else ''}, decode-only steps, context "
          f"{args.context} tokens at the start, {args.steps} steps timed")
    print("ms per step; gc: collections (ms in all) of the oldest generation, then of the younger two")
    print(f"{'batch':>5} {'step':>8} {'host':>7} {'us/seq':>7}  " + " ".join(f"{p:>8}" for p in PHASES)
          + f"  {'longest':>8}  {'full gc':>11}  {'young gc':>11}")
    for r in results:
        phases = " ".join(f"{r['phases_ms'][p]:8.3f}" for p in PHASES)
        full, young = r["gc"]["gen2"], [r["gc"]["gen0"], r["gc"]["gen1"]]
        young_gc = f"{sum(g['collections'] for g in young)} ({sum(g['ms'] for g in young):.0f})"
        print(f"{r['batch']:5d} {r['step_ms']:8.2f} {r['host_ms']:7.3f} {r['host_us_per_seq']:7.2f}  {phases}"
              f"  {r['longest_step_ms']:8.1f}  {full['collections']:>4} ({full['ms']:4.0f})  {young_gc:>11}")
    if args.json:
        write_report(args.json, device_report(torch.device(args.device), results))


if __name__ == "__main__":
    main()
