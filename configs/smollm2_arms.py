"""The SmolLM2-135M-Instruct study (issue 39): each arm as its difference from configs/smollm2_cpu.py.

    S="python -m sage_jax.experiments.study --settings configs/smollm2_arms.py"
    $S --regime --out docs/results/smollm2_study --work /tmp/smol_study
    $S --out docs/results/smollm2_study --work /tmp/smol_study
    $S --out docs/results/smollm2_study --report-only
    python -m sage_jax.train --config configs/smollm2_arms.py:grpo --workdir /tmp/one_arm   # one arm alone

arg: "ARM" or "ARM,quick" with ARM one of ARMS. A config is configs/smollm2_cpu.py (its `:quick` preset under
`quick`), then STUDY (what every arm shares: the held-out set, n, bookkeeping), then the frozen REGIME, then the
arm's own entry in ARMS; nothing else differs (tests/experiments/test_study.py checks it). The study harness
(sage_jax.experiments.study; `sage_jax.experiments.smollm2_study` is its old alias, every flag as it is) evaluates
with its own loop, so the trainer's before/after evaluations are off here; `sage_jax.train` on one arm trains it
and exports nothing else (Branch then keeps loss.tau = 1.2: the harness sets tau from the base's entropies; `base`
is the harness's evaluation-only arm). This file is also the study's settings: the names in capitals below.
Cost on the shared 2-core machine (CPU time, the process's own): an evaluation of 96 problems x 32 samples ~5 CPU-min
(0.1 CPU-s per sample, measured 2026-12-04), an RL step of 4 x 8 rollouts ~40 CPU-s (docs/results/smollm2/rl.md:
680 CPU-s for 8 steps and two small evaluations): an 8-step run ~11 CPU-min, a 16-step one ~16.
"""

import os
from typing import Any

import ml_collections

from configs import base, smollm2_cpu

PRESETS = ("study", "quick")

# Shared by every arm: at least 96 held-out problems disjoint from the 2000 training problems (data.num_eval: the
# generator draws them with seed + 1 and drops any training text), n = 32 samples each (pass@1..32), the harness's
# evaluation instead of the trainer's, and a checkpoint every 2 steps (LoRA adapters: small) so a stopped run loses
# little. Sampling stays smollm2_cpu's (T 0.7, min-p 0.1, 40 new tokens) for rollouts and evaluation alike.
STUDY: dict[str, Any] = {
    "data.num_eval": 96, "eval.problems": 96, "eval.n": 32, "eval.ks": (1, 2, 4, 8, 16, 32),
    "eval.at_start": False, "eval.at_end": False, "train.ckpt_every": 2, "train.sample_every": 0,
    "train.export_hf": False, "train.progress": False,
}
# `quick`: the smoke (smollm2_cpu:quick's 2 steps of 2 prompts x 4, plus a 4-problem, n = 4 evaluation)
QUICK: dict[str, Any] = {
    "data.num_eval": 4, "eval.problems": 4, "eval.n": 4, "eval.ks": (1, 2, 4),
    "experiment.entropy_prompts": 2, "experiment.entropy_group": 4, "experiment.eval_rows": 16,
}

# Each arm's difference from smollm2_cpu + STUDY (smollm2_cpu runs GRPO + Branch: k3 anchor, beta 0.05).
ARMS: dict[str, dict[str, Any]] = {
    # the pretrained model as it is: evaluated with every seed's sampling key, never trained
    "base": {"loss.guide": "none", "experiment.rl": False},
    # GRPO: no guide, the authors' k3 reverse-KL anchor to pi_ref, beta 0.05 (smollm2_cpu's, configs/base.py's)
    "grpo": {"loss.guide": "none"},
    # GRPO + Branch as the authors ran it: k3 anchor to q * pi_ref, q = 1 + gamma * relu(H - tau) clamped to
    # [0.6, 1.4], their ratio gamma 0.3; the threshold tau is the base's 0.8 token-entropy quantile on its own
    # samples (the countdown study's rule: their 1.2 nats assumes a 7B model's entropies), written as loss.tau
    "branch": {"loss.guide": "branch", "loss.gamma": 0.3, "loss.q_min": 0.6, "loss.q_max": 1.4,
               "experiment.tau_quantile": 0.8},
    # no anchor at all
    "nokl": {"loss.guide": "none", "loss.kl_estimator": "none", "loss.beta": 0.0},
    # the entropy peer: TRL's top_entropy_quantile 0.2 (the 80/20 rule: policy gradient on the 20% highest-entropy
    # tokens only). Not KL-Cov: it penalises |log pi - log pi_old|, which has no gradient with one update per batch
    "top_entropy": {"loss.guide": "none", "loss.top_entropy_quantile": 0.2},
}

# Seeds per arm (seed = sampling, guide noise, prompt order, LoRA init; the problems are fixed by
# experiment.data_seed). The base gets as many as any arm, so every run pairs with the base's evaluation drawn with
# the same sampling key.
SEEDS_PER_ARM = {"base": 5, "grpo": 5, "branch": 5, "nokl": 3, "top_entropy": 3}

