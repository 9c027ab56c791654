"""``decision_log: PATH``: each finished record as one JSON line, rotated by size.

The event loop only hands the record to a queue; a writer thread turns it into JSON and writes it through
the standard library's ``RotatingFileHandler`` (``MAX_BYTES`` per file, ``BACKUPS`` old files:
``decisions.jsonl.1`` ...). A record still queued when the guard stops is written before ``close`` returns.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import threading
from pathlib import Path

from guard.records.record import DecisionRecord

MAX_BYTES = 64 << 20
BACKUPS = 3


class DecisionLog:
    def __init__(self, path: str | Path, max_bytes: int = MAX_BYTES, backups: int = BACKUPS) -> None:
        """Opens (creates) the file now: a path that cannot be written stops the guard at start-up."""
        self.path = Path(path)
        self._handler = logging.handlers.RotatingFileHandler(self.path, maxBytes=max_bytes, backupCount=backups,
                                                             encoding="utf-8")
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._queue: queue.SimpleQueue[DecisionRecord | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="decision log", daemon=True)
        self._thread.start()

    def add(self, record: DecisionRecord) -> None:
        self._queue.put(record)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._handler.close()

    def _write(self) -> None:
        while (record := self._queue.get()) is not None:
            line = json.dumps(record.to_dict(), separators=(",", ":"))
            self._handler.emit(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))
