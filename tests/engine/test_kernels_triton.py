"""The Triton kernels against the torch reference backend: compiled on a GPU, interpreted on CPU.

Without CUDA, ``conftest.py`` switches on Triton's interpreter (``TRITON_INTERPRET=1``) before triton is
first imported, so the same tests run the kernels' code on CPU. Shapes are small because interpreted Triton
is slow. The interpreter cannot run ``tl.dot`` on bfloat16 (it multiplies the raw bit patterns:
triton-lang/triton#11584), so low precision is covered by float16, which takes the same path through the
kernels; ``test_kernels_compile.py`` compiles the bfloat16 kernels for a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")  # before the imports below: the kernel modules import triton

from engine import LLM, SamplingParams
from engine.kernels import AttentionMetadata, TorchAttentionBackend, get_attention_backend, triton_decode
from engine.kernels.triton_backend import TritonAttentionBackend
from engine.kernels.triton_decode import choose_num_splits, decode_attention
from engine.kernels.triton_prefill import prefill_attention
from engine.kernels.triton_store import store_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 48
NUM_KV_HEADS = 2
HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
# Largest |triton - reference| allowed. fp16 rounds the softmax weights to 11 bits before the P @ V product,
# bf16 to 8 (eight times coarser).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2}
# bf16 only where the kernels are compiled: the interpreter cannot run its tl.dot (see the module docstring).
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@dataclass
class PagedBatch:
    kv_cache: torch.Tensor  # every position's K/V already stored, the step's new tokens included
    meta: AttentionMetadata
    query: torch.Tensor
    new_key: torch.Tensor
    new_value: torch.Tensor


def paged_batch(
    sequences: list[tuple[int, int]], group: int, dtype: torch.dtype, seed: int, head_dim: int = HEAD_DIM
) -> PagedBatch:
    """A batch of ``(cached tokens, new tokens)`` sequences in randomly chosen, non-contiguous blocks.

    Drawn on the CPU (the same numbers on every machine), then moved to ``DEVICE``.
    """
    generator = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, head_dim, generator=generator).to(dtype)
    free = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    tables, slots, query_lens, seq_lens = [], [], [], []
    for cached, new in sequences:
        total = cached + new
        blocks = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        tables.append(blocks)
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, total)]
        query_lens.append(new)
        seq_lens.append(total)
    num_tokens = sum(query_lens)
    meta = AttentionMetadata.from_host(slots, tables, query_lens, seq_lens)
    query = torch.randn(num_tokens, NUM_KV_HEADS * group, head_dim, generator=generator).to(dtype)
    new_key = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=generator).to(dtype)
    new_value = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=generator).to(dtype)
    TorchAttentionBackend().store_kv(new_key, new_value, kv_cache, meta.slot_mapping)
    for name in ("slot_mapping", "block_tables", "query_start_loc", "seq_lens"):
        setattr(meta, name, getattr(meta, name).to(DEVICE))
    return PagedBatch(kv_cache.to(DEVICE), meta, query.to(DEVICE), new_key.to(DEVICE), new_value.to(DEVICE))


def reference(batch: PagedBatch) -> torch.Tensor:
    """The torch backend's answer, in fp32 from the same (possibly fp16) cache."""
    return TorchAttentionBackend().forward(batch.query.float(), batch.kv_cache.float(), batch.meta, SCALE)


def max_error(output: torch.Tensor, expected: torch.Tensor) -> float:
    return (output.float() - expected).abs().max().item()


