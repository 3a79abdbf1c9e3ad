"""GRPO + Branch on Qwen2.5-Math-7B: the paper's main result.

    python -m sage_jax.train --config configs/qwen7b_branch.py --workdir gs://BUCKET/qwen7b_branch \
        --config.model.path=/path/to/Qwen2.5-Math-7B

Hardware: TPU v5p-64 (or 32 x H100/H200), ~1000 steps. Guide q = 1 + 0.3 * relu(H_t - 1.2), clamped to [0.6, 1.4].
Should produce (paper, avg of AIME24/25, AMC23, MATH-500): pass@1 0.284 and pass@256 0.729, vs GRPO 0.266 / 0.714.
"""

from configs import paper

ARGS = ()  # accepted config arguments (configs/NAME.py:ARG): none, so any is an error


def get_config(arg=None):
    c = paper.get_config(arg)
    c.loss.guide = "branch"  # gamma 0.3, tau 1.2, q in [0.6, 1.4]: the defaults
    # Placement: on-policy and colocated (train.off_policy_steps 0, mesh.rollout_devices 0, from configs/base.py).
    # phase_model's PREDICTION for v5p:4x4x2 with long-tailed lengths (`python -m sage_jax.plan_placements --config
    # configs/qwen7b_branch.py --chip v5p --chips 32`) puts the best k = 1 placement, split with n = 16 rollout
    # chips, at 1.15x the on-policy tokens/s: below the 1.25x that would make it the default. With issue 26's decode
    # shrink stages (`--decode-stages`) it predicts 1.37x for split n = 8, i.e. `train.off_policy_steps = 1` and
    # `mesh.rollout_devices = 8` here once those stages land (docs/PERFORMANCE.md "Off-policy steps").
    return c
