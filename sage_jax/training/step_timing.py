"""Phase timings of one RL step that count finished device work, not dispatch (DESIGN.md: every time/* metric
waits for the device work it names, and the phases add up to the step)."""

from __future__ import annotations

import time

import jax


class PhaseClock:
    """time/<phase>_s laps, each ended once the phase's outputs are computed (not merely dispatched), so the device
    work is counted in the phase that did it and the laps add up to time/step_s."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, phase: str, *outputs) -> None:
        jax.block_until_ready(outputs)
        now = time.perf_counter()
        key = f"time/{phase}_s"
        self.laps[key] = self.laps.get(key, 0.0) + now - self.last
        self.last = now

    def total(self) -> float:
        return self.last - self.start
