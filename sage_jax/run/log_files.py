"""The run's log.txt, as run/metrics_log.setup_python_logging writes it: on a bucket (BucketLog), and no more lines
once the run lost its workdir's lease (Fenced)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging as pylogging
import threading
import time

from sage_jax.run import paths, retry


class BucketLog(pylogging.Handler):
    """log.txt on a bucket: lines are held and appended (paths.append_text) at most every FLUSH_S seconds, at once
    for a warning or an error, and at close (logging.shutdown); a kill loses at most the last FLUSH_S seconds.

    No lock is held while a record is handled: an upload waits on gcsfs's event-loop thread, which logs too, and a
    record that arrives during an upload (from any thread) only joins the lines the next one takes."""
    FLUSH_S = 10.0

    def __init__(self, path: str):
        super().__init__()
        self.path, self._lines, self._last = path, collections.deque(), time.monotonic()
        self._upload, self._failed = threading.Lock(), -float("inf")  # the last failed upload's time

    def handle(self, record: pylogging.LogRecord) -> bool:
        if self.filter(record):
            self.emit(record)
            return True
        return False

    def emit(self, record: pylogging.LogRecord) -> None:
        try:
            self._lines.append(self.format(record) + "\n")
            if record.exc_info:
                self._write(wait=30)  # a failure's traceback: before the process ends
                return
            if retry.busy() or _in_event_loop() or time.monotonic() - self._failed < self.FLUSH_S:
                return  # the bucket does not answer now, or this is gcsfs's own loop: the lines wait
            if record.levelno >= pylogging.WARNING or time.monotonic() - self._last >= self.FLUSH_S:
                self._write(wait=0)
        except OSError:  # the bucket did not take them (they are kept); the run reports the outage itself
            self._failed = time.monotonic()
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)

    def _write(self, wait: float) -> None:
        got = self._upload.acquire(timeout=wait) if wait else self._upload.acquire(blocking=False)
        if not got:
            return  # another upload is under way (maybe this thread's own: a record it logged)
        try:
            self._last, lines = time.monotonic(), []
            while self._lines:
                lines.append(self._lines.popleft())
            if lines:
                try:
                    paths.append_text(self.path, "".join(lines))
                except Exception:
                    self._lines.extendleft(reversed(lines))  # kept for the next upload
                    raise
        finally:
            self._upload.release()

    def flush(self) -> None:
        """Called by cli.main_guard before the process ends: at interpreter exit gcsfs's session is closed."""
        with contextlib.suppress(Exception):  # logging.shutdown at exit must not raise
            self._write(wait=30)

    def close(self) -> None:
        self.flush()
        super().close()


def _in_event_loop() -> bool:
    """Whether this thread runs an event loop (gcsfs's I/O thread logs too): an upload from it would wait on itself."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Fenced(pylogging.Filter):
    """log.txt takes no more lines once this run lost its workdir's lease (run/lease.py): it is another run's then."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        try:
            paths.fence("log.txt", renew=False)  # any leases this process holds
        except Exception:  # noqa: BLE001 - LeaseLost
            return False
        return True