# The shared regime, frozen from `smollm2_study --regime` (regime.json's "selected") before any guided arm runs, and
# never changed after a guide's results are seen. Frozen 2026-12-04 (docs/results/smollm2_study/regime.md): none of
# the 4 candidates met the rule; the closest, steps8_lr2e-4, is smollm2_cpu's own 8 steps at lr 2e-4, i.e. empty.
REGIME: dict[str, Any] = {}

# What the regime search tries on GRPO alone (at most 4), in the order it tries them (cheapest first): the settings
# and why. Each keeps the held-out set above (96 problems, n 32); steps x lr is the lever 6 CPU-hours allow.
REGIME_CANDIDATES: dict[str, tuple[dict[str, Any], str]] = {
    "steps8_lr2e-4": ({}, "smollm2_cpu's run: pass@1 0.159 -> 0.331, pass@16 0.667 -> 0.583 on 24 problems"),
    "steps8_lr5e-4": ({"optim.lr": 5e-4}, "the same steps, a faster drift from pi_ref"),
    "steps16_lr2e-4": ({"train.steps": 16}, "twice the steps: more time to sharpen"),
    "steps16_lr5e-4": ({"train.steps": 16, "optim.lr": 5e-4}, "longer and faster: the strongest sharpening tried"),
}


# ------------------------------------------------------------------------------------------ the study's settings
TITLE = "GRPO against SAGE-Branch on SmolLM2-135M-Instruct (CPU)"
DESCRIPTION = ("Held-out: 96 generated arithmetic word problems disjoint from the training problems, n = 32 samples "
               "each; pass@k by the unbiased estimator, averaged over problems. The base is the pretrained model "
               "evaluated with each seed's sampling key. *distinct correct forms*: distinct arithmetic written out "
               "among a problem's correct samples; *distinct answers*: distinct final numbers among all n samples.")
# each comparison: arm minus its reference, paired by seed; Branch - GRPO first (the study's question)
PAIRS = (("branch", "grpo"), ("grpo", "base"), ("branch", "base"), ("nokl", "grpo"), ("top_entropy", "grpo"))
PAIR_METRICS = (("heldout/pass@1", "pass@1"), ("heldout/pass@{k16}", "pass@{k16}"), ("heldout/pass@{n}", "pass@{n}"),
                ("heldout/distinct_forms", "distinct forms"))
PRIMARY = ("branch", "grpo", 16)  # the comparison the study is sized for: Branch - GRPO on pass@16
# the regime search (regime.py): GRPO's pass@1 up and pass@n down, both intervals excluding 0
REGIME_RULE = {"split": "heldout", "min_gain": 0.0, "fall": ("pass@n",), "fall_interval": True}


def seeds_for(arm: str, preset: str) -> int:
    return SEEDS_PER_ARM[arm]


def reference(preset: str) -> str:
    """The config each run's recorded settings are the differences from: smollm2_cpu (its quick preset)."""
    return os.path.join(os.path.dirname(__file__), "smollm2_cpu.py") + (":quick" if preset == "quick" else "")


def candidate(name: str, preset: str) -> dict[str, Any]:
    """A regime candidate's settings over the arms' config. They are relative to smollm2_cpu, so a frozen REGIME is
    undone first (a rerun after the freeze still finds the candidates' committed runs)."""
    cpu = smollm2_cpu.get_config("quick" if preset == "quick" else None)

    def value(key: str) -> Any:
        node = cpu
        for part in key.split("."):
            node = node[part]
        return node
    return {**{k: value(k) for k in REGIME}, **REGIME_CANDIDATES[name][0]}


def _set(c: ml_collections.ConfigDict, dotted: dict[str, Any]) -> None:
    base.set_fields(c, dotted, "smollm2_arms")


def parse_arg(arg: str | None) -> tuple[str, str]:
    return base.parse_arm(arg, ARMS, "preset", PRESETS, "study")


def ARGS() -> tuple[str, ...]:  # the name config.load_file looks for
    """Accepted config arguments: ARM and ARM,PRESET (any other is an error)."""
    return tuple(ARMS) + tuple(f"{a},{p}" for a in ARMS for p in PRESETS)


def get_config(arg=None):
    arm, preset = parse_arg(arg)
    c = smollm2_cpu.get_config("quick" if preset == "quick" else None)
    c.experiment = ml_collections.ConfigDict(dict(
        arm=arm, preset=preset,
        rl=True,                 # False: the base arm (evaluation only)
        data_seed=0,             # the problem sets (tasks.build's seed); config.seed keys only the run's randomness
        tau_quantile=0.0,        # > 0: Branch's tau = this quantile of the base's token entropies (loss.tau else)
        entropy_prompts=32, entropy_group=8,  # the base's entropy profile: held-out prompts x samples
        eval_rows=256,           # sampled rows per evaluation call (the trainer's 256 // n problems of n)
    ))
    _set(c, STUDY)
    if preset == "quick":
        _set(c, QUICK)  # a smoke of smollm2_cpu:quick's schedule: the regime's steps and lr stay out of it
    else:
        _set(c, REGIME)
    _set(c, ARMS[arm])
    return c
