"""One run per workdir: WORKDIR/run.lock is a lease, and a run that loses it stops before its next write (fencing).

The lock holds {"pid", "host", "start", "since", "command", "token", "beat", "beat_s"} of the run holding it (written
by process 0, on a local disk, a shared filesystem or a bucket alike: run/paths.py). A daemon thread of the holder
rewrites "beat" (its wall-clock time) every BEAT_S seconds (30; SAGE_LEASE_BEAT_S). A second run exits naming the
holder while it lives. A lock is taken over, with a warning, only when its holder is dead: on the same host, when
its pid is not alive (or reused), at once; on another host, when its beat is MISSED_BEATS (3) intervals old. A beat
younger than that is watched (a warning says so): renewed, the run exits 2 naming the holder; not renewed by the time
it is that old, the lock is taken over. So a run requeued onto another node after a SIGKILL waits out the dead run's
lease (at most 90 s) and goes on, and a live run's lock is never taken. The age is the holder's clock against this
one's: the hosts' clocks must agree to well within the 90 s (NTP). A lock without a beat (an older version's) from
another host is never taken over. A new lock is created exclusively (O_EXCL; GCS's create-if-absent precondition)
after reading that there is none; a take-over (a plain overwrite on a bucket) and a late renewal read the lock back
SETTLE_S seconds later and only count if their token is still there, so of two writers racing, the later one holds it.

Fencing: every write or delete under the workdir (run/paths.py's writes, a checkpoint save, the log files) first
asks `fence`. The holder counts its lease as its own only while its last renewal is younger than FRESH_BEATS (2)
intervals, one interval short of a take-over: past that (the process was paused, SIGSTOP or a frozen VM, or its
renewals failed), the next write renews first, reading the lock. A lock that is gone (deleted by hand) is made
again, exclusively; a lock that another run holds now, or a renewal that keeps failing until the lease is no longer
safe, makes the lease lost: from then on every write raises LeaseLost (a line naming the other holder), the log
files take no more lines, and the step loop stops at its next boundary (run/guard.py), with no checkpoint, no
metrics and no deletion. The lease is only checked before the write, not held through it: a pause of more than a
whole lease between the check and the write is not caught.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging as pylogging
import os
import shlex
import socket
import sys
import threading
import time
from typing import Any, Iterator

from sage_jax.run import paths, retry

log = pylogging.getLogger("sage_jax")

LOCK_NAME = "run.lock"


class WorkdirBusy(ValueError):
    """Another live run holds the workdir's lock (a user error: exit 2 with one line)."""


class LeaseLost(RuntimeError):
    """This run's lease on its workdir is gone (another run holds it, or it could not be renewed in time): nothing
    more may be written there (cli.main_guard: one line, exit 2)."""


_held: dict[str, int] = {}  # lock path -> nesting depth in this process (train holds it, run_rl/run_sft nest)
_leases: dict[str, "_Lease"] = {}  # lock path -> the lease (process 0)

BEAT_S = float(os.environ.get("SAGE_LEASE_BEAT_S", "30"))  # the holder rewrites its lock's "beat" this often
MISSED_BEATS = 3  # a lock of another host whose beat is older than this many of its intervals is stale
FRESH_BEATS = 2  # the holder trusts its lease without reading the lock while its last renewal is this young
SETTLE_S = 2.0  # the wait before a taker (or a late renewal) reads the lock back: a racing writer's write lands


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


def _settled(path: str, me: dict[str, Any], anywhere: bool = False) -> bool:
    """On a bucket (no atomic create or rename everywhere), or `anywhere` (a take-over from a lease that may be a
    paused run's, a late renewal), whether our write is the one that stayed."""
    if not paths.is_remote(path) and not anywhere:
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
    return paths.create_text(path, json.dumps(me)) and _settled(path, me, anywhere=_leased_elsewhere(holder))


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


