"""The engine's throughput at two commits, side by side in one run: did a change cost tokens/s?

Each round runs both trees in turn (A B, then B A in the next round, so neither always goes first on a
shared machine whose speed drifts), each in a fresh process that imports only its own tree:

- ``tiny``: the built-in model on the CPU through the public ``LLM`` API (``--requests`` prompts of 64 to
  256 token ids, 32 to 128 output tokens each, ``ignore_eos``, greedy, one torch thread);
- ``smoke``: that tree's own ``bench/engine_throughput.py --smoke`` (toy Qwen/Llama shapes), its engine
  tokens/s as it prints them.

Reported: the median tokens/s of each tree per workload, and B over A.

    .venv/bin/python bench/engine_ab.py --baseline c643250            # A = that commit, B = this tree
    .venv/bin/python bench/engine_ab.py --a /path/to/tree --b . --rounds 6
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from run_info import command, describe

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


def run_tiny(tree: Path, requests: int) -> float:
    result = _run(tree, [sys.executable, "-c", TINY_WORKLOAD.format(requests=requests)])
    return json.loads(result.strip().splitlines()[-1])["tokens_per_s"]


def run_smoke(tree: Path) -> float:
    result = _run(tree, [sys.executable, str(tree / "bench" / "engine_throughput.py"), "--smoke"])
    # a result row: the model's label (``-smoke-shaped`` before 59b6d91, ``-smoke`` since), then tokens/s
    rows = [line for line in result.splitlines() if "-smoke" in line and " output tokens" in line]
    if not rows:
        raise RuntimeError(f"no result rows in the smoke run of {tree}:\n{result}")
    return statistics.fmean(float(re.split(r"\s+", row)[1].replace(",", "")) for row in rows)


def _run(tree: Path, argv: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[1]} in {tree} failed:\n{done.stderr[-4000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a git ref checked out as tree A (B is this tree)")
    parser.add_argument("--a", type=Path, help="tree A (instead of --baseline)")
    parser.add_argument("--b", type=Path, default=ROOT, help="tree B (default: this tree)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--no-smoke", action="store_true", help="only the tiny workload")
    args = parser.parse_args()
    if (args.baseline is None) == (args.a is None):
        parser.error("give exactly one of --baseline and --a")
    print(f"machine: {describe(torch.device('cpu'))}")
    print(f"command: {command()}")
    with tempfile.TemporaryDirectory(prefix="kvguard-ab-") as tmp:
        tree_a = args.a
        if args.baseline is not None:
            tree_a = Path(tmp) / "a"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree_a), args.baseline], cwd=ROOT,
                           check=True, capture_output=True)
        try:
            trees = {"A": tree_a.resolve(), "B": args.b.resolve()}
            workloads = {"tiny": lambda tree: run_tiny(tree, args.requests)}
            if not args.no_smoke:
                workloads["smoke"] = run_smoke
            results: dict[str, dict[str, list[float]]] = {w: {"A": [], "B": []} for w in workloads}
            for round_ in range(args.rounds):
                order = ("A", "B") if round_ % 2 == 0 else ("B", "A")
                for name in order:
                    for workload, run in workloads.items():
                        results[workload][name].append(run(trees[name]))
                print(f"round {round_ + 1}: " + "; ".join(
                    f"{w} A {r['A'][-1]:,.0f} B {r['B'][-1]:,.0f} tok/s" for w, r in results.items()))
        finally:
            if args.baseline is not None:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree_a)], cwd=ROOT, check=False,
                               capture_output=True)
    print(f"A = {trees['A']}" + (f" ({args.baseline})" if args.baseline else ""), f"B = {trees['B']}", sep="\n")
    for workload, by_tree in results.items():
        a, b = statistics.median(by_tree["A"]), statistics.median(by_tree["B"])
        print(f"{workload:<6} median tokens/s  A {a:>9,.0f}  B {b:>9,.0f}  B/A {b / a:.3f}  "
              f"(rounds A {[round(x) for x in by_tree['A']]}, B {[round(x) for x in by_tree['B']]})")


if __name__ == "__main__":
    main()
