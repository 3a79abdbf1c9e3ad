"""The report's prose: description, commands, hyperparameters, run times and the full-run estimate, caveats."""

from __future__ import annotations

import os
import statistics
from typing import Any, Mapping, Sequence

SPLITS = ("countdown", "countdown_rl", "countdown_ood")  # report order: held-out first, OOD last


def _flat(d: Mapping[str, Any], prefix: str = "") -> list[str]:
    lines = []
    for k in sorted(d):
        v = d[k]
        if isinstance(v, Mapping):
            lines += _flat(v, f"{prefix}{k}.")
        else:
            lines.append(f"{prefix}{k} = {v!r}")
    return lines


def arm_times(records: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> dict[str, dict[str, float]]:
    out = {}
    for arm, runs in records.items():
        times = [r["times"] for r in runs.values()]
        if times:
            out[arm] = {k: statistics.fmean(t[k] for t in times)
                        for k in ("train_wall_s", "train_cpu_s", "eval_wall_s", "step_s")}
    return out


def estimate(full, base_record, records, n_arms: int) -> dict[str, float]:
    """Seconds a `full` run (+ sweep) would take, extrapolated from the recorded runs' measured costs.

    Per-step costs carry over because the budgets differ only in step counts, seeds and evaluation sizes:
    a run costs (its fixed overhead: compiles, setup) + (median step time) x steps; evaluation costs a measured
    time per sampled completion; SFT a measured time per step. cpu_ratio (process CPU s per wall s during RL) turns
    wall times measured on a busy machine into those of a quiet one, for a process that uses about one core.
    """
    runs = [r for arm in records.values() for r in arm.values()]
    if not runs:
        return {}
    per_step = statistics.median(r["times"]["step_s"] for r in runs)
    overhead = statistics.median(max(r["times"]["train_wall_s"] - r["times"]["step_s"] * len(r["curves"]["step"]), 0.0)
                                 for r in runs)
    rows = {id(r): sum(len(s) * s[0]["n"] for s in r["eval"].values()) for r in runs}
    per_row = statistics.median(r["times"]["eval_wall_s"] / rows[id(r)] for r in runs)
    sft_steps = max(base_record.get("sft_steps", 1), 1)
    sft = base_record["times"]["sft_wall_s"] / sft_steps * full.sft.steps
    full_rows = full.eval.n * (full.eval.problems + full.experiment.ood_problems + full.experiment.rl_eval_problems)
    one_run = overhead + per_step * full.train.steps + per_row * full_rows
    est = {"sft_s": sft, "per_run_s": one_run, "rl_runs": n_arms * full.experiment.seeds,
           "total_s": sft + per_row * full_rows + n_arms * full.experiment.seeds * one_run,
           "sweep_s": len(full.experiment.sweep_gammas) * len(full.experiment.sweep_taus) * full.experiment.sweep_seeds
           * one_run, "per_step_s": per_step, "overhead_s": overhead, "per_row_ms": per_row * 1e3,
           "cpu_ratio": sum(r["times"]["train_cpu_s"] for r in runs) / sum(r["times"]["train_wall_s"] for r in runs)}
    return est


def meta(config, budget: str, seeds: int, arms: Sequence[str], sweep: bool, sweep_seeds: int, command: str,
         base_record: Mapping[str, Any], records, sweep_records, wall: float, cpu: float, loads, arms_mod, full
         ) -> dict[str, Any]:
    """The report's metadata; `full` is the full-budget GRPO config, for the time estimate of a full run."""
    from sage_jax.models import build
    from sage_jax.rewards import countdown
    n = int(config.eval.n)
    splits = [s for s in SPLITS if s in base_record["eval"]]
    problems = {s: len(base_record["eval"][s]) for s in splits}
    est = estimate(full, base_record, records, len(arms_mod.ARMS))
    counts = sorted({len(by_seed) for by_seed in records.values()})
    seeds_text = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    m = config.model
    num_params = build.model_config(config, vocab_size=countdown.CountdownTokenizer().vocab_size).num_params
    description = (
        "RL from one shared SFT base on countdown (reach a target with + - * / using each given number once; "
        "verifiable, several distinct solutions per problem). The base's SFT demonstrations spread unevenly over "
        "valid strategies (each demo's strategy drawn with weights "
        f"{', '.join(f'{k} {config.sft.mode_weights[k]}' for k in ('mul', 'add', 'sub', 'div'))} among those its "
        "problem has; the resulting shares are in the strategy table): a dominant mode and rarer valid ones, so RL "
        "can sharpen onto the dominant mode or keep the rare ones. Every arm starts from "
        "the same base, uses the same seeds (seed = RL sampling + guide randomness + prompt order), budget and "
        "hyperparameters, and differs from GRPO only in its row of the arms table. pass@k is the unbiased estimator "
        f"(evaluation.pass_at_k) from n = {n} samples per problem, for k = 1..{n}.")
    diffs = {a: ", ".join(f"{k}={v!r}" for k, v in arms_mod.ARMS[a].items()) for a in arms}
    arm_lines = ["| arm | difference from grpo |", "|---|---|"] + [
        f"| {a} | {d or '(reference: k3 anchor to pi_ref, no guide)'} |" for a, d in diffs.items()]
    ent = base_record.get("entropy", {})
    ent_line = ""
    if ent:
        ent_line = (f"\n\nBase policy entropy on its own held-out samples ({ent['tokens']} tokens): mean "
                    f"{ent['mean']:.3f} nats; quantiles " + ", ".join(f"q{float(q) * 100:g} {v:.2f}"
                                                                     for q, v in ent["quantiles"].items())
                    + "; fraction of tokens above tau: " + ", ".join(f"{t}: {v:.3f}"
                                                                      for t, v in ent["frac_above"].items()) + ".")
    setup = (f"Model: Qwen2-style decoder, {m.num_layers} layers, width {m.hidden_size}, {m.num_heads} heads "
             f"({m.num_kv_heads} KV), MLP {m.intermediate_size}, character tokenizer (~{num_params / 1e6:.2f}M "
             f"parameters), fp32. Data: countdown with 3 numbers in 1..{config.data.max_number}; "
             f"{config.experiment.sft_problems} problems for SFT demonstrations, another "
             f"{config.data.num_train - config.experiment.sft_problems} as RL prompts (unseen by the base), "
             f"{problems['countdown']} held-out problems from the same generator (ID) and {problems['countdown_ood']} "
             f"problems of {config.data.ood_num_numbers} numbers in 2..{config.data.ood_max_number} (OOD: numbers "
             f"beyond the training range, tasks.countdown_sets). SFT: {config.sft.steps} steps x "
             f"{config.sft.batch_size} on "
             f"{config.sft.num_demos} demonstrations. RL: {config.train.steps} steps x "
             f"{config.rollout.prompts_per_step} prompts x {config.rollout.group_size} samples, lr {config.optim.lr}, "
             f"beta {config.loss.beta}; "
             f"Branch gamma {config.loss.gamma}, tau {config.loss.tau}. Seeds per arm: "
             + ", ".join(f"{a} {len(records[a])}" for a in arms) + ".\n\n"
             + "\n".join(arm_lines) + ent_line + "\n\nFull configuration of the grpo arm (configs/countdown_arms.py"
             f":grpo,{budget}):")
    hyper = "\n".join(_flat({k: v for k, v in config.to_dict().items() if k not in ("mesh",)}))
    times = arm_times(records)
    all_runs = [r for runs in (*records.values(), *sweep_records.values()) for r in runs.values()]
    timing = _timing(config, full, est, base_record["times"], all_runs, command, wall, cpu, loads)
    caveats = _caveats(config, counts[0], seeds_text, arms)
    commands = _commands(command, [base_record, *all_runs])
    sweep_note = (f"{sweep_seeds} seed(s) per cell, otherwise the {config.experiment.sweep_arm} arm; taus chosen "
                  "around the base policy's token entropies (see the setup section).")
    return {"budget": budget, "seeds": seeds, "seeds_text": seeds_text, "arms": list(arms), "n": n, "splits": splits,
            "problems": problems, "description": description, "setup": setup, "hyperparameters": hyper,
            "timing": timing, "caveats": caveats, "commands": commands, "arm_times": times,
            "demo_shares": base_record.get("demo_shares"), "sweep_note": sweep_note,
            "base_entropy": ent, "estimate": est, "wall_s": wall, "cpu_s": cpu, "loadavg": [list(l) for l in loads],
            "sweep": sweep}


def _timing(config, full, est, base_t, all_runs, command: str, wall: float, cpu: float, loads) -> str:
    cores = os.cpu_count() or 1
    rl_s = sum(r["times"]["train_wall_s"] for r in all_runs)
    ev_s = sum(r["times"]["eval_wall_s"] for r in all_runs)
    timing = (("This invocation (--report-only: rendering alone): " if "--report-only" in command else
               "This invocation: ") + f"{wall / 60:.1f} min wall, {cpu / 60:.1f} min process CPU on {cores} cores "
              f"(load average {loads[0][0]:.1f} at the start, {loads[1][0]:.1f} at the end; on a shared machine wall "
              f"times are inflated). Recorded time of everything in this report, whenever it ran: "
              f"{(base_t['sft_wall_s'] + base_t['eval_wall_s'] + rl_s + ev_s) / 60:.1f} min = SFT base "
              f"{base_t['sft_wall_s']:.0f} s ({config.sft.steps} steps) + base eval {base_t['eval_wall_s']:.0f} s + "
              f"RL {rl_s:.0f} s + eval {ev_s:.0f} s over {len(all_runs)} runs.")
    if est:
        timing += (
            f"\n\nEstimated `full` run ({est['rl_runs'] // full.experiment.seeds} arms x {full.experiment.seeds} "
            f"seeds, {full.train.steps} RL steps, {full.sft.steps} SFT steps, n={full.eval.n} on "
            f"{full.eval.problems}+{full.experiment.ood_problems} problems), extrapolated from this run's measured "
            f"costs (median {est['per_step_s']:.2f} s per RL step, "
            f"{est['overhead_s']:.0f} s fixed per run, {est['per_row_ms']:.2f} ms per sampled eval completion): "
            f"{est['total_s'] / 3600:.1f} h at this run's speed"
            + (f", about {est['total_s'] * est['cpu_ratio'] / 3600:.1f} h on a quiet machine (the RL runs got "
               f"{est['cpu_ratio']:.2f} CPU seconds per wall second; the process mostly keeps one core busy)"
               if est['cpu_ratio'] < 0.95 else "")
            + f"; `--sweep` adds {est['sweep_s'] / 3600:.1f} h ({len(full.experiment.sweep_gammas)} x "
              f"{len(full.experiment.sweep_taus)} cells x {full.experiment.sweep_seeds} seed).")
    return timing


def _caveats(config, seeds: int, seeds_text: str, arms: Sequence[str]) -> str:
    """seeds: the fewest any arm has (seeds_text: their range)."""
    dapo = any(a.startswith("dapo") for a in arms)
    bnpo = any(a.startswith("bnpo") for a in arms)
    kl_cov = any("kl_cov" in a for a in arms)
    lines = [
        "- A sub-1M-parameter model, a few dozen RL steps and a synthetic task: a test of the mechanism (does "
        "reshaping the anchor keep rare valid modes), not of the paper's numbers.",
        f"- {seeds_text} seed(s) per arm" + (": no intervals; differences between arms are within what seeds move"
                                             " unless a full run says otherwise." if seeds < 2 else
                                             "; 95% t-intervals with so few seeds are wide.")]
    lines += ([
        "- DAPO arms draw extra rollouts when groups have zero reward variance (dynamic sampling, up to "
        f"{config.train.max_resample} extra rounds), so they spend more sampling compute per step; overlong "
        "shaping is off (completions are ~10 tokens of a 24-token budget). Their logged train reward is over the "
        "kept (mixed-outcome) groups, so it reads higher than the other arms' and is not comparable with them."]
        if dapo else [])
    lines += ["- BNPO here is its token-mean loss aggregation (no beta-normalised advantages)."] if bnpo else []
    lines += ([
        "- KL-Cov penalises |log pi - log pi_old|, which has no gradient on a batch's first (on-policy) update: with "
        f"{config.optim.num_iterations * config.optim.mini_batches} update(s) per batch here it "
        + ("cannot act (Guide activity marks it)." if config.optim.num_iterations * config.optim.mini_batches == 1
           else "acts from the second update on.")] if kl_cov else [])
    lines += [
        "- The top-entropy quantile and KL-Cov's covariance are over the rows of one loss call (one micro-batch).",
        "- The trainer draws countdown problems from config.seed; until config.data has its own seed, every run "
        "here reuses the base's problem sets (see reproduce.run_experiment), so seeds change RL randomness only."]
    return "\n".join(lines)


def _commands(command: str, records) -> list[str]:
    made_by = list(dict.fromkeys(r.get("command") for r in records if r.get("command")))
    return ["# the runs in this report were made by:", *made_by] + (
        ["# and this report rendered by:", command] if made_by != [command] else []) + [
                "", "# the budgets (configs/countdown_arms.py BUDGETS) and other uses:",
                "python -m sage_jax.experiments.reproduce --out DIR --quick          # 1 seed, short SFT and RL",
                "python -m sage_jax.experiments.reproduce --out DIR                  # full: 3 seeds, 80 RL steps",
                "python -m sage_jax.experiments.reproduce --out DIR --sweep          # + Branch gamma x tau grid",
                "python -m sage_jax.experiments.reproduce --out DIR --report-only    # render what has finished",
                "# round 2: the GRPO-only regime search, then the study (records kept for later sessions)",
                "python -m sage_jax.experiments.regime --out docs/results/study_countdown/regime.md "
                "--records docs/results/study_countdown/runs",
                "python -m sage_jax.experiments.reproduce --budget study --arms STUDY --sweep "
                "--out docs/results/study_countdown --records docs/results/study_countdown/runs"]
