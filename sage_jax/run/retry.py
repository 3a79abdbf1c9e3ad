"""A bucket that does not answer: bounded retries, then one error, then no more waiting (run/paths.py's remote calls
go through `call`).

gcsfs retries each request itself (6 tries, about 30 s); on top of that a remote call that fails because the store
did not answer (a refused or lost connection, DNS, a timeout, a 5xx) is retried until RETRY_S seconds
(SAGE_STORAGE_RETRY_S, 120) have passed since its first failure (FIRST_RETRY_S while the store has never answered
this process: a wrong host or a missing emulator is a setup error, not an outage). Then it raises
StorageUnreachable, whose message names the path, the cause and the resume; from then on every remote call and
`check_up` fail at once, so a run that is ending does not wait the outage out again for each file it would touch on
its way out. tensorstore (orbax's checkpoint arrays) retries by itself: run/checkpoint.py bounds its retries to about
the same time (gcs_request_retries).
"""

from __future__ import annotations

import logging as pylogging
import os
import threading
import time
from typing import Any, Callable

log = pylogging.getLogger(__name__)

PathLike = str | os.PathLike

RETRY_S = float(os.environ.get("SAGE_STORAGE_RETRY_S", "120"))  # how long a bucket may not answer before the run stops
FIRST_RETRY_S = 15.0  # ... one that never answered this process (a wrong host, no emulator): a setup error
_state = {"answered": False, "down": ""}  # a remote call has succeeded; why the store was given up (then: fail fast)
_inside = threading.local()


class _Quiet(pylogging.Filter):
    """gcsfs logs every request that ran out of its own retries as an ERROR with a traceback (a screen per request
    while a bucket does not answer), and warns per bucket when it cannot probe the bucket's type without credentials;
    `call` decides and reports, in one line: those records are dropped, the rest keep no traceback."""
    DROPPED = ("out of retries", "non-retriable", "Could not determine bucket type")

    def filter(self, record: pylogging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return not any(words in str(record.msg) for words in self.DROPPED)


pylogging.getLogger("gcsfs").addFilter(_Quiet())


class StorageUnreachable(OSError):
    """A remote workdir (a bucket) did not answer for RETRY_S seconds: the run stops (one line, cli.main_guard)."""


def _transient(e: BaseException) -> bool:
    """Whether `e` says the store did not answer (a refused or lost connection, DNS, a timeout, a 5xx), rather than
    something about the file (missing, exists, forbidden)."""
    if isinstance(e, (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError,
                      StorageUnreachable)):
        return False
    origin = type(e).__module__.split(".")[0]
    return isinstance(e, (ConnectionError, TimeoutError)) or origin in ("aiohttp", "requests", "urllib3", "gcsfs",
                                                                         "google")


def _gave_up(p: PathLike, e: BaseException, waited: float) -> str:
    cause = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    if not _state["answered"]:
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        hint = (f"is the emulator at STORAGE_EMULATOR_HOST={emulator} running?" if emulator else
                "STORAGE_EMULATOR_HOST is not set: for a local emulator's bucket, set it as when the run started")
        return f"cannot reach the storage of {p} ({cause}): check the bucket name and the network; {hint}"
    return (f"the storage of {p} did not answer for {waited:.0f} s ({cause}); the last checkpoint written is intact: "
            "check the network and the bucket, then rerun the same command to resume (SAGE_STORAGE_RETRY_S sets "
            f"how long a run waits, now {RETRY_S:.0f} s)")


def call(p: PathLike, op: Callable[[], Any]) -> Any:
    """op() on a remote path, retried while the store does not answer, for RETRY_S seconds in all (gcsfs retries
    each request too, about 30 s); then StorageUnreachable, and every later remote call fails at once (the run is
    ending: its exit must not wait out the same outage again for each file it would touch). Local paths: op()."""
    if "://" not in os.fspath(p) or getattr(_inside, "on", False):
        return op()
    if _state["down"]:
        raise StorageUnreachable(_state["down"])
    _inside.on, t0, delay = True, time.monotonic(), 1.0
    try:
        while True:
            try:
                out = op()
                _state["answered"] = True
                return out
            except Exception as e:
                if not _transient(e):
                    raise
                waited, limit = time.monotonic() - t0, RETRY_S if _state["answered"] else min(RETRY_S, FIRST_RETRY_S)
                if waited >= limit:
                    _state["down"] = _gave_up(p, e, waited)
                    raise StorageUnreachable(_state["down"]) from e
                if delay == 1.0:
                    log.warning("the storage of %s does not answer (%s); retrying for up to %.0f s", p,
                                type(e).__name__, limit - waited)
                time.sleep(min(delay, limit - waited))
                delay = min(2 * delay, 16.0)
    finally:
        _inside.on = False


def gave_up() -> str:
    """Why the store was given up ("" while it has not been)."""
    return _state["down"]


def check_up() -> None:
    """StorageUnreachable if the store was given up (before a write that does not go through `call`)."""
    if _state["down"]:
        raise StorageUnreachable(_state["down"])


def busy() -> bool:
    """Whether this thread is inside a retried remote call (a log line it writes then waits for a later upload)."""
    return bool(getattr(_inside, "on", False))


def bound_tensorstore_retries() -> None:
    """tensorstore's own GCS retries (32 by default, up to 32 s apart: about 15 minutes) cut to about RETRY_S, in
    the contexts orbax opens its checkpoint arrays with (orbax 0.12's module defaults; nothing if they moved)."""
    try:
        from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
        contexts = (ts_utils._BASE_TS_CONTEXT, ts_utils._DEFAULT_OCDBT_TS_CONTEXT)
    except (ImportError, AttributeError):
        return
    tries, total, delay = 0, 0.0, 1.0
    while total < RETRY_S:
        tries, total, delay = tries + 1, total + delay, min(2 * delay, 32.0)
    for context in contexts:
        context.setdefault("gcs_request_retries", {"max_retries": tries, "initial_delay": "1s", "max_delay": "32s"})
