"""Shared fixtures. Every engine here is the real engine on the built-in tiny model, on CPU."""

from __future__ import annotations

import pytest

from engine import LLM


@pytest.fixture(scope="session")
def llm() -> LLM:
    """A roomy engine shared by read-only tests (each test leaves it idle, with every block free)."""
    return LLM("tiny", device="cpu", num_blocks=512, block_size=16)
