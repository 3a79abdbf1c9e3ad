"""GRPO + Branch on Qwen2.5-Math-7B: the paper's main result.

    python -m sage_jax.train --config configs/qwen7b_branch.py --workdir gs://BUCKET/qwen7b_branch \
        --config.model.path=/path/to/Qwen2.5-Math-7B

Hardware: TPU v5p-64 (or 32 x H100/H200), ~1000 steps. Guide q = 1 + 0.3 * relu(H_t - 1.2), clamped to [0.6, 1.4].
Should produce (paper, avg of AIME24/25, AMC23, MATH-500): pass@1 0.284 and pass@256 0.729, vs GRPO 0.266 / 0.714.
"""

from configs import paper

ARGS = ("async",)  # configs/qwen7b_branch.py:async = one step off-policy on the predicted best placement; any other
# argument is an error


def get_config(arg=None):
    c = paper.get_config()
    c.loss.guide = "branch"  # gamma 0.3, tau 1.2, q in [0.6, 1.4]: the defaults
    # Placement: on-policy and colocated (train.off_policy_steps 0, mesh.rollout_devices 0, from configs/base.py):
    # the paper's algorithm. `:async` trains one step off-policy (k = 1) on the placement phase_model PREDICTS best
    # for v5p:4x4x2 with long-tailed lengths and the sampler's shrink stages (`python -m sage_jax.plan.placements
    # --config configs/qwen7b_branch.py --chip v5p --chips 32`): split, the sampler on n = 8 chips (1 per host of 8,
    # as (data 2, tensor 4)) and training on the other 24 as (1, 6, 4): 1.14x the on-policy colocated tokens/s, against
    # 1.00x for k = 1 colocated and 0.76x / 0.38x for n = 16 / 24. A prediction, not a measurement (no TPU was used;
    # the weight copy's 100 GB/s per chip is an assumption): docs/PERFORMANCE.md "Off-policy steps".
    if arg == "async":
        c.train.off_policy_steps = 1
        c.mesh.rollout_devices = 8
    return c
