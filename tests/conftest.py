"""Shared fixtures. Every engine here is the real engine on the built-in tiny model, on CPU. The helpers
every test shares live in ``tests/support/`` (see its ``__init__``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.processes import Processes
from support.redis_server import RedisServer

from engine import LLM

# Without a GPU, Triton kernels can only run in Triton's interpreter, and whether they do is fixed when
# triton (whose own library is @triton.jit code) is first imported: switch it on before any test can.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def llm() -> LLM:
    """A roomy engine shared by read-only tests (each test leaves it idle, with every block free)."""
    return LLM("tiny", device="cpu", num_blocks=512, block_size=16)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    """The process factory for one test: engines, guards and other servers as real processes, each logging
    to ``tmp_path / "<name>.log"``, all stopped (SIGTERM, then SIGKILL) when the test ends."""
    with Processes(tmp_path) as running:
        yield running


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real Redis for one test module (the admission tests run every case on it and on local state); a
    module that needs a fresh one per test defines its own ``redis``."""
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server
