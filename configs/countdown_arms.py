"""The CPU-scale SAGE comparison on countdown: one shared SFT base, then RL with each arm (sage_jax.experiments).

    S="python -m sage_jax.experiments.study --settings configs/countdown_arms.py"
    $S --preset quick --out DIR                               # ~15 min on 2 free CPU cores
    $S --preset study --regime --out docs/results/study_countdown --results RUNS/study   # the regime (GRPO)
    $S --preset study --sweep --out docs/results/study_countdown --results RUNS/study    # round 2 (SEEDS_PER_ARM)
    python -m sage_jax.train --config configs/countdown_arms.py:grpo_branch,quick --workdir /tmp/one_arm

RUNS: docs/results/study_countdown/runs.tar.xz unpacked (the study's result files). The old commands
(`sage_jax.experiments.reproduce --budget B --records RUNS`, `sage_jax.experiments.regime`) are aliases of these.

arg: "ARM" or "ARM,BUDGET" with ARM one of ARMS (default grpo) and BUDGET tiny | quick | full | study (default full).
Every arm shares everything below except its entry in ARMS. The base model is an SFT warm-start whose
demonstrations spread unevenly over valid strategies (mul 0.7, add 0.2, sub 0.07, div 0.03: a dominant mode and
rarer valid ones), so RL can either sharpen onto the dominant mode or keep the rare ones.
Run alone with sage_jax.train, a config does its own SFT first; the study trains the base once and shares it.
This file is also the study's settings (sage_jax/experiments/study.py): the names in capitals below.
"""

from typing import Any

import ml_collections

from configs import base

# DAPO's clip-higher, token-mean and dynamic sampling (no overlong shaping: completions are 24 tokens at most)
DAPO = {"loss.eps_high": 0.28, "loss.aggregation": "token-mean", "train.dynamic_sampling": True}
BRANCH = {"loss.guide": "branch"}
# TRL's loss_type="bnpo" (token-mean over the batch), as the authors ran it; not the BNPO paper's Beta-normalised
# advantages
BNPO = {"loss.aggregation": "token-mean"}
# the exact reverse KL over whole completions: k1 as a reward penalty (README "Which KL estimator")
RKL = {"loss.kl_estimator": "k1", "loss.kl_in_reward": True}

# Each arm's difference from GRPO (k3 reverse-KL anchor to pi_ref, no guide, seq-mean-token-mean).
ARMS: dict[str, dict[str, Any]] = {
    "base": {"experiment.rl": False},  # the shared SFT model, evaluated (never trained by RL)
    "grpo": {},
    "grpo_nokl": {"loss.kl_estimator": "none", "loss.beta": 0.0},
    "fkl": {"loss.kl_estimator": "forward-seq"},
    "grpo_random": {"loss.guide": "random"},
    "grpo_token": {"loss.guide": "token"},
    "grpo_rkl": RKL,
    # Branch as the authors ran it (k3, log q on the reference) and in the paper's form: k1 in the reward, whose
    # stationary policy over completions is q * pi_ref * exp(r / beta) (tests/rl/test_objectives.py)
    "grpo_branch": BRANCH,
    "grpo_branch_paper": RKL | BRANCH,
    # the nearest peers (objectives.py): an entropy bonus; TRL's top_entropy_quantile 0.2 (the policy gradient on
    # the top 20% entropy tokens); verl's kl_cov (its 7B recipe's ratio is 0.002; a countdown batch has ~1.3k
    # tokens, so 0.01 penalises ~13 of them). KL-Cov penalises |log pi - log pi_old| and so acts only when a batch
    # is used for more than one update (optim.mini_batches or optim.num_iterations > 1).
    "grpo_entropy": {"loss.entropy_coef": 0.01},
    "grpo_top_entropy": {"loss.top_entropy_quantile": 0.2},
    "grpo_kl_cov": {"loss.kl_cov_ratio": 0.01, "loss.kl_cov_coef": 1.0},
    "dapo": DAPO,
    "dapo_branch": DAPO | BRANCH,
    "bnpo": BNPO,
    "bnpo_branch": BNPO | BRANCH,
}

