"""Rollouts: sampler.py (generate: prefill, then KV-cache decoding in a fixed pool of slots), decode_pool.py (the
pool's loop, its refill and its widths), filters.py (temperature, top-k, top-p).

Imports: models/.
"""
