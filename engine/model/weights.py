"""How the decoder's big matrices are stored and multiplied: ``--weight-format auto|fp32|bf16|int8|int4``.

On a CPU, decoding one token reads every weight once, so bytes per weight set the speed; a GGUF file's
weights are already 4 to 8 bits. A quantized format keeps them that small in memory and multiplies with
them directly, never holding a float32 copy:

=======  ==================================================================  ============  ===========
format   storage                                                             bytes/weight  from GGUF
=======  ==================================================================  ============  ===========
fp32     dense, in the engine's dtype (the loader's plain path: exact)       4             F32/F16/BF16
bf16     dense bfloat16                                                      2
int8     int8 per output row, symmetric, one float32 scale per row           1             Q5_*, Q6_K, Q8_0
int4     uint4 in groups of 32 along the input, a scale and zero each        0.625         Q4_0/Q4_1/Q4_K
=======  ==================================================================  ============  ===========

``auto`` picks per tensor from its GGUF type (last column; anything else, and every non-GGUF model, fp32),
so a Q4_1 file stays 4-bit: its blocks are affine in groups of 32 (``d * q + m``), which the int4 format
holds. int4 applies to projections whose output rows are a multiple of the kernel's tile (16 native, 64
torch) and input a multiple of 32; other projections take int8 instead, and so does the token embedding
(whose rows are gathered, and which is also the LM head when tied).

int4 has two implementations (``int4_class``): ``Q4Linear``, the native kernel (engine/kernels/native:
C built on first use for AVX-512 VNNI or AVX2, cached), which keeps ``d`` and ``m`` in float16 as the file
does and multiplies in integers like llama.cpp's Q4_1 x Q8_1 (activations quantized per group of 32, exact
integer sums) at any row count; where the native path is off, ``Int4Linear`` on torch's kernel below.

Multiplying (``QuantizedLinear``): torch's int4 (``Int4Linear``) and bf16 use a weight-only kernel on
bfloat16 activations (``_weight_int4pack_mm_for_cpu``) up to ``KERNEL_MAX_ROWS`` rows (decode), which reads
the small weights directly; more rows (prefill) dequantize the matrix to the activations' dtype for one dense GEMM, whose cost
the many rows amortize. int8 uses its weight-only kernel for a few rows and multiplies in integers
(``torch._int_mm``, VNNI, each activation row quantized to int8) for more (``Int8Linear``). Measured on this
project's 2-core Xeon (AVX-512 VNNI, no AVX512-BF16), one thread, 576x1536: 1 row fp32 124 us, int8 60 us,
int4 54 us; 1,000 rows fp32 19 ms, the int4 kernel 48 ms, dequantize + fp32 GEMM 29 ms.

Quantized formats are lossy (bfloat16 or int8 activations into the kernels, requantized scales): the
parity tests (tests/engine/test_weight_formats.py) bound their logits against the fp32 path, which stays
exact (tests/engine/test_gguf_smollm2.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from engine.kernels.native import library as native_library
from engine.kernels.native import ops as native_ops
from engine.kernels.native import q4 as native_q4
from engine.kernels.native.ops import NativeKernels
from engine.model import cuda_fusion

Q = GGMLQuantizationType
WEIGHT_FORMATS = ("auto", "fp32", "bf16", "int8", "int4")
_AUTO = {Q.Q4_0: "int4", Q.Q4_1: "int4", Q.Q4_K: "int4", Q.Q5_0: "int8", Q.Q5_1: "int8", Q.Q5_K: "int8",
         Q.Q6_K: "int8", Q.Q8_0: "int8"}
# Above this many rows the dequantize-then-GEMM path beats the weight-only kernels (module docstring).
KERNEL_MAX_ROWS = 64
INT8_KERNEL_MAX_ROWS = 8  # int8: weight-only kernel up to here, integer GEMM above (Int8Linear)
GROUP = 32  # int4 group along the input dimension (Q4_* blocks are 32 weights)
_PACK_ROWS = 64  # int4: output rows a multiple of this (torch's packing tiles them by 64 or 32)


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W [out, in]`` resident in a compact format; a drop-in for ``nn.Linear``.

    Subclasses store the weight as buffers and say how to multiply with few rows (``_kernel``, bfloat16
    activations in and out) and how to rebuild the dense matrix (``dequantize``).
    """

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ W^T`` in the rows' dtype: the weight-only kernel on bfloat16 activations for few rows,
        one dense GEMM on the dequantized matrix for many (module docstring)."""
        if rows.shape[0] <= KERNEL_MAX_ROWS:
            return self._kernel(rows.to(torch.bfloat16)).to(rows.dtype)
        return F.linear(rows, self.dequantize(rows.dtype))

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


class Bf16Linear(QuantizedLinear):
    format = "bf16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(*weight.shape, bias)
        self.register_buffer("weight", weight.to(torch.bfloat16))

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.weight)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.weight[ids].to(dtype)


class Int8Linear(QuantizedLinear):
    """Symmetric int8 per output row: ``W[n, k] = qweight[n, k] * scales[n]``.

    Up to ``INT8_KERNEL_MAX_ROWS`` rows (one stream's decode) use the weight-only kernel on bfloat16
    activations; one float32 row takes the native int8_matmul.c where the model was bound to the native
    library (``native``, set once at load by native_path.bind; ops.int8_fits: as
    fast, both read the weights at memory speed, and 2e-5 off the exact product where bfloat16 is 5e-3).
    More rows multiply in integers: each activation row is quantized to int8 with its own scale (absmax /
    127, so a row's result never depends on the other rows of the batch), ``torch._int_mm`` sums
    int8 x int8 into int32 (VNNI), and the two scales come back in one multiply. Measured here, one thread,
    against the dense fp32 GEMM: at 32 rows 1.2-2.4x faster (the 49152-row LM head 48 -> 27-42 ms), where the
    weight-only kernel is 1.3-2.7x slower; at one row both beat fp32 (LM head 13.7 ms: 6.2 weight-only, 4.0
    integer). The integer path costs precision on activations with outlier channels (SmolLM2 with every
    matrix int8: max logit error 9-13% of the largest logit, against 3-6% weight-only), hence the split.
    """

    format = "int8"

    native: NativeKernels | None = None  # native_path.bind sets it when the model loads

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(*weight.shape, bias)
        qweight, scales = quantize_int8(weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("scales_bf16", scales.to(torch.bfloat16))  # the weight-only kernel's dtype

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        integer_gemm = integer_gemm_pays()
        if rows.shape[0] <= (INT8_KERNEL_MAX_ROWS if integer_gemm else KERNEL_MAX_ROWS):
            if self.native is not None and rows.dtype == torch.float32 and native_ops.int8_fits(*rows.shape):
                return self.native.int8_matmul(rows, self.qweight, self.scales)  # int8_matmul.c (docstring)
            x = rows.to(torch.bfloat16)
            return torch._weight_int8pack_mm(x, self.qweight, self.scales_bf16).to(rows.dtype)
        if not integer_gemm:
            return F.linear(rows, self.dequantize(rows.dtype))
        x = rows.float()
        x_scales = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30) / 127
        x_int8 = torch.round(x / x_scales).to(torch.int8)
        # qweight.t() is a view: _int_mm takes the transposed layout without a copy of the weight.
        return (torch._int_mm(x_int8, self.qweight.t()) * (x_scales * self.scales)).to(rows.dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``W[ids]``, dense: the embedding lookup of a quantized (possibly tied) embedding."""
        return self.qweight[ids].to(dtype) * self.scales[ids].to(dtype)[:, None]


class Int4Linear(QuantizedLinear):
    """uint4 ``q`` in groups of 32 inputs: ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]``, g = k // 32.

    ``packed`` is torch's CPU int4 layout (``_convert_weight_to_int4pack_for_cpu``), which depends on the
    kernel ATen picked for this CPU (``torch_int4_tile``): with AVX-512 output rows in tiles of T = 64, with
    AVX2 of T = 32; byte ``j`` of input ``k`` of tile ``t`` holds row ``Tt + j`` in its low nibble and
    ``Tt + T/2 + j`` in its high one::

        packed.view(out / T, in, T / 2)[t, k, j] = q[Tt + j, k] | q[Tt + T/2 + j, k] << 4

    Without either, ATen packs otherwise: ``dequantize`` then reads ``q`` back through the kernel itself, times
    the identity with unit scales and a zero of 8, which returns each ``q`` exactly.

    ``scales_zeros [in / 32, out, 2]`` (bfloat16) holds each group's scale and zero.
    """

    format = "int4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(*weight.shape, bias)
        q, scales_zeros = quantize_int4(weight)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_zeros", scales_zeros)

    def _kernel(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_zeros)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        out, inp = self.out_features, self.in_features
        tile = torch_int4_tile()
        if tile is None:  # (q - 8) * 1 + 8 = q: small integers, exact in bfloat16
            unit = torch.stack((torch.ones_like(self.scales_zeros[..., 0]), torch.full_like(self.scales_zeros[..., 1], 8)),
                               dim=-1)
            eye = torch.eye(inp, dtype=torch.bfloat16)
            q = torch._weight_int4pack_mm_for_cpu(eye, self.packed, GROUP, unit).t()
        else:
            q = _unpack_torch_int4(self.packed, out, inp, tile)
        q = q.reshape(out, inp // GROUP, GROUP).to(dtype) - 8
        scale, zero = self.scales_zeros.to(dtype).permute(2, 1, 0).unsqueeze(-1)  # each [out, groups, 1]
        return torch.addcmul(zero, q, scale).reshape(out, inp)


@functools.cache
def integer_gemm_pays() -> bool:
    """Whether Int8Linear's integer GEMM (``torch._int_mm``) pays on this CPU: where it has VNNI (the native
    library's avx512 target asks the same CPU features). Without, torch takes a slow path, and Int8Linear keeps
    the weight-only kernel up to KERNEL_MAX_ROWS rows, then dequantizes. On the AMD EPYC Zen 3 VM (AVX2),
    SmolLM2's LM head, one thread, best of 3-5: 32 rows 865 ms integer, 88 ms weight-only, 205 ms to
    dequantize (+ 35-81 ms fp32 GEMM); 128 rows 304 ms weight-only. Asked once per process."""
    try:
        return native_library.best_target() == "avx512"
    except OSError:  # no compiler to ask with: the float GEMM, never the slow one
        return False


def _unpack_torch_int4(packed: torch.Tensor, out: int, inp: int, tile: int) -> torch.Tensor:
    """``q [out, inp]`` (0..15) from torch's packed layout with ``tile`` rows per tile (Int4Linear)."""
    tiles = packed.view(out // tile, inp, tile // 2)
    q = torch.stack((tiles & 15, tiles >> 4), dim=2).view(out // tile, inp, tile)
    return q.transpose(1, 2).reshape(out, inp)


@functools.cache
def torch_int4_tile() -> int | None:
    """Rows per tile of torch's CPU int4 layout on this CPU (64 with AVX-512, 32 with AVX2), or None where
    it packs otherwise: found once by packing a matrix whose every nibble says where it came from."""
    rows, cols = torch.arange(128)[:, None], torch.arange(64)[None, :]
    q = ((7 * rows + 3 * cols) % 16).to(torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    for tile in (64, 32):
        if torch.equal(_unpack_torch_int4(packed, 128, 64, tile).to(torch.int32), q):
            return tile
    return None


class Q4Linear(QuantizedLinear):
    """int4 on the native kernel (engine/kernels/native): ``W[n, k] = d[n, g] * q[n, k] + m[n, g]``,
    ``q`` in 0..15, ``d`` and ``m`` float16 per group of 32 inputs: a Q4_1 block's own numbers, so its
    weights stay exact. float32 activations in and out, at every row count: the kernel writes each row as
    two int8 digits per input on a step per group of 32 (about 15 bits; one digit, as llama.cpp's Q8_1,
    made SmolLM2's logits chaotic) and sums in integers (AVX-512 VNNI). Output rows a multiple of 16. The
    int4 format takes this class wherever the kernel builds (``int4_class``). SmolLM2 Q4_1 against
    Int4Linear, locked runs on the 2-core VM: 32 sequences, one thread, 594 vs 186 tokens/s with one digit
    (two digits: 288 one thread, 462 two); one stream gains less (the matmuls read memory at its speed;
    the ~50 other torch ops of a layer remain).
    """

    format = "int4"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(*weight.shape, bias)
        qpack, scales = native_q4.pack(*quantize_q4(weight))
        self.register_buffer("qpack", qpack)
        self.register_buffer("scales", scales)
        self.native = _native_on()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.dim() == 2 and self.bias is None:  # the decoder's flat tokens
            return self.native.q4_matmul(x, self.qpack, self.scales)  # (no reshape, view or cast to pay for)
        return super().forward(x)

    def _matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return self.native.q4_matmul(rows, self.qpack, self.scales).to(rows.dtype)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return native_q4.unpack(self.qpack, self.scales, dtype)


def concatenated(modules: list[nn.Module]) -> nn.Module | None:
    """One module whose output rows are the ``modules``' one after another (they share an input), or None:
    one kernel call in place of several, with no weight rounded again.

    - every module a ``Q4Linear`` without bias: a ``Q4Linear`` on buffers that are the originals'
      concatenated (the layout tiles output rows);
    - every module a dense ``nn.Linear`` on CUDA, all with a bias or none (``cuda_fusion``): an ``nn.Linear``
      of the weights (and biases) concatenated. On CPU dense projections stay apart, as HF computes them.
    """
    if not modules or len({m.in_features for m in modules}) != 1:
        return None
    if all(type(m) is nn.Linear and cuda_fusion.applies(m.weight) for m in modules):
        return _dense_concatenated(modules)
    if not all(type(m) is Q4Linear and m.bias is None for m in modules):
        return None
    fused = Q4Linear.__new__(Q4Linear)
    QuantizedLinear.__init__(fused, sum(m.out_features for m in modules), modules[0].in_features, None)
    fused.register_buffer("qpack", torch.cat([m.qpack for m in modules]))
    fused.register_buffer("scales", torch.cat([m.scales for m in modules]))
    fused.native = modules[0].native
    return fused


def _dense_concatenated(modules: list[nn.Linear]) -> nn.Linear | None:
    if len({m.bias is None for m in modules}) != 1:
        return None
    weight = torch.cat([m.weight for m in modules])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=modules[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if modules[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([m.bias for m in modules]), requires_grad=False)
    return fused


def _native_on() -> NativeKernels:
    """The library a ``Q4Linear`` multiplies with: one exists only where the native path is on."""
    chosen = native_library.library()
    if chosen is None:
        raise RuntimeError(f"Q4Linear needs the native library, which is off: {native_library.status().reason}")
    return chosen


def int4_class() -> type[QuantizedLinear]:
    """What the int4 format is built of here: the native kernel where the native path is on
    (engine/kernels/native/library.py), else torch's weight-only kernel."""
    return Q4Linear if native_library.library() is not None else Int4Linear


_FORMATS: dict[str, type[QuantizedLinear]] = {"bf16": Bf16Linear, "int8": Int8Linear}  # int4: int4_class()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight int8 [out, in], scales float32 [out])``, symmetric per row: the row's largest magnitude
    maps to 127 (an all-zero row gets scale 1 so that nothing divides by zero)."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    qweight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight, scales


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q int32 [out, in] in 0..15, scales_zeros bfloat16 [in / 32, out, 2])``, affine per group of 32:
    the group's minimum maps to 0 and its maximum to 15. The scale and zero are rounded to bfloat16 first
    and ``q`` is chosen against the rounded values, so the stored numbers are the best the format holds."""
    out, inp = weight.shape
    groups = weight.float().reshape(out, inp // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).to(torch.bfloat16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    q = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.int32)
    scales_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return q.view(out, inp), scales_zeros


def quantize_q4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [out, in] in 0..15, d, m [out, in / 32])``, affine per group of 32 with ``d`` and ``m`` rounded to
    float16 first (``q`` is chosen against the rounded values): the group's minimum maps to 0, its maximum to
    15. A Q4_1 block spans 0..15 by construction, so its ``d`` and ``m`` come back exactly."""
    out, inp = weight.shape
    groups = weight.float().reshape(out, inp // GROUP, GROUP)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    d = ((high - low) / 15).half().float()
    d = torch.where(d > 0, d, torch.ones_like(d))
    m = low.half().float()
    q = torch.round((groups - m[..., None]) / d[..., None]).clamp(0, 15).to(torch.uint8)
    return q.view(out, inp), d, m


def int4_fits(out_features: int, in_features: int) -> bool:
    if int4_class() is Q4Linear:
        return native_q4.fits(out_features, in_features)
    return out_features % _PACK_ROWS == 0 and in_features % GROUP == 0


def choose_format(requested: str, source_type: GGMLQuantizationType | None) -> str:
    """The format one matrix gets: ``requested`` unless it is ``auto``, which follows the GGUF type."""
    if requested != "auto":
        return requested
    return _AUTO.get(source_type, "fp32") if source_type is not None else "fp32"


def apply_weight_formats(model: nn.Module, formats: Mapping[str, str]) -> None:
    """Replace each ``nn.Linear`` named in ``formats`` (module name -> format) by its quantized form, in place;
    ``fp32`` leaves a module as it is. The embedding (``model.embed_tokens``) takes int8 for any quantized
    format; ``LlamaForCausalLM.compute_logits`` multiplies through ``project``, so a tied LM head shares it.
    Then each module with a ``fuse_projections`` method (llama.py's attention and MLP) may merge projections
    of one input into one matrix (``concatenated``).
    """
    for name, fmt in formats.items():
        if fmt == "fp32":
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, child)
        weight = module.weight.data
        if isinstance(module, nn.Embedding):
            table = Bf16Linear(weight, None) if fmt == "bf16" else Int8Linear(weight, None)
            setattr(parent, child, QuantizedEmbedding(table, weight.dtype))
            continue
        if fmt == "int4" and not int4_fits(*weight.shape):
            fmt = "int8"
        bias = None if module.bias is None else module.bias.data
        setattr(parent, child, (int4_class() if fmt == "int4" else _FORMATS[fmt])(weight, bias))
    for module in list(model.modules()):  # the decoder's own rule for which projections share a kernel call
        if hasattr(module, "fuse_projections"):
            module.fuse_projections()


class QuantizedEmbedding(nn.Module):
    """An embedding whose table is an ``Int8Linear`` (or ``Bf16Linear``): lookups gather rows and return them
    in the engine's ``dtype``; as a tied LM head it multiplies like any quantized projection (``project``)."""

    def __init__(self, table: Int8Linear | Bf16Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids, self.dtype)


def project(hidden: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``hidden @ W^T`` for a dense ``nn.Linear``/``nn.Embedding`` or a quantized one (the LM head)."""
    if isinstance(module, QuantizedEmbedding):
        return module.table(hidden)
    if isinstance(module, QuantizedLinear):
        return module(hidden)
    return F.linear(hidden, module.weight)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights as they are resident: parameters and quantized buffers, each tensor once
    (tied weights share storage). Excludes the non-weight buffers (the RoPE tables)."""
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            seen.update({b.data_ptr(): b.numel() * b.element_size() for b in module.buffers(recurse=False)})
    return sum(seen.values())