# What a budget changes: SFT/RL steps, eval sizes, seeds. Times are for 2 otherwise idle CPU cores.
BUDGETS: dict[str, dict[str, Any]] = {
    # the test suite's: seconds per arm, numbers meaningless
    "tiny": {"model.hidden_size": 32, "model.num_layers": 1, "model.intermediate_size": 64,
             "data.num_train": 64, "data.num_eval": 4, "experiment.sft_problems": 32, "sft.steps": 4,
             "sft.batch_size": 16, "sft.num_demos": 64, "sft.warmup_steps": 1, "rollout.prompts_per_step": 2,
             "rollout.group_size": 4, "rollout.max_new_tokens": 16,
             "train.steps": 2, "train.max_resample": 1, "eval.n": 8,
             "eval.problems": 2, "eval.max_new_tokens": 16, "experiment.seeds": 1, "experiment.ood_problems": 2,
             "experiment.rows_per_call": 16, "experiment.sweep_gammas": (0.3, 1.0), "experiment.sweep_taus": (0.3,),
             # the study's machinery in seconds: tau from the base's entropies, the cross on the paper-form Branch
             "experiment.tau_quantile": 0.8, "experiment.sweep_arm": "grpo_branch_paper",
             "experiment.sweep_design": "cross", "experiment.sweep_tau_quantiles": (0.5,),
             "experiment.rl_eval_problems": 2, "experiment.primary_split": "countdown_rl"},
    # ~15 minutes: a shorter SFT and RL, 1 seed, 64 samples on 48 + 24 problems
    "quick": {"sft.steps": 500, "train.steps": 32, "eval.n": 64, "eval.problems": 48,
              "experiment.ood_problems": 24, "experiment.seeds": 1},
    "full": {},
    # round 2 (issue 20): the arms of SEEDS_PER_ARM, a smaller evaluation at n = 256, tau from the base's own
    # token entropies (experiment.tau_quantile), the gamma / tau cross on the paper-form Branch; then REGIME.
    # Also evaluated: 64 of the RL prompts (countdown_rl), where the regime is judged: GRPO raised train reward
    # 0.29 -> 0.49 in 200 steps while held-out pass@1 stayed at the base's (docs/results/study_countdown/RESULTS.md,
    # regime search)
    "study": {"eval.problems": 64, "experiment.ood_problems": 32, "experiment.seeds": 10,
              "experiment.rl_eval_problems": 64, "experiment.primary_split": "countdown_rl",
              "experiment.tau_quantile": 0.8, "experiment.sweep_arm": "grpo_branch_paper",
              "experiment.sweep_design": "cross", "experiment.sweep_seeds": 5,
              "experiment.sweep_tau_quantiles": (0.7, 0.8, 0.9)},
}

# Seeds per arm in the study: 10 for the main Branch arms and their GRPO baselines (same estimator, no guide), 5 else
# (the base: the SFT model, evaluated once)
SEEDS_PER_ARM = {"base": 1, "grpo": 10, "grpo_branch": 10, "grpo_rkl": 10, "grpo_branch_paper": 10, "grpo_nokl": 5,
                 "fkl": 5, "grpo_token": 5, "grpo_random": 5, "grpo_entropy": 5, "grpo_top_entropy": 5,
                 "grpo_kl_cov": 5}

# The study's shared regime, frozen from the regime search (`study.py --regime`; regime.json's selected) before any arm
# runs, and never changed after a guide's results are seen. Frozen on 2026-12-01 to the selected candidate "round1"
# (no overrides: the study budget as above), the cheapest one GRPO sharpens in on the RL prompts
# (docs/results/study_countdown/regime.md, regime.json's "selected").
REGIME: dict[str, Any] = {}

# What the regime search tries, GRPO only: the shared settings and why each is a candidate.
REGIME_CANDIDATES: dict[str, tuple[dict[str, Any], str]] = {
    "round1": ({}, "round 1's regime: GRPO moved pass@1 0.351 -> 0.360 only"),
    "steps120_lr5e-4": ({"train.steps": 120, "optim.lr": 5e-4},
                        "faster RL in fewer steps: if kept, the study costs 60% of a 200-step regime"),
    "steps120_lr1e-3": ({"train.steps": 120, "optim.lr": 1e-3}, "faster still (lr 5x round 1's)"),
    "steps200": ({"train.steps": 200}, "longer RL: more time to sharpen"),
    "steps200_lr5e-4": ({"train.steps": 200, "optim.lr": 5e-4}, "longer and faster RL"),
    "steps200_beta0.02": ({"train.steps": 200, "loss.beta": 0.02}, "a looser anchor lets GRPO drift further"),
    "steps200_skew": ({"train.steps": 200, "sft.mode_weights.mul": 0.85, "sft.mode_weights.add": 0.1,
                       "sft.mode_weights.sub": 0.035, "sft.mode_weights.div": 0.015},
                      "a more skewed base: a clearer dominant mode to collapse onto"),
    "steps150_prompts32": ({"train.steps": 150, "rollout.prompts_per_step": 32}, "more prompts per step"),
    "steps200_mb2": ({"train.steps": 200, "optim.mini_batches": 2},
                     "two updates per batch (the clip and KL-Cov act; verl's default uses several)"),
}


