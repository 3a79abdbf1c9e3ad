"""The SmolLM2 study's report, from its committed result files alone (--out/runs/ARM/seedK.json): RESULTS.md,
results.json and the figures (pass@k per arm with 95% bands over seeds; pass@k minus the base's, paired by seed;
training curves). Statistics are experiments/stats.py's: 95% t-intervals over seeds, paired-by-seed t-tests with
Holm's correction over every comparison made, and the minimum detectable effect of each."""

from __future__ import annotations

import glob
import math
import os
import re
import statistics
from typing import Any, Mapping, Sequence

import numpy as np

from sage_jax.eval import passk as evaluation
from sage_jax.experiments import plots, report
from sage_jax.experiments.smollm2_run import SPLIT, read_result, write_result
from sage_jax.experiments.stats import aggregate, fmt, holm, mean_ci, paired_diffs, paired_test, pass_curve

ARM_ORDER = ("base", "grpo", "branch", "nokl", "top_entropy")
# each comparison: arm minus its reference, paired by seed; Branch - GRPO first (the study's question)
PAIRS = (("branch", "grpo"), ("grpo", "base"), ("branch", "base"), ("nokl", "grpo"), ("top_entropy", "grpo"))
PRIMARY = ("branch", "grpo", 16)  # the comparison the study is sized for: Branch - GRPO on pass@16
ACTED_TOL = report.ACTED_TOL


def load_runs(out: str, sub: str = "runs") -> dict[str, dict[int, dict[str, Any]]]:
    """{arm: {seed: record}} from out/SUB/ARM/seedK.json (files of another schema are left out)."""
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(glob.glob(os.path.join(out, sub, "*", "seed*.json"))):
        m = re.fullmatch(r"seed(\d+)\.json", os.path.basename(path))
        record = read_result(path) if m else None
        if record is not None:
            found.setdefault(os.path.basename(os.path.dirname(path)), {})[int(m.group(1))] = record
    order = [a for a in ARM_ORDER if a in found] + sorted(a for a in found if a not in ARM_ORDER)
    return {a: found[a] for a in order}


def _tail(values: Sequence[float | None], frac: float = 0.25) -> float:
    x = [v for v in values or [] if v is not None]
    return float(np.mean(x[-max(1, int(round(len(x) * frac))):])) if x else math.nan


def summarize(record: Mapping[str, Any]) -> dict[str, Any]:
    """A run's scalars and pass@k curve, recomputed from its per-problem correct counts."""
    ev = record["eval"]
    curve = pass_curve([{"n": n, "correct": c} for n, c in zip(ev["n"], ev["correct"])])
    out: dict[str, Any] = {f"{SPLIT}/curve": curve, **{f"{SPLIT}/pass@{k}": v for k, v in enumerate(curve, 1)}}
    for key in ("distinct_forms", "distinct_correct", "distinct_answers"):
        out[f"{SPLIT}/{key}"] = float(np.mean(ev[key]))
    curves = record.get("curves") or {}
    for name in ("reward", "entropy", "kl"):
        if curves.get(name):
            out[f"train/{name}_end"] = _tail(curves[name])
    guide = record.get("guide") or {}
    for name in ("q_mean", "q_active"):
        if guide.get(name) is not None:
            out[f"train/{name}"] = float(guide[name])
    times = record.get("times") or {}
    out["cpu_min"] = (times.get("train_cpu_s", 0.0) + times.get("eval_cpu_s", 0.0)) / 60
    return out


