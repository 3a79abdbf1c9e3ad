"""What keeps a training run's workdir honest: one run per workdir (a lock file), and a stop on SIGTERM / SIGINT at
a step boundary that saves the last completed step first.

Lock: WORKDIR/run.lock holds {"pid", "host", "start", "since", "command"} of the run holding it (written by process
0). A second run exits at once naming the holder; a lock whose process is gone (same host, pid not alive or reused)
is taken over with a warning. A lock written on another host is never taken over (its pid cannot be checked there).

Stop: inside the step loop (`StepStop.steps`), the first SIGTERM or SIGINT only sets a flag; the step in flight
finishes, every process agrees on the flag at the step boundary (one tiny allgather), the last completed step is
checkpointed by all of them together and the run exits 143 (SIGTERM) or 130 (SIGINT) with one line naming the step
and the command that resumes it. A second signal aborts at once (the step in flight is lost, the checkpoints on disk
stay). Outside the loop a SIGTERM ends the run like a Ctrl-C (`Terminated`), since no step is in flight there.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging as pylogging
import os
import shlex
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence

log = pylogging.getLogger("sage_jax")

LOCK_NAME = "run.lock"
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class WorkdirBusy(ValueError):
    """Another live run holds the workdir's lock (a user error: exit 2 with one line)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM outside a step loop: handled like a Ctrl-C (cli.main_guard exits 143)."""


class Stopped(SystemExit):
    """A signal stopped the run at a step boundary after saving; `code` is 130 or 143, `message` the one line."""

    def __init__(self, code: int, message: str):
        super().__init__(code)
        self.message = message


# --------------------------------------------------------------------------------------------------- the lock

_held: dict[str, int] = {}  # lock path -> nesting depth in this process (train holds it, run_rl/run_sft nest)


def _process_index() -> int:
    jax = sys.modules.get("jax")
    return jax.process_index() if jax is not None else 0