def seeds_for(arm: str, budget: str) -> int:
    """Seeds an arm gets: the base 1 (one SFT model, evaluated once); SEEDS_PER_ARM's under the study budget (capped
    by experiment.seeds), else the budget's experiment.seeds."""
    default = BUDGETS[budget].get("experiment.seeds", 3)
    return 1 if arm == "base" else min(default, SEEDS_PER_ARM.get(arm, default)) if budget == "study" else default


# ------------------------------------------------------------------------------------------ the study's settings
TITLE = "SAGE on countdown (CPU scale)"
DESCRIPTION = ("RL from one shared SFT base on countdown (reach a target with + - * / using each given number once). "
               "The base's SFT demonstrations spread unevenly over valid strategies (mul 0.7, add 0.2, sub 0.07, div "
               "0.03), so RL can sharpen onto the dominant mode or keep the rare ones. Every arm starts from the same "
               "base with the same seeds and differs from GRPO only in its row of ARMS (configs/countdown_arms.py). "
               "ID: held-out problems from the training generator; OOD: numbers beyond the training range; RL-prompt: "
               "the RL prompts themselves. pass@k: the unbiased estimator from n samples per problem.")
BASE_MODEL = "sft"  # the base: trained once by SFT on the first experiment.sft_problems problems
SPLITS = {"countdown": ("countdown", "eval.problems", "ID"),
          "countdown_rl": ("countdown_rl", "experiment.rl_eval_problems", "RL-prompt"),
          "countdown_ood": ("countdown_ood", "experiment.ood_problems", "OOD")}
TAIL = 0.1  # "(end)": the mean over the last 10% of RL steps
# each arm against its baseline: the paper-form Branch against GRPO with the same (k1-in-reward) anchor
PAIRS = (("grpo_branch", "grpo"), ("grpo_branch_paper", "grpo_rkl"), ("grpo_rkl", "grpo"), ("grpo_token", "grpo"),
         ("grpo_random", "grpo"), ("fkl", "grpo"), ("grpo_nokl", "grpo"), ("grpo_entropy", "grpo"),
         ("grpo_top_entropy", "grpo"), ("grpo_kl_cov", "grpo"), ("dapo_branch", "dapo"), ("bnpo_branch", "bnpo"))
PAIR_METRICS = (("countdown/pass@1", "ID pass@1"), ("countdown/pass@{n}", "ID pass@{n}"),
                ("countdown_ood/pass@1", "OOD pass@1"), ("countdown_ood/pass@{n}", "OOD pass@{n}"),
                ("countdown/distinct", "ID distinct"), ("countdown_rl/pass@1", "RL-prompt pass@1"),
                ("countdown_rl/pass@{n}", "RL-prompt pass@{n}"), ("countdown_rl/distinct", "RL-prompt distinct"))
PRIMARY = ("grpo_branch", "grpo", 1)
# the regime search (regime.py): GRPO's pass@1 on the RL prompts up by 0.05 with an interval above 0, and distinct
# solutions or pass@n down
REGIME_RULE = {"split": "countdown_rl", "min_gain": 0.05, "fall": ("distinct", "pass@n"), "fall_interval": False}
# what a run's fingerprint leaves out (the SFT settings count: every run starts from the SFT base)
IGNORED = ("model.path", "tokenizer_path", "mesh.", "rollout.slots", "eval.at_start", "eval.at_end",
           "train.allow_config_change", "train.ckpt_every", "train.eval_every", "train.export_hf", "train.keep_ckpts",
           "train.progress", "train.reward_memory_mb", "train.reward_timeout", "train.reward_workers",
           "train.sample_every", "train.use_tensorboard", "train.use_wandb", "train.logprob_rows", "experiment.arm",
           "experiment.budget", "experiment.seeds", "experiment.sweep_", "experiment.primary_split",
           "experiment.tau_quantile", "experiment.entropy_")
BASE_KEYS = ("model.", "data.", "sft.", "eval.", "seed", "experiment.sft_problems", "experiment.ood_problems",
             "experiment.rl_eval_problems", "experiment.rows_per_call")
ENTROPY_KEYS = ("model.", "data.", "sft.", "rollout.", "experiment.sft_problems", "experiment.entropy_")


