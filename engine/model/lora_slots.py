"""Adapters resident on the device, and the batched LoRA delta of one step.

``max_loras`` slots hold adapters' A and B, zero-padded to ``max_rank``, stacked per layer and projection::

    a[module][layer]: [slots, max_rank, in]      b[module][layer]: [slots, max_rank, out]   (B transposed)

A slot is filled when a step needs an adapter that is not resident, evicting the least recently used one
that this step does not need (the scheduler admits at most ``max_loras`` adapters among running sequences,
so one is always free). Zero padding makes a smaller rank, or a projection an adapter leaves alone, add
exactly nothing.

The delta of one step (torch path, a segmented matmul over the step's active slots)::

    y     = x @ A_active^T            [T, k * max_rank]     one GEMM for every adapter of the step
    y    *= mask                      mask[t, j*R:(j+1)*R] = scaling of token t's adapter if it is slot j, else 0
    out  += y @ B_active              [T, out]

so each token gets its own adapter's ``scaling * B (A x)`` and a base token gets exact zeros (its output is
bit for bit the base model's). The mask is built once per step and shared by every layer. On CUDA the
Triton kernel (engine/kernels/triton_lora.py) gathers each token's slot instead (BGMV), and the two are
tested against each other.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.model.config import ModelConfig
from engine.model.lora import LoraAdapter, projection_shapes


@dataclass(slots=True)
class LoraStep:
    """One step's adapter layout, shared by every projection of the forward."""

    active: torch.Tensor | None  # slots the step uses, in mask order; None: every slot, in order
    mask: torch.Tensor  # [T, k * max_rank]: the token's scaling on its slot's columns, 0 elsewhere
    token_slots: torch.Tensor  # [T] int32: each token's slot, -1 for the base model (the Triton path)
    scales: torch.Tensor  # [slots] float32: each slot's scaling (the Triton path)


class LoraSlots:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.max_loras, self.max_rank, self.device, self.dtype = max_loras, max_rank, device, dtype
        layers = config.num_hidden_layers
        shapes = projection_shapes(config)
        self.a = {m: torch.zeros(layers, max_loras, max_rank, fan_in, device=device, dtype=dtype)
                  for m, (fan_in, _) in shapes.items()}
        self.b = {m: torch.zeros(layers, max_loras, max_rank, fan_out, device=device, dtype=dtype)
                  for m, (_, fan_out) in shapes.items()}
        self.scales = [0.0] * max_loras
        self.resident: OrderedDict[LoraAdapter, int] = OrderedDict()  # least recently used first
        self.step: LoraStep | None = None  # set by ``prepare`` for the forward that follows

    def names(self) -> list[str]:
        return sorted(adapter.name for adapter in self.resident)

    def prepare(self, adapters: list[LoraAdapter | None], query_lens: list[int]) -> bool:
        """Lay out the next forward: ``adapters[i]`` serves the ``query_lens[i]`` tokens of chunk ``i``.
        Returns whether any token uses an adapter (a step without one skips LoRA entirely)."""
        used = list(dict.fromkeys(a for a in adapters if a is not None))
        if not used:
            self.step = None
            return False
        slots = [self._slot(adapter, used) for adapter in used]
        position = {adapter: j for j, adapter in enumerate(used)}
        index = torch.tensor([position[a] if a is not None else -1 for a in adapters]).repeat_interleave(
            torch.tensor(query_lens))
        scales = torch.tensor([self.scales[s] for s in slots], dtype=torch.float32)
        mask = (index[:, None] == torch.arange(len(used))) * scales
        mask = mask.repeat_interleave(self.max_rank, dim=1).to(device=self.device, dtype=self.dtype)
        token_slots = torch.tensor(slots + [-1], dtype=torch.int32)[index].to(self.device)
        active = None if slots == list(range(self.max_loras)) else torch.tensor(slots, device=self.device)
        self.step = LoraStep(active, mask, token_slots, torch.tensor(self.scales, device=self.device))
        return True

    def site(self, layer: int) -> LoraSite:
        return LoraSite(self, layer)

    def _slot(self, adapter: LoraAdapter, keep: list[LoraAdapter]) -> int:
        """``adapter``'s slot, filling one (evicting the least recently used adapter not in ``keep``)."""
        slot = self.resident.get(adapter)
        if slot is not None:
            self.resident.move_to_end(adapter)
            return slot
        if len(self.resident) < self.max_loras:
            slot = len(self.resident)
        else:
            victim = next(a for a in self.resident if a not in keep)  # the scheduler leaves one (module doc)
            slot = self.resident.pop(victim)
        self._fill(slot, adapter)
        self.resident[adapter] = slot
        return slot

    def _fill(self, slot: int, adapter: LoraAdapter) -> None:
        for stacks in (self.a, self.b):
            for stack in stacks.values():
                stack[:, slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():
            self.a[module][layer, slot, : adapter.rank] = a.to(self.dtype)
            self.b[module][layer, slot, : adapter.rank] = b.t().to(self.dtype)
        self.scales[slot] = adapter.scaling


class LoraSite:
    """The LoRA delta of one decoder layer's projections: ``site(module, x, out)`` returns ``out`` plus each
    token's adapter delta for ``module``, or ``out`` itself when the step has no adapter."""

    __slots__ = ("layer", "slots")

    def __init__(self, slots: LoraSlots, layer: int) -> None:
        self.slots, self.layer = slots, layer

    def __call__(self, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        step = self.slots.step
        if step is None:
            return out
        a, b = self.slots.a[module][self.layer], self.slots.b[module][self.layer]
        if x.is_cuda:
            from engine.kernels.triton_lora import lora_bgmv  # triton is imported only on the GPU path

            return lora_bgmv(x, out, a, b, step.token_slots, step.scales)
        return lora_segmented(x, out, a, b, step.active, step.mask)


def lora_segmented(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   active: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """``out + delta`` for ``x [T, in]``, ``a [slots, R, in]``, ``b [slots, R, out]`` (see the module)."""
    if active is not None:
        a, b = a.index_select(0, active), b.index_select(0, active)
    y = torch.mm(x, a.reshape(-1, a.shape[-1]).t()) * mask
    return torch.addmm(out, y, b.reshape(-1, b.shape[-1]))


class _NoLora:
    """The site of a model without adapters: the projection's output as it is."""

    __slots__ = ()

    def __call__(self, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out


NO_LORA = _NoLora()


def attach(model: torch.nn.Module, slots: LoraSlots) -> None:
    """Give every decoder layer of ``model`` (engine/model/llama.py) its site on ``slots``."""
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.lora = layer.mlp.lora = slots.site(index)
