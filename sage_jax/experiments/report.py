"""RESULTS.md, results.json and the figures from the experiment's run records (see reproduce.py for their layout)."""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import numpy as np

from sage_jax.eval import passk as evaluation
from sage_jax.experiments import plots
from sage_jax.experiments.stats import aggregate, fmt, holm, paired_diffs, paired_test, summarize_run
from sage_jax.rewards import countdown

SPLIT_NAMES = {"countdown": "held-out (ID)", "countdown_ood": "OOD (wider number range)",
               "countdown_rl": "RL prompts (trained on)"}
RL = "countdown_rl"
# each arm against its baseline: the paper-form Branch against GRPO with the same (k1-in-reward) anchor
PAIRS = (("grpo_branch", "grpo"), ("grpo_branch_paper", "grpo_rkl"), ("grpo_rkl", "grpo"), ("grpo_token", "grpo"),
         ("grpo_random", "grpo"), ("fkl", "grpo"), ("grpo_nokl", "grpo"), ("grpo_entropy", "grpo"),
         ("grpo_top_entropy", "grpo"), ("grpo_kl_cov", "grpo"), ("dapo_branch", "dapo"), ("bnpo_branch", "bnpo"))
ACTED_TOL = 0.01  # a guided arm whose q_mean over training stays within 1% of 1 did not act
CI_NOTE = ("Cells are mean ± half-width of the 95% Student-t interval over seeds (t_{0.975, s-1} · sd / √s, sd "
           "with ddof 1); a cell without ± comes from one seed (no interval). The base row is one evaluation of the "
           "shared SFT model.")


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], align_first: bool = True) -> str:
    sep = ["---"] + ["---:"] * (len(header) - 1) if align_first else ["---:"] * len(header)
    return "\n".join([_row(header), _row(sep)] + [_row(r) for r in rows]) + "\n"


def _ks(n: int) -> list[int]:
    return evaluation.default_ks(n)


def _cell(agg: Mapping[str, Any], key: str, digits: int = 3) -> str:
    return fmt(*agg.get(key, (math.nan, math.nan)), digits=digits)


def _signed(mean: float, half: float, count: int) -> str:
    if math.isnan(mean):
        return "–"
    text = f"{mean:+.3f}" + ("" if math.isnan(half) else f" ± {half:.3f}")
    return text + (" *" if not math.isnan(half) and abs(mean) > half else "") + ("" if count > 1 else " (1 seed)")


def build(base_record: Mapping[str, Any], records: Mapping[str, Mapping[int, Mapping[str, Any]]],
          sweep: Mapping[tuple[float, float], Mapping[int, Mapping[str, Any]]], meta: Mapping[str, Any]
          ) -> dict[str, Any]:
    """Summaries per arm and seed, aggregates over seeds, sweep cells: the content of results.json."""
    per_seed = {arm: {seed: summarize_run(rec) for seed, rec in sorted(runs.items())} for arm, runs in records.items()}
    base = summarize_run(base_record)
    agg = {arm: aggregate(list(runs.values())) for arm, runs in per_seed.items() if runs}
    sweep_cells = {}
    for (gamma, tau), runs in sorted(sweep.items()):
        summaries = [summarize_run(r) for _, r in sorted(runs.items())]
        if summaries:
            sweep_cells[f"gamma={gamma},tau={tau}"] = {"gamma": gamma, "tau": tau, "seeds": len(summaries),
                                                       **{k: v for k, v in aggregate(summaries).items()
                                                          if not k.endswith("/curve")}}
    return {"meta": dict(meta), "base": base, "per_seed": per_seed, "aggregate": agg, "sweep": sweep_cells,
            "curves": {arm: [rec.get("curves", {}) for _, rec in sorted(runs.items())]
                       for arm, runs in records.items()}}


