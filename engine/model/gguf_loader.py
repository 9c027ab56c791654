"""Weights, config, tokenizer and chat template from one GGUF file (llama.cpp's format), Llama and Qwen2.

Parsing and dequantization are the ``gguf`` package's (llama.cpp's own reader and reference dequantizers),
so every block format decodes exactly as llama.cpp defines it. Loading is two passes, as for safetensors:
names, shapes and tensor types are checked first, so a bad file fails before anything is dequantized; then
each tensor is dequantized to fp32 on the host, fixed up, cast to the engine's dtype and moved to its device
before the next one, so peak host memory stays near one fp32 tensor beyond the model itself.

Names map one to one, ours from GGUF's::

    token_embd.weight           model.embed_tokens.weight
    output_norm.weight          model.norm.weight
    output.weight               lm_head.weight (absent: tied embeddings)
    blk.N.attn_norm.weight      model.layers.N.input_layernorm.weight
    blk.N.ffn_norm.weight       model.layers.N.post_attention_layernorm.weight
    blk.N.attn_{q,k,v}.*        model.layers.N.self_attn.{q,k,v}_proj.*
    blk.N.attn_output.*         model.layers.N.self_attn.o_proj.*
    blk.N.ffn_{gate,up,down}.*  model.layers.N.mlp.{gate,up,down}_proj.*

GGUF lists a tensor's dimensions innermost first, so its ``[in, out]`` is torch's ``[out, in]``.

The one layout change: for Llama, llama.cpp's converter reorders each head's Q and K rows (weights and
biases) from Hugging Face's rotate-half layout (a head's first half of dimensions, then its second) to the
interleaved pairs that GGML's default RoPE rotates::

    HF row of head h:   [x0 x1 ... x(d/2-1) | y0 y1 ... y(d/2-1)]    (x_i, y_i) rotate together
    GGUF row of head h: [x0 y0 x1 y1 ... x(d/2-1) y(d/2-1)]

`_rotate_half_rows` undoes it. Qwen2 is converted with GGML's NEOX RoPE, which is rotate-half: no change.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize

from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.gguf_config import config_from_gguf
from engine.model.gguf_file import GGUFMetadata, open_gguf
from engine.prompting.gguf_vocab import GGUFVocab, GGUFVocabError, read_gguf_vocab

Q = GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
_TOP_LEVEL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_MODULES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_PREFIX = "model.layers."


def gguf_name(parameter: str) -> str:
    """Our parameter's GGUF name: ``model.layers.3.mlp.up_proj.weight`` -> ``blk.3.ffn_up.weight``."""
    if parameter in _TOP_LEVEL:
        return _TOP_LEVEL[parameter]
    layer, module_and_kind = parameter.removeprefix(_LAYER_PREFIX).split(".", 1)
    module, kind = module_and_kind.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_MODULES[module]}.{kind}"


@dataclass(slots=True)
class GGUFCheckpoint:
    """An opened GGUF file: its config and tokenizer parsed, its weights still mapped (``read_weights``).

    ``vocab`` is None when the file has no ``tokenizer.ggml.tokens`` (token ids in and out only, as for a
    Hugging Face directory without ``tokenizer.json``); otherwise the config's special token ids are the
    vocabulary's, so the engine stops on exactly the tokens the tokenizer calls end-of-generation.
    """

    path: Path
    tensors: dict[str, ReaderTensor]  # their data are views of the reader's memory map of the file
    config: ModelConfig
    vocab: GGUFVocab | None

    @classmethod
    def open(cls, path: Path) -> GGUFCheckpoint:
        reader = open_gguf(path)
        tensors = {tensor.name: tensor for tensor in reader.tensors}
        config = config_from_gguf(GGUFMetadata(path, reader.fields), tensors)
        vocab = _read_vocab(path, reader, config)
        if vocab is not None:
            config = replace(config, bos_token_id=vocab.bos_token_id, eos_token_ids=vocab.eos_token_ids)
        return cls(path, tensors, config, vocab)

    def read_weights(
        self, shapes: dict[str, tuple[int, ...]], device: torch.device, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """The parameters of ``shapes`` (name -> torch shape), dequantized, in ``dtype`` on ``device``."""
        names = {parameter: gguf_name(parameter) for parameter in shapes}
        self._check(names, shapes)
        weights: dict[str, torch.Tensor] = {}
        for parameter, name in names.items():
            tensor = self.tensors[name]
            values = dequantize(tensor.data, tensor.tensor_type)
            if not values.flags.writeable:  # F32 data is a view of the file's memory map: own a copy
                values = np.array(values)
            weight = self._to_rotate_half(name, torch.from_numpy(values).reshape(shapes[parameter]))
            weights[parameter] = weight.to(device=device, dtype=dtype)
        return weights

    def _check(self, names: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> None:
        """Every tensor present once with the right shape and a supported type, and nothing else, before
        anything is dequantized."""
        missing = [f"{name} ({parameter})" for parameter, name in names.items() if name not in self.tensors]
        if missing:
            raise ModelLoadError(f"{self.path}: tensors missing: {', '.join(missing)}")
        unexpected = sorted(set(self.tensors) - set(names.values()))
        if unexpected:
            raise ModelLoadError(f"{self.path}: unexpected tensors: {', '.join(unexpected)}")
        for parameter, name in names.items():
            tensor = self.tensors[name]
            if tensor.tensor_type not in SUPPORTED_TYPES:
                supported = ", ".join(t.name for t in SUPPORTED_TYPES)
                raise ModelLoadError(f"{self.path}: tensor '{name}' has type {tensor.tensor_type.name}, "
                                     f"which is not supported (supported: {supported})")
            shape = tuple(int(size) for size in reversed(tensor.shape))
            if shape != shapes[parameter]:
                raise ModelLoadError(f"{self.path}: tensor '{name}' has shape {shape} (torch order), "
                                     f"expected {shapes[parameter]} for {parameter}")

    def _to_rotate_half(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        if self.config.architecture != "llama":
            return weight
        if ".attn_q." in name:
            return _rotate_half_rows(weight, self.config.num_attention_heads)
        if ".attn_k." in name:
            return _rotate_half_rows(weight, self.config.num_key_value_heads)
        return weight


def _read_vocab(path: Path, reader: GGUFReader, config: ModelConfig) -> GGUFVocab | None:
    if "tokenizer.ggml.tokens" not in reader.fields:
        return None
    try:
        vocab = read_gguf_vocab(reader)
    except GGUFVocabError as exc:
        raise ModelLoadError(f"{path}: tokenizer metadata: {exc}") from None
    if vocab.tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(f"{path}: the tokenizer has {vocab.tokenizer.vocab_size} tokens but the "
                             f"embedding only {config.vocab_size} rows")
    return vocab


def _rotate_half_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (module docstring): per head, rows ``[x0 y0 x1 y1 ...]`` back to
    ``[x0 x1 ... y0 y1 ...]``. Works on a weight ``[heads * d, in]`` and on a bias ``[heads * d]``."""
    shape = weight.shape
    pairs = weight.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:])
    return pairs.transpose(1, 2).reshape(shape)
