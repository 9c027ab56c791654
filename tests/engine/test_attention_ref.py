"""The torch paged-attention reference against dense causal attention on contiguous K/V."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import AttentionMetadata, TorchAttentionBackend, get_attention_backend, torch_ref

BLOCK_SIZE = 4
NUM_BLOCKS = 64
HEAD_DIM = 8
NUM_KV_HEADS = 2


def dense_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of the last ``len(query)`` positions over ``key``/``value`` [ctx, kv_heads, D], in fp64."""
    group = query.shape[1] // key.shape[1]
    q = query.double().transpose(0, 1)
    k = key.double().repeat_interleave(group, dim=1).transpose(0, 1)
    v = value.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale
    offset = key.shape[0] - query.shape[0]
    for i in range(query.shape[0]):
        scores[:, i, offset + i + 1 :] = float("-inf")
    return (scores.softmax(-1) @ v).transpose(0, 1)


# (cached tokens before the step, new tokens this step): prefill chunks with and without a cached prefix,
# decodes, and contexts that end exactly on, just past and just before block boundaries.
SEQUENCES = [(0, 7), (5, 6), (11, 1), (3, 1), (0, 1), (8, 4), (16, 1), (2, 13)]


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_attention_matches_dense(group: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    num_heads = NUM_KV_HEADS * group
    backend = TorchAttentionBackend()
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()

    tables, keys, values, queries, slots = [], [], [], [], []
    for cached, new in SEQUENCES:
        total = cached + new
        blocks = [free_blocks.pop() for _ in range(-(-total // BLOCK_SIZE))]
        tables.append(blocks)
        key = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        value = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        positions = torch.arange(total)
        seq_slots = torch.tensor(blocks)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        # The cached prefix was stored by earlier steps; this step stores only the new tokens.
        backend.store_kv(key[:cached], value[:cached], kv_cache, seq_slots[:cached])
        keys.append(key)
        values.append(value)
        queries.append(torch.randn(new, num_heads, HEAD_DIM, generator=generator))
        slots.append(seq_slots[cached:])

    query_lens = [new for _, new in SEQUENCES]
    seq_lens = [cached + new for cached, new in SEQUENCES]
    meta = AttentionMetadata.from_host(torch.cat(slots).tolist(), tables, query_lens, seq_lens)
    new_keys = torch.cat([k[cached:] for k, (cached, _) in zip(keys, SEQUENCES)])
    new_values = torch.cat([v[cached:] for v, (cached, _) in zip(values, SEQUENCES)])
    backend.store_kv(new_keys, new_values, kv_cache, meta.slot_mapping)

    scale = HEAD_DIM**-0.5
    output = backend.forward(torch.cat(queries), kv_cache, meta, scale)

    expected = torch.cat([dense_causal_attention(q, k, v, scale) for q, k, v in zip(queries, keys, values)])
    assert output.dtype == torch.float32
    assert output.shape == (sum(query_lens), num_heads, HEAD_DIM)
    # fp32 against float64, any summation order (ATen's CPU kernels choose it by capability): a softmax-weighted
    # sum of n <= 17 values after a D = 8 dot product errs by at most ~(D + n + 10) * 2^-24 * max|v| ~ 1e-5.
    assert (output.double() - expected).abs().max().item() < 1e-5


def test_store_kv_writes_exactly_the_mapped_slots() -> None:
    backend = TorchAttentionBackend()
    kv_cache = torch.zeros(2, 3, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key = torch.randn(2, NUM_KV_HEADS, HEAD_DIM)
    value = torch.randn(2, NUM_KV_HEADS, HEAD_DIM)
    backend.store_kv(key, value, kv_cache, torch.tensor([9, 2]))

    assert torch.equal(kv_cache[0, 2, 1], key[0]) and torch.equal(kv_cache[1, 2, 1], value[0])
    assert torch.equal(kv_cache[0, 0, 2], key[1]) and torch.equal(kv_cache[1, 0, 2], value[1])
    assert torch.count_nonzero(kv_cache) == 4 * NUM_KV_HEADS * HEAD_DIM


def test_output_keeps_the_query_dtype() -> None:
    backend = TorchAttentionBackend()
    kv_cache = torch.randn(2, 2, BLOCK_SIZE, 1, HEAD_DIM).to(torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([2]),
        block_tables=torch.tensor([[1]], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32),
        query_lens_cpu=[1],
        seq_lens_cpu=[3],
        max_query_len=1,
        max_seq_len=3,
    )
    query = torch.randn(1, 2, HEAD_DIM, dtype=torch.bfloat16)
    assert backend.forward(query, kv_cache, meta, scale=1.0).dtype == torch.bfloat16


def step_meta(chunks: list[tuple[int, int]], generator: torch.Generator) -> AttentionMetadata:
    """A step's metadata for sequences of (cached tokens, new tokens), each one's blocks drawn at random."""
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    seq_lens = [cached + new for cached, new in chunks]
    tables = [[free_blocks.pop() for _ in range(-(-n // BLOCK_SIZE))] for n in seq_lens]
    slots = [t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for t, (cached, new) in zip(tables, chunks) for p in range(cached, cached + new)]
    return AttentionMetadata.from_host(slots, tables, [new for _, new in chunks], seq_lens)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_decode_matches_per_sequence_reference(group: int, seed: int) -> None:
    """The one-call decode path equals the per-sequence loop: random tables, ragged lengths, GQA."""
    generator = torch.Generator().manual_seed(seed)
    backend = TorchAttentionBackend()
    num_layers, num_seqs = 3, 9
    # Ragged contexts, including a single token and ends exactly on a block boundary.
    seq_lens = [1, BLOCK_SIZE, 2 * BLOCK_SIZE + 1] + torch.randint(1, 40, (num_seqs - 3,), generator=generator).tolist()
    meta = step_meta([(n - 1, 1) for n in seq_lens], generator)
    scale = HEAD_DIM**-0.5

    for _ in range(num_layers):  # one metadata serves every layer, each with its own cache
        kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        query = torch.randn(num_seqs, NUM_KV_HEADS * group, HEAD_DIM, generator=generator)
        batched = backend.forward(query, kv_cache, meta, scale)
        reference = backend._forward_per_sequence(query, kv_cache, meta, scale)
        assert batched.shape == query.shape
        assert (batched - reference).abs().max().item() < 1e-5  # two fp32 orders of one sum: as above
    assert len(meta.backend_cache) == 1  # gather indices and mask built once for the step


@pytest.mark.parametrize("budget_rows", [1, 24, 60])
def test_batched_decode_in_groups_matches_per_sequence_reference(monkeypatch: pytest.MonkeyPatch, budget_rows: int) -> None:
    """Under a gather budget smaller than the batch, the decodes run in groups by context length (one
    sequence a group at least) and still equal the per-sequence loop, every sequence in one group once."""
    row_bytes = 2 * NUM_KV_HEADS * HEAD_DIM * 4  # K and V, float32
    monkeypatch.setattr(torch_ref, "GATHER_BUDGET_BYTES", budget_rows * row_bytes)
    generator = torch.Generator().manual_seed(budget_rows)
    backend = TorchAttentionBackend()
    seq_lens = [9, 1, 30, BLOCK_SIZE, 17, 2 * BLOCK_SIZE + 1, 25, 3]
    meta = step_meta([(n - 1, 1) for n in seq_lens], generator)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    query = torch.randn(len(seq_lens), NUM_KV_HEADS * 2, HEAD_DIM, generator=generator)

    grouped = backend.forward(query, kv_cache, meta, HEAD_DIM**-0.5)
    reference = backend._forward_per_sequence(query, kv_cache, meta, HEAD_DIM**-0.5)
    assert (grouped - reference).abs().max().item() < 1e-5  # two fp32 orders of one sum: as above
    (groups,) = meta.backend_cache.values()
    members = [g.rows.tolist() for g in groups]
    assert sorted(seq for rows in members for seq in rows) == list(range(len(seq_lens)))
    for rows in members:  # each group within the budget, or a single sequence
        assert len(rows) == 1 or len(rows) * max(seq_lens[i] for i in rows) <= budget_rows
    assert len(groups) == {1: 8, 24: 5, 60: 3}[budget_rows]


@pytest.mark.parametrize("budget_rows", [1, 200])
def test_mixed_step_batches_its_decodes(monkeypatch: pytest.MonkeyPatch, budget_rows: int) -> None:
    """In a step with prefill chunks, the decodes (one query token) still go batched, in groups under the
    gather budget, at their own query rows, and the step equals the per-sequence loop."""
    row_bytes = 2 * NUM_KV_HEADS * HEAD_DIM * 4
    monkeypatch.setattr(torch_ref, "GATHER_BUDGET_BYTES", budget_rows * row_bytes)
    generator = torch.Generator().manual_seed(budget_rows)
    backend = TorchAttentionBackend()
    chunks = [(9, 1), (0, 7), (30, 1), (5, 6), (BLOCK_SIZE - 1, 1), (16, 1), (2, 13), (0, 1)]  # (cached, new)
    query_lens = [new for _, new in chunks]
    meta = step_meta(chunks, generator)
    kv_cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    query = torch.randn(sum(query_lens), NUM_KV_HEADS * 2, HEAD_DIM, generator=generator)

    mixed = backend.forward(query, kv_cache, meta, HEAD_DIM**-0.5)
    reference = backend._forward_per_sequence(query, kv_cache, meta, HEAD_DIM**-0.5)
    assert (mixed - reference).abs().max().item() < 1e-5  # two fp32 orders of one sum: as above
    (groups,) = meta.backend_cache.values()
    starts = meta.query_start_loc.tolist()
    decode_rows = [starts[seq] for seq, n in enumerate(query_lens) if n == 1]
    assert sorted(row for g in groups for row in g.rows.tolist()) == decode_rows
    assert len(groups) == {1: len(decode_rows), 200: 1}[budget_rows]


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert isinstance(get_attention_backend("torch", cpu), TorchAttentionBackend)
    assert isinstance(get_attention_backend("auto", cpu), TorchAttentionBackend)
    with pytest.raises(ValueError, match="attention_backend: 'triton' on cpu runs only in Triton's interpreter"):
        get_attention_backend("triton", cpu)
    with pytest.raises(ValueError, match="attention_backend.*'auto', 'torch', 'triton'"):
        get_attention_backend("flash", cpu)
