"""The report's figures: pass@k curves with seed bands, training curves, strategy shares, the Branch sweep heatmap."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

# Panels: GRPO with its anchors and guides; the entropy-based peers; the DAPO/BNPO pairs (GRPO repeated in each);
# the SmolLM2 study's arms.
FAMILIES = (("grpo", "grpo_rkl", "grpo_nokl", "fkl", "grpo_random", "grpo_token", "grpo_branch", "grpo_branch_paper"),
            ("grpo", "grpo_entropy", "grpo_top_entropy", "grpo_kl_cov", "grpo_branch", "grpo_branch_paper"),
            ("grpo", "dapo", "dapo_branch", "bnpo", "bnpo_branch"),
            ("grpo", "branch", "nokl", "top_entropy"))  # the SmolLM2 study's arms (configs/smollm2_arms.py)


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _color(arm: str, arms: Sequence[str]):
    import matplotlib
    return matplotlib.colormaps["tab10"](list(arms).index(arm) % 10)


def _style(arm: str) -> dict[str, Any]:
    return {"linestyle": "-" if "branch" in arm else "--" if arm == "grpo" else ":", "linewidth": 1.6}


def _band(ax, x, mean, half, color, label, **style):
    mean, half = np.asarray(mean, float), np.asarray(half, float)
    ax.plot(x, mean, color=color, label=label, **style)
    if np.isfinite(half).any():
        ax.fill_between(x, mean - half, mean + half, color=color, alpha=0.15, linewidth=0)


def _families(arms: Sequence[str]) -> list[list[str]]:
    fams = [[a for a in fam if a in arms] for fam in FAMILIES]
    fams = [f for f in fams if len(f) > (1 if "grpo" in f else 0)] or [[]]
    fams[0] += [a for a in arms if not any(a in fam for fam in fams)]  # GRPO alone, or arms of no family
    return fams


def paired_curve(per_seed: Mapping[str, Mapping[int, Mapping[str, Any]]], arm: str, ref: str, key: str
                 ) -> tuple[list[float], list[float]]:
    """Mean and 95% half-width over seeds of (arm - ref) curves, paired by seed."""
    from sage_jax.experiments.stats import mean_ci
    seeds = sorted(set(per_seed[arm]) & set(per_seed[ref]))
    diffs = [np.asarray(per_seed[arm][s][key]) - np.asarray(per_seed[ref][s][key]) for s in seeds]
    pairs = [mean_ci(column) for column in zip(*diffs)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def pass_at_k(agg: Mapping[str, Mapping[str, Any]], base: Mapping[str, Any], split: str, path: str,
              title: str, per_seed: Mapping[str, Mapping[int, Mapping[str, Any]]], base_label: str = "base (SFT)"
              ) -> None:
    """Top: pass@k vs k per arm (mean, 95% band over seeds) and the base; bottom: arm - GRPO paired by seed."""
    plt = _plt()
    arms = list(agg)
    fams = _families(arms)
    fig, axes = plt.subplots(2, len(fams), figsize=(6 * len(fams), 7), squeeze=False, sharex=True)
    base_curve = base[f"{split}/curve"][0]
    ks = np.arange(1, len(base_curve) + 1)
    for col, fam in enumerate(fams):
        top, bottom = axes[0, col], axes[1, col]
        top.plot(ks, base_curve, color="black", linewidth=1.2, label=base_label)
        ref = agg["grpo"][f"{split}/curve"][0] if "grpo" in agg else base_curve
        for arm in fam:
            mean, half = agg[arm][f"{split}/curve"]
            _band(top, ks, mean, half, _color(arm, arms), arm, **_style(arm))
            if arm != "grpo" and "grpo" in agg:
                _band(bottom, ks, *paired_curve(per_seed, arm, "grpo", f"{split}/curve"), _color(arm, arms), arm,
                      **_style(arm))
        bottom.axhline(0.0, color="grey", linewidth=0.8)
        bottom.plot(ks, np.asarray(base_curve) - np.asarray(ref), color="black", linewidth=1.0, label="base")
        top.set_ylabel("pass@k")
        bottom.set_ylabel("pass@k − GRPO (same seeds)")
        bottom.set_xlabel("k")
        ticks = [k for k in (2 ** i for i in range(12)) if k <= len(ks)]
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [str(k) for k in ticks])
            ax.grid(alpha=0.3)
        top.set_ylim(0, 1)
        top.legend(fontsize=7, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def smooth(values: Sequence[float | None], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is); None counts as missing."""
    x = np.asarray([np.nan if v is None else v for v in values], float)
    out = []
    for i in range(len(x)):
        chunk = x[max(0, i - window + 1):i + 1]
        out.append(float(np.nanmean(chunk)) if np.isfinite(chunk).any() else math.nan)
    return out


def training(curves: Mapping[str, Sequence[Mapping[str, Sequence]]], path: str) -> None:
    """Entropy, reward and the guide's q_mean over RL steps (trailing moving average over ~10% of the steps): mean
    over seeds with a 95% band, one column per family."""
    from sage_jax.experiments.stats import mean_ci
    plt = _plt()
    arms = list(curves)
    fams = _families(arms)
    names = ("entropy", "reward", "q_mean")
    fig, axes = plt.subplots(len(names), len(fams), figsize=(6 * len(fams), 8.5), squeeze=False, sharex=True)
    for col, fam in enumerate(fams):
        for row, name in enumerate(names):
            ax = axes[row, col]
            window = 1
            for arm in fam:
                runs = [c for c in curves[arm] if c.get(name)]
                if not runs:
                    continue
                length = min(len(c[name]) for c in runs)
                window = max(1, length // 10)
                smoothed = [smooth(c[name][:length], window) for c in runs]
                pairs = [mean_ci([s[i] for s in smoothed]) for i in range(length)]
                _band(ax, runs[0]["step"][:length], [p[0] for p in pairs], [p[1] for p in pairs],
                      _color(arm, arms), arm, **_style(arm))
            ax.set_ylabel({"entropy": "policy entropy (nats/token)", "reward": "train reward",
                           "q_mean": "guide q_mean (1 = no guide)"}[name]
                          + (f"\n{window}-step moving average" if window > 1 else ""))
            ax.grid(alpha=0.3)
        axes[-1, col].set_xlabel("RL step")
        axes[0, col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def vs_base(per_seed: Mapping[str, Mapping[int, Mapping[str, Any]]], key: str, path: str) -> None:
    """pass@k minus the base's, paired by seed (mean, 95% band), one line per arm."""
    plt = _plt()
    arms = [a for a in per_seed if a != "base"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in arms:
        mean, half = paired_curve(per_seed, arm, "base", key)
        if mean:
            _band(ax, np.arange(1, len(mean) + 1), mean, half, _color(arm, arms), arm, **_style(arm))
    ax.axhline(0.0, color="black", linewidth=0.8)
    n = len(next(iter(per_seed["base"].values()))[key])
    ticks = [k for k in (2 ** i for i in range(12)) if k <= n]
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(k) for k in ticks])
    ax.set_xlabel("k")
    ax.set_ylabel("pass@k − base (same seeds)")
    ax.set_title("pass@k minus the base's, paired by seed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
