"""Build a model, its config, tokenizer and chat template from what a ``model`` argument names (sources.py):
the built-in ``tiny``, a local Hugging Face directory, or a GGUF file (``smollm2`` is one; gguf_loader.py).

A checkpoint is checked before any tensor is read: every parameter must be present exactly once with the
right shape, and nothing else may be there, except (in a directory) rotary ``inv_freq`` buffers (recomputed
here) and a redundant ``lm_head.weight`` beside tied embeddings. Weights are cast to the engine's dtype and
moved to its device one tensor at a time, so peak host memory stays near one tensor rather than a second
copy of the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.kernels.backend import AttentionBackend
from engine.kernels.native.library import NativeStatus
from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.gguf_loader import GGUFCheckpoint, gguf_name
from engine.model.llama import LlamaForCausalLM
from engine.model.native_path import bind as bind_native_path
from engine.model.sources import resolve_model
from engine.model.tiny import tiny_config, tiny_state_dict
from engine.model.weights import apply_weight_formats, choose_format
from engine.prompting.chat_template import DEFAULT_TEMPLATE, ChatTemplate
from engine.prompting.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM  # eval mode, no grads, on the requested device and dtype
    config: ModelConfig
    tokenizer: Tokenizer | None  # None when the checkpoint has no tokenizer: token ids in and out only
    chat_template: ChatTemplate  # the checkpoint's own, else DEFAULT_TEMPLATE
    name: str  # the id served unless --served-model-name says otherwise: the alias or the path's stem
    native: NativeStatus  # the CPU path the model took (native_path.bind): logged at start-up, in telemetry


def load_model(
    model: str,
    device: torch.device,
    dtype: torch.dtype,
    attn_backend: AttentionBackend,
    weight_format: str = "fp32",
) -> LoadedModel:
    """``weight_format`` (engine/model/weights.py) sets how the matrices stay resident; ``auto`` follows each
    GGUF tensor's type, and is fp32 for every other source."""
    source = resolve_model(model)
    source_types = None
    if source.path is None:  # the built-in model
        config = tiny_config()
        weights = {name: t.to(device=device, dtype=dtype) for name, t in tiny_state_dict().items()}
        tokenizer, template = ByteTokenizer(), ChatTemplate(DEFAULT_TEMPLATE)
    elif source.kind == "gguf":
        checkpoint = GGUFCheckpoint.open(source.path)
        config = checkpoint.config
        source_types = {name: t.tensor_type for name, t in checkpoint.tensors.items()}
        weights = checkpoint.read_weights(_parameter_shapes(config, attn_backend), device, dtype)
        vocab = checkpoint.vocab  # None: the file has no tokenizer, so neither a template
        tokenizer = vocab.tokenizer if vocab is not None else None
        template = (vocab.chat_template if vocab is not None else None) or ChatTemplate(DEFAULT_TEMPLATE)
    else:
        config = ModelConfig.from_hf_dir(source.path)
        shapes = _parameter_shapes(config, attn_backend)
        weights = _read_checkpoint(source.path, shapes, config, device, dtype)
        tokenizer, template = _read_tokenizer(source.path, config), ChatTemplate.for_model(str(source.path))
    decoder = _build(config, weights, device, attn_backend)
    apply_weight_formats(decoder, _formats(decoder, weight_format, source_types))
    native = bind_native_path(decoder)
    return LoadedModel(decoder, config, tokenizer, template, source.name, native)


def _parameter_shapes(config: ModelConfig, attn_backend: AttentionBackend) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in LlamaForCausalLM(config, attn_backend).named_parameters()}


def _build(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    device: torch.device,
    attn_backend: AttentionBackend,
) -> LlamaForCausalLM:
    # Built on the meta device so no memory is spent on random initial weights that are overwritten anyway.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attn_backend)
    model.load_state_dict(weights, strict=True, assign=True)
    model.to(device)  # moves the RoPE tables, which are built on the host
    model.eval()
    model.requires_grad_(False)
    return model


def _formats(model: LlamaForCausalLM, requested: str, source_types: dict | None) -> dict[str, str]:
    """Module name -> weight format for every matrix (projections, LM head, embedding)."""
    formats = {}
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            source_type = None if source_types is None else source_types[gguf_name(f"{name}.weight")]
            formats[name] = choose_format(requested, source_type)
    return formats


def _ignorable(name: str, config: ModelConfig) -> bool:
    return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_word_embeddings)


def _read_checkpoint(
    directory: Path,
    shapes: dict[str, tuple[int, ...]],
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weight files found")

    # First pass: names and shapes only, so a bad checkpoint fails before gigabytes are read.
    source: dict[str, Path] = {}
    unexpected: list[str] = []
    for file in files:
        with _open(file) as handle:
            names = handle.keys()
            for name in names:
                if name not in shapes:
                    if not _ignorable(name, config):
                        unexpected.append(f"{name} ({file.name})")
                    continue
                if name in source:
                    raise ModelLoadError(f"{file}: tensor '{name}' is also in {source[name].name}")
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != shapes[name]:
                    raise ModelLoadError(
                        f"{file}: tensor '{name}' has shape {shape}, expected {shapes[name]}"
                    )
                source[name] = file
    if unexpected:
        raise ModelLoadError(f"{directory}: unexpected tensors: {', '.join(unexpected)}")
    missing = [name for name in shapes if name not in source]
    if missing:
        shard_names = ", ".join(file.name for file in files)
        raise ModelLoadError(f"{directory}: tensors missing from {shard_names}: {', '.join(missing)}")

    weights: dict[str, torch.Tensor] = {}
    for file in files:
        with _open(file) as handle:
            names = handle.keys()
            for name in names:
                if source.get(name) == file:
                    weights[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
    return weights


def _open(file: Path):  # safetensors exposes no public type for the handle
    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{file}: not a readable safetensors file: {exc}") from None


def _read_tokenizer(directory: Path, config: ModelConfig) -> HFTokenizer | None:
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return HFTokenizer.from_file(path, config.eos_token_ids, config.bos_token_id)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for every parse error
        raise ModelLoadError(f"{path}: cannot be parsed: {exc}") from None
