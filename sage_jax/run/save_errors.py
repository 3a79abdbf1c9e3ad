"""Checkpoint writes that fail: one error for the caller, not a screen of orbax / event-loop tracebacks above it.

Where the noise came from (orbax 0.12, tensorstore 0.1): a save runs its writes in orbax `_SignalingThread`s, each
with its own asyncio loop. When a write fails (a full disk), every thread that sees the failure logs it through absl
with `logging.exception` (a traceback each), the first failure reaches the caller while the other threads are still
running (so they logged after the caller had moved on), and tensorstore writes still pending when a thread's loop
closed call back into the closed loop ("Event loop is closed", reported through sys.unraisablehook).
"""

from __future__ import annotations

import contextlib
import logging as pylogging
import sys
import threading
import time

log = pylogging.getLogger(__name__)

JOIN_S = 30.0  # how long a failed save waits for its other writer threads to end (each is cancelled first)


class NoTraceback(pylogging.Filter):
    """orbax's error records without their tracebacks; a writer thread's "raised an exception" record (the error the
    save raises to its caller, who reports it) is demoted to DEBUG, so it is in a DEBUG log but not on the console."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        if record.levelno >= pylogging.ERROR and "raised an exception" in str(record.msg):
            record.levelno, record.levelname = pylogging.DEBUG, "DEBUG"
        return True


def _writer_threads() -> list[threading.Thread]:
    """orbax's writer threads still running (per operation: a save waits for the previous one before it starts, so
    after a failed save or wait these are the failed operation's, an async save's included)."""
    return [t for t in threading.enumerate() if t.is_alive() and type(t).__module__.startswith("orbax.")]


def _shut_down(threads: list[threading.Thread]) -> None:
    """Cancel the failed save's other writers and wait for them, so none of them logs after the error is reported."""
    for t in threads:
        with contextlib.suppress(Exception):
            getattr(t, "cancel", lambda: None)()
    deadline = time.monotonic() + JOIN_S
    for t in threads:
        threading.Thread.join(t, max(0.0, deadline - time.monotonic()))
    left = [t.name for t in threads if t.is_alive()]
    if left:
        log.debug("checkpoint writer threads still running after a failed save: %s", left)


def _report_thread(args) -> None:
    log.debug("checkpoint thread %s: %s", args.thread, args.exc_value)


def _report_callback(unraisable) -> None:
    # tensorstore's completion callbacks into a writer's closed loop ("Event loop is closed"): the write they report
    # has already failed the save
    log.debug("checkpoint callback: %s", unraisable.exc_value)


@contextlib.contextmanager
def quiet_failures():
    """While orbax writes: its worker threads' exceptions and tracebacks are not printed (the save raises the first
    failure itself). After a failure the save's other writer threads are cancelled and joined before the error goes
    on, and the hooks stay quiet: tensorstore may still call back into the closed loops of the failed writes."""
    hooks, quiet = (threading.excepthook, sys.excepthook, sys.unraisablehook), NoTraceback()
    threading.excepthook = _report_thread
    sys.unraisablehook = _report_callback
    # a native callback may also report a Python exception through sys.excepthook (PyErr_Print)
    sys.excepthook = lambda kind, value, tb: log.debug("checkpoint callback: %s: %s", kind.__name__, value)
    loggers = [pylogging.getLogger(n) for n in ("absl", "orbax", "asyncio")]
    for lg in loggers:
        lg.addFilter(quiet)
    try:
        yield
    except BaseException:
        _shut_down(_writer_threads())
        for lg in loggers:
            lg.removeFilter(quiet)
        raise
    threading.excepthook, sys.excepthook, sys.unraisablehook = hooks
    for lg in loggers:
        lg.removeFilter(quiet)


# errno -> what the user is told
_CAUSES = {28: ("No space left on device", "no space left on device; free space there or rerun with a --workdir on a "
                "disk with room"),
           27: ("File too large", "a file exceeds the file-size limit (ulimit -f) or the file system's largest file; "
                "raise the limit (ulimit -f unlimited) or rerun with a --workdir on another file system")}


def write_failure(e: BaseException) -> str | None:
    """What went wrong and the fix, in words, if `e` is a write that failed for lack of room; else None."""
    text = str(e)
    for code, (strerror, words) in _CAUSES.items():
        if strerror in text or f"os_error_code='{code}'" in text or getattr(e, "errno", None) == code:
            return words
    return None


def disk_full(e: BaseException) -> bool:
    return write_failure(e) == _CAUSES[28][1]
