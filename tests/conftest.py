"""Shared fixtures. Every engine here is the real engine on the built-in tiny model, on CPU."""

from __future__ import annotations

import os

import pytest
import torch

from engine import LLM

# Without a GPU, Triton kernels can only run in Triton's interpreter, and whether they do is fixed when
# triton (whose own library is @triton.jit code) is first imported: switch it on before any test can.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def llm() -> LLM:
    """A roomy engine shared by read-only tests (each test leaves it idle, with every block free)."""
    return LLM("tiny", device="cpu", num_blocks=512, block_size=16)
