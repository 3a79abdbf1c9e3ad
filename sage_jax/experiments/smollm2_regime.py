"""The SmolLM2 study's regime, chosen on GRPO alone before any guided arm runs (issue 39): the rule, the verdict on
each candidate of configs/smollm2_arms.REGIME_CANDIDATES, and regime.md / regime.json.

Rule. A candidate (steps, learning rate; the held-out set is the study's: 96 problems, n = 32) is kept when, paired
by seed (GRPO seed s against the base evaluated with seed s's sampling key), GRPO's held-out pass@1 rises (the 95%
t-interval of the differences lies above 0) and its pass@n at the largest k evaluated (n) falls below the base's
(the interval lies below 0). Candidates run in their listed order, cheapest first, and the first kept one is
selected (smollm2_study --regime stops there unless --regime-all). If none is kept, the selected one is the closest
to the rule: the smallest shortfall, (how far pass@1's interval reaches below 0) + (how far pass@n's reaches above
0), the cheaper on a tie. Either way the arms then run in that regime (the comparison is still the paper's); freeze
it by copying its settings into configs/smollm2_arms.REGIME (one commit) before any guided arm runs.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from sage_jax.experiments.stats import fmt, paired_test

RULE = ("Kept when, paired by seed (GRPO seed s minus the base evaluated with seed s's sampling key), GRPO's held-out "
        "pass@1 rises (95% t-interval above 0) and its pass@n at the largest k evaluated falls below the base's "
        "(interval below 0). Candidates run cheapest first; the first kept one is selected. If none is kept: the "
        "one with the smallest shortfall (how far pass@1's interval reaches below 0 plus how far pass@n's reaches "
        "above 0), the cheaper on a tie; the arms run in it anyway.")


def _by_seed(records: Mapping[int, Mapping[str, Any]], k: int) -> dict[int, dict[str, float]]:
    """pass@1 and pass@k per seed, from the per-problem correct counts where the record has them."""
    from sage_jax.experiments.smollm2_run import pass_at_k
    table = lambda r: pass_at_k(r["eval"]) if "eval" in r else r["pass_at_k"]
    return {s: {"p1": table(r)["1"], "pk": table(r)[str(k)]} for s, r in records.items()}


def verdict(base: Mapping[int, Mapping[str, Any]], grpo: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The candidate's paired differences against the base (result records by seed) and whether it is kept."""
    seeds = sorted(set(base) & set(grpo))
    if not seeds:
        return {"seeds": 0, "kept": False, "shortfall": math.inf, "reason": "not run: no seed has both arms"}
    n = int(grpo[seeds[0]]["n"])
    b, g = _by_seed(base, n), _by_seed(grpo, n)
    d1 = paired_test([g[s]["p1"] - b[s]["p1"] for s in seeds])
    dk = paired_test([g[s]["pk"] - b[s]["pk"] for s in seeds])
    mean = lambda rows, key: sum(rows[s][key] for s in seeds) / len(seeds)
    out = {"seeds": len(seeds), "n": n, "base_pass@1": mean(b, "p1"), "grpo_pass@1": mean(g, "p1"),
           "base_pass@n": mean(b, "pk"), "grpo_pass@n": mean(g, "pk"), "d_pass@1": d1, "d_pass@n": dk}
    if len(seeds) < 2:
        return {**out, "kept": False, "shortfall": math.inf, "reason": "dropped: one seed gives no interval"}
    rise_lo, fall_hi = d1["mean"] - d1["half"], dk["mean"] + dk["half"]
    shortfall = max(0.0, -rise_lo) + max(0.0, fall_hi)
    if rise_lo <= 0:
        reason = f"dropped: pass@1's interval ({fmt(d1['mean'], d1['half'])}) does not lie above 0"
    elif fall_hi >= 0:
        reason = f"dropped: pass@{n}'s interval ({fmt(dk['mean'], dk['half'])}) does not lie below 0"
    else:
        reason = f"kept: pass@1 up, pass@{n} down, both intervals excluding 0"
    return {**out, "kept": reason.startswith("kept"), "shortfall": shortfall, "reason": reason}