def _all_agree(ok: bool) -> bool:
    jax = sys.modules.get("jax")
    if jax is None or jax.process_count() == 1:
        return ok
    import numpy as np
    from jax.experimental import multihost_utils
    return bool(np.all(multihost_utils.process_allgather(np.array([ok]))))


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (clock ticks since boot), to tell a reused pid from the lock's holder."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict[str, Any]) -> bool:
    if holder.get("host") != socket.gethostname():
        return True  # cannot look at another host's processes: assume it runs
    pid = int(holder.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    started = _start_time(pid)
    return holder.get("start") is None or started is None or started == holder.get("start")


def _read_lock(path: str) -> dict[str, Any] | None:
    """The holder, or None for an unreadable lock file (a crash between creating and writing it)."""
    for _ in range(3):  # a holder that just created the file may not have written it yet
        try:
            with open(path, encoding="utf-8") as f:
                holder = json.load(f)
            if isinstance(holder, dict):
                return holder
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    return None


def _describe(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since', '?')}"


def _try_take(path: str) -> bool:
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
          "since": datetime.datetime.now().isoformat(timespec="seconds"), "command": shlex.join(sys.argv)}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(me, f)
    return True


def _acquire(path: str) -> None:
    for _ in range(5):
        if _try_take(path):
            return
        holder = _read_lock(path)
        if holder == {}:
            continue  # released meanwhile
        if holder is not None and _alive(holder):
            raise WorkdirBusy(f"the workdir {os.path.dirname(path)} is in use by another run ({_describe(holder)}; "
                              f"lock file {path}): wait for it to finish, stop it, or pass another --workdir; if that "
                              "run is gone, delete the lock file")
        what = "unreadable lock" if holder is None else f"stale lock of {_describe(holder)} (no longer running)"
        # move it aside under a name of our own, so two runs taking over the same stale lock cannot both win
        aside = f"{path}.stale.{os.getpid()}"
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        if _read_lock(aside) != holder and holder is not None:  # someone else's fresh lock: put it back
            os.rename(aside, path)
            continue
        os.unlink(aside)
        log.warning("took over the %s: %s", what, path)
    raise WorkdirBusy(f"could not take the lock {path} (other runs keep taking it): pass another --workdir")


def _lock_path(workdir: str) -> str | None:
    if "://" in str(workdir):
        return None  # an object store has no atomic create; multi-host launchers keep one run per pod themselves
    return os.path.join(os.path.realpath(workdir), LOCK_NAME)


def acquire(workdir: str) -> None:
    """Take WORKDIR/run.lock for this process (re-entrant); WorkdirBusy if a live run holds it. Call on every
    process: process 0 takes the lock and all of them agree on the outcome."""
    path = _lock_path(workdir)
    if path is None:
        return
    if path in _held:
        _held[path] += 1
        return
    error: WorkdirBusy | None = None
    if _process_index() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            _acquire(path)
        except WorkdirBusy as e:
            error = e
    if not _all_agree(error is None):
        if error is None and _process_index() == 0:
            _remove(path)
        raise error or WorkdirBusy(f"the workdir {workdir} is in use by another run (process 0 could not lock it)")
    _held[path] = 1


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        if (_read_lock(path) or {}).get("pid") == os.getpid():
            os.unlink(path)


def release(workdir: str) -> None:
    path = _lock_path(workdir)
    if path is None or path not in _held:
        return
    _held[path] -= 1
    if _held[path] == 0:
        del _held[path]
        if _process_index() == 0:
            _remove(path)


def release_all() -> None:
    """Drop every lock this process holds (before an os._exit, which skips `finally` blocks)."""
    for path in list(_held):
        del _held[path]
        if _process_index() == 0:
            _remove(path)


@contextlib.contextmanager
def locked(workdir: str) -> Iterator[None]:
    acquire(workdir)
    try:
        yield
    finally:
        release(workdir)


# --------------------------------------------------------------------------------------------------- stopping

def _raise_terminated(signum, frame):
    raise Terminated()


def raise_on_sigterm() -> None:
    """SIGTERM -> Terminated (main thread only), so a run outside its step loop ends like a Ctrl-C, with a message."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


def resume_command() -> str:
    """The command line this process was started with, as `python -m MODULE ...` for a module run."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = spec.name.removesuffix(".__main__") if spec is not None and spec.name else ""  # a folder's __main__
    prog = ["python", "-m", name] if name else ["python", sys.argv[0]]
    return shlex.join([*prog, *sys.argv[1:]])


class StepStop:
    """The step loop's stop on SIGTERM / SIGINT: `for step in stop.steps(start, end): ...`.

    save(done) writes checkpoint `done` (called only if the newest checkpoint is older), flush() reports the late
    metrics first, closers are closed (logger, progress bar) before the run exits with Stopped."""

    def __init__(self, what: str, ckpt, save: Callable[[int], Any], flush: Callable[[], Any] = lambda: None,
                 closers: Sequence[Any] = ()):
        self.what, self.ckpt, self.save, self.flush, self.closers = what, ckpt, save, flush, closers
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handler(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            log.warning("%s received: stopping after the %s in flight (send it again to abort without saving)",
                        signal.Signals(signum).name, self.what)
            return
        self._restore()
        signal.raise_signal(signum)  # a second signal: the handler before the loop (KeyboardInterrupt, Terminated)

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s in EXIT_CODES:
            self._previous[s] = signal.signal(s, self._handler)

    def _restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def requested(self) -> bool:
        """Whether any process got a signal; every process must call it at the same step boundary."""
        jax = sys.modules.get("jax")
        if jax is not None and jax.process_count() > 1:
            import numpy as np
            from jax.experimental import multihost_utils
            flags = multihost_utils.process_allgather(np.array([self.signum or 0], np.int32))
            got = [int(s) for s in np.ravel(flags) if s]
            self.signum = self.signum or (got[0] if got else None)
        return self.signum is not None

    def steps(self, start: int, end: int) -> Iterator[int]:
        self._install()
        try:
            for step in range(start, end):
                yield step
                if self.requested():
                    self._stop(step + 1)
        finally:
            self._restore()

    def _stop(self, done: int) -> None:
        self.flush()
        if self.ckpt.latest_step() != done:
            self.save(done)
        self.ckpt.wait()
        for c in self.closers:
            c.close()
        jax = sys.modules.get("jax")
        if jax is not None and jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices("sage_jax.run.guard.stop")  # every process has saved
        name = signal.Signals(self.signum).name
        where = os.path.join(self.ckpt.directory, str(done))
        message = (f"stopped by {name} after {self.what} {done}: checkpoint saved at {where}; resume with: "
                   f"{resume_command()}")
        raise Stopped(EXIT_CODES[self.signum], message)
