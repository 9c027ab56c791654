"""`ModelConfig` from a GGUF file's metadata (llama.cpp's ``{arch}.*`` keys) and its tensor index.

Key by key (``{arch}`` is ``general.architecture``, ``llama`` or ``qwen2``)::

    {arch}.block_count                       num_hidden_layers
    {arch}.embedding_length                  hidden_size
    {arch}.feed_forward_length               intermediate_size
    {arch}.attention.head_count              num_attention_heads
    {arch}.attention.head_count_kv           num_key_value_heads (default: head_count)
    {arch}.attention.key_length              head_dim (default: embedding_length / head_count)
    {arch}.attention.layer_norm_rms_epsilon  rms_norm_eps
    {arch}.rope.freq_base                    rope_theta (default 10000)
    {arch}.rope.scaling.type, .factor        rope_scaling: none or linear (legacy: {arch}.rope.scale_linear)
    {arch}.context_length                    max_position_embeddings

The special token ids are left unset here: they come with the tokenizer (engine/prompting/gguf_vocab.py),
so that the ids the engine stops on are the ones the tokenizer knows as end-of-generation tokens.

What the metadata does not say, the tensors do: the vocabulary size is the embedding's row count (the token
list may be shorter than a padded embedding); embeddings are tied when ``output.weight`` is absent; a Llama
has attention biases when layer 0 has ``attn_q.bias``/``attn_output.bias`` (Qwen2 always has q/k/v biases
and never an output one). Features that would silently change the maths if ignored (partial rotary, YaRN,
Llama 3.1's ``rope_freqs.weight`` frequency factors) are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping

from gguf import ReaderTensor

from engine.model.config import Architecture, LinearRopeScaling, ModelConfig, RopeScaling
from engine.model.errors import ModelLoadError
from engine.model.gguf_file import GGUFMetadata

ARCHITECTURES: tuple[Architecture, ...] = ("llama", "qwen2")
EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"
_ROPE_FREQS = "rope_freqs.weight"
_DEFAULT_ROPE_THETA = 10000.0


def gguf_architecture(meta: GGUFMetadata) -> Architecture:
    name = meta.string("general.architecture")
    for architecture in ARCHITECTURES:
        if name == architecture:
            return architecture
    raise meta.error(
        "general.architecture", f"is {name!r}, which is not supported (supported: {', '.join(ARCHITECTURES)})"
    )


def config_from_gguf(meta: GGUFMetadata, tensors: Mapping[str, ReaderTensor]) -> ModelConfig:
    architecture = gguf_architecture(meta)
    arch = architecture  # the key prefix
    hidden_size = meta.positive_int(f"{arch}.embedding_length")
    num_heads = meta.positive_int(f"{arch}.attention.head_count")
    num_kv_heads = meta.positive_int(f"{arch}.attention.head_count_kv", num_heads)
    if num_heads % num_kv_heads:
        raise meta.error(f"{arch}.attention.head_count", f"({num_heads}) must be divisible by "
                         f"{arch}.attention.head_count_kv ({num_kv_heads})")
    head_dim = _head_dim(meta, arch, hidden_size, num_heads)
    if EMBEDDING not in tensors:
        raise _missing(meta, EMBEDDING)
    if _ROPE_FREQS in tensors:
        raise ModelLoadError(f"{meta.path}: tensor '{_ROPE_FREQS}' (per-dimension RoPE frequency factors, "
                             "as in Llama 3.1) is not supported")
    llama_output_bias = architecture == "llama" and "blk.0.attn_output.bias" in tensors
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(tensors[EMBEDDING].shape[-1]),  # GGUF shapes list the innermost first: [hidden, vocab]
        hidden_size=hidden_size,
        intermediate_size=meta.positive_int(f"{arch}.feed_forward_length"),
        num_hidden_layers=meta.positive_int(f"{arch}.block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta.positive_float(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=meta.positive_float(f"{arch}.rope.freq_base", _DEFAULT_ROPE_THETA),
        rope_scaling=_rope_scaling(meta, arch),
        max_position_embeddings=meta.positive_int(f"{arch}.context_length"),
        tie_word_embeddings=OUTPUT not in tensors,
        attention_bias=architecture == "qwen2" or "blk.0.attn_q.bias" in tensors,
        attention_output_bias=llama_output_bias,
        bos_token_id=None,
        eos_token_ids=(),
        torch_dtype=None,  # GGUF tensors each have their own type; they are dequantized to the engine's dtype
    )


def _missing(meta: GGUFMetadata, name: str) -> ModelLoadError:
    return ModelLoadError(f"{meta.path}: tensor '{name}' is missing")


def _head_dim(meta: GGUFMetadata, arch: str, hidden_size: int, num_heads: int) -> int:
    key_length = f"{arch}.attention.key_length"
    if meta.has(key_length):
        head_dim = meta.positive_int(key_length)
    elif hidden_size % num_heads:
        raise meta.error(f"{arch}.embedding_length",
                         f"({hidden_size}) must be divisible by {arch}.attention.head_count ({num_heads})")
    else:
        head_dim = hidden_size // num_heads
    value_length = meta.positive_int(f"{arch}.attention.value_length", head_dim)
    if value_length != head_dim:
        raise meta.error(f"{arch}.attention.value_length", f"({value_length}) must equal the key length "
                         f"({head_dim}): separate key and value head sizes are not supported")
    if head_dim % 2:
        raise meta.error(key_length, f"must be even for rotary embeddings, got {head_dim}")
    rotary = meta.positive_int(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise meta.error(f"{arch}.rope.dimension_count",
                         f"({rotary}) must equal the head size ({head_dim}): partial rotary is not supported")
    return head_dim


def _rope_scaling(meta: GGUFMetadata, arch: str) -> RopeScaling | None:
    kind_key = f"{arch}.rope.scaling.type"
    kind = meta.string(kind_key, "none")
    if kind == "linear":
        return LinearRopeScaling(factor=meta.positive_float(f"{arch}.rope.scaling.factor"))
    if kind != "none":
        raise meta.error(kind_key, f"is {kind!r}, which is not supported (supported: none, linear)")
    legacy_factor = meta.positive_float(f"{arch}.rope.scale_linear", 1.0)  # written by older converters
    return LinearRopeScaling(factor=legacy_factor) if legacy_factor != 1.0 else None
