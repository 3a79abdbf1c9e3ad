"""A process pool that scores (completion, gold) pairs with a hard per-item time limit and a memory cap.

    with RewardPool("math", num_workers=8, timeout_s=5.0) as pool:
        rewards_N = pool.score(completions, golds)       # float32 [N]; an item over the limit scores 0.0
        pool.take_counts()                               # {"rl/reward_timeouts": ..., "rl/reward_errors": ...}

Workers are fresh interpreters (`python -c ...`, not fork: the trainer process runs JAX threads) that import only the
reward module, so they start in about a second and never load JAX. They talk to the pool over their stdin/stdout
pipes with length-prefixed pickles. A worker that overruns its item, crashes or exits is killed and replaced; the
item scores 0.0, so one pathological answer cannot stall a step. Workers ignore SIGINT and SIGTERM (a Ctrl-C or
a launcher's signal reaches the whole process group): the trainer finishes its step with them and owns their end.
Each worker's address space is capped (RLIMIT_AS, `memory_mb`): an answer that makes the checker allocate gigabytes fails there and scores 0.0. A limit
inside the trainer process could not be hard (a long C call ignores signals), so `num_workers=0`, the setting for
tiny CPU runs, means the smallest pool: one worker.

Reward functions are named "math", "kk", "countdown" (modules under sage_jax.rewards, imported lazily), or given as
"package.module:function", or as a module-level callable.
"""

from __future__ import annotations

import atexit
import collections
import importlib
import logging
import math
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

REGISTRY = {
    "math": "sage_jax.rewards.math:score",
    "kk": "sage_jax.rewards.kk:score",
    "countdown": "sage_jax.rewards.countdown:score",
}
STARTUP_TIMEOUT_S = 120.0
FAILED_SHARE_WARNING = 0.25  # warn when more than this share of a batch times out or fails
log = logging.getLogger("sage_jax")
_HEADER = struct.Struct(">Q")
# A Ctrl-C (SIGINT to the terminal's whole process group) or a launcher's group-wide SIGTERM must not kill the
# workers while the trainer finishes its step and saves: they ignore both from their first line (before the imports,
# so no KeyboardInterrupt traceback either), and the parent owns their shutdown (stdin EOF, kill, parent-death watch).
_WORKER_CODE = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, "
                "signal.SIG_IGN); from sage_jax.rewards.pool import worker_main; worker_main()")


def resolve(fn: str | Callable[..., Any]) -> str:
    """A 'module:function' spec for a registry name, a spec, or a module-level callable."""
    if callable(fn):
        module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
        if not module or "<" in name or module == "__main__":
            raise ValueError(f"reward callable {fn!r} must be a module-level function importable by worker "
                             "processes (not a lambda, closure or __main__ function); pass 'module:function'")
        return f"{module}:{name}"
    if fn in REGISTRY:
        return REGISTRY[fn]
    if isinstance(fn, str) and ":" in fn:
        return fn
    raise ValueError(f"unknown reward function {fn!r}; use one of {sorted(REGISTRY)} or 'package.module:function'")


def load(spec: str) -> Callable[[str, Any], float]:
    module_name, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load reward function {spec!r}: {e}; check the module path and function name") from e
    return obj


# ----------------------------------------------------------------------------------------------- wire format


