"""``RequestStream``: a streaming reader gets the newest output at each wake-up; a reader of ``final`` only is
woken once, by the final output (or the error), however many steps pushed an output before it."""

from __future__ import annotations

import asyncio

import pytest

from engine.outputs import CompletionOutput, RequestOutput
from engine.request_stream import RequestFailed, RequestStream


def output(tokens: int, finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, "x" * tokens, list(range(tokens)), "length" if finished else None)
    return RequestOutput("r", None, [1], [completion], 0, finished)


async def test_final_wakes_its_reader_once_and_a_streaming_reader_every_push() -> None:
    final_only = RequestStream("r")
    final_only.push(output(1))  # before the reader came: kept, and taken as it starts
    waiting = asyncio.create_task(final_only.final())
    await asyncio.sleep(0)
    for tokens in range(2, 50):
        final_only.push(output(tokens))
        assert not final_only._wake.is_set(), "an output that is not the last woke a reader of final()"
        await asyncio.sleep(0)
    final_only.push(output(50, finished=True))
    last = await asyncio.wait_for(waiting, 1)
    assert last.finished and last.outputs[0].num_tokens == 50 and final_only.done

    streaming, seen = RequestStream("s"), []

    async def read() -> None:
        async for out in streaming:
            seen.append(out.outputs[0].num_tokens)

    reader = asyncio.create_task(read())
    for tokens in range(1, 4):
        await asyncio.sleep(0)
        streaming.push(output(tokens, finished=tokens == 3))
        await asyncio.sleep(0)
    await asyncio.wait_for(reader, 1)
    assert seen == [1, 2, 3]


async def test_an_error_wakes_a_reader_of_final() -> None:
    stream = RequestStream("r")
    waiting = asyncio.create_task(stream.final())
    await asyncio.sleep(0)
    stream.push(output(3))
    stream.fail(RequestFailed("the step failed"))
    with pytest.raises(RequestFailed, match="the step failed"):
        await asyncio.wait_for(waiting, 1)
