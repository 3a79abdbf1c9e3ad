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


def _after_failure(thread_hook, unraisable_hook):
    """The hooks left in place after a failed save: tensorstore may still call back into the closed loops of the
    failed writes, and orbax's cancelled writer threads may still end with an error; those stay quiet (DEBUG), and
    everything else goes to the hooks that were there before, so no other error is swallowed."""
    def thread(args) -> None:
        if type(args.thread).__module__.startswith("orbax."):
            _report_thread(args)
        else:
            thread_hook(args)

    def unraisable(u) -> None:
        if isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value):
            _report_callback(u)
        else:
            unraisable_hook(u)
    return thread, unraisable


@contextlib.contextmanager
def quiet_failures():
    """While orbax writes: its worker threads' exceptions and tracebacks are not printed (the save raises the first
    failure itself). After a failure the save's other writer threads are cancelled and joined before the error goes
    on; sys.excepthook is always restored (a left-over quiet one swallowed the very error the save raised, and the
    run exited 1 without a word), and the thread and unraisable hooks stay quiet only for the failed writes' late
    reports (_after_failure)."""
    hooks, quiet = (threading.excepthook, sys.excepthook, sys.unraisablehook), NoTraceback()
    threading.excepthook = _report_thread
    sys.unraisablehook = _report_callback
    # a native callback may also report a Python exception through sys.excepthook (PyErr_Print)
    sys.excepthook = lambda kind, value, tb: log.debug("checkpoint callback: %s: %s", kind.__name__, value)
    loggers = [pylogging.getLogger(n) for n in ("absl", "orbax", "asyncio")]
    for lg in loggers:
        lg.addFilter(quiet)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        _shut_down(_writer_threads())
        raise
    finally:
        threading.excepthook, sys.excepthook, sys.unraisablehook = hooks
        if failed:
            threading.excepthook, sys.unraisablehook = _after_failure(hooks[0], hooks[2])
        for lg in loggers:
            lg.removeFilter(quiet)


# errno -> (the error's words, what the user is told)
_CAUSES = {28: ("No space left on device", "no space left on device; free space there or rerun with a --workdir on a "
                "disk with room"),
           27: ("File too large", "a file exceeds the file-size limit (ulimit -f) or the file system's largest file; "
                "raise the limit (ulimit -f unlimited) or rerun with a --workdir on another file system"),
           13: ("Permission denied", "permission denied; make the folder writable for this user or rerun with "
                "another --workdir"),
           30: ("Read-only file system", "the file system is read-only; remount it writable or rerun with a "
                "--workdir on a writable disk"),
           122: ("Disk quota exceeded", "the disk quota is exceeded; free space within the quota or rerun with a "
                 "--workdir on another disk"),
           5: ("Input/output error", "an I/O error on the disk; check the disk (dmesg) or rerun with a --workdir on "
               "another one")}


def write_failure(e: BaseException) -> str | None:
    """What went wrong and the fix, in words, if `e` is a write that failed for lack of room or permission, or on
    a read-only or failing disk; else None."""
    text = str(e)
    for code, (strerror, words) in _CAUSES.items():
        if strerror in text or f"os_error_code='{code}'" in text or getattr(e, "errno", None) == code:
            return words
    return None


def disk_full(e: BaseException) -> bool:
    return write_failure(e) == _CAUSES[28][1]
