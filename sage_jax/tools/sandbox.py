"""Model-written code run in isolation: a fresh interpreter in isolated mode (`python -I`), inside new network, mount
and PID namespaces (`unshare`), as an unprivileged user id of its own, under resource limits.

    result = run_isolated("print(2 ** 10)", Limits(timeout_s=5.0))
    result.stdout, result.stderr, result.returncode, result.timed_out, result.seconds

What holds each hostile case (tests/tools/test_sandbox.py has one test for each):
- no network: a new network namespace holds only a loopback device, and it is down;
- processes: RLIMIT_NPROC binds because the code runs as a user id no other process has (one per concurrent call);
  a PID namespace makes every process the code starts die with it, whatever session or group it moved to;
- memory, CPU, file size, open files: RLIMIT_AS / CPU / FSIZE / NOFILE (a write past FSIZE fails with EFBIG: Python
  ignores SIGXFSZ); core dumps off;
- files: a private tmpfs over /tmp, /var/tmp, /run/lock and /dev/shm (the only world-writable places), the scratch
  working directory in it; everything the code writes vanishes with the namespace. A directory that others may not
  enter (root's home, where pyenv installs Python) is covered by an empty tmpfs that shows only the interpreter;
- the parent: another user id may not signal it or read its /proc (and a fresh /proc shows only the sandbox); the
  code gets a bare environment, never the trainer's;
- time: a wall-clock kill of the whole process group at the timeout (the namespace's first process dies, and the
  kernel kills the rest).
The namespaces need root (CI runs as root); elsewhere `isolation="none"` runs trusted code under the limits only.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time

UID_BASE = 1_900_000_000  # sandbox user ids: far above any a distribution hands out; one per concurrent call
WRITABLE_DIRS = ("/tmp", "/var/tmp", "/run/lock", "/dev/shm")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/tmp/work", "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"}


@dataclasses.dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_processes: int = 16
    max_file_mb: int = 8
    max_open_files: int = 64
    scratch_mb: int = 64


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    seconds: float


class _UserIds:
    """A free list of sandbox user ids: two calls running at once never share one (RLIMIT_NPROC counts per user)."""

    def __init__(self):
        self._free: list[int] = []
        self.first = UID_BASE + os.getpid() % 10_000 * 100  # this process's block: first + 1 .. first + 100
        self._next = self.first
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            self._next += 1
            return self._next

    def give(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)


USER_IDS = _UserIds()


def _blocked_ancestor(path: str) -> str | None:
    """The first directory above `path` that other users may not enter, or None."""
    parts = path.strip("/").split("/")
    for i in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:i])
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return ancestor
    return None


def _interpreter_paths() -> list[str]:
    paths = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)})
    return [p for p in paths if not any(p != q and p.startswith(q + "/") for q in paths)]


def namespace_script(uid: int, limits: Limits) -> str:
    """The shell that runs as root inside the new namespaces, then execs the interpreter as `uid` under the limits."""
    q = shlex.quote
    lines = ["set -e", f"mount -t tmpfs -o size={limits.scratch_mb}m,mode=1777 tmpfs /tmp"]
    by_ancestor: dict[str, list[str]] = {}
    for path in _interpreter_paths():
        ancestor = _blocked_ancestor(path)
        if ancestor is not None:
            by_ancestor.setdefault(ancestor, []).append(path)
    stage = 0
    for ancestor, paths in by_ancestor.items():
        stages = [f"/tmp/.stage{stage + i}" for i in range(len(paths))]
        stage += len(paths)
        for path, staged in zip(paths, stages):
            lines += [f"mkdir {staged}", f"mount --rbind {q(path)} {staged}"]
        lines.append(f"mount -t tmpfs -o size=1m,mode=755 tmpfs {q(ancestor)}")
        for path, staged in zip(paths, stages):
            lines += [f"mkdir -p {q(path)}", f"mount --move {staged} {q(path)}", f"rmdir {staged}"]
    lines += [f"[ ! -d {d} ] || mount -t tmpfs -o size=1m,mode=1777 tmpfs {d}" for d in WRITABLE_DIRS[1:]]
    lines += [f"mkdir -m 700 /tmp/work && chown {uid}:{uid} /tmp/work && cd /tmp/work",
              "exec prlimit --as={} --cpu={}:{} --nproc={} --fsize={} --nofile={} --core=0 -- ".format(
                  limits.memory_mb << 20, int(limits.timeout_s) + 1, int(limits.timeout_s) + 2,
                  limits.max_processes, limits.max_file_mb << 20, limits.max_open_files)
              + f"setpriv --reuid={uid} --regid={uid} --clear-groups --no-new-privs --inh-caps=-all "
              + f"--bounding-set=-all {q(os.path.realpath(sys.executable))} -I -"]
    return "\n".join(lines)


def _command(isolation: str, uid: int, limits: Limits) -> list[str]:
    if isolation == "namespaces":
        return ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
                "--propagation", "private", "sh", "-c", namespace_script(uid, limits)]
    return ["prlimit", f"--as={limits.memory_mb << 20}", f"--cpu={int(limits.timeout_s) + 1}",
            f"--fsize={limits.max_file_mb << 20}", f"--nofile={limits.max_open_files}", "--core=0", "--",
            os.path.realpath(sys.executable), "-I", "-"]


def available_isolation() -> str | None:
    """'namespaces' where this process may build them (root with unshare, mount, prlimit and setpriv), else None."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "mount", "prlimit", "setpriv")):
        return None
    probe = subprocess.run(["unshare", "--net", "--mount", "--pid", "--fork", "--mount-proc", "true"],
                           capture_output=True, timeout=30)
    return "namespaces" if probe.returncode == 0 else None


def _read_capped(f, max_bytes: int) -> str:
    """The file's text, or its head and tail with the middle cut where it is over `max_bytes`."""
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    if size <= max_bytes:
        return f.read().decode("utf-8", "replace")
    head = f.read(max_bytes // 2).decode("utf-8", "replace")
    f.seek(size - max_bytes // 2)
    tail = f.read().decode("utf-8", "replace")
    return f"{head}\n[... {size - max_bytes} bytes cut ...]\n{tail}"


def run_isolated(code: str, limits: Limits, isolation: str = "namespaces",
                 max_output_bytes: int = 16384) -> SandboxResult:
    """Runs `code` in a fresh isolated interpreter; never raises for anything the code does."""
    uid = USER_IDS.take()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sage_tool_") as io_dir:
        paths = [os.path.join(io_dir, n) for n in ("code.py", "stdout", "stderr")]
        with open(paths[0], "w") as f:
            f.write(code)
        with open(paths[0], "rb") as code_in, open(paths[1], "w+b") as out, open(paths[2], "w+b") as err:
            proc = subprocess.Popen(_command(isolation, uid, limits), stdin=code_in, stdout=out, stderr=err,
                                    env=dict(_ENV), cwd="/", close_fds=True, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
            result = SandboxResult(_read_capped(out, max_output_bytes), _read_capped(err, max_output_bytes),
                                   proc.returncode, timed_out, time.perf_counter() - start)
    USER_IDS.give(uid)
    return result


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _kill_group(proc: subprocess.Popen) -> None:
    """Kills the namespace's first process, so that the kernel kills every process left in the namespace and
    `unshare` reaps it (killing `unshare` first would leave it to the machine's init to reap), then the group."""
    if proc.poll() is not None:
        return
    for pid in _children(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
