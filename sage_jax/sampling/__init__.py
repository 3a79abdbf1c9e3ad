"""Rollouts: sampler.py (generate: prefill, then KV-cache decoding in a fixed pool of slots), decode_pool.py (the
pool's loop, its refill and its widths), prefill.py (what the pool starts from: the prefill, its queues, widths and
slots), session.py (a pool kept on the device across calls: a row pauses in its slot at a tool call and goes on with
tokens appended), rows.py (each row's sequence, offset, key and group: rows that leave the pool
before they finish and come back with their tokens so far), schedule.py (the pool's schedule simulated on the host),
filters.py (temperature, top-k, top-p).

Imports: models/.
"""
