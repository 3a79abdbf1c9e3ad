"""The decode pool's schedule simulated on the host: which rows compute and which are live at each decode step, for
given completion lengths. It follows sampler.generate's rules (decode_pool.py: a finished row's slot takes the next
queued row; once the queue is empty the pool shrinks to the narrowest of decode_pool.stage_widths that holds the live
rows), so the planner's phase model and the benchmarks' schedule ceiling price the sampler's own schedule."""

from __future__ import annotations

import numpy as np

from sage_jax.sampling.decode_pool import stage_widths


def decode_batches(lengths_N: np.ndarray, slots: int | None = None, stage_dp: int = 0
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(rows computed, rows live), int [steps] each, for decode steps j = 1.. (the first token comes from the
    prefill) of the slot pool (sampler.generate, decode_pool.py): S = `slots` (default every row) slots compute at
    every step while any row is live, and a row that ends hands its slot to the next queued row.
    stage_dp > 0: the pool shrinks in stages (stage_widths(S, stage_dp, the longest row's tokens), where the sampler
    takes its completion bucket): once the queue is empty and the live rows fit in a narrower width, the following
    steps compute the rows of the narrowest width holding them; 0: no stages, S rows at every step."""
    lengths_N = np.asarray(lengths_N)
    S = len(lengths_N) if not slots else min(int(slots), len(lengths_N))
    free_S = np.zeros(S, np.int64)  # the step each slot frees up at; rows start in queue order on the first free
    live = []
    for n in lengths_N:
        s = int(np.argmin(free_S))
        live.append((free_S[s], free_S[s] + int(n)))
        free_S[s] += int(n)
    steps = int(free_S.max())
    start_N, end_N = (np.array(x) for x in zip(*live))
    j = np.arange(1, steps)
    live_J = ((start_N[None, :] <= j[:, None]) & (end_N[None, :] > j[:, None])).sum(1)
    rows_J = np.full(len(j), S)
    if stage_dp > 0:
        widths = stage_widths(S, stage_dp, int(lengths_N.max()))  # the longest row, where the sampler takes its bucket
        width, queue_empty = S, j >= start_N.max()  # a row started at step j was in the queue until then
        for i in range(len(j)):
            while queue_empty[i] and any(w < width and live_J[i] <= w for w in widths):
                width = max(w for w in widths if w < width)
            rows_J[i] = width
    return rows_J, live_J
