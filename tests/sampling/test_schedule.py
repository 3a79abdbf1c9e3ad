"""sampling.schedule: the decode pool's schedule simulated on the host (the rows each step computes and the live ones)
follows the sampler's rules: refill from the queue, shrink stages once the queue is empty."""

import numpy as np

from sage_jax.bench import workloads
from sage_jax.sampling.decode_pool import stage_widths
from sage_jax.sampling.schedule import decode_batches


def test_stage_widths_keep_the_multiples_of_the_row_shards():
    assert stage_widths(64, 1) == (64, 56, 48, 40, 32, 28, 24, 20, 16, 14, 12, 10, 8, 6, 4, 2)
    assert stage_widths(64, 16) == (64, 32)  # at least 2 slots per row shard
    assert stage_widths(4, 1) == (4, 2)
    assert stage_widths(48, 8) == (48, 32, 16)  # 6, 4, 2 slots per shard


def test_decode_stages_shrink_only_once_the_queue_is_empty():
    rows, live = decode_batches(np.array([10, 2, 2, 2]), slots=4, stage_dp=1)
    assert rows.tolist() == [4] + [2] * 8 and live.tolist() == [4] + [1] * 8  # widths 4, 2: at least 2 slots
    assert (decode_batches(np.array([10, 2, 2, 2]), slots=4)[0] == 4).all()  # default: no stages
    # 8 slots, 12 rows: the last 4 wait in the queue and start at step 1, so the pool keeps its 8 slots while 5 are
    # live (10 tokens at most: halving widths 8, 4, 2), and shrinks to 2 once the queue is empty and one row is left
    rows, live = decode_batches(np.array([10] + [2] * 11), slots=8, stage_dp=1)
    assert rows.tolist() == [8, 8, 8] + [2] * 6 and live.tolist() == [8, 5, 5] + [1] * 6
    # with 128 tokens or more, the fine widths: 6 fits the 5 live rows once the queue is empty
    rows, live = decode_batches(np.array([130] + [2] * 11), slots=8, stage_dp=1)
    assert rows[:3].tolist() == [8, 6, 6] and rows[-1] == 2
    lengths = workloads.longtail_lengths(64, 256)
    for dp in (1, 8, 16):
        rows, live = decode_batches(lengths, stage_dp=dp)
        assert (rows >= live).all() and (np.diff(rows) <= 0).all()
        assert set(rows.tolist()) <= set(stage_widths(64, dp))
    assert decode_batches(lengths, stage_dp=8)[0].min() == 16
    assert decode_batches(lengths, stage_dp=16)[0].min() == 32
