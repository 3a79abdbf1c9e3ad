"""The tool study on a CPU (issue 49): does RL with a Python tool learn a task a small model cannot do in its head?

    S="python -m sage_jax.experiments.study --settings configs/tools_arms.py"
    $S --out docs/results/tools_study --work /tmp/tools_study           # the study (~1 h on 2 free cores)
    $S --preset tiny --out /tmp/tools_smoke                             # the harness in a minute (numbers meaningless)
    python -m sage_jax.train --config configs/tools_arms.py:tool --workdir /tmp/tool_arm   # one arm alone

Task: two-digit products ("37*48=", generated: data.train=products), scored on the reply's last number. Model: the
1M-parameter Qwen2-style model of the CPU demo, trained from scratch with the character tokenizer that has whole
``` fences (tokenizer_path=chars). The base: one SFT warm start on the first experiment.sft_problems products, where
sft.tool_share of the demonstrations write a ```python block that prints the product, read the ```output block the
tool loop inserts, and copy the answer, and the rest give the answer directly. So both arms start from a model that
calls the tool on some rows and guesses on the others.

Arms (everything else shared, seeds paired): `tool` runs RL with the Python tool (rows pause at the closing fence,
the sandbox runs the block, its output comes back as observed tokens, never trained); `no_tool` runs the same RL with
no tool (a block the model writes gets no output: the model goes on writing on its own). Equal sample budgets: the
same prompts, group size and steps. Each arm is evaluated as it trained (with / without the tool), and the base both
ways (`base_tool`, `base`). This file is also the study's settings (sage_jax/experiments/study.py).
"""

from typing import Any

import ml_collections

from configs import base

PRESETS = ("study", "tiny")

ARMS: dict[str, dict[str, Any]] = {
    "base": {"experiment.rl": False, "rollout.tools": ()},  # the SFT base, evaluated without the tool
    "base_tool": {"experiment.rl": False},  # the SFT base, evaluated with the tool
    "no_tool": {"rollout.tools": ()},  # RL with no tool
    "tool": {},  # RL with the Python tool
}
BASELINE_ARM = "no_tool"  # the arm a regime would be chosen on (sage_jax.experiments.study)
SEEDS_PER_ARM = {"base": 5, "base_tool": 5, "no_tool": 5, "tool": 5}

# The regime: the settings in get_config, written down on 2026-12-06 before any full-length run of either arm and
# not changed after (the CPU demo's model, optimiser and sampling; 40 steps of 32 prompts x 8; beta 0.04; one SFT
# base of 600 steps on 1000 products, 30% of them tool traces). The only runs before were the tiny preset's smoke and
# a 6-step run of the tool arm that checked the plumbing (its train reward 0.21 -> 0.38). No search: one candidate.
REGIME: dict[str, Any] = {}
REGIME_CANDIDATES: dict[str, tuple[dict[str, Any], str]] = {"study": ({}, "the settings below")}
REGIME_RULE = {"split": "heldout", "min_gain": 0.0, "fall": (), "fall_interval": False}

TINY: dict[str, Any] = {
    "model.hidden_size": 32, "model.num_layers": 1, "model.intermediate_size": 64, "data.num_train": 48,
    "data.num_eval": 4, "experiment.sft_problems": 32, "sft.steps": 4, "sft.batch_size": 16, "sft.warmup_steps": 1,
    "rollout.prompts_per_step": 2, "rollout.group_size": 4, "train.steps": 2, "eval.n": 4, "eval.ks": (1, 4),
    "eval.problems": 4, "experiment.eval_rows": 16, "experiment.entropy_prompts": 2, "experiment.entropy_group": 4,
}

TITLE = "RL with a Python tool against RL without, on two-digit products (CPU)"
DESCRIPTION = ("Held-out: generated two-digit products disjoint from the training ones, n samples each, scored on the "
               "reply's last number (the model's own tokens only, never the tool's output). Every run starts from "
               "one SFT base (a share of its demonstrations call the tool); `tool` and `no_tool` differ only in "
               "rollout.tools, with equal prompts, group size and steps; each is evaluated as it trained. "
               "`base` / `base_tool`: the SFT base evaluated without / with the tool.")
