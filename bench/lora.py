"""Multi-LoRA throughput: SmolLM2 on the CPU, a batch mixing four adapters and the base model against the
same batch on the base model alone, side by side in one run (goal: the mix keeps >= 0.75 of the base's
generated tokens per second).

One engine serves four random rank-``--rank`` adapters on every projection (q/k/v/o, gate/up/down; PEFT's
layout, written here and loaded as ``POST /v1/load_lora_adapter`` loads them), ``--max-loras 4``. Each round generates ``--batch`` greedy completions of ``--tokens``
tokens (``ignore_eos``) twice, back to back: every prompt on the base, and the prompts spread round robin
over the base and the four adapters (a fifth each); rounds repeat ``--repeats`` times, alternating which
goes first. Reported: each run's generated tokens per second of wall time and per second of this process's
CPU time (prefill included; the prompts are short chat turns), and the ratio mixed / base of each round,
with their median. The engine runs one torch thread, so CPU time counts its work and not the waits that
other processes on a shared machine add; the wall-time ratios move with them.

    .venv/bin/python bench/lora.py                 # a few minutes on one core
    .venv/bin/python bench/lora.py --smoke         # the tiny model, a few tokens: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from run_info import device_report, print_preamble, write_report
from safetensors.torch import save_file

from engine import LLM, SamplingParams
from engine.model.config import ModelConfig
from engine.model.lora import TARGET_MODULES, projection_shapes
from engine.protocol import ChatMessage

ADAPTERS = ["support", "legal", "billing", "sales"]
QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn.", "Explain gravity to a child.",
             "List three primary colors.", "How do I boil an egg?", "What is 12 times 7?",
             "Translate 'good morning' into Spanish.", "Give me a name for a pet turtle.",
             "Why is the sky blue?", "Name a fast animal."]


def write_adapter(directory: Path, config: ModelConfig, rank: int, seed: int) -> str:
    """A random adapter on every projection, in PEFT's directory layout."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (fan_in, fan_out) in projection_shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES)}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return str(directory)


def run(llm: LLM, prompts: list[list[int]], loras: list[str | None], tokens: int) -> tuple[float, float]:
    """Generated tokens per second of wall time and of CPU time."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, lora=loras)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return generated / wall, generated / cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("bench/results/lora.json"))
    args = parser.parse_args()
    model, tokens, batch = ("tiny", 4, 5) if args.smoke else ("smollm2", args.tokens, args.batch)
    repeats = 2 if args.smoke else args.repeats
    print_preamble(torch.device("cpu"), args.smoke)
    # Adapters are written for the loaded model's shapes and registered as the runtime load route does.
    llm = LLM(model, device="cpu", dtype="float32", allow_runtime_lora=True, max_loras=len(ADAPTERS),
              max_lora_rank=args.rank, enable_prefix_caching=False)
    registry = llm.core.loras
    assert registry is not None
    with tempfile.TemporaryDirectory() as scratch:
        for seed, name in enumerate(ADAPTERS):
            registry.load(name, write_adapter(Path(scratch) / name, llm.core.loaded.config, args.rank, seed),
                          reserved={llm.core.model_name})
    loaded = llm.core.loaded
    prompts = [loaded.tokenizer.encode(loaded.chat_template.render([ChatMessage(role="user", content=q)]),
                                       add_special_tokens=False) for q in (QUESTIONS * batch)[:batch]]
    mixed = [([None, *ADAPTERS])[i % (len(ADAPTERS) + 1)] for i in range(batch)]
    run(llm, prompts[:2], [None, ADAPTERS[0]], 2)  # warm-up
    rounds = []
    for repeat in range(repeats):
        order = ["base", "mixed"] if repeat % 2 == 0 else ["mixed", "base"]
        rates = {name: run(llm, prompts, [None] * batch if name == "base" else mixed, tokens) for name in order}
        (base_wall, base_cpu), (mixed_wall, mixed_cpu) = rates["base"], rates["mixed"]
        rounds.append({"base_wall": base_wall, "mixed_wall": mixed_wall, "base_cpu": base_cpu, "mixed_cpu": mixed_cpu,
                       "ratio_wall": mixed_wall / base_wall, "ratio_cpu": mixed_cpu / base_cpu})
        print(f"round {repeat + 1}: tokens/s wall base {base_wall:6.1f} mixed {mixed_wall:6.1f} "
              f"({mixed_wall / base_wall:.3f}); per CPU s base {base_cpu:6.1f} mixed {mixed_cpu:6.1f} "
              f"({mixed_cpu / base_cpu:.3f})", flush=True)
    ratio_cpu = statistics.median(r["ratio_cpu"] for r in rounds)
    ratio_wall = statistics.median(r["ratio_wall"] for r in rounds)
    print(f"mixed / base, median of {len(rounds)} rounds: {ratio_cpu:.3f} per CPU second, {ratio_wall:.3f} "
          f"per wall second; goal >= 0.75")
    write_report(args.out, device_report(torch.device("cpu"), rounds, model=model, batch=batch, tokens=tokens,
                                         rank=args.rank, adapters=len(ADAPTERS), ratio_cpu=round(ratio_cpu, 3),
                                         ratio_wall=round(ratio_wall, 3), smoke=args.smoke))


if __name__ == "__main__":
    main()
