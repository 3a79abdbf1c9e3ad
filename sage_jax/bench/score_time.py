"""Host scoring cost of realistic completions: MATH train solutions (they end in \\boxed{answer}) scored against their
answers by the math reward in the worker pool (2 workers), 256 items, best of 3 rounds.

    python -m sage_jax.bench score_time [--items 256] [--workers 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from sage_jax.bench import common
from sage_jax.data.loaders import default_data_dir
from sage_jax.rewards.pool import RewardPool


def main(argv: list[str]) -> list[dict]:
    """argv: ["score_time", flags...] -> one row: the mean reward and the best round's seconds."""
    parser = argparse.ArgumentParser(prog="python -m sage_jax.bench score_time", description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=common.count(1), default=256)
    parser.add_argument("--workers", type=common.count(1), default=2)
    parser.add_argument("--rounds", type=common.count(1), default=3)
    args = parser.parse_args(argv[1:])
    with open(default_data_dir() / "math_train" / "math12k_train.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(args.items), f)]
    texts, golds = [r["solution"] for r in rows], [r.get("answer") or "" for r in rows]
    with RewardPool("math", num_workers=args.workers, timeout_s=10.0) as pool:
        pool.score(texts[:8], golds[:8])  # the workers start and import their libraries
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            rewards = pool.score(texts, golds)
            times.append(time.perf_counter() - t0)
    row = {"bench": "score_time", "items": len(texts), "workers": args.workers, "mean_reward": float(rewards.mean()),
           "best_s": min(times), "ms_per_item_per_worker": min(times) * args.workers / len(texts) * 1e3,
           "load": os.getloadavg()[0]}
    print(f"mean reward {row['mean_reward']:.3f}; best {row['best_s']:.3f} s for {len(texts)} items, "
          f"{row['ms_per_item_per_worker']:.2f} ms per rollout per worker; load {row['load']:.1f}")
    return [row]
