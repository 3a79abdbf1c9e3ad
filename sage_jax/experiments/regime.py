"""Choose the study's shared regime on GRPO alone, before any guide runs (issue 20, item 1).

    python -m sage_jax.experiments.regime --out docs/results/study_countdown/regime.md --records docs/results/study_countdown/runs   # hours
    python -m sage_jax.experiments.regime --out /tmp/regime.md --tiny --seeds 2                      # smoke, seconds

Each candidate of configs/countdown_arms.REGIME_CANDIDATES (shared settings only: RL steps, learning rate, beta,
model size, the base's mode skew, prompts per step, updates per batch) gets plain GRPO with --seeds seeds from its
SFT base (one base per distinct base setting, shared between candidates). A candidate is kept when GRPO clearly
sharpens on experiment.primary_split (held-out problems, or the RL prompts themselves): pass@1 above the base's by
at least MIN_GAIN with a 95% t-interval over seeds that excludes 0, and distinct correct solutions per problem or
pass@n below the base's. The selected regime is the cheapest kept one
(fewest sampled rollouts), the larger pass@1 gain on a tie. The report (markdown + a .json beside it) lists every
candidate tried, its numbers and why it was kept or dropped; freeze the selected one by copying its overrides into
countdown_arms.REGIME (one commit) before any arm runs, and change nothing after a guide's results are seen.
Runs resume like the reproduction's (--work; --records keeps each finished run's record.json).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping, Sequence

from sage_jax.data import tasks
from sage_jax.eval import passk as evaluation
from sage_jax.run import config as config_lib
from sage_jax.experiments import reproduce, worklist
from sage_jax.experiments.report import SPLIT_NAMES
from sage_jax.experiments.stats import fmt, mean_ci, summarize_run

MIN_GAIN = 0.05  # pass@1 over the base that counts as "GRPO clearly sharpens"


def candidate_config(name: str, budget: str, overrides: Sequence[str], seed: int = 0):
    """The grpo arm under `budget` with the candidate's settings (under `tiny`, only those tiny leaves alone)."""
    mod = worklist.arms_module()
    settings, _ = mod.REGIME_CANDIDATES[name]
    if budget == "tiny":  # the smoke keeps tiny's sizes and step counts
        settings = {k: v for k, v in settings.items() if k not in mod.BUDGETS["tiny"]}
    flags = [f"{k}={v}" for k, v in settings.items()] + list(overrides)
    return worklist.load_config("grpo", budget, flags, seed=seed)


def verdict(base: Mapping[str, Any], runs: Sequence[Mapping[str, Any]], n: int, split: str = "countdown"
            ) -> dict[str, Any]:
    """The candidate's numbers on `split` against the base, and whether (and why) it is kept."""
    gain, gain_half = mean_ci([r[f"{split}/pass@1"] - base[f"{split}/pass@1"] for r in runs])
    distinct = mean_ci([r[f"{split}/distinct"] for r in runs])
    pass_n = mean_ci([r[f"{split}/pass@{n}"] for r in runs])
    out = {"seeds": len(runs), "gain": (gain, gain_half), "distinct": distinct, "pass_n": pass_n}
    diversity_down = distinct[0] < base[f"{split}/distinct"] or pass_n[0] < base[f"{split}/pass@{n}"]
    if len(runs) < 2:
        reason = "dropped: one seed gives no interval (use --seeds >= 2)"
    elif gain < MIN_GAIN:
        reason = f"dropped: pass@1 gain {gain:+.3f} is below {MIN_GAIN}"
    elif gain - gain_half <= 0:
        reason = f"dropped: the pass@1 gain's 95% interval ({gain:+.3f} ± {gain_half:.3f}) includes 0"
    elif not diversity_down:
        reason = "dropped: neither distinct solutions nor pass@n fell below the base's (no collapse)"
    else:
        reason = "kept: pass@1 up with an interval excluding 0, diversity down"
    return {**out, "kept": reason.startswith("kept"), "reason": reason}


def search(names: Sequence[str], budget: str, seeds: int, overrides: Sequence[str], work: str,
           records: str | None, command: str) -> dict[str, Any]:
    """Runs (or resumes) every candidate's base and GRPO seeds; {name: verdict and settings}."""
    mod = worklist.arms_module()
    work = os.path.join(work, budget, "regime")
    bases: dict[str, tuple[Any, dict[str, Any]]] = {}
    out = {}
    for name in names:
        config = candidate_config(name, budget, overrides)
        split, n = config.experiment.primary_split, int(config.eval.n)
        if not reproduce.eval_sizes(config).get(split):  # before any training: a split that is never evaluated
            evaluated = [s for s, size in reproduce.eval_sizes(config).items() if size]
            raise ValueError(f"experiment.primary_split={split!r} is not evaluated: choose one of "
                             f"{', '.join(evaluated)} (countdown_rl needs experiment.rl_eval_problems > 0)")
        fp = reproduce.fingerprint(config, reproduce.BASE_SECTIONS)
        if fp not in bases:
            sft_task, rl_task = reproduce.split_task(tasks.build(config), config.experiment.sft_problems)
            _, params, record = reproduce.train_base(sft_task, config, os.path.join(work, "bases", fp), command)
            bases[fp] = (rl_task, params, record)
        rl_task, params, base_record = bases[fp]
        runs = []
        for seed in range(seeds):
            run_dir = os.path.join(work, name, f"seed{seed}")
            mirror = (os.path.join(records, budget, "regime", name, f"seed{seed}", "record.json") if records
                      else None)
            job = worklist.Job("regime", name, seed, candidate_config(name, budget, overrides, seed), run_dir,
                                f"regime {name} seed{seed}", mirror)
            record = reproduce.run_one(rl_task, job, params, command, base_record.get("params_checksum", ""))
            if record is not None:
                runs.append(summarize_run(record))
        base = summarize_run(base_record)
        settings, why = mod.REGIME_CANDIDATES[name]
        cost = config.train.steps * config.rollout.prompts_per_step * config.rollout.group_size
        held_out = mean_ci([r["countdown/pass@1"] - base["countdown/pass@1"] for r in runs])
        out[name] = {"settings": settings, "why": why, "rollouts": cost, "base_fingerprint": fp, "split": split,
                     "base_pass@1": base[f"{split}/pass@1"], "base_distinct": base[f"{split}/distinct"],
                     "base_pass_n": base[f"{split}/pass@{n}"], "n": n, "held_out_gain": held_out,
                     **verdict(base, runs, n, split)}
    return out


