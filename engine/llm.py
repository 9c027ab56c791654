"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from dataclasses import fields

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.outputs import RequestOutput
from engine.protocol import TelemetrySnapshot
from engine.sampling_params import SamplingParams
from engine.structured.spec import GrammarSpec
from engine.validation import is_int, require

Prompt = str | list[int]


class LLM:
    """Loads a model and generates completions for batches of prompts.

    Keyword arguments are those of ``EngineConfig`` (model, device, block_size, num_blocks, max_num_seqs,
    max_num_batched_tokens, preemption_mode, swap_blocks, enable_prefix_caching, attention_backend, ...).
    """

    def __init__(self, model: str = "tiny", **options: object) -> None:
        known = {f.name for f in fields(EngineConfig)}
        for name in options:
            require(name in known, name, f"one of the LLM options {sorted(known)}", "an unknown option")
        self.core = EngineCore(EngineConfig(model=model, **options))  # type: ignore[arg-type]

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        tenant: str | None | list[str | None] = None,
        cache_salt: str | None | list[str | None] = None,
        priority: int | list[int] = 0,
        grammar: GrammarSpec | None | list[GrammarSpec | None] = None,
        lora: str | None | list[str | None] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids) and return outputs in prompt order.

        ``grammar`` holds a prompt's completions to a JSON schema (``GrammarSpec.of(schema, "grammar")``).
        ``lora`` names the adapter a prompt runs with (one of ``LLM(loras={name: peft_dir})``; None: the base).
        All prompts are validated before the first one is queued: a bad one raises ``ValueError`` naming
        the field and leaves the engine untouched.
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and all(is_int(t) for t in prompts)):
            prompts = [prompts]  # type: ignore[list-item]
        require(isinstance(prompts, list) and len(prompts) > 0, "prompts", "a prompt or a non-empty list",
                prompts)
        count = len(prompts)
        params = _per_prompt(sampling_params if sampling_params is not None else SamplingParams(), count,
                             "sampling_params")
        tenants = _per_prompt(tenant, count, "tenant")
        salts = _per_prompt(cache_salt, count, "cache_salt")
        priorities = _per_prompt(priority, count, "priority")
        grammars = [g if g is None else self.core.compile_grammar(g)
                    for g in _per_prompt(grammar, count, "grammar")]
        loras = _per_prompt(lora, count, "lora")
        requests = [
            self.core.make_request(p, sp, tenant=t, cache_salt=s, priority=pr, grammar=g, lora=a)
            for p, sp, t, s, pr, g, a in zip(prompts, params, tenants, salts, priorities, grammars, loras)
        ]
        for request in requests:
            self.core.add(request)
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < count:
                for output in self.core.step(finished_only=True):
                    finished[output.request_id] = output
        finally:
            # An interrupted generate (KeyboardInterrupt, a failing forward) must not strand blocks.
            for request in requests:
                self.core.abort(request.request_id)
        return [finished[r.request_id] for r in requests]

    def telemetry(self) -> TelemetrySnapshot:
        return self.core.telemetry()


def _per_prompt(value: object, count: int, name: str) -> list:
    """Broadcast an argument given once to every prompt, or check that a list has one value per prompt."""
    if isinstance(value, list):
        require(len(value) == count, name, f"one value or a list of {count}", f"a list of {len(value)}")
        return value
    return [value] * count