def reference(budget: str) -> str:
    """The config each run's recorded settings are the differences from."""
    return f"{__file__}:grpo,{budget}"


def candidate(name: str, budget: str) -> dict[str, Any]:
    """A regime candidate's settings (under `tiny`, only those tiny leaves alone: the smoke keeps its sizes)."""
    settings = REGIME_CANDIDATES[name][0]
    return {k: v for k, v in settings.items() if budget != "tiny" or k not in BUDGETS["tiny"]}


def _set(c: ml_collections.ConfigDict, dotted: dict[str, Any]) -> None:
    base.set_fields(c, dotted, "countdown_arms")


def parse_arg(arg: str | None) -> tuple[str, str]:
    return base.parse_arm(arg, ARMS, "budget", BUDGETS, "full")


def get_config(arg=None):
    arm, budget = parse_arg(arg)
    c = base.get_config()
    c.seed = 0
    c.model.update(preset="tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384,
                   compute_dtype="float32", ref_dtype="float32", logits_chunk=64)
    # 1800 training problems: the first experiment.sft_problems for SFT demonstrations, the rest RL prompts (unseen
    # by the base, so RL has to generalise rather than replay memorised answers)
    c.data.update(task="countdown", num_train=1800, num_eval=200, max_number=20, max_prompt_len=32, eval="",
                  ood_num_numbers=3, ood_max_number=30)
    c.rollout.update(prompts_per_step=16, group_size=8, max_new_tokens=24, temperature=1.0, min_p=0.0)
    # beta 0.1 and lr 2e-4 (paper: 0.05, 5e-6): in a few dozen steps the policy must move far enough from pi_ref for
    # the anchor, and so its shape, to matter (at 5e-5 the KL stayed ~0.01 and every arm ran the same course).
    # tau 0.6: the base's token entropies have q90 ~0.7 and q99 ~1.15 nats, so the paper's 1.2 would almost never fire.
    c.loss.update(guide="none", kl_estimator="k3", beta=0.1, gamma=0.3, tau=0.6)
    c.optim.update(lr=2e-4, warmup_steps=5, weight_decay=0.0)
    # packing off: completions are 24 tokens at most, so packed rows save few positions, and each step's packed row
    # count differs, which costs a compile per new count in these short runs (the loss is the same either way)
    c.train.update(steps=80, ckpt_every=1000, keep_ckpts=1, eval_every=0, sample_every=0, reward="countdown",
                   reward_workers=0, export_hf=False, use_tensorboard=False, progress=False, packing=False)
    # the experiment evaluates with its own sampler loop (sage_jax.experiments), not the trainer's
    c.eval.update(n=256, ks=(1, 4, 16, 64, 256), problems=96, max_new_tokens=24, temperature=1.0, min_p=0.0,
                  at_start=False, at_end=False)
    c.sft.update(steps=800, lr=2e-3, warmup_steps=30, batch_size=64, data="countdown", num_demos=4000)
    c.sft.mode_weights.update(mul=0.7, add=0.2, sub=0.07, div=0.03)
    c.experiment = ml_collections.ConfigDict(dict(
        budget=budget, arm=arm, seeds=3, sft_problems=1000, ood_problems=64, rows_per_call=4096,
        # tau_quantile > 0: Branch's tau = that quantile of the SFT base's token entropies on its own samples
        # (0.8: ~20% of completion tokens above tau, the share forking tokens have in large models)
        tau_quantile=0.0, sweep_arm="grpo_branch", sweep_design="grid", sweep_gammas=(0.1, 0.3, 1.0),
        sweep_taus=(0.3, 0.6, 1.2), sweep_tau_quantiles=(), sweep_seeds=1,
        # rl_eval_problems > 0: also evaluate the first that many RL prompts (split countdown_rl, trained on);
        # primary_split: the split the regime search judges GRPO's sharpening on
        rl_eval_problems=0, primary_split="countdown",
        rl=True,  # False: the base arm (the SFT model evaluated)
        entropy_prompts=32, entropy_group=8))  # the base's entropy profile: held-out prompts x samples
    _set(c, BUDGETS[budget])
    if budget == "study":
        _set(c, REGIME)
    _set(c, ARMS[arm])
    c.train.ckpt_every = c.train.steps  # one checkpoint, at the end: what a resumed experiment reloads
    c.eval.ks = tuple(k for k in c.eval.ks if k <= c.eval.n) or (1,)  # budgets with a smaller eval.n
    return c
