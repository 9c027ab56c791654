"""Small random GGUF checkpoints written with llama.cpp's own writer (``gguf.GGUFWriter``) for loader tests.

``write_tiny_gguf`` writes a two-layer Qwen2 (or Llama) whose 2-D weights cycle through every tensor type the
engine loads (so one file exercises every dequantizer), with a minimal GPT-2-style byte-level BPE vocabulary
(``tokenizer.ggml.model = "gpt2"``, ``pre = "qwen2"``: 256 byte tokens, three merges, three ChatML control
tokens) and a ChatML chat template, which is what both our loader and ``transformers`` need to load it.

Dimensions are multiples of 256 because K-quants pack rows in 256-element super-blocks. ``gguf.quants``
quantizes only the legacy formats (F16, BF16, Q8_0, Q4_0/1, Q5_0/1); K-quant tensors are therefore written as
random blocks with sane scales, which is just as valid a file: what is tested is that our loader and
``transformers`` decode the same bytes to the same weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from tokenizers import pre_tokenizers

Q = GGMLQuantizationType
ALL_TYPES = (Q.Q8_0, Q.Q4_K, Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K)
CONTROL, NORMAL = 3, 1  # llama.cpp's token types
MERGES = ["Ġ t", "h e", "Ġt he"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, CONTEXT = 256, 512, 2, 4, 2, 512
# Scales of random K-quant blocks: (byte offset of the f16 d, its value, offset of dmin, dmin = d x mean q
# so that weights centre near zero), giving weights of roughly 2 / sqrt(256), as the float tensors have.
_K_SCALES = {Q.Q4_K: (0, 5e-4, 2, 7.5), Q.Q5_K: (0, 2.7e-4, 2, 15.5), Q.Q6_K: (208, 9e-5, None, 0.0)}


def vocabulary() -> tuple[list[str], list[int]]:
    """Tokens and token types: every byte-level character, the merges' results, then the ChatML specials."""
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + [m.replace(" ", "") for m in MERGES] + SPECIALS
    return tokens, [NORMAL] * (len(tokens) - len(SPECIALS)) + [CONTROL] * len(SPECIALS)


def parameter_names(layers: int = LAYERS, *, biases: bool = True, tied: bool = False) -> list[str]:
    """GGUF tensor names in the order llama.cpp's converter writes them."""
    names = ["token_embd.weight"]
    for layer in range(layers):
        block = f"blk.{layer}."
        names += [block + "attn_norm.weight"]
        for projection in ("attn_q", "attn_k", "attn_v"):
            names += [block + projection + ".weight"] + ([block + projection + ".bias"] if biases else [])
        rest = ("attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
        names += [block + n + ".weight" for n in rest]
    return names + ["output_norm.weight"] + ([] if tied else ["output.weight"])


def write_tiny_gguf(
    path: Path,
    *,
    architecture: str = "qwen2",
    types: Sequence[GGMLQuantizationType] = ALL_TYPES,
    leave_out: Sequence[str] = (),
    metadata: Callable[[GGUFWriter], None] | None = None,
    seed: int = 0,
) -> Path:
    """A random two-layer model; 2-D weights take ``types`` in turn. ``leave_out`` drops tensors by GGUF name;
    ``metadata`` adds or overrides keys (it runs after the standard ones)."""
    rng = np.random.default_rng(seed)
    tokens, token_types = vocabulary()
    shapes = _shapes(len(tokens))
    writer = GGUFWriter(path, architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    if metadata is not None:
        metadata(writer)
    matrix_types = itertools.cycle(types)
    for name in parameter_names(biases=architecture == "qwen2"):
        shape = shapes[name.split(".", 2)[-1] if name.startswith("blk.") else name]
        if name in leave_out:
            continue
        if len(shape) == 1:
            values = (1.0 if "norm" in name else 0.0) + rng.normal(0.0, 0.1, shape)
            writer.add_tensor(name, values.astype(np.float32))
        else:
            qtype = next(matrix_types)
            writer.add_tensor(name, _encode(rng, shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _shapes(vocab: int) -> dict[str, tuple[int, ...]]:
    """Torch-order shapes ([out, in]) by tensor name (a layer's without its ``blk.N.`` prefix)."""
    head_dim = HIDDEN // HEADS
    q, kv = HEADS * head_dim, KV_HEADS * head_dim
    return {
        "token_embd.weight": (vocab, HIDDEN), "output.weight": (vocab, HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "attn_norm.weight": (HIDDEN,), "ffn_norm.weight": (HIDDEN,),
        "attn_q.weight": (q, HIDDEN), "attn_k.weight": (kv, HIDDEN), "attn_v.weight": (kv, HIDDEN),
        "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,), "attn_output.weight": (HIDDEN, q),
        "ffn_gate.weight": (INTERMEDIATE, HIDDEN), "ffn_up.weight": (INTERMEDIATE, HIDDEN),
        "ffn_down.weight": (HIDDEN, INTERMEDIATE),
    }


def _encode(rng: np.random.Generator, shape: tuple[int, ...], qtype: GGMLQuantizationType) -> np.ndarray:
    """``shape`` random weights as ``qtype``'s bytes (a float array for F32)."""
    if qtype in _K_SCALES or qtype not in ALL_TYPES:
        return random_blocks(rng, shape, qtype)
    weights = rng.normal(0.0, 2.0 / np.sqrt(shape[-1]), shape).astype(np.float32)
    return quantize(weights, qtype)


def random_blocks(
    rng: np.random.Generator, shape: tuple[int, ...], qtype: GGMLQuantizationType
) -> np.ndarray:
    """Random blocks of a block-quantized type; for K-quants with their f16 scales set to sane values."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    if qtype in _K_SCALES:
        d_offset, d, dmin_offset, mean_q = _K_SCALES[qtype]
        blocks[..., d_offset:d_offset + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
        if dmin_offset is not None:
            dmin = np.float16(d * mean_q).tobytes()
            blocks[..., dmin_offset:dmin_offset + 2] = np.frombuffer(dmin, np.uint8)
    return blocks.reshape(rows, -1)
