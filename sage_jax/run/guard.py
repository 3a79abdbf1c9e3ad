"""What keeps a training run's workdir honest: one run per workdir (the lease, run/lease.py, whose names this module
re-exports), and a stop on SIGTERM / SIGINT at a step boundary that saves the last completed step first.

Stop: inside the step loop (`StepStop.steps`), the first SIGTERM or SIGINT only sets a flag; the step in flight
finishes, every process agrees on the flag at the step boundary (one tiny allgather), the last completed step is
checkpointed by all of them together and the run exits 143 (SIGTERM) or 130 (SIGINT) with one line naming the step
and the command that resumes it. A second signal aborts at once (the step in flight is lost, the checkpoints on disk
stay). Outside the loop a SIGTERM ends the run like a Ctrl-C (`Terminated`), since no step is in flight there. At
the same boundary a lost lease (run/lease.py) stops every process with LeaseLost, before anything more is written.
"""

from __future__ import annotations

import logging as pylogging
import os
import shlex
import signal
import sys
import threading
from typing import Any, Callable, Iterator, Sequence

from sage_jax.run import lease
from sage_jax.run.lease import (LOCK_NAME, LeaseLost, WorkdirBusy, acquire, fence, locked, release,  # noqa: F401
                                release_all)

log = pylogging.getLogger("sage_jax")

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Terminated(KeyboardInterrupt):
    """SIGTERM outside a step loop: handled like a Ctrl-C (cli.main_guard exits 143)."""


class Stopped(SystemExit):
    """A signal stopped the run at a step boundary after saving; `code` is 130 or 143, `message` the one line."""

    def __init__(self, code: int, message: str):
        super().__init__(code)
        self.message = message


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
                why = lease.lost()  # every process alike: a lost lease stops them all before they write more
                if why:
                    raise LeaseLost(why)
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
