"""A study's report from its result files alone: RESULTS.md, results.json and the figures (pass@k per arm with 95%
bands over seeds, pass@k minus the base's paired by seed, training curves, the Branch sweep). Statistics are
stats.py's: 95% t-intervals over seeds, paired-by-seed t-tests with Holm's correction over every comparison made
(the settings file's PAIRS x PAIR_METRICS), and the minimum detectable effect of each. Also the regime search's
regime.md / regime.json (regime.py states the rule)."""

from __future__ import annotations

import math
import os
import statistics
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from sage_jax.eval import passk as evaluation
from sage_jax.experiments import plots
from sage_jax.experiments.measure import SPLITS
from sage_jax.experiments.runs import option, write_result
from sage_jax.experiments.stats import aggregate, fmt, holm, mean_ci, paired_diffs, paired_test, pass_curve

ACTED_TOL = 0.01  # a guided arm whose q_mean over training stays within 1% of 1 did not act
READING, REGIME = "reading.md", "regime.md"  # hand-written after the results; the regime search's report


def _tail(values: Sequence[float | None], frac: float) -> float:
    x = [v for v in values or [] if v is not None]
    return float(np.mean(x[-max(1, int(round(len(x) * frac))):])) if x else math.nan


def summarize(mod, record: Mapping[str, Any]) -> dict[str, Any]:
    """A run's scalars and pass@k curves per split, recomputed from its per-problem counts."""
    out: dict[str, Any] = {}
    for split, ev in record["eval"].items():
        curve = pass_curve([{"n": n, "correct": c} for n, c in zip(ev["n"], ev["correct"])])
        out[f"{split}/curve"] = curve
        out |= {f"{split}/pass@{k}": v for k, v in enumerate(curve, 1)}
        for key in ("distinct", "distinct_forms", "distinct_correct", "distinct_answers"):
            if key in ev:
                out[f"{split}/{key}"] = float(np.mean(ev[key]))
        if "tool_rows" in ev:  # the share of samples that called a tool
            out[f"{split}/tool_rows"] = float(np.sum(ev["tool_rows"]) / np.sum(ev["n"]))
        if "solutions" in ev:
            out[f"{split}/coverage"] = float(np.mean([d / s for d, s in zip(ev["distinct"], ev["solutions"])]))
        if "strategies" in ev:  # each strategy's share of the correct samples
            counts = sum((Counter(c) for c in ev["strategies"]), Counter())
            out |= {f"{split}/share/{k}": v / sum(counts.values()) for k, v in sorted(counts.items())}
    curves, guide = record.get("curves") or {}, record.get("guide") or {}
    for name in ("entropy", "reward", "kl", "kl_ref"):
        if curves.get(name):
            out[f"train/{name}_end"] = _tail(curves[name], option(mod, "TAIL", 0.25))
    if any(v is not None for v in curves.get("tool_rows") or ()):  # logged as the rows that never called
        out["train/tool_rows_end"] = 1.0 - _tail(curves["tool_rows"], option(mod, "TAIL", 0.25))
    for name in ("q_mean", "q_p90", "q_active"):
        value = guide.get(name) if guide.get(name) is not None else _tail(curves.get(name), 1.0)
        if not math.isnan(value):
            out[f"train/{name}"] = float(value)
    if curves.get("kl_cov"):
        out["train/kl_cov_max"] = float(max(abs(v) for v in curves["kl_cov"] if v is not None))
    times = record.get("times") or {}
    out["cpu_min"] = (times.get("train_cpu_s", 0.0) + times.get("eval_cpu_s", 0.0)) / 60
    return out


def pair_metrics(mod, n: int) -> list[tuple[str, str]]:
    """(key, label) of every paired comparison's metric, the settings' PAIR_METRICS with n filled in."""
    rows = [(k.format(n=n, k16=min(16, n)), label.format(n=n, k16=min(16, n)))
            for k, label in option(mod, "PAIR_METRICS", ())]
    return list(dict.fromkeys(rows))


