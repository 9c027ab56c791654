"""What constrained decoding costs per engine step: SmolLM2 on the CPU, the same batch with and without a
grammar, side by side in one run.

Each run adds ``--batch`` chat requests (greedy, ``--tokens`` output tokens each) to one ``EngineCore`` and
times every step in which all of them decode. The constrained run holds every request to a JSON schema
that cannot be completed within ``--tokens`` (an array of at least 100 ``{"name": string, "qty": integer}``
objects), so no request ends early and both runs step the same batch for the same number of steps, through
string, integer and punctuation states of the grammar. Runs alternate (plain, constrained, plain, ...)
``--repeats`` times each; reported: the best and the median of their mean ms per decode step, and inside
the constrained steps the time spent filling the bitmask (xgrammar, one matcher per sequence) and applying
it to the logits (one call), timed around those two functions. On a shared machine the whole-step figures
move by more than the grammar costs (other processes only ever add time, so the best run is the fairer
comparison); the two timed parts are the cost itself.

    .venv/bin/python bench/structured_cost.py             # about a minute on one core
    .venv/bin/python bench/structured_cost.py --smoke     # the tiny model, a few steps: checks that it runs
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from run_info import command, describe

from engine import LLM, SamplingParams
from engine.core import EngineCore
from engine.protocol import ChatMessage
from engine.structured.bitmask import GrammarBitmask
from engine.structured.manager import StructuredOutputManager
from engine.structured.spec import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 100, "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}},
        "required": ["name", "qty"], "additionalProperties": False}}},
    "required": ["items"],
    "additionalProperties": False,
}
QUESTIONS = ["List the groceries for a week.", "What do I need to bake bread?", "Inventory of a small library.",
             "Parts of a bicycle.", "Things to pack for a trip.", "Tools in a workshop."]


@dataclass
class Timer:
    """Seconds spent in the functions it wraps, since the last ``reset``."""

    seconds: float = 0.0
    calls: int = 0
    _originals: list[tuple[Any, str, Callable[..., Any]]] = field(default_factory=list)

    def wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        self._originals.append((owner, name, original))

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
                self.calls += 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def run(core: EngineCore, prompts: list[list[int]], tokens: int, grammar: GrammarSpec | None,
        timers: dict[str, Timer]) -> tuple[float, dict[str, float]]:
    """Mean ms per step in which every request decodes, and each timer's ms per such step."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    compiled = core.compile_grammar(grammar) if grammar is not None else None
    for prompt in prompts:
        core.add(core.make_request(prompt, params, grammar=compiled))
    durations: list[float] = []
    spent = {name: 0.0 for name in timers}
    while core.has_unfinished:
        for timer in timers.values():
            timer.reset()
        started = time.perf_counter()
        outputs = core.step()
        elapsed = time.perf_counter() - started
        decoding = sum(1 for output in outputs if output.outputs and not output.finished)
        if decoding == len(prompts) and all(len(o.outputs[0].token_ids) > 1 for o in outputs):
            durations.append(elapsed)
            for name, timer in timers.items():
                spent[name] += timer.seconds
    steps = len(durations)
    return 1e3 * statistics.mean(durations), {name: 1e3 * s / steps for name, s in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the engine's cpu_threads)")
    parser.add_argument("--smoke", action="store_true", help="tiny model, few steps: checks that it runs")
    args = parser.parse_args()
    model = "tiny" if args.smoke else "smollm2"
    batch, tokens, repeats = (2, 6, 1) if args.smoke else (args.batch, args.tokens, args.repeats)
    llm = LLM(model, device="cpu", dtype="float32", num_blocks=1024, cpu_threads=args.threads)
    core = llm.core
    template, tokenizer = core.loaded.chat_template, core.tokenizer
    assert tokenizer is not None
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(batch)]
    prompts = [tokenizer.encode(template.render([ChatMessage(role="user", content=q)]), add_special_tokens=False)
               for q in questions]
    grammar = GrammarSpec.of(SCHEMA, "response_format")
    core.compile_grammar(grammar)  # loads xgrammar and indexes the vocabulary: not a step cost
    timers = {"fill": Timer(), "apply": Timer()}
    timers["fill"].wrap(StructuredOutputManager, "bitmask")
    timers["apply"].wrap(GrammarBitmask, "apply")
    plain: list[float] = []
    constrained: list[float] = []
    parts: list[dict[str, float]] = []
    for _ in range(repeats):
        plain.append(run(core, prompts, tokens, None, timers)[0])
        ms, spent = run(core, prompts, tokens, grammar, timers)
        constrained.append(ms)
        parts.append(spent)
    fill = statistics.median(p["fill"] for p in parts)
    apply = statistics.median(p["apply"] for p in parts)
    print(f"# {command()}")
    print(f"# {describe(torch.device('cpu'))}; model {model}, torch threads {args.threads}")
    print(f"# batch {batch} sequences, {tokens} output tokens, {repeats} runs each, ms per decode step")
    print(f"{'':30}{'best':>9}{'median':>9}")
    for name, runs in (("no grammar", plain), ("JSON schema, every sequence", constrained)):
        print(f"{name:30}{min(runs):>9.2f}{statistics.median(runs):>9.2f}")
    print(f"{'  of which: fill bitmask':30}{'':>9}{fill:>9.2f}   ({1e3 * fill / batch:.0f} us per sequence)")
    print(f"{'            apply to logits':30}{'':>9}{apply:>9.2f}")
    best = min(plain)
    print(f"{'fill + apply':30}{'':>9}{fill + apply:>9.2f}   ({100 * (fill + apply) / best:.1f}% of the best "
          "plain step)")


if __name__ == "__main__":
    main()
