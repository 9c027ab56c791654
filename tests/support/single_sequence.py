"""Test helper: drive one sequence through a model and its paged KV cache, step by step, without the engine."""

from __future__ import annotations

import torch

from engine.kernels import AttentionMetadata
from engine.model.llama import LlamaForCausalLM


class SingleSequence:
    """One sequence's KV cache, in shuffled (non-contiguous) blocks of a small pool."""

    def __init__(
        self, model: LlamaForCausalLM, block_size: int = 4, num_blocks: int = 32, seed: int = 0
    ) -> None:
        config = model.config
        parameter = next(model.parameters())
        self.device = parameter.device
        self.model = model
        self.block_size = block_size
        self.kv_caches = [
            torch.zeros(
                2,
                num_blocks,
                block_size,
                config.num_key_value_heads,
                config.head_dim,
                dtype=parameter.dtype,
                device=parameter.device,
            )
            for _ in range(config.num_hidden_layers)
        ]
        generator = torch.Generator().manual_seed(seed)
        self.block_table = torch.randperm(num_blocks, generator=generator).to(torch.int32).to(self.device)
        self.num_cached = 0

    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Feed the next ``token_ids`` (a prefill chunk or one decode token); return their fp32 logits."""
        start, end = self.num_cached, self.num_cached + len(token_ids)
        positions = torch.arange(start, end, device=self.device)
        slots = (
            self.block_table[positions // self.block_size].long() * self.block_size
            + positions % self.block_size
        )
        meta = AttentionMetadata(
            slot_mapping=slots,
            block_tables=self.block_table[None, :],
            query_start_loc=torch.tensor([0, len(token_ids)], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=self.device),
            query_lens_cpu=[len(token_ids)],
            seq_lens_cpu=[end],
            max_query_len=len(token_ids),
            max_seq_len=end,
        )
        hidden = self.model(torch.tensor(token_ids, device=self.device), positions, self.kv_caches, meta)
        self.num_cached = end
        return self.model.compute_logits(hidden)

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        next_token = int(self.step(prompt)[-1].argmax())
        output = [next_token]
        while len(output) < max_tokens:
            next_token = int(self.step([next_token])[-1].argmax())
            output.append(next_token)
        return output
