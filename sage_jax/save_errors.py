"""Checkpoint writes that fail: one error for the caller, not a screen of orbax / event-loop tracebacks above it."""

from __future__ import annotations

import contextlib
import logging as pylogging
import sys
import threading

log = pylogging.getLogger(__name__)


class NoTraceback(pylogging.Filter):
    """Keep orbax's error records to their one line: the exception reaches the caller, which reports it."""

    def filter(self, record: pylogging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


@contextlib.contextmanager
def quiet_failures():
    """While orbax writes: its worker threads' exceptions (and the 'Event loop is closed' ones of threads outliving
    their loop after a failed write) are not printed as tracebacks; the save raises the first failure itself."""
    hooks, quiet = (threading.excepthook, sys.excepthook, sys.unraisablehook), NoTraceback()
    threading.excepthook = lambda args: log.debug("checkpoint thread %s: %s", args.thread, args.exc_value)
    # tensorstore's C++ callbacks report a Python exception through sys.excepthook (PyErr_Print)
    sys.excepthook = lambda kind, value, tb: log.debug("checkpoint callback: %s: %s", kind.__name__, value)
    sys.unraisablehook = lambda u: log.debug("checkpoint callback: %s", u.exc_value)
    loggers = [pylogging.getLogger(n) for n in ("absl", "orbax")]
    for lg in loggers:
        lg.addFilter(quiet)
    try:
        yield
    except BaseException:
        # a failed write's threads go on calling back for a while after the error reached the caller: stay quiet
        # (the run is about to report it and exit), only the logging filters go
        for lg in loggers:
            lg.removeFilter(quiet)
        raise
    threading.excepthook, sys.excepthook, sys.unraisablehook = hooks
    for lg in loggers:
        lg.removeFilter(quiet)


def disk_full(e: BaseException) -> bool:
    text = str(e)
    return "No space left on device" in text or "os_error_code='28'" in text or getattr(e, "errno", None) == 28