def build(mod, runs: Mapping[str, Mapping[int, Mapping[str, Any]]],
          sweep: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> dict[str, Any]:
    per_seed = {arm: {s: summarize(mod, r) for s, r in sorted(by.items())} for arm, by in runs.items()}
    agg = {arm: aggregate(list(rows.values())) for arm, rows in per_seed.items() if rows}
    n = min(int(r["n"]) for by in runs.values() for r in by.values())
    rows = [{"pair": (a, b), "key": key, "metric": label, **paired_test(paired_diffs(per_seed[a], per_seed[b], key))}
            for a, b in option(mod, "PAIRS", ()) if a in per_seed and b in per_seed
            for key, label in pair_metrics(mod, n)]
    for row, p in zip(rows, holm([r["p"] for r in rows])):
        row["p_holm"] = p
    cells = {cell: {k: v for k, v in aggregate([summarize(mod, r) for _, r in sorted(by.items())]).items()
                    if not k.endswith("/curve")} | {"seeds": len(by)} for cell, by in sweep.items() if by}
    return {"per_seed": per_seed, "aggregate": agg, "n": n, "comparisons": rows, "warnings": warnings(runs),
            "sweep": cells}


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

def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    line = lambda cells: "| " + " | ".join(cells) + " |"
    return "\n".join([line(header), line(["---"] + ["---:"] * (len(header) - 1))] + [line(r) for r in rows]) + "\n"


def _cell(agg: Mapping[str, Any], key: str, digits: int = 3) -> str:
    return fmt(*agg.get(key, (math.nan, math.nan)), digits=digits)


def diff_cell(r: Mapping[str, Any]) -> str:
    if math.isnan(r["mean"]):
        return "–"
    text = f"{r['mean']:+.3f}" + ("" if math.isnan(r["half"]) else f" ± {r['half']:.3f}")
    if not math.isnan(r.get("p_holm", math.nan)):
        text += f" (p {r['p_holm']:.2f})" + (" *" if r["p_holm"] < 0.05 else "")
    return text + ("" if r["n"] > 1 else " (1 seed)")


def _splits(mod, results) -> list[tuple[str, str]]:
    """(split, column prefix) of the splits the runs evaluated."""
    first = next(iter(next(iter(results["per_seed"].values())).values()))
    return [(s, (spec[2] + " ") if len(spec) > 2 and spec[2] else "")
            for s, spec in option(mod, "SPLITS", SPLITS).items() if f"{s}/curve" in first]


def arms_table(mod, results: Mapping[str, Any]) -> str:
    n = results["n"]
    ks = sorted({1, min(16, n), n})
    head, keys = ["arm", "seeds"], []
    for split, label in _splits(mod, results):
        head += [f"{label}pass@{k}" for k in ks]
        keys += [(f"{split}/pass@{k}", 3) for k in ks]
        for key, name in (("distinct", "distinct sols / problem"), ("distinct_forms", "distinct correct forms"),
                          ("distinct_answers", "distinct answers"), ("coverage", "coverage"),
                          ("tool_rows", "samples calling the tool")):
            if any(f"{split}/{key}" in g for g in results["aggregate"].values()):
                head.append(f"{label}{name}")
                keys.append((f"{split}/{key}", 2 if key not in ("coverage", "tool_rows") else 3))
    head += ["train reward (end)", "entropy (end)", "q_mean", "q ≠ 1 share", "CPU min / run"]
    keys += [("train/reward_end", 3), ("train/entropy_end", 3), ("train/q_mean", 3), ("train/q_active", 3),
             ("cpu_min", 1)]
    if any("train/tool_rows_end" in g for g in results["aggregate"].values()):
        head.insert(-1, "rollouts calling the tool (end)")
        keys.insert(-1, ("train/tool_rows_end", 3))
    return table(head, [[arm, str(len(results["per_seed"][arm]))] + [_cell(agg, k, d) for k, d in keys]
                        for arm, agg in results["aggregate"].items()])


def pairs_tables(mod, results: Mapping[str, Any]) -> tuple[str, str]:
    """(differences with Holm-adjusted p, minimum detectable effects); empty strings when no pair ran."""
    by_pair: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results["comparisons"]:
        by_pair.setdefault(tuple(r["pair"]), {})[r["metric"]] = r
    if not by_pair:
        return "", ""
    labels = [label for _, label in pair_metrics(mod, results["n"])]
    seeds = lambda cells: str(max(c["n"] for c in cells.values()))
    diffs = table(["pair (same seeds)", "seeds"] + labels,
                  [[f"{a} − {b}", seeds(c)] + [diff_cell(c[l]) for l in labels] for (a, b), c in by_pair.items()])
    mdes = table(["pair", "seeds"] + labels, [[f"{a} − {b}", seeds(c)] + [fmt(c[l]["mde"]) for l in labels]
                                              for (a, b), c in by_pair.items()])
    return diffs, mdes


def activity_table(runs: Mapping[str, Mapping[int, Mapping[str, Any]]], results, guides: Mapping[str, str]) -> str:
    rows = []
    for arm, by_seed in runs.items():
        if guides.get(arm, "none") == "none":
            continue
        per = results["per_seed"][arm]
        q = [r["train/q_mean"] for r in per.values() if "train/q_mean" in r]
        taus = sorted({r.get("tau") for r in by_seed.values() if r.get("tau") is not None})
        acted = bool(q) and abs(statistics.fmean(q) - 1.0) >= ACTED_TOL
        status = (("acted" if acted else "**did not act**") if guides[arm] == "branch" else
                  "– (zero-mean noise: the 1% rule is for Branch)")
        rows.append([arm, ", ".join(f"{t:.4g}" for t in taus) or "–", fmt(*mean_ci(q)),
                     _cell(results["aggregate"][arm], "train/q_active"), ", ".join(f"{v:.3f}" for v in q), status])
    return table(["arm", "tau (nats)", "q_mean (training)", "share of tokens with q ≠ 1", "q_mean per run", "status"],
                 rows) if rows else ""


def sweep_table(results: Mapping[str, Any], split: str) -> str:
    n = results["n"]
    rows = [[name, str(c["seeds"]), _cell(c, f"{split}/pass@1"), _cell(c, f"{split}/pass@{n}"),
             _cell(c, f"{split}/distinct", 2), _cell(c, "train/entropy_end"), _cell(c, "train/q_mean"),
             _cell(c, "train/q_active")] for name, c in sorted(results["sweep"].items())]
    return table(["cell", "seeds", "pass@1", f"pass@{n}", "distinct", "entropy (end)", "q_mean", "q ≠ 1 share"], rows)


def runs_table(mod, runs: Mapping[str, Mapping[int, Mapping[str, Any]]], results) -> str:
    rows, n = [], results["n"]
    split = _splits(mod, results)[0][0]
    for arm, by_seed in runs.items():
        for seed, r in sorted(by_seed.items()):
            s, t = results["per_seed"][arm][seed], r.get("times") or {}
            rows.append([arm, str(seed), fmt(s[f"{split}/pass@1"]), fmt(s[f"{split}/pass@{n}"]),
                         fmt(s.get("train/q_mean", math.nan))] + [f"{t.get(k, 0) / 60:.1f}" for k in
                                                                   ("train_wall_s", "train_cpu_s", "eval_wall_s")]
                        + [str((r.get("host") or {}).get("finished_utc", "")), str(r.get("fingerprint", ""))[:8]])
    return table(["arm", "seed", "pass@1", f"pass@{n}", "q_mean", "RL wall min", "RL CPU min", "eval wall min",
                  "finished (UTC)", "fingerprint"], rows)


def _included(out_dir: str, name: str, title: str) -> list[str]:
    """A section holding out_dir/name (its own top heading dropped, its headings moved one level down), or none."""
    path = os.path.join(out_dir, name)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.read().strip().splitlines()
    out, code = [], False
    for line in lines[1:] if lines and lines[0].startswith("# ") else lines:
        code ^= line.startswith("```")
        out.append("#" + line if line.startswith("#") and not code else line)
    return [f"## {title}\n", f"(from [{name}]({name}))\n", "\n".join(out).strip() + "\n"]


# --------------------------------------------------------------------------------------------------- the page

def figures(mod, out: str, results: Mapping[str, Any], runs) -> list[str]:
    per_seed, agg, n, made = results["per_seed"], results["aggregate"], results["n"], []
    trained = {a: g for a, g in agg.items() if a != "base"}
    if not trained:
        return made
    for split, _ in _splits(mod, results):
        name = "pass_at_k.png" if split == "heldout" else f"pass_at_k_{split}.png"
        key = f"{split}/curve"
        base = {key: agg["base"][key]} if "base" in agg else {key: ([math.nan] * n, None)}
        plots.pass_at_k(trained, base, split, os.path.join(out, name), f"pass@k, {split}, n={n} (bands: 95% over "
                        "seeds)", per_seed, base_label="base")
        made.append(name)
    plots.training({a: [r.get("curves") or {} for _, r in sorted(runs[a].items())] for a in trained},
                   os.path.join(out, "training_curves.png"))
    made.append("training_curves.png")
    if "base" in per_seed and len(per_seed["base"]) > 1:
        split = _splits(mod, results)[0][0]
        plots.vs_base(per_seed, f"{split}/curve", os.path.join(out, "pass_at_k_vs_base.png"))
        made.append("pass_at_k_vs_base.png")
    return made


def _primary_line(mod, results: Mapping[str, Any]) -> str:
    a, b, k = option(mod, "PRIMARY", ("", "", 1))
    label = next((lab for key, lab in pair_metrics(mod, results["n"]) if key.endswith(f"/pass@{min(k, results['n'])}")),
                 "")
    row = next((r for r in results["comparisons"] if tuple(r["pair"]) == (a, b) and r["metric"] == label), None)
    if row is None or row["n"] < 2:
        return f"The primary comparison ({a} − {b}, {label}) has fewer than 2 paired seeds so far.\n"
    return (f"Primary comparison, {a} − {b} on {label} over {row['n']} paired seeds: {diff_cell(row)}; the smallest "
            f"effect this design detects (80% power, alpha 0.05): {row['mde']:.3f}.\n")


def render(mod, out: str, runs, results, made: Sequence[str], guides: Mapping[str, str]) -> str:
    diffs, mdes = pairs_tables(mod, results)
    comparisons = sum(1 for r in results["comparisons"] if not math.isnan(r["p"]))
    commands = list(dict.fromkeys(r.get("command") for by in runs.values() for r in by.values() if r.get("command")))
    md = [f"# {option(mod, 'TITLE', 'Study')}: {len(runs)} arms\n", option(mod, "DESCRIPTION", "") + "\n",
          *(["**Warnings:** " + "; ".join(results["warnings"]) + "\n"] if results["warnings"] else []),
          *_included(out, REGIME, "Regime, chosen on GRPO alone before any guided arm ran"),
          *_included(out, READING, "Reading"),
          "## Arms\n", "Cells: mean ± 95% t half-width over seeds (a cell without ± is one seed). *(end)*: the mean "
          "over the last part of RL steps; *q_mean*, *q ≠ 1 share*: the guide's sage/q_mean and sage/q_active "
          "averaged over RL steps.\n", arms_table(mod, results), _primary_line(mod, results)]
    if diffs:
        md += ["## Paired differences\n", f"Arm minus reference over the seeds both ran: mean ± 95% t half-width, and "
               f"the paired t-test p-value Holm-adjusted over all {comparisons} comparisons in this table (* Holm p < "
               "0.05).\n", diffs, "Minimum detectable effect of each comparison: (t_{0.975, s-1} + t_{0.8, s-1}) · "
               "sd / √s with the observed sd of the paired differences over s seeds (80% power, two-sided alpha 0.05 "
               "before Holm).\n", mdes]
    if activity := activity_table(runs, results, guides):
        md += ["## Guide activity\n", f"Per run, sage/q_mean and the share of tokens with q ≠ 1 averaged over RL "
               f"steps. A Branch arm whose q_mean stays within {ACTED_TOL:.0%} of 1 **did not act**.\n", activity]
    md += ["## pass@k\n"] + [f"![{m}]({m})\n" for m in made]
    for split, label in _splits(mod, results):
        ks = evaluation.default_ks(results["n"])
        md += [f"{label or split}:\n", table(["arm"] + [f"pass@{k}" for k in ks], [
            [arm] + [_cell(agg, f"{split}/pass@{k}") for k in ks] for arm, agg in results["aggregate"].items()])]
    if results["sweep"]:
        md += ["## Branch sweep (gamma × tau)\n", sweep_table(results, _splits(mod, results)[0][0])]
    md += ["## Runs\n", runs_table(mod, runs, results), "## Commands\n", "```\n" + "\n".join(commands) + "\n```\n"]
    return "\n".join(md)


def write(mod, out: str, runs, sweep=None, guides: Mapping[str, str] | None = None) -> str:
    """RESULTS.md, results.json and the PNGs in out from the runs' records ({arm: {seed: record}}); the markdown."""
    results = build(mod, runs, sweep or {})
    os.makedirs(out, exist_ok=True)
    guide = lambda by: (next(iter(by.values())).get("guide") or {}).get("name", "none")
    guides = guides or {arm: guide(by) for arm, by in runs.items()}
    text = render(mod, out, runs, results, figures(mod, out, results, runs), guides)
    with open(os.path.join(out, "RESULTS.md"), "w", encoding="utf-8") as f:
        f.write(text)
    write_result(os.path.join(out, "results.json"), {"schema": "study/results", **results})
    return text


# --------------------------------------------------------------------------------------------------- the regime

RULE = {"split": "heldout", "min_gain": 0.0, "fall": ("pass@n",), "fall_interval": True}


def rollouts(config) -> int:
    return int(config.train.steps * config.rollout.prompts_per_step * config.rollout.group_size)


def regime_verdict(mod, base: Mapping[int, Mapping[str, Any]], grpo: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The candidate's paired differences against the base (result records by seed) and whether it is kept."""
    rule = {**RULE, **option(mod, "REGIME_RULE", {})}
    seeds = sorted(s for s in grpo if s in base or len(base) == 1)
    if not seeds:
        return {"seeds": 0, "kept": False, "shortfall": math.inf, "reason": "not run: no seed has both arms"}
    n, split = int(grpo[seeds[0]]["n"]), rule["split"]
    key = lambda m: f"{split}/{m.replace('pass@n', f'pass@{n}')}"
    b = {s: summarize(mod, base.get(s, next(iter(base.values())))) for s in seeds}
    g = {s: summarize(mod, grpo[s]) for s in seeds}
    diff = {m: paired_test([g[s][key(m)] - b[s][key(m)] for s in seeds]) for m in ("pass@1", *rule["fall"])}
    mean = lambda rows, m: sum(rows[s][key(m)] for s in seeds) / len(seeds)
    out = {"seeds": len(seeds), "n": n, "split": split, **{f"base_{m}": mean(b, m) for m in diff},
           **{f"grpo_{m}": mean(g, m) for m in diff}, **{f"d_{m}": d for m, d in diff.items()}}
    if len(seeds) < 2:
        return {**out, "kept": False, "shortfall": math.inf, "reason": "dropped: one seed gives no interval"}
    d1 = diff["pass@1"]
    rise_lo = d1["mean"] - d1["half"]
    falls = {m: diff[m]["mean"] + (diff[m]["half"] if rule["fall_interval"] else 0.0) for m in rule["fall"]}
    shortfall = max(0.0, -rise_lo) + max(0.0, min(falls.values()))
    if d1["mean"] < rule["min_gain"] or rise_lo <= 0:
        reason = (f"dropped: pass@1's gain ({fmt(d1['mean'], d1['half'])}) is not above {rule['min_gain']} with an "
                  "interval above 0")
    elif min(falls.values()) >= 0:
        reason = f"dropped: none of {', '.join(rule['fall'])} fell below the base's (no collapse)"
    else:
        reason = "kept: pass@1 up, " + ", ".join(m for m, v in falls.items() if v < 0) + " down"
    return {**out, "kept": reason.startswith("kept"), "shortfall": shortfall, "reason": reason}


def regime_summary(mod, names: Sequence[str], found: Mapping[str, Mapping[str, Mapping[int, Any]]],
              costs: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    """{candidate: settings, why, rollouts, CPU hours and verdict}; found[name] = {"base": {...}, "grpo": {...}}."""
    out = {}
    for name in names:
        runs = found.get(name, {})
        settings, why = mod.REGIME_CANDIDATES[name]
        cpu = sum(r.get("times", {}).get(k, 0.0) for arm in runs.values() for r in arm.values()
                  for k in ("train_cpu_s", "eval_cpu_s"))
        out[name] = {"settings": dict(settings), "why": why, "rollouts": costs[name], "cpu_h": cpu / 3600,
                     **regime_verdict(mod, runs.get("base", {}), runs.get(option(mod, "BASELINE_ARM", "grpo"), {}))}
    return out


def regime_select(results: Mapping[str, Mapping[str, Any]]) -> tuple[str | None, bool]:
    """(selected candidate, whether it meets the rule)."""
    kept = [(r["rollouts"], -r["d_pass@1"]["mean"], i, name) for i, (name, r) in enumerate(results.items())
            if r.get("kept")]
    if kept:
        return min(kept)[3], True
    tried = [(r.get("shortfall", math.inf), r.get("rollouts", 0), i, name)
             for i, (name, r) in enumerate(results.items()) if r.get("seeds", 0) >= 2]
    return (min(tried)[3], False) if tried else (None, False)


def _regime_diff(d: Mapping[str, float] | None) -> str:
    if not d or d.get("n", 0) == 0:
        return "–"
    text = f"{d['mean']:+.3f}" + ("" if math.isnan(d["half"]) else f" ± {d['half']:.3f}")
    return text + ("" if math.isnan(d.get("p", math.nan)) else f" (p {d['p']:.2f})")


def regime_render(mod, results: Mapping[str, Mapping[str, Any]], command: str) -> str:
    rule = {**RULE, **option(mod, "REGIME_RULE", {})}
    metrics = ("pass@1", *rule["fall"])
    head = ["candidate", "settings", "why tried", "rollouts", "seeds"] + [
        f"{who} {m}" for m in metrics for who in ("base", "GRPO", "GRPO − base")] + ["CPU h", "verdict"]
    rows = []
    for name, r in results.items():
        cell = lambda key, r=r: fmt(r[key]) if key in r else "–"
        cells = [c for m in metrics for c in (cell(f"base_{m}"), cell(f"grpo_{m}"), _regime_diff(r.get(f"d_{m}")))]
        rows.append([name, ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "(the settings' own)",
                     r["why"], str(r["rollouts"]), str(r.get("seeds", 0)), *cells, f"{r.get('cpu_h', math.nan):.2f}",
                     r["reason"]])
    choice, meets = regime_select(results)
    decision = ("No candidate has finished two seeds yet: nothing is selected." if choice is None else
                f"Selected: **{choice}**, " + ("the cheapest candidate that meets the rule." if meets else
                                               "the closest to the rule (none meets it).")
                + f" Freeze it before any guided arm runs, in one commit:\n\n```python\nREGIME = "
                f"{dict(results[choice]['settings'])!r}  # {os.path.basename(mod.PATH)}\n```")
    return "\n".join(["# Regime, chosen on GRPO alone before any guided arm ran\n",
                      f"Rule (regime.py): {rule}. A difference is mean ± the 95% t half-width of the per-seed "
                      "differences with its paired t-test p-value (uncorrected). Rollouts = RL steps × prompts × "
                      "samples.\n", table(head, rows), decision + "\n", "Made by:\n", f"```\n{command}\n```\n"])


def regime_write(mod, out: str, results: Mapping[str, Mapping[str, Any]], command: str) -> None:
    choice, meets = regime_select(results)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "regime.md"), "w", encoding="utf-8") as f:
        f.write(regime_render(mod, results, command))
    write_result(os.path.join(out, "regime.json"), {"rule": {**RULE, **option(mod, "REGIME_RULE", {})},
                                                    "selected": choice, "meets_rule": meets, "candidates": results})
    print(f"wrote {os.path.join(out, 'regime.md')}; selected: {choice} (meets the rule: {meets})", flush=True)
