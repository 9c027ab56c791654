"""``decision_log: PATH``: each finished record as one JSON line, rotated by size.

The event loop only hands the record to a queue; a writer thread turns it into JSON and writes it through
the standard library's ``RotatingFileHandler`` (``MAX_BYTES`` per file, ``BACKUPS`` old files:
``decisions.jsonl.1`` ...). A record still queued when the guard stops is written before ``close`` returns.
Worker ``i`` of ``--workers N`` writes a file of its own, ``decisions.worker<i>.jsonl``: processes cannot
share a rotation. Its configuration keeps the path as written, so that a reload compares like with like.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import threading
from pathlib import Path

from guard.records.record import DecisionRecord

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
        """Writes what is queued in batches, one ``emit`` (one write, one flush) each: under load a batch holds
        many records. A batch is cut at half a file (at most 1 MiB), so no file outgrows ``max_bytes``."""
        records, handler = self._queue, self._handler
        while True:
            record, lines, size = records.get(), [], 0
            while record is not None:
                if (line := _line(record)) is not None:
                    lines.append(line)
                    size += len(line) + 1  # ASCII: json.dumps escapes the rest
                if size >= self._batch_bytes or records.empty():
                    break
                record = records.get_nowait()
            if lines:
                handler.emit(logging.makeLogRecord({"msg": "\n".join(lines), "levelno": logging.INFO}))
            if record is None:
                return


def _line(record: DecisionRecord) -> str | None:
    try:
        return json.dumps(record.to_dict(), separators=(",", ":"))
    except Exception:  # one bad record must not end the writer: its queue would grow without bound
        log.exception("decision record %s not written", record.request_id)
        return None
