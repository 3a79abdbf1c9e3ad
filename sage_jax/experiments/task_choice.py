"""Pick an RL task for a model from its base pass@k alone, before any RL; and pass@k with 95% intervals.

    python -m sage_jax.experiments.task_choice --config configs/smollm2_cpu.py --candidates \
        arith_words,gsm8k_heldout,math_train_l1to2 --problems 48 --n 16 --out docs/results/smollm2/task_choice.json
    python -m sage_jax.experiments.task_choice --config configs/smollm2_cpu.py --candidates \
        countdown_words,kk_2people --problems 16 --n 16   # the generators, worded for an instruct model
    python -m sage_jax.experiments.task_choice --compare WORKDIR/eval/before/arith_words/samples.jsonl \
        WORKDIR/eval/after/arith_words/samples.jsonl

Intervals: percentile bootstrap over problems (the unbiased pass@k estimator per problem, problems resampled);
before vs after is paired by problem id.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any, Sequence

import numpy as np

from sage_jax.run import cli


def bootstrap_ci(values: Sequence[float], iters: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): the 95% percentile bootstrap interval of the mean over problems."""
    v = np.asarray(values, np.float64)
    idx = np.random.default_rng(seed).integers(0, len(v), size=(iters, len(v)))
    means = v[idx].mean(1)
    return float(v.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def per_problem(records: Sequence[dict], k: int) -> dict[str, float]:
    from sage_jax.eval.passk import pass_at_k
    return {str(r["id"]): pass_at_k(int(r["n"]), int(r["num_correct"]), k) for r in records}


def table(records: Sequence[dict], ks: Sequence[int]) -> dict[str, list[float]]:
    return {f"pass@{k}": [round(x, 4) for x in bootstrap_ci(list(per_problem(records, k).values()))] for k in ks}


def compare(before: Sequence[dict], after: Sequence[dict], ks: Sequence[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k in ks:
        a, b = per_problem(before, k), per_problem(after, k)
        ids = sorted(set(a) & set(b))
        diff = bootstrap_ci([b[i] - a[i] for i in ids])
        out[f"pass@{k}"] = {"before": table([r for r in before if str(r["id"]) in ids], [k])[f"pass@{k}"],
                            "after": table([r for r in after if str(r["id"]) in ids], [k])[f"pass@{k}"],
                            "after_minus_before": [round(x, 4) for x in diff], "problems": len(ids)}
    return out


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# The generator tasks, worded for an instruct model (the CPU countdown task's "3 4 2>10:" prompt is for a character
# model trained from scratch). Each names its own answer format, which its reward reads.
GENERATED = ("countdown_words", "kk_2people")


def _countdown_words(problems: int, seed: int) -> list:
    from sage_jax.data.loaders import Example
    from sage_jax.rewards import countdown
    out = []
    for i, p in enumerate(countdown.generate_problems(problems, seed, num_numbers=3, high=15)):
        nums = ", ".join(map(str, p["numbers"][:-1])) + f" and {p['numbers'][-1]}"
        text = (f"Use the numbers {nums}, each exactly once, with + - * / and parentheses, to make {p['target']}. "
                "Reply with only the equation on one line, for example (1+2)*3=9.")
        out.append(Example(text, str(p["target"]), {"numbers": list(p["numbers"]), "target": int(p["target"]),
                                                    "id": f"cd{i}"}))
    return out


def _kk_people(problems: int, seed: int, people: int = 2) -> list:
    from sage_jax.data.loaders import Example
    from sage_jax.rewards import kk
    out = []
    for i, row in enumerate(kk.generate_dataset([people], problems, seed)):
        out.append(Example(kk.prompt(row), row.get("solution_text_format", ""), {"id": f"kk{i}",
                                                                                  "gold": kk.parse_row(row)}))
    return out


def generated_candidate(name: str, problems: int, seed: int):
    """(examples, score(text, example)) for a generator candidate."""
    from sage_jax.rewards import countdown, kk
    if name == "countdown_words":
        return _countdown_words(problems, seed), lambda text, ex: countdown.score(text, ex.meta)
    return _kk_people(problems, seed), lambda text, ex: kk.score(text, ex.meta["gold"])


def measure(config, candidates: list[str], problems: int, n: int, out_dir: str) -> dict[str, Any]:
    import jax
    from sage_jax.data import tasks
    from sage_jax.eval import passk as evaluation
    from sage_jax.models import decoder as model
    from sage_jax.rewards import math as math_reward
    cfg = params = None
    results: dict[str, Any] = {}
    instruction = config.data.instruction
    for name in candidates:
        config.data.eval = "arith_words" if name in GENERATED else name
        config.data.train = "arith_words"  # only the evals are used; a generated train set loads instantly
        # a generator candidate's problem text carries its own answer format
        config.data.instruction = "{problem}" if name in GENERATED else instruction
        task = tasks.build(config)
        if name in GENERATED:
            examples, score = generated_candidate(name, problems, config.seed + 1)
        else:
            examples = task.evals[name]
            examples = random.Random(0).sample(examples, min(problems, len(examples)))
            score = lambda text, ex, t=task: math_reward.score(text, t.gold(ex))
        if cfg is None:
            cfg, params = model.load_hf(config.model.path)
            cfg = cfg.replace(eos_token_ids=tuple(task.tokenizer.eos_ids), pad_token_id=task.tokenizer.pad_id)
        ev = config.eval
        sampling = dict(max_new_tokens=ev.max_new_tokens, temperature=ev.temperature, top_p=ev.top_p, min_p=ev.min_p)
        generate_fn = evaluation.make_generate_fn(cfg, params, task.tokenizer.decode, sampling, config.seed,
                                                  max_rows=8 * n)
        evaluation.evaluate(task.tokenizer, examples, score, n=n, ks=[1, n], out_dir=f"{out_dir}/{name}",
                            generate_fn=generate_fn, batch_problems=8, template=task.template, run_name=name,
                            progress=False)
        records = _read(f"{out_dir}/{name}/samples.jsonl")
        results[name] = {"problems": len(records), "n": n, **table(records, [1, n]),
                         "example_prompt": records[0]["prompt"], "example_completion": records[0]["completions"][0]}
        print(name, json.dumps({k: v for k, v in results[name].items() if k.startswith("pass")}), file=sys.stderr)
        jax.clear_caches()
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/smollm2_cpu.py")
    p.add_argument("--candidates", default="arith_words,gsm8k_heldout,math_train_l1to2")
    p.add_argument("--problems", type=int, default=48)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=0, help="0: the config's eval.max_new_tokens")
    p.add_argument("--work", default="/tmp/task_choice", help="samples go here (resumable)")
    p.add_argument("--out", default="", help="JSON results file")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="two samples.jsonl files")
    p.add_argument("--ks", default="1,16")
    args, overrides = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.compare:
        result = compare(_read(args.compare[0]), _read(args.compare[1]), [int(k) for k in args.ks.split(",")])
    else:
        from sage_jax.run import config as config_lib
        config = config_lib.load(args.config, overrides)
        if args.max_new_tokens:
            config.eval.max_new_tokens = args.max_new_tokens
        result = measure(config, args.candidates.split(","), args.problems, args.n, args.work)
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    cli.main_guard(main)