def select(results: Mapping[str, Mapping[str, Any]]) -> tuple[str | None, bool]:
    """(selected candidate, whether it meets the rule): the first kept in order, else the smallest shortfall."""
    for name, r in results.items():
        if r.get("kept"):
            return name, True
    tried = [(r.get("shortfall", math.inf), r.get("rollouts", 0), i, name)
             for i, (name, r) in enumerate(results.items()) if r.get("seeds", 0) >= 2]
    return (min(tried)[3], False) if tried else (None, False)


def rollouts(config) -> int:
    return int(config.train.steps * config.rollout.prompts_per_step * config.rollout.group_size)


def _diff(d: Mapping[str, float] | None) -> str:
    if not d or d.get("n", 0) == 0:
        return "–"
    text = f"{d['mean']:+.3f}" + ("" if math.isnan(d["half"]) else f" ± {d['half']:.3f}")
    return text + ("" if math.isnan(d.get("p", math.nan)) else f" (p {d['p']:.2f})")


def render(results: Mapping[str, Mapping[str, Any]], command: str) -> str:
    rows = ["| candidate | settings | why tried | rollouts | seeds | base pass@1 | GRPO pass@1 | pass@1 GRPO − base "
            "| base pass@n | GRPO pass@n | pass@n GRPO − base | CPU h | verdict |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        settings = ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "(smollm2_cpu's)"
        cell = lambda key, r=r: fmt(r[key]) if key in r else "–"
        rows.append(f"| {name} | {settings} | {r['why']} | {r['rollouts']} | {r.get('seeds', 0)} | "
                    f"{cell('base_pass@1')} | {cell('grpo_pass@1')} | {_diff(r.get('d_pass@1'))} | "
                    f"{cell('base_pass@n')} | {cell('grpo_pass@n')} | {_diff(r.get('d_pass@n'))} | "
                    f"{r.get('cpu_h', math.nan):.2f} | {r['reason']} |")
    choice, meets = select(results)
    n = next((r["n"] for r in results.values() if "n" in r), "n")
    if choice is None:
        decision = "No candidate has finished two seeds yet: nothing is selected."
    else:
        decision = (f"Selected: **{choice}**, " + ("the first candidate that meets the rule." if meets else
                    f"the closest to the rule; **no candidate showed GRPO's pass@{n} falling below the base's** "
                    "with an interval excluding 0.")
                    + " Freeze it before any guided arm runs, in one commit:\n\n"
                    f"```python\nREGIME = {dict(results[choice]['settings'])!r}  # configs/smollm2_arms.py\n```")
    return "\n".join([
        "# Regime, chosen on GRPO alone before any guided arm ran\n", RULE + f" Here n = {n}.\n",
        "Each cell is the mean over the seeds both arms finished; a difference is mean ± the 95% t half-width of the "
        "per-seed differences, with its paired t-test p-value (uncorrected). Rollouts = RL steps × prompts × "
        "samples; CPU h = process CPU time of the candidate's GRPO runs and base evaluations as recorded.\n",
        "\n".join(rows) + "\n", decision + "\n", "Made by:\n", f"```\n{command}\n```\n"])


def summarize(names: Sequence[str], candidates: Mapping[str, tuple[Mapping[str, Any], str]],
              found: Mapping[str, Mapping[str, Mapping[int, Mapping[str, Any]]]],
              costs: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    """{candidate: settings, why, rollouts, CPU hours and verdict} for the candidates tried, in order.
    found[name] = {"base": {seed: record}, "grpo": {seed: record}}."""
    out = {}
    for name in names:
        runs = found.get(name, {})
        settings, why = candidates[name]
        cpu = sum(r.get("times", {}).get(k, 0.0) for arm in runs.values() for r in arm.values()
                  for k in ("train_cpu_s", "eval_cpu_s"))
        out[name] = {"settings": dict(settings), "why": why, "rollouts": costs[name], "cpu_h": cpu / 3600,
                     **verdict(runs.get("base", {}), runs.get("grpo", {}))}
    return out
