"""What keeps a training run's workdir honest: one run per workdir (a lock file), and a stop on SIGTERM / SIGINT at
a step boundary that saves the last completed step first.

Lock: WORKDIR/run.lock holds {"pid", "host", "start", "since", "command", "token", "beat", "beat_s"} of the run
holding it (written by process 0, on a local disk, a shared filesystem or a bucket alike: run/paths.py). It is a
lease: a daemon thread of the holder rewrites "beat" (its wall-clock time) every BEAT_S seconds (30;
SAGE_LEASE_BEAT_S). A second run exits naming the holder while it lives. A lock is taken over, with a warning, only
when its holder is dead: on the same host, when its pid is not alive (or reused), as before, at once; on another
host, when its beat is MISSED_BEATS (3) intervals old. A beat younger than that is watched (a warning says so):
renewed, the run exits 2 naming the holder; not renewed by the time it is that old, the lock is taken over. So a run
requeued onto another node after a SIGKILL waits out the dead run's lease (at most 90 s) and goes on, and a live
run's lock is never taken. The age is the holder's clock against this one's: the hosts' clocks must agree to well
within the 90 s (NTP). A lock without a beat (an older version's) from another host is never taken over. A new lock
is created exclusively (O_EXCL; GCS's create-if-absent precondition) after reading that there is none; on a bucket,
where a store may not refuse to create over an object and a take-over is a plain overwrite, the new holder reads its
lock back SETTLE_S seconds later and only holds it if its token is still there. A holder that finds another token at
a renewal logs an error and stops renewing.

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

from sage_jax.run import paths

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
_leases: dict[str, "_Heartbeat"] = {}  # lock path -> the thread renewing it (process 0)

BEAT_S = float(os.environ.get("SAGE_LEASE_BEAT_S", "30"))  # the holder rewrites its lock's "beat" this often
MISSED_BEATS = 3  # a lock of another host whose beat is older than this many of its intervals is stale
SETTLE_S = 2.0  # on a bucket: the wait before a new holder reads its lock back (a racing writer's upload lands)


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
    """Whether the lock's holder still runs, by its pid on this host (another host's lease: _watch)."""
    if holder.get("host") != socket.gethostname():
        return True  # a lock without a lease (an older version's): another host's pid cannot be checked
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
    """The holder, {} if there is no lock, or None for an unreadable one (a crash between creating and writing it)."""
    for _ in range(3):  # a holder that just created the file may not have written it yet
        try:
            holder = json.loads(paths.read_text(path))
            if isinstance(holder, dict):
                return holder
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    return None


def _leased_elsewhere(holder: dict[str, Any] | None) -> bool:
    if not holder or holder.get("host") == socket.gethostname():
        return False
    try:
        return float(holder["beat"]) > 0 and float(holder.get("beat_s", BEAT_S)) > 0
    except (KeyError, TypeError, ValueError):
        return False


def _watch(path: str, holder: dict[str, Any]) -> dict[str, Any] | None:
    """Another host's lease: the lock as it is once renewed, replaced or removed (its holder runs, or the lock
    changed hands), or `holder` itself once its beat is MISSED_BEATS intervals old (its holder is gone). A beat that
    recent can be a live run's or a dead one's: the wait (at most those intervals) tells them apart."""
    beat_s = float(holder.get("beat_s", BEAT_S))
    left = MISSED_BEATS * beat_s - (time.time() - float(holder["beat"]))
    if left > 0:
        log.warning("the workdir's lock %s is held by %s, renewed %.0f s ago: waiting up to %.0f s to see whether "
                    "that run renews it", path, _describe(holder), time.time() - float(holder["beat"]), left)
    deadline = time.monotonic() + left
    while time.monotonic() < deadline:
        time.sleep(max(0.01, min(beat_s / 4, 5.0, deadline - time.monotonic())))
        latest = _read_lock(path)
        if latest != holder:
            return latest
    return holder


def _busy(path: str, holder: dict[str, Any]) -> WorkdirBusy:
    return WorkdirBusy(f"the workdir {os.path.dirname(path)} is in use by another run ({_describe(holder)}; lock file "
                       f"{path}): wait for it to finish, stop it, or pass another --workdir; if that run is gone, "
                       "delete the lock file")


def _describe(holder: dict[str, Any]) -> str:
    return f"pid {holder.get('pid')} on host {holder.get('host')}, since {holder.get('since', '?')}"


def _record() -> dict[str, Any]:
    import uuid
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
            "since": datetime.datetime.now().isoformat(timespec="seconds"), "command": shlex.join(sys.argv),
            "token": uuid.uuid4().hex, "beat": time.time(), "beat_s": BEAT_S}


def _settled(path: str, me: dict[str, Any]) -> bool:
    """On a bucket (no atomic create or rename everywhere), whether our write is the one that stayed."""
    if not paths.is_remote(path):
        return True
    time.sleep(SETTLE_S)
    return (_read_lock(path) or {}).get("token") == me["token"]


def _take_over(path: str, holder: dict[str, Any] | None, me: dict[str, Any]) -> bool:
    """Replace a dead holder's lock with ours; False if another run got there first."""
    if paths.is_remote(path):
        paths.write_text(path, json.dumps(me))
        return _settled(path, me)
    # move it aside under a name of our own, so two runs taking over the same stale lock cannot both win
    aside = f"{path}.stale.{os.getpid()}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if _read_lock(aside) != holder and holder is not None:  # someone else's fresh lock: put it back
        os.rename(aside, path)
        return False
    os.unlink(aside)
    return paths.create_text(path, json.dumps(me))


