"""The engine's throughput at two commits, side by side in one run: did a change cost tokens/s?

Each round runs both trees at the same time, each in a fresh process that imports only its own tree, pinned
to a core of its own (the two swap cores every round), so that whatever slows the shared machine falls on
both alike: run one after the other, the rounds of one tree alone spread 2x on the 2-core EPYC VM (tiny
1,949-3,813 tok/s in one run) and a change that runs the very same ops measured 0.87. The figure is the
median over rounds of each round's B/A; without ``taskset`` or a second core the trees run in turn, A B,
then B A. The workloads:

- ``tiny``: the built-in model on the CPU through the public ``LLM`` API (``--requests`` prompts of 64 to
  256 token ids, 32 to 128 output tokens each, ``ignore_eos``, greedy, one torch thread);
- ``smoke``: that tree's own ``bench/engine_throughput.py --smoke`` (toy Qwen/Llama shapes), its engine
  tokens/s as it prints them.

Reported: the median tokens/s of each tree per workload, and the median of the rounds' B/A.

    .venv/bin/python bench/engine_ab.py --baseline c643250            # A = that commit, B = this tree
    .venv/bin/python bench/engine_ab.py --a /path/to/tree --b . --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from run_info import command, describe
from stack import baseline_tree, pinned

ROOT = Path(__file__).resolve().parent.parent

TINY_WORKLOAD = """
import json, random, time, torch
torch.set_num_threads(1)
from engine import LLM, SamplingParams
rng = random.Random(0)
prompts = [[rng.randrange(256) for _ in range(rng.randint(64, 256))] for _ in range({requests})]
params = [SamplingParams(max_tokens=rng.randint(32, 128), temperature=0.0, ignore_eos=True) for _ in prompts]
llm = LLM("tiny", num_blocks=2048, max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False)
llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
start = time.perf_counter()
outputs = llm.generate(prompts, params)
elapsed = time.perf_counter() - start
print(json.dumps({{"tokens_per_s": sum(len(o.token_ids) for o in outputs) / elapsed}}))
"""


class Workload:
    """One way of measuring a tree's tokens/s: the command, and how to read its output."""

    def __init__(self, argv: Callable[[Path], list[str]], read: Callable[[str, Path], float]) -> None:
        self.argv, self.read = argv, read


def tiny(requests: int) -> Workload:
    return Workload(lambda tree: [sys.executable, "-c", TINY_WORKLOAD.format(requests=requests)],
                    lambda out, tree: json.loads(out.strip().splitlines()[-1])["tokens_per_s"])


def _smoke_tokens_per_s(out: str, tree: Path) -> float:
    # a result row: the model's label (``-smoke-shaped`` before 59b6d91, ``-smoke`` since), then tokens/s
    rows = [line for line in out.splitlines() if "-smoke" in line and " output tokens" in line]
    if not rows:
        raise RuntimeError(f"no result rows in the smoke run of {tree}:\n{out}")
    return statistics.fmean(float(re.split(r"\s+", row)[1].replace(",", "")) for row in rows)


SMOKE = Workload(lambda tree: [sys.executable, str(tree / "bench" / "engine_throughput.py"), "--smoke"],
                 _smoke_tokens_per_s)


def run_together(workload: Workload, trees: dict[str, Path], cpus: dict[str, str | None]) -> dict[str, float]:
    """Tokens/s of each tree, their processes started at once (each on ``cpus[name]``, None: unpinned)."""
    started = {}
    for name, tree in trees.items():
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        started[name] = subprocess.Popen(pinned(workload.argv(tree), cpus[name]), cwd=tree, env=env,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = {}
    for name, process in started.items():
        out, err = process.communicate(timeout=1800)
        if process.returncode != 0:
            raise RuntimeError(f"{workload.argv(trees[name])[1]} in {trees[name]} failed:\n{err[-4000:]}")
        results[name] = workload.read(out, trees[name])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a git ref checked out as tree A (B is this tree)")
    parser.add_argument("--a", type=Path, help="tree A (instead of --baseline)")
    parser.add_argument("--b", type=Path, default=ROOT, help="tree B (default: this tree)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--no-smoke", action="store_true", help="only the tiny workload")
    parser.add_argument("--in-turn", action="store_true", help="run the trees one after the other, unpinned")
    args = parser.parse_args()
    if (args.baseline is None) == (args.a is None):
        parser.error("give exactly one of --baseline and --a")
    print(f"machine: {describe(torch.device('cpu'))}")
    print(f"command: {command()}")
    with tempfile.TemporaryDirectory(prefix="kvguard-ab-") as tmp, baseline_tree(args.baseline, args.a, Path(tmp)) as tree:
        trees = {"A": tree.resolve(), "B": args.b.resolve()}
        workloads = {"tiny": tiny(args.requests)}
        if not args.no_smoke:
            workloads["smoke"] = SMOKE
        side_by_side = not args.in_turn and shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
        print("layout: " + ("A and B at once, each pinned to a core of its own, the cores swapped every round"
                            if side_by_side else "A and B in turn, unpinned"))
        results: dict[str, dict[str, list[float]]] = {w: {"A": [], "B": []} for w in workloads}
        for round_ in range(args.rounds):
            first, second = ("A", "B") if round_ % 2 == 0 else ("B", "A")
            for workload, by_tree in results.items():
                if side_by_side:
                    measured = run_together(workloads[workload], trees, {first: "0", second: "1"})
                else:  # in turn: each alone, unpinned
                    measured = {name: run_together(workloads[workload], {name: trees[name]}, {name: None})[name]
                                for name in (first, second)}
                for name, tokens_per_s in measured.items():
                    by_tree[name].append(tokens_per_s)
            print(f"round {round_ + 1}: " + "; ".join(
                f"{w} A {r['A'][-1]:,.0f} B {r['B'][-1]:,.0f} tok/s B/A {r['B'][-1] / r['A'][-1]:.3f}"
                for w, r in results.items()))
    print(f"A = {trees['A']}" + (f" ({args.baseline})" if args.baseline else ""), f"B = {trees['B']}", sep="\n")
    for workload, by_tree in results.items():
        a, b = statistics.median(by_tree["A"]), statistics.median(by_tree["B"])
        ratios = [b_ / a_ for a_, b_ in zip(by_tree["A"], by_tree["B"], strict=True)]
        print(f"{workload:<6} median tokens/s  A {a:>9,.0f}  B {b:>9,.0f}  B/A {statistics.median(ratios):.3f} "
              f"(rounds {min(ratios):.3f}-{max(ratios):.3f}; A {[round(x) for x in by_tree['A']]}, "
              f"B {[round(x) for x in by_tree['B']]})")


if __name__ == "__main__":
    main()