BASE_MODEL = "sft"
SPLITS = {"heldout": ("products", "eval.problems", "held-out")}
PAIRS = (("tool", "no_tool"), ("tool", "base_tool"), ("no_tool", "base"), ("base_tool", "base"))
PAIR_METRICS = (("heldout/pass@1", "pass@1"), ("heldout/pass@{n}", "pass@{n}"))
PRIMARY = ("tool", "no_tool", 1)
IGNORED = ("model.path", "mesh.", "rollout.slots", "rollout.tool_workers", "eval.at_start", "eval.at_end",
           "train.allow_config_change", "train.ckpt_every", "train.eval_every", "train.export_hf", "train.keep_ckpts",
           "train.progress", "train.reward_memory_mb", "train.reward_timeout", "train.reward_workers",
           "train.sample_every", "train.use_tensorboard", "train.use_wandb", "train.logprob_rows", "experiment.arm",
           "experiment.preset", "experiment.entropy_")
# what the SFT base is made from (one base for every arm) and what a base arm's evaluation-only fingerprint reads
SFT_KEYS = ("model.", "data.", "sft.", "seed", "tokenizer_path", "rollout.max_new_tokens", "experiment.sft_problems")
BASE_KEYS = ("model.", "data.", "sft.", "eval.", "seed", "tokenizer_path", "rollout.tools", "rollout.tool_",
             "rollout.max_t", "experiment.sft_problems", "experiment.eval_rows")


def seeds_for(arm: str, preset: str) -> int:
    return 1 if preset == "tiny" else SEEDS_PER_ARM[arm]


def reference(preset: str) -> str:
    """The config each run's recorded settings are the differences from: the tool arm."""
    return f"{__file__}:tool,{preset}"


def candidate(name: str, preset: str) -> dict[str, Any]:
    return REGIME_CANDIDATES[name][0]


def _set(c: ml_collections.ConfigDict, dotted: dict[str, Any]) -> None:
    base.set_fields(c, dotted, "tools_arms")


def parse_arg(arg: str | None) -> tuple[str, str]:
    return base.parse_arm(arg or "tool", ARMS, "preset", PRESETS, "study")


def ARGS() -> tuple[str, ...]:  # the name config.load_file looks for
    """Accepted config arguments: ARM and ARM,PRESET (any other is an error)."""
    return tuple(ARMS) + tuple(f"{a},{p}" for a in ARMS for p in PRESETS)


def get_config(arg=None):
    arm, preset = parse_arg(arg)
    c = base.get_config()
    c.seed = 0
    c.tokenizer_path = "chars"
    c.model.update(preset="tiny", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512,
                   compute_dtype="float32", ref_dtype="float32", logits_chunk=64)
    c.mesh.shape = (1, -1, 1)
    c.data.update(task="math", train="products", eval="products", template="plain", num_train=2000, num_eval=200,
                  max_prompt_len=16, answer_extraction="last_number")
    c.rollout.update(prompts_per_step=32, group_size=8, max_new_tokens=48, temperature=1.0, min_p=0.0,
                     tools=("python",), tool_format="markdown", max_turns=2, tool_timeout=5.0, max_tool_tokens=16,
                     tool_workers=4)
    c.loss.update(guide="none", kl_estimator="k3", beta=0.04)
    c.optim.update(lr=2e-4, warmup_steps=5, weight_decay=0.0)
    c.train.update(steps=40, ckpt_every=10, keep_ckpts=1, eval_every=0, sample_every=0, reward="math",
                   reward_workers=0, export_hf=False, use_tensorboard=False, progress=False, packing=False)
    c.eval.update(n=16, ks=(1, 4, 16), problems=100, max_new_tokens=48, temperature=1.0, min_p=0.0,
                  at_start=False, at_end=False)
    c.sft.update(steps=600, lr=3e-3, warmup_steps=30, batch_size=64, data="tool_traces", tool_share=0.3)
    c.experiment = ml_collections.ConfigDict(dict(
        arm=arm, preset=preset, rl=True, data_seed=0, sft_problems=1000, tau_quantile=0.0,
        entropy_prompts=32, entropy_group=8, eval_rows=256))
    if preset == "tiny":
        _set(c, TINY)
    else:
        _set(c, REGIME)
    _set(c, ARMS[arm])
    return c
