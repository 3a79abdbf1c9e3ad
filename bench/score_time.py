"""Host scoring cost of realistic completions: MATH train solutions (they end in \\boxed{answer}) scored against their
answers by the math reward in the worker pool (2 workers), 256 items, best of 3 rounds.

    PYTHONPATH=. python bench/score_time.py
"""
import json
import os
import time

from sage_jax.data.loaders import default_data_dir
from sage_jax.rewards.pool import RewardPool

rows = [json.loads(line) for line in open(default_data_dir() / "math_train" / "math12k_train.jsonl")][:256]
texts, golds = [r["solution"] for r in rows], [r.get("answer") or "" for r in rows]
with RewardPool("math", num_workers=2, timeout_s=10.0) as pool:
    pool.score(texts[:8], golds[:8])
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        rewards = pool.score(texts, golds)
        times.append(time.perf_counter() - t0)
print(f"mean reward {rewards.mean():.3f}; best {min(times):.3f} s for {len(texts)} items, "
      f"{min(times) * 2 / len(texts) * 1e3:.2f} ms per rollout per worker; load {os.getloadavg()[0]:.1f}")