def _acquire(path: str) -> dict[str, Any]:
    me = _record()
    for _ in range(5):
        holder = _read_lock(path)  # first: a bucket may not refuse to create over an existing object
        if holder == {}:
            if paths.create_text(path, json.dumps(me)) and _settled(path, me):
                return me
            continue
        if _leased_elsewhere(holder):
            latest = _watch(path, holder)
            if latest != holder:
                if latest and latest.get("token") == holder.get("token"):
                    raise _busy(path, latest)  # renewed: that run is alive
                continue  # released or taken meanwhile: look again
        elif holder is not None and _alive(holder):
            raise _busy(path, holder)
        if _take_over(path, holder, me):
            what = "unreadable lock" if holder is None else f"stale lock of {_describe(holder)} (no longer running)"
            log.warning("took over the %s: %s", what, path)
            return me
    raise WorkdirBusy(f"could not take the lock {path} (other runs keep taking it): pass another --workdir")


class _Heartbeat(threading.Thread):
    """Renews a held lock's beat every BEAT_S seconds, so another host can tell a live run from a dead one."""

    def __init__(self, path: str, me: dict[str, Any]):
        super().__init__(name="sage-lease", daemon=True)
        self.path, self.me, self.stopped = path, me, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(BEAT_S):
            holder = _read_lock(self.path)
            if holder is not None and holder.get("token") != self.me["token"]:
                log.error("the lock %s is no longer this run's (now %s): another run may write to this workdir",
                          self.path, _describe(holder) if holder else "deleted")
                return
            try:
                paths.write_text(self.path, json.dumps({**self.me, "beat": time.time()}))
            except OSError as e:
                log.warning("could not renew the lock %s (%s); trying again in %.0f s", self.path, e, BEAT_S)

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=10)


def _lock_path(workdir: str) -> str:
    return os.path.join(paths.absolute(workdir), LOCK_NAME)


def acquire(workdir: str) -> None:
    """Take WORKDIR/run.lock for this process (re-entrant); WorkdirBusy if a live run holds it. Call on every
    process: process 0 takes the lock (and renews its lease) and all of them agree on the outcome."""
    path = _lock_path(workdir)
    if path in _held:
        _held[path] += 1
        return
    error: WorkdirBusy | None = None
    if _process_index() == 0:
        paths.makedirs(os.path.dirname(path))
        try:
            _leases[path] = _Heartbeat(path, _acquire(path))
            _leases[path].start()
        except WorkdirBusy as e:
            error = e
    if not _all_agree(error is None):
        if error is None and _process_index() == 0:
            _remove(path)
        raise error or WorkdirBusy(f"the workdir {workdir} is in use by another run (process 0 could not lock it)")
    _held[path] = 1


def _remove(path: str) -> None:
    lease = _leases.pop(path, None)
    if lease is None:
        return
    lease.stop()
    with contextlib.suppress(OSError):
        if (_read_lock(path) or {}).get("token") == lease.me["token"]:
            paths.remove(path)


def release(workdir: str) -> None:
    path = _lock_path(workdir)
    if path not in _held:
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
    """The command line this process was started with, as `python -m MODULE ...` for a module run, behind the
    environment that shapes the run (XLA_FLAGS: e.g. the simulated devices a split placement needs; JAX_PLATFORMS)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = spec.name.removesuffix(".__main__") if spec is not None and spec.name else ""  # a folder's __main__
    prog = ["python", "-m", name] if name else ["python", sys.argv[0]]
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in RESUME_ENV if os.environ.get(k)]
    return " ".join([*env, shlex.join([*prog, *sys.argv[1:]])])


RESUME_ENV = ("XLA_FLAGS", "JAX_PLATFORMS")  # what a resume must repeat to build the same devices


class StepStop:
    """The step loop's stop on SIGTERM / SIGINT: `for step in stop.steps(start, end): ...`.

    save(done) writes checkpoint `done` (called only if the newest checkpoint is older), flush() reports the late
    metrics first, then(done) saves what may take longer once the state is on disk (the off-policy batches in
    flight: a preemption notice may run out while they finish), closers are closed (logger, progress bar) before the
    run exits with Stopped. A second signal raises at once, also while then() waits."""

    def __init__(self, what: str, ckpt, save: Callable[[int], Any], flush: Callable[[], Any] = lambda: None,
                 closers: Sequence[Any] = (), then: Callable[[int], Any] = lambda done: None):
        self.what, self.ckpt, self.save, self.flush, self.closers, self.then = what, ckpt, save, flush, closers, then
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
        self.ckpt.wait()  # the state is on disk
        self.then(done)
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