def selected(results: Mapping[str, Mapping[str, Any]]) -> str | None:
    kept = [(r["rollouts"], -r["gain"][0], name) for name, r in results.items() if r["kept"]]
    return min(kept)[2] if kept else None


def render(results: Mapping[str, Mapping[str, Any]], budget: str, command: str) -> str:
    rows = ["| candidate | settings | why tried | seeds | base pass@1 | pass@1 gain | distinct (base → GRPO) | "
            "pass@n (base → GRPO) | held-out pass@1 gain | rollouts | verdict |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        settings = ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "(round 1's)"
        rows.append(f"| {name} | {settings} | {r['why']} | {r['seeds']} | {r['base_pass@1']:.3f} | "
                    f"{fmt(*r['gain'], digits=3)} | {r['base_distinct']:.2f} → {fmt(*r['distinct'], digits=2)} | "
                    f"{r['base_pass_n']:.3f} → {fmt(*r['pass_n'])} | {fmt(*r['held_out_gain'], digits=3)} | "
                    f"{r['rollouts']} | {r['reason']} |")
    choice = selected(results)
    first = next(iter(results.values()), {})
    split = first.get("split", "countdown")
    frozen = ("No candidate met the criterion: widen REGIME_CANDIDATES (longer RL, a more skewed base, a larger "
              "model) and rerun; do not run the arms in a regime where GRPO does not sharpen." if choice is None else
              f"Selected: **{choice}** (the cheapest kept regime). Freeze it before any arm runs, in one commit:\n\n"
              f"```python\nREGIME = {dict(results[choice]['settings'])!r}  # configs/countdown_arms.py\n```")
    return "\n".join([
        f"# Regime search (GRPO only, budget `{budget}`)\n",
        f"Chosen before any guide runs. Kept when GRPO's pass@1 on the split `{split}` "
        f"({SPLIT_NAMES.get(split, split)}) rises over its SFT base by at least "
        f"{MIN_GAIN} with a 95% t-interval over seeds excluding 0, and distinct correct solutions per problem or "
        f"pass@n fall below the base's there (the held-out gain is shown beside it). pass@n: n = "
        f"{first['n'] if results else '?'}; rollouts = RL steps × prompts × samples (the cost).\n",
        "\n".join(rows) + "\n", frozen + "\n",
        "Made by:\n", f"```\n{command}\n```\n"])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides, rest = config_lib.split_config_flags(argv)
    parser = argparse.ArgumentParser(description="choose the study's regime on GRPO alone")
    parser.add_argument("--out", required=True, help="the report (markdown); a .json with the numbers beside it")
    parser.add_argument("--work", default="/tmp/sage_reproduce", help="checkpoints and run records (resumable)")
    parser.add_argument("--records", default=None, help="also keep each finished run's record.json here")
    parser.add_argument("--seeds", type=int, default=3, help="GRPO seeds per candidate (>= 2 for an interval)")
    parser.add_argument("--candidates", default="", help="comma-separated subset (default: all)")
    parser.add_argument("--budget", choices=("tiny", "quick", "full", "study"), default="study")
    parser.add_argument("--tiny", action="store_true", help="the smoke: tiny budget, seconds")
    args = parser.parse_args(rest)
    known = list(worklist.arms_module().REGIME_CANDIDATES)
    names = [c.strip() for c in args.candidates.split(",") if c.strip()] or known
    if unknown := [c for c in names if c not in known]:
        raise ValueError(f"--candidates: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    budget = "tiny" if args.tiny else args.budget
    command = "python -m sage_jax.experiments.regime " + " ".join(argv)
    results = search(names, budget, args.seeds, overrides, args.work, args.records, command)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(render(results, budget, command))
    evaluation.write_json(os.path.splitext(args.out)[0] + ".json",
                          {"budget": budget, "selected": selected(results), "candidates": results})
    print(f"wrote {args.out}; selected: {selected(results)}", flush=True)
    return 0


if __name__ == "__main__":
    from sage_jax.run import cli
    cli.main_guard(main)