# Contexts of one token, just short of, exactly on and just past block boundaries, and many blocks long.
DECODE_CONTEXTS = [1, 3, 4, 5, 8, 17, 38, 64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_matches_reference(dtype: torch.dtype, group: int, num_splits: int) -> None:
    batch = paged_batch([(n - 1, 1) for n in DECODE_CONTEXTS], group, dtype, seed=group * 10 + num_splits)
    meta = batch.meta
    output = torch.full_like(batch.query, float("nan"))
    # block_n = 16 (and as few keys a split) cuts the 38- and 64-token contexts into 3 and 4 splits, each of
    # several cache blocks.
    decode_attention(batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                     output, SCALE, num_splits=num_splits, block_n=16, min_split_keys=16)
    assert output.dtype == dtype
    assert max_error(output, reference(batch)) < TOLERANCE[dtype]


class SkippedLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing, and counts that it was asked."""

    def __init__(self) -> None:
        self.launches = 0

    def __getitem__(self, grid: object) -> SkippedLaunch:
        return self

    def __call__(self, *args: object, **kwargs: object) -> None:
        self.launches += 1


# 3 and 20 tokens fit one 32-key split; 33 and 70 take 2 and 3 (a split holds max(32, ceil(n / 4)) keys).
SPLIT_CONTEXTS, SPLITS_USED = [3, 20, 33, 70], [1, 1, 2, 3]


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_splits_hold_a_fixed_number_of_keys_and_one_split_needs_no_reduce(
    num_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each split covers at least ``min_split_keys`` keys; a sequence that fits one split gets its output
    from the partial kernel itself, and with one split per sequence the reduce is not launched at all."""
    batch = paged_batch([(n - 1, 1) for n in SPLIT_CONTEXTS], 4, torch.float32, seed=11)
    meta, expected = batch.meta, reference(batch)
    reduce = SkippedLaunch()
    monkeypatch.setattr(triton_decode, "_decode_reduce_kernel", reduce)
    output = torch.full_like(batch.query, float("nan"))
    decode_attention(batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                     output, SCALE, num_splits=num_splits, block_n=16, min_split_keys=32)
    assert reduce.launches == (num_splits > 1)
    one_split = torch.tensor([used == 1 or num_splits == 1 for used in SPLITS_USED], device=DEVICE)
    assert max_error(output[one_split], expected[one_split]) < TOLERANCE[torch.float32]
    assert output[~one_split].isnan().all(), "a sequence of several splits waits for the reduce"
    monkeypatch.undo()
    decode_attention(batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                     output, SCALE, num_splits=num_splits, block_n=16, min_split_keys=32)
    assert max_error(output, expected) < TOLERANCE[torch.float32]


def test_decode_with_a_head_dim_that_is_not_a_power_of_two() -> None:
    batch = paged_batch([(20, 1), (6, 1)], group=2, dtype=torch.float32, seed=3, head_dim=24)
    meta = batch.meta
    output = torch.empty_like(batch.query)
    decode_attention(batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                     output, SCALE, num_splits=2, block_n=16)
    assert max_error(output, reference(batch)) < TOLERANCE[torch.float32]


# (cached prefix, new tokens): plain prefills, prefix-cached chunks starting mid-block and on a boundary,
# and chunks longer than one query tile.
PREFILL_SEQUENCES = [(0, 7), (5, 6), (8, 4), (0, 2), (13, 19), (2, 9)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_matches_reference(dtype: torch.dtype, group: int) -> None:
    batch = paged_batch(PREFILL_SEQUENCES, group, dtype, seed=group)
    meta = batch.meta
    output = torch.full_like(batch.query, float("nan"))
    # 16 rows per program: 16, 4 and 2 tokens a tile for the three ratios; long chunks take several tiles.
    prefill_attention(batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                      output, SCALE, max_query_len=meta.max_query_len, block_m=16, block_n=16)
    assert max_error(output, reference(batch)) < TOLERANCE[dtype]


# Decodes and prefill chunks interleaved, as the scheduler emits them.
MIXED = [(0, 7), (11, 1), (5, 6), (3, 1), (0, 1), (16, 1), (2, 13), (8, 4), (30, 1)]


@pytest.mark.parametrize("group", [1, 4])
def test_backend_on_a_mixed_batch_matches_reference(group: int) -> None:
    batch = paged_batch(MIXED, group, torch.float32, seed=7 + group)
    output = TritonAttentionBackend().forward(batch.query, batch.kv_cache, batch.meta, SCALE)
    assert max_error(output, reference(batch)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_reference(dtype: torch.dtype) -> None:
    batch = paged_batch(MIXED, 1, dtype, seed=5)
    fresh = torch.zeros_like(batch.kv_cache)
    expected = torch.zeros_like(batch.kv_cache)
    # fp32 rows into the cache's dtype: the kernel casts exactly as the reference's index_copy_ does.
    key, value = batch.new_key.float(), batch.new_value.float()
    store_kv(key, value, fresh, batch.meta.slot_mapping)
    TorchAttentionBackend().store_kv(key, value, expected, batch.meta.slot_mapping)
    assert torch.equal(fresh, expected)


def test_store_kv_skips_negative_slots() -> None:
    kv_cache = torch.zeros(2, 3, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    value = torch.randn(3, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    store_kv(key, value, kv_cache, torch.tensor([9, -1, 2], device=DEVICE))
    assert torch.equal(kv_cache[0, 2, 1], key[0]) and torch.equal(kv_cache[1, 2, 1], value[0])
    assert torch.equal(kv_cache[0, 0, 2], key[2]) and torch.equal(kv_cache[1, 0, 2], value[2])
    assert torch.count_nonzero(kv_cache) == 4 * NUM_KV_HEADS * HEAD_DIM


def test_num_splits_fill_the_device_and_depend_only_on_the_batch_shape() -> None:
    assert choose_num_splits(num_seqs=1, num_kv_heads=2, num_sms=132) == 16
    assert choose_num_splits(num_seqs=64, num_kv_heads=2, num_sms=132) == 4
    assert choose_num_splits(num_seqs=256, num_kv_heads=2, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, num_sms=132, max_splits=4) == 4


def test_auto_and_triton_selection() -> None:
    assert isinstance(get_attention_backend("triton", DEVICE), TritonAttentionBackend)
    auto = TritonAttentionBackend if DEVICE.type == "cuda" else TorchAttentionBackend
    assert isinstance(get_attention_backend("auto", DEVICE), auto)


def test_engine_greedy_tokens_match_the_torch_backend() -> None:
    # Four-token blocks and a 16-token budget: prompts are chunked, blocks are crossed, and most steps mix
    # prefill chunks with decodes. fp32 everywhere, so that the backends can only differ by summation order.
    prompts = ["The quick brown fox", "Hello", "paged attention, split over the context"]
    params = SamplingParams(max_tokens=6, temperature=0.0)  # Triton's interpreter: ~0.5 s a step
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM("tiny", device=DEVICE.type, dtype="float32", num_blocks=64, block_size=4,
                  max_num_batched_tokens=16, attention_backend=backend)
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]
    assert len({tuple(t) for t in outputs["torch"]}) == len(prompts)
