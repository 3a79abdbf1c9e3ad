"""What the experiment measures on a policy: big sampler calls, in-process countdown scoring, per-problem statistics.

Per problem it keeps the counts the report needs (pass@k for every k comes from the correct count): correct
samples, distinct correct solutions (countdown.canonical forms), all solutions there are (countdown.solve) and the
strategy of every correct sample (countdown.strategy, the scheme countdown.strategy_shares uses).
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from sage_jax.sampling import sampler
from sage_jax.rewards import countdown


def problem_stats(texts: Sequence[str], gold: Mapping[str, Any]) -> dict[str, Any]:
    """Counts over one problem's samples: correct, distinct correct solutions, solutions in all, strategies."""
    correct, forms, strategies = 0, set(), Counter()
    for text in texts:
        if countdown.score(text, gold) != 1.0:
            continue
        expr = countdown.extract_expression(text)[0]
        correct += 1
        forms.add(countdown.canonical(expr))
        strategies[countdown.strategy(expr)] += 1
    return {"n": len(texts), "correct": correct, "distinct": len(forms),
            "solutions": len(countdown.solve(gold["numbers"], int(gold["target"]))), "strategies": dict(strategies)}


def _chunks(num_problems: int, per_call: int) -> list[tuple[int, int]]:
    """Near-equal [start, stop) chunks of at most per_call problems (few distinct shapes -> few compiles)."""
    calls = max(1, math.ceil(num_problems / max(per_call, 1)))
    size = math.ceil(num_problems / calls)
    return [(s, min(s + size, num_problems)) for s in range(0, num_problems, size)]


def sample_problems(cfg, params, tokenizer, golds: Sequence[Mapping[str, Any]], *, n: int, max_new_tokens: int,
                    temperature: float, min_p: float, key: jax.Array, rows_per_call: int) -> list[dict[str, Any]]:
    """n samples for each problem (in calls of about rows_per_call rows), scored in-process: problem_stats each."""
    out_stats = []
    chunks = _chunks(len(golds), rows_per_call // n)
    width = chunks[0][1] - chunks[0][0]
    for call, (start, stop) in enumerate(chunks):
        prompts = [tokenizer.encode(countdown.prompt(g)) for g in golds[start:stop]]
        prompts += [prompts[0]] * (width - len(prompts))  # same shape as the other calls: no new program
        out = sampler.generate(cfg, params, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                               min_p=min_p, eos_ids=cfg.eos_token_ids, seed=jax.random.fold_in(key, call),
                               num_samples=n, pad_id=cfg.pad_token_id)
        tokens_NxC, lengths_N = np.asarray(out.tokens), np.asarray(out.lengths)
        for i, gold in enumerate(golds[start:stop]):
            rows = range(i * n, (i + 1) * n)
            out_stats.append(problem_stats([tokenizer.decode(tokens_NxC[r, :lengths_N[r]]) for r in rows], gold))
    return out_stats


def training_curves(workdir: str) -> dict[str, list]:
    """Per-step rl/entropy, rl/reward, rl/kl, ... from a run's metrics.jsonl (a resumed run's later lines win)."""
    path = os.path.join(workdir, "metrics.jsonl")
    by_step: dict[int, dict[str, Any]] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    by_step.setdefault(int(record["step"]), {}).update(record)
    steps = sorted(by_step)
    names = {"entropy": "rl/entropy", "reward": "rl/reward", "accuracy": "rl/accuracy", "kl": "rl/kl",
             "kl_ref": "rl/kl_ref", "q_mean": "sage/q_mean", "q_p90": "sage/q_p90", "q_active": "sage/q_active",
             "kl_cov": "loss/kl_cov", "pg_token_frac": "rl/pg_token_frac", "step_s": "time/step_s"}
    return {"step": steps, **{k: [by_step[s].get(v) for s in steps] for k, v in names.items()}}