class _Lease(threading.Thread):
    """The held lock: renews its beat every BEAT_S seconds (so another host can tell a live run from a dead one) and
    knows whether it is still this run's (`lost`: why not)."""

    def __init__(self, path: str, me: dict[str, Any]):
        super().__init__(name="sage-lease", daemon=True)
        self.path, self.me, self.stopped = path, me, threading.Event()
        self.beat, self.lost = float(me["beat"]), None  # the last renewal that held; why the lease is lost
        self._mutex = threading.Lock()

    def run(self) -> None:
        while not self.stopped.wait(BEAT_S):
            self.renew()
            if self.lost:
                log.error("%s", self.lost)
                return

    def renew(self) -> None:
        """Read the lock and, still ours, write a new beat; lost if another run holds it (or it is gone), or if
        renewing failed until the lease is no longer safe (a take-over may be near)."""
        with self._mutex:
            why = self._renew()
        if why:  # logged outside the mutex: log.txt on a bucket is written through paths, which asks fence()
            log.warning("could not renew the lock %s (%s); trying again in %.0f s", self.path, why, BEAT_S)

    def _renew(self) -> str | None:
        if self.lost or self.stopped.is_set():
            return None
        late = time.time() - self.beat > FRESH_BEATS * BEAT_S
        holder, why = _read_lock(self.path), "the lock is unreadable"
        if holder and holder.get("token") != self.me["token"]:
            self.lost = _lost(self.path, holder)
            return None
        if holder is not None:
            now = time.time()
            record = json.dumps({**self.me, "beat": now})
            try:
                if holder:
                    paths.write_text(self.path, record)
                    ok = True
                else:  # gone (deleted by hand): made again, unless another run made it meanwhile
                    ok = paths.create_text(self.path, record)
                if ok and ((holder and not late) or _settled(self.path, self.me, anywhere=True)):
                    self.beat = now
                    return None
                latest = _read_lock(self.path)  # not ours now; or a store's overwrite that read as absent
                if latest and latest.get("token") != self.me["token"]:
                    self.lost = _lost(self.path, latest)
                    return None
                raise OSError("the lock did not read back as this run's")
            except OSError as e:
                why = f"{type(e).__name__}: {e}"
        age = time.time() - self.beat
        if age <= FRESH_BEATS * BEAT_S:
            return why
        self.lost = (f"this run could not renew the lock {self.path} of its workdir for {age:.0f} s "
                     f"({retry.gave_up() or why}): another run may take the workdir over after "
                     f"{MISSED_BEATS * BEAT_S:.0f} s, so this run stopped and writes nothing more; once the workdir "
                     "is reachable again, rerun the same command to resume from its last checkpoint")
        return None

    def check(self, renew: bool = True) -> None:
        """LeaseLost if the lease is lost; with renew, a lease not renewed for FRESH_BEATS intervals renews first."""
        if renew and self.lost is None and time.time() - self.beat > FRESH_BEATS * BEAT_S:
            self.renew()
        if self.lost:
            raise LeaseLost(self.lost)

    def stop(self) -> None:
        self.stopped.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=10)


def _lost(path: str, holder: dict[str, Any]) -> str:
    now = f"is now held by {_describe(holder)}" if holder else "was deleted"
    return (f"this run lost its workdir: the lock {path} {now}; it stopped at once and wrote nothing more there (no "
            "metrics, checkpoints or deletions). That run owns the workdir now: stop it and rerun this command to go "
            "on here, or pass another --workdir")


def fence(p: str = "", renew: bool = True) -> None:
    """Before a write or delete (paths calls it): LeaseLost if a lease this process holds is lost (see module doc).
    The lock files themselves are the lease's own business."""
    if os.path.basename(os.fspath(p)).startswith(LOCK_NAME):
        return
    for lease in list(_leases.values()):
        lease.check(renew)


def lost() -> str | None:
    """Why a lease of this process is lost, on every process alike (call on all of them, e.g. at a step boundary:
    process 0 holds the lease and renews it first when it is late)."""
    with contextlib.suppress(LeaseLost):
        fence()
    why = next((lease.lost for lease in list(_leases.values()) if lease.lost), None)
    if _all_agree(why is None):
        return why
    return why or "process 0 lost the workdir's lock to another run: every process stopped and wrote nothing more"


paths.set_fence(fence)


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
            _leases[path] = _Lease(path, _acquire(path))
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