def build(runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> dict[str, Any]:
    per_seed = {arm: {s: summarize(r) for s, r in sorted(by_seed.items())} for arm, by_seed in runs.items()}
    agg = {arm: aggregate(list(rows.values())) for arm, rows in per_seed.items() if rows}
    n = min(len(row[f"{SPLIT}/curve"]) for rows in per_seed.values() for row in rows.values())
    return {"per_seed": per_seed, "aggregate": agg, "n": n, "comparisons": comparisons(per_seed, n),
            "warnings": warnings(runs)}


def metrics(n: int) -> list[tuple[str, str]]:
    ks = sorted({1, min(16, n), n})
    return [(f"{SPLIT}/pass@{k}", f"pass@{k}") for k in ks] + [(f"{SPLIT}/distinct_forms", "distinct forms")]


def comparisons(per_seed: Mapping[str, Mapping[int, Mapping[str, Any]]], n: int) -> list[dict[str, Any]]:
    """Every (pair, metric) paired-by-seed t-test with a Holm-adjusted p over all of them (those with >= 2 seeds)."""
    rows = [{"pair": (a, b), "key": key, "metric": label, **paired_test(paired_diffs(per_seed[a], per_seed[b], key))}
            for a, b in PAIRS if a in per_seed and b in per_seed for key, label in metrics(n)]
    for row, p in zip(rows, holm([r["p"] for r in rows])):
        row["p_holm"] = p
    return rows


def warnings(runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> list[str]:
    out = []
    for arm, by_seed in runs.items():
        if len({r.get("arm_fingerprint") for r in by_seed.values()}) > 1:
            out.append(f"{arm}: its seeds were made with different settings (arm_fingerprint differs); rerun the "
                       "odd ones with the current config")
    weights = {r.get("weights") for by_seed in runs.values() for r in by_seed.values()}
    if len(weights) > 1:
        out.append(f"the runs started from {len(weights)} different sets of weights: {sorted(map(str, weights))}")
    return out


# --------------------------------------------------------------------------------------------------- tables

def _cell(agg: Mapping[str, Any], key: str, digits: int = 3) -> str:
    return fmt(*agg.get(key, (math.nan, math.nan)), digits=digits)


def arms_table(results: Mapping[str, Any]) -> str:
    n = results["n"]
    ks = sorted({1, 4 if n >= 4 else 1, min(16, n), n})
    head = (["arm", "seeds"] + [f"pass@{k}" for k in ks] + ["distinct correct forms", "distinct answers",
            "train reward (last ¼)", "entropy (last ¼)", "q_mean", "q ≠ 1 share", "CPU min / run"])
    rows = []
    for arm, agg in results["aggregate"].items():
        rows.append([arm, str(len(results["per_seed"][arm]))] + [_cell(agg, f"{SPLIT}/pass@{k}") for k in ks]
                    + [_cell(agg, f"{SPLIT}/distinct_forms", 2), _cell(agg, f"{SPLIT}/distinct_answers", 2),
                       _cell(agg, "train/reward_end"), _cell(agg, "train/entropy_end"), _cell(agg, "train/q_mean"),
                       _cell(agg, "train/q_active"), _cell(agg, "cpu_min", 1)])
    return report._table(head, rows)


def pass_table(results: Mapping[str, Any]) -> str:
    ks = evaluation.default_ks(results["n"])
    return report._table(["arm"] + [f"pass@{k}" for k in ks],
                         [[arm] + [_cell(agg, f"{SPLIT}/pass@{k}") for k in ks]
                          for arm, agg in results["aggregate"].items()])


_diff = report._diff_cell  # one format for a paired difference in both studies' reports


def pairs_tables(results: Mapping[str, Any]) -> tuple[str, str]:
    """(differences with Holm-adjusted p, minimum detectable effects); empty strings when no pair ran."""
    by_pair: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results["comparisons"]:
        by_pair.setdefault(tuple(r["pair"]), {})[r["metric"]] = r
    if not by_pair:
        return "", ""
    labels = [label for _, label in metrics(results["n"])]
    seeds = lambda cells: str(max(c["n"] for c in cells.values()))
    diffs = report._table(["pair (same seeds)", "seeds"] + labels,
                          [[f"{a} − {b}", seeds(c)] + [_diff(c[l]) for l in labels] for (a, b), c in by_pair.items()])
    mdes = report._table(["pair", "seeds"] + labels, [[f"{a} − {b}", seeds(c)] + [fmt(c[l]["mde"]) for l in labels]
                                                      for (a, b), c in by_pair.items()])
    return diffs, mdes


def activity_table(runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> str:
    rows = []
    for arm, by_seed in runs.items():
        guides = [r["guide"] for r in by_seed.values() if r.get("guide")]
        if not guides or all(g.get("name") == "none" for g in guides):
            continue
        q = [g["q_mean"] for g in guides if g.get("q_mean") is not None]
        active = [g["q_active"] for g in guides if g.get("q_active") is not None]
        taus = sorted({r.get("tau") for r in by_seed.values() if r.get("tau") is not None})
        acted = bool(q) and abs(statistics.fmean(q) - 1.0) >= ACTED_TOL
        rows.append([arm, ", ".join(f"{t:.3f}" for t in taus) or "–", fmt(*mean_ci(q)), fmt(*mean_ci(active)),
                     ", ".join(f"{v:.3f}" for v in q), "acted" if acted else "**did not act**"])
    return report._table(["arm", "tau (nats)", "q_mean (training)", "share of tokens with q ≠ 1", "q_mean per run",
                          "status"], rows) if rows else ""


def runs_table(runs: Mapping[str, Mapping[int, Mapping[str, Any]]], n: int) -> str:
    rows = []
    for arm, by_seed in runs.items():
        for seed, r in sorted(by_seed.items()):
            s, t = summarize(r), r.get("times") or {}
            rows.append([arm, str(seed), fmt(s[f"{SPLIT}/pass@1"]), fmt(s[f"{SPLIT}/pass@{n}"]),
                         fmt(s[f"{SPLIT}/distinct_forms"], digits=2),
                         fmt(s.get("train/q_mean", math.nan)), f"{t.get('train_wall_s', 0) / 60:.1f}",
                         f"{t.get('train_cpu_s', 0) / 60:.1f}", f"{t.get('eval_wall_s', 0) / 60:.1f}",
                         f"{t.get('eval_cpu_s', 0) / 60:.1f}", str((r.get("host") or {}).get("finished_utc", "")),
                         str(r.get("fingerprint", ""))[:8]])
    return report._table(["arm", "seed", "pass@1", f"pass@{n}", "distinct forms", "q_mean", "RL wall min",
                          "RL CPU min", "eval wall min", "eval CPU min", "finished (UTC)", "fingerprint"], rows)


def settings_block(runs: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> str:
    """The settings every arm shares (beyond configs/smollm2_cpu.py), then each arm's own."""
    skip = ("seed", "experiment.arm", "experiment.preset")
    firsts = {arm: {k: v for k, v in (by_seed[min(by_seed)].get("settings") or {}).items() if k not in skip}
              for arm, by_seed in runs.items()}
    shared = {k: v for k, v in next(iter(firsts.values())).items()
              if all(k in f and f[k] == v for f in firsts.values())}
    show = lambda d: ", ".join(f"{k}={v!r}" for k, v in d.items()) or "(nothing more)"
    return "\n".join([f"every arm: {show(shared)}"] + [f"{arm}: {show({k: v for k, v in f.items() if k not in shared})}"
                                                       for arm, f in firsts.items()])


# --------------------------------------------------------------------------------------------------- figures

def figure_vs_base(per_seed: Mapping[str, Mapping[int, Mapping[str, Any]]], path: str, title: str) -> bool:
    """pass@k minus the base's, paired by seed (mean, 95% band), one line per arm; False when there is no base."""
    if "base" not in per_seed or len(per_seed) < 2:
        return False
    plt = plots._plt()
    arms = [a for a in per_seed if a != "base"]  # the colours of pass_at_k.png
    fig, ax = plt.subplots(figsize=(7, 4.2))
    key = f"{SPLIT}/curve"
    for arm in arms:
        mean, half = plots.paired_curve(per_seed, arm, "base", key)
        if mean:
            plots._band(ax, np.arange(1, len(mean) + 1), mean, half, plots._color(arm, arms), arm, **plots._style(arm))
    ax.axhline(0.0, color="black", linewidth=0.8)
    n = len(next(iter(per_seed["base"].values()))[key])
    ticks = [k for k in (2 ** i for i in range(12)) if k <= n]
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(k) for k in ticks])
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k − base (same seeds)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def figures(out: str, results: Mapping[str, Any], runs) -> list[str]:
    per_seed, agg, n = results["per_seed"], results["aggregate"], results["n"]
    trained = {a: g for a, g in agg.items() if a != "base"}
    problems = next(iter(next(iter(runs.values())).values()))["problems"]
    made = []
    if trained:
        base = ({f"{SPLIT}/curve": agg["base"][f"{SPLIT}/curve"]} if "base" in agg
                else {f"{SPLIT}/curve": ([math.nan] * n, None)})
        plots.pass_at_k(trained, base, SPLIT, os.path.join(out, "pass_at_k.png"),
                        f"pass@k, {problems} held-out problems, n={n} (bands: 95% over seeds)", per_seed,
                        base_label="base (pretrained; mean over seeds)")
        made.append("pass_at_k.png")
        curves = {a: [r.get("curves") or {} for _, r in sorted(runs[a].items())] for a in trained}
        plots.training(curves, os.path.join(out, "training_curves.png"))
        made.append("training_curves.png")
    if figure_vs_base(per_seed, os.path.join(out, "pass_at_k_vs_base.png"), "pass@k minus the base's, paired by seed"):
        made.append("pass_at_k_vs_base.png")
    return made


# --------------------------------------------------------------------------------------------------- the page

def _primary_line(results: Mapping[str, Any]) -> str:
    a, b, k = PRIMARY
    k = min(k, results["n"])
    row = next((r for r in results["comparisons"] if tuple(r["pair"]) == (a, b) and r["metric"] == f"pass@{k}"), None)
    if row is None or row["n"] < 2:
        return f"The primary comparison ({a} − {b}, pass@{k}) has fewer than 2 paired seeds so far.\n"
    return (f"Primary comparison, {a} − {b} on pass@{k} over {row['n']} paired seeds: {_diff(row)}; the smallest "
            f"effect this design detects (80% power, alpha 0.05): {row['mde']:.3f}.\n")


def render(out: str, runs, results, made: Sequence[str]) -> str:
    n = results["n"]
    total_cpu = sum((r.get("times") or {}).get(k, 0.0) for by in runs.values() for r in by.values()
                    for k in ("train_cpu_s", "eval_cpu_s")) / 3600
    problems = next(iter(next(iter(runs.values())).values()))["problems"]
    diffs, mdes = pairs_tables(results)
    comparisons = sum(1 for r in results["comparisons"] if not math.isnan(r["p"]))
    commands = list(dict.fromkeys(r.get("command") for by in runs.values() for r in by.values() if r.get("command")))
    md = [f"# GRPO against SAGE-Branch on SmolLM2-135M-Instruct (CPU): {len(runs)} arms\n",
          f"Held-out: {problems} generated arithmetic word problems disjoint from the training problems, n = {n} "
          f"samples each; pass@k by the unbiased estimator, averaged over problems. Recorded CPU time of everything "
          f"below: {total_cpu:.2f} h.\n",
          *(["**Warnings:** " + "; ".join(results["warnings"]) + "\n"] if results["warnings"] else []),
          *report._included(out, report.REGIME, "Regime, chosen on GRPO alone before any guided arm ran"),
          *report._included(out, report.READING, "Reading"),
          "## Arms\n", "Cells: mean ± 95% t half-width over seeds (a cell without ± is one seed). The base is the "
          "pretrained model evaluated with each seed's sampling key. *distinct correct forms*: distinct arithmetic "
          "written out (numbers and operators, wording dropped) among a problem's correct samples; *distinct "
          "answers*: distinct final numbers among all n samples; *q_mean*, *q ≠ 1 share*: the guide's sage/q_mean "
          "and sage/q_active averaged over RL steps.\n", arms_table(results), _primary_line(results)]
    if diffs:
        md += ["## Paired differences\n", f"Arm minus reference over the seeds both ran: mean ± 95% t half-width, and "
               f"the paired t-test p-value Holm-adjusted over all {comparisons} comparisons in this table (* Holm p < "
               "0.05).\n", diffs, "Minimum detectable effect of each comparison: (t_{0.975, s-1} + t_{0.8, s-1}) · "
               "sd / √s with the observed sd of the paired differences over s seeds (80% power, two-sided alpha 0.05 "
               "before Holm).\n", mdes]
    activity = activity_table(runs)
    if activity:
        md += ["## Guide activity\n", f"Per run, sage/q_mean and the share of tokens with q ≠ 1 averaged over RL "
               f"steps. A Branch arm whose q_mean stays within {ACTED_TOL:.0%} of 1 **did not act**.\n", activity]
    md += ["## pass@k\n"] + [f"![{m}]({m})\n" for m in made] + [pass_table(results),
           "## Runs\n", runs_table(runs, n), "## Settings (each arm's differences from configs/smollm2_cpu.py)\n",
           "```\n" + settings_block(runs) + "\n```\n", "## Commands\n", "```\n" + "\n".join(commands) + "\n```\n"]
    return "\n".join(md)


def write(out: str) -> str:
    """RESULTS.md, results.json and the PNGs in out from out/runs/*/seed*.json; returns the markdown."""
    runs = load_runs(out)
    if not runs:
        raise FileNotFoundError(f"no result files under {os.path.join(out, 'runs')}: run the study first")
    results = build(runs)
    made = figures(out, results, runs)
    text = render(out, runs, results, made)
    with open(os.path.join(out, "RESULTS.md"), "w", encoding="utf-8") as f:
        f.write(text)
    write_result(os.path.join(out, "results.json"), {"schema": "smollm2_study/results", **results})
    return text
