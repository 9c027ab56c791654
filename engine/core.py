"""The engine's step loop: requests in, one scheduled step at a time, outputs out.

``EngineCore`` is synchronous and single-threaded; ``LLM`` drives it to completion and the server's
``AsyncEngine`` drives it from a background thread. A step is three calls: the scheduler decides
(``SchedulerOutput``), the runner executes and samples, and the scheduler commits the result (``advance``,
then ``settle`` once the tokens are read back), consulting the output processor about stops. Every input is validated before any
state changes, and every sequence that ends (finished, stopped or aborted) releases its blocks in the same
call.

A request with a grammar (engine/structured) adds one thing to the step: before it runs, the core fills the
bitmask of its constrained draws from their matchers, and the sampler masks their logits with it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig
from engine.gc_heap import freeze_startup_heap
from engine.kernels import get_attention_backend
from engine.kv.block_pool import BlockPool
from engine.kv.manager import KVCacheManager
from engine.kv.swap import SwapSpace
from engine.model.loader import load_model
from engine.model.lora import LoraRegistry
from engine.model.lora_slots import LoraSlots, attach
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.protocol import TelemetrySnapshot
from engine.sampling_params import SamplingParams
from engine.sched.output import SchedulerOutput
from engine.sched.request import Request, Sequence
from engine.sched.scheduler import Scheduler
from engine.structured.spec import Grammar, GrammarSpec
from engine.telemetry import EngineStats
from engine.validation import is_int, require
from engine.worker.bandwidth import peak_bandwidth
from engine.worker.memory_profile import activation_bytes
from engine.worker.runner import ModelRunner, StepResult

if TYPE_CHECKING:
    from engine.structured.manager import StructuredOutputManager

log = logging.getLogger("engine.core")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)  # process-wide: torch has no per-thread setting
        backend = get_attention_backend(config.attention_backend, self.device)
        weight_format = config.weight_format if self.device.type == "cpu" else "fp32"
        self.loaded = load_model(config.model, self.device, self.dtype, backend, weight_format)
        native = self.loaded.native  # a failed build is never silent: its first error line is the reason
        level = logging.INFO if native.on or self.device.type != "cpu" else logging.WARNING
        log.log(level, "native CPU kernels: %s (%s)", native.path, native.reason)
        self.tokenizer = self.loaded.tokenizer
        model_len = self.loaded.config.max_position_embeddings
        require(config.max_model_len is None or config.max_model_len <= model_len, "max_model_len",
                f"at most the model's context length {model_len}", config.max_model_len)
        self.max_model_len = config.max_model_len or model_len
        self.block_size = config.block_size
        num_blocks = config.num_blocks or self._derive_num_blocks()
        swap_blocks = config.swap_blocks
        if swap_blocks is None:
            swap_blocks = num_blocks if config.preemption_mode == "swap" else 0
        self.loras: LoraRegistry | None = None  # None: LoRA disabled, no device slots
        self.lora_slots: LoraSlots | None = None
        self.lora_requests: Counter[str] = Counter()
        if config.lora_enabled:
            self._enable_lora()
        self.kv = KVCacheManager(BlockPool(num_blocks, config.enable_prefix_caching), SwapSpace(swap_blocks),
                                 self.block_size)
        self.output_processor = OutputProcessor(self.tokenizer, self.loaded.config.eos_token_ids)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.preemption_mode, self.output_processor.check_stop, config.max_loras)
        self.runner = ModelRunner(self.loaded, num_blocks, self.block_size, swap_blocks, self.device, self.dtype,
                                  self.lora_slots)
        block_bytes = self.loaded.config.kv_bytes_per_token(self.dtype) * self.block_size
        self.stats = EngineStats(block_bytes, self.scheduler.stats, peak_bandwidth(self.device))
        self.requests: dict[str, Request] = {}
        self._request_ids = itertools.count()
        self._structured: StructuredOutputManager | None = None  # built by the first compile_grammar
        self._structured_lock = threading.Lock()
        # The schedule of the latest step whose tokens were committed, for the server's tracing
        # (engine/server/tracing.py): which sequences ran what, and which were preempted. Read on the
        # stepping thread, between steps.
        self.last_schedule: SchedulerOutput | None = None
        # With run-ahead: the step scheduled and queued ahead, whose tokens the next call reads back.
        self._ahead: tuple[SchedulerOutput, StepResult] | None = None
        self.run_ahead = config.run_ahead(self.device)
        freeze_startup_heap()  # last: everything built above lives as long as the engine

    @property
    def model_name(self) -> str:
        """The id clients see and must send: ``--served-model-name``, else the loader's default (never a path)."""
        return self.config.served_model_name or self.loaded.name

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        tenant: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        stream: bool = False,
        grammar: Grammar | None = None,
        lora: str | None = None,
        resume: list[int] | None = None,
    ) -> Request:
        """Validate one prompt and build its request; nothing is queued yet (see ``add``).

        ``stream=True`` keeps every completion's ``text`` current token by token, for a server that sends
        text deltas; otherwise text is decoded once, when the completion finishes. ``grammar`` (from
        ``compile_grammar``) holds every completion to it. ``lora`` names a served adapter (None: the base).
        ``resume``: output tokens an earlier replica generated (n == 1); the request continues after them
        (engine/output_processor.py), and they are replayed here once, on a scratch sequence, so that a
        grammar that refuses one, or one that already ends the completion, is refused before anything runs.
        """
        require(isinstance(params, SamplingParams), "sampling_params", "a SamplingParams", params)
        text, ids = self._tokenize(prompt)
        limit = self.max_model_len
        require(len(ids) < limit, "prompt", f"shorter than the context window of {limit} tokens "
                f"(max_model_len), leaving room for one generated token", f"{len(ids)} tokens")
        capacity = self.kv.pool.num_blocks * self.block_size
        require(len(ids) < capacity, "prompt", f"shorter than the KV pool's {capacity} token slots",
                f"{len(ids)} tokens")
        # A sequence longer than the whole pool could never finish: it would preempt itself forever.
        room = min(limit, capacity) - len(ids)
        require(params.max_tokens is None or params.max_tokens <= room, "max_tokens",
                f"at most {room} for a prompt of {len(ids)} tokens (context window {limit} tokens, "
                f"KV pool {capacity} token slots)", params.max_tokens)
        max_tokens = params.max_tokens or room
        resume = list(resume or [])
        if resume:
            vocab = self.loaded.config.vocab_size
            require(all(is_int(t) and 0 <= t < vocab for t in resume), "resume_token_ids",
                    f"token ids in [0, {vocab})", resume)
            require(params.n == 1, "resume_token_ids", "used with n == 1: the tokens are one choice's", params.n)
            require(len(resume) < max_tokens, "resume_token_ids", f"fewer than max_tokens ({max_tokens}): "
                    "the resumed tokens count towards it", f"{len(resume)} tokens")
        require(params.stop is None or self.tokenizer is not None, "stop",
                "unset for a model without a tokenizer", params.stop)
        require(params.n <= self.config.max_num_seqs, "n", f"at most max_num_seqs ({self.config.max_num_seqs})",
                params.n)
        require(is_int(priority), "priority", "an integer", priority)
        require(tenant is None or isinstance(tenant, str), "tenant", "a string or None", tenant)
        require(cache_salt is None or isinstance(cache_salt, str), "cache_salt", "a string or None", cache_salt)
        require(isinstance(stream, bool), "stream", "a boolean", stream)
        require(grammar is None or isinstance(grammar, Grammar), "grammar", "a Grammar from compile_grammar",
                grammar)
        adapter = None if lora is None or self.loras is None else self.loras.get(lora)
        require(lora is None or adapter is not None, "lora",
                f"one of the adapters served here {self.loras.names() if self.loras else []}", lora)
        request_id = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        require(request_id not in self.requests, "request_id", "unique among running requests", request_id)
        request = Request(request_id, text, ids, params, max_tokens, tenant, cache_salt, priority, stream, grammar,
                          adapter, resume_token_ids=resume)
        if resume:
            request.resume_text = self._dry_replay(request)
        return request

    def _dry_replay(self, request: Request) -> str:
        """Replay a resumed request's tokens on a scratch sequence with scratch matchers (``ValueError`` when
        they cannot be resumed); the text its stream had sent. ``add`` replays them for real."""
        if request.grammar is not None:
            assert self._structured is not None  # it compiled the grammar
            request.matchers = self._structured.matchers(request.grammar, 1)
        scratch = Sequence(-1, request, 0, list(request.prompt_token_ids), len(request.prompt_token_ids))
        try:
            self.output_processor.replay(scratch, request.resume_token_ids)
        finally:
            request.matchers = []
        return self.output_processor.sent_text(request, scratch)

    def compile_grammar(self, spec: GrammarSpec) -> Grammar:
        """Compile ``spec`` for this model's vocabulary (cached per distinct schema); ``ValueError`` naming
        ``spec.param`` when it cannot be. Safe from any thread: the server compiles off its event loop while
        this engine steps. The first call loads xgrammar and indexes the vocabulary (a second or two for a
        49k-token vocabulary), so engines that never constrain an output never pay for it."""
        require(isinstance(spec, GrammarSpec), "grammar", "a GrammarSpec", spec)
        with self._structured_lock:
            if self._structured is None:
                require(self.tokenizer is not None, spec.param, "unset for a model without a tokenizer",
                        "a grammar")
                from engine.structured.manager import StructuredOutputManager  # deferred: see above

                self._structured = StructuredOutputManager(self.tokenizer, self.loaded.config.vocab_size)
            structured = self._structured
        return structured.compile(spec)

    def add(self, request: Request) -> None:
        require(request.request_id not in self.requests, "request_id", "unique among running requests",
                request.request_id)
        params = request.params
        seeded = params.seed is not None and not params.greedy
        # Created here, in the thread that steps the engine, like every other device object.
        request.generators = [torch.Generator(self.device).manual_seed(params.seed + index) if seeded else None
                              for index in range(params.n)]
        if seeded and request.resume_token_ids:
            self._skip_draws(request.generators[0], len(request.resume_token_ids))
        if request.grammar is not None:
            assert self._structured is not None  # it compiled the grammar
            request.matchers = self._structured.matchers(request.grammar, params.n)
        self.requests[request.request_id] = request
        if request.lora is not None:
            self.lora_requests[request.lora.name] += 1
        self.scheduler.add_request(request)
        if request.resume_token_ids:  # make_request's dry replay accepted them: this one cannot fail
            self.output_processor.replay(request.seqs[0], request.resume_token_ids)

    def _skip_draws(self, generator: torch.Generator | None, tokens: int) -> None:
        """Advance a seeded completion's generator past the draws of ``tokens`` sampled tokens, so that a
        resumed request draws what the uninterrupted one would have: the sampler draws one row of the
        vocabulary's width per token (engine/worker/sampler.py)."""
        assert generator is not None
        row = torch.empty(self.loaded.config.vocab_size, device=self.device, dtype=torch.float32)
        for _ in range(tokens):
            row.exponential_(generator=generator)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is and release its blocks. Unknown or finished ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            self.scheduler.finish(seq, "abort")
        self._drop_idle_ahead()
        return self.output_processor.output(request, True)

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one step; return the requests that produced tokens or ended in it.

        ``finished_only``: return only the requests that ended, for a caller that waits for final outputs
        (``LLM.generate``): an output per request per step is most of the host work of a large decode batch
        after the schedule, and a streaming server needs it (text deltas, inter-token latency), not they.

        With run-ahead (``EngineConfig.run_ahead``: on CUDA by default), a steady decode runs one step ahead:
        the step after this one is scheduled and queued on the device before this one's tokens are read back
        (``Scheduler.advance``), so the host's work overlaps the device's. Each call still returns one step's
        tokens; a sequence that they end has computed one token too many, which is dropped.
        """
        started = time.perf_counter()
        if self._ahead is not None:
            out, result = self._ahead
            self._ahead = None
        elif not self.scheduler.has_work:
            return []
        else:
            out = self.scheduler.schedule()
            if not out.seqs:
                # Validation guarantees every request fits an idle pool; an empty step with work left is a
                # bug, and raising beats spinning forever.
                raise RuntimeError("scheduler: no sequence could be scheduled although requests are pending")
            result = self._execute(out)
        self.scheduler.advance(out)
        if self.run_ahead and self.scheduler.can_run_ahead():
            ahead = self.scheduler.schedule()
            self._ahead = (ahead, self._execute(ahead, result))
        touched = self.scheduler.settle(out, result.sampled())
        self._drop_idle_ahead()
        self.last_schedule = out
        self.stats.on_step(time.perf_counter() - started, result.num_tokens, out.has_decode, result.bytes_moved,
                           len(out.seqs))
        return self.report(touched, finished_only)

    def report(self, touched: Iterable[Request], finished_only: bool = False) -> list[RequestOutput]:
        """The outputs of a step's ``touched`` requests (only those that ended, with ``finished_only``); an
        ended request leaves ``requests`` here. One call per step, so that a phase timer
        (bench/step_phases.py) costs one wrapped call per step, not one per request."""
        outputs = []
        output = self.output_processor.output
        for request in touched:
            if request.finished:
                del self.requests[request.request_id]
                outputs.append(output(request, True))
            elif not finished_only:
                outputs.append(output(request, False))
        return outputs

    def _drop_idle_ahead(self) -> None:
        """Forget the step ahead once nothing runs: every sequence in it has ended (run-ahead preempts
        nobody, so a sequence leaves the running queue only by ending), nobody will read its tokens, and an
        idle engine keeps no step."""
        if not self.scheduler.running:
            self._ahead = None

    def _execute(self, out: SchedulerOutput, previous: StepResult | None = None) -> StepResult:
        # The matchers have accepted every token committed so far; this step's commit advances them.
        grammar = self._structured.bitmask(*out.grammar_draws()) if self._structured is not None else None
        return self.runner.execute(out, grammar, previous)

    def telemetry(self, healthy: bool = True) -> TelemetrySnapshot:
        snapshot = self.stats.snapshot(self.model_name, self.kv, self.scheduler.load(), healthy)
        snapshot.native_path, snapshot.native_reason = self.loaded.native.path, self.loaded.native.reason
        if self.loras is not None and self.lora_slots is not None:
            available = self.loras.names()  # an unloaded adapter may stay in a slot until evicted: not listed
            snapshot.loras = [name for name in self.lora_slots.names() if name in available]
            snapshot.loras_available = available
            snapshot.lora_requests_total = dict(self.lora_requests)
        return snapshot

    def _enable_lora(self) -> None:
        """The registry with the configured adapters (each checked: a bad one stops start-up with its one-line
        error) and the device slots, attached to every decoder layer."""
        config = self.config
        self.loras = LoraRegistry(self.loaded.config, config.max_lora_rank)
        for name, path in (config.loras or {}).items():
            self.loras.load(name, path, reserved={self.model_name})
        self.lora_slots = LoraSlots(self.loaded.config, config.max_loras, config.max_lora_rank, self.device,
                                    self.dtype)
        attach(self.loaded.model, self.lora_slots)

    def _tokenize(self, prompt: object) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            require(prompt != "", "prompt", "a non-empty string or list of token ids", prompt)
            require(self.tokenizer is not None, "prompt", "token ids for a model without tokenizer.json", "a string")
            ids = self.tokenizer.encode(prompt)
            require(len(ids) > 0, "prompt", "text that encodes to at least one token", prompt)
            return prompt, ids
        vocab = self.loaded.config.vocab_size
        require(isinstance(prompt, list) and len(prompt) > 0, "prompt",
                "a non-empty string or list of token ids", prompt)
        require(all(is_int(t) and 0 <= t < vocab for t in prompt), "prompt",
                f"token ids in [0, {vocab})", prompt)
        return None, list(prompt)

    def _derive_num_blocks(self) -> int:
        cfg = self.loaded.config
        block_bytes = cfg.kv_bytes_per_token(self.dtype) * self.block_size
        if self.device.type == "cuda":
            # Measured by warm-up forwards (which also compile the kernels): the worst step's activations.
            activations = activation_bytes(self.loaded.model, self.block_size, self.config.max_num_batched_tokens,
                                           self.config.max_num_seqs, self.max_model_len, self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.gpu_memory_utilization) - (total - free) - activations
        else:
            budget = self.config.cpu_kv_cache_bytes
        useful = self.config.max_num_seqs * -(-self.max_model_len // self.block_size)
        num_blocks = min(budget // block_bytes, useful)
        require(num_blocks > 0, "num_blocks", "derivable from memory: not even one KV block fits", num_blocks)
        return num_blocks

