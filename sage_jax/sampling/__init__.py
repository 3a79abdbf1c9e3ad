"""Rollouts: sampler.py (generate: prefill, then KV-cache decoding in a fixed pool of slots), decode_pool.py (the
pool's loop, its refill and its widths), rows.py (each row's sequence, offset, key and group: rows that leave the pool
before they finish and come back with their tokens so far), schedule.py (the pool's schedule simulated on the host),
filters.py (temperature, top-k, top-p).

Imports: models/.
"""
