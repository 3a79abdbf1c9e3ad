"""Shared flag parsing and error reporting for the `python -m sage_jax.*` entry points."""

from __future__ import annotations

import argparse
import contextlib
import logging as pylogging
import os
import sys
import threading
import traceback
from typing import Any, Callable, Sequence


def _cpu_unless_an_accelerator() -> None:
    """libtpu (the memory plan's optional extra) makes every jax import try to start a TPU and print warnings; on a
    machine with no TPU device files and no CUDA plugin the entry points run on the CPU quietly. A JAX_PLATFORMS the
    user set wins."""
    import glob
    import importlib.util
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None:
        return
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return
    if any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
        return
    os.environ["JAX_PLATFORMS"] = "cpu"


_cpu_unless_an_accelerator()  # before anything imports jax

# Errors a user can act on: print one line, no traceback (set SAGE_DEBUG=1 to see it).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, KeyError)


def parse(argv: Sequence[str] | None, description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    """--config path.py[:arg] --workdir DIR [--config.key=value ...] -> (config, args)."""
    from sage_jax.run import config as config_lib
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides, rest = config_lib.split_config_flags(argv)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", required=True, help="configs/NAME.py[:arg]")
    parser.add_argument("--workdir", required=True, help="checkpoints, logs and results go here (resumes if present)")
    if extra:
        extra(parser)
    args = parser.parse_args(rest)
    from sage_jax.run import paths  # a local folder or a gs:// bucket alike
    if paths.isfile(args.workdir):
        raise config_lib.ConfigError(f"--workdir {args.workdir!r} is a file, not a directory: pass a directory path "
                                     "(it is created if missing)")
    return config_lib.validate(config_lib.load(args.config, overrides)), args


def main_guard(fn: Callable[[], int | None]) -> None:
    """Run an entry point; every failure ends it with one line naming what failed and what to do, and a non-zero
    exit: a user error (bad config, flags, data, a busy workdir, a checkpoint that cannot be read or written) exits
    2, a run that lost its workdir's lease (run/lease.py) 2, anything else 1. The traceback goes to the run's
    log.txt when there is one (SAGE_DEBUG=1 prints it too). A SIGTERM ends it like a Ctrl-C (exit 143 instead of
    130); inside a training loop both stop at the next step boundary after a checkpoint (run_guard.StepStop)."""
    from sage_jax.run import config as config_lib
    from sage_jax.run import guard as run_guard
    from sage_jax.run.checkpoint import CheckpointError
    from sage_jax.run.metrics_log import NonFiniteLossError
    run_guard.raise_on_sigterm()
    as_main = getattr(fn, "__module__", None) == "__main__"  # a `python -m` run, not a caller in this process
    if as_main:
        threading.excepthook = _thread_failed
    try:
        sys.exit(fn() or 0)
    except run_guard.Stopped as e:
        print(e.message, file=sys.stderr)
        if as_main:
            _exit_now(e.code)
        raise
    except KeyboardInterrupt as e:
        code = 143 if isinstance(e, run_guard.Terminated) else 130
        what = "terminated (SIGTERM)" if code == 143 else "interrupted"
        print(f"\n{what}: rerun the same command to resume from the last checkpoint", file=sys.stderr)
        if as_main:
            _exit_now(code)
        sys.exit(code)
    except (config_lib.ConfigError, NonFiniteLossError, CheckpointError, run_guard.LeaseLost, *USER_ERRORS) as e:
        _fail(e, f"error: {e}", 2, as_main)
    except OSError as e:
        from sage_jax.run import retry
        unreachable = isinstance(e, retry.StorageUnreachable)  # its line says it all; log.txt may be in that bucket
        _fail(e, f"error: {e if unreachable else failure_line(e)}", 1, as_main, hint=not unreachable)
    except Exception as e:  # noqa: BLE001 - the last resort: one line, the traceback in the log, never silence
        _fail(e, f"error: {failure_line(e)}", 1, as_main)
    finally:
        run_guard.release_all()
        for handler in pylogging.getLogger().handlers:  # log.txt on a bucket: before gcsfs closes at exit
            handler.flush()


def failure_line(e: BaseException) -> str:
    """An unexpected error in words: what failed and what to do (the traceback is kept elsewhere: _fail)."""
    text = (str(e).strip().splitlines() or [""])[0][:300]
    if isinstance(e, OSError):
        name = getattr(e, "filename", None)
        where = f" ({name})" if name else ""
        if paths_unreachable(e):
            return (f"storage unreachable{where}: {type(e).__name__}: {text}; check the network and the bucket (for "
                    "an emulator, that STORAGE_EMULATOR_HOST is set and it runs), then rerun to resume from the last "
                    "checkpoint")
        return (f"{e.strerror or text}{where}: check that the path exists, is reachable and writable and that its "
                "disk has room, then rerun (a training run resumes from its last checkpoint)")
    return (f"{type(e).__name__}: {text}: this is a bug or an unexpected state, not a bad input; a training run "
            "resumes from its last checkpoint when rerun")


def paths_unreachable(e: BaseException) -> bool:
    """Whether `e` says the storage behind a path did not answer (DNS, refused connection, timeouts)."""
    words = ("Cannot connect to host", "Name or service not known", "Temporary failure in name resolution",
             "Connection refused", "timed out", "unreachable")
    return any(w in str(e) for w in words) or type(e).__module__.startswith(("aiohttp", "requests", "google"))


def _fail(e: BaseException, line: str, code: int, as_main: bool, hint: bool = True) -> None:
    """Print the one line, keep the traceback in the run's log.txt (and on stderr with SAGE_DEBUG=1), exit."""
    if os.environ.get("SAGE_DEBUG"):
        traceback.print_exc()
    logs = _log_traceback(e)
    if code == 1 and hint and not os.environ.get("SAGE_DEBUG"):
        line += f" (traceback in {', '.join(logs)})" if logs else " (rerun with SAGE_DEBUG=1 to see the traceback)"
    print(line, file=sys.stderr)
    _leave_together()
    if as_main:  # orbax / tensorstore threads still running would print tracebacks at interpreter shutdown
        _exit_now(code)
    sys.exit(code)


def _thread_failed(args) -> None:
    """A background thread's error (e.g. TensorBoard's writer when its bucket does not answer): one line on stderr,
    the traceback in the run's log.txt, instead of a screen of traceback."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logs = _log_traceback(args.exc_value, f"background thread {name} failed")
    text = (str(args.exc_value).strip().splitlines() or [""])[0][:300]
    print(f"warning: background thread {name} failed: {args.exc_type.__name__}: {text}"
          + (f" (traceback in {', '.join(logs)})" if logs else ""), file=sys.stderr)


def _log_traceback(e: BaseException, what: str = "the run failed") -> list[str]:
    """The error and its traceback into the run's log files only (not the console); their paths."""
    logger = pylogging.getLogger("sage_jax")
    record = logger.makeRecord(logger.name, pylogging.ERROR, __file__, 0, "%s: %s: %s", (what, type(e).__name__, e),
                               (type(e), e, e.__traceback__))
    written = []
    for handler in pylogging.getLogger().handlers:
        # log.txt (run/metrics_log.py's handlers: a local file, or lines appended to an object in a bucket)
        path = getattr(handler, "_sage_jax", False) and (getattr(handler, "path", None) or
                                                          getattr(handler, "baseFilename", None))
        with contextlib.suppress(Exception):  # the one line on stderr goes out whatever happens here
            if path and handler.handle(record):  # False: filtered (a run that lost its lease writes no more)
                handler.flush()
                written.append(path)
    return written


def _leave_together() -> None:
    """On several processes a user error (a config or mesh check: the same on every process) ends them together:
    process 0 hosts the coordination service, and once it is gone a process still running aborts with the
    runtime's stack trace instead of its one-line error. Shutting the distributed runtime down waits for every
    process (at most its shutdown timeout, should only some of them have failed)."""
    if "jax" not in sys.modules:
        return
    try:
        from jax._src.distributed import global_state  # no public "is it initialized?" in this JAX
        if global_state.client is None:
            return
        import jax
        jax.distributed.shutdown()
    except Exception:  # noqa: BLE001 - leaving anyway; the error line is already printed
        pass


def _exit_now(code: int) -> None:
    """Exit without interpreter shutdown: after an interrupt, JAX, orbax and tensorstore threads may still be mid-call,
    and finalising modules under them can crash the process (SIGSEGV). Saved checkpoints are complete or ignored."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    pylogging.shutdown()
    from sage_jax.run import guard as run_guard
    run_guard.release_all()  # os._exit skips the `finally` that would
    os._exit(code)


def setup_runtime(workdir: str, check: Callable[[], Any] | None = None) -> Any:
    """Distributed runtime, the workdir and its lock (held until the process ends: one run per workdir), then
    `check` (what can be checked before the run writes or loads anything: a refused run leaves no line in the
    workdir's log), then logging to WORKDIR/log.txt; returns what `check` returned."""
    from sage_jax.models import sharding
    from sage_jax.run import guard as run_guard
    from sage_jax.run import metrics_log as slog
    from sage_jax.run import paths
    sharding.initialize_distributed()
    bucket = paths.missing_bucket(workdir)
    if bucket:
        case = " (bucket names are lower case)" if bucket != bucket.lower() else ""
        raise ValueError(f"--workdir {workdir}: the bucket gs://{bucket} does not exist{case}: create it (gcloud "
                         "storage buckets create; on an emulator, its POST .../storage/v1/b, see the README) or pass "
                         "another --workdir")
    try:
        paths.makedirs(workdir)
        run_guard.acquire(workdir)
    except paths.StorageUnreachable:
        raise
    except OSError as e:  # a read-only or full disk, a folder that cannot be made
        raise ValueError(f"workdir {workdir}: cannot write there ({e.strerror or e}); pass a --workdir on a writable "
                         "disk with free space") from None
    slog.setup_python_logging(None, pylogging.INFO)  # stderr only, while the checks run
    checked = check() if check is not None else None
    slog.setup_python_logging(workdir, pylogging.INFO)
    return checked
