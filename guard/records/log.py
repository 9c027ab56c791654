"""``decision_log: PATH``: each finished record as one JSON line, rotated by size.

The event loop only hands the packed record (guard/records/record.py) to a queue; a writer thread unpacks
it, turns it into JSON and writes it through the standard library's ``RotatingFileHandler`` (``MAX_BYTES``
per file, ``BACKUPS`` old files: ``decisions.jsonl.1`` ...). A record still queued when the guard stops is
written before ``close`` returns. Worker ``i`` of ``--workers N`` writes a file of its own,
``decisions.worker<i>.jsonl``: processes cannot share a rotation. Its configuration keeps the path as
written, so that a reload compares like with like.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import threading
from pathlib import Path

from guard.records.record import unpack

log = logging.getLogger("guard.records")

MAX_BYTES = 64 << 20
BACKUPS = 3


class DecisionLog:
    def __init__(self, path: str | Path, *, worker: int | None = None, max_bytes: int = MAX_BYTES,
                 backups: int = BACKUPS) -> None:
        """Opens (creates) the file now: a path that cannot be written stops the guard at start-up, with an
        ``OSError`` that names the key and the path."""
        path = Path(path)
        self.path = path if worker is None else path.with_name(f"{path.stem}.worker{worker}{path.suffix}")
        try:
            self._handler = logging.handlers.RotatingFileHandler(self.path, maxBytes=max_bytes,
                                                                 backupCount=backups, encoding="utf-8")
        except OSError as exc:
            raise OSError(exc.errno, f"decision_log {self.path}: cannot open: {exc.strerror}") from exc
        self._handler.setFormatter(logging.Formatter("%(message)s"))
        self._batch_bytes = max(1, min(max_bytes // 2, 1 << 20))
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._write, name="decision log", daemon=True)
        self._thread.start()

    def add(self, kept: bytes) -> None:
        """``kept``: ``pack`` of a record."""
        self._queue.put(kept)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._handler.close()

    def _write(self) -> None:
        """Writes what is queued in batches, one ``emit`` (one write, one flush) each: under load a batch holds
        many records. A batch is cut at half a file (at most 1 MiB), so no file outgrows ``max_bytes``."""
        queued, handler = self._queue, self._handler
        while True:
            kept, lines, size = queued.get(), [], 0
            while kept is not None:
                if (line := _line(kept)) is not None:
                    lines.append(line)
                    size += len(line) + 1  # ASCII: json.dumps escapes the rest
                if size >= self._batch_bytes or queued.empty():
                    break
                kept = queued.get_nowait()
            if lines:
                handler.emit(logging.makeLogRecord({"msg": "\n".join(lines), "levelno": logging.INFO}))
            if kept is None:
                return


def _line(kept: bytes) -> str | None:
    try:
        return json.dumps(unpack(kept).to_dict(), separators=(",", ":"))
    except Exception:  # one bad record must not end the writer: its queue would grow without bound
        log.exception("a decision record not written (%d bytes)", len(kept))
        return None
