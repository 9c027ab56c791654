"""Waiting for something to become true: poll ``probe()`` until ``done(value)`` holds, or fail after a
timeout.

``wait_for`` blocks (for synchronous tests and helpers); ``until`` is the same for ``async`` tests and yields
to their event loop between polls, so that their own clients keep running. Both return the value that
satisfied ``done``; on timeout both raise ``AssertionError`` with ``message()`` if given, else the last value.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(probe: Callable[[], T], done: Callable[[T], bool], timeout: float, interval: float = 0.02,
             message: Callable[[], str] | None = None) -> T:
    """Call ``probe`` until ``done`` holds for its result; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done(value := probe()):
        _check(deadline, timeout, value, message)
        time.sleep(interval)
    return value


async def until(probe: Callable[[], T], done: Callable[[T], bool], timeout: float, interval: float = 0.02,
                message: Callable[[], str] | None = None) -> T:
    """``wait_for`` for async tests: sleeps with ``asyncio.sleep``, so the test's own tasks keep running."""
    deadline = time.monotonic() + timeout
    while not done(value := probe()):
        _check(deadline, timeout, value, message)
        await asyncio.sleep(interval)
    return value


def _check(deadline: float, timeout: float, value: object, message: Callable[[], str] | None) -> None:
    if time.monotonic() > deadline:
        raise AssertionError(f"still not done after {timeout} s: {value}" if message is None else message())
