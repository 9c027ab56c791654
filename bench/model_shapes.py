"""The published models whose shapes the GPU benchmarks run, with random weights, as checkpoints on disk.

Throughput and bandwidth do not depend on the weights' values, so a checkpoint is the architecture of a
published model (its ``config.json`` hyperparameters) with seeded random weights, initialised on the GPU
(seconds, even for 8B parameters) and written with ``save_pretrained``: no download. ``checkpoint`` reuses
one already written in the same directory, so the engine runs and the later ``transformers`` run of the
one-command GPU round (bench/gpu_round.sh) pay for it once.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch
import transformers

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# Architecture hyperparameters of published models; weights are random.
SHAPES: dict[str, tuple[type[transformers.PretrainedConfig], dict]] = {
    "qwen2.5-0.5b": (
        transformers.Qwen2Config,
        {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
         "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
         "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    ),
    "llama-3.2-1b": (
        transformers.LlamaConfig,
        {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0}},
    ),
    # The weight-bound shape (issue 46): 8.03B parameters, 16.1 GB in bf16, so a decode step at batch 64
    # reads mostly weights and its MBU can approach what the device's memory allows.
    "llama-3.1-8b": (
        transformers.LlamaConfig,
        {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0}},
    ),
}
# --smoke: the same architectures at toy size, so a whole benchmark runs on a CPU in seconds.
SMOKE_SIZES = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 16384,
}


def checkpoint(name: str, smoke: bool, dtype: torch.dtype, device: torch.device, root: Path) -> tuple[Path, int]:
    """The directory of shape ``name``'s random-weight checkpoint under ``root`` (written unless one of the
    same shape, size and dtype is there already: ``config.json`` is written last, after the weights) and its
    vocabulary size."""
    config_class, sizes = SHAPES[name]
    config = config_class(**{**sizes, **(SMOKE_SIZES if smoke else {})})
    directory = root / f"{name}{'-smoke' if smoke else ''}-{str(dtype).removeprefix('torch.')}"
    if (directory / "config.json").is_file():
        return directory, json.loads((directory / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of minutes for 8B parameters
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    partial = directory.with_name(directory.name + ".partial")
    model.save_pretrained(partial)
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    partial.rename(directory)  # whole or absent: a run cut short mid-write leaves nothing to reuse
    return directory, config.vocab_size
