"""Engine options (the keyword arguments of ``LLM``), validated before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels.backend import ATTENTION_BACKENDS
from engine.model.weights import WEIGHT_FORMATS
from engine.validation import is_int, is_number, require

PREEMPTION_MODES = ("recompute", "swap")
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class EngineConfig:
    """``num_blocks=None`` sizes the pool from memory: ``gpu_memory_utilization`` of the GPU, or
    ``cpu_kv_cache_bytes`` on CPU (never more than ``max_num_seqs`` full-context sequences need).
    ``swap_blocks=None`` gives swap mode as many host blocks as device blocks, and recompute mode none.
    ``max_model_len=None`` takes the model's context length. ``served_model_name=None`` serves the model as
    its alias (``tiny``, ``smollm2``) or its directory's or file's stem, never as a path.
    """

    model: str = "tiny"
    served_model_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"
    swap_blocks: int | None = None
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    # torch intra-op threads on CPU. One is right for small models and shared machines: with more threads
    # than free cores, OpenMP's spin-waits slowed the tiny model's steps 14x (15 ms -> 210 ms) here.
    cpu_threads: int = 1
    # How the matrices stay resident on CPU (engine/model/weights.py): 'auto' keeps a GGUF file's 4- and
    # 8-bit tensors quantized and multiplies with them (as llama.cpp does; every other source stays fp32);
    # 'fp32' is the dense path, exact to the file's dequantized weights. CUDA: dense always.
    weight_format: str = "auto"
    # LoRA adapters (engine/model/lora.py): name -> PEFT directory, loaded at start; at most ``max_loras`` of
    # them resident on the device at once (least recently used evicted beyond), each of rank <= max_lora_rank.
    # ``allow_runtime_lora`` lets the server load and unload adapters while it runs.
    loras: dict[str, str] | None = None
    max_loras: int = 4
    max_lora_rank: int = 16
    allow_runtime_lora: bool = False
    # Schedule and queue a steady decode's next step before this one's tokens are read back, so that the
    # host's work per step overlaps the device's (EngineCore.step). None: where it pays (``run_ahead``).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        cuda = isinstance(self.device, str) and (self.device == "cuda" or self.device.startswith("cuda:"))
        checks = [
            ("model", isinstance(self.model, str) and self.model != "",
             "'tiny', 'smollm2', a local Hugging Face directory or a .gguf file"),
            ("served_model_name", self.served_model_name is None
             or (isinstance(self.served_model_name, str) and self.served_model_name.strip() != ""),
             "a non-empty string or None"),
            ("device", self.device in ("auto", "cpu") or cuda, "'auto', 'cpu' or 'cuda[:N]'"),
            ("device", not cuda or torch.cuda.is_available(), "'cpu' or 'auto' on a machine without CUDA"),
            ("dtype", self.dtype in DTYPES, f"one of {sorted(DTYPES)}"),
            ("block_size", _positive(self.block_size) and self.block_size & (self.block_size - 1) == 0
             and self.block_size <= 256, "a power of two in [1, 256]"),
            ("num_blocks", self.num_blocks is None or _positive(self.num_blocks), "a positive integer or None"),
            ("max_num_seqs", _positive(self.max_num_seqs), "a positive integer"),
            ("max_num_batched_tokens", _positive(self.max_num_batched_tokens), "a positive integer"),
            ("preemption_mode", self.preemption_mode in PREEMPTION_MODES, f"one of {PREEMPTION_MODES}"),
            ("swap_blocks", self.swap_blocks is None or (is_int(self.swap_blocks) and self.swap_blocks >= 0),
             "an integer >= 0 or None"),
            ("enable_prefix_caching", isinstance(self.enable_prefix_caching, bool), "a boolean"),
            ("attention_backend", self.attention_backend in ATTENTION_BACKENDS, f"one of {ATTENTION_BACKENDS}"),
            ("max_model_len", self.max_model_len is None or _positive(self.max_model_len),
             "a positive integer or None"),
            ("gpu_memory_utilization", is_number(self.gpu_memory_utilization)
             and 0.0 < self.gpu_memory_utilization <= 1.0, "a number in (0, 1]"),
            ("cpu_kv_cache_bytes", _positive(self.cpu_kv_cache_bytes), "a positive integer"),
            ("cpu_threads", _positive(self.cpu_threads), "a positive integer"),
            ("weight_format", self.weight_format in WEIGHT_FORMATS, f"one of {WEIGHT_FORMATS}"),
            ("weight_format", self.weight_format in ("auto", "fp32") or not cuda,
             "'auto' or 'fp32' on CUDA (the quantized formats are CPU kernels)"),
            ("loras", self.loras is None or (isinstance(self.loras, dict) and all(
                isinstance(k, str) and k.strip() and isinstance(v, str) and v for k, v in self.loras.items())),
             "a mapping of adapter names to PEFT directories, or None"),
            ("max_loras", _positive(self.max_loras), "a positive integer"),
            ("max_lora_rank", _positive(self.max_lora_rank), "a positive integer"),
            ("allow_runtime_lora", isinstance(self.allow_runtime_lora, bool), "a boolean"),
            ("async_scheduling", self.async_scheduling is None or isinstance(self.async_scheduling, bool),
             "a boolean, or None (on CUDA only)"),
        ]
        for name, ok, expected in checks:
            require(ok, name, expected, getattr(self, name))

    @property
    def lora_enabled(self) -> bool:
        """Whether any request may name an adapter: the device slots are allocated only then."""
        return bool(self.loras) or self.allow_runtime_lora

    def run_ahead(self, device: torch.device) -> bool:
        """Whether a steady decode runs one step ahead on ``device``: ``async_scheduling`` when set, else on
        CUDA only. There the device runs asynchronously and the host's work hides under it (1.49x output
        tokens/s on the H200, Qwen2.5-0.5B shape: docs/benchmarks/engine-gpu.md); on a CPU every step has
        finished before the next is scheduled, nothing overlaps, and each sequence that ends computes one
        token that is dropped."""
        return self.async_scheduling if self.async_scheduling is not None else device.type == "cuda"

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        chosen = DTYPES[self.dtype]
        if chosen is not None:
            return chosen
        return torch.bfloat16 if device.type == "cuda" else torch.float32



def _positive(value: object) -> bool:
    return is_int(value) and value > 0
