"""XLA compilations counted while a benchmark step runs: a step that compiled is not a timing.

jax.monitoring reports every backend compilation with the jitted function's name, whichever library jitted it (ours,
tunix, a one-off `jnp` op on a new shape). `CompileCounter` counts them while it is open; `split` sorts the names
into the sampler's programs, the train step's and the rest.
"""

from __future__ import annotations

import statistics
from typing import Sequence

from jax import monitoring

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# jitted names, ours and tunix's: the sampler's programs and the train step's
SAMPLER_PROGRAMS = ("generate_program", "_prefill_fn", "_decode_fn")
TRAIN_PROGRAMS = ("train_step",)


class CompileCounter:
    """`with CompileCounter() as c: ...` then c.names (one per compilation, in order) and c.seconds."""

    def __init__(self):
        self.names: list[str] = []
        self.seconds = 0.0

    def _listen(self, event: str, duration: float, **kw) -> None:
        if event == COMPILE_EVENT:
            self.names.append(str(kw.get("fun_name", "?")))
            self.seconds += duration

    def __enter__(self) -> "CompileCounter":
        monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_duration_listener(self._listen)

    @property
    def count(self) -> int:
        return len(self.names)

    def split(self) -> dict[str, float]:
        """{compiles, sampler_compiles, train_compiles, compile_s}: all compilations, those of a sampler program
        (ours or tunix's), those of a train step, and the seconds they took."""
        def of(programs):
            return sum(any(p in name for p in programs) for name in self.names)
        return dict(compiles=float(self.count), sampler_compiles=float(of(SAMPLER_PROGRAMS)),
                    train_compiles=float(of(TRAIN_PROGRAMS)), compile_s=self.seconds)


def timed_steps(steps: Sequence[dict], warmup: int = 1) -> tuple[list[dict], dict[str, int]]:
    """(the steps that count, {timed_steps, compiled_steps}): the steps after `warmup` that compiled nothing; when
    every one of them compiled, all of them (compiled_steps then says so, and the table flags it)."""
    after = list(steps[warmup:]) or list(steps)
    clean = [s for s in after if not s.get("compiles")]
    return (clean or after), dict(timed_steps=len(clean), compiled_steps=len(after) - len(clean))


def median_row(steps: Sequence[dict]) -> dict[str, float]:
    """Per key, the median over steps (of the keys of the first step)."""
    return {k: statistics.median(float(s[k]) for s in steps) for k in steps[0]}