def _frame(obj: Any) -> bytes:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def _read_exact(stream, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _watch_parent(parent_pid: int) -> None:
    # A worker busy in Python code still notices an orphaning (the GIL is released every few ms).
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(0)


def worker_main() -> None:
    """Worker loop: read (index, completion, gold) frames from stdin, write (index, reward, ok) frames."""
    spec, memory_mb = sys.argv[1], int(sys.argv[3])
    if memory_mb > 0:
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    wire_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # prints from reward code go to stderr, not into the wire
    wire_in = sys.stdin.buffer
    threading.Thread(target=_watch_parent, args=(int(sys.argv[2]),), daemon=True).start()
    fn = load(spec)
    warmup = getattr(sys.modules.get(spec.partition(":")[0]), "warmup", None)
    if callable(warmup):
        warmup()
    wire_out.write(_frame(("ready", os.getpid())))
    wire_out.flush()
    while True:
        header = _read_exact(wire_in, _HEADER.size)
        if header is None:
            return
        body = _read_exact(wire_in, _HEADER.unpack(header)[0])
        if body is None:
            return
        index, completion, gold = pickle.loads(body)
        try:
            reward, ok = float(fn(completion, gold)), True
        except (Exception, MemoryError) as e:  # noqa: BLE001 - a crashing checker scores 0, the step goes on
            print(f"reward worker: {spec} raised {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            reward, ok = 0.0, False
        wire_out.write(_frame((index, reward if math.isfinite(reward) else 0.0, ok)))
        wire_out.flush()


# ----------------------------------------------------------------------------------------------- parent side


class _Worker:
    def __init__(self, spec: str, memory_mb: int):
        env = dict(os.environ)
        paths = [p or os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_CODE, spec, str(os.getpid()), str(memory_mb)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.state = "starting"  # starting -> idle <-> busy
        self.item = -1
        self.deadline = time.monotonic() + STARTUP_TIMEOUT_S

    def send(self, index: int, completion: str, gold: Any, timeout_s: float) -> None:
        self.proc.stdin.write(_frame((index, completion, gold)))
        self.proc.stdin.flush()
        self.state, self.item, self.deadline = "busy", index, time.monotonic() + timeout_s

    def read_messages(self) -> list[Any] | None:
        """Messages now available; None once the worker has exited."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        self.buf += chunk
        messages = []
        while len(self.buf) >= _HEADER.size:
            size = _HEADER.unpack_from(self.buf)[0]
            if len(self.buf) < _HEADER.size + size:
                break
            messages.append(pickle.loads(self.buf[_HEADER.size:_HEADER.size + size]))
            self.buf = self.buf[_HEADER.size + size:]
        return messages

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def close(self, wait_s: float = 2.0) -> None:
        try:
            self.proc.stdin.close()  # EOF: the worker leaves its loop
            self.proc.wait(timeout=wait_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class RewardPool:
    """Scores batches with `num_workers` worker processes (0: one), a per-item limit of `timeout_s` and a cap of
    `memory_mb` MiB of address space per worker (0: no cap)."""

    def __init__(self, fn: str | Callable[[str, Any], float], num_workers: int | None = None,
                 timeout_s: float = 5.0, memory_mb: int = 4096):
        if timeout_s <= 0:
            raise ValueError(f"RewardPool timeout_s must be > 0, got {timeout_s}")
        self.spec = resolve(fn)
        self.fn = load(self.spec)  # fails here, with a clear message, rather than in every worker
        self.num_workers = min(8, os.cpu_count() or 1) if num_workers is None else int(num_workers)
        if self.num_workers < 0:
            raise ValueError(f"RewardPool num_workers must be >= 0, got {num_workers}")
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.stats = collections.Counter()  # items, timeouts, errors, restarts
        self._counted = collections.Counter()  # stats at the last take_counts()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = [_Worker(self.spec, self.memory_mb) for _ in range(max(1, self.num_workers))]
        self._closed = False

    def score(self, completions: Sequence[str], golds: Sequence[Any], timeout_s: float | None = None) -> np.ndarray:
        """float32 rewards, one per completion; items over the limit, or whose checker fails, score 0.0."""
        if len(completions) != len(golds):
            raise ValueError(f"RewardPool.score got {len(completions)} completions but {len(golds)} golds")
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            if self._closed:
                raise ValueError("RewardPool is closed; create a new one")
            self.stats["items"] += len(completions)
            return self._score_workers(completions, golds, limit)

    def take_counts(self) -> dict[str, float]:
        """Items that timed out / failed since the last call, as metrics; warns when a large share failed."""
        with self._lock:
            new = self.stats - self._counted
            self._counted = collections.Counter(self.stats)
        items, failed = new["items"], new["timeouts"] + new["errors"]
        if items and failed > FAILED_SHARE_WARNING * items:
            log.warning("reward %s: %d of %d items timed out (%d) or failed (%d) and scored 0; check the checker, "
                        "train.reward_timeout and the completions", self.spec, failed, items, new["timeouts"],
                        new["errors"])
        return {"rl/reward_timeouts": float(new["timeouts"]), "rl/reward_errors": float(new["errors"])}

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self.spec, self.memory_mb)
        self.stats["restarts"] += 1

    def _score_workers(self, completions, golds, limit: float) -> np.ndarray:
        rewards_N = np.zeros(len(completions), np.float32)
        pending = collections.deque(range(len(completions)))
        while True:
            for worker in list(self._workers):
                if worker.state == "idle" and pending:
                    index = pending.popleft()
                    try:
                        worker.send(index, completions[index], golds[index], limit)
                    except (BrokenPipeError, OSError, pickle.PicklingError):
                        self.stats["errors"] += 1
                        self._replace(worker)
            active = [w for w in self._workers if w.state != "idle"]
            if not pending and not any(w.state == "busy" for w in self._workers):
                return rewards_N
            wait = max(0.0, min(w.deadline for w in active) - time.monotonic())
            readable, _, _ = select.select([w.fd for w in active], [], [], wait)
            for worker in [w for w in active if w.fd in readable]:
                messages = worker.read_messages()
                if messages is None:  # the worker exited
                    if worker.state == "starting":
                        raise RuntimeError(f"reward worker for {self.spec!r} exited during start-up; see its "
                                           "traceback above (is the module importable without JAX?)")
                    self.stats["errors"] += 1
                    self._replace(worker)
                    continue
                for message in messages:
                    if message[0] == "ready":
                        worker.state = "idle"
                    else:
                        index, reward, ok = message
                        rewards_N[index] = reward
                        self.stats["errors"] += not ok
                        worker.state = "idle"
            now = time.monotonic()
            for worker in list(self._workers):
                if worker.state == "busy" and now >= worker.deadline:
                    self.stats["timeouts"] += 1
                    self._replace(worker)
                elif worker.state == "starting" and now >= worker.deadline:
                    raise RuntimeError(f"reward worker for {self.spec!r} did not start within {STARTUP_TIMEOUT_S}s")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in self._workers:
                worker.close()
            self._workers = []

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_SHARED: dict[str, RewardPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(fn: str, timeout_s: float = 5.0) -> RewardPool:
    """One lazily started single-worker pool per reward name (backs math.verify_with_timeout); closed at exit."""
    with _SHARED_LOCK:
        if fn not in _SHARED:
            _SHARED[fn] = RewardPool(fn, num_workers=1, timeout_s=timeout_s)
        return _SHARED[fn]


@atexit.register
def _close_shared() -> None:
    for pool in _SHARED.values():
        pool.close()
