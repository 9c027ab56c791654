"""LoRA adapters for tests, in PEFT's directory layout: random ones written directly for any model config
(``write_adapter``: no peft needed, shapes or names may be broken on purpose), and random PEFT adapters
on a `transformers` model (``add_peft_adapters``), which are then the reference the engine is compared with.
"""

from __future__ import annotations

import json
from pathlib import Path

import peft
import torch
import transformers
from safetensors.torch import save_file

from engine.model.config import ModelConfig
from engine.model.lora import projection_shapes

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(directory: Path, config: ModelConfig, *, rank: int = 4, alpha: float = 8.0,
                  targets: list[str] | None = None, seed: int = 0, scale: float = 0.1,
                  extra_config: dict | None = None) -> Path:
    """A random adapter for ``config``'s model (``scale``: the weights' standard deviation)."""
    targets = targets or ALL_TARGETS
    generator = torch.Generator().manual_seed(seed)
    shapes = projection_shapes(config)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            fan_in, fan_out = shapes.get(module, (config.hidden_size, config.hidden_size))
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * scale
    directory.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets,
                "bias": "none", "use_rslora": False, **(extra_config or {})}
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def add_peft_adapters(model: transformers.PreTrainedModel, directory: Path,
                      specs: dict[str, dict]) -> peft.PeftModel:
    """Random PEFT adapters on ``model`` (``specs``: name -> LoraConfig keywords), each saved as
    ``directory / name``; returns the PeftModel holding them all (``set_adapter(name)`` picks one,
    ``disable_adapter()`` gives the base model)."""
    wrapped = None
    for seed, (name, options) in enumerate(specs.items()):
        config = peft.LoraConfig(init_lora_weights=False, **options)  # random A and B, not B = 0
        torch.manual_seed(seed + 1)
        if wrapped is None:
            wrapped = peft.get_peft_model(model, config, adapter_name=name)
        else:
            wrapped.add_adapter(name, config)
    assert wrapped is not None
    wrapped.eval()
    for name in specs:
        wrapped.save_pretrained(directory / "saved", selected_adapters=[name])
        saved = directory / "saved" if name == "default" else directory / "saved" / name
        (directory / name).mkdir(parents=True, exist_ok=True)
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            (directory / name / file).write_bytes((saved / file).read_bytes())
    return wrapped