def _headline(results: Mapping[str, Any], splits: Sequence[str], n: int) -> str:
    id_split, ood = splits[0], splits[-1]
    header = ["arm", "seeds", "ID pass@1", "ID pass@16" if n >= 16 else "ID pass@" + str(n // 2 or 1),
              f"ID pass@{n}", "OOD pass@1", f"OOD pass@{n}", "ID distinct sols / problem", "ID coverage",
              "entropy (end)", "train reward (end)"]
    rl = RL in splits  # the RL prompts' columns after the held-out ones
    if rl:
        header[6:6] = ["RL-prompt pass@1", f"RL-prompt pass@{n}", "RL-prompt distinct"]
    mid = min(16, max(n // 2, 1))
    rows = []
    base = {k: (v, math.nan) for k, v in results["base"].items() if not k.endswith("/curve")}
    for name, agg, seeds in [("base (SFT)", base, 1)] + [(a, g, len(results["per_seed"][a]))
                                                        for a, g in results["aggregate"].items()]:
        rows.append([name, str(seeds) if name != "base (SFT)" else "–", _cell(agg, f"{id_split}/pass@1"),
                     _cell(agg, f"{id_split}/pass@{mid}"), _cell(agg, f"{id_split}/pass@{n}"),
                     _cell(agg, f"{ood}/pass@1"), _cell(agg, f"{ood}/pass@{n}"),
                     _cell(agg, f"{id_split}/distinct", 2), _cell(agg, f"{id_split}/coverage"),
                     _cell(agg, "train/entropy_end"), _cell(agg, "train/reward_end")])
        if rl:
            rows[-1][6:6] = [_cell(agg, f"{RL}/pass@1"), _cell(agg, f"{RL}/pass@{n}"), _cell(agg, f"{RL}/distinct", 2)]
    return _table(header, rows)


def _pass_table(results: Mapping[str, Any], split: str, n: int) -> str:
    ks = _ks(n)
    rows = [["base (SFT)"] + [fmt(results["base"][f"{split}/pass@{k}"]) for k in ks]]
    rows += [[arm] + [_cell(agg, f"{split}/pass@{k}") for k in ks] for arm, agg in results["aggregate"].items()]
    return _table(["arm"] + [f"pass@{k}" for k in ks], rows)


def _coverage_table(results: Mapping[str, Any], splits: Sequence[str]) -> str:
    header = ["arm"] + [f"{SPLIT_NAMES.get(s, s)}: {m}" for s in splits for m in ("distinct", "coverage")]
    base = results["base"]
    rows = [["base (SFT)"] + [fmt(base[f"{s}/{m}"], digits=2 if m == "distinct" else 3) for s in splits
                              for m in ("distinct", "coverage")]]
    rows += [[arm] + [_cell(agg, f"{s}/{m}", 2 if m == "distinct" else 3) for s in splits
                      for m in ("distinct", "coverage")] for arm, agg in results["aggregate"].items()]
    return _table(header, rows)


def _share_rows(results: Mapping[str, Any], split: str) -> dict[str, dict[str, tuple[float, float]]]:
    rows = {}
    demo = results["meta"].get("demo_shares")
    if demo:
        rows["SFT demos"] = {s: (demo.get(s, 0.0), math.nan) for s in countdown.STRATEGIES}
    rows["base (SFT)"] = {s: (results["base"][f"{split}/share/{s}"], math.nan) for s in countdown.STRATEGIES}
    for arm, agg in results["aggregate"].items():
        rows[arm] = {s: agg[f"{split}/share/{s}"] for s in countdown.STRATEGIES}
    return rows


def _share_table(rows: Mapping[str, Mapping[str, tuple[float, float]]]) -> str:
    return _table(["run"] + list(countdown.STRATEGIES),
                  [[name] + [fmt(*row[s]) for s in countdown.STRATEGIES] for name, row in rows.items()])


def _pair_keys(splits: Sequence[str], n: int) -> list[tuple[str, str]]:
    return [(f"{splits[0]}/pass@1", "ID pass@1"), (f"{splits[0]}/pass@{n}", f"ID pass@{n}"),
            (f"{splits[-1]}/pass@1", "OOD pass@1"), (f"{splits[-1]}/pass@{n}", f"OOD pass@{n}"),
            (f"{splits[0]}/distinct", "ID distinct")] + (
        [(f"{RL}/pass@1", "RL-prompt pass@1"), (f"{RL}/pass@{n}", f"RL-prompt pass@{n}"),
         (f"{RL}/distinct", "RL-prompt distinct")] if RL in splits else [])


def paired_comparisons(results: Mapping[str, Any], splits: Sequence[str], n: int) -> list[dict[str, Any]]:
    """Every (pair, metric) paired-by-seed test, with Holm-adjusted p-values over all of them."""
    per_seed, rows = results["per_seed"], []
    for a, b in PAIRS:
        if a in per_seed and b in per_seed:
            for key, label in _pair_keys(splits, n):
                rows.append({"pair": (a, b), "metric": label,
                             **paired_test(paired_diffs(per_seed[a], per_seed[b], key))})
    for row, p_holm in zip(rows, holm([r["p"] for r in rows])):
        row["p_holm"] = p_holm
    return rows


def _diff_cell(r: Mapping[str, Any]) -> str:
    if math.isnan(r["mean"]):
        return "–"
    text = f"{r['mean']:+.3f}" + ("" if math.isnan(r["half"]) else f" ± {r['half']:.3f}")
    if not math.isnan(r["p_holm"]):
        text += f" (p {r['p_holm']:.2f})" + (" *" if r["p_holm"] < 0.05 else "")
    return text + ("" if r["n"] > 1 else " (1 seed)")


def _pairs_tables(results: Mapping[str, Any], splits: Sequence[str], n: int) -> tuple[str, str, int]:
    """(differences table, minimum-detectable-effect table, number of comparisons)."""
    rows = paired_comparisons(results, splits, n)
    if not rows:
        return "", "", 0
    labels = [label for _, label in _pair_keys(splits, n)]
    acted = guide_activity(results)
    by_pair: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        by_pair.setdefault(r["pair"], {})[r["metric"]] = r
    name = lambda a, b: f"{a} − {b}" + (" (guide did not act)" if acted.get(a, {}).get("acted") is False else "")
    diffs = _table(["pair (same seeds)", "seeds"] + labels,
                   [[name(a, b), str(max(c["n"] for c in cells.values()))] + [_diff_cell(cells[l]) for l in labels]
                    for (a, b), cells in by_pair.items()])
    mdes = _table(["pair", "seeds"] + labels,
                  [[f"{a} − {b}", str(max(c["n"] for c in cells.values()))]
                   + [fmt(cells[l]["mde"]) for l in labels] for (a, b), cells in by_pair.items()])
    return diffs, mdes, sum(1 for r in rows if not math.isnan(r["p"]))


def guide_activity(results: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per guided arm: q statistics over training (mean over seeds) and, for Branch, whether it acted at all (None
    for the noise guides, whose q_mean is 1 by design)."""
    configs = results["meta"].get("arm_configs", {})
    out = {}
    for arm, runs in results["per_seed"].items():
        guide = configs.get(arm, {}).get("guide", "none")
        if guide == "none":
            continue
        q = [r.get("train/q_mean", math.nan) for r in runs.values()]
        idle = [s for s, r in runs.items() if abs(r.get("train/q_mean", 1.0) - 1.0) < ACTED_TOL]
        agg = results["aggregate"][arm]
        out[arm] = {"q_mean": agg.get("train/q_mean", (math.nan, math.nan)),
                    "q_p90": agg.get("train/q_p90", (math.nan, math.nan)),
                    "q_active": agg.get("train/q_active", (math.nan, math.nan)),
                    "q_mean_max": max(q) if q else math.nan, "idle_seeds": idle,
                    "acted": (bool(q) and abs(float(np.nanmean(q)) - 1.0) >= ACTED_TOL) if guide == "branch" else None}
    return out


def _activity_table(results: Mapping[str, Any]) -> str:
    rows = []
    for arm, a in guide_activity(results).items():
        per_run = ", ".join(f"{results['per_seed'][arm][s].get('train/q_mean', math.nan):.3f}"
                            for s in sorted(results["per_seed"][arm]))
        status = {True: "acted", False: "**did not act**", None: "– (zero-mean noise: the 1% rule is for Branch)"}
        rows.append([arm, fmt(*a["q_mean"]), fmt(*a["q_p90"]), fmt(*a["q_active"]), per_run, status[a["acted"]]])
    for arm, c in results["meta"].get("arm_configs", {}).items():
        if c.get("kl_cov") and arm in results["per_seed"]:
            kl = [r.get("train/kl_cov_max", 0.0) for r in results["per_seed"][arm].values()]
            inert = c.get("updates_per_batch", 1) == 1 or max(kl) == 0.0
            rows.append([arm, "–", "–", "–", "max loss/kl_cov " + ", ".join(f"{v:.2g}" for v in kl),
                         "**did not act** (one update per batch: its penalty has no gradient)" if inert else "acted"])
    return _table(["arm", "q_mean (training)", "q_p90", "share of tokens with q ≠ 1", "q_mean per run", "status"],
                  rows) if rows else ""


def _sweep_table(results: Mapping[str, Any], split: str, n: int) -> tuple[str, dict[str, np.ndarray], list, list]:
    cells = results["sweep"]
    gammas = sorted({c["gamma"] for c in cells.values()})
    taus = sorted({c["tau"] for c in cells.values()})
    grids = {f"pass@1 ({split})": np.full((len(gammas), len(taus)), np.nan),
             f"pass@{n} ({split})": np.full((len(gammas), len(taus)), np.nan)}
    rows = []
    for cell in cells.values():
        i, j = gammas.index(cell["gamma"]), taus.index(cell["tau"])
        p1, pn = cell[f"{split}/pass@1"], cell[f"{split}/pass@{n}"]
        grids[f"pass@1 ({split})"][i, j], grids[f"pass@{n} ({split})"][i, j] = p1[0], pn[0]
        nan2 = (math.nan, math.nan)
        q_mean = cell.get("train/q_mean", nan2)
        rows.append([str(cell["gamma"]), str(cell["tau"]), str(cell["seeds"]), fmt(*p1), fmt(*pn),
                     fmt(*cell.get("train/entropy_end", nan2)),
                     fmt(*cell.get(f"{split}/distinct", nan2), digits=2), fmt(*q_mean),
                     fmt(*cell.get("train/q_p90", nan2)), fmt(*cell.get("train/q_active", nan2)),
                     "did not act" if abs(q_mean[0] - 1.0) < ACTED_TOL else ""])
    table = _table(["gamma", "tau", "seeds", "pass@1", f"pass@{n}", "entropy (end)", "distinct sols / problem",
                    "q_mean", "q_p90", "q ≠ 1 share", ""], rows)
    return table, grids, gammas, taus


def _times_table(meta: Mapping[str, Any]) -> str:
    rows = [[arm] + [f"{t[k]:.{d}f}" for k, d in (("train_wall_s", 0), ("train_cpu_s", 0), ("step_s", 2),
                                                   ("eval_wall_s", 0))]
            for arm, t in meta.get("arm_times", {}).items()]
    return _table(["arm", "RL wall s (mean/seed)", "RL CPU s", "median s / RL step", "eval wall s"], rows)


READING = "reading.md"  # hand-written, after the results: what they say against the paper (kept across renders)
REGIME = "regime.md"    # sage_jax.experiments.regime's report, when the study's regime search wrote one here


def _included(out_dir: str, name: str, title: str) -> list[str]:
    """A section holding out_dir/name (its own top heading dropped, its headings moved one level down), or none."""
    path = os.path.join(out_dir, name)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.read().strip().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    out, code = [], False
    for line in lines:
        code ^= line.startswith("```")
        out.append("#" + line if line.startswith("#") and not code else line)
    return [f"## {title}\n", f"(from [{name}]({name}))\n", "\n".join(out).strip() + "\n"]


def write(out_dir: str, results: Mapping[str, Any]) -> str:
    """RESULTS.md, results.json and the PNGs in out_dir; returns the markdown."""
    os.makedirs(out_dir, exist_ok=True)
    meta = results["meta"]
    splits, n = list(meta["splits"]), int(meta["n"])
    agg = {a: g for a, g in results["aggregate"].items()}
    base_curves = {f"{s}/curve": (results["base"][f"{s}/curve"], None) for s in splits}
    figures = []
    for s in splits:
        name = f"pass_at_k_{s}.png"
        plots.pass_at_k(agg, base_curves, s, os.path.join(out_dir, name),
                        f"pass@k, {SPLIT_NAMES.get(s, s)} ({meta['problems'][s]} problems, n={n})",
                        results["per_seed"])
        figures.append(name)
    plots.training(results["curves"], os.path.join(out_dir, "training_curves.png"))
    share_rows = _share_rows(results, splits[0])
    plots.strategy_shares(share_rows, countdown.STRATEGIES, os.path.join(out_dir, "strategy_shares.png"),
                          f"strategy of correct samples, {SPLIT_NAMES.get(splits[0], splits[0])}")
    md = [f"# SAGE on countdown: {len(agg)} arms × {meta.get('seeds_text', meta['seeds'])} seed(s), budget "
          f"`{meta['budget']}`\n", meta["description"] + "\n", *_included(out_dir, READING, "Reading"),
          *_included(out_dir, REGIME, "Regime, chosen on GRPO alone before any arm ran"), "## Commands\n", "```\n" + "\n".join(meta["commands"]) + "\n```\n",
          "## Headline\n", CI_NOTE + "\n", _headline(results, splits, n),
          "ID = held-out problems from the training generator; OOD = problems whose numbers reach beyond the training "
          "range (see Setup). *distinct sols / problem*: "
          "distinct correct solutions (countdown.canonical forms) among the n samples; *coverage*: that over all "
          "solutions the problem has (countdown.solve), averaged over problems. *entropy / train reward (end)*: mean "
          "of rl/entropy and rl/reward over the last 10% of RL steps.\n"]
    pairs, mdes, m = _pairs_tables(results, splits, n)
    if pairs:
        md += ["## Paired differences\n", f"Arm minus its baseline over the same seeds: mean ± 95% t half-width of "
               f"the per-seed differences, and in brackets the two-sided paired t-test p-value Holm-adjusted over all "
               f"{m} comparisons in this table (pairs × metrics with at least 2 seeds); * marks Holm p < 0.05. A "
               "pair marked *guide did not act* compares GRPO with GRPO (see Guide activity).\n", pairs,
               "Minimum detectable effect of each comparison: (t_{0.975, s-1} + t_{0.8, s-1}) · sd / √s with the "
               "observed sd of its paired differences over s seeds (80% power, two-sided alpha 0.05 before the Holm "
               "correction): a true difference smaller than this would usually be missed.\n", mdes]
    activity = _activity_table(results)
    if activity:
        tau = results["meta"].get("tau") or {}
        tau_line = (f"Branch's tau = {tau['tau']} nats, the {tau['quantile']} quantile of the SFT base's token "
                    "entropies on its own held-out samples (so about "
                    f"{100 * (1 - tau['quantile']):.0f}% of the base's completion tokens lie above it)"
                    if tau.get("tau") is not None else "Branch's tau is the config's loss.tau")
        md += ["## Guide activity\n", f"{tau_line}. Per run, the mean over all RL steps of sage/q_mean, "
               f"sage/q_p90 (90th percentile of q over each step's tokens) and sage/q_active (share of tokens with "
               f"q ≠ 1); the cells are mean ± 95% half-width over seeds. An arm whose q_mean stays within "
               f"{ACTED_TOL:.0%} of 1 **did not act**: its results are GRPO's, not a finding about the guide.\n",
               activity]
    for s, fig in zip(splits, figures):
        md += [f"## pass@k, {SPLIT_NAMES.get(s, s)}\n", f"![pass@k {s}]({fig})\n", _pass_table(results, s, n)]
    md += ["## Mode coverage\n", _coverage_table(results, splits),
           "## Strategy shares among correct samples\n",
           "Top-level operation of each correct held-out sample (countdown.strategy, the classes of "
           "countdown.strategy_shares): the analogue of the paper's reasoning-pattern table. *SFT demos* is what the "
           "base was trained on.\n", "![strategy shares](strategy_shares.png)\n", _share_table(share_rows),
           "OOD split:\n", _share_table({k: v for k, v in _share_rows(results, splits[-1]).items()
                                         if k != "SFT demos"}),
           "## Training dynamics\n", "![training curves](training_curves.png)\n"]
    if results["sweep"]:
        table, grids, gammas, taus = _sweep_table(results, splits[0], n)
        plots.heatmaps(grids, gammas, taus, os.path.join(out_dir, "sweep_heatmap.png"))
        md += ["## Branch sweep (GRPO + Branch, gamma × tau)\n", meta.get("sweep_note", "") + "\n",
               "![sweep](sweep_heatmap.png)\n", table]
    md += ["## Setup and hyperparameters\n", meta["setup"] + "\n", "```\n" + meta["hyperparameters"] + "\n```\n",
           "## Run times\n", meta["timing"] + "\n", _times_table(meta), "## Caveats\n", meta["caveats"] + "\n"]
    text = "\n".join(md)
    evaluation.write_json(os.path.join(out_dir, "results.json"), _jsonable(results))
    with open(os.path.join(out_dir, "RESULTS.md"), "w", encoding="utf-8") as f:
        f.write(text)
    return text


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, (np.floating, np.integer)):
        return _jsonable(x.item())
    return x
