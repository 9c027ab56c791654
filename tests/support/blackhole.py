"""A TCP relay in front of a real engine whose network can be black-holed: connections accepted, nothing answered.

``BlackHole(target_port)`` listens on a free loopback port and relays every connection to the target, byte
for byte, until ``swallow()``: from then on it still accepts and reads both sides (so the engine's writes
never block and its requests run to their end, as they would into a dead network), but delivers nothing in
either direction, and it never closes a connection itself. That is the fault a real engine cannot produce on
its own: the guard sees neither an error nor an answer, only silence, and must rely on its own deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib

from .loop_thread import LoopThread


class BlackHole(LoopThread):
    def __init__(self, target_port: int) -> None:
        super().__init__("blackhole-loop")
        self.target_port = target_port
        self.port = 0
        self.url = ""
        self.swallowing = False
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()

    def swallow(self) -> None:
        """From now on nothing is delivered, either way, on any connection, old or new."""
        self.call(lambda: setattr(self, "swallowing", True))

    async def started(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    async def stopping(self) -> None:
        assert self._server is not None
        self._server.close()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _relay(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        try:
            engine_in, engine_out = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_out.close()
            return
        pipes = [asyncio.ensure_future(self._pipe(client_in, engine_out)),
                 asyncio.ensure_future(self._pipe(engine_in, client_out))]
        self._pipes.update(pipes)
        try:  # one side closed: so does the other (unless swallowing: then neither pipe ever ends)
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pipe in pipes:
                pipe.cancel()
            self._pipes.difference_update(pipes)
            for writer in (client_out, engine_out):
                writer.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy until EOF; while swallowing, read and drop (a black hole never closes: it waits forever)."""
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if not self.swallowing:
                    writer.write(data)
                    await writer.drain()
            while self.swallowing:
                await asyncio.sleep(3600)
