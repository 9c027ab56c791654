"""GPU memory a step needs beyond the weights and the KV pool, measured by running the worst steps once.

The KV pool gets whatever ``gpu_memory_utilization`` leaves after the weights and this figure, so it must
not be a guess: too low and the first full prefill runs out of memory, too high and blocks are wasted. Two
warm-up forwards on a scratch cache of just the blocks they need, before the pool exists:

- the largest eager step: ``max_num_batched_tokens`` prefill tokens, then logits and sampling (temperature
  and top-p, the most memory-hungry path) for ``max_num_seqs`` rows;
- the largest decode batch captured in a CUDA graph, with the LM head and the greedy draw of the graph that
  draws (engine/worker/cuda_graphs.py): graphs keep their own memory pool, which the regular allocator
  cannot reuse, so its peak is counted on top.

Both also compile the Triton kernels for these shapes before the first request arrives.
"""

from __future__ import annotations

import torch

from engine.kernels import AttentionMetadata
from engine.model.llama import LlamaForCausalLM
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graphs import MAX_CAPTURED_BATCH, greedy_draw
from engine.worker.sampler import sample


@torch.inference_mode()
def activation_bytes(
    model: LlamaForCausalLM,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    device: torch.device,
) -> int:
    """Peak bytes of the largest eager step, plus the decode CUDA-graph pool when graphs are used."""
    prefill_tokens = min(max_num_batched_tokens, max_model_len - 1)
    total = _step_peak(model, [prefill_tokens], max_num_seqs, block_size, device)
    if model.attn_backend.supports_cuda_graphs:
        total += _step_peak(model, [1] * min(max_num_seqs, MAX_CAPTURED_BATCH), 0, block_size, device, graph=True)
    torch.cuda.empty_cache()  # hand the warm-up's cached blocks back, so that free memory is true again
    return total


def _step_peak(
    model: LlamaForCausalLM, query_lens: list[int], sampled_rows: int, block_size: int, device: torch.device,
    graph: bool = False,
) -> int:
    """Peak allocation of a step of fresh sequences of ``query_lens`` tokens, beyond its scratch cache (with
    ``graph``, as a decode graph holds it)."""
    input_ids, positions, kv_caches, meta = scratch_step(model, query_lens, block_size, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    hidden = model(input_ids, positions, kv_caches, meta)
    if graph:  # the drawing graph's intermediates: the LM head's logits and their argmax
        greedy_draw(model, hidden)
    if sampled_rows:
        rows = torch.zeros(sampled_rows, dtype=torch.int64, device=device)  # any row: only the shape matters
        params = SamplingParams(temperature=1.0, top_p=0.9)
        sample(model.compute_logits(hidden[rows]), [params] * sampled_rows, [None] * sampled_rows)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - baseline


def scratch_step(
    model: LlamaForCausalLM, query_lens: list[int], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata]:
    """Model inputs for fresh sequences of ``query_lens`` tokens, on a cache of exactly the blocks they fill.

    Sequence ``i`` owns the consecutive blocks after those of sequences ``0 .. i-1``.
    """
    config = model.config
    dtype = model.model.embed_tokens.weight.dtype
    blocks = [-(-n // block_size) for n in query_lens]
    kv_caches = [
        torch.zeros(
            (2, sum(blocks), block_size, config.num_key_value_heads, config.head_dim),
            dtype=dtype,
            device=device,
        )
        for _ in range(config.num_hidden_layers)
    ]
    first_block = torch.tensor([0, *blocks[:-1]], device=device).cumsum(0)
    tables = first_block[:, None] + torch.arange(max(blocks), device=device)[None, :]
    positions = torch.cat([torch.arange(n, device=device) for n in query_lens])
    owners = torch.repeat_interleave(
        torch.arange(len(query_lens), device=device), torch.tensor(query_lens, device=device)
    )
    lens = torch.tensor(query_lens, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=first_block[owners] * block_size + positions,
        block_tables=tables.to(torch.int32),
        query_start_loc=torch.cat([lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)]),
        seq_lens=lens,
        query_lens_cpu=query_lens,
        seq_lens_cpu=query_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(query_lens),
    )
    input_ids = torch.zeros(len(positions), dtype=torch.int64, device=device)
    return input_ids, positions, kv_caches, meta
