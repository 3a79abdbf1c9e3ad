"""The experiment's work list: arm configs, Branch's tau from the base's entropies, and every run's Job.

configs/countdown_arms.py holds the arms, budgets and seeds per arm; this module turns them into configs and run
directories (reproduce.py runs them, regime.py reuses the Job).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np

from sage_jax.run import config as config_lib

ROOT = Path(__file__).resolve().parents[2]
CONFIG_FILE = ROOT / "configs" / "countdown_arms.py"


def arms_module():
    config_lib.load_file(f"{CONFIG_FILE}:grpo")  # puts the repository root on sys.path for `configs`
    from configs import countdown_arms
    return countdown_arms


def load_config(arm: str, budget: str, overrides: Sequence[str] = (), seed: int = 0, **loss: float):
    config = config_lib.load(f"{CONFIG_FILE}:{arm},{budget}", overrides)
    config.seed = seed
    for key, value in loss.items():
        config.loss[key] = value
    return config


class Job(NamedTuple):
    bucket: str            # "arms" or "sweep"
    key: Any               # the arm, or the sweep cell (gamma, tau)
    seed: int
    config: Any
    run_dir: str
    label: str
    mirror: str | None     # where --records keeps its record.json


def tau_at(profile: dict[str, Any], quantile: float) -> float:
    """The base's token-entropy quantile (interpolated on its 1% grid), rounded so equal settings compare equal."""
    if "grid" not in profile:
        raise ValueError("the base record's entropy profile has no quantile grid (made by older code): delete "
                         "WORK/BUDGET/base/record.json to recompute it")
    return round(float(np.interp(quantile, np.linspace(0.0, 1.0, 101), profile["grid"])), 4)


def branch_taus(base_config, base_record) -> tuple[float | None, list[float]]:
    """(tau for every Branch run, the sweep's taus): from the base's token entropies when experiment.tau_quantile
    is set (the sweep then at experiment.sweep_tau_quantiles, if given), else (None: loss.tau, sweep_taus)."""
    ex = base_config.experiment
    if not ex.tau_quantile:
        return None, list(ex.sweep_taus)
    profile = base_record["entropy"]
    sweep = [tau_at(profile, q) for q in ex.sweep_tau_quantiles] if ex.sweep_tau_quantiles else list(ex.sweep_taus)
    return tau_at(profile, ex.tau_quantile), sweep


def jobs(arms, seeds: int, sweep: bool, base_config, budget: str, overrides, work: str, records: str | None = None,
         tau: float | None = None, sweep_taus: Sequence[float] = ()) -> list[Job]:
    """Every run, seed-major (an interrupted experiment has every arm at the first seeds), then the sweep cells.

    Seeds per arm: countdown_arms.seeds_for. A sweep cell that equals its arm's own setting reuses that arm's runs.
    """
    mod, ex = arms_module(), base_config.experiment
    mirror = lambda run_dir: (os.path.join(records, os.path.relpath(run_dir, os.path.dirname(work)), "record.json")
                              if records else None)

    def make(bucket, key, arm, seed, run_dir, label, **loss):
        config = load_config(arm, budget, overrides, seed=seed, **loss)
        if tau is not None and config.loss.guide == "branch" and "tau" not in loss:
            config.loss.tau = tau
        return Job(bucket, key, seed, config, run_dir, label, mirror(run_dir))

    out = [make("arms", arm, arm, seed, os.path.join(work, "runs", arm, f"seed{seed}"), f"{arm} seed{seed}")
           for seed in range(seeds) for arm in arms if seed < mod.seeds_for(arm, budget, seeds)]
    if sweep:
        arm = ex.sweep_arm
        centre = load_config(arm, budget, overrides)
        gamma0, tau0 = centre.loss.gamma, centre.loss.tau if tau is None else tau
        cells = [(g, t) for g in ex.sweep_gammas for t in sweep_taus]
        if ex.sweep_design == "cross":  # one factor at a time through the arm's own (gamma, tau)
            cells = [(g, tau0) for g in ex.sweep_gammas] + [(gamma0, t) for t in sweep_taus if t != tau0]
        for gamma, t in cells:
            for seed in range(min(seeds, ex.sweep_seeds)):
                same = (gamma, t) == (gamma0, tau0) and arm in arms
                run_dir = (os.path.join(work, "runs", arm, f"seed{seed}") if same else
                           os.path.join(work, "sweep", f"gamma{gamma}_tau{t}", f"seed{seed}"))
                out.append(make("sweep", (gamma, t), arm, seed, run_dir, f"{arm} gamma={gamma} tau={t} seed{seed}",
                                gamma=gamma, tau=t))
    return out
